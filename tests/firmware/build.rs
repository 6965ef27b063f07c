//! Puts the model into the firmware and sizes its static buffers.
//!
//! Inputs (environment variables; `run.sh` next to this file sets them):
//! - `LES_FW_MODEL`: the packed GGUF (`les synth` + `les pack`), embedded in flash;
//! - `LES_FW_INDEX`: its index (`les mcu-index`), embedded too;
//! - `LES_FW_PROMPT`: the prompt's token ids, comma-separated (tokenized on a host);
//! - `LES_FW_N`: tokens to generate (default 8);
//! - `LES_FW_SLOTS`: expert slots in RAM (default 4), split across the experts'
//!   sizes as `les run --slots` splits them (les-core's slot classes).
//!
//! Writes `$OUT_DIR/model.rs` (constants, and the embedded bytes) and puts
//! `linker/memory.x` on the linker's search path.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;

use les_core::model::forward::{KvCache, Scratch};
use les_core::slot_classes::{plan_by_count, SizeGroup};

#[allow(dead_code)]
#[path = "src/index.rs"]
mod index;

fn var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

fn required(name: &str) -> String {
    var(name).unwrap_or_else(|| {
        panic!(
            "{name} is not set. The firmware embeds a model: run tests/firmware/run.sh, \
             or set LES_FW_MODEL (packed GGUF), LES_FW_INDEX (`les mcu-index` output) \
             and LES_FW_PROMPT (token ids, comma-separated)"
        )
    })
}

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());

    // The linker script of the board, from the repository's linker/ folder.
    let memory_x = manifest.join("../../linker/memory.x");
    println!("cargo:rerun-if-changed={}", memory_x.display());
    fs::copy(&memory_x, out.join("memory.x")).expect("linker/memory.x is readable");
    println!("cargo:rustc-link-search={}", out.display());
    println!("cargo:rerun-if-changed=src/index.rs");

    let model_path = required("LES_FW_MODEL");
    let index_path = required("LES_FW_INDEX");
    println!("cargo:rerun-if-changed={model_path}");
    println!("cargo:rerun-if-changed={index_path}");
    let model = fs::read(&model_path).unwrap_or_else(|e| panic!("{model_path}: {e}"));
    let index_bytes = fs::read(&index_path).unwrap_or_else(|e| panic!("{index_path}: {e}"));
    let idx =
        index::Index::<256>::parse(&index_bytes).unwrap_or_else(|e| panic!("{index_path}: {e}"));
    assert_eq!(
        idx.model_len,
        model.len(),
        "{index_path} describes a model of another size than {model_path}"
    );
    let prompt: Vec<u32> = required("LES_FW_PROMPT")
        .split(',')
        .map(|t| t.trim().parse().expect("LES_FW_PROMPT holds token ids"))
        .collect();
    let n_predict: usize = var("LES_FW_N").map_or(8, |v| v.parse().expect("LES_FW_N"));
    let slots: usize = var("LES_FW_SLOTS").map_or(4, |v| v.parse().expect("LES_FW_SLOTS"));
    let hp = idx.hp;
    let n_experts = hp.moe.map_or(0, |m| m.n_experts);
    let max_pos = prompt.len() + n_predict;
    let max_cols = idx.max_cols();

    fs::write(out.join("model.bin"), &model).unwrap();
    fs::write(out.join("index.bin"), &index_bytes).unwrap();
    let mut rs = String::new();
    let mut c = |name: &str, ty: &str, v: String| {
        writeln!(rs, "pub const {name}: {ty} = {v};").unwrap();
    };
    c("PROMPT", "&[u32]", format!("&{prompt:?}"));
    c("N_PREDICT", "usize", n_predict.to_string());
    // Slots sized to the experts that use them (les-core's slot classes): a
    // model packed with several expert types gets a run of slots per size,
    // each size the same share of its experts, at least one layer's picks.
    let sizes = (0..hp.n_layers).filter_map(|l| {
        let x = idx.expert(l, 0).ok()??;
        let bytes: usize = x.parts[..x.n_parts].iter().map(|p| p.1).sum();
        Some(SizeGroup {
            bytes: bytes as u32,
            count: n_experts as u32,
        })
    });
    let top_k = hp.moe.map_or(1, |m| m.top_k) as u32;
    let classes = if n_experts == 0 {
        Vec::new()
    } else {
        plan_by_count(sizes, slots as u32, top_k)
            .unwrap_or_else(|e| panic!("LES_FW_SLOTS={slots}: {e}"))
            .to_vec()
    };
    let n_slots: u32 = classes.iter().map(|c| c.slots).sum();
    let slot_memory: u64 = classes
        .iter()
        .map(|c| c.slots as u64 * c.bytes as u64)
        .sum();
    let runs: Vec<String> = classes
        .iter()
        .map(|c| {
            format!(
                "les_core::slot_classes::SlotClass {{ slots: {}, bytes: {} }}",
                c.slots, c.bytes
            )
        })
        .collect();
    c(
        "SLOT_CLASSES",
        &format!("[les_core::slot_classes::SlotClass; {}]", classes.len()),
        format!("[{}]", runs.join(", ")),
    );
    c("N_SLOTS", "usize", n_slots.max(1).to_string());
    c("SLOT_MEMORY", "usize", slot_memory.max(1).to_string());
    c("SLOT_BYTES", "usize", idx.slot_bytes.to_string());
    c("N_LAYERS", "usize", hp.n_layers.to_string());
    c("N_EXPERTS", "usize", n_experts.to_string());
    c("N_VOCAB", "usize", hp.n_vocab.to_string());
    c("MAX_POS", "usize", max_pos.to_string());
    c("KV_LEN", "usize", KvCache::len(&hp, max_pos).to_string());
    c(
        "SCRATCH_LEN",
        "usize",
        Scratch::len(&hp, max_pos).to_string(),
    );
    c("Q8_BLOCKS", "usize", max_cols.div_ceil(32).to_string());
    c("Q8K_BLOCKS", "usize", max_cols.div_ceil(256).to_string());
    c("MODEL_LEN", "usize", model.len().to_string());
    c("INDEX_LEN", "usize", index_bytes.len().to_string());
    writeln!(
        rs,
        "/// The packed GGUF, in flash, aligned like the file's own alignment.\n\
         pub static MODEL: crate::Aligned4096<[u8; MODEL_LEN]> = \
         crate::Aligned4096(*include_bytes!(concat!(env!(\"OUT_DIR\"), \"/model.bin\")));\n\
         /// The model index, in flash.\n\
         pub static INDEX: crate::Aligned4<[u8; INDEX_LEN]> = \
         crate::Aligned4(*include_bytes!(concat!(env!(\"OUT_DIR\"), \"/index.bin\")));"
    )
    .unwrap();
    fs::write(out.join("model.rs"), rs).unwrap();
}
