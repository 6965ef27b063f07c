//! Vision projector files (mmproj GGUFs) on arbitrary bytes (seeded with tiny
//! `minicpmv4_6`, `gemma3`, `qwen3vl_merger`, `kimivl`, `kimik25`, `llama4`,
//! `glm4v`, `internvl` and `lfm2` projectors): loading one
//! never panics; a projector the loader accepts lays out images of a few
//! sizes, and, where its tower is small, encodes a small picture into as
//! many rows of `row_width` values as the layout says, without a panic
//! (NaNs allowed).
#![no_main]

use les::compute::Pool;
use les::vision::{self, ClipModel, Ctx, RgbImage};
use les_core::gemv::Isa;
use libfuzzer_sys::fuzz_target;

#[path = "input_file.rs"]
mod input_file;

/// Most multiply-adds an encode may cost: larger towers are loaded and laid
/// out but not run, so that each input stays fast.
const MAX_WORK: usize = 1 << 24;

fuzz_target!(|data: &[u8]| {
    let Some(path) = input_file::gguf("mmproj", data) else {
        return;
    };
    let Ok(m) = ClipModel::open(path) else {
        return;
    };
    for size in [(1, 1), (33, 17), (640, 480), (16384, 1)] {
        let layout = vision::image_layout(&m, size);
        let (nx, ny) = vision::merged_grid(&m, size.0, size.1);
        assert!(nx.checked_mul(ny).is_some());
        assert!(layout.n_tokens() < 1 << 24, "{size:?}: {layout:?}");
    }
    let img = RgbImage {
        width: 40,
        height: 30,
        data: (0..40 * 30 * 3).map(|i| (i * 7 % 251) as u8).collect(),
    };
    let hp = &m.hp;
    let pre = vision::preprocess_image(&m, &img);
    let p = hp.patch_size.max(1);
    let patches: usize = pre
        .chunks
        .iter()
        .map(|c| (c.width / p) * (c.height / p))
        .sum();
    let per_patch = hp.n_layer * hp.n_embd * (4 * hp.n_embd + 2 * hp.n_ff)
        + 3 * p * p * hp.n_embd
        + 16 * hp.n_embd * hp.n_embd;
    if patches.saturating_mul(per_patch) > MAX_WORK {
        return;
    }
    let mut pool = Pool::new(1);
    let mut ctx = Ctx {
        pool: &mut pool,
        isa: Isa::detect(),
    };
    let layout = vision::image_layout(&m, (img.width, img.height));
    if let Ok(enc) = vision::encode_image(&mut ctx, &m, &img) {
        assert_eq!(enc.n_embd, m.row_width());
        assert_eq!(enc.n_tokens(), layout.n_tokens());
        for (c, chunk) in enc.chunks.iter().enumerate() {
            assert_eq!(chunk.len(), layout.chunk_tokens[c] * m.row_width());
        }
    }
});
