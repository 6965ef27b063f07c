//! `les perplexity` end to end on synthetic models: the same numbers under
//! every schedule and batch size, each chunk evaluated from a fresh state,
//! base files written and read back, KL divergence that sees a requantized
//! pack, and bad input refused with a clear error. (Against llama.cpp's
//! `llama-perplexity`, both ways, see the README.)

mod cli;

use std::path::{Path, PathBuf};
use std::process::Output;

use cli::{json_ok, les, pack, stdout_ok, synth_once, tmp};

fn model(arch: &str) -> PathBuf {
    synth_once(
        &format!("ppl_{arch}.gguf"),
        &["--arch", arch, "--preset", "tiny", "--seed", "4", "--quiet"],
    )
}

/// The synthetic models' sample text (~2500 tokens).
fn text() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/synth/sample.txt")
}

fn ppl(model: &Path, extra: &[&str]) -> Output {
    les()
        .args(["perplexity", "-m"])
        .arg(model)
        .args(["-t", "2"])
        .args(extra)
        .output()
        .unwrap()
}

fn with_text<'a>(extra: &[&'a str], text: &'a Path) -> Vec<&'a str> {
    [&["-f", text.to_str().unwrap()], extra].concat()
}

#[test]
fn every_schedule_and_batch_size_gives_the_same_perplexity() {
    for arch in ["qwen3moe", "qwen35moe"] {
        let m = model(arch);
        let packed = tmp(&format!("ppl_{arch}.packed.gguf"));
        pack(&m, &packed);
        let t = text();
        let base_args = with_text(&["-c", "64", "--chunks", "5"], &t);
        let want = stdout_ok(ppl(&m, &base_args), "resident");
        assert!(want.starts_with("[1]") && want.contains("[5]"), "{want}");
        assert!(want.contains("Final estimate: PPL = "), "{want}");
        for (model, extra) in [
            (&m, &["-b", "1"][..]),
            (&m, &["-b", "7"]),
            (&m, &["--schedule", "on-demand", "--slots", "3"]),
            (&m, &["--schedule", "les", "--slots", "3", "-b", "1"]),
            (&packed, &["--schedule", "les", "--slots", "4", "-b", "5"]),
            (&packed, &["--cache-type-k", "f16"]),
        ] {
            let got = stdout_ok(ppl(model, &[&base_args[..], extra].concat()), "streamed");
            assert_eq!(got, want, "{arch} {extra:?}");
        }
        // The JSON has the same numbers.
        let v = json_ok(ppl(&m, &[&base_args[..], &["--json"]].concat()), "json");
        let running = v["running_ppl"].as_array().unwrap();
        assert_eq!(running.len(), 5);
        assert_eq!(v["scored"], 5 * 31);
        let last = running[4].as_f64().unwrap();
        assert!(want.contains(&format!("[5]{last:.4},")), "{want} vs {last}");
        assert_eq!(v["ppl"].as_f64().unwrap(), last);
    }
}

/// A base file (here les's own) holds the tokens and the scored positions'
/// log-probabilities; compared with the model that wrote it, the divergence
/// is that of 16-bit rounding and every top token is the same. A file whose
/// first chunk is made a copy of its second gives that chunk's numbers twice:
/// each chunk starts from a fresh state (here qwen35moe's recurrent one).
#[test]
fn base_files_round_trip_and_chunks_start_afresh() {
    let m = model("qwen35moe");
    let base = tmp("ppl_q35.base");
    let t = text();
    let plain = stdout_ok(
        ppl(
            &m,
            &[
                &with_text(&["-c", "64", "--chunks", "2"], &t)[..],
                &["--kl-divergence-base", base.to_str().unwrap()],
            ]
            .concat(),
        ),
        "write base",
    );
    // Written under a temporary name, renamed when complete.
    let leftovers = std::fs::read_dir(base.parent().unwrap())
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().contains(".les-base-")
        })
        .count();
    assert_eq!(leftovers, 0);
    let (n_ctx, n_chunk, n_vocab) = (64usize, 2usize, 300usize);
    let bytes = std::fs::read(&base).unwrap();
    let row = (2 * n_vocab.div_ceil(2) + 4) * 2;
    let rows = n_ctx - 1 - n_ctx / 2;
    assert_eq!(&bytes[..8], b"_logits_");
    assert_eq!(
        bytes.len(),
        20 + n_chunk * n_ctx * 4 + n_chunk * rows * row,
        "llama.cpp's layout"
    );
    let compare = |path: &Path| {
        json_ok(
            ppl(
                &m,
                &[
                    "--kl-divergence",
                    "--kl-divergence-base",
                    path.to_str().unwrap(),
                    "--json",
                ],
            ),
            "compare",
        )
    };
    let v = compare(&base);
    let kld = &v["kld"];
    assert!(kld["mean"].as_f64().unwrap().abs() < 1e-4, "{v}");
    assert_eq!(kld["same_top"], 1.0, "{v}");
    // The base's perplexity is the plain run's, to the file's rounding.
    let final_ppl: f64 = plain
        .rsplit("PPL = ")
        .next()
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let ppl_base = kld["ppl_base"].as_f64().unwrap();
    assert!(
        (ppl_base / final_ppl - 1.0).abs() < 1e-3,
        "{ppl_base} vs {final_ppl}"
    );
    // (f32 and f64 log-likelihoods, and the report's 4 decimals.)
    assert!((kld["ppl"].as_f64().unwrap() / final_ppl - 1.0).abs() < 1e-5);

    // Chunk 2 twice: tokens and rows.
    let mut twice = bytes.clone();
    let (tok0, tok_len) = (20, n_ctx * 4);
    twice.copy_within(tok0 + tok_len..tok0 + 2 * tok_len, tok0);
    let rows0 = tok0 + n_chunk * tok_len;
    twice.copy_within(rows0 + rows * row..rows0 + 2 * rows * row, rows0);
    let path = tmp("ppl_q35_twice.base");
    std::fs::write(&path, &twice).unwrap();
    let v = compare(&path);
    let r = v["running_ppl"].as_array().unwrap();
    let (a, b) = (r[0].as_f64().unwrap(), r[1].as_f64().unwrap());
    assert!(
        (a / b - 1.0).abs() < 1e-12,
        "chunk 2 alone {a}, after itself {b}"
    );
    assert!(v["kld"]["mean"].as_f64().unwrap().abs() < 1e-4, "{v}");
}

/// Experts requantized from q8_0 to q4_0 move the distributions away from
/// the base's, far more than writing the same types again does.
#[test]
fn kl_divergence_sees_a_requantized_pack() {
    let m = synth_once(
        "ppl_q8.gguf",
        &[
            "--arch",
            "qwen3moe",
            "--preset",
            "tiny",
            "--expert-type",
            "q8_0",
            "--quiet",
        ],
    );
    let base = tmp("ppl_q8.base");
    let t = text();
    stdout_ok(
        ppl(
            &m,
            &[
                &with_text(&["-c", "128", "--chunks", "4"], &t)[..],
                &["--kl-divergence-base", base.to_str().unwrap()],
            ]
            .concat(),
        ),
        "write base",
    );
    let kld = |plan: &str| {
        let out = tmp(&format!("ppl_q8_{}.gguf", plan.replace([':', '-'], "_")));
        stdout_ok(
            les()
                .arg("pack")
                .arg(&m)
                .arg("-o")
                .arg(&out)
                .args(["--expert-types", plan, "--quiet"])
                .output()
                .unwrap(),
            "pack",
        );
        let args = [
            "--kl-divergence",
            "--kl-divergence-base",
            base.to_str().unwrap(),
            "--json",
        ];
        json_ok(ppl(&out, &args), "compare")["kld"].clone()
    };
    let same = kld("0-:q8_0");
    let q4 = kld("0-:q4_0");
    let (same_mean, q4_mean) = (same["mean"].as_f64().unwrap(), q4["mean"].as_f64().unwrap());
    assert!(same_mean.abs() < 1e-4, "{same}");
    assert!(
        q4_mean > 1e-3 && q4_mean > 20.0 * same_mean.abs(),
        "{q4} vs {same}"
    );
    // The text report has llama-perplexity's sections.
    let report = stdout_ok(
        ppl(
            &m,
            &[
                "--kl-divergence",
                "--kl-divergence-base",
                base.to_str().unwrap(),
            ],
        ),
        "report",
    );
    for section in [
        "====== Perplexity statistics ======",
        "Mean PPL(Q)/PPL(base)",
        "====== KL divergence statistics ======",
        "Median  KLD:",
        "====== Token probability statistics ======",
        "Same top p:",
    ] {
        assert!(report.contains(section), "{section}: {report}");
    }
}

#[test]
fn bad_inputs_fail_with_clear_errors() {
    let m = model("qwen3moe");
    let t = text();
    let fails = |args: &[&str], want: &str| {
        let o = ppl(&m, args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
    };
    fails(&with_text(&["-c", "4096"], &t), "needs at least 8192");
    let base = |name: &str, bytes: &[u8]| {
        let p = tmp(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let kl = |p: &Path| {
        vec![
            "--kl-divergence".to_string(),
            "--kl-divergence-base".to_string(),
            p.to_str().unwrap().to_string(),
        ]
    };
    let run_kl = |p: &Path, want: &str| {
        let args = kl(p);
        fails(&args.iter().map(String::as_str).collect::<Vec<_>>(), want);
    };
    run_kl(
        &base("ppl_garbage.base", b"not a base file at all"),
        "not a file of base log-probabilities",
    );
    let header = |ctx: i32, vocab: i32, chunks: i32| {
        let mut h = b"_logits_".to_vec();
        for v in [ctx, vocab, chunks] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        h
    };
    // Counts that would ask for huge buffers are checked against the size.
    run_kl(
        &base("ppl_huge.base", &header(1 << 20, 300, i32::MAX)),
        "truncated",
    );
    run_kl(
        &base("ppl_neg.base", &header(-5, 300, 1)),
        "not a valid base file",
    );
    run_kl(
        &base("ppl_vocab.base", &header(64, 301, 1)),
        "vocabulary of 301 tokens",
    );
    // A token outside the vocabulary.
    let rows = 31 * (2 * 150 + 4) * 2;
    let mut bad = header(64, 300, 1);
    bad.extend((0..64).flat_map(|i: i32| if i == 9 { 300 } else { i }.to_le_bytes()));
    bad.resize(bad.len() + rows, 0);
    run_kl(&base("ppl_token.base", &bad), "outside the vocabulary");
    let missing = tmp("ppl_no_such.base");
    run_kl(&missing, "ppl_no_such.base");
    // --kl-divergence needs the base file and takes no text.
    let o = ppl(&m, &["--kl-divergence"]);
    assert_eq!(o.status.code(), Some(2));
    let o = ppl(
        &m,
        &with_text(&["--kl-divergence", "--kl-divergence-base", "x"], &t),
    );
    assert_eq!(o.status.code(), Some(2));
}
