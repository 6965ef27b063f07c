//! Broken hyperparameters: every number in the metadata of each architecture's
//! tiny synthetic model and of each synthetic vision projector, set one at a
//! time to values that break it (0, 1, odd, huge, the type's maximum; floats
//! also negative, NaN and infinite), gives a clear one-line error when the file
//! loads, or a model that decodes a few tokens (a projector that encodes an
//! image) or refuses with an error: never a panic, never an allocation far
//! beyond what the file holds, and no non-finite float accepted. One test in
//! this binary: its tests would share the counting allocator.

mod cli;
mod common;
mod counting_alloc;

use std::path::{Path, PathBuf};

use les::compute::{Pool, ThreadedMatVec};
use les::engine::Session;
use les::flash::FileDeviceConfig;
use les::gguf::{Gguf, MetaValue};
use les::model::Model;
use les::supply::{Schedule, SlotBudget, Supply};
use les::vision::encoder::Ctx;
use les::vision::image::RgbImage;
use les::vision::{encode_image, ClipModel};
use les_core::gemv::Isa;
use les_core::model::forward::TokenInput;

use cli::{synth_once, tmp};
use common::rewrite_gguf;

#[global_allocator]
static ALLOC: counting_alloc::Counting = counting_alloc::Counting;

/// Heap a load plus a short decode of a tiny model may use above what was live
/// before (the models are ~0.3-1 MB; the vocabulary tables, KV cache of 8
/// positions and scratch buffers take ~8 MB).
const HEAP_BOUND: usize = 32 << 20;

/// A tiny synthetic model of `arch`.
fn synth(arch: &str) -> PathBuf {
    synth_once(
        &format!("meta-{arch}.gguf"),
        &["--quiet", "--arch", arch, "--preset", "tiny"],
    )
}

/// A synthetic projector of type `projector` for a tiny model (Qwen3-VL's for
/// a qwen3vlmoe one, whose deepstack mergers it then has).
fn synth_mmproj(projector: &str) -> PathBuf {
    let arch = if projector == "qwen3vl_merger" {
        "qwen3vlmoe"
    } else {
        "qwen3moe"
    };
    let mm = tmp(&format!("meta-mmproj-{projector}.gguf"));
    let mm_arg = mm.to_str().expect("a UTF-8 scratch path");
    synth_once(
        &format!("meta-lm-{projector}.gguf"),
        &[
            "--quiet",
            "--arch",
            arch,
            "--preset",
            "tiny",
            "--projector",
            projector,
            "--mmproj-out",
            mm_arg,
        ],
    );
    mm
}

/// The breaking values of a number of `v`'s type, or none for other types.
fn breaking(v: &MetaValue) -> Vec<MetaValue> {
    const SMALL: [u64; 4] = [0, 1, 3, 1 << 20];
    match v {
        MetaValue::U32(_) => SMALL
            .iter()
            .map(|&x| MetaValue::U32(x as u32))
            .chain([MetaValue::U32(u32::MAX)])
            .collect(),
        MetaValue::I32(_) => SMALL
            .iter()
            .map(|&x| MetaValue::I32(x as i32))
            .chain([MetaValue::I32(-1), MetaValue::I32(i32::MAX)])
            .collect(),
        MetaValue::U64(_) => SMALL
            .iter()
            .map(|&x| MetaValue::U64(x))
            .chain([MetaValue::U64(u64::MAX)])
            .collect(),
        MetaValue::F32(_) => [0.0, -1.0, f32::NAN, f32::INFINITY, 1e30]
            .into_iter()
            .map(MetaValue::F32)
            .collect(),
        _ => Vec::new(),
    }
}

/// Loads `path` and, if it loads, decodes a few tokens with every weight
/// resident; returns the error, if any. Panics propagate (the test fails).
fn load_and_decode(path: &Path) -> Option<String> {
    let model = match Model::open(path) {
        Ok(m) => m,
        Err(e) => return Some(e.to_string()),
    };
    let budget = SlotBudget::none(FileDeviceConfig::default());
    let mut supply = match Supply::new(&model, path, Schedule::Resident, budget) {
        Ok(s) => s,
        Err(e) => return Some(e.to_string()),
    };
    let mut mv = ThreadedMatVec::new(2, Isa::detect());
    let mut session = Session::new(&model, 8).unwrap();
    let mut logits = vec![0f32; model.hp.n_vocab];
    for t in [1u32, 2, 3] {
        let t = t % model.hp.n_vocab.max(1) as u32;
        if let Err(e) = session.eval(
            &mut mv,
            &mut supply,
            None,
            TokenInput::Token(t),
            &mut logits,
        ) {
            return Some(e.to_string());
        }
    }
    None
}

/// Loads the projector at `path` and, if it loads, encodes a small image;
/// returns the error, if any.
fn load_and_encode(path: &Path) -> Option<String> {
    let model = match ClipModel::open(path) {
        Ok(m) => m,
        Err(e) => return Some(e.to_string()),
    };
    let mut pool = Pool::new(2);
    let mut ctx = Ctx {
        pool: &mut pool,
        isa: Isa::detect(),
    };
    let img = RgbImage::filled(40, 24, [200, 30, 90]);
    encode_image(&mut ctx, &model, &img)
        .err()
        .map(|e| e.to_string())
}

/// Tallies of [`edit_every_number`].
#[derive(Default)]
struct Tally {
    cases: usize,
    refused: usize,
    max_heap: usize,
}

/// Sets every number under `prefix` in `src` to each of its [`breaking`]
/// values in turn and runs `try_it` on the edited file: it must not panic nor
/// allocate more than [`HEAP_BOUND`], must refuse non-finite floats, and its
/// errors are one line.
fn edit_every_number(
    src: &Path,
    prefix: &str,
    tally: &mut Tally,
    try_it: impl Fn(&Path) -> Option<String>,
) {
    let name = src.file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(try_it(src), None, "{name}: the unedited file");
    let dst = tmp("meta-edited.gguf");
    let g = Gguf::open(src).unwrap();
    let keys: Vec<(String, MetaValue)> = g
        .metadata()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(k, v)| (k.to_string(), v.to_meta()))
        .collect();
    assert!(keys.len() >= 5, "{name}: only {} keys", keys.len());
    for (key, value) in &keys {
        for bad in breaking(value) {
            rewrite_gguf(
                src,
                &dst,
                |k, v| Some(if k == key { bad.clone() } else { v }),
                vec![],
            );
            let base = counting_alloc::start();
            let err = try_it(&dst);
            let heap = counting_alloc::peak_since(base);
            assert!(
                heap < HEAP_BOUND,
                "{name}: {key} = {bad:?} allocated {heap} bytes"
            );
            tally.max_heap = tally.max_heap.max(heap);
            if matches!(bad, MetaValue::F32(x) if !x.is_finite()) {
                assert!(err.is_some(), "{name}: {key} = {bad:?} was accepted");
            }
            if let Some(e) = err {
                assert!(
                    !e.is_empty() && !e.contains('\n'),
                    "{name}: {key} = {bad:?}: error {e:?}"
                );
                tally.refused += 1;
            }
            tally.cases += 1;
        }
    }
}

// One test: the tests of a binary share the counting allocator.
#[test]
fn broken_hyperparameters_are_errors_not_panics() {
    let mut lm = Tally::default();
    for arch in [
        "qwen3moe",
        "qwen2moe",
        "olmoe",
        "llama",
        "mixtral",
        "qwen35moe",
        "qwen3next",
        "gpt-oss",
        "glm4moe",
        "deepseek2",
        "ernie4_5-moe",
        "bailingmoe2",
        "minimax-m2",
        "dots1",
        "hunyuan-moe",
        "llama4",
        "qwen3vlmoe",
        "qwen3vl",
        "granite",
        "granitemoe",
        "granitehybrid",
        "nemotron_h",
        "nemotron_h_moe",
        "lfm2moe",
        "lfm2",
    ] {
        let src = synth(arch);
        // Mixtral files are `llama` ones.
        let g = Gguf::open(&src).unwrap();
        let prefix = format!("{}.", g.get_str("general.architecture").unwrap());
        edit_every_number(&src, &prefix, &mut lm, load_and_decode);
    }
    let mut vision = Tally::default();
    for projector in ["minicpmv4_6", "gemma3", "qwen3vl_merger"] {
        let src = synth_mmproj(projector);
        edit_every_number(&src, "clip.", &mut vision, load_and_encode);
    }
    for (what, t) in [("language model", &lm), ("projector", &vision)] {
        eprintln!(
            "{what}: {} of {} edits refused; most heap {} bytes",
            t.refused, t.cases, t.max_heap
        );
        // Most edits break the file; some (another context length, epsilon) do not.
        assert!(t.cases > 40 && t.refused > t.cases / 3, "{what}");
    }
}
