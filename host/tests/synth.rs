//! End-to-end tests of `les synth`: the files it writes load as their architecture
//! in the Python `gguf` package and in our reader, are deterministic, carry a
//! consistent tokenizer, and route the way the knobs say.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use les::gguf::Gguf;
use les::synth::probe::{probe, ProbeReport};
use les_core::quant::GgmlType;
use serde_json::Value as Json;

fn les(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_les"))
        .args(args)
        .output()
        .expect("les runs")
}

fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "les failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("UTF-8 output")
}

/// Writes a model with `les synth ARGS -o <tmp/name>` and returns its path.
fn synth(name: &str, args: &[&str]) -> PathBuf {
    let path = tmp(name);
    let mut all = vec!["synth"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["-o", path.to_str().unwrap(), "--quiet"]);
    ok(les(&all));
    path
}

const Q8: GgmlType = GgmlType::Q8_0;
const Q4: GgmlType = GgmlType::Q4_0;
const F32: GgmlType = GgmlType::F32;

/// The tiny preset's tensors as llama.cpp names and shapes them (`ne`, innermost
/// first), written out by hand from `src/models/<arch>.cpp`: 64 wide, 4 query
/// heads of 16, 8 experts of 64, vocab 300.
fn expected_tensors(arch: &str) -> Vec<(String, Vec<u64>, GgmlType)> {
    let kv: u64 = if arch == "olmoe" { 64 } else { 32 };
    let mut t: Vec<(String, Vec<u64>, GgmlType)> =
        vec![("token_embd.weight".into(), vec![64, 300], Q8)];
    for l in 0..4 {
        let mut add = |n: &str, d: &[u64], ty| t.push((format!("blk.{l}.{n}"), d.to_vec(), ty));
        add("attn_norm.weight", &[64], F32);
        for (p, rows) in [("attn_q", 64), ("attn_k", kv), ("attn_v", kv)] {
            add(&format!("{p}.weight"), &[64, rows], Q8);
            if arch == "qwen2moe" {
                add(&format!("{p}.bias"), &[rows], F32);
            }
        }
        add("attn_output.weight", &[64, 64], Q8);
        match arch {
            "qwen3moe" => {
                add("attn_q_norm.weight", &[16], F32);
                add("attn_k_norm.weight", &[16], F32);
            }
            "olmoe" => {
                add("attn_q_norm.weight", &[64], F32);
                add("attn_k_norm.weight", &[64], F32);
            }
            _ => {}
        }
        add("ffn_norm.weight", &[64], F32);
        if arch == "llama" {
            add("ffn_gate.weight", &[64, 128], Q8);
            add("ffn_up.weight", &[64, 128], Q8);
            add("ffn_down.weight", &[128, 64], Q8);
        } else {
            add("ffn_gate_inp.weight", &[64, 8], F32);
            add("ffn_gate_exps.weight", &[64, 64, 8], Q4);
            add("ffn_up_exps.weight", &[64, 64, 8], Q4);
            add("ffn_down_exps.weight", &[64, 64, 8], Q4);
        }
        if arch == "qwen2moe" {
            add("ffn_gate_inp_shexp.weight", &[64], F32);
            add("ffn_gate_shexp.weight", &[64, 128], Q8);
            add("ffn_up_shexp.weight", &[64, 128], Q8);
            add("ffn_down_shexp.weight", &[128, 64], Q8);
        }
    }
    t.push(("output_norm.weight".into(), vec![64], F32));
    t.push(("output.weight".into(), vec![64, 300], Q8));
    t
}

/// Checks one architecture's tiny model with our reader, the Python `gguf`
/// package and `les inspect --json`.
fn round_trip(cli_arch: &str) {
    let gguf_arch = if cli_arch == "mixtral" {
        "llama"
    } else {
        cli_arch
    };
    let path = synth(&format!("synth_rt_{cli_arch}.gguf"), &["--arch", cli_arch]);
    let g = Gguf::open(&path).unwrap();

    // Tensor names, shapes and types, in order.
    let expected = expected_tensors(if cli_arch == "mixtral" {
        "mixtral"
    } else {
        gguf_arch
    });
    let ours: Vec<(String, Vec<u64>, GgmlType)> = g
        .tensors()
        .map(|t| (t.name().to_string(), t.dims().to_vec(), t.ggml_type()))
        .collect();
    assert_eq!(ours, expected, "{cli_arch}");

    // Hyperparameters.
    let k = |s: &str| format!("{gguf_arch}.{s}");
    assert_eq!(g.architecture().unwrap(), gguf_arch);
    assert_eq!(g.get_u32("general.alignment").unwrap(), 32);
    assert_eq!(g.get_u32(&k("block_count")).unwrap(), 4);
    assert_eq!(g.get_u32(&k("embedding_length")).unwrap(), 64);
    assert_eq!(g.get_u32(&k("context_length")).unwrap(), 4096);
    assert_eq!(g.get_u32(&k("attention.head_count")).unwrap(), 4);
    let kv_heads = if gguf_arch == "olmoe" { 4 } else { 2 };
    assert_eq!(g.get_u32(&k("attention.head_count_kv")).unwrap(), kv_heads);
    assert_eq!(g.get_f32(&k("rope.freq_base")).unwrap(), 1e6);
    assert_eq!(
        g.get_f32(&k("attention.layer_norm_rms_epsilon")).unwrap(),
        1e-6
    );
    let ff = match cli_arch {
        "olmoe" | "mixtral" => 64,
        _ => 128,
    };
    assert_eq!(g.get_u32(&k("feed_forward_length")).unwrap(), ff);
    let flexible_heads = matches!(gguf_arch, "qwen3moe" | "llama");
    assert_eq!(g.contains_key(&k("attention.key_length")), flexible_heads);
    if flexible_heads {
        assert_eq!(g.get_u32(&k("attention.key_length")).unwrap(), 16);
        assert_eq!(g.get_u32(&k("attention.value_length")).unwrap(), 16);
    }
    if cli_arch == "llama" {
        assert!(!g.contains_key(&k("expert_count")));
    } else {
        assert_eq!(g.get_u32(&k("expert_count")).unwrap(), 8);
        assert_eq!(g.get_u32(&k("expert_used_count")).unwrap(), 2);
        assert_eq!(g.get_u32(&k("expert_feed_forward_length")).unwrap(), 64);
        assert_eq!(g.get_u32(&k("expert_gating_func")).unwrap(), 1);
        let norm = matches!(cli_arch, "qwen3moe" | "mixtral");
        assert_eq!(g.get_bool(&k("expert_weights_norm")).unwrap(), norm);
    }
    assert_eq!(
        g.contains_key(&k("expert_shared_feed_forward_length")),
        cli_arch == "qwen2moe"
    );
    assert_eq!(
        g.get_u32("general.file_type").unwrap(),
        if cli_arch == "llama" { 7 } else { 2 }
    );

    // The Python gguf package reads the same file the same way, and its own
    // dequantizers see the intended distributions.
    let py = python("synth_check.py", &[path.as_os_str()]);
    let py_tensors = py["tensors"].as_array().unwrap();
    assert_eq!(py_tensors.len(), g.tensor_count());
    for (t, p) in g.tensors().zip(py_tensors) {
        assert_eq!(p["name"], t.name());
        assert_eq!(p["type"], t.ggml_type().id());
        assert_eq!(p["dims"], serde_json::json!(t.dims()));
        assert_eq!(p["bytes"], t.size());
        let (mean, std) = (p["mean"].as_f64().unwrap(), p["std"].as_f64().unwrap());
        let name = t.name();
        let want_std = if name.ends_with("norm.weight") {
            assert!((mean - 1.0).abs() < 0.02, "{name}: mean {mean}");
            0.02
        } else if name == "token_embd.weight" {
            1.0
        } else if name.contains("attn_output") || name.contains("ffn_down") {
            0.5 / (t.dims()[0] as f64).sqrt()
        } else if name.ends_with(".bias") {
            0.1
        } else if name.contains("ffn_gate_inp.") {
            continue; // The router's spread includes the popularity term.
        } else {
            1.0 / (t.dims()[0] as f64).sqrt()
        };
        assert!(
            (std / want_std - 1.0).abs() < 0.3,
            "{name}: std {std}, want about {want_std}"
        );
    }
    let meta = &py["meta"];
    assert_eq!(meta["general.architecture"], gguf_arch);
    assert_eq!(meta[k("block_count")], 4);
    assert_eq!(meta["tokenizer.ggml.model"], "gpt2");
    assert_eq!(meta["tokenizer.ggml.pre"], "qwen2");
    for (key, v) in meta.as_object().unwrap() {
        let ours = g
            .get(key)
            .unwrap_or_else(|| panic!("{key} missing in our reader"));
        let ours = match (
            ours.as_integer(),
            ours.as_f64(),
            ours.as_bool(),
            ours.as_str(),
        ) {
            (Some(i), ..) => serde_json::json!(i as i64),
            (_, Some(f), ..) => serde_json::json!(f),
            (_, _, Some(b), _) => serde_json::json!(b),
            (_, _, _, Some(s)) => serde_json::json!(s),
            _ => panic!("{key}: unexpected type"),
        };
        assert_eq!(&ours, v, "{key}");
    }
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(
        py["arrays"]["tokenizer.ggml.tokens"],
        serde_json::json!(tokens)
    );

    // les inspect --json.
    let report: Json =
        serde_json::from_str(&ok(les(&["inspect", "--json", path.to_str().unwrap()]))).unwrap();
    assert_eq!(report["architecture"], gguf_arch);
    assert_eq!(report["tensors"].as_array().unwrap().len(), expected.len());
    if cli_arch != "llama" {
        assert_eq!(report["experts"]["expert_count"], 8);
        assert_eq!(report["experts"]["layers"].as_array().unwrap().len(), 4);
    }
}

#[test]
fn synth_round_trip_qwen3moe() {
    round_trip("qwen3moe");
}

#[test]
fn synth_round_trip_olmoe() {
    round_trip("olmoe");
}

#[test]
fn synth_round_trip_qwen2moe() {
    round_trip("qwen2moe");
}

#[test]
fn synth_round_trip_llama() {
    round_trip("llama");
}

#[test]
fn synth_round_trip_mixtral() {
    round_trip("mixtral");
}

#[test]
fn synth_llama_with_experts_is_mixtral() {
    let a = std::fs::read(synth(
        "synth_llama_x8.gguf",
        &["--arch", "llama", "--experts", "8"],
    ))
    .unwrap();
    let b = std::fs::read(synth("synth_mixtral.gguf", &["--arch", "mixtral"])).unwrap();
    // Same tensors and values; only general.name and les.synth.arch differ.
    let (ga, gb) = (Gguf::parse(&a[..]).unwrap(), Gguf::parse(&b[..]).unwrap());
    assert_eq!(ga.tensor_count(), gb.tensor_count());
    for (x, y) in ga.tensors().zip(gb.tensors()) {
        assert_eq!((x.name(), x.data()), (y.name(), y.data()));
    }
}

#[test]
fn synth_tied_embeddings_omit_output() {
    let g = Gguf::open(synth(
        "synth_tied.gguf",
        &["--arch", "qwen3moe", "--tie-embeddings"],
    ))
    .unwrap();
    assert!(g.tensor("output.weight").is_none());
    assert!(g.tensor("token_embd.weight").is_some());
    // olmoe and qwen2moe require output.weight.
    let o = les(&["synth", "--arch", "olmoe", "--tie-embeddings", "--dry-run"]);
    assert!(!o.status.success());
}

fn bytes_of(name: &str, args: &[&str]) -> Vec<u8> {
    std::fs::read(synth(name, args)).unwrap()
}

#[test]
fn synth_is_deterministic() {
    let base = ["--arch", "qwen3moe", "--layers", "3", "--seed", "42"];
    let a = bytes_of(
        "synth_det_a.gguf",
        &[&base[..], &["--threads", "1"]].concat(),
    );
    let b = bytes_of(
        "synth_det_b.gguf",
        &[&base[..], &["--threads", "3"]].concat(),
    );
    assert!(a == b, "same seed, different bytes");
    let c = bytes_of(
        "synth_det_c.gguf",
        &["--arch", "qwen3moe", "--layers", "3", "--seed", "43"],
    );
    assert_eq!(a.len(), c.len());
    assert!(a != c, "different seeds, same bytes");
    // Every tensor differs, not just the metadata.
    let (ga, gc) = (Gguf::parse(&a[..]).unwrap(), Gguf::parse(&c[..]).unwrap());
    for (x, y) in ga.tensors().zip(gc.tensors()) {
        assert_ne!(x.data(), y.data(), "{}", x.name());
    }
}

#[test]
fn synth_tokenizer_is_consistent() {
    for vocab in ["259", "300", "5000"] {
        let path = synth(
            &format!("synth_tok_{vocab}.gguf"),
            &["--arch", "qwen3moe", "--layers", "1", "--vocab", vocab],
        );
        let g = Gguf::open(&path).unwrap();
        let n: usize = vocab.parse().unwrap();
        let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
        let types: Vec<i64> = g
            .get_array("tokenizer.ggml.token_type")
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        let merges = g.get_str_array("tokenizer.ggml.merges").unwrap();
        assert_eq!(tokens.len(), n);
        assert_eq!(types.len(), n);
        assert_eq!(g.tensor("token_embd.weight").unwrap().dims()[1], n as u64);
        let set: HashSet<&str> = tokens.iter().copied().collect();
        assert_eq!(set.len(), n, "duplicate tokens");
        for m in &merges {
            let (a, b) = m.split_once(' ').expect("a merge is two tokens");
            assert!(set.contains(a), "merge {m:?}: {a:?} is not a token");
            assert!(set.contains(b), "merge {m:?}: {b:?} is not a token");
            assert!(
                set.contains(format!("{a}{b}").as_str()),
                "merge {m:?}: no result token"
            );
        }
        if n >= 5000 {
            assert!(merges.len() > 500, "{} merges", merges.len());
            assert!(tokens.contains(&"Ġthe"), "no ' the' token");
        }
        // The 256 byte tokens come first, in GPT-2 order.
        assert_eq!(tokens[0], "!");
        assert_eq!(tokens[255], "\u{143}");
        assert!(tokens.contains(&"\u{120}")); // 'Ġ', the space byte
        for (key, want) in [
            ("tokenizer.ggml.bos_token_id", "<|endoftext|>"),
            ("tokenizer.ggml.eos_token_id", "<|im_end|>"),
            ("tokenizer.ggml.padding_token_id", "<|endoftext|>"),
        ] {
            let id = g.get_u32(key).unwrap() as usize;
            assert!(id < n, "{key} out of range");
            assert_eq!(tokens[id], want, "{key}");
            assert_eq!(types[id], 3, "{key} is a control token");
        }
        for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
            let id = tokens.iter().position(|t| *t == special).unwrap();
            assert_eq!(types[id], 3);
        }
        assert!(types.iter().all(|t| [1, 3, 4].contains(t)));
        assert!(!g.get_bool("tokenizer.ggml.add_bos_token").unwrap());
        let template = g.get_str("tokenizer.chat_template").unwrap();
        assert!(template.contains("<|im_start|>") && template.contains("add_generation_prompt"));
    }
}

#[test]
fn synth_small_with_reduced_layers() {
    let args = [
        "--arch",
        "qwen3moe",
        "--preset",
        "small",
        "--layers",
        "2",
        "--experts",
        "16",
        "--vocab",
        "2048",
    ];
    let plan = ok(les(&[&["synth", "--dry-run"][..], &args].concat()));
    let path = synth("synth_small.gguf", &args);
    let g = Gguf::open(&path).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    assert!(plan.contains(&format!("total_bytes {len} ")), "{plan}");
    assert_eq!(g.get_u32("qwen3moe.block_count").unwrap(), 2);
    assert_eq!(g.get_u32("qwen3moe.expert_used_count").unwrap(), 4);
    assert_eq!(g.get_u32("general.file_type").unwrap(), 15);
    let exps = g.tensor("blk.1.ffn_down_exps.weight").unwrap();
    assert_eq!(exps.dims(), [256, 1024, 16]);
    // Q4_K_M: the last of two layers' ffn_down gets more bits.
    assert_eq!(exps.ggml_type(), GgmlType::Q6K);
    assert_eq!(
        g.tensor("blk.0.ffn_down_exps.weight").unwrap().ggml_type(),
        GgmlType::Q4K
    );
    assert_eq!(
        g.tensor("blk.1.ffn_up_exps.weight").unwrap().ggml_type(),
        GgmlType::Q4K
    );
    assert_eq!(
        g.tensor("blk.0.attn_q.weight").unwrap().dims(),
        [1024, 1024]
    );
    assert_eq!(g.tensor("blk.0.attn_k.weight").unwrap().dims(), [1024, 256]);
    assert_eq!(g.tensor("blk.0.attn_q_norm.weight").unwrap().dims(), [64]);
    assert_eq!(
        g.tensor("output.weight").unwrap().ggml_type(),
        GgmlType::Q6K
    );
    // Python's Q4_K / Q6_K dequantizers agree with the intended spread.
    let py = python("synth_check.py", &[path.as_os_str()]);
    for t in py["tensors"].as_array().unwrap() {
        if t["name"] == "blk.1.ffn_gate_exps.weight" {
            let std = t["std"].as_f64().unwrap();
            assert!((std * 32.0 - 1.0).abs() < 0.1, "std {std}");
        }
    }
    // Only this model's temporary file: the other tests write theirs to the
    // same directory at the same time.
    let no_tmp = std::fs::read_dir(path.parent().unwrap()).unwrap().all(|e| {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        !(name.starts_with(".synth_small.gguf.") && name.ends_with(".tmp"))
    });
    assert!(no_tmp, "a temporary file was left behind");
}

#[test]
fn synth_a3b_dry_run_size() {
    let plan = ok(les(&[
        "synth",
        "--arch",
        "qwen3moe",
        "--preset",
        "a3b",
        "--dry-run",
    ]));
    let total: f64 = plan
        .lines()
        .find_map(|l| l.strip_prefix("total_bytes "))
        .and_then(|l| l.split_whitespace().next())
        .expect("a total_bytes line")
        .parse()
        .unwrap();
    // Qwen3-30B-A3B's Q4_K_M download: 17.28 GiB.
    assert!((total / 18.55e9 - 1.0).abs() < 0.01, "a3b is {total} bytes");
    // 1 + 48 layers x 12 + 2 tensors, with Qwen3-30B-A3B's shapes.
    assert_eq!(
        plan.lines().filter(|l| l.contains(".weight")).count(),
        1 + 48 * 12 + 2
    );
    for needle in [
        "blk.47.ffn_gate_exps.weight",
        "2048 x 768 x 128",
        "768 x 2048 x 128",
        "2048 x 4096",
        "2048 x 512",
        "2048 x 151936",
        "q4_k",
    ] {
        assert!(plan.contains(needle), "{needle} not in the plan");
    }
    assert!(!tmp("synth_a3b.gguf").exists());
}

#[test]
fn synth_rejects_bad_configs_without_writing() {
    let out = tmp("synth_bad.gguf");
    let _ = std::fs::remove_file(&out);
    for args in [
        &["--arch", "qwen3moe", "--top-k", "9"][..],
        &["--arch", "olmoe", "--head-dim", "32"],
        &["--arch", "qwen3moe", "--router-corr", "1.5"],
        &["--arch", "qwen3moe", "--expert-type", "q8_k"],
        &["--arch", "qwen3moe", "--experts", "0"],
        &["--arch", "llama", "--shared-ff", "64"],
        // Shapes beyond any memory: refused, not aborted on an allocation.
        &["--arch", "qwen3moe", "--embd", "1000000000000"],
        &[
            "--arch",
            "qwen3moe",
            "--embd",
            "65536",
            "--expert-ff",
            "65536",
        ],
        &["--arch", "qwen3moe", "--layers", "1000000"],
        &[
            "--arch",
            "qwen3moe",
            "--heads",
            "1024",
            "--kv-heads",
            "1024",
            "--head-dim",
            "4096",
        ],
        // The projector is checked before the model is written.
        &[
            "--arch",
            "qwen3moe",
            "--vocab",
            "4096",
            "--mmproj-out",
            "/dev/null",
            "--mmproj-width",
            "100000000",
        ],
    ] {
        let o = les(&[&["synth"][..], args, &["-o", out.to_str().unwrap()]].concat());
        assert!(!o.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.starts_with("error: ") && err.lines().count() == 1,
            "{args:?}: {err}"
        );
        assert!(!out.exists());
    }
    // An unwritable target leaves nothing behind either.
    let missing = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no/such/dir/m.gguf");
    let o = les(&[
        "synth",
        "--arch",
        "qwen3moe",
        "-o",
        missing.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
}

fn probe_with(name: &str, extra: &[&str]) -> ProbeReport {
    let base = [
        "--arch",
        "qwen3moe",
        "--layers",
        "6",
        "--experts",
        "32",
        "--top-k",
        "4",
    ];
    let path = synth(name, &[&base[..], extra].concat());
    probe(&Gguf::open(&path).unwrap(), 150, 1).unwrap()
}

#[test]
fn synth_router_knobs_shape_routing() {
    let default = probe_with("synth_knobs_default.gguf", &[]);
    let look = default.mean_lookahead();
    assert!(
        (0.5..=0.9).contains(&look),
        "default lookahead precision {look}"
    );

    // A slower-moving residual stream makes lookahead better, a faster one worse.
    let slow = probe_with("synth_knobs_slow.gguf", &["--residual-scale", "0.1"]);
    let fast = probe_with("synth_knobs_fast.gguf", &["--residual-scale", "2"]);
    let (slow, fast) = (slow.mean_lookahead(), fast.mean_lookahead());
    assert!(
        slow > look + 0.1 && fast < look - 0.05,
        "{slow} / {look} / {fast}"
    );

    // Correlated routers reuse the previous layer's experts.
    let indep = probe_with("synth_knobs_indep.gguf", &["--router-corr", "0"]);
    let same = probe_with("synth_knobs_same.gguf", &["--router-corr", "1"]);
    assert!(
        same.mean_reuse() > indep.mean_reuse() + 0.3,
        "{} vs {}",
        same.mean_reuse(),
        indep.mean_reuse()
    );

    // Popularity skew concentrates picks on a few experts.
    let flat = probe_with("synth_knobs_flat.gguf", &["--popularity-skew", "0"]);
    let skewed = probe_with("synth_knobs_skewed.gguf", &["--popularity-skew", "1.5"]);
    assert!(
        skewed.top_decile_share > flat.top_decile_share + 0.15,
        "{} vs {}",
        skewed.top_decile_share,
        flat.top_decile_share
    );
}

#[test]
fn synth_probe_cli() {
    let out = tmp("synth_probe.gguf");
    let text = ok(les(&[
        "synth",
        "--arch",
        "olmoe",
        "-o",
        out.to_str().unwrap(),
        "--probe",
        "20",
        "--quiet",
    ]));
    assert!(text.contains("lookahead precision"), "{text}");
}

/// Loads every architecture's tiny model in llama.cpp and generates a few tokens.
/// Needs llama.cpp's `llama-simple` (build target `llama-simple`) named by the
/// `LES_LLAMA_SIMPLE` environment variable; run with `--ignored`.
#[test]
#[ignore = "needs llama.cpp's llama-simple in LES_LLAMA_SIMPLE"]
fn synth_loads_in_llama_cpp() {
    let bin = std::env::var("LES_LLAMA_SIMPLE")
        .expect("set LES_LLAMA_SIMPLE to the path of llama.cpp's llama-simple");
    for arch in ["qwen3moe", "olmoe", "qwen2moe", "llama", "mixtral"] {
        let path = synth(
            &format!("synth_llama_cpp_{arch}.gguf"),
            &["--arch", arch, "--vocab", "2000"],
        );
        let o = Command::new(&bin)
            .args([
                "-m",
                path.to_str().unwrap(),
                "-n",
                "4",
                "The river was high",
            ])
            .output()
            .expect("llama-simple runs");
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{arch}: llama.cpp failed:\n{log}");
        let want = if arch == "mixtral" { "llama" } else { arch };
        assert!(
            log.contains(&format!("arch                  = {want}")),
            "{arch}:\n{log}"
        );
        assert!(log.contains("decoded 4 tokens"), "{arch}:\n{log}");
    }
}
