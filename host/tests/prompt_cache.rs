//! `les run --prompt-cache`: a run that restores its prompt's first tokens
//! from the file gives, bit for bit, the tokens and logits of one that
//! evaluates them, whatever the file held (the same prompt, a shorter one, a
//! different one, another model's, a damaged one), for qwen3moe and for
//! qwen35moe's recurrent state; a file that is not a prompt cache is never
//! overwritten.

mod cli;

use std::path::{Path, PathBuf};
use std::process::Output;

use cli::{json_ok, les, npy, synth_once, tmp, tokens};
use serde_json::Value;

fn model(arch: &str, seed: &str) -> PathBuf {
    synth_once(
        &format!("pcache_{arch}_{seed}.gguf"),
        &[
            "--arch", arch, "--preset", "tiny", "--seed", seed, "--quiet",
        ],
    )
}

fn run(model: &Path, prompt: &str, extra: &[&str]) -> Output {
    les()
        .args(["run", "-m"])
        .arg(model)
        .args(["-p", prompt, "-n", "12", "--json"])
        .args(extra)
        .output()
        .unwrap()
}

/// A run's JSON, its logits' bytes and its stderr.
fn generate(model: &Path, prompt: &str, extra: &[&str]) -> (Value, Vec<u8>, String) {
    // One file a call: the tests run in parallel.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let logits = tmp(&format!("pcache_logits_{call}.npy"));
    let out = run(
        model,
        prompt,
        &[extra, &["--logits-out", logits.to_str().unwrap()]].concat(),
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = json_ok(out, "les run");
    (v, npy(&logits).2, err)
}

const FOX: &str = "The quick brown fox jumps over the lazy dog";

#[test]
fn restored_prompts_give_evaluated_prompts_logits() {
    for arch in ["qwen3moe", "qwen35moe"] {
        let m = model(arch, "3");
        let cache = tmp(&format!("pcache_{arch}.bin"));
        let _ = std::fs::remove_file(&cache);
        let c = cache.to_str().unwrap();
        let restored = |v: &Value| v["stats"]["prompt_cache_restored"].as_u64().unwrap() as usize;
        let n_prompt = |v: &Value| v["prompt_tokens"].as_array().unwrap().len();
        for (prompt, extra) in [
            (FOX, &["--temp", "0"][..]),
            (FOX, &["--temp", "0.8", "--seed", "9"]),
            (FOX, &["--temp", "0", "--schedule", "les", "--slots", "3"]),
        ] {
            let (want, want_logits, _) = generate(&m, prompt, extra);
            let first = !cache.exists();
            let args = [extra, &["--prompt-cache", c]].concat();
            let (got, logits, err) = generate(&m, prompt, &args);
            assert_eq!(tokens(&got), tokens(&want), "{arch} {extra:?}");
            assert!(logits == want_logits, "{arch} {extra:?}: logits differ");
            let n = n_prompt(&want);
            // All but the last prompt token come from the file once it exists.
            assert_eq!(
                restored(&got),
                if first { 0 } else { n - 1 },
                "{arch}: {err}"
            );
            assert_eq!(err.contains("the state saved"), first, "{err}");
        }
        let held = std::fs::read(&cache).unwrap();

        // A longer prompt: the cached tokens start it.
        let longer = format!("{FOX} and then runs away");
        let (want, want_logits, _) = generate(&m, &longer, &["--temp", "0"]);
        let (got, logits, err) = generate(
            &m,
            &longer,
            &["--temp", "0", "--prompt-cache", c, "--prompt-cache-ro"],
        );
        assert_eq!(tokens(&got), tokens(&want), "{arch}");
        assert!(
            logits == want_logits,
            "{arch}: logits differ after a longer prompt"
        );
        let ids = |v: &Value| v["prompt_tokens"].as_array().unwrap().clone();
        let fox = ids(&generate(&m, FOX, &["--temp", "0"]).0);
        assert_eq!(ids(&got)[..fox.len() - 1], fox[..fox.len() - 1]);
        assert_eq!(restored(&got), fox.len() - 1, "{arch}: {err}");
        assert_eq!(std::fs::read(&cache).unwrap(), held, "--prompt-cache-ro");

        // A prompt sharing only its first words: attention restores them, a
        // recurrent state nothing (it cannot be cut back); rewritten either way.
        let other = "The quick brown cat sleeps";
        let (want, want_logits, _) = generate(&m, other, &["--temp", "0"]);
        let (got, logits, err) = generate(&m, other, &["--temp", "0", "--prompt-cache", c]);
        assert_eq!(tokens(&got), tokens(&want), "{arch}");
        assert!(
            logits == want_logits,
            "{arch}: logits differ after another prompt"
        );
        if arch == "qwen35moe" {
            assert_eq!(restored(&got), 0, "{err}");
            assert!(err.contains("cannot be cut back"), "{err}");
        } else {
            assert!(
                restored(&got) > 5 && restored(&got) < n_prompt(&got) - 1,
                "{err}"
            );
        }
        assert_ne!(std::fs::read(&cache).unwrap(), held, "rewritten");
        let (again, _, _) = generate(&m, other, &["--temp", "0", "--prompt-cache", c]);
        assert_eq!(restored(&again), n_prompt(&again) - 1);
    }
}

#[test]
fn caches_of_another_model_or_kv_type_or_damaged_are_not_used() {
    let m = model("qwen3moe", "3");
    let other = model("qwen3moe", "4");
    let cache = tmp("pcache_stale.bin");
    let c = cache.to_str().unwrap();
    let _ = std::fs::remove_file(&cache);
    let (want, want_logits, _) = generate(&m, FOX, &["--temp", "0"]);
    let check = |extra: &[&str], note: &str| {
        let (got, logits, err) = generate(
            &m,
            FOX,
            &[&["--temp", "0", "--prompt-cache", c][..], extra].concat(),
        );
        assert_eq!(tokens(&got), tokens(&want));
        if extra.is_empty() {
            assert!(logits == want_logits, "{note}");
        }
        assert_eq!(got["stats"]["prompt_cache_restored"], 0, "{err}");
        assert!(
            err.contains(note) && err.contains("not used"),
            "{note}: {err}"
        );
    };
    // Another model's.
    let (_, _, err) = generate(&other, FOX, &["--temp", "0", "--prompt-cache", c]);
    assert!(err.contains("the state saved"), "{err}");
    check(&[], "another model");
    // Another KV cache type's (the file is now this model's, f16).
    check(&["--cache-type-k", "f32"], "another KV cache type");
    // Damaged: cut short (the file is now this model's, f32 keys).
    check(&[], "another KV cache type");
    let bytes = std::fs::read(&cache).unwrap();
    std::fs::write(&cache, &bytes[..bytes.len() - 3]).unwrap();
    check(&[], "does not match");
}

#[test]
fn other_files_and_options_are_refused() {
    let m = model("qwen3moe", "3");
    // A file that is not a prompt cache (here the model itself) is an error
    // and stays as it was.
    let copy = tmp("pcache_not_a_cache.gguf");
    std::fs::copy(&m, &copy).unwrap();
    let before = std::fs::read(&copy).unwrap();
    let out = run(&m, FOX, &["--prompt-cache", copy.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a prompt cache"), "{err}");
    assert_eq!(std::fs::read(&copy).unwrap(), before);
    // With multi-token prediction, images, or read-only without a file.
    let q35 = model("qwen35moe", "3");
    let out = run(
        &q35,
        FOX,
        &["--prompt-cache", "/tmp/x.bin", "--speculate", "mtp"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("multi-token-prediction"),
        "{err}"
    );
    for extra in [
        &["--prompt-cache", "x", "--mmproj", "m", "--image", "i.png"][..],
        &["--prompt-cache-ro"],
    ] {
        assert_eq!(run(&m, FOX, extra).status.code(), Some(2), "{extra:?}");
    }
}

/// gpt-oss's sliding-window layers kept in rings (the default) save only
/// their last window: such a cache restores a prompt that starts with all
/// of its tokens, not one that parts from them earlier (it says why); one
/// saved with `--swa-full` restores any common start, into rings or not.
/// The logits are always those of evaluating the prompt.
#[test]
fn sliding_window_caches_restore_what_they_hold() {
    let m = model("gpt-oss", "3");
    let cache = tmp("pcache_gpt_oss.bin");
    let c = cache.to_str().unwrap();
    let _ = std::fs::remove_file(&cache);
    let long = format!("{FOX}, and the dog, who was not lazy at all, ran after the fox");
    let other = format!("{FOX}, and the cat, who was lazy, slept on");
    let restored = |v: &Value| v["stats"]["prompt_cache_restored"].as_u64().unwrap() as usize;
    let n_prompt = |v: &Value| v["prompt_tokens"].as_array().unwrap().len();
    let rings = ["--temp", "0", "--batch-size", "4", "--ctx", "160"];
    let check = |prompt: &str, extra: &[&str]| {
        let (want, want_logits, _) = generate(&m, prompt, &rings);
        let args = [&rings[..], extra, &["--prompt-cache", c]].concat();
        let (got, logits, err) = generate(&m, prompt, &args);
        assert_eq!(tokens(&got), tokens(&want), "{prompt} {extra:?}");
        assert!(logits == want_logits, "{prompt} {extra:?}: logits differ");
        (got, err)
    };
    let (v, err) = check(&long, &[]);
    assert!(n_prompt(&v) > 2 * 16, "longer than two windows");
    assert!(err.contains("the state saved"), "{err}");
    let (v, _) = check(&long, &[]);
    assert_eq!(restored(&v), n_prompt(&v) - 1);
    let (v, _) = check(&format!("{long} through the field"), &["--prompt-cache-ro"]);
    assert!(restored(&v) > 2 * 16, "the cached tokens start the prompt");
    // Parting from the cached tokens well before their end: not restored.
    let (v, err) = check(&other, &[]);
    assert_eq!(restored(&v), 0, "{err}");
    assert!(
        err.contains("sliding-window") && err.contains("--swa-full"),
        "{err}"
    );
    // Saved with every position, it restores the common start, also into rings.
    let (_, err) = check(&long, &["--swa-full"]);
    assert!(err.contains("the state saved"), "{err}");
    let (v, err) = check(&other, &["--prompt-cache-ro"]);
    assert!(restored(&v) > 5 && restored(&v) < n_prompt(&v) - 1, "{err}");
    let (v, err) = check(&other, &["--swa-full"]);
    assert!(restored(&v) > 5 && restored(&v) < n_prompt(&v) - 1, "{err}");
}
