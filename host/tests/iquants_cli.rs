//! Models whose routed experts are ggml's lattice i-quants (`IQ1_S`, `IQ1_M`,
//! `IQ2_XXS`, `IQ2_XS`, `IQ2_S`, `IQ3_XXS`, `IQ3_S`), as the 1.5- to 3-bit
//! downloads of large MoE models use them: streamed exactly, packed,
//! requantized by `les pack`, and (ignored, needs llama-cpp-python) the same
//! tokens as llama.cpp.

mod cli;

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cli::{assert_equals_llama_cpp, greedy_logits, les, pack, synth_once, tmp};
use les::gguf::{Gguf, GgufWriter};
use les_core::quant::{dequantize, f32_to_f16, GgmlType};

/// The lattice types, one per expert tensor in turn.
const LATTICE: [GgmlType; 7] = [
    GgmlType::IQ2XXS,
    GgmlType::IQ3S,
    GgmlType::IQ1M,
    GgmlType::IQ2XS,
    GgmlType::IQ3XXS,
    GgmlType::IQ1S,
    GgmlType::IQ2S,
];

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Writes the f16 `d` into a block of `ty` (`IQ1_M` spreads it over the top
/// nibbles of its four `u16` scale words; the others keep it first).
fn set_scale(ty: GgmlType, block: &mut [u8], d: u16) {
    if ty == GgmlType::IQ1M {
        for k in 0..4 {
            let at = 48 + 2 * k;
            let w = u16::from_le_bytes([block[at], block[at + 1]]);
            let w = (w & 0x0fff) | ((d >> (4 * k)) & 15) << 12;
            block[at..at + 2].copy_from_slice(&w.to_le_bytes());
        }
    } else {
        block[..2].copy_from_slice(&d.to_le_bytes());
    }
}

/// `n` random blocks of the lattice type `ty` (any bytes are valid indices,
/// signs and sub-scales) with scales of either sign that give weights of
/// about the synthetic model's spread (RMS 0.01-0.04, whatever the type's
/// grid and sub-scales): large weights would make the routers' top picks
/// flip on rounding.
fn random_blocks(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut v: Vec<u8> = (0..n * bb).map(|_| rng.next() as u8).collect();
    // The RMS of the first blocks' weights at a scale of 1.
    let probe = n.min(16);
    let mut unit = v[..probe * bb].to_vec();
    for block in unit.chunks_exact_mut(bb) {
        set_scale(ty, block, f32_to_f16(1.0));
    }
    let mut w = vec![0f32; probe * ty.block_elems()];
    dequantize(ty, &unit, &mut w).unwrap();
    let rms = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    for block in v.chunks_exact_mut(bb) {
        let m = 0.01 + 0.03 * (rng.next() % 1000) as f32 / 1000.0;
        let s = if rng.next() & 1 == 1 { -m } else { m };
        set_scale(ty, block, f32_to_f16(s / rms));
    }
    v
}

/// Copies `src` with every routed expert tensor (`*_exps.weight`) replaced by
/// random blocks of the next type of [`LATTICE`].
fn with_lattice_experts(src: &Path, dst: &Path) {
    let g = Gguf::open(src).unwrap();
    let mut rng = Rng(11);
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add_kv(k, v.to_meta()).unwrap();
    }
    let mut data = Vec::new();
    let mut next = 0;
    for t in g.tensors() {
        let (ty, bytes) = if t.name().contains("_exps.") {
            let ty = LATTICE[next % LATTICE.len()];
            next += 1;
            let elems: u64 = t.dims().iter().product();
            let blocks = elems as usize / ty.block_elems();
            (ty, random_blocks(ty, blocks, &mut rng))
        } else {
            (t.ggml_type(), t.data().to_vec())
        };
        w.add_tensor(t.name(), t.dims(), ty).unwrap();
        data.push((t.name().to_string(), bytes));
    }
    assert!(
        next >= LATTICE.len(),
        "every lattice type used ({next} tensors)"
    );
    let _ = std::fs::remove_file(dst);
    let mut out = w
        .write_header(BufWriter::new(File::create(dst).unwrap()))
        .unwrap();
    for (name, bytes) in &data {
        out.write_tensor(name, bytes).unwrap();
    }
    out.finish().unwrap();
}

/// A tiny qwen3moe (three layers, 256-wide experts: whole super-blocks)
/// with lattice experts, written once per test binary.
fn lattice_model() -> &'static PathBuf {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| {
        let base = synth_once(
            "iquants_base.gguf",
            &[
                "--arch",
                "qwen3moe",
                "--preset",
                "tiny",
                "--embd",
                "256",
                "--expert-ff",
                "256",
                "--layers",
                "3",
                "--top-k",
                "2",
                "--seed",
                "5",
            ],
        );
        let path = tmp("iquants.gguf");
        with_lattice_experts(&base, &path);
        path
    })
}

/// Packed and streamed at the smallest budgets (each layer's experts have
/// their own size here, so each size gets a class of slots: 2 picks times 3
/// sizes), every schedule gives the plain file's resident tokens and logits
/// bit for bit.
#[test]
fn lattice_experts_stream_exactly() {
    let model = lattice_model();
    let g = Gguf::open(model).unwrap();
    for ty in LATTICE {
        assert!(
            g.tensors().any(|t| t.ggml_type() == ty),
            "{ty} missing from the test model"
        );
    }
    let packed = tmp("iquants.p.gguf");
    pack(model, &packed);
    // The packed file keeps each expert matrix's type.
    let p = Gguf::open(&packed).unwrap();
    let mut packed_types = Vec::new();
    for l in 0..3 {
        let types = p.get_array(&format!("les.pack.blk.{l}.types")).unwrap();
        packed_types.extend(types.iter().map(|v| v.as_u64().unwrap() as u32));
    }
    for ty in LATTICE {
        assert!(
            packed_types.contains(&ty.id()),
            "{ty} packed: {packed_types:?}"
        );
    }
    let (want_tokens, want) = greedy_logits(model, "iq_plain", &["--schedule", "resident"]);
    assert!(want_tokens.len() > 1);
    for (name, file, extra) in [
        ("packed", &packed, &[][..]),
        ("les6", &packed, &["--schedule", "les", "--slots", "6"][..]),
        ("od7", &packed, &["--schedule", "on-demand", "--slots", "7"]),
        (
            "les6_b1",
            &packed,
            &["--schedule", "les", "--slots", "6", "-b", "1"],
        ),
        ("plain_les", model, &["--schedule", "les", "--slots", "8"]),
    ] {
        let (t, got) = greedy_logits(file, &format!("iq_{name}"), extra);
        assert_eq!(t, want_tokens, "{name}");
        assert!(got == want, "{name}: logits differ");
    }
}

#[test]
fn pack_requantizes_lattice_experts_and_refuses_to_write_them() {
    let model = lattice_model();
    let out = tmp("iquants_q4k.p.gguf");
    let run = les()
        .arg("pack")
        .arg(model)
        .arg("-o")
        .arg(&out)
        .args(["--expert-types", "0-:q4_k"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let (tokens, logits) = greedy_logits(&out, "q4k", &[]);
    let (again, same) = greedy_logits(&out, "q4k_les", &["--schedule", "les", "--slots", "3"]);
    assert_eq!(tokens, again);
    assert!(logits == same, "requantized: streamed logits differ");

    let refused = tmp("iquants_refused.p.gguf");
    let run = les()
        .arg("pack")
        .arg(model)
        .arg("-o")
        .arg(&refused)
        .args(["--expert-types", "0-:iq2_xxs"])
        .output()
        .unwrap();
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("no quantizer for iq2_xxs") && err.contains("q4_k"),
        "{err}"
    );
    assert!(!refused.exists(), "nothing written");
}

/// The same greedy tokens as llama.cpp, log-probabilities within a small KL
/// divergence: llama.cpp's own lattice kernels agree with les's.
#[test]
#[ignore = "needs llama-cpp-python"]
fn lattice_experts_equal_llama_cpp() {
    assert_equals_llama_cpp(lattice_model(), "iquants", 1e-3, 0.99);
}
