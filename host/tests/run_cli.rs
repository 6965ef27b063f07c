//! End-to-end tests of `les run` on synthetic models: determinism, thread
//! independence, every schedule bit-identical to resident, the JSON and .npy
//! outputs, and clean errors.

mod cli;

use std::path::{Path, PathBuf};
use std::process::Output;

use cli::{json_ok, les, npy, pack, synth_once, tmp, tokens};
use serde_json::Value;

/// A tiny synthetic model of `arch`, written once per test binary.
fn model(arch: &str) -> PathBuf {
    synth_once(
        &format!("run_cli_{arch}.gguf"),
        &["--arch", arch, "--preset", "tiny", "--seed", "3"],
    )
}

fn run(model: &Path, extra: &[&str]) -> Output {
    les()
        .args(["run", "-m"])
        .arg(model)
        .args(["-p", "The quick brown fox"])
        .args(if extra.contains(&"-n") {
            &[][..]
        } else {
            &["-n", "20"][..]
        })
        .args(extra)
        .output()
        .unwrap()
}

fn json_run(model: &Path, extra: &[&str]) -> Value {
    let out = run(model, &[&["--json"], extra].concat());
    json_ok(out, &format!("run {extra:?}"))
}

#[test]
fn greedy_output_does_not_depend_on_threads() {
    for arch in [
        "qwen3moe",
        "qwen2moe",
        "olmoe",
        "llama",
        "mixtral",
        "gpt-oss",
        "glm4moe",
        "deepseek2",
    ] {
        let m = model(arch);
        let a = json_run(&m, &["--temp", "0", "-t", "1"]);
        let b = json_run(&m, &["--temp", "0", "-t", "2"]);
        let c = json_run(&m, &["--temp", "0", "-t", "3"]);
        assert_eq!(tokens(&a), tokens(&b), "{arch}");
        assert_eq!(tokens(&a), tokens(&c), "{arch}");
        assert!(!tokens(&a).is_empty(), "{arch}");
        assert!(a["stats"]["decode_tok_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn sampling_is_reproducible_for_a_seed() {
    let m = model("qwen3moe");
    let a = json_run(
        &m,
        &[
            "--temp", "1.5", "--top-k", "0", "--top-p", "1", "--seed", "42",
        ],
    );
    let b = json_run(
        &m,
        &[
            "--temp", "1.5", "--top-k", "0", "--top-p", "1", "--seed", "42",
        ],
    );
    let c = json_run(
        &m,
        &[
            "--temp", "1.5", "--top-k", "0", "--top-p", "1", "--seed", "43",
        ],
    );
    assert_eq!(tokens(&a), tokens(&b));
    assert_ne!(
        tokens(&a),
        tokens(&c),
        "different seeds should differ on a 20-token run"
    );
}

/// `--repeat-penalty` and `--repeat-last-n` reach the sampler (the prompt's
/// tokens in its window, as llama.cpp), `--min-p 1` keeps only the most likely
/// token, and `-f` reads the same prompt as `-p`.
#[test]
fn sampling_options_and_prompt_files() {
    let m = model("qwen3moe");
    let greedy = tokens(&json_run(&m, &["--temp", "0", "-n", "24"]));
    // The tiny model's greedy continuation repeats itself: a penalty changes it.
    let penalized = json_run(&m, &["--temp", "0", "-n", "24", "--repeat-penalty", "1.5"]);
    assert_ne!(tokens(&penalized), greedy);
    // So do the frequency and presence penalties, each its own way.
    let frequency = json_run(&m, &["--temp", "0", "-n", "24", "--frequency-penalty", "1"]);
    let presence = json_run(
        &m,
        &["--temp", "0", "-n", "24", "--presence-penalty", "1.5"],
    );
    assert_ne!(tokens(&frequency), greedy);
    assert_ne!(tokens(&presence), greedy);
    let off = [
        &["--repeat-penalty", "1"][..],
        &["--repeat-penalty", "1.5", "--repeat-last-n", "0"],
        &["--presence-penalty", "0", "--frequency-penalty", "0"],
        &[
            "--presence-penalty",
            "2",
            "--frequency-penalty",
            "-1",
            "--repeat-last-n",
            "0",
        ],
    ];
    for args in off {
        let got = json_run(&m, &[&["--temp", "0", "-n", "24"], args].concat());
        assert_eq!(tokens(&got), greedy, "{args:?}");
    }
    // A window of one token (the last) differs from the default 64.
    let short = json_run(
        &m,
        &[
            "--temp",
            "0",
            "-n",
            "24",
            "--repeat-penalty",
            "1.5",
            "--repeat-last-n",
            "1",
        ],
    );
    assert_ne!(tokens(&short), tokens(&penalized));
    // The prompt's tokens are in the window: a prompt that ends in the loop
    // the model is in penalizes the first token it would pick next. (Where
    // the loop stands after 24 tokens is a property of this random model's
    // continuation with an f32 KV cache; the f16 one leaves it a token
    // earlier, and the next token then is not the loop's.)
    let f32_cache = ["--cache-type-k", "f32", "--cache-type-v", "f32"];
    let looping = format!(
        "The quick brown fox{}",
        json_run(&m, &[&["--temp", "0", "-n", "24"][..], &f32_cache].concat())["text"]
            .as_str()
            .unwrap()
    );
    let first = |extra: &[&str]| {
        let out = les()
            .args(["run", "--json", "--temp", "0", "-n", "1", "-m"])
            .arg(&m)
            .args(["-p", &looping])
            .args(f32_cache)
            .args(extra)
            .output()
            .unwrap();
        tokens(&json_ok(out, "run -n 1"))
    };
    assert_ne!(first(&["--repeat-penalty", "1.5"]), first(&[]));
    // DRY breaks the greedy decode's loop (one token repeated); over no
    // tokens it does nothing.
    let greedy_24 = tokens(&json_run(&m, &["--temp", "0", "-n", "24"]));
    let dry = tokens(&json_run(
        &m,
        &["--temp", "0", "-n", "24", "--dry-multiplier", "5"],
    ));
    assert_ne!(dry, greedy_24);
    let longest_run = |t: &[u64]| t.chunk_by(|a, b| a == b).map(<[u64]>::len).max();
    assert!(longest_run(&dry) <= Some(3), "{dry:?}");
    assert!(
        longest_run(&greedy_24) > Some(3),
        "the loop this test breaks: {greedy_24:?}"
    );
    let args = [
        "--temp",
        "0",
        "-n",
        "24",
        "--dry-multiplier",
        "5",
        "--dry-penalty-last-n",
        "0",
    ];
    assert_eq!(tokens(&json_run(&m, &args)), greedy_24);
    // min-p 1 leaves the most likely token, whatever the temperature and seed.
    for seed in ["1", "2"] {
        let args = [
            "--temp", "2", "--top-k", "0", "--min-p", "1", "--seed", seed, "-n", "24",
        ];
        assert_eq!(tokens(&json_run(&m, &args)), greedy, "seed {seed}");
    }
    // Top-n-sigma with a tiny n leaves the most likely token too.
    for seed in ["1", "2"] {
        let args = [
            "--temp",
            "2",
            "--top-k",
            "0",
            "--min-p",
            "0",
            "--top-nsigma",
            "1e-6",
            "--seed",
            seed,
            "-n",
            "24",
        ];
        assert_eq!(tokens(&json_run(&m, &args)), greedy, "seed {seed}");
    }
    // XTC always on at threshold 0 drops all but the least likely of the
    // top-k 2: the second most likely token, whatever the seed.
    let second: Vec<_> = ["1", "2", "3"]
        .iter()
        .map(|seed| {
            let args = [
                "--temp",
                "1",
                "--top-k",
                "2",
                "--top-p",
                "1",
                "--min-p",
                "0",
                "--xtc-probability",
                "1",
                "--xtc-threshold",
                "0",
                "--seed",
                seed,
                "-n",
                "1",
            ];
            tokens(&json_run(&m, &args))
        })
        .collect();
    assert!(second.windows(2).all(|w| w[0] == w[1]), "{second:?}");
    assert_ne!(second[0][0], greedy[0]);
    // Typical-p runs (its effect is the sampler's unit tests').
    let args = ["--typical", "0.5", "--seed", "3", "-n", "8", "--ignore-eos"];
    assert_eq!(tokens(&json_run(&m, &args)).len(), 8);

    let file_run = |contents: &[u8]| {
        let path = tmp(&format!("prompt_{}.txt", contents.len()));
        std::fs::write(&path, contents).unwrap();
        let out = les()
            .args(["run", "--json", "--temp", "0", "-n", "24", "-m"])
            .arg(&m)
            .arg("-f")
            .arg(&path)
            .output()
            .unwrap();
        tokens(&json_ok(out, "run -f"))
    };
    // `run` passes -p "The quick brown fox".
    assert_eq!(file_run(b"The quick brown fox"), greedy);
    assert_eq!(file_run(b"The quick brown fox\n"), greedy);
    assert_eq!(file_run(b"The quick brown fox\r\n"), greedy);
    assert_ne!(file_run(b"The quick brown fox\n\n"), greedy);
}

/// `--ignore-eos` generates past the point where a run sampled an
/// end-of-generation token, to `-n`.
#[test]
fn ignore_eos_generates_to_n() {
    let m = model("qwen3moe");
    let sampled = |seed: u32, extra: &[&str]| {
        let seed = seed.to_string();
        let args = [
            "--temp", "50", "--top-k", "0", "--top-p", "1", "--min-p", "0",
        ];
        json_run(
            &m,
            &[&args[..], &["--seed", &seed, "-n", "100"], extra].concat(),
        )
    };
    // Near-uniform draws from 300 tokens: some seed's run ends at an EOG token.
    let seed = (0..40)
        .find(|&s| sampled(s, &[])["stats"]["stop"] == "eog")
        .expect("a run that stops at end of generation");
    let stopped = sampled(seed, &[]);
    let full = sampled(seed, &["--ignore-eos"]);
    assert_eq!(full["stats"]["generated"], 100, "{full}");
    assert_ne!(full["stats"]["stop"], "eog");
    assert!(tokens(&stopped).len() < 100);
}

/// `--stop` (`-r`): the reply ends where its text contains a stop string,
/// which is not printed; text that may start one is held back until the next
/// token tells, so what is printed is the JSON's text.
#[test]
fn stop_strings_end_the_reply() {
    let m = model("qwen3moe");
    let base = ["--temp", "0", "-n", "24"];
    let full = json_run(&m, &base);
    let text = full["text"].as_str().unwrap().to_string();
    let all = tokens(&full);
    let chars: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    assert!(chars.len() > 8, "{text:?}");
    let mut tried = 0;
    for (a, b) in [(2, 5), (5, 6), (1, 8), (0, 2)] {
        let stop = &text[chars[a]..chars[b]];
        if stop.contains('\\') {
            continue; // would be read as an escape
        }
        tried += 1;
        let at = text.find(stop).unwrap();
        let flag = format!("--stop={stop}");
        let args = [&base[..], &[flag.as_str()]].concat();
        let v = json_run(&m, &args);
        assert_eq!(v["text"], text[..at], "stop {stop:?}");
        assert_eq!(v["stats"]["stop"], "string", "{v}");
        assert_eq!(v["stats"]["stop_string"], stop, "{v}");
        let got = tokens(&v);
        assert!(all.starts_with(&got) && got.len() < all.len(), "{got:?}");
        let out = run(&m, &args);
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("{}\n", &text[..at]),
            "stop {stop:?}"
        );
    }
    assert!(tried >= 3);
    // Another stop string that does not occur changes nothing.
    let args = [
        &base[..],
        &["-r", "never in this text", "--reverse-prompt", "nor this"],
    ]
    .concat();
    let v = json_run(&m, &args);
    assert_eq!(
        (&v["text"], &v["stats"]["stop"]),
        (&full["text"], &full["stats"]["stop"])
    );
    let out = run(&m, &args);
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{text}\n"));
}

/// `-p` and `--stop` read llama.cpp's escapes (`\n`, `\xHH`...) unless
/// `--no-escape`; a prompt file is read as it is.
#[test]
fn prompt_escapes_are_read_unless_no_escape() {
    let m = model("qwen3moe");
    let prompt = |extra: &[&str]| {
        let out = les()
            .args(["run", "--json", "--temp", "0", "-n", "1", "-m"])
            .arg(&m)
            .args(extra)
            .output()
            .unwrap();
        json_ok(out, "escapes")["prompt_tokens"].clone()
    };
    let real = prompt(&["-p", "one\ntwo\tA"]);
    assert_eq!(prompt(&["-p", r"one\ntwo\t\x41"]), real);
    assert_ne!(prompt(&["-p", r"one\ntwo\t\x41", "--no-escape"]), real);
    let path = tmp("escapes_prompt.txt");
    std::fs::write(&path, r"one\ntwo").unwrap();
    let from_file = prompt(&["-f", path.to_str().unwrap()]);
    assert_eq!(from_file, prompt(&["-p", r"one\ntwo", "--no-escape"]));
    // A \x escape that is not UTF-8 is a one-line error naming -p.
    let out = les()
        .args(["run", "-n", "1", "-p", r"\xff", "-m"])
        .arg(&m)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("-p:"), "{err}");
}

/// `--logit-bias` (`-l`), as llama.cpp's: a large bias makes greedy decoding
/// pick its token every time, `-inf` never, and biases of a token add up.
#[test]
fn logit_bias_steers_sampling() {
    let m = model("qwen3moe");
    let greedy = tokens(&json_run(&m, &["--temp", "0", "-n", "8"]));
    let first = greedy[0];
    let run = |extra: &[&str]| {
        tokens(&json_run(
            &m,
            &[&["--temp", "0", "-n", "8"], extra].concat(),
        ))
    };
    let banned = run(&["-l", &format!("{first}-inf")]);
    assert_ne!(banned[0], first, "{banned:?}");
    assert!(!banned.contains(&first), "{banned:?}");
    // A token the model generated (not an end of generation), favoured.
    let other = *greedy.iter().find(|&&t| t != first).unwrap_or(&banned[0]);
    let favoured = run(&["--logit-bias", &format!("{other}+1000")]);
    assert_eq!(favoured, vec![other; 8]);
    // Two biases of a token add up: +1000 and -1000 change nothing.
    let cancelled = run(&[
        "-l",
        &format!("{other}+1000"),
        "-l",
        &format!("{other}-1000"),
    ]);
    assert_eq!(cancelled, greedy);
    // And a bias applies at every temperature.
    let drawn = tokens(&json_run(
        &m,
        &[
            "--temp",
            "1.5",
            "--seed",
            "3",
            "-n",
            "8",
            "-l",
            &format!("{other}+1000"),
        ],
    ));
    assert_eq!(drawn, vec![other; 8]);
}

/// A greedy `--json` run with `args` writing its logits to `logits_{name}.npy`:
/// the JSON, the `.npy` (rows, columns, data) and stderr.
fn greedy_with_logits(
    model: &Path,
    args: &[&str],
    name: &str,
) -> (Value, (usize, usize, Vec<u8>), String) {
    let path = tmp(&format!("logits_{name}.npy"));
    let logits = [
        "--temp",
        "0",
        "--json",
        "--logits-out",
        path.to_str().unwrap(),
    ];
    let out = run(model, &[args, &logits[..]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = json_ok(out, &format!("run {args:?}"));
    (json, npy(&path), stderr)
}

#[test]
fn every_schedule_and_budget_gives_bit_identical_logits() {
    for arch in [
        "qwen3moe",
        "qwen2moe",
        "mixtral",
        "gpt-oss",
        "glm4moe",
        "deepseek2",
    ] {
        let m = model(arch);
        let (want, (rows, cols, want_logits), _) =
            greedy_with_logits(&m, &["--schedule", "resident"], &format!("{arch}_resident"));
        let eog = usize::from(want["stats"]["stop"] == "eog");
        assert_eq!(
            rows,
            tokens(&want).len() + eog,
            "one row per sampled position"
        );
        assert!(cols > 200, "vocab");
        for args in [
            ["--schedule", "on-demand", "--slots", "2"],
            ["--schedule", "les", "--slots", "2"],
            ["--schedule", "les", "--slots", "5"],
            ["--schedule", "on-demand", "--slots", "32"],
            ["--schedule", "les", "--expert-mem", "64KiB"],
            // Reads through io_uring (plain GGUF: unaligned reads via its bounce
            // buffers), les by default with slots.
            ["--io-engine", "uring", "--slots", "3"],
        ] {
            let name = format!("{arch}_{}", args.join("_"));
            let (got, (_, _, logits), _) = greedy_with_logits(&m, &args, &name);
            assert_eq!(tokens(&got), tokens(&want), "{arch} {args:?}");
            assert!(logits == want_logits, "{arch} {args:?}: logits differ");
            let rate = |k: &str| {
                got["stats"][k]
                    .as_f64()
                    .unwrap_or_else(|| panic!("{k}: {got}"))
            };
            assert!((0.0..=1.0).contains(&rate("hit_rate")), "{got}");
            assert!(rate("ready_hit_rate") <= rate("hit_rate"), "{got}");
        }
    }
}

/// A batch's union of picks larger than one group (here 160 experts, groups
/// of at most 64): `les` reads each next group while the current one
/// computes (the prompt alone, `-n 1`, so these are the only reads ahead),
/// `on-demand` only when asked; the logits are the resident run's.
#[test]
fn batched_prompts_read_the_next_group_ahead() {
    let m = synth_once(
        "run_cli_groups.gguf",
        &[
            "--arch",
            "qwen3moe",
            "--preset",
            "tiny",
            "--experts",
            "160",
            "--top-k",
            "8",
            "--layers",
            "2",
            "--seed",
            "8",
        ],
    );
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(6);
    let go = |extra: &[&str]| {
        let path = tmp(&format!("groups_{}.npy", extra.join("_")));
        let out = les()
            .args(["run", "-m"])
            .arg(&m)
            .args([
                "-p", &prompt, "-n", "1", "--temp", "0", "-b", "256", "--json",
            ])
            .args(["--logits-out", path.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        (json_ok(out, "groups"), npy(&path))
    };
    let (_, want) = go(&["--schedule", "resident"]);
    let (les_run, got) = go(&["--schedule", "les", "--slots", "200"]);
    assert!(got == want, "les: logits differ");
    assert!(
        les_run["stats"]["prefetch_bytes"].as_u64().unwrap() > 0,
        "{}",
        les_run["stats"]
    );
    let (od, got) = go(&["--schedule", "on-demand", "--slots", "200"]);
    assert!(got == want, "on-demand: logits differ");
    assert_eq!(od["stats"]["prefetch_bytes"], 0, "{}", od["stats"]);
}

/// The prompt evaluated in batches (`-b`, layer by layer) or one position at a
/// time gives the same tokens and logits, resident and streamed.
#[test]
fn prompt_batch_size_does_not_change_the_logits() {
    for arch in [
        "qwen3moe",
        "qwen35moe",
        "qwen3next",
        "gpt-oss",
        "glm4moe",
        "deepseek2",
    ] {
        let m = model(arch);
        let (want, (_, _, want_logits), _) = greedy_with_logits(
            &m,
            &["--schedule", "resident", "-b", "1"],
            &format!("{arch}_b1"),
        );
        let prompt = want["stats"]["prompt_tokens"].as_u64().unwrap();
        assert!(prompt > 3, "batches of 2 and 3 split the prompt: {prompt}");
        for args in [
            &["--schedule", "resident"][..],
            &["--schedule", "resident", "-b", "2"],
            &["--schedule", "les", "--slots", "2", "-b", "2"],
            &["--schedule", "les", "--slots", "5"],
            &["--schedule", "on-demand", "--slots", "3", "-b", "3"],
        ] {
            let name = format!("{arch}_batch_{}", args.join("_"));
            let (got, (_, _, logits), _) = greedy_with_logits(&m, args, &name);
            assert_eq!(tokens(&got), tokens(&want), "{arch} {args:?}");
            assert!(logits == want_logits, "{arch} {args:?}: logits differ");
        }
    }
}

/// `--cache-type-k` / `--cache-type-v` choose the KV cache's element types
/// (f16 by default, as llama.cpp): the JSON stats report them and their bytes,
/// they change the logits (f16 rounds what is cached), and every schedule
/// streams bit-identically to `resident` with either.
#[test]
fn kv_cache_types_are_chosen_reported_and_exact() {
    let m = model("qwen3moe");
    let f32_cache = ["--cache-type-k", "f32", "--cache-type-v", "f32"];
    let (f16, (_, _, f16_logits), _) = greedy_with_logits(&m, &[], "kv_f16");
    let (f32, (_, _, f32_logits), _) = greedy_with_logits(&m, &f32_cache, "kv_f32");
    let (mixed, _, _) = greedy_with_logits(&m, &["--cache-type-k", "f32"], "kv_mixed");
    let kv = |j: &Value| j["stats"]["kv_cache"].clone();
    assert_eq!(kv(&f16)["k"], "f16");
    assert_eq!(kv(&f16)["v"], "f16");
    assert_eq!(
        (kv(&f32)["k"].clone(), kv(&f32)["v"].clone()),
        ("f32".into(), "f32".into())
    );
    assert_eq!(
        (kv(&mixed)["k"].clone(), kv(&mixed)["v"].clone()),
        ("f32".into(), "f16".into())
    );
    let bytes = |j: &Value| kv(j)["bytes"].as_u64().unwrap();
    // tiny: 4 layers of 2 KV heads of 16, prompt + 20 positions.
    let positions = f16["stats"]["prompt_tokens"].as_u64().unwrap() + 20;
    assert_eq!(bytes(&f16), positions * 4 * 32 * 2 * 2, "{f16}");
    assert_eq!(bytes(&f32), 2 * bytes(&f16));
    assert_eq!(2 * bytes(&mixed), 3 * bytes(&f16));
    assert!(f16_logits != f32_logits, "the f16 cache changed nothing");
    for (cache, want) in [(&[][..], &f16_logits), (&f32_cache[..], &f32_logits)] {
        for schedule in [
            ["--schedule", "les", "--slots", "3"],
            ["--schedule", "on-demand", "--slots", "4"],
        ] {
            let args = [&schedule[..], cache].concat();
            let name = format!("kv_{}", args.join("_"));
            let (_, (_, _, logits), _) = greedy_with_logits(&m, &args, &name);
            assert!(&logits == want, "{args:?}: logits differ from resident's");
        }
    }
}

/// Speculative decoding (`--speculate ngram`) gives the same tokens and logits,
/// resident and streamed, whatever share of its drafts is accepted.
#[test]
fn speculative_decoding_does_not_change_the_logits() {
    let draft = model("qwen3moe").to_str().unwrap().to_owned();
    for arch in ["qwen3moe", "qwen35moe"] {
        let m = model(arch);
        // 40 tokens: enough for a token to recur (the n-gram drafter's cue at
        // --ngram-min 1) in any greedy continuation of a 300-token vocabulary.
        let (want, (_, _, want_logits), _) = greedy_with_logits(
            &m,
            &["--schedule", "resident", "-n", "40"],
            &format!("{arch}_plain"),
        );
        let every = [
            "--speculate",
            "ngram",
            "--draft-fixed",
            "--ngram-min",
            "1",
            "-n",
            "40",
        ];
        for (args, drafts) in [
            (&["--speculate", "ngram", "-n", "40"][..], false),
            (&[&every[..], &["--draft-max", "3"]].concat()[..], true),
            (
                &[&every[..], &["--schedule", "les", "--slots", "3"]].concat(),
                true,
            ),
            (
                &[
                    &every[..],
                    &["--schedule", "on-demand", "--slots", "4", "-b", "1"],
                ]
                .concat(),
                true,
            ),
            (
                &[
                    "--model-draft",
                    &draft,
                    "--draft-fixed",
                    "--schedule",
                    "les",
                    "--slots",
                    "3",
                    "-n",
                    "40",
                ],
                true,
            ),
        ] {
            let name = format!("{arch}_spec_{}", args.join("_")).replace('/', "_");
            let (got, (_, _, logits), stderr) = greedy_with_logits(&m, args, &name);
            assert_eq!(tokens(&got), tokens(&want), "{arch} {args:?}");
            assert!(logits == want_logits, "{arch} {args:?}: logits differ");
            let st = &got["stats"];
            if drafts {
                assert!(st["drafted"].as_u64().unwrap() > 0, "{arch} {args:?}: {st}");
                assert!(st["verify_passes"].as_u64().unwrap() > 0, "{st}");
            }
            assert!(
                st["accepted"].as_u64() <= st["drafted"].as_u64(),
                "{stderr}"
            );
        }
    }
    // qwen35moe's own multi-token-prediction block drafts too.
    let m = model("qwen35moe");
    let (want, (_, _, want_logits), _) = greedy_with_logits(
        &m,
        &["--schedule", "resident", "-n", "40"],
        "qwen35moe_plain",
    );
    for args in [
        &["--speculate", "mtp", "-n", "40"][..],
        &[
            "--speculate",
            "mtp",
            "--draft-fixed",
            "--draft-max",
            "3",
            "--schedule",
            "les",
            "--slots",
            "3",
            "-n",
            "40",
        ],
    ] {
        let name = format!("qwen35moe_spec_{}", args.join("_"));
        let (got, (_, _, logits), _) = greedy_with_logits(&m, args, &name);
        assert_eq!(tokens(&got), tokens(&want), "{args:?}");
        assert!(logits == want_logits, "{args:?}: logits differ");
    }
}

#[test]
fn mixed_expert_sizes_get_slots_of_their_size_and_stay_exact() {
    // llama.cpp's Q4_K_M mix: layers 2 and 3 have a q6_k ffn_down, so their
    // experts need larger slots than those of layers 0 and 1.
    let plain = synth_once(
        "run_cli_mixed.gguf",
        &[
            "--arch",
            "qwen3moe",
            "--preset",
            "tiny",
            "--embd",
            "256",
            "--expert-ff",
            "256",
            "--expert-type",
            "q4_k",
            "--mix",
            "q4_k_m",
            "--layers",
            "4",
            "--seed",
            "3",
        ],
    );
    let packed = tmp("run_cli_mixed.p.gguf");
    pack(&plain, &packed);
    for m in [&plain, &packed] {
        let (want, (_, _, want_logits), _) =
            greedy_with_logits(m, &["--schedule", "resident"], "mixed_resident");
        for args in [
            ["--schedule", "les", "--slots", "4"],
            ["--schedule", "on-demand", "--slots", "5"],
            ["--schedule", "les", "--expert-mem", "1MiB"],
            ["--schedule", "les", "--slots", "32"],
        ] {
            let name = format!("mixed_{}", args.join("_"));
            let (got, (_, _, logits), stderr) = greedy_with_logits(m, &args, &name);
            assert_eq!(tokens(&got), tokens(&want), "{args:?}");
            assert!(logits == want_logits, "{args:?}: logits differ");
            // Two runs of slots: 108 KiB for the q4_k layers, 128 KiB for the others.
            assert!(
                stderr.contains("of 108 KiB") && stderr.contains("of 128 KiB"),
                "{stderr}"
            );
        }
        // 1 MiB holds 4 slots of each size (944 KiB); all of one size would be 8 of 128.
        let got = json_run(m, &["--temp", "0", "-n", "2", "--expert-mem", "1MiB"]);
        assert_eq!(got["stats"]["slots"], 8);
        assert_eq!(got["stats"]["slot_bytes"], 4 * 110_592 + 4 * 131_072);
    }
    // Too small a budget for one layer's picks of each size is a clear error.
    let out = run(&packed, &["--expert-mem", "300KiB"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("expert slots") && err.contains("need"),
        "{err}"
    );
}

#[test]
fn expert_mem_takes_a_share_of_the_expert_bytes() {
    // The tiny preset: 4 layers of 8 experts, each in a slot of one size.
    let m = model("qwen3moe");
    let resident = json_run(&m, &["--temp", "0", "-n", "4"]);
    for (share, slots) in [("100%", 32), ("50%", 16), ("25%", 8)] {
        let got = json_run(&m, &["--temp", "0", "-n", "4", "--expert-mem", share]);
        assert_eq!(got["stats"]["slots"], slots, "{share}");
        assert_eq!(tokens(&got), tokens(&resident), "{share}");
        let bytes = got["stats"]["slot_bytes"].as_u64().unwrap();
        // The same budget in bytes buys the same slots.
        let same = json_run(
            &m,
            &["--temp", "0", "-n", "1", "--expert-mem", &bytes.to_string()],
        );
        assert_eq!(same["stats"]["slots"], slots, "{share} = {bytes} bytes");
    }
    for bad in ["0%", "101%", "x%", "%"] {
        let out = run(&m, &["--expert-mem", bad]);
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--expert-mem"), "{bad}: {err}");
    }
}

#[test]
fn text_goes_to_stdout_and_stats_to_stderr() {
    let m = model("qwen3moe");
    let out = run(&m, &["--temp", "0"]);
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tok/s"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("The quick brown fox"),
        "no prompt echo: {stdout}"
    );
    // The streamed text equals the JSON text.
    let j = json_run(&m, &["--temp", "0"]);
    assert_eq!(stdout.trim_end_matches('\n'), j["text"].as_str().unwrap());
}

#[test]
fn chat_template_wraps_the_prompt() {
    let m = model("qwen3moe");
    let plain = json_run(&m, &["--temp", "0", "-n", "1"]);
    let chat = json_run(&m, &["--temp", "0", "-n", "1", "--chat"]);
    let n_plain = plain["prompt_tokens"].as_array().unwrap().len();
    let n_chat = chat["prompt_tokens"].as_array().unwrap().len();
    assert!(
        n_chat > n_plain + 4,
        "chat template adds role markers: {n_plain} vs {n_chat}"
    );
    // A system prompt adds a system turn (this template has one).
    let system = json_run(
        &m,
        &[
            "--temp",
            "0",
            "-n",
            "1",
            "--chat",
            "--system-prompt",
            "Be brief.",
        ],
    );
    let n_system = system["prompt_tokens"].as_array().unwrap().len();
    assert!(n_system > n_chat + 3, "{n_chat} vs {n_system}");
    // Only with --chat.
    let out = run(&m, &["--system-prompt", "Be brief."]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--chat"));
}

/// `--chat-template-file` replaces the model's template, and
/// `--chat-template-kwargs` are variables it sees: the prompt is the text the
/// file renders, evaluated as a plain prompt of that text would be.
#[test]
fn chat_template_file_and_kwargs_replace_and_feed_the_template() {
    let m = model("qwen3moe");
    let file = tmp("run_cli_template.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}\
         {% if enable_thinking is defined and not enable_thinking %}(no thinking)\n{% endif %}\
         [assistant] ",
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let prompt_of = |extra: &[&str]| -> Value {
        let mut args = vec!["--temp", "0", "-n", "1"];
        args.extend_from_slice(extra);
        json_run(&m, &args)["prompt_tokens"].clone()
    };
    let want = |text: &str| {
        let out = les()
            .args(["run", "--json", "-n", "1", "--temp", "0", "-m"])
            .arg(&m)
            .args(["-p", text])
            .output()
            .unwrap();
        json_ok(out, "plain prompt")["prompt_tokens"].clone()
    };
    assert_eq!(
        prompt_of(&["--chat", "--chat-template-file", file]),
        want("[user] The quick brown fox\n[assistant] ")
    );
    assert_eq!(
        prompt_of(&[
            "--chat",
            "--chat-template-file",
            file,
            "--chat-template-kwargs",
            r#"{"enable_thinking": false}"#,
        ]),
        want("[user] The quick brown fox\n(no thinking)\n[assistant] ")
    );
    // Bad overrides are named; they need --chat.
    let err = |extra: &[&str]| {
        let out = run(&m, extra);
        assert!(!out.status.success(), "{extra:?}");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    assert!(err(&["--chat", "--chat-template-kwargs", "[1]"]).contains("JSON object"));
    assert!(err(&["--chat", "--chat-template-kwargs", "{"]).contains("not JSON"));
    assert!(
        err(&["--chat", "--chat-template-file", "/nonexistent.jinja"])
            .contains("/nonexistent.jinja")
    );
    let broken = tmp("run_cli_broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}").unwrap();
    assert!(
        err(&["--chat", "--chat-template-file", broken.to_str().unwrap()])
            .contains("does not parse")
    );
    assert!(err(&["--chat-template-file", file]).contains("--chat"));
}

#[test]
fn generation_stops_when_the_context_is_full() {
    let m = model("qwen3moe");
    // -n far beyond any memory: the context (here 24 positions) bounds it.
    let a = json_run(
        &m,
        &["--temp", "0", "--ctx", "24", "-n", "18446744073709551615"],
    );
    let b = json_run(&m, &["--temp", "0", "-n", "40"]);
    let prompt = a["prompt_tokens"].as_array().unwrap().len();
    assert_eq!(a["stats"]["stop"], "ctx");
    // n tokens take n - 1 positions after the prompt (the last is not evaluated).
    let n = 24 + 1 - prompt;
    assert_eq!(a["stats"]["generated"], n);
    assert_eq!(tokens(&a), tokens(&b)[..n]);
    // Without --ctx the model's training context is the bound: a huge -n
    // allocates for that, not for -n.
    let short = synth_once(
        "run_cli_ctx26.gguf",
        &[
            "--arch",
            "qwen3moe",
            "--preset",
            "tiny",
            "--seed",
            "3",
            "--context",
            "26",
        ],
    );
    let c = json_run(&short, &["--temp", "0", "-n", "100000000000"]);
    assert_eq!(c["stats"]["stop"], "ctx");
    assert_eq!(c["stats"]["generated"], 26 + 1 - prompt);
    // Drafts stop at the context's end too.
    let spec = ["--speculate", "ngram", "--draft-fixed", "--ngram-min", "1"];
    let d = json_run(
        &short,
        &[&["--temp", "0", "-n", "100000000000"][..], &spec].concat(),
    );
    assert_eq!(d["tokens"], c["tokens"]);
    assert_eq!(d["stats"]["stop"], "ctx");
    // A --ctx past the training context is allowed, with a warning (as llama.cpp).
    let warning = "longer than the 26 the model was trained on";
    for (ctx, warned) in [("26", false), ("30", true)] {
        let out = run(&short, &["--temp", "0", "-n", "8", "--ctx", ctx]);
        assert!(out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.contains(warning), warned, "--ctx {ctx}: {err}");
    }
}

#[test]
fn out_of_range_options_are_usage_errors() {
    let m = model("qwen3moe");
    for (args, option) in [
        (vec!["--temp", "nan"], "--temp"),
        (vec!["--top-p", "inf"], "--top-p"),
        (vec!["-t", "100000"], "--threads"),
        (vec!["--io-threads", "100000"], "--io-threads"),
        (vec!["--predict-min-prob", "1.5"], "--predict-min-prob"),
        (vec!["--min-p", "1.5"], "--min-p"),
        (vec!["--min-p", "nan"], "--min-p"),
        (vec!["--typical", "1.5"], "--typical"),
        (vec!["--dry-multiplier=-1"], "--dry-multiplier"),
        (vec!["--dry-penalty-last-n=-2"], "--dry-penalty-last-n"),
        (vec!["--dry-base", "inf"], "--dry-base"),
        (vec!["--top-nsigma", "nan"], "--top-nsigma"),
        (vec!["--xtc-probability", "2"], "--xtc-probability"),
        (vec!["--xtc-threshold=-0.1"], "--xtc-threshold"),
        (vec!["--repeat-penalty", "0"], "--repeat-penalty"),
        (vec!["--repeat-penalty", "inf"], "--repeat-penalty"),
        (vec!["--presence-penalty", "nan"], "--presence-penalty"),
        (vec!["--frequency-penalty=-inf"], "--frequency-penalty"),
        (vec!["-b", "0"], "--batch-size"),
        (vec!["-b", "100000"], "--batch-size"),
        (vec!["--draft-max", "0"], "--draft-max"),
        (vec!["--draft-max", "65"], "--draft-max"),
        (vec!["--ngram-min", "9"], "--ngram-min"),
        (vec!["--speculate", "bogus"], "--speculate"),
        (vec!["--cache-type-k", "q8_0"], "--cache-type-k"),
        (vec!["--cache-type-v", "f64"], "--cache-type-v"),
        (vec!["--logit-bias", "5+inf"], "--logit-bias"),
        (vec!["-l", "5*2"], "--logit-bias"),
    ] {
        let out = run(&m, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.starts_with("error: invalid value") && err.contains(option),
            "{args:?}: {err}"
        );
    }
    for args in [
        ["-n", "0"],
        ["-n", "18446744073709551615"],
        ["--sweep", "10,0"],
    ] {
        let out = les()
            .args(["bench", "-m"])
            .arg(&m)
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            !err.contains("les bench:"),
            "{args:?} did work first: {err}"
        );
    }
    // A --logits-out that cannot be written fails before the generation, naming it.
    let out = run(&m, &["--logits-out", "/nonexistent/dir/l.npy"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("/nonexistent/dir/l.npy") && !err.contains("tok/s"),
        "{err}"
    );
}

/// `--model-draft` takes a draft model with recurrent layers (a qwen35moe
/// drafting for a qwen3moe of the same vocabulary): the output is plain
/// decoding's.
#[test]
fn a_recurrent_draft_model_drafts() {
    let m = model("qwen3moe");
    let hybrid = model("qwen35moe");
    let args = ["-n", "12", "--temp", "0"];
    let plain = json_run(&m, &args);
    let draft = [
        &args[..],
        &["--model-draft", hybrid.to_str().unwrap(), "--draft-fixed"],
    ]
    .concat();
    let drafted = json_run(&m, &draft);
    assert_eq!(drafted["tokens"], plain["tokens"]);
    assert!(
        drafted["stats"]["drafted"].as_u64().unwrap() > 0,
        "{drafted}"
    );
}

#[test]
fn errors_are_one_line_and_nonzero() {
    let m = model("qwen3moe");
    for (args, needle) in [
        (
            vec!["run", "-m", "/nonexistent.gguf", "-p", "x"],
            "nonexistent",
        ),
        // The prompt file is read before the model.
        (
            vec![
                "run",
                "-m",
                "/nonexistent.gguf",
                "-f",
                "/no-such-prompt.txt",
            ],
            "/no-such-prompt.txt",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--speculate",
                "ngram",
                "--ngram-min",
                "3",
                "--ngram-max",
                "1",
            ],
            "--ngram-min 3 is more than --ngram-max 1",
        ),
        // Drafting options without speculative decoding would do nothing.
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--draft-max",
                "16",
            ],
            "speculative decoding, which is not on",
        ),
        (
            vec!["run", "-m", m.to_str().unwrap(), "-p", "x", "--draft-fixed"],
            "speculative decoding, which is not on",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "-l",
                "100000+1",
            ],
            "--logit-bias: token 100000 is outside the vocabulary",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--model-draft",
                m.to_str().unwrap(),
                "--ngram-max",
                "3",
            ],
            "--speculate ngram, which is not on",
        ),
        (
            vec![
                "bench",
                "-m",
                m.to_str().unwrap(),
                "--slots",
                "4",
                "--draft-max",
                "4",
            ],
            "speculative decoding, which is not on",
        ),
        // A budget for a schedule that has no slots is a mistake, not a no-op.
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--schedule",
                "resident",
                "--slots",
                "4",
            ],
            "--schedule resident keeps every expert in RAM",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--schedule",
                "les",
            ],
            "--expert-mem",
        ),
        (
            vec!["run", "-m", m.to_str().unwrap(), "-p", "x", "--slots", "1"],
            "slots",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--expert-mem",
                "12 parsecs",
            ],
            "unit",
        ),
        // A context no machine holds: an error, not an abort on the allocation.
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--ctx",
                "100000000000",
            ],
            "positions",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "The quick brown fox",
                "--ctx",
                "2",
            ],
            "does not fit the context",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--speculate",
                "model",
            ],
            "--model-draft",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--speculate",
                "mtp",
            ],
            "no multi-token-prediction block",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--speculate",
                "ngram",
                "--model-draft",
                m.to_str().unwrap(),
            ],
            "--speculate model",
        ),
        (
            vec![
                "run",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "x",
                "--model-draft",
                "/nonexistent-draft.gguf",
            ],
            "nonexistent-draft",
        ),
    ] {
        let out = les().args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.trim_end().lines().last().unwrap_or("");
        assert!(
            last.starts_with("error: ") && last.contains(needle),
            "{args:?}: {err}"
        );
    }
    let bad = tmp("run_cli_bad.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let out = les()
        .args(["run", "-m"])
        .arg(&bad)
        .args(["-p", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr).lines().count(), 1);
}

#[test]
fn packed_model_streams_identically_and_detects_corruption() {
    let plain = model("qwen3moe");
    let packed = tmp("run_cli_packed.gguf");
    pack(&plain, &packed);
    let want = json_run(&plain, &["--temp", "0"]);
    for args in [
        &["--schedule", "resident"][..],
        &["--schedule", "les", "--slots", "2"],
        &["--schedule", "on-demand", "--slots", "3"],
        &["--schedule", "les", "--slots", "2", "--io-engine", "uring"],
        &[
            "--schedule",
            "on-demand",
            "--slots",
            "3",
            "--io-engine",
            "uring",
        ],
    ] {
        let got = json_run(&packed, &[args, &["--temp", "0"]].concat());
        assert_eq!(tokens(&got), tokens(&want), "packed {args:?}");
    }
    // Flip one byte inside every expert of the first packed layer: whichever the
    // router picks, its checksum fails and the run stops with a clear error.
    let g = les::gguf::Gguf::open(&packed).unwrap();
    let index = les::pack::PackedIndex::from_gguf(&g)
        .unwrap()
        .expect("packed");
    let layer = index.layers()[0].clone();
    drop(g);
    let mut bytes = std::fs::read(&packed).unwrap();
    for e in 0..index.n_experts {
        bytes[layer.extent(e).unwrap().offset as usize + 10] ^= 0x40;
    }
    let corrupt = tmp("run_cli_corrupt.gguf");
    std::fs::write(&corrupt, &bytes).unwrap();
    // Resident experts are checked too, each the first time it is computed.
    for (schedule, engine) in [
        ("resident", "threads"),
        ("on-demand", "threads"),
        ("les", "threads"),
        ("les", "uring"),
    ] {
        let slots: &[&str] = if schedule == "resident" {
            &[]
        } else {
            &["--slots", "2"]
        };
        let out = run(
            &corrupt,
            &[
                &["--schedule", schedule, "--temp", "0", "--io-engine", engine][..],
                slots,
            ]
            .concat(),
        );
        assert!(
            !out.status.success(),
            "{schedule}: corruption went unnoticed"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.trim_end().lines().last().unwrap();
        assert!(
            last.starts_with("error: ")
                && last.contains(&format!("layer {} expert", layer.layer))
                && last.contains("checksum"),
            "{schedule}: {err}"
        );
    }
}

/// Packed experts longer than the I/O chunk are read in two parts, so `les`
/// computes an expert's gate and up projections while its down projection still
/// loads; the logits stay those of the resident run.
#[test]
fn experts_computed_in_halves_stay_exact() {
    let plain = synth_once(
        "run_cli_halves.gguf",
        &[
            "--arch", "qwen3moe", "--preset", "small", "--layers", "3", "--seed", "5",
        ],
    );
    let packed = tmp("run_cli_halves.p.gguf");
    pack(&plain, &packed);
    let (want, (_, _, want_logits), _) = greedy_with_logits(
        &packed,
        &["--schedule", "resident", "-n", "12"],
        "halves_resident",
    );
    // Whether an expert's first part lands before its second depends on the
    // machine's load: every run must be exact, and at least one of up to four
    // rounds (both chunk sizes each) must compute some expert in halves.
    let mut halves = 0;
    for (i, chunk) in ["64KiB", "128KiB"].iter().cycle().take(8).enumerate() {
        if i >= 2 && i % 2 == 0 && halves > 0 {
            break;
        }
        let args = [
            "--schedule",
            "les",
            "--slots",
            "24",
            "-n",
            "12",
            "--io-chunk",
            chunk,
        ];
        let (got, (_, _, logits), _) =
            greedy_with_logits(&packed, &args, &format!("halves_{chunk}"));
        assert_eq!(tokens(&got), tokens(&want), "{args:?}");
        assert!(logits == want_logits, "{args:?}: logits differ");
        halves += got["stats"]["split_computes"].as_u64().unwrap();
    }
    assert!(halves > 0, "no expert was computed in halves");
}

/// Streaming keeps the process's peak RSS within the resident weights, the slot
/// budget and a stated overhead (KV cache, scratch, code, allocator): the page
/// cache is not a hidden second expert cache, and experts are never mapped in.
#[test]
fn peak_rss_stays_within_budget() {
    let path = tmp("run_cli_rss.gguf");
    let out = les()
        .args([
            "synth", "--arch", "qwen3moe", "--preset", "small", "--layers", "4", "--quiet", "-o",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = json_run(
        &path,
        &["--temp", "0", "-n", "8", "--expert-mem", "16MiB", "-t", "2"],
    );
    let st = &j["stats"];
    let peak = st["peak_rss_bytes"].as_u64().expect("VmHWM on Linux");
    let resident = st["resident_weight_bytes"].as_u64().unwrap();
    let slots = st["slot_bytes"].as_u64().unwrap();
    const OVERHEAD: u64 = 48 << 20;
    assert!(
        peak <= resident + slots + OVERHEAD,
        "peak RSS {peak} > resident {resident} + slots {slots} + {OVERHEAD}"
    );
    // And the budget is real: experts are much larger than what was allowed.
    let g = les::model::Model::open(&path).unwrap();
    assert!(g.total_expert_bytes() > 4 * slots);
}

#[test]
fn kernel_prefetch_distance_changes_no_bit_and_a_bad_one_is_refused() {
    let m = model("qwen3moe");
    let with = |distance: &str| {
        let path = tmp(&format!("logits_prefetch_{distance}.npy"));
        let out = les()
            .env("LES_KERNEL_PREFETCH", distance)
            .args(["run", "-m"])
            .arg(&m)
            .args([
                "-p",
                "The quick brown fox",
                "-n",
                "8",
                "--temp",
                "0",
                "--json",
            ])
            .arg("--logits-out")
            .arg(&path)
            .output()
            .unwrap();
        let json = json_ok(out, &format!("LES_KERNEL_PREFETCH={distance}"));
        (tokens(&json), npy(&path))
    };
    let none = with("0");
    assert!(!none.0.is_empty());
    for distance in ["64", "4096", "1048576"] {
        assert_eq!(with(distance), none, "LES_KERNEL_PREFETCH={distance}");
    }
    for bad in ["4KiB", "-1", "1048577"] {
        let out = les()
            .env("LES_KERNEL_PREFETCH", bad)
            .args(["run", "-m"])
            .arg(&m)
            .args(["-p", "x"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("LES_KERNEL_PREFETCH") && err.contains("bytes"),
            "{bad}: {err}"
        );
    }
}

/// `--json` names the engine that read the experts: `--io-engine auto` (the
/// default) takes `io_uring` for experts of one read and I/O threads for
/// experts of several chunks; the tokens are the same either way.
#[test]
fn json_names_the_io_engine_auto_chose() {
    let m = model("qwen3moe");
    let base = ["--temp", "0", "-n", "6", "--expert-mem", "64KiB"];
    let engine = |extra: &[&str]| {
        let j = json_run(&m, &[&base[..], extra].concat());
        (j["stats"]["io_engine"].clone(), j["tokens"].clone())
    };
    let (auto, tokens) = engine(&[]);
    assert_eq!(auto, "uring");
    let (chunked, same) = engine(&["--io-chunk", "4KiB"]);
    assert_eq!(
        chunked, "threads",
        "the tiny preset's experts span several 4 KiB chunks"
    );
    assert_eq!(same, tokens);
    assert_eq!(engine(&["--io-engine", "threads"]).0, "threads");
    let resident = json_run(&m, &["--temp", "0", "-n", "2"]);
    assert!(resident["stats"]["io_engine"].is_null());
}

/// A closed stderr (`les run ... 2>&1 | head`) does not end the run: its
/// diagnostics are dropped, the text still comes out (it panicked).
#[test]
fn a_closed_stderr_is_not_a_failure() {
    use std::io::Read;
    let m = model("qwen3moe");
    let mut child = cli::les()
        .args(["run", "-m"])
        .arg(&m)
        .args(["-p", "hello", "-n", "8", "--temp", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    let mut text = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!text.is_empty());
}

/// `--logits-out` rewrites its header as rows come: a pipe is refused before
/// any work (it failed after the whole generation, and the JSON was lost).
#[test]
fn logits_out_must_be_a_regular_file() {
    let m = model("qwen3moe");
    let fifo = cli::fifo("run_cli_logits.fifo");
    let out = run(&m, &["--logits-out", fifo.to_str().unwrap(), "-n", "2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.trim_end()
            .ends_with("not a regular file (the .npy header is rewritten as rows come)"),
        "{err}"
    );
    std::fs::remove_file(&fifo).unwrap();
}

/// Ctrl-C during a `--logits-out` run leaves a valid `.npy` of the rows written
/// so far (its header said 0 rows until the end of the run).
#[test]
fn an_interrupted_logits_out_holds_the_rows_so_far() {
    use std::time::{Duration, Instant};
    let m = model("qwen3moe");
    let path = tmp("logits_interrupted.npy");
    let _ = std::fs::remove_file(&path);
    // Far more tokens than the test waits for.
    let child = les()
        .args(["run", "-m"])
        .arg(&m)
        .args(["-p", "x", "--temp", "0", "--ignore-eos"])
        .args(["-n", "100000", "--ctx", "100000"])
        .arg("--logits-out")
        .arg(&path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::fs::metadata(&path).map_or(0, |m| m.len()) < 128 + (64 << 10) {
        assert!(start.elapsed() < Duration::from_secs(60), "no rows written");
        std::thread::sleep(Duration::from_millis(2));
    }
    let kill = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    // `les run` leaves SIGINT to its default: the process ends at once.
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&path).unwrap();
    let header = std::str::from_utf8(&bytes[10..128]).unwrap();
    let shape = &header[header.find("'shape': (").unwrap() + 10..];
    let (rows, cols) = shape[..shape.find(')').unwrap()].split_once(", ").unwrap();
    let (rows, cols): (usize, usize) = (rows.parse().unwrap(), cols.parse().unwrap());
    let row_bytes = cols * 4;
    let data = bytes.len() - 128;
    assert!(rows * row_bytes >= 64 << 10, "{rows} rows in the header");
    // Every counted row is on the file; at most one more was written (whole,
    // when the interrupt fell between a row and its header update) or being
    // written.
    assert!(
        data >= rows * row_bytes && data <= (rows + 1) * row_bytes,
        "{rows} rows of {row_bytes} bytes, {data} bytes of data"
    );
}

/// `les run --conversation` (`--cnv`): the prompt, or the first line of
/// stdin, then each further line is a turn answered in the same session,
/// until end of input or `/exit`; it does not mix with --json or --logits-out.
/// (Images and `/clear`: `vision_cli`.)
/// `les run -m model args...` with `stdin` written to its standard input.
fn run_with_stdin(model: &Path, args: &[&str], stdin: &str) -> Output {
    cli::with_stdin(
        les().args(["run", "-m"]).arg(model).args(args),
        stdin.as_bytes(),
    )
}

#[test]
fn conversation_answers_each_line_of_stdin() {
    let m = model("qwen35moe");
    let converse = |extra: &[&str], stdin: &str| {
        let out = run_with_stdin(&m, &[&["--temp", "0", "-n", "6"], extra].concat(), stdin);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{extra:?}: {err}");
        (out.stdout, err)
    };
    // Two more turns after the prompt's, an empty line skipped.
    let (_, err) = converse(&["--cnv", "-p", "Hello"], "How are you?\n\nAnd then?\n");
    assert_eq!(err.matches("les: turn of").count(), 2, "{err}");
    assert!(err.contains("positions used"), "{err}");
    // A line ending in \ goes on on the next; /image needs a projector;
    // /exit ends.
    let (_, err) = converse(
        &["--cnv", "-p", "Hello"],
        "/image x.png\nLine one\\\nline two\n/exit\nNot read\n",
    );
    assert_eq!(err.matches("les: turn of").count(), 1, "{err}");
    assert!(err.contains("/image needs a vision projector"), "{err}");
    // Without a prompt the first line is the first turn; the same first reply.
    let (a, _) = converse(&["--conversation", "-p", "Hello"], "");
    let (b, err) = converse(&["--conversation"], "Hello\n");
    assert_eq!(a, b);
    assert_eq!(err.matches("les: turn of").count(), 0, "{err}");
    // Lines read escapes as -p does (llama-cli's), unless --no-escape.
    let (c, _) = converse(&["--conversation"], "\\x48ello\n");
    assert_eq!(c, b);
    let (out, err) = converse(&["--conversation"], "\\xff\n");
    assert!(out.is_empty(), "{err}");
    assert!(err.contains("was not sent"), "{err}");
    let (out, err) = converse(&["--conversation", "--no-escape"], "\\xff\n");
    assert!(!out.is_empty(), "{err}");
    // Nothing read, nothing done.
    let (out, _) = converse(&["--conversation"], "");
    assert!(out.is_empty());
    // A stop string ends a turn (cut there), and the conversation goes on.
    let (plain, _) = converse(&["--cnv", "-p", "Hello"], "More\n");
    let plain = String::from_utf8(plain).unwrap();
    let at: Vec<usize> = plain.char_indices().map(|(i, _)| i).collect();
    let stop = &plain[at[1]..at[3]];
    assert!(!stop.contains(['\n', '\\']), "{plain:?}");
    let flag = format!("--stop={stop}");
    let (cut, err) = converse(&["--cnv", "-p", "Hello", &flag], "More\n");
    let cut = String::from_utf8(cut).unwrap();
    let first = &plain[..plain.find(stop).unwrap()];
    assert!(
        cut.starts_with(&format!("{first}\n")),
        "{cut:?} after {plain:?}"
    );
    assert_eq!(err.matches("les: turn of").count(), 1, "{err}");
    // MTP drafting carries across the turns too.
    let (_, err) = converse(
        &[
            "--cnv",
            "-p",
            "Hello",
            "--speculate",
            "mtp",
            "--draft-fixed",
        ],
        "More\n",
    );
    assert_eq!(err.matches("les: turn of").count(), 1, "{err}");
    for extra in [&["--json"][..], &["--logits-out", "/tmp/x.npy"]] {
        let out = les()
            .args(["run", "-m"])
            .arg(&m)
            .args(["--cnv", "-p", "x"])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
    }
}

/// `--grammar` / `--grammar-file` (llama.cpp's GBNF): every reply is text the
/// grammar derives, at any temperature and with speculative decoding (the
/// same tokens as without), ending where the grammar is complete; a grammar
/// that can allow nothing more (complete, end of generation banned) stops
/// with `"stop": "grammar"`; each conversation turn starts the grammar over.
#[test]
fn grammar_constrains_the_reply() {
    let m = model("qwen3moe");
    let yes_no = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../grammars/yes_no.gbnf")
        .to_str()
        .unwrap()
        .to_string();
    for extra in [
        &["--temp", "0"][..],
        &["--temp", "1.5", "--seed", "1"],
        &["--temp", "1.5", "--seed", "2", "--top-k", "0"],
        &[
            "--temp", "1.5", "--seed", "3", "--top-k", "0", "--top-p", "0.5",
        ],
    ] {
        let v = json_run(
            &m,
            &[&["--grammar-file", &yes_no, "-n", "20"], extra].concat(),
        );
        let text = v["text"].as_str().unwrap();
        assert!(text == "yes" || text == "no", "{extra:?}: {text:?}");
        assert_eq!(v["stats"]["stop"], "eog", "{extra:?}");
    }
    // A grammar a reply can only finish one way: a small JSON object.
    let g = r#"root ::= "{\"n\": " [1-9] [0-9]{0,2} ", \"ok\": " ("true" | "false") "}""#;
    let plain = json_run(&m, &["--temp", "0", "-n", "40", "--grammar", g]);
    let text = plain["text"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        parsed["n"].as_u64().is_some_and(|n| (1..1000).contains(&n)),
        "{text}"
    );
    assert!(parsed["ok"].is_boolean(), "{text}");
    // Speculative decoding samples the same tokens under the grammar.
    let spec = json_run(
        &m,
        &[
            "--temp",
            "0",
            "-n",
            "40",
            "--grammar",
            g,
            "--speculate",
            "ngram",
        ],
    );
    assert_eq!(tokens(&spec), tokens(&plain));
    // Complete, with the end of generation banned: nothing is allowed.
    let out = run(
        &m,
        &[
            "--temp",
            "0",
            "-n",
            "20",
            "--grammar",
            "root ::= \"yes\"",
            "--ignore-eos",
            "--json",
        ],
    );
    let v = json_ok(out, "grammar with --ignore-eos");
    assert_eq!(v["text"], "yes");
    assert_eq!(v["stats"]["stop"], "grammar");
    // Each conversation turn follows the grammar from its start.
    let out = run_with_stdin(
        &m,
        &[
            "--temp",
            "0",
            "-n",
            "10",
            "--cnv",
            "-p",
            "Hello",
            "--grammar-file",
            &yes_no,
        ],
        "Again?\nAnd again?\n",
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let replies: Vec<&str> = stdout.lines().collect();
    assert_eq!(replies.len(), 3, "{stdout:?}");
    assert!(
        replies.iter().all(|r| *r == "yes" || *r == "no"),
        "{stdout:?}"
    );
}

/// Bad grammars are one-line errors naming the flag or file and the place.
#[test]
fn grammar_errors_are_clear() {
    let m = model("qwen3moe");
    let dir = tmp("grammar_errors");
    std::fs::create_dir_all(&dir).unwrap();
    let big = dir.join("big.gbnf");
    std::fs::write(&big, vec![b'#'; (1 << 20) + 1]).unwrap();
    let latin1 = dir.join("latin1.gbnf");
    std::fs::write(&latin1, b"root ::= \"\xe9\"\n").unwrap();
    let missing = dir.join("missing.gbnf");
    for (args, want) in [
        (
            vec!["--grammar", "root ::= undefined"],
            "--grammar: grammar: undefined rule `undefined`".to_string(),
        ),
        (
            vec!["--grammar", "root ::= \"a\"\nx ::= \"b\" }"],
            "expecting a line break or the end at line 2, column 11".into(),
        ),
        (
            vec!["--grammar", "item ::= \"a\""],
            "--grammar: grammar: no `root` rule".into(),
        ),
        (
            vec!["--grammar", "root ::= root \"a\""],
            "left-recursive".into(),
        ),
        (
            vec!["--grammar-file", big.to_str().unwrap()],
            "grammar file larger than 1 MiB".into(),
        ),
        (
            vec!["--grammar-file", latin1.to_str().unwrap()],
            "grammar is not UTF-8".into(),
        ),
        (
            vec!["--grammar-file", missing.to_str().unwrap()],
            format!("{}", missing.display()),
        ),
    ] {
        let out = run(&m, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(&want), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
    let out = run(&m, &["--grammar", "root ::= \"a\"", "--grammar-file", "x"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `-j`/`--json-schema` (and `--json-schema-file`, llama.cpp's `-jf`): the
/// reply is a JSON document of the schema, required members first in
/// schema order; unsupported keywords are one-line errors naming them.
#[test]
fn json_schema_shapes_the_reply() {
    let m = model("qwen3moe");
    let schema = r#"{"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}, "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}, "required": ["n", "ok", "tag", "xs"]}"#;
    let file = tmp("schema.json");
    std::fs::write(&file, schema).unwrap();
    for (seed, flag, value) in [
        ("1", "-j", schema.to_string()),
        ("2", "--json-schema", schema.to_string()),
        (
            "3",
            "--json-schema-file",
            file.to_str().unwrap().to_string(),
        ),
    ] {
        let v = json_run(
            &m,
            &["--temp", "0.8", "--seed", seed, "-n", "200", flag, &value],
        );
        let text = v["text"].as_str().unwrap();
        assert_eq!(v["stats"]["stop"], "eog", "{text:?}");
        let doc: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let keys: Vec<&str> = doc
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys.len(), 4, "{text}");
        assert!(doc["n"].is_i64() || doc["n"].is_u64(), "{text}");
        assert!(doc["ok"].is_boolean(), "{text}");
        assert!(doc["tag"] == "a" || doc["tag"] == "b", "{text}");
        let xs = doc["xs"].as_array().unwrap();
        assert!(
            xs.len() <= 3 && xs.iter().all(|x| x.is_i64() || x.is_u64()),
            "{text}"
        );
        // In the schema's order.
        let at = |k: &str| text.find(&format!("\"{k}\"")).unwrap();
        assert!(
            at("n") < at("ok") && at("ok") < at("tag") && at("tag") < at("xs"),
            "{text}"
        );
    }
    // A string pattern: the value matches it, its quote and backslash escaped.
    for seed in ["1", "2", "3"] {
        let v = json_run(
            &m,
            &[
                "--temp",
                "0.8",
                "--seed",
                seed,
                "-n",
                "200",
                "-j",
                r#"{"type": "string", "pattern": "^[ab\"\\\\]{2}-\\d{1,3}$"}"#,
            ],
        );
        let text = v["text"].as_str().unwrap();
        assert_eq!(v["stats"]["stop"], "eog", "{text:?}");
        let doc: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let s = doc.as_str().unwrap_or_else(|| panic!("{text}"));
        let (head, digits) = s.split_once('-').unwrap_or_else(|| panic!("{text}"));
        assert!(
            head.chars().count() == 2 && head.chars().all(|c| "ab\"\\".contains(c)),
            "{text}"
        );
        assert!(
            (1..=3).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()),
            "{text}"
        );
    }
    let out = run(&m, &["-j", r#"{"type": "number", "multipleOf": 2}"#]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--json-schema: json schema: unsupported keyword `multipleOf` at /"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let out = run(&m, &["-j", "{}", "--grammar", "root ::= \"a\""]);
    assert_eq!(out.status.code(), Some(2));
}

/// Every command's `--help` is plain text: the doc comments it is made of
/// hold no rustdoc links (`[`name`]` shown as brackets), and it exits 0.
#[test]
fn help_texts_have_no_rustdoc_links() {
    let out = les().arg("--help").output().unwrap();
    assert!(out.status.success());
    let top = String::from_utf8(out.stdout).unwrap();
    let commands: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 8, "{top}");
    for c in std::iter::once(None).chain(commands.iter().map(Some)) {
        let mut cmd = les();
        cmd.args(c).arg("--help");
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{c:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(!text.contains("[`"), "les {c:?} --help:\n{text}");
    }
}
