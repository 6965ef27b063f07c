//! Images in: the vision tower of a multimodal model, from an mmproj GGUF, as
//! llama.cpp's `tools/mtmd` runs it.
//!
//! - [`image`](mod@image): decoding PNG, JPEG, GIF, BMP and PPM files (dimensions bounded before
//!   decoding) to the pixels llama.cpp's stb_image gives.
//! - [`jpeg`]: the JPEG decoder, stb_image's arithmetic.
//! - [`preprocess`]: resizing, MiniCPM-V's slicing into a grid of slices plus an
//!   overview, Llama 4's and InternVL's tiles, Qwen-VL's, Kimi-VL's and
//!   GLM-4.xV's resize to a token budget, LFM2-VL's (and its tiles of large
//!   images), normalisation.
//! - [`clip`]: the mmproj file (`general.architecture = clip`): hyperparameters
//!   and weights, for projector types `minicpmv4_6` (MiniCPM-V 4.6 and 4.7),
//!   `gemma3`, `qwen3vl_merger` (Qwen3-VL; its rows carry the deepstack
//!   features after the embedding: [`ClipModel::row_width`], and its tokens
//!   form a grid: [`merged_grid`]), `kimivl` (Kimi-VL), `kimik25` (Kimi
//!   K2.5, GLM-5.2-V), `llama4` (Llama 4), `glm4v` (GLM-4.5V and 4.6V; a
//!   grid as Qwen3-VL's), `internvl` (InternVL) and `lfm2` (LFM2-VL).
//! - [`encoder`]: the ViT and projector forward pass, multi-threaded.
//! - [`prompt`]: the image embeddings spliced into the token sequence with the
//!   model's special tokens.
//!
//! The vision tower is always resident (memory-mapped); only the language
//! model's experts stream. [`encode_image`] is the whole path from pixels to
//! embeddings.

pub mod clip;
pub mod encoder;
pub mod gemm;
pub mod image;
pub mod jpeg;
pub mod preprocess;
pub mod prompt;

use std::fmt;

use les_core::gemv::GemvError;

pub use clip::{ClipModel, ProjectorType};
pub use encoder::Ctx;
pub use image::{load_image, probe_image, RgbImage};
pub use preprocess::ImageF32;
pub use prompt::{
    build_prompt, build_turn, place_markers, prompt_positions, EncodedImage, MultimodalPrompt,
    MEDIA_MARKER,
};

/// Why a vision step failed.
#[derive(Debug)]
pub enum VisionError {
    /// An image file could not be read or decoded, or is too large.
    Image(String),
    /// The mmproj file is not one LES can run.
    Mmproj(String),
    /// A matrix product failed.
    Gemv(GemvError),
    /// A tensor or image does not have the shape the computation needs.
    Shape(&'static str),
    /// The prompt and the images do not fit together.
    Prompt(String),
}

impl fmt::Display for VisionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VisionError::Image(m) => write!(f, "image: {m}"),
            VisionError::Mmproj(m) => write!(f, "mmproj: {m}"),
            VisionError::Gemv(e) => write!(f, "vision encoder: {e}"),
            VisionError::Shape(m) => write!(f, "vision encoder: {m}"),
            VisionError::Prompt(m) => write!(f, "multimodal prompt: {m}"),
        }
    }
}

impl std::error::Error for VisionError {}

impl From<GemvError> for VisionError {
    fn from(e: GemvError) -> Self {
        VisionError::Gemv(e)
    }
}

/// An image preprocessed for a projector: the normalised pictures the tower
/// encodes one by one (overview first, then slices row by row).
#[derive(Clone, Debug)]
pub struct Preprocessed {
    /// Overview, then slices.
    pub chunks: Vec<ImageF32>,
    /// Slices per row and rows of slices (`(0, 0)` without slices).
    pub grid: (usize, usize),
}

/// The most slices MiniCPM-V cuts an image into (llama.cpp's `max_slice_nums`).
pub const MAX_SLICES: usize = 9;

/// Resizes, slices and normalises `img` as the projector of `m` expects.
pub fn preprocess_image(m: &ClipModel, img: &RgbImage) -> Preprocessed {
    let hp = &m.hp;
    let norm = |i: &RgbImage| preprocess::normalize(i, hp.mean, hp.std);
    match hp.projector {
        ProjectorType::MiniCpmV46
        | ProjectorType::Llama4
        | ProjectorType::InternVl
        | ProjectorType::Lfm2 => {
            // LFM2's resizes are bilinear (llama.cpp's `image_resize_algo_ov`
            // / `_rf`), the others' bicubic; the overview unpadded and the
            // slices' image padded.
            let algo = if hp.projector == ProjectorType::Lfm2 {
                preprocess::ResizeAlgo::Bilinear
            } else {
                preprocess::ResizeAlgo::Bicubic
            };
            let inst = llava_uhd_slices(m, (img.width, img.height));
            let sliced = preprocess::slice_image_with(img, &inst, algo);
            let mut chunks = vec![norm(&sliced.overview)];
            chunks.extend(sliced.slices.iter().map(norm));
            Preprocessed {
                chunks,
                grid: sliced.grid,
            }
        }
        ProjectorType::Gemma3 => {
            let s = hp.image_size;
            let resized =
                preprocess::resize_padded(img, s, s, preprocess::ResizeAlgo::Bilinear, [0; 3]);
            Preprocessed {
                chunks: vec![norm(&resized)],
                grid: (0, 0),
            }
        }
        ProjectorType::Qwen3Vl
        | ProjectorType::KimiVl
        | ProjectorType::KimiK25
        | ProjectorType::Glm4v => {
            // llama.cpp's dyn_size preprocessor: bicubic into the smart size,
            // aspect kept and centred on black (its default PAD_CEIL).
            let (w, h) = dyn_size(m, (img.width, img.height));
            let resized =
                preprocess::resize_padded(img, w, h, preprocess::ResizeAlgo::Bicubic, [0; 3]);
            Preprocessed {
                chunks: vec![norm(&resized)],
                grid: (0, 0),
            }
        }
    }
}

/// The size Qwen3-VL's and Kimi-VL's projectors resize an image of `size`
/// to: multiples of a merged patch a side, within the projector's token
/// budget (llama.cpp's 8 to 4096 merged tokens for Qwen3-VL, 8 to 1024 for
/// Kimi-VL, or `--image-min-tokens` / `--image-max-tokens`).
fn dyn_size(m: &ClipModel, size: (usize, usize)) -> (usize, usize) {
    let hp = &m.hp;
    preprocess::smart_resize(
        size,
        hp.patch_size * hp.n_merge,
        hp.image_min_pixels,
        hp.image_max_pixels,
    )
}

/// The grid of merged tokens an image of `width` x `height` pixels becomes:
/// `(tokens per row, rows)`, llama.cpp's `clip_n_output_tokens_x` and `_y`.
/// For Qwen3-VL the encoder's rows are this grid, row-major (the language
/// model's M-RoPE positions come from it); the other projectors' tokens are no
/// grid: `(tokens, 1)` of the image's first chunk, as llama.cpp says.
pub fn merged_grid(m: &ClipModel, width: usize, height: usize) -> (usize, usize) {
    match m.hp.projector {
        ProjectorType::Qwen3Vl | ProjectorType::Glm4v => {
            let (w, h) = dyn_size(m, (width, height));
            let p = m.hp.patch_size;
            ((w / p) / 2, (h / p) / 2)
        }
        _ => {
            let layout = image_layout(m, (width, height));
            (layout.chunk_tokens.first().copied().unwrap_or(0), 1)
        }
    }
}

/// What [`encode_image`] makes of an image, known from its size alone: the
/// embeddings of each chunk and the slice grid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageLayout {
    /// Embeddings of the overview, then of each slice, row by row.
    pub chunk_tokens: Vec<usize>,
    /// Slices per row and rows of slices (`(0, 0)` without slices).
    pub grid: (usize, usize),
}

impl ImageLayout {
    /// Embeddings in all chunks.
    pub fn n_tokens(&self) -> usize {
        self.chunk_tokens.iter().sum()
    }
}

/// How the MiniCPM-V, Llama 4, InternVL or LFM2-VL projector of `m` slices
/// an image of `(width, height)` pixels (llama.cpp's llava-uhd slicing:
/// MiniCPM-V's dynamic grid, Llama 4's and InternVL's tiles, LFM2-VL's
/// overview within its token budget and tiles of large images):
/// [`preprocess_image`] cuts the pixels so, [`image_layout`] counts the
/// embeddings.
fn llava_uhd_slices(m: &ClipModel, size: (usize, usize)) -> preprocess::SliceInstructions {
    let hp = &m.hp;
    if hp.projector == ProjectorType::Lfm2 {
        return preprocess::lfm2_instructions(
            size,
            hp.patch_size * hp.n_merge,
            hp.patch_size,
            (hp.image_min_pixels, hp.image_max_pixels),
        );
    }
    if hp.projector == ProjectorType::Llama4 {
        return preprocess::tile_instructions(size, hp.image_size, &preprocess::llama4_grids());
    }
    if hp.projector == ProjectorType::InternVl {
        let grids = preprocess::internvl_grids(hp.tiles.0, hp.tiles.1);
        return preprocess::tile_instructions(size, hp.image_size, &grids);
    }
    preprocess::slice_instructions(size, hp.image_size, hp.patch_size * hp.n_merge, MAX_SLICES)
}

/// The layout of an image of `width` x `height` pixels, without its pixels:
/// what the prompt's length will be is known before any image is encoded.
pub fn image_layout(m: &ClipModel, size: (usize, usize)) -> ImageLayout {
    let tokens = |(w, h): (usize, usize)| encoder::output_tokens(m, w, h);
    match m.hp.projector {
        ProjectorType::MiniCpmV46
        | ProjectorType::Llama4
        | ProjectorType::InternVl
        | ProjectorType::Lfm2 => {
            let inst = llava_uhd_slices(m, size);
            let mut chunk_tokens = vec![tokens(inst.overview)];
            chunk_tokens.extend(inst.slices.iter().map(|&(_, _, w, h)| tokens((w, h))));
            ImageLayout {
                chunk_tokens,
                grid: inst.grid,
            }
        }
        ProjectorType::Gemma3 => ImageLayout {
            chunk_tokens: vec![tokens((m.hp.image_size, m.hp.image_size))],
            grid: (0, 0),
        },
        ProjectorType::Qwen3Vl
        | ProjectorType::KimiVl
        | ProjectorType::KimiK25
        | ProjectorType::Glm4v => ImageLayout {
            chunk_tokens: vec![tokens(dyn_size(m, size))],
            grid: (0, 0),
        },
    }
}

/// Preprocesses and encodes `img`: the embeddings of its overview and slices
/// (each embedding [`ClipModel::row_width`] values).
pub fn encode_image(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &RgbImage,
) -> Result<EncodedImage, VisionError> {
    let pre = preprocess_image(m, img);
    let mut chunks = Vec::with_capacity(pre.chunks.len());
    for c in &pre.chunks {
        chunks.push(encoder::encode(ctx, m, c)?);
    }
    // Where an M-RoPE language model places the embeddings (llama.cpp's
    // `mtmd`): MiniCPM-V's and Llama 4's overview and slices in sequence,
    // the others' one chunk as its grid (Gemma 3's and Kimi-VL's one row,
    // Qwen3-VL's merged patches).
    let chunk_grids = match m.hp.projector {
        ProjectorType::MiniCpmV46
        | ProjectorType::Llama4
        | ProjectorType::InternVl
        | ProjectorType::Lfm2 => Vec::new(),
        ProjectorType::Gemma3
        | ProjectorType::Qwen3Vl
        | ProjectorType::KimiVl
        | ProjectorType::KimiK25
        | ProjectorType::Glm4v => {
            vec![merged_grid(m, img.width, img.height)]
        }
    };
    Ok(EncodedImage {
        chunks,
        grid: pre.grid,
        n_embd: m.row_width(),
        chunk_grids,
    })
}
