//! `les pack`: packed layout, requantization plans, the bits-per-weight planner,
//! the reader's validation, Python interoperability and the CLI.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use les::gguf::{Gguf, GgufWriter, MetaValue};
use les::pack::{
    pack, Choice, ExpertTypes, PackError, PackOptions, PackReport, PackedIndex, Packer, Plan,
};
use les_core::layout;
use les_core::quant::{dequantize, quantize, GgmlType};

const N_EMBD: usize = 256;
const N_FF: usize = 256;
const N_EXPERTS: usize = 8;
const N_VOCAB: usize = 64;

/// The test model's expert types per layer (gate, up, down).
fn default_layers() -> Vec<[GgmlType; 3]> {
    use GgmlType::*;
    vec![[Q8_0; 3], [Q4K; 3], [F16; 3], [Q4K, Q4K, Q6K]]
}

/// Deterministic pseudo-Gaussian values with per-row scales, like trained weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    fn gauss(&mut self) -> f32 {
        (0..4).map(|_| self.next()).sum::<f32>() - 2.0
    }

    fn matrix(&mut self, rows: usize, cols: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(rows * cols);
        for _ in 0..rows {
            let scale = 0.02 * (0.5 + self.next());
            out.extend((0..cols).map(|_| scale * self.gauss()));
        }
        out
    }
}

fn quantized(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; ty.row_bytes(x.len()).unwrap()];
    quantize(ty, x, &mut out).unwrap();
    out
}

struct ModelSpec {
    layers: Vec<[GgmlType; 3]>,
    n_ff: usize,
    alignment: Option<u32>,
    /// Leave out layer 1's down tensor.
    drop_down: bool,
    /// No experts at all (a dense model).
    dense: bool,
}

impl Default for ModelSpec {
    fn default() -> Self {
        ModelSpec {
            layers: default_layers(),
            n_ff: N_FF,
            alignment: None,
            drop_down: false,
            dense: false,
        }
    }
}

/// Writes a small qwen3moe-like GGUF to `path`.
fn write_model(path: &Path, spec: &ModelSpec) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let n_layers = spec.layers.len();
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "qwen3moe").unwrap();
    w.add_kv("general.name", "pack test").unwrap();
    if let Some(a) = spec.alignment {
        w.add_kv("general.alignment", a).unwrap();
    }
    w.add_kv("qwen3moe.block_count", n_layers as u32).unwrap();
    w.add_kv("qwen3moe.embedding_length", N_EMBD as u32)
        .unwrap();
    w.add_kv("qwen3moe.feed_forward_length", 768u32).unwrap();
    if !spec.dense {
        w.add_kv("qwen3moe.expert_feed_forward_length", spec.n_ff as u32)
            .unwrap();
        w.add_kv("qwen3moe.expert_count", N_EXPERTS as u32).unwrap();
        w.add_kv("qwen3moe.expert_used_count", 2u32).unwrap();
    }
    w.add_kv("qwen3moe.rope.freq_base", 1e6f32).unwrap();
    let tokens: Vec<String> = (0..N_VOCAB).map(|i| format!("tok{i}")).collect();
    w.add_kv("tokenizer.ggml.tokens", MetaValue::strings(tokens))
        .unwrap();
    w.add_kv("test.scores", vec![0.5f32, -1.0, 2.0]).unwrap();

    let mut tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> = Vec::new();
    let mut add = |name: String, dims: Vec<u64>, ty: GgmlType, x: Vec<f32>| {
        tensors.push((name, dims, ty, quantized(ty, &x)));
    };
    let (e, d, v) = (N_EMBD as u64, N_EXPERTS as u64, N_VOCAB as u64);
    add(
        "token_embd.weight".into(),
        vec![e, v],
        GgmlType::F16,
        rng.matrix(N_VOCAB, N_EMBD),
    );
    for (l, types) in spec.layers.iter().enumerate() {
        let t = |s: &str| format!("blk.{l}.{s}");
        add(
            t("attn_norm.weight"),
            vec![e],
            GgmlType::F32,
            vec![1.0; N_EMBD],
        );
        add(
            t("attn_q.weight"),
            vec![e, e],
            GgmlType::Q4K,
            rng.matrix(N_EMBD, N_EMBD),
        );
        if spec.dense {
            add(
                t("ffn_up.weight"),
                vec![e, 768],
                GgmlType::Q8_0,
                rng.matrix(768, N_EMBD),
            );
            continue;
        }
        add(
            t("ffn_gate_inp.weight"),
            vec![e, d],
            GgmlType::F32,
            rng.matrix(N_EXPERTS, N_EMBD),
        );
        let ff = spec.n_ff as u64;
        let shapes = [
            ("ffn_gate_exps.weight", vec![e, ff, d]),
            ("ffn_up_exps.weight", vec![e, ff, d]),
            ("ffn_down_exps.weight", vec![ff, e, d]),
        ];
        for (m, (name, dims)) in shapes.into_iter().enumerate() {
            if spec.drop_down && l == 1 && m == 2 {
                continue;
            }
            let n = (dims[0] * dims[1] * dims[2]) as usize;
            let rows = n.checked_div(dims[0] as usize).unwrap_or(0);
            add(
                t(name),
                dims.clone(),
                types[m],
                rng.matrix(rows, dims[0] as usize),
            );
        }
        add(
            t("ffn_norm.weight"),
            vec![e],
            GgmlType::F32,
            vec![1.0; N_EMBD],
        );
    }
    add(
        "output_norm.weight".into(),
        vec![e],
        GgmlType::F32,
        vec![1.0; N_EMBD],
    );

    for (name, dims, ty, _) in &tensors {
        w.add_tensor(name.as_str(), dims, *ty).unwrap();
    }
    let mut data = w
        .write_header(BufWriter::new(File::create(path).unwrap()))
        .unwrap();
    for (name, _, _, bytes) in &tensors {
        data.write_tensor(name, bytes).unwrap();
    }
    data.finish().unwrap();
}

/// A fresh path in the scratch directory (removed if present).
fn fresh(name: &str) -> PathBuf {
    let p = tmp(name);
    let _ = fs::remove_file(&p);
    p
}

fn model(name: &str, spec: &ModelSpec) -> PathBuf {
    let p = fresh(name);
    write_model(&p, spec);
    p
}

fn opts(types: ExpertTypes) -> PackOptions {
    PackOptions {
        types,
        threads: 2,
        ..PackOptions::default()
    }
}

/// Packs, checking that progress reaches the file length.
fn pack_ok(input: &Path, output: &Path, o: &PackOptions) -> PackReport {
    let mut last = (0, 0);
    let mut calls = 0;
    let report = pack(input, output, o, |done, total| {
        assert!(done <= total && done >= last.0);
        last = (done, total);
        calls += 1;
    })
    .unwrap_or_else(|e| panic!("pack failed: {e}"));
    assert!(calls > 0);
    assert_eq!(last, (report.file_bytes, report.file_bytes));
    assert_eq!(fs::metadata(output).unwrap().len(), report.file_bytes);
    report
}

/// Source expert `e` of `layer`: the bytes of gate, up and down.
fn source_parts(src: &Gguf, layer: usize, e: usize) -> [(&[u8], GgmlType); 3] {
    ["gate", "up", "down"].map(|m| {
        let t = src
            .tensor(&format!("blk.{layer}.ffn_{m}_exps.weight"))
            .unwrap();
        let n = t.data().len() / N_EXPERTS;
        (&t.data()[e * n..(e + 1) * n], t.ggml_type())
    })
}

fn dequant(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    dequantize(ty, bytes, &mut out).unwrap();
    out
}

/// Relative error (sum of squared error / sum of squares) of each packed layer
/// against the source, over every expert.
fn layer_errors(src: &Gguf, packed: &Gguf, index: &PackedIndex) -> BTreeMap<usize, f64> {
    let mut out = BTreeMap::new();
    for l in index.layers() {
        let (mut sse, mut energy) = (0f64, 0f64);
        for e in 0..N_EXPERTS {
            let x = l.extent(e).unwrap();
            let bytes = &packed.bytes()[x.offset as usize..(x.offset + x.len) as usize];
            let [g, u, d] = l.format.part_bytes().unwrap();
            let parts = [&bytes[..g], &bytes[g..g + u], &bytes[g + u..g + u + d]];
            for ((pb, pt), (sb, st)) in parts
                .iter()
                .zip(l.types())
                .zip(source_parts(src, l.layer, e))
            {
                let n = N_EMBD * l.format.n_ff;
                let a = dequant(st, sb, n);
                let b = dequant(pt, pb, n);
                for (x, y) in a.iter().zip(&b) {
                    let (x, y) = (f64::from(*x), f64::from(*y));
                    sse += (x - y) * (x - y);
                    energy += x * x;
                }
            }
        }
        out.insert(l.layer, sse / energy);
    }
    out
}

/// The worst relative error a type may show on the test data.
fn threshold(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::Q8_0 | GgmlType::F16 | GgmlType::BF16 | GgmlType::F32 => 1e-4,
        GgmlType::Q6K | GgmlType::Q5_0 | GgmlType::Q5_1 => 3e-3,
        _ => 2e-2,
    }
}

#[test]
fn pack_estimates_its_output_size() {
    let input = model("pack_size_in.gguf", &ModelSpec::default());
    for (align, types) in [
        (4096, ExpertTypes::Keep),
        (1 << 16, ExpertTypes::Plan("0-:q4_k".parse().unwrap())),
    ] {
        let output = fresh(&format!("pack_size_out_{align}.gguf"));
        let o = PackOptions {
            align,
            ..opts(types)
        };
        let packer = Packer::open(&input, &o).unwrap();
        let estimate = packer.estimated_file_bytes();
        let report = packer.write(&output, |_, _| {}).unwrap();
        // Exact but for the packed index's metadata (checksums, keys) and where
        // the data section starts.
        let off = report.file_bytes.abs_diff(estimate);
        assert!(off <= align + (64 << 10), "{align}: {off}");
    }
}

#[test]
fn pack_keeps_types_and_copies_bytes() {
    let input = model("pack_keep_in.gguf", &ModelSpec::default());
    let output = fresh("pack_keep_out.gguf");
    let report = pack_ok(&input, &output, &opts(ExpertTypes::Keep));
    assert_eq!(report.plan, "0-3:keep");
    assert_eq!(report.bpw(), report.source_bpw());
    assert_eq!(report.error(), Some(0.0));

    let src = Gguf::open(&input).unwrap();
    let out = Gguf::open(&output).unwrap();
    // Metadata: everything copied, alignment set, packed keys added.
    assert_eq!(out.alignment(), 4096);
    assert_eq!(out.get_u32("general.alignment").unwrap(), 4096);
    for (k, v) in src.metadata() {
        assert_eq!(out.get(k).unwrap().to_meta(), v.to_meta(), "{k}");
    }
    assert_eq!(out.get_u32(layout::keys::VERSION).unwrap(), layout::VERSION);
    assert_eq!(out.get_u32(layout::keys::ALIGNMENT).unwrap(), 4096);
    assert_eq!(out.get_str(layout::keys::PLAN).unwrap(), "0-3:keep");

    // Tensors: source order, packed tensors in place of each layer's experts,
    // everything else byte-identical, every tensor aligned.
    let mut expect = Vec::new();
    for t in src.tensors() {
        match t.name().strip_suffix(".ffn_gate_exps.weight") {
            Some(blk) => expect.push(format!("{blk}.ffn_exps_packed.weight")),
            None if t.name().contains("_exps.") => {}
            None => expect.push(t.name().to_string()),
        }
    }
    let names: Vec<&str> = out.tensors().map(|t| t.name()).collect();
    assert_eq!(names, expect);
    for t in out.tensors() {
        assert_eq!(t.offset() % 4096, 0, "{}", t.name());
        if let Some(s) = src.tensor(t.name()) {
            assert_eq!((t.dims(), t.ggml_type()), (s.dims(), s.ggml_type()));
            assert!(t.data() == s.data(), "{} differs", t.name());
        }
    }

    // The index: types kept, every expert the concatenation of its source slices.
    let index = PackedIndex::from_gguf(&out).unwrap().expect("packed");
    assert_eq!(index.alignment, 4096);
    assert_eq!(index.n_experts, N_EXPERTS);
    assert_eq!(index.layers().len(), 4);
    index.verify_all(&out).unwrap();
    for (l, types) in index.layers().iter().zip(default_layers()) {
        assert_eq!(l.types(), types);
        assert_eq!(l.stride % 4096, 0);
        assert!(l.stride >= l.expert_bytes && l.stride - l.expert_bytes < 4096);
        assert_eq!(report.layer_report(l.layer).unwrap().stride, l.stride);
        for e in 0..N_EXPERTS {
            let x = l.extent(e).unwrap();
            assert_eq!(x.offset % 4096, 0);
            let bytes = &out.bytes()[x.offset as usize..(x.offset + x.padded_len) as usize];
            let concat: Vec<u8> = source_parts(&src, l.layer, e)
                .iter()
                .flat_map(|(b, _)| b.iter().copied())
                .collect();
            assert_eq!(x.len as usize, concat.len());
            assert!(
                bytes[..concat.len()] == concat[..],
                "layer {} expert {e}",
                l.layer
            );
            assert!(bytes[concat.len()..].iter().all(|&b| b == 0));
            assert_eq!(layout::checksum(&concat), l.checksums[e]);
            assert!(l.verify(e, bytes));
        }
        assert!(l.extent(N_EXPERTS).is_none());
    }
    // A plain file has no index.
    assert!(PackedIndex::from_gguf(&src).unwrap().is_none());
}

#[test]
fn pack_with_expert_types_plan() {
    let input = model("pack_plan_in.gguf", &ModelSpec::default());
    let output = fresh("pack_plan_out.gguf");
    let plan: Plan = "0-1:q6_k,2-:q4_k".parse().unwrap();
    let o = PackOptions {
        align: 8192,
        ..opts(ExpertTypes::Plan(plan))
    };
    let report = pack_ok(&input, &output, &o);
    assert_eq!(report.plan, "0-1:q6_k,2-3:q4_k");
    use GgmlType::*;
    let want = [[Q6K; 3], [Q6K; 3], [Q4K; 3], [Q4K; 3]];

    let src = Gguf::open(&input).unwrap();
    let out = Gguf::open(&output).unwrap();
    assert_eq!(out.alignment(), 8192);
    let index = PackedIndex::from_gguf(&out).unwrap().unwrap();
    assert_eq!(index.alignment, 8192);
    assert_eq!(index.plan, "0-1:q6_k,2-3:q4_k");
    index.verify_all(&out).unwrap();
    for (l, w) in index.layers().iter().zip(want) {
        assert_eq!(l.types(), w, "layer {}", l.layer);
        assert_eq!(l.stride % 8192, 0);
        assert_eq!(l.offset % 8192, 0);
        let r = report.layer_report(l.layer).unwrap();
        assert_eq!(
            (r.types.clone(), r.expert_bytes, r.stride),
            (w.to_vec(), l.expert_bytes, l.stride)
        );
    }
    // Layer 3's gate and up are already q4_k: copied, not requantized.
    let l3 = index.layer(3).unwrap();
    for e in 0..N_EXPERTS {
        let x = l3.extent(e).unwrap();
        let [g, u, _] = l3.format.part_bytes().unwrap();
        let parts = source_parts(&src, 3, e);
        let bytes = &out.bytes()[x.offset as usize..];
        assert!(bytes[..g] == *parts[0].0 && bytes[g..g + u] == *parts[1].0);
    }
    let errors = layer_errors(&src, &out, &index);
    for l in index.layers() {
        let err = errors[&l.layer];
        assert!(
            err > 0.0 && err < threshold(l.format.down),
            "layer {}: {err}",
            l.layer
        );
    }
    // q6_k of a q8_0 source is closer than q4_k of an f16 one.
    assert!(errors[&0] < errors[&2]);
}

#[test]
fn pack_with_bits_per_weight_budget() {
    let input = model("pack_bpw_in.gguf", &ModelSpec::default());
    let output = fresh("pack_bpw_out.gguf");
    let budget = 6.0;
    let report = pack_ok(&input, &output, &opts(ExpertTypes::BitsPerWeight(budget)));
    eprintln!("{report}");
    assert_eq!(report.budget, Some(budget));
    assert!(report.bpw() <= budget, "{} > {budget}", report.bpw());
    // The budget is nearly spent (the cheap layers are kept, the rest compete).
    assert!(report.bpw() > budget - 1.0, "{}", report.bpw());
    let total_err = report.error().unwrap();

    // Every uniform plan that fits the budget is no better than the chosen one.
    let choices: Vec<Choice> = report.layers[0]
        .candidates
        .iter()
        .map(|c| c.choice)
        .collect();
    for c in choices {
        let per_layer: Option<Vec<_>> = report
            .layers
            .iter()
            .map(|l| l.candidates.iter().find(|x| x.choice == c))
            .collect();
        let Some(per_layer) = per_layer else { continue };
        let bpw = per_layer.iter().map(|x| x.bpw).sum::<f64>() / per_layer.len() as f64;
        let err = per_layer.iter().map(|x| x.error).sum::<f64>() / per_layer.len() as f64;
        if bpw <= budget {
            assert!(
                total_err <= err + 1e-12,
                "{c}: {err} beats the plan's {total_err}"
            );
        }
    }
    // Layer 1 (q4_k, the cheapest source) is kept verbatim.
    assert_eq!(report.layers[1].choice, Choice::Keep);

    let src = Gguf::open(&input).unwrap();
    let out = Gguf::open(&output).unwrap();
    let index = PackedIndex::from_gguf(&out).unwrap().unwrap();
    index.verify_all(&out).unwrap();
    assert_eq!(index.plan, report.plan);
    // The plan string reproduces the same types.
    let again: Plan = report.plan.parse().unwrap();
    let errors = layer_errors(&src, &out, &index);
    for (l, r) in index.layers().iter().zip(&report.layers) {
        assert_eq!(l.types(), r.types);
        let choice = again.choice(l.layer).unwrap();
        assert_eq!(choice, r.choice);
        let measured = r.error.unwrap();
        let actual = errors[&l.layer];
        if r.types == r.source {
            assert_eq!((measured, actual), (0.0, 0.0));
        } else {
            assert!(
                actual < threshold(l.format.down),
                "layer {}: {actual}",
                l.layer
            );
            // The sample predicts the whole layer's error.
            assert!(
                actual < 1.5 * measured && measured < 1.5 * actual,
                "layer {}: sampled {measured}, actual {actual}",
                l.layer
            );
        }
    }

    // A generous budget keeps everything; an impossible one is refused.
    let generous = pack_ok(
        &input,
        &fresh("pack_bpw_generous.gguf"),
        &opts(ExpertTypes::BitsPerWeight(16.0)),
    );
    assert_eq!(generous.plan, "0-3:keep");
    let err = pack(
        &input,
        &fresh("pack_bpw_small.gguf"),
        &opts(ExpertTypes::BitsPerWeight(2.0)),
        |_, _| {},
    )
    .unwrap_err();
    assert!(matches!(err, PackError::Budget { .. }), "{err}");
    assert!(err.to_string().contains("too small"), "{err}");
}

#[test]
fn pack_errors_are_clear() {
    let msg = |input: &Path, o: PackOptions| -> String {
        pack(input, &fresh("pack_err_out.gguf"), &o, |_, _| {})
            .unwrap_err()
            .to_string()
    };
    let plain = model("pack_err_in.gguf", &ModelSpec::default());
    let plan = |s: &str| ExpertTypes::Plan(s.parse().unwrap());
    let m = msg(&plain, opts(plan("0-:q3_k")));
    assert!(m.contains("layer 0: LES has no quantizer for q3_k"), "{m}");
    let m = msg(&plain, opts(plan("9:q4_k")));
    assert!(
        m.ends_with("'9:q4_k' covers no MoE layer (the MoE layers are 0-3)"),
        "{m}"
    );
    let m = msg(
        &plain,
        PackOptions {
            align: 1000,
            ..opts(ExpertTypes::Keep)
        },
    );
    assert!(m.contains("not a power of two"), "{m}");
    assert!(!tmp("pack_err_out.gguf").exists());

    let dense = model(
        "pack_err_dense.gguf",
        &ModelSpec {
            dense: true,
            ..Default::default()
        },
    );
    let m = msg(&dense, opts(ExpertTypes::Keep));
    assert!(m.starts_with("not a MoE model"), "{m}");

    let missing = model(
        "pack_err_missing.gguf",
        &ModelSpec {
            drop_down: true,
            ..Default::default()
        },
    );
    let m = msg(&missing, opts(ExpertTypes::Keep));
    assert_eq!(
        m,
        "layer 1 has expert tensors but no blk.1.ffn_down_exps.weight"
    );

    // Rows of 288 elements: K-quants do not fit, 32-element blocks do.
    let odd = model(
        "pack_err_rows.gguf",
        &ModelSpec {
            layers: vec![[GgmlType::Q8_0; 3]; 2],
            n_ff: 288,
            ..Default::default()
        },
    );
    let m = msg(&odd, opts(plan("1:q4_k")));
    assert!(
        m.contains("layer 1: q4_k needs rows that are a multiple of 256 elements, but the down rows have 288"),
        "{m}"
    );
    let out = fresh("pack_rows_bpw.gguf");
    let report = pack_ok(&odd, &out, &opts(ExpertTypes::BitsPerWeight(5.0)));
    for l in &report.layers {
        assert_eq!(l.types[0].block_elems(), 32, "{:?}", l.types);
    }

    // Zero-width experts (which would leave the expert count unbounded by the
    // file's size), and more experts than 16-bit ids name.
    let zero = model(
        "pack_err_zero.gguf",
        &ModelSpec {
            n_ff: 0,
            ..Default::default()
        },
    );
    let m = msg(&zero, opts(ExpertTypes::BitsPerWeight(4.0)));
    assert!(
        m.contains("expert_feed_forward_length must not be 0"),
        "{m}"
    );
    let many = fresh("pack_err_many.gguf");
    rewrite_gguf(
        &plain,
        &many,
        |k, v| {
            Some(if k == "qwen3moe.expert_count" {
                70000u32.into()
            } else {
                v
            })
        },
        vec![],
    );
    let m = msg(&many, opts(ExpertTypes::Keep));
    assert!(
        m.contains("qwen3moe.expert_count is 70000, above 65535"),
        "{m}"
    );

    // Packing a packed file.
    let packed = fresh("pack_err_packed.gguf");
    pack_ok(&plain, &packed, &opts(ExpertTypes::Keep));
    let m = msg(&packed, opts(ExpertTypes::Keep));
    assert!(m.contains("already packed"), "{m}");

    // The output is the input.
    let m = pack(&plain, &plain, &opts(ExpertTypes::Keep), |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(m.starts_with("refusing to overwrite the input"), "{m}");
}

/// [`rewrite_gguf`] with `general.alignment` set to `general_alignment`.
fn rewrite(
    src: &Path,
    dst: &Path,
    general_alignment: u32,
    edit: impl Fn(&str, MetaValue) -> Option<MetaValue>,
    extra: Vec<(&str, MetaValue)>,
) {
    rewrite_gguf(
        src,
        dst,
        |k, v| {
            if k == "general.alignment" {
                Some(general_alignment.into())
            } else {
                edit(k, v)
            }
        },
        extra,
    );
}

#[test]
fn packed_index_rejects_corrupt_metadata() {
    let input = model("pack_index_in.gguf", &ModelSpec::default());
    let packed = fresh("pack_index_ok.gguf");
    pack_ok(&input, &packed, &opts(ExpertTypes::Keep));
    let good = PackedIndex::from_gguf(&Gguf::open(&packed).unwrap())
        .unwrap()
        .unwrap();
    let stride1 = good.layer(1).unwrap().stride;
    let bad = fresh("pack_index_bad.gguf");
    let check = |edit: &dyn Fn(&str, MetaValue) -> Option<MetaValue>,
                 extra: Vec<(&str, MetaValue)>,
                 align: u32,
                 want: &str| {
        rewrite(&packed, &bad, align, edit, extra);
        let g = Gguf::open(&bad).unwrap();
        let err = PackedIndex::from_gguf(&g).unwrap_err().to_string();
        assert!(err.starts_with("bad packed layout: "), "{err}");
        assert!(err.contains(want), "{err:?} lacks {want:?}");
    };
    let set = |key: &'static str, value: MetaValue| {
        move |k: &str, v: MetaValue| Some(if k == key { value.clone() } else { v })
    };
    // The rewrite itself keeps a valid index.
    rewrite(&packed, &bad, 4096, |_, v| Some(v), vec![]);
    let same = PackedIndex::from_gguf(&Gguf::open(&bad).unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(same.layers().len(), good.layers().len());

    check(
        &set("les.pack.blk.2.checksums", vec![0u32; N_EXPERTS - 1].into()),
        vec![],
        4096,
        "les.pack.blk.2.checksums has 7 entries, expected 8 (qwen3moe.expert_count)",
    );
    check(
        &set("les.pack.blk.1.stride", (stride1 + 32).into()),
        vec![],
        4096,
        "is not a multiple of the alignment 4096",
    );
    check(
        &set("les.pack.blk.1.stride", 4096u64.into()),
        vec![],
        4096,
        "les.pack.blk.1.stride = 4096 is less than the",
    );
    check(
        &set("les.pack.blk.1.stride", (stride1 + 4096).into()),
        vec![],
        4096,
        "blk.1.ffn_exps_packed.weight has shape",
    );
    for n in [1, 4] {
        check(
            &set("les.pack.blk.0.types", vec![8u32; n].into()),
            vec![],
            4096,
            &format!("has {n} entries, expected 3 (gate, up, down) or 2 (up, down)"),
        );
    }
    // Two entries are experts without a gate (Nemotron-H's): a layout the
    // index reads (the loader checks it against the architecture:
    // `nemotron_h_cli`).
    rewrite(
        &packed,
        &bad,
        4096,
        set("les.pack.blk.0.types", vec![8u32, 8].into()),
        vec![],
    );
    let ungated = PackedIndex::from_gguf(&Gguf::open(&bad).unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(ungated.layer(0).unwrap().format.gate, None);
    check(
        &set("les.pack.blk.0.types", vec![8u32, 8, 4].into()),
        vec![],
        4096,
        "unsupported ggml type id 4",
    );
    check(
        &set("les.pack.blk.0.types", vec![15u32, 15, 15].into()),
        vec![],
        4096,
        "q8_k is not a weight type",
    );
    check(
        &set("les.pack.blk.1.types", vec![8u32, 8, 8].into()),
        vec![],
        4096,
        "is less than the 208896 bytes of an expert",
    );
    check(
        &set("les.pack.version", 2u32.into()),
        vec![],
        4096,
        "les.pack.version is 2",
    );
    check(
        &set("les.pack.alignment", 3000u32.into()),
        vec![],
        4096,
        "les.pack.alignment = 3000 is not a power of two",
    );
    check(
        &|k: &str, v| (k != "les.pack.blk.3.checksums").then_some(v),
        vec![],
        4096,
        "les.pack.blk.3.checksums is missing",
    );
    check(
        &|_: &str, v| Some(v),
        vec![("les.pack.blk.9.stride", 4096u64.into())],
        4096,
        "les.pack.blk.9.stride describes layer 9",
    );
    check(
        &set("qwen3moe.expert_count", 4u32.into()),
        vec![],
        4096,
        "expected 4 (qwen3moe.expert_count)",
    );
    // A smaller file alignment moves the packed tensors off 4 KiB boundaries.
    rewrite(&packed, &bad, 32, |_, v| Some(v), vec![]);
    let g = Gguf::open(&bad).unwrap();
    let first = g.tensor("blk.0.ffn_exps_packed.weight").unwrap().offset();
    assert_ne!(first % 4096, 0, "the test needs a misaligned offset");
    let err = PackedIndex::from_gguf(&g).unwrap_err().to_string();
    assert!(err.contains("not a multiple of 4096"), "{err}");

    // A flipped checksum passes validation but not verification.
    let sums = good.layer(2).unwrap().checksums.clone();
    let mut flipped = sums.clone();
    flipped[5] ^= 1;
    rewrite(
        &packed,
        &bad,
        4096,
        set("les.pack.blk.2.checksums", flipped.into()),
        vec![],
    );
    let g = Gguf::open(&bad).unwrap();
    let index = PackedIndex::from_gguf(&g).unwrap().unwrap();
    let err = index.verify_all(&g).unwrap_err().to_string();
    assert!(
        err.contains("checksum mismatch in expert 5 of layer 2"),
        "{err}"
    );
}

#[test]
fn pack_output_reads_in_python_gguf() {
    let input = model("pack_py_in.gguf", &ModelSpec::default());
    let output = fresh("pack_py_out.gguf");
    let plan = ExpertTypes::Plan("0:q4_0,1:keep,2:q8_0".parse().unwrap());
    pack_ok(&input, &output, &opts(plan));
    let dump = python("check_packed.py", &[output.as_os_str()]);
    let g = Gguf::open(&output).unwrap();
    let index = PackedIndex::from_gguf(&g).unwrap().unwrap();
    assert_eq!(dump["alignment"], 4096);
    assert_eq!(dump["version"], layout::VERSION);
    assert_eq!(dump["pack_alignment"], 4096);
    assert_eq!(dump["plan"], "0:q4_0,1:keep,2:q8_0,3:keep");
    let tensors = dump["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), g.tensor_count());
    for (t, d) in g.tensors().zip(tensors) {
        assert_eq!(d["name"], t.name());
        assert_eq!(d["offset"], t.offset(), "{}", t.name());
        assert_eq!(d["n_bytes"], t.size(), "{}", t.name());
        assert_eq!(d["type"], t.ggml_type().id());
        if t.ggml_type() == GgmlType::I8 {
            assert_eq!(d["dtype"], "int8");
            assert_eq!(d["dims"][0], t.size());
        }
    }
    let layers = dump["layers"].as_array().unwrap();
    assert_eq!(layers.len(), index.layers().len());
    for (l, d) in index.layers().iter().zip(layers) {
        assert_eq!(d["layer"], l.layer);
        assert_eq!(d["stride"], l.stride);
        assert_eq!(d["expert_bytes"], l.expert_bytes);
        let ids: Vec<u32> = l.types().iter().map(|t| t.id()).collect();
        assert_eq!(d["types"], serde_json::json!(ids));
        assert_eq!(d["crc_ok"], true, "layer {}", l.layer);
        assert_eq!(d["pad_ok"], true, "layer {}", l.layer);
    }
}

fn les(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_les"))
        .args(args)
        .output()
        .expect("les runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Files in the scratch directory whose name contains `part`.
fn leftovers(part: &str) -> Vec<String> {
    fs::read_dir(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains(part) && n.contains(".les-pack-"))
        .collect()
}

#[test]
fn pack_cli_end_to_end() {
    let input = model("pack_cli_in.gguf", &ModelSpec::default());
    let output = fresh("pack_cli_out.gguf");
    let o = |s: &str| std::ffi::OsString::from(s);
    let run = |extra: &[&str], out: &Path| {
        let mut args = vec![o("pack"), input.clone().into(), o("-o"), out.into()];
        args.extend(extra.iter().map(|s| o(s)));
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        les(&refs)
    };

    let ok = run(
        &["--expert-types", "0-3:q6_k,2-:q4_k", "--threads", "2"],
        &output,
    );
    assert!(ok.status.success(), "{}", stderr(&ok));
    let err = stderr(&ok);
    assert!(err.contains("plan: 0-1:q6_k,2-3:q4_k"), "{err}");
    assert!(err.contains("layer  source"), "{err}");
    assert!(err.contains("wrote "), "{err}");
    let g = Gguf::open(&output).unwrap();
    let index = PackedIndex::from_gguf(&g).unwrap().unwrap();
    index.verify_all(&g).unwrap();
    assert_eq!(index.layer(3).unwrap().types(), [GgmlType::Q4K; 3]);
    drop(g);

    // --bits-per-weight prints its plan with errors.
    let bpw_out = fresh("pack_cli_bpw.gguf");
    let ok = run(&["--bits-per-weight", "5.5"], &bpw_out);
    assert!(ok.status.success(), "{}", stderr(&ok));
    assert!(stderr(&ok).contains("budget 5.5"), "{}", stderr(&ok));

    // Refuses to overwrite the input, by name, through a symlink and a hard link.
    let before = fs::read(&input).unwrap();
    let link = fresh("pack_cli_link.gguf");
    std::os::unix::fs::symlink(&input, &link).unwrap();
    let hard = fresh("pack_cli_hard.gguf");
    fs::hard_link(&input, &hard).unwrap();
    for target in [&input, &link, &hard] {
        let r = run(&[], target);
        assert!(!r.status.success());
        let e = stderr(&r);
        assert!(
            e.starts_with("error: refusing to overwrite the input"),
            "{e}"
        );
    }
    assert!(fs::read(&input).unwrap() == before);

    // Refuses to replace what is not a regular file: a pipe, a directory.
    let fifo = fresh("pack_cli_fifo.gguf");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let dir = fresh("pack_cli_dir.gguf");
    let _ = fs::remove_dir(&dir);
    fs::create_dir(&dir).unwrap();
    for target in [&fifo, &dir] {
        let r = run(&[], target);
        assert!(!r.status.success());
        let e = stderr(&r);
        assert!(
            e.trim_end()
                .ends_with("exists and is not a regular file: refusing to replace it"),
            "{e}"
        );
    }
    let fifo_kind = fs::symlink_metadata(&fifo).unwrap().file_type();
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&fifo_kind));
    fs::remove_file(&fifo).unwrap();
    fs::remove_dir(&dir).unwrap();

    // Bad plans and options: one clear line, nothing left behind.
    let failed = fresh("pack_cli_failed.gguf");
    for (args, want) in [
        (
            &["--expert-types", "0-3"][..],
            "error: bad expert-type plan: '0-3' has no ':TYPE'",
        ),
        (
            &["--expert-types", "0-:q4_z"],
            "error: unknown ggml type 'q4_z' (weight types: f32, f16,",
        ),
        (
            &["--expert-types", "0-:iq4_xs"],
            "error: layer 0: LES has no quantizer for iq4_xs",
        ),
        (
            &["--bits-per-weight", "1"],
            "error: a budget of 1 bits per weight is too small",
        ),
        (
            &["--align", "100"],
            "error: alignment 100 is not a power of two",
        ),
    ] {
        let r = run(args, &failed);
        assert!(!r.status.success());
        // One error line, the last (after the planner's notice, if any).
        let e = stderr(&r);
        let last = e.trim_end().lines().last().unwrap_or_default();
        assert!(last.starts_with(want), "{args:?}: {e}");
        assert_eq!(
            e.lines().filter(|l| l.starts_with("error")).count(),
            1,
            "{e}"
        );
        assert!(!failed.exists());
    }
    // A size with units; padding over a quarter of the experts is warned about.
    let padded = fresh("pack_cli_padded.gguf");
    let r = run(&["--align", "1MiB", "-q"], &padded);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(
        stderr(&r)
            .contains("warning: 80% of the packed experts' bytes are padding to 1048576-byte"),
        "{}",
        stderr(&r)
    );
    let g = Gguf::open(&padded).unwrap();
    assert_eq!(g.alignment(), 1 << 20);
    drop(g);
    fs::remove_file(&padded).unwrap();
    let r = run(&["--align", "4KiB", "-q"], &padded);
    assert!(
        r.status.success() && !stderr(&r).contains("warning"),
        "{}",
        stderr(&r)
    );

    let r = run(
        &["--expert-types", "0:q4_k", "--bits-per-weight", "4"],
        &failed,
    );
    assert!(!r.status.success() && stderr(&r).contains("cannot be used with"));

    // A dense model.
    let dense = model(
        "pack_cli_dense.gguf",
        &ModelSpec {
            dense: true,
            ..Default::default()
        },
    );
    let r = les(&[
        o("pack").as_os_str(),
        dense.as_os_str(),
        o("-o").as_os_str(),
        failed.as_os_str(),
    ]);
    assert!(!r.status.success());
    assert_eq!(
        stderr(&r).trim_end(),
        "error: not a MoE model: no blk.N.ffn_{gate,up,down}_exps.weight tensors"
    );
    assert!(
        leftovers("pack_cli").is_empty(),
        "{:?}",
        leftovers("pack_cli")
    );
}
