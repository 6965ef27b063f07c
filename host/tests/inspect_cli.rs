//! End-to-end tests of `les inspect`.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;
use les::gguf::{Gguf, GgufWriter};
use les_core::quant::GgmlType;
use serde_json::Value as Json;

fn les(args: &[&str], file: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_les"))
        .args(args)
        .arg(file)
        .output()
        .expect("les runs")
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "les failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).expect("UTF-8 output")
}

#[test]
fn inspect_python_model_text() {
    let path = tmp("inspect_text.gguf");
    python_model(&path);
    let out = stdout(&les(&["inspect"], &path));
    for needle in [
        "architecture  qwen3moe",
        "hyperparameters (qwen3moe.*)",
        "block_count",
        "expert_feed_forward_length",
        "attention.head_count_kv",
        "tokenizer.ggml.tokens",
        "[string; 3005]",
        "blk.1.ffn_down_exps.weight",
        "q8_0",
        "32 x 64 x 4",
        "experts (expert_count 4, expert_used_count 2)",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    // Per layer: three Q8_0 tensors of 4 experts x 32 rows x 68 bytes = 26112,
    // 6528 per expert.
    let layer0 = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some("0"))
        .expect("a row for layer 0");
    assert_eq!(
        layer0.split_whitespace().collect::<Vec<_>>(),
        ["0", "26112", "6528"]
    );
    assert!(out.contains("total expert bytes"), "{out}");
    assert!(out.contains("non-expert bytes"), "{out}");
}

#[test]
fn inspect_python_model_json() {
    let path = tmp("inspect_json.gguf");
    python_model(&path);
    let out = stdout(&les(&["inspect", "--json"], &path));
    let j: Json = serde_json::from_str(&out).expect("valid JSON");
    let g = Gguf::open(&path).unwrap();

    assert_eq!(j["architecture"], "qwen3moe");
    assert_eq!(j["version"], 3);
    assert_eq!(j["data_offset"], g.data_offset());
    let hp = &j["hyperparameters"];
    assert_eq!(hp["block_count"], 2);
    assert_eq!(hp["expert_count"], 4);
    assert_eq!(hp["expert_used_count"], 2);
    assert_eq!(hp["embedding_length"], 64);
    assert_eq!(hp["rope.freq_base"], 1e6);
    assert_eq!(hp["attention.layer_norm_rms_epsilon"], 1e-6);
    assert_eq!(j["metadata"]["general.name"]["value"], "tiny interop model");
    assert_eq!(j["metadata"]["tokenizer.ggml.tokens"]["len"], 3005);
    assert_eq!(
        j["metadata"]["test.arr_nested"]["value"][2],
        serde_json::json!([4, 5, 6])
    );

    let tensors = j["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), g.tensor_count());
    for (t, jt) in g.tensors().zip(tensors) {
        assert_eq!(jt["name"], t.name());
        assert_eq!(jt["type"], t.ggml_type().name());
        assert_eq!(jt["dims"], serde_json::json!(t.dims()));
        assert_eq!(jt["bytes"], t.size());
        assert_eq!(jt["offset"], t.offset());
    }

    let total: u64 = g.tensors().map(|t| t.size()).sum();
    let e = &j["experts"];
    assert_eq!(e["expert_count"], 4);
    assert_eq!(e["total_expert_bytes"], 6 * 8704);
    assert_eq!(e["non_expert_bytes"], total - 6 * 8704);
    let layers = e["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    for (i, l) in layers.iter().enumerate() {
        assert_eq!(l["layer"], i);
        assert_eq!(l["bytes"], 3 * 8704);
        assert_eq!(l["bytes_per_expert"], 3 * 8704 / 4);
    }
}

#[test]
fn inspect_without_expert_count_uses_tensor_shape() {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama").unwrap();
    w.add_kv("llama.block_count", 1u64).unwrap();
    let dims = [[32u64, 8, 3], [32, 8, 3], [8, 32, 3]];
    let names = ["gate", "up", "down"];
    for (n, d) in names.iter().zip(&dims) {
        w.add_tensor(format!("blk.0.ffn_{n}_exps.weight"), d, GgmlType::F16)
            .unwrap();
    }
    w.add_tensor("blk.0.ffn_gate_shexp.weight", &[32, 8], GgmlType::F32)
        .unwrap();
    let mut data = w.write_header(Vec::new()).unwrap();
    while let Some((name, size)) = data.next_tensor() {
        let name = name.to_owned();
        data.write_tensor(&name, &vec![0; size as usize]).unwrap();
    }
    let path = tmp("inspect_no_count.gguf");
    std::fs::write(&path, data.finish().unwrap()).unwrap();

    let out = stdout(&les(&["inspect", "--json"], &path));
    let j: Json = serde_json::from_str(&out).unwrap();
    let e = &j["experts"];
    assert_eq!(e["expert_count"], Json::Null);
    assert_eq!(e["layers"][0]["bytes"], 3 * 32 * 8 * 3 * 2);
    assert_eq!(e["layers"][0]["bytes_per_expert"], 3 * 32 * 8 * 2);
    assert_eq!(e["non_expert_bytes"], 32 * 8 * 4);
}

fn assert_one_line_error(o: &Output) -> String {
    assert!(!o.status.success(), "les should fail");
    assert!(o.stdout.is_empty(), "nothing on stdout");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    err
}

#[test]
fn inspect_corrupt_file_fails_with_one_line() {
    let path = tmp("inspect_corrupt_src.gguf");
    python_model(&path);
    let bytes = std::fs::read(&path).unwrap();

    let truncated = tmp("inspect_truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    for args in [&["inspect"][..], &["inspect", "--json"]] {
        let err = assert_one_line_error(&les(args, &truncated));
        assert!(err.contains("at byte"), "{err}");
    }

    // Cut inside the tensor data: the error names the tensor.
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let err = assert_one_line_error(&les(&["inspect"], &truncated));
    assert!(err.contains("tensor 'blk.1.ffn_down_exps.weight'"), "{err}");

    let mut bad = bytes.clone();
    bad[..4].copy_from_slice(b"GGJT");
    let bad_magic = tmp("inspect_bad_magic.gguf");
    std::fs::write(&bad_magic, &bad).unwrap();
    let err = assert_one_line_error(&les(&["inspect"], &bad_magic));
    assert!(err.contains("not a GGUF file"), "{err}");

    let err = assert_one_line_error(&les(&["inspect"], &tmp("does-not-exist.gguf")));
    assert!(err.contains("does-not-exist.gguf"), "{err}");
}

#[test]
fn inspect_counts_packed_experts() {
    let dir = std::env::temp_dir().join(format!("les-inspect-packed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (plain, packed) = (dir.join("tiny.gguf"), dir.join("tiny.packed.gguf"));
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_les"))
            .args(args)
            .output()
            .expect("les runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let (p, q) = (plain.to_str().unwrap(), packed.to_str().unwrap());
    run(&[
        "synth", "--arch", "qwen3moe", "--preset", "tiny", "--quiet", "-o", p,
    ]);
    run(&["pack", "--quiet", p, "-o", q]);
    let json = |f: &Path| -> Json {
        serde_json::from_str(&stdout(&les(&["inspect", "--json"], f))).unwrap()
    };
    let (a, b) = (json(&plain), json(&packed));
    let (ea, eb) = (&a["experts"], &b["experts"]);
    let (la, lb) = (
        ea["layers"].as_array().unwrap(),
        eb["layers"].as_array().unwrap(),
    );
    assert_eq!(la.len(), 4);
    assert_eq!(lb.len(), la.len(), "{eb}");
    for (x, y) in la.iter().zip(lb) {
        // One extent per expert: the expert's bytes rounded up to 4 KiB.
        let per = x["bytes_per_expert"].as_u64().unwrap();
        assert_eq!(
            y["bytes_per_expert"].as_u64().unwrap(),
            per.div_ceil(4096) * 4096
        );
    }
    assert!(
        eb["total_expert_bytes"].as_u64().unwrap() >= ea["total_expert_bytes"].as_u64().unwrap()
    );
    // The packed layers' types, alike layers as one run: `tiny`'s experts
    // are one type throughout.
    let runs = b["packed"]["types"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{}", b["packed"]);
    assert_eq!(runs[0]["layers"], "0-3");
    assert_eq!(runs[0]["matrices"], "gate / up / down");
    let ty = "q4_0";
    assert_eq!(runs[0]["types"], serde_json::json!([ty, ty, ty]));
    assert_eq!(runs[0]["expert_bytes"], la[0]["bytes_per_expert"]);
    let text = stdout(&les(&["inspect"], &packed));
    assert!(
        text.contains(&format!(
            "  layers 0-3: {ty} / {ty} / {ty} (gate / up / down)"
        )),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Keys and tensor names come from the file: printed with their control
/// characters escaped, so a file cannot move the cursor, retitle the terminal
/// or forge lines of the listing.
#[test]
fn inspect_escapes_control_characters_in_names() {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama").unwrap();
    w.add_kv("evil\nsecond line \u{1b}[31mRED", 1u32).unwrap();
    w.add_tensor("t\u{1b}]0;pwned\u{7}", &[4], GgmlType::F32)
        .unwrap();
    let mut data = w.write_header(Vec::new()).unwrap();
    while let Some((name, size)) = data.next_tensor() {
        let name = name.to_owned();
        data.write_tensor(&name, &vec![0; size as usize]).unwrap();
    }
    let path = tmp("inspect_escapes.gguf");
    std::fs::write(&path, data.finish().unwrap()).unwrap();
    let out = stdout(&les(&["inspect"], &path));
    assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
    assert!(out.contains(r"evil\nsecond line \u{1b}[31mRED  1"), "{out}");
    assert!(out.contains(r"t\u{1b}]0;pwned\u{7}  f32"), "{out}");
    assert!(!out.lines().any(|l| l.starts_with("second line")), "{out}");
}

/// A packed file's index is checked as `les run` checks it, and `--verify`
/// checks every expert's bytes: a corrupt one fails the command, naming it,
/// after the listing.
#[test]
fn inspect_checks_a_packed_index_and_verifies_its_experts() {
    let (plain, packed) = (tmp("inspect_pk.gguf"), tmp("inspect_pk.packed.gguf"));
    let run = |args: &[&std::ffi::OsStr]| {
        Command::new(env!("CARGO_BIN_EXE_les"))
            .args(args)
            .output()
            .unwrap()
    };
    let synth = run(&[
        "synth".as_ref(),
        "--arch".as_ref(),
        "qwen3moe".as_ref(),
        "--preset".as_ref(),
        "tiny".as_ref(),
        "--quiet".as_ref(),
        "-o".as_ref(),
        plain.as_os_str(),
    ]);
    assert!(synth.status.success());
    let _ = std::fs::remove_file(&packed);
    let pack = run(&[
        "pack".as_ref(),
        "--quiet".as_ref(),
        plain.as_os_str(),
        "-o".as_ref(),
        packed.as_os_str(),
    ]);
    assert!(
        pack.status.success(),
        "{}",
        String::from_utf8_lossy(&pack.stderr)
    );

    let out = stdout(&les(&["inspect", "--verify"], &packed));
    assert!(out.contains("packed by les pack: 4 layers"), "{out}");
    assert!(out.contains("match their CRC-32"), "{out}");
    let j: Json =
        serde_json::from_str(&stdout(&les(&["inspect", "--json", "--verify"], &packed))).unwrap();
    assert_eq!(j["packed"]["valid"], true, "{j}");
    assert!(j["packed"]["verified_experts"].as_u64().unwrap() > 0, "{j}");
    let j: Json = serde_json::from_str(&stdout(&les(&["inspect", "--json"], &plain))).unwrap();
    assert!(j["packed"].is_null(), "{j}");

    // One flipped byte inside layer 1's first expert.
    let offset = Gguf::open(&packed)
        .unwrap()
        .tensor("blk.1.ffn_exps_packed.weight")
        .unwrap()
        .offset();
    let mut bytes = std::fs::read(&packed).unwrap();
    bytes[offset as usize + 100] ^= 0x40;
    let bad = tmp("inspect_pk_bad.gguf");
    std::fs::write(&bad, &bytes).unwrap();
    let plain_listing = les(&["inspect"], &bad);
    assert!(plain_listing.status.success(), "the index itself is intact");
    let o = les(&["inspect", "--verify"], &bad);
    assert!(!o.status.success());
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(listing.contains("packed by les pack: INVALID"), "{listing}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.trim_end()
            .ends_with("error: bad packed layout: checksum mismatch in expert 0 of layer 1"),
        "{err}"
    );

    // A broken index fails without --verify.
    rewrite_gguf(
        &packed,
        &bad,
        |k, v| {
            Some(if k == "les.pack.blk.2.stride" {
                0u64.into()
            } else {
                v
            })
        },
        vec![],
    );
    let o = les(&["inspect"], &bad);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("packed by les pack: INVALID"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("les.pack.blk.2.stride = 0"), "{err}");
    for p in [plain, packed, bad] {
        std::fs::remove_file(p).unwrap();
    }
}
