//! An mmproj GGUF (`general.architecture = clip`) as a loaded vision encoder:
//! hyperparameters, the ViT's tensors and the projector's.
//!
//! Projector types: `minicpmv4_6` (MiniCPM-V 4.6 / 4.7), `gemma3` (Gemma 3) and
//! `qwen3vl_merger` (Qwen3-VL: a fused-QKV ViT with learned, interpolated
//! position embeddings and M-RoPE, a 2x2 merger and deepstack mergers) and
//! `kimivl` (Kimi-VL's MoonViT: learned position embeddings interpolated with
//! antialiasing, a 2-D RoPE, an n x n patch merger and a LayerNorm + GELU MLP)
//! `kimik25` (Kimi K2.5's and GLM-5.2-V's MoonViT3d for still images: the
//! same, its position table interpolated bicubically) and `llama4` (Llama
//! 4's: a class token, the 2-D RoPE, a pixel shuffle and a GELU MLP;
//! 336-pixel tiles plus an overview) and `glm4v` (GLM-4.5V's and GLM-4.6V's:
//! Qwen3-VL's patches and M-RoPE with RMSNorms, a SwiGLU ViT, a bicubically
//! interpolated position table, a 2x2 convolution merger, a projection,
//! LayerNorm + GELU and a SwiGLU MLP) and `internvl` (InternVL's:
//! InternViT over 448-pixel tiles with a class token after the patches and
//! layer scales, a pixel shuffle, LayerNorm and a GELU MLP) and `lfm2`
//! (LFM2-VL's SigLIP2: a position table resized with antialiasing, a pixel
//! unshuffle, an optional LayerNorm and a GELU MLP).
//!
//! Tensor and key names are llama.cpp's (`tools/mtmd/clip-impl.h`). Matrices stay
//! in the memory-mapped file in their own type and are multiplied with
//! [`les_core::gemv`]'s kernels; vectors (norms, biases, position embeddings) are
//! dequantized to `f32` at load.

use std::ops::Range;
use std::path::Path;

use les_core::gemv::{activation_format, GemvError, MatrixView};
use les_core::quant::{self, GgmlType};

use super::VisionError;
use crate::gguf::{Gguf, MappedFile, Tensor};

/// The projector types LES implements (llama.cpp's names in the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProjectorType {
    /// MiniCPM-V 4.6 / 4.7 (`minicpmv4_6`): SigLIP ViT with a window-attention
    /// merger inside the tower and a downsample MLP merger after it.
    MiniCpmV46,
    /// Gemma 3 (`gemma3`): SigLIP ViT, average pooling, RMSNorm and a projection.
    Gemma3,
    /// Qwen3-VL (`qwen3vl_merger`): ViT with two temporal patch kernels, learned
    /// position embeddings interpolated to the image's grid, M-RoPE, a 2x2
    /// merger MLP and deepstack mergers on some blocks; images of any size
    /// (within a token budget), one chunk each.
    Qwen3Vl,
    /// Kimi-VL (`kimivl`): MoonViT with learned position embeddings
    /// interpolated to the image's grid, a 2-D RoPE (half of each head by the
    /// patch's column, half by its row), an n x n patch merger, LayerNorm and
    /// a GELU MLP; images of any size (within a token budget), one chunk each.
    KimiVl,
    /// Kimi K2.5 and GLM-5.2-V (`kimik25`): Kimi-VL's tower and projector
    /// with a `[n_embd, W, H]` position table interpolated bicubically, the
    /// projector's norm at the file's epsilon, and the token budget of the
    /// file (`image_min_pixels` / `image_max_pixels`) or 2 to 4096.
    KimiK25,
    /// Llama 4 (`llama4`): a ViT over fixed-size tiles with a class token,
    /// learned position embeddings and the 2-D RoPE (by column and row, from
    /// 1; the class token at 0), a pixel shuffle of n x n patches and a
    /// two-layer GELU MLP before a projection; a large image is cut into a
    /// grid of up to 3 x 3 tiles plus an overview.
    Llama4,
    /// GLM-4.5V and GLM-4.6V (`glm4v`): Qwen3-VL's two temporal patch
    /// kernels, merge order and vision M-RoPE, with RMSNorms, a SwiGLU FFN,
    /// a norm after the patch embedding and the position table interpolated
    /// bicubically; then a 2x2 convolution merger, a projection, LayerNorm,
    /// GELU and a SwiGLU MLP; images of any size (within a token budget),
    /// one chunk each.
    Glm4v,
    /// InternVL 2.5 / 3 / 3.5 (`internvl`): InternViT over fixed-size tiles
    /// (a class token after the patches, learned position embeddings, layer
    /// scales; RMSNorms and Q/K norms in the 6B ViT), a pixel shuffle of
    /// n x n patches, LayerNorm and a GELU MLP; a large image is cut into
    /// the grid of tiles (within the file's tile bounds) that fits it best,
    /// the tiles then an overview.
    InternVl,
    /// LFM2-VL and LFM2.5-VL (`lfm2`): SigLIP2 with its learned position
    /// table resized to the image's grid (antialiased bilinear), a pixel
    /// unshuffle of n x n patches, an optional LayerNorm over each merged
    /// row and a GELU MLP; images of any size (64 to 256 merged tokens),
    /// a large one also cut into 512-pixel tiles before its thumbnail.
    Lfm2,
}

impl ProjectorType {
    /// The name in `clip.projector_type`.
    pub fn name(self) -> &'static str {
        match self {
            ProjectorType::MiniCpmV46 => "minicpmv4_6",
            ProjectorType::Gemma3 => "gemma3",
            ProjectorType::Qwen3Vl => "qwen3vl_merger",
            ProjectorType::KimiVl => "kimivl",
            ProjectorType::KimiK25 => "kimik25",
            ProjectorType::Llama4 => "llama4",
            ProjectorType::Glm4v => "glm4v",
            ProjectorType::InternVl => "internvl",
            ProjectorType::Lfm2 => "lfm2",
        }
    }

    /// Parses a `clip.projector_type` value.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "minicpmv4_6" => Some(ProjectorType::MiniCpmV46),
            "gemma3" => Some(ProjectorType::Gemma3),
            "qwen3vl_merger" => Some(ProjectorType::Qwen3Vl),
            "kimivl" => Some(ProjectorType::KimiVl),
            "kimik25" => Some(ProjectorType::KimiK25),
            "llama4" => Some(ProjectorType::Llama4),
            "glm4v" => Some(ProjectorType::Glm4v),
            "internvl" => Some(ProjectorType::InternVl),
            "lfm2" => Some(ProjectorType::Lfm2),
            _ => None,
        }
    }

    /// The merged tokens an image is resized to by default, `(fewest, most)`
    /// (llama.cpp's `set_limit_image_tokens` in `clip.cpp`), for the
    /// projectors that size images dynamically; `None` for those that take
    /// fixed sizes.
    pub fn token_budget(self) -> Option<(usize, usize)> {
        match self {
            ProjectorType::Qwen3Vl | ProjectorType::Glm4v => Some((8, 4096)),
            ProjectorType::KimiVl => Some((8, 1024)),
            ProjectorType::KimiK25 => Some((2, 4096)),
            ProjectorType::Lfm2 => Some((64, 256)),
            ProjectorType::MiniCpmV46
            | ProjectorType::Gemma3
            | ProjectorType::Llama4
            | ProjectorType::InternVl => None,
        }
    }
}

/// The activation of the ViT's feed-forward blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnOp {
    /// GELU, tanh approximation (`clip.use_gelu`).
    Gelu,
    /// GELU with `erf`.
    GeluErf,
    /// `x * sigmoid(1.702 x)` (neither `use_gelu` nor `use_silu`).
    GeluQuick,
    /// `x * sigmoid(x)` (`clip.use_silu`).
    Silu,
}

/// Hyperparameters of the vision tower.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipHparams {
    /// The projector.
    pub projector: ProjectorType,
    /// ViT width.
    pub n_embd: usize,
    /// ViT FFN width.
    pub n_ff: usize,
    /// ViT blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
    /// Input size (the slice size of llava-uhd slicing).
    pub image_size: usize,
    /// Patch size.
    pub patch_size: usize,
    /// Normalisation mean per channel.
    pub mean: [f32; 3],
    /// Normalisation standard deviation per channel.
    pub std: [f32; 3],
    /// The FFN activation.
    pub ffn_op: FfnOp,
    /// Spatial merge per side: 4 for MiniCPM-V 4.6 (2x2 twice), the pooling
    /// kernel for Gemma 3, 2 for Qwen3-VL, the patch merger's for Kimi-VL,
    /// the pixel shuffle's for Llama 4.
    pub n_merge: usize,
    /// MiniCPM-V 4.6: the ViT block after which the window-attention merger runs.
    pub insert_layer: usize,
    /// Width of the projector's embeddings (the language model's `n_embd`).
    /// Qwen3-VL's output rows are wider: this, then one more of this width
    /// per deepstack merger ([`ClipModel::row_width`]).
    pub n_mmproj_embd: usize,
    /// Qwen3-VL: deepstack mergers (blocks whose output is also merged and
    /// projected into the row); 0 for the other projectors.
    pub n_deepstack: usize,
    /// Qwen3-VL and Kimi-VL: the fewest pixels an image is resized to
    /// (llama.cpp's `image_min_pixels`: 8 merged tokens); 0 for the other
    /// projectors.
    pub image_min_pixels: usize,
    /// Qwen3-VL and Kimi-VL: the most pixels an image is resized to
    /// (llama.cpp's `image_max_pixels`: 4096 merged tokens for Qwen3-VL, 1024
    /// for Kimi-VL); 0 for the other projectors.
    pub image_max_pixels: usize,
    /// The tower's norms are RMSNorms (GLM-4.xV, InternVL's 6B ViT), not
    /// LayerNorms.
    pub rms_norm: bool,
    /// InternVL: the fewest and most tiles an image is cut into
    /// (`clip.vision.preproc_min_tiles` / `_max_tiles`, 1 and 12 by
    /// default); `(0, 0)` for the other projectors.
    pub tiles: (usize, usize),
    /// Kimi K2.5: the file sets the pixel budget (both
    /// `clip.vision.image_min_pixels` and `_max_pixels`), and
    /// `--image-min-tokens` / `--image-max-tokens` leave it, as in llama.cpp.
    pub pixels_from_file: bool,
}

/// Where a matrix's bytes are.
#[derive(Clone, Debug)]
enum Bytes {
    /// A range of the mapped file.
    Mapped(Range<usize>),
    /// Owned (e.g. transposed at load).
    Owned(Vec<u8>),
}

/// A weight matrix: `rows` x `cols` of `ty`.
#[derive(Clone, Debug)]
pub struct Mat {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: Bytes,
}

impl Mat {
    /// The matrix's bytes: a range of `file` (the mapped mmproj) where it is
    /// mapped, else its own.
    fn raw<'a>(&'a self, file: &'a [u8]) -> &'a [u8] {
        match &self.bytes {
            Bytes::Mapped(r) => &file[r.clone()],
            Bytes::Owned(b) => &b[..],
        }
    }

    /// This matrix with `f32` weights rounded to `f16` (others as they are);
    /// `file` holds a mapped matrix's bytes (an owned one's are its own).
    fn f32_as_f16(self, file: &[u8]) -> Mat {
        if self.ty != GgmlType::F32 {
            return self;
        }
        let bytes = self
            .raw(file)
            .chunks_exact(4)
            .flat_map(|c| {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                quant::f32_to_f16(v).to_le_bytes()
            })
            .collect();
        Mat {
            ty: GgmlType::F16,
            bytes: Bytes::Owned(bytes),
            ..self
        }
    }

    /// This matrix as the kernel of `ggml_conv_2d`, which multiplies it by
    /// its input unfolded (`im2col`) with the operands swapped: an `f16` or
    /// `f32` kernel, and the input, in `f16` (an `f32` kernel rounded to
    /// `f16` here; [`super::encoder`] rounds the input for every `f16`
    /// matrix); a `bf16` kernel widened to `f32` (exactly) against the
    /// `f32` input, which ggml then leaves unrounded.
    fn conv_kernel(self, file: &[u8]) -> Mat {
        if self.ty != GgmlType::BF16 {
            return self.f32_as_f16(file);
        }
        let bytes = self
            .raw(file)
            .chunks_exact(2)
            .flat_map(|c| quant::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])).to_le_bytes())
            .collect();
        Mat {
            ty: GgmlType::F32,
            bytes: Bytes::Owned(bytes),
            ..self
        }
    }

    /// Rows `start..end` of this matrix (a fused matrix's parts), or `None`
    /// when the range is outside it or its type has no whole-row size.
    fn row_range(&self, start: usize, end: usize) -> Option<Mat> {
        if start > end || end > self.rows {
            return None;
        }
        let rb = self.ty.row_bytes(self.cols)?;
        let (a, b) = (start * rb, end * rb);
        let bytes = match &self.bytes {
            Bytes::Mapped(r) => Bytes::Mapped(r.start + a..r.start + b),
            Bytes::Owned(v) => Bytes::Owned(v.get(a..b)?.to_vec()),
        };
        Some(Mat {
            ty: self.ty,
            rows: end - start,
            cols: self.cols,
            bytes,
        })
    }

    /// Rows (outputs).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (inputs).
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// A linear layer `y = W x + b`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// The weight.
    pub w: Mat,
    /// The bias (`rows` values).
    pub b: Option<Vec<f32>>,
}

/// A LayerNorm (or RMSNorm) weight and optional bias.
#[derive(Clone, Debug)]
pub struct Norm {
    /// Scale.
    pub w: Vec<f32>,
    /// Shift.
    pub b: Option<Vec<f32>>,
}

/// One ViT block.
#[derive(Clone, Debug)]
pub struct VitLayer {
    /// Pre-attention LayerNorm.
    pub ln1: Norm,
    /// Query projection.
    pub q: Linear,
    /// Key projection.
    pub k: Linear,
    /// Value projection.
    pub v: Linear,
    /// Output projection.
    pub o: Linear,
    /// Layer scale after attention.
    pub ls1: Option<Vec<f32>>,
    /// Pre-FFN LayerNorm.
    pub ln2: Norm,
    /// FFN up projection.
    pub ffn_up: Linear,
    /// FFN gate projection (gated FFNs).
    pub ffn_gate: Option<Linear>,
    /// FFN down projection.
    pub ffn_down: Linear,
    /// Layer scale after the FFN.
    pub ls2: Option<Vec<f32>>,
    /// Norm of the queries, over all heads at once (InternViT-6B's).
    pub q_norm: Option<Norm>,
    /// Norm of the keys, over all heads at once.
    pub k_norm: Option<Norm>,
}

/// MiniCPM-V 4.6's merger inside the tower: window attention over 2x2 patches,
/// then a 2x2 downsample MLP.
#[derive(Clone, Debug)]
pub struct VitMerger {
    /// LayerNorm before the window attention.
    pub ln1: Norm,
    /// Query projection.
    pub q: Linear,
    /// Key projection.
    pub k: Linear,
    /// Value projection.
    pub v: Linear,
    /// Output projection.
    pub o: Linear,
    /// LayerNorm of the concatenated 2x2 tokens.
    pub ds_ln: Norm,
    /// Downsample MLP up.
    pub ds_up: Linear,
    /// Downsample MLP down.
    pub ds_down: Linear,
}

/// Qwen3-VL's deepstack merger on one ViT block: the block's output, 2x2
/// tokens concatenated, through LayerNorm and a GELU MLP.
#[derive(Clone, Debug)]
pub struct Deepstack {
    /// The block (0-based) whose output it takes.
    pub layer: usize,
    /// LayerNorm of the concatenated 2x2 tokens (`4 * n_embd`; a missing
    /// weight is ones, as llama.cpp's `build_norm` skips it).
    pub norm: Norm,
    /// MLP up (`v.deepstack.N.fc1`).
    pub fc1: Linear,
    /// MLP down (`v.deepstack.N.fc2`), to `n_mmproj_embd`.
    pub fc2: Linear,
}

/// The projector after the ViT.
#[derive(Clone, Debug)]
pub enum Projector {
    /// MiniCPM-V 4.6: optional in-tower merger, then the final 2x2 merger MLP.
    MiniCpmV46 {
        /// The merger inside the tower (absent when `n_merge` is 2).
        vit_merger: Option<Box<VitMerger>>,
        /// LayerNorm of the concatenated 2x2 tokens.
        input_norm: Norm,
        /// MLP up.
        up: Linear,
        /// MLP down (to the language model's width).
        down: Linear,
    },
    /// Gemma 3: average pooling, RMSNorm, projection.
    Gemma3 {
        /// RMSNorm weight (Gemma's `1 + w` already applied by the converter).
        soft_emb_norm: Vec<f32>,
        /// Projection, `n_mmproj_embd` x `n_embd` (transposed at load).
        input_proj: Mat,
    },
    /// Qwen3-VL: the second temporal patch kernel, the deepstack mergers and
    /// the final 2x2 merger MLP (after `post_ln`, the merger's norm).
    Qwen3Vl {
        /// The patch kernel of the second frame (`v.patch_embd.weight.1`); a
        /// still image is both frames, so the patch embedding is the sum of
        /// both kernels' products.
        patch_embd_1: Mat,
        /// Deepstack mergers, by block.
        deepstack: Vec<Deepstack>,
        /// Merger MLP up (`mm.0`).
        up: Linear,
        /// Merger MLP down (`mm.2`), to `n_mmproj_embd`.
        down: Linear,
    },
    /// Kimi-VL: after the ViT (and `post_ln`), each `n_merge` x `n_merge`
    /// block of patches concatenated, each patch LayerNormed, then a GELU MLP.
    KimiVl {
        /// LayerNorm of each patch before the MLP (`mm.input_norm`, `n_embd`
        /// wide, epsilon 1e-5 whatever the file says, as clip.cpp).
        input_norm: Norm,
        /// MLP up (`mm.1`), from `n_merge² * n_embd`.
        up: Linear,
        /// MLP down (`mm.2`), to `n_mmproj_embd`.
        down: Linear,
    },
    /// Llama 4: the class token, then after the ViT a pixel shuffle, two GELU
    /// layers and a projection, none with a bias.
    Llama4 {
        /// The class token's embedding (`v.class_embd`), after the patches.
        class_embd: Vec<f32>,
        /// Adapter MLP's first layer (`mm.model.mlp.1`), from `n_merge² *
        /// n_embd`.
        mlp1: Mat,
        /// Adapter MLP's second layer (`mm.model.mlp.2`).
        mlp2: Mat,
        /// The projection to the language model (`mm.model.fc`).
        fc: Mat,
    },
    /// InternVL: the class token, then after the ViT a pixel shuffle,
    /// LayerNorm and a GELU MLP.
    InternVl {
        /// The class token's embedding (`v.class_embd`), after the patches.
        class_embd: Vec<f32>,
        /// LayerNorm of each shuffled row (`mm.model.mlp.0`, epsilon 1e-5).
        norm: Norm,
        /// MLP up (`mm.model.mlp.1`), from `n_merge² * n_embd`.
        up: Linear,
        /// MLP down (`mm.model.mlp.3`), to `n_mmproj_embd`.
        down: Linear,
    },
    /// LFM2-VL: after the ViT (and `post_ln` where the file has it) each
    /// `n_merge` x `n_merge` block of patches as one row, LayerNormed where
    /// the file has the norm, then a GELU MLP.
    Lfm2 {
        /// LayerNorm of each merged row (`mm.input_norm`, `n_merge² *
        /// n_embd` wide, epsilon 1e-5), optional as in clip.cpp.
        input_norm: Option<Norm>,
        /// MLP up (`mm.1`), from `n_merge² * n_embd`.
        up: Linear,
        /// MLP down (`mm.2`), to `n_mmproj_embd`.
        down: Linear,
    },
    /// GLM-4.xV: the second temporal patch kernel, an RMSNorm after the
    /// patch embedding, then after the ViT (and `post_ln`) the merger.
    Glm4v {
        /// The patch kernel of the second frame (`v.patch_embd.weight.1`),
        /// as Qwen3-VL's.
        patch_embd_1: Mat,
        /// RMSNorm after the patch embedding and its bias (`v.norm_embd`).
        norm_embd: Option<Norm>,
        /// The merger.
        merger: Box<Glm4vMerger>,
    },
}

/// GLM-4.xV's projector after the ViT: a 2x2 convolution over each merged
/// block, a projection, LayerNorm, GELU and a SwiGLU MLP.
#[derive(Clone, Debug)]
pub struct Glm4vMerger {
    /// The 2x2 convolution (`mm.patch_merger`, with its bias) as a matrix
    /// over a block's `4 * n_embd` values in (channel, row, column) order.
    pub conv: Linear,
    /// The projection (`mm.model.fc`; no bias in llama.cpp's graph).
    pub fc: Mat,
    /// LayerNorm after it (`mm.post_norm`, epsilon 1e-5).
    pub post_norm: Norm,
    /// MLP up (`mm.up`).
    pub up: Linear,
    /// MLP gate (`mm.gate`).
    pub gate: Linear,
    /// MLP down (`mm.down`), to `n_mmproj_embd`.
    pub down: Linear,
}

/// A loaded mmproj file.
pub struct ClipModel {
    gguf: Gguf<MappedFile>,
    /// Hyperparameters.
    pub hp: ClipHparams,
    /// Patch embedding as a matrix: `n_embd` x `3 * patch * patch`, columns in
    /// (channel, y, x) order.
    pub patch_embd: Mat,
    /// Patch embedding bias.
    pub patch_bias: Option<Vec<f32>>,
    /// Learned position embeddings, `n_pos` rows of `n_embd`.
    pub pos_embd: Vec<f32>,
    /// Rows of `pos_embd`.
    pub n_pos: usize,
    /// The position table's grid `(width, height)`: Kimi K2.5's from its
    /// `[n_embd, W, H]` shape, the others' `(n_pos, 1)` (square tables are
    /// taken as square where a tower interpolates them).
    pub pos_grid: (usize, usize),
    /// LayerNorm before the blocks.
    pub pre_ln: Option<Norm>,
    /// The blocks.
    pub layers: Vec<VitLayer>,
    /// LayerNorm after the blocks.
    pub post_ln: Option<Norm>,
    /// The projector.
    pub projector: Projector,
}

impl std::fmt::Debug for ClipModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipModel").field("hp", &self.hp).finish()
    }
}

fn err(m: impl Into<String>) -> VisionError {
    VisionError::Mmproj(m.into())
}

/// The largest dimension accepted for any hyperparameter (guards allocations).
const MAX_DIM: usize = 1 << 16;
/// The most patches a side of `clip.vision.image_size` may have.
const MAX_PATCHES_PER_SIDE: usize = 128;
/// The largest merged patch (patch x merge, pixels a side) of a projector
/// that sizes images dynamically: its token budget is tokens x merged patch²
/// pixels (Qwen3-VL's 32: 4096 tokens 4.2 M pixels; Kimi-VL's 28; 64 at
/// [`MAX_IMAGE_TOKENS`]: 67 M).
const MAX_MERGED_PATCH: usize = 64;
/// The most tiles InternVL may cut an image into (its models say 6 to 12;
/// each tile is a whole pass of the tower).
pub const MAX_TILES: usize = 64;
/// The most merged tokens `--image-max-tokens` may let one image take (4x
/// Qwen3-VL's default: a 16 Mpx picture at 16-pixel patches).
pub const MAX_IMAGE_TOKENS: usize = 16384;

struct Loader<'g> {
    g: &'g Gguf<MappedFile>,
    base: usize,
}

impl<'g> Loader<'g> {
    fn tensor(&self, name: &str) -> Result<Tensor<'g>, VisionError> {
        self.g
            .tensor(name)
            .ok_or_else(|| err(format!("tensor {name} is missing")))
    }

    fn range(&self, t: &Tensor<'_>) -> Range<usize> {
        let start = t.data().as_ptr() as usize - self.base;
        start..start + t.data().len()
    }

    /// A matrix of `rows` rows: the first dimension is a row, the others rows.
    fn mat(&self, name: &str, cols: usize, rows: usize) -> Result<Mat, VisionError> {
        let t = self.tensor(name)?;
        let n: u64 = t.dims().iter().product();
        if t.dims().first().copied() != Some(cols as u64) || n != (cols * rows) as u64 {
            return Err(err(format!(
                "tensor {name} has shape {:?}, expected {cols} x {rows}",
                t.dims()
            )));
        }
        self.mat_of(&t, rows, cols)
    }

    fn mat_of(&self, t: &Tensor<'_>, rows: usize, cols: usize) -> Result<Mat, VisionError> {
        let ty = t.ggml_type();
        if activation_format(ty).is_none() {
            return Err(err(format!(
                "tensor {}: type {ty} is not supported",
                t.name()
            )));
        }
        MatrixView::new(ty, rows, cols, t.data())
            .map_err(|e| err(format!("tensor {}: {e}", t.name())))?;
        Ok(Mat {
            ty,
            rows,
            cols,
            bytes: Bytes::Mapped(self.range(t)),
        })
    }

    /// A matrix whose input width is `cols` and whose output width is read from
    /// the file (`ne[1]`).
    fn mat_any_rows(&self, name: &str, cols: usize) -> Result<Mat, VisionError> {
        let t = self.tensor(name)?;
        if t.dims().len() != 2
            || t.dims()[0] != cols as u64
            || t.dims()[1] == 0
            || t.dims()[1] as usize > MAX_DIM
        {
            return Err(err(format!(
                "tensor {name} has shape {:?}, expected {cols} x N",
                t.dims()
            )));
        }
        self.mat_of(&t, t.dims()[1] as usize, cols)
    }

    fn floats(&self, name: &str, len: usize) -> Result<Vec<f32>, VisionError> {
        let t = self.tensor(name)?;
        let n: u64 = t.dims().iter().product();
        if n != len as u64 {
            return Err(err(format!(
                "tensor {name} has {n} elements, expected {len}"
            )));
        }
        let mut out = vec![0f32; len];
        quant::dequantize(t.ggml_type(), t.data(), &mut out)
            .map_err(|e| err(format!("tensor {name}: {e}")))?;
        Ok(out)
    }

    fn opt_floats(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>, VisionError> {
        if self.g.tensor(name).is_some() {
            self.floats(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    fn linear(&self, prefix: &str, cols: usize, rows: usize) -> Result<Linear, VisionError> {
        Ok(Linear {
            w: self.mat(&format!("{prefix}.weight"), cols, rows)?,
            b: self.opt_floats(&format!("{prefix}.bias"), rows)?,
        })
    }

    fn linear_any(&self, prefix: &str, cols: usize) -> Result<Linear, VisionError> {
        let w = self.mat_any_rows(&format!("{prefix}.weight"), cols)?;
        let b = self.opt_floats(&format!("{prefix}.bias"), w.rows)?;
        Ok(Linear { w, b })
    }

    fn norm(&self, prefix: &str, n: usize) -> Result<Norm, VisionError> {
        Ok(Norm {
            w: self.floats(&format!("{prefix}.weight"), n)?,
            b: self.opt_floats(&format!("{prefix}.bias"), n)?,
        })
    }

    /// A norm whose weight may be missing (then ones: `x * 1` is `x`, as
    /// llama.cpp's `build_norm` skipping it) and whose bias may be too.
    fn norm_or_unit(&self, prefix: &str, n: usize) -> Result<Norm, VisionError> {
        Ok(Norm {
            w: self
                .opt_floats(&format!("{prefix}.weight"), n)?
                .unwrap_or_else(|| vec![1.0; n]),
            b: self.opt_floats(&format!("{prefix}.bias"), n)?,
        })
    }

    /// A fused `n` -> `3n` query-key-value projection with its bias
    /// (optional where `bias_optional`, as clip.cpp's `build_vit` takes it),
    /// split into its three parts (rows `0..n`, `n..2n`, `2n..3n`, as
    /// clip.cpp views it).
    fn qkv(
        &self,
        prefix: &str,
        n: usize,
        bias_optional: bool,
    ) -> Result<(Linear, Linear, Linear), VisionError> {
        let w = self.mat(&format!("{prefix}.weight"), n, 3 * n)?;
        let bias = format!("{prefix}.bias");
        let b = if bias_optional {
            self.opt_floats(&bias, 3 * n)?
        } else {
            Some(self.floats(&bias, 3 * n)?)
        };
        let part = |i: usize| -> Result<Linear, VisionError> {
            Ok(Linear {
                w: w.row_range(i * n, (i + 1) * n).ok_or_else(|| {
                    err(format!("{prefix}.weight: type {} has no whole rows", w.ty))
                })?,
                b: b.as_ref().map(|b| b[i * n..(i + 1) * n].to_vec()),
            })
        };
        Ok((part(0)?, part(1)?, part(2)?))
    }

    fn opt_norm(&self, prefix: &str, n: usize) -> Result<Option<Norm>, VisionError> {
        if self.g.tensor(&format!("{prefix}.weight")).is_some() {
            self.norm(prefix, n).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Qwen3-VL's deepstack mergers: one on each block `i` with a tensor
/// `v.deepstack.{i}.fc1.weight` (what clip.cpp counts), checked against
/// `clip.vision.is_deepstack_layers` where the file has it. Each takes the
/// block's 2x2 tokens (`4 * n_embd`) to `out` values.
fn load_deepstack(
    l: &Loader<'_>,
    n_layer: usize,
    n_embd: usize,
    out: usize,
) -> Result<Vec<Deepstack>, VisionError> {
    let key = "clip.vision.is_deepstack_layers";
    let marked: Option<Vec<bool>> = match l.g.get(key) {
        None => None,
        Some(v) => {
            let a = v
                .as_array()
                .ok_or_else(|| err(format!("{key} must be an array")))?;
            if a.len() != n_layer {
                return Err(err(format!(
                    "{key} has {} entries for {n_layer} blocks",
                    a.len()
                )));
            }
            let flags: Option<Vec<bool>> = a.iter().map(|v| v.as_bool()).collect();
            Some(flags.ok_or_else(|| err(format!("{key} must hold bools")))?)
        }
    };
    let mut out_ds = Vec::new();
    for layer in 0..n_layer {
        let p = |s: &str| format!("v.deepstack.{layer}.{s}");
        let present = l.g.tensor(&p("fc1.weight")).is_some();
        if let Some(m) = &marked {
            if m[layer] != present {
                return Err(err(format!(
                    "{key} marks block {layer} {}, but tensor {} is {}",
                    if m[layer] {
                        "deepstack"
                    } else {
                        "not deepstack"
                    },
                    p("fc1.weight"),
                    if present { "present" } else { "missing" }
                )));
            }
        }
        if !present {
            continue;
        }
        let norm = l.norm_or_unit(&p("norm"), 4 * n_embd)?;
        let fc1 = l.linear_any(&p("fc1"), 4 * n_embd)?;
        let fc2 = l.linear_any(&p("fc2"), fc1.w.rows)?;
        if fc2.w.rows != out {
            return Err(err(format!(
                "tensor {} makes {} values, the merger {out}",
                p("fc2.weight"),
                fc2.w.rows
            )));
        }
        out_ds.push(Deepstack {
            layer,
            norm,
            fc1,
            fc2,
        });
    }
    Ok(out_ds)
}

fn get_usize(g: &Gguf<MappedFile>, key: &str) -> Result<usize, VisionError> {
    let v = g.get_u64(key).map_err(|e| err(e.to_string()))?;
    if v == 0 || v as usize > MAX_DIM {
        return Err(err(format!("{key} = {v} is out of range")));
    }
    Ok(v as usize)
}

/// An optional flag: absent is `false`; present, it must be a bool.
fn opt_bool(g: &Gguf<MappedFile>, key: &str) -> Result<bool, VisionError> {
    match g.get(key) {
        None => Ok(false),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| err(format!("{key} must be a bool"))),
    }
}

/// An optional non-negative integer: present, it must be one.
fn opt_u64(g: &Gguf<MappedFile>, key: &str) -> Result<Option<u64>, VisionError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| err(format!("{key} must be a non-negative integer"))),
    }
}

/// `clip.vision.projector.scale_factor` (`scale`), which `projector` needs,
/// within `range`.
fn required_scale(
    projector: ProjectorType,
    scale: Option<u64>,
    range: std::ops::RangeInclusive<u64>,
) -> Result<usize, VisionError> {
    let name = projector.name();
    let m = scale.ok_or_else(|| {
        err(format!(
            "{name}: clip.vision.projector.scale_factor is missing"
        ))
    })?;
    if !range.contains(&m) {
        return Err(err(format!(
            "{name}: scale_factor {m} (must be {} to {})",
            range.start(),
            range.end()
        )));
    }
    Ok(m as usize)
}

fn get_floats3(g: &Gguf<MappedFile>, key: &str) -> Result<[f32; 3], VisionError> {
    let a = g.get_array(key).map_err(|e| err(e.to_string()))?;
    let v: Vec<f32> = a.iter().filter_map(|v| v.as_f32()).collect();
    if v.len() < 3 || v.len() != a.len() {
        return Err(err(format!("{key} must hold at least 3 numbers")));
    }
    Ok([v[0], v[1], v[2]])
}

impl ClipModel {
    /// Maps and validates the mmproj file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, VisionError> {
        let path = path.as_ref();
        let g = Gguf::open(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
        Self::from_gguf(g)
    }

    /// Validates a parsed mmproj file.
    pub fn from_gguf(g: Gguf<MappedFile>) -> Result<Self, VisionError> {
        let arch = g.architecture().map_err(|e| err(e.to_string()))?;
        if arch != "clip" {
            return Err(err(format!(
                "general.architecture is '{arch}', not 'clip': not an mmproj file"
            )));
        }
        if g.get("clip.has_vision_encoder").and_then(|v| v.as_bool()) == Some(false) {
            return Err(err("the file has no vision encoder"));
        }
        let ptype = g
            .get_str("clip.vision.projector_type")
            .or_else(|_| g.get_str("clip.projector_type"))
            .map_err(|_| err("clip.projector_type is missing"))?;
        let projector = ProjectorType::from_name(ptype).ok_or_else(|| {
            err(format!(
                "projector type '{ptype}' is not supported (LES implements minicpmv4_6, gemma3, qwen3vl_merger, kimivl, kimik25, llama4, glm4v, internvl and lfm2)"
            ))
        })?;
        let n_embd = get_usize(&g, "clip.vision.embedding_length")?;
        let n_ff = get_usize(&g, "clip.vision.feed_forward_length")?;
        let n_layer = get_usize(&g, "clip.vision.block_count")?;
        let n_head = get_usize(&g, "clip.vision.attention.head_count")?;
        if !n_embd.is_multiple_of(n_head) {
            return Err(err(format!(
                "embedding width {n_embd} is not a multiple of {n_head} heads"
            )));
        }
        let eps = g
            .get_f32("clip.vision.attention.layer_norm_epsilon")
            .map_err(|e| err(e.to_string()))?;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(err(format!(
                "clip.vision.attention.layer_norm_epsilon = {eps} must be finite and >= 0"
            )));
        }
        let image_size = get_usize(&g, "clip.vision.image_size")?;
        let patch_size = get_usize(&g, "clip.vision.patch_size")?;
        // A chunk's attention costs the square of its patches: a file's sizes
        // must not make one image hours of work (real towers: 32-64 a side).
        if patch_size > 0 && image_size / patch_size > MAX_PATCHES_PER_SIDE {
            return Err(err(format!(
                "clip.vision.image_size {image_size} is {} patches of {patch_size} a side, \
                 more than {MAX_PATCHES_PER_SIDE}",
                image_size / patch_size
            )));
        }
        let mean = get_floats3(&g, "clip.vision.image_mean")?;
        let std = get_floats3(&g, "clip.vision.image_std")?;
        if std.iter().any(|s| !(s.is_finite() && *s != 0.0)) || mean.iter().any(|m| !m.is_finite())
        {
            return Err(err("image_mean / image_std must be finite, std non-zero"));
        }
        let ffn_op = match (
            opt_bool(&g, "clip.use_gelu")?,
            opt_bool(&g, "clip.use_silu")?,
        ) {
            (true, true) => return Err(err("clip.use_gelu and clip.use_silu are both set")),
            (true, false) => FfnOp::Gelu,
            (false, true) => FfnOp::Silu,
            (false, false) => FfnOp::GeluQuick,
        };
        let scale = opt_u64(&g, "clip.vision.projector.scale_factor")?;
        let n_merge = match projector {
            ProjectorType::MiniCpmV46 => {
                let m = scale.unwrap_or(4) as usize;
                if m != 2 && m != 4 {
                    return Err(err(format!(
                        "minicpmv4_6: scale_factor {m} (must be 2 or 4)"
                    )));
                }
                m
            }
            ProjectorType::Gemma3 => {
                let m = scale.unwrap_or(4) as usize;
                if m == 0 || m > 64 {
                    return Err(err(format!("gemma3: scale_factor {m}")));
                }
                m
            }
            ProjectorType::Qwen3Vl | ProjectorType::Glm4v => {
                // llama.cpp reads spatial_merge_size (default 2) but its graph
                // and position ids merge 2x2 whatever the value.
                let m = opt_u64(&g, "clip.vision.spatial_merge_size")?.unwrap_or(2);
                if m != 2 {
                    return Err(err(format!(
                        "{}: spatial_merge_size {m} (llama.cpp merges 2x2)",
                        projector.name()
                    )));
                }
                2
            }
            // clip.cpp's patch merger asserts a factor above 1 (its
            // default, 1, fails there).
            ProjectorType::KimiVl | ProjectorType::KimiK25 | ProjectorType::Lfm2 => {
                required_scale(projector, scale, 2..=4)?
            }
            // The converters write 1 / pixel_shuffle_ratio (Llama 4's and
            // InternVL's: 2).
            ProjectorType::Llama4 | ProjectorType::InternVl => {
                required_scale(projector, scale, 1..=4)?
            }
        };
        let qwen3vl = projector == ProjectorType::Qwen3Vl;
        let glm4v = projector == ProjectorType::Glm4v;
        let kimik25 = projector == ProjectorType::KimiK25;
        let kimivl = projector == ProjectorType::KimiVl || kimik25;
        let llama4 = projector == ProjectorType::Llama4;
        let internvl = projector == ProjectorType::InternVl;
        let lfm2 = projector == ProjectorType::Lfm2;
        if llama4 || internvl {
            // Their tiles are image_size a side, a whole number of shuffled
            // patches.
            if patch_size == 0
                || !image_size.is_multiple_of(patch_size * n_merge)
                || image_size == 0
            {
                return Err(err(format!(
                    "{}: image_size {image_size} is not a multiple of patch {patch_size} x scale {n_merge}",
                    projector.name()
                )));
            }
        }
        // Llama 4's heads turn by the 2-D RoPE.
        if llama4 && !(n_embd / n_head).is_multiple_of(4) {
            return Err(err(format!(
                "llama4: head width {} ({n_embd} / {n_head} heads) is not a multiple of 4",
                n_embd / n_head
            )));
        }
        let (mut image_min_pixels, mut image_max_pixels) = (0, 0);
        if let Some((min_tokens, max_tokens)) = projector.token_budget() {
            let name = projector.name();
            let d_head = n_embd / n_head;
            // Both 2-D RoPEs rotate half a head in pairs (d_head / 2 even);
            // LFM2's SigLIP2 has no RoPE.
            if !lfm2 && !d_head.is_multiple_of(4) {
                return Err(err(format!(
                    "{name}: head width {d_head} ({n_embd} / {n_head} heads) is not a multiple of 4"
                )));
            }
            if let Some(hd) = opt_u64(&g, "clip.vision.attention.head_dim")? {
                if hd != d_head as u64 {
                    return Err(err(format!(
                        "{name}: attention.head_dim {hd} is not {n_embd} / {n_head} heads"
                    )));
                }
            }
            // The token budget is llama.cpp's; the patch and merge sizes set
            // the pixels, bounded here beyond real towers' (32, 28).
            if patch_size == 0 || patch_size * n_merge > MAX_MERGED_PATCH {
                return Err(err(format!(
                    "{name}: patch_size {patch_size} x merge {n_merge} is not 1 to {MAX_MERGED_PATCH} pixels"
                )));
            }
            let merged_area = (patch_size * n_merge).pow(2);
            image_min_pixels = min_tokens * merged_area;
            image_max_pixels = max_tokens * merged_area;
        }
        // Kimi K2.5's converter may write its pixel budget; clip.cpp takes it
        // where both bounds are positive.
        let mut pixels_from_file = false;
        if kimik25 {
            let min = opt_u64(&g, "clip.vision.image_min_pixels")?.unwrap_or(0);
            let max = opt_u64(&g, "clip.vision.image_max_pixels")?.unwrap_or(0);
            if min > 0 && max > 0 {
                let most = (MAX_IMAGE_TOKENS * (patch_size * n_merge).pow(2)) as u64;
                if min > max || max > most {
                    return Err(err(format!(
                        "kimik25: image pixels {min} to {max} (at most {most}, the fewest at most the most)"
                    )));
                }
                (image_min_pixels, image_max_pixels) = (min as usize, max as usize);
                pixels_from_file = true;
            }
        }
        // InternVL's tile bounds (llama.cpp's defaults for older files: 1 and
        // 12); each tile is a whole pass of the tower.
        let tiles = if internvl {
            let min = opt_u64(&g, "clip.vision.preproc_min_tiles")?.unwrap_or(1);
            let max = opt_u64(&g, "clip.vision.preproc_max_tiles")?.unwrap_or(12);
            if min == 0 || min > max || max > MAX_TILES as u64 {
                return Err(err(format!(
                    "internvl: {min} to {max} tiles (1 to {MAX_TILES}, the fewest at most the most)"
                )));
            }
            (min as usize, max as usize)
        } else {
            (0, 0)
        };
        // InternVL's 6B ViT (InternVL 2.5 / 3 26B to 78B, 3.5 241B) takes
        // RMSNorms, as llama.cpp recognises it, by its shape.
        let rms_norm = glm4v || (internvl && n_embd == 3200 && n_layer == 45);
        // The merger's window attention goes in after the first listed layer
        // (0 when the list is absent or empty).
        let insert_layer = match g.get("clip.vision.wa_layer_indexes") {
            None => 0,
            Some(v) => {
                let first = v
                    .as_array()
                    .ok_or_else(|| err("clip.vision.wa_layer_indexes must be an array"))?
                    .get(0);
                match first {
                    None => 0,
                    Some(i) => i.as_u64().map(|i| i as usize).ok_or_else(|| {
                        err("clip.vision.wa_layer_indexes must hold non-negative integers")
                    })?,
                }
            }
        };

        let base = g.bytes().as_ptr() as usize;
        let l = Loader { g: &g, base };
        let pe = l.tensor("v.patch_embd.weight")?;
        let pcols = 3 * patch_size * patch_size;
        let dims = pe.dims();
        // Llama 4's converter keeps its unfold-and-linear patch embedding as
        // a matrix, [3 p p, n_embd]; the others write a kernel.
        let flat = llama4 && dims == [pcols as u64, n_embd as u64];
        if !flat
            && (dims.len() != 4
                || dims[0] != patch_size as u64
                || dims[1] != patch_size as u64
                || dims[2] != 3
                || dims[3] != n_embd as u64)
        {
            return Err(err(format!(
                "v.patch_embd.weight has shape {dims:?}, expected [{patch_size}, {patch_size}, 3, {n_embd}]"
            )));
        }
        // llama.cpp's patch embedding (`ggml_conv_2d`) multiplies in f16: an
        // f32 kernel is rounded to f16 (and the pixels with it, as for every
        // f16 matrix in the encoder). A bf16 kernel multiplies f32 pixels
        // ([`Mat::conv_kernel`]). Llama 4's (`ggml_im2col`, then a product)
        // multiplies in the matrix's own type, and adds no bias.
        let patch_embd = l.mat_of(&pe, n_embd, pcols)?;
        let patch_embd = if llama4 {
            patch_embd
        } else {
            patch_embd.conv_kernel(l.g.bytes())
        };
        let patch_bias = if llama4 {
            None
        } else {
            l.opt_floats("v.patch_embd.bias", n_embd)?
        };
        let patch_embd_1 = if qwen3vl || glm4v {
            let name = "v.patch_embd.weight.1";
            let pe1 = l.tensor(name)?;
            if pe1.dims() != dims {
                return Err(err(format!(
                    "{name} has shape {:?}, expected {dims:?} as v.patch_embd.weight",
                    pe1.dims()
                )));
            }
            let name = projector.name();
            if patch_bias.is_none() {
                return Err(err(format!("{name}: tensor v.patch_embd.bias is missing")));
            }
            if g.tensor("v.class_embd").is_some() {
                return Err(err(format!("{name}: the ViT has no class embedding")));
            }
            Some(l.mat_of(&pe1, n_embd, pcols)?.conv_kernel(l.g.bytes()))
        } else {
            None
        };
        let pos = l.tensor("v.position_embd.weight")?;
        // Kimi K2.5's table is [n_embd, W, H]; the others' [n_embd, N].
        let pd = pos.dims();
        let pos_grid = match (kimik25, pd.len()) {
            (true, 3) if pd[0] == n_embd as u64 && pd[1] * pd[2] <= MAX_DIM as u64 => {
                (pd[1] as usize, pd[2] as usize)
            }
            (false, 2) if pd[0] == n_embd as u64 && pd[1] as usize <= MAX_DIM => {
                (pd[1] as usize, 1)
            }
            _ => {
                let want = if kimik25 { "W, H" } else { "N" };
                return Err(err(format!(
                    "v.position_embd.weight has shape {pd:?}, expected [{n_embd}, {want}]"
                )));
            }
        };
        let n_pos = pos_grid.0 * pos_grid.1;
        let pos_embd = l.floats("v.position_embd.weight", n_pos * n_embd)?;
        let pre_ln = l.opt_norm("v.pre_ln", n_embd)?;
        let post_ln = l.opt_norm("v.post_ln", n_embd)?;
        let mut layers = Vec::with_capacity(n_layer);
        for i in 0..n_layer {
            let p = |s: &str| format!("v.blk.{i}.{s}");
            // Older conversions (llama.cpp's legacy naming) swapped ffn_up and
            // ffn_down; clip.cpp swaps them back when the shapes say so (for
            // the older projector types, not Qwen3-VL).
            let swapped = !qwen3vl
                && !glm4v
                && n_ff != n_embd
                && g.tensor(&p("ffn_down.weight"))
                    .is_some_and(|t| t.dims().first() == Some(&(n_embd as u64)));
            let (up_name, down_name) = if swapped {
                ("ffn_down", "ffn_up")
            } else {
                ("ffn_up", "ffn_down")
            };
            let ffn_gate = if g.tensor(&p("ffn_gate.weight")).is_some() {
                Some(l.linear(&p("ffn_gate"), n_embd, n_ff)?)
            } else {
                None
            };
            // Qwen3-VL's QKV is one matrix; Kimi-VL's converter splits its
            // (clip.cpp takes either).
            // GLM-4.xV's too, its bias optional.
            let fused = qwen3vl || glm4v || (kimivl && g.tensor(&p("attn_qkv.weight")).is_some());
            let (q, k, v) = if fused {
                l.qkv(&p("attn_qkv"), n_embd, glm4v)?
            } else {
                (
                    l.linear(&p("attn_q"), n_embd, n_embd)?,
                    l.linear(&p("attn_k"), n_embd, n_embd)?,
                    l.linear(&p("attn_v"), n_embd, n_embd)?,
                )
            };
            // Qwen3-VL's LayerNorms may lack weights (llama.cpp then only
            // normalises); the other towers' have them.
            let ln = |s: &str| {
                if qwen3vl || glm4v {
                    l.norm_or_unit(&p(s), n_embd)
                } else {
                    l.norm(&p(s), n_embd)
                }
            };
            layers.push(VitLayer {
                ln1: ln("ln1")?,
                q,
                k,
                v,
                o: l.linear(&p("attn_out"), n_embd, n_embd)?,
                // Layer scales: not in Qwen3-VL's graph.
                ls1: if qwen3vl {
                    None
                } else {
                    l.opt_floats(&p("ls1.weight"), n_embd)?
                },
                ln2: ln("ln2")?,
                ffn_up: l.linear(&p(up_name), n_embd, n_ff)?,
                ffn_gate,
                ffn_down: l.linear(&p(down_name), n_ff, n_embd)?,
                ls2: if qwen3vl {
                    None
                } else {
                    l.opt_floats(&p("ls2.weight"), n_embd)?
                },
                // InternViT-6B's Q/K norms, over all heads (its
                // `qk_normalization`).
                q_norm: if internvl {
                    l.opt_norm(&p("attn_q_norm"), n_embd)?
                } else {
                    None
                },
                k_norm: if internvl {
                    l.opt_norm(&p("attn_k_norm"), n_embd)?
                } else {
                    None
                },
            });
        }

        let (projector_w, n_mmproj_embd) = match projector {
            ProjectorType::MiniCpmV46 => {
                if insert_layer >= n_layer {
                    return Err(err(format!(
                        "minicpmv4_6: merger after block {insert_layer} of {n_layer}"
                    )));
                }
                let vit_merger = if n_merge == 4 {
                    let m = "v.vit_merger";
                    let ds_up = l.linear_any(&format!("{m}.ds_ffn_up"), 4 * n_embd)?;
                    Some(Box::new(VitMerger {
                        ln1: l.norm(&format!("{m}.ln1"), n_embd)?,
                        q: l.linear(&format!("{m}.attn_q"), n_embd, n_embd)?,
                        k: l.linear(&format!("{m}.attn_k"), n_embd, n_embd)?,
                        v: l.linear(&format!("{m}.attn_v"), n_embd, n_embd)?,
                        o: l.linear(&format!("{m}.attn_out"), n_embd, n_embd)?,
                        ds_ln: l.norm(&format!("{m}.ds_ln"), 4 * n_embd)?,
                        ds_down: l.linear(&format!("{m}.ds_ffn_down"), ds_up.w.rows, n_embd)?,
                        ds_up,
                    }))
                } else {
                    None
                };
                let input_norm = l.norm("mm.input_norm", 4 * n_embd)?;
                let up = l.linear_any("mm.up", 4 * n_embd)?;
                let down = l.linear_any("mm.down", up.w.rows)?;
                let out = down.w.rows;
                (
                    Projector::MiniCpmV46 {
                        vit_merger,
                        input_norm,
                        up,
                        down,
                    },
                    out,
                )
            }
            ProjectorType::Gemma3 => {
                let soft_emb_norm = l.floats("mm.soft_emb_norm.weight", n_embd)?;
                let t = l.tensor("mm.input_projection.weight")?;
                // ne = {n_text, n_embd}: y = W^T x. Transposed here into an
                // n_text x n_embd matrix (f16 where the file's is, else f32).
                if t.dims().len() != 2
                    || t.dims()[1] != n_embd as u64
                    || t.dims()[0] == 0
                    || t.dims()[0] as usize > MAX_DIM
                {
                    return Err(err(format!(
                        "mm.input_projection.weight has shape {:?}, expected [N, {n_embd}]",
                        t.dims()
                    )));
                }
                let n_text = t.dims()[0] as usize;
                let raw = l.floats("mm.input_projection.weight", n_text * n_embd)?;
                let mut bytes = vec![0u8; n_text * n_embd * 4];
                for (j, row) in raw.chunks_exact(n_text).enumerate() {
                    for (i, v) in row.iter().enumerate() {
                        let at = 4 * (i * n_embd + j);
                        bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
                    }
                }
                let input_proj = Mat {
                    ty: GgmlType::F32,
                    rows: n_text,
                    cols: n_embd,
                    bytes: Bytes::Owned(bytes),
                };
                // An f16 matrix stays f16 (exactly), so its product rounds the
                // activations to f16 as ggml's does.
                let input_proj = if t.ggml_type() == GgmlType::F16 {
                    input_proj.f32_as_f16(&[])
                } else {
                    input_proj
                };
                (
                    Projector::Gemma3 {
                        soft_emb_norm,
                        input_proj,
                    },
                    n_text,
                )
            }
            ProjectorType::Qwen3Vl => {
                let patch_embd_1 =
                    patch_embd_1.ok_or_else(|| err("tensor v.patch_embd.weight.1 is missing"))?;
                // The merger: post_ln (its norm) per token, then an MLP of the
                // 2x2 tokens concatenated. Both biases are required, as in
                // clip.cpp.
                let up = l.linear_any("mm.0", 4 * n_embd)?;
                let down = l.linear_any("mm.2", up.w.rows)?;
                if up.b.is_none() || down.b.is_none() {
                    return Err(err("qwen3vl_merger: mm.0.bias and mm.2.bias are required"));
                }
                let out = down.w.rows;
                let deepstack = load_deepstack(&l, n_layer, n_embd, out)?;
                (
                    Projector::Qwen3Vl {
                        patch_embd_1,
                        deepstack,
                        up,
                        down,
                    },
                    out,
                )
            }
            ProjectorType::Llama4 => {
                let class_embd = l.floats("v.class_embd", n_embd)?;
                let mlp1 = l.mat_any_rows("mm.model.mlp.1.weight", n_merge * n_merge * n_embd)?;
                let mlp2 = l.mat_any_rows("mm.model.mlp.2.weight", mlp1.rows)?;
                let fc = l.mat_any_rows("mm.model.fc.weight", mlp2.rows)?;
                let out = fc.rows;
                (
                    Projector::Llama4 {
                        class_embd,
                        mlp1,
                        mlp2,
                        fc,
                    },
                    out,
                )
            }
            ProjectorType::InternVl => {
                let class_embd = l.floats("v.class_embd", n_embd)?;
                let width = n_merge * n_merge * n_embd;
                let norm = l.norm("mm.model.mlp.0", width)?;
                let up = l.linear_any("mm.model.mlp.1", width)?;
                let down = l.linear_any("mm.model.mlp.3", up.w.rows)?;
                let out = down.w.rows;
                (
                    Projector::InternVl {
                        class_embd,
                        norm,
                        up,
                        down,
                    },
                    out,
                )
            }
            ProjectorType::Glm4v => {
                let patch_embd_1 =
                    patch_embd_1.ok_or_else(|| err("tensor v.patch_embd.weight.1 is missing"))?;
                let norm_embd = l.opt_norm("v.norm_embd", n_embd)?;
                // The merger's 2x2 convolution: ggml's [2, 2, n_embd, out]
                // kernel is a matrix over each block's values in (channel,
                // row, column) order, multiplied as `ggml_conv_2d` does
                // ([`Mat::conv_kernel`]).
                let name = "mm.patch_merger.weight";
                let t = l.tensor(name)?;
                let d = t.dims();
                if d.len() != 4
                    || d[..3] != [2, 2, n_embd as u64]
                    || d[3] == 0
                    || d[3] as usize > MAX_DIM
                {
                    return Err(err(format!(
                        "tensor {name} has shape {d:?}, expected [2, 2, {n_embd}, N]"
                    )));
                }
                let out = d[3] as usize;
                let conv = Linear {
                    w: l.mat_of(&t, out, 4 * n_embd)?.conv_kernel(l.g.bytes()),
                    b: Some(l.floats("mm.patch_merger.bias", out)?),
                };
                let fc = l.mat_any_rows("mm.model.fc.weight", out)?;
                let post_norm = l.norm("mm.post_norm", fc.rows)?;
                let up = l.linear_any("mm.up", fc.rows)?;
                let gate = l.linear("mm.gate", fc.rows, up.w.rows)?;
                let down = l.linear_any("mm.down", up.w.rows)?;
                let out = down.w.rows;
                (
                    Projector::Glm4v {
                        patch_embd_1,
                        norm_embd,
                        merger: Box::new(Glm4vMerger {
                            conv,
                            fc,
                            post_norm,
                            up,
                            gate,
                            down,
                        }),
                    },
                    out,
                )
            }
            ProjectorType::Lfm2 => {
                let width = n_merge * n_merge * n_embd;
                // clip.cpp adds a bias without a weight to the unnormalised
                // rows; no converter writes that, so it is refused.
                let input_norm = l.opt_norm("mm.input_norm", width)?;
                if input_norm.is_none() && g.tensor("mm.input_norm.bias").is_some() {
                    return Err(err("lfm2: mm.input_norm.bias without mm.input_norm.weight"));
                }
                let up = l.linear_any("mm.1", width)?;
                let down = l.linear_any("mm.2", up.w.rows)?;
                if up.b.is_none() || down.b.is_none() {
                    return Err(err("lfm2: mm.1.bias and mm.2.bias are required"));
                }
                let out = down.w.rows;
                (
                    Projector::Lfm2 {
                        input_norm,
                        up,
                        down,
                    },
                    out,
                )
            }
            ProjectorType::KimiVl | ProjectorType::KimiK25 => {
                let input_norm = l.norm("mm.input_norm", n_embd)?;
                // clip.cpp requires the norm's bias too.
                if input_norm.b.is_none() {
                    return Err(err(format!(
                        "{}: tensor mm.input_norm.bias is missing",
                        projector.name()
                    )));
                }
                let up = l.linear_any("mm.1", n_merge * n_merge * n_embd)?;
                let down = l.linear_any("mm.2", up.w.rows)?;
                if up.b.is_none() || down.b.is_none() {
                    return Err(err(format!(
                        "{}: mm.1.bias and mm.2.bias are required",
                        projector.name()
                    )));
                }
                let out = down.w.rows;
                (
                    Projector::KimiVl {
                        input_norm,
                        up,
                        down,
                    },
                    out,
                )
            }
        };
        let n_deepstack = match &projector_w {
            Projector::Qwen3Vl { deepstack, .. } => deepstack.len(),
            _ => 0,
        };
        let hp = ClipHparams {
            projector,
            n_embd,
            n_ff,
            n_layer,
            n_head,
            eps,
            image_size,
            patch_size,
            mean,
            std,
            ffn_op,
            n_merge,
            insert_layer,
            n_mmproj_embd,
            n_deepstack,
            image_min_pixels,
            image_max_pixels,
            rms_norm,
            tiles,
            pixels_from_file,
        };
        if projector == ProjectorType::Gemma3 {
            let side = image_size / patch_size;
            if !image_size.is_multiple_of(patch_size)
                || side * side != n_pos
                || !side.is_multiple_of(n_merge)
            {
                return Err(err(format!(
                    "gemma3: image_size {image_size}, patch {patch_size}, {n_pos} positions and pooling {n_merge} do not fit"
                )));
            }
        }
        if qwen3vl || kimivl || glm4v || lfm2 {
            // clip.cpp reshapes the table to a square before interpolating it
            // (ggml's interpolation reads f32).
            // (Kimi K2.5's table carries its own width and height.)
            let name = projector.name();
            let side = (n_pos as f64).sqrt() as usize;
            if side * side != n_pos && !kimik25 {
                return Err(err(format!(
                    "{name}: {n_pos} position embeddings are not a square grid"
                )));
            }
            let ty = l.tensor("v.position_embd.weight")?.ggml_type();
            if ty != GgmlType::F32 {
                return Err(err(format!(
                    "{name}: v.position_embd.weight is {ty}, llama.cpp interpolates f32"
                )));
            }
        }
        if llama4 || internvl {
            // One embedding per patch of a tile, and the class token's.
            let side = image_size / patch_size;
            if n_pos != side * side + 1 {
                return Err(err(format!(
                    "{}: {n_pos} position embeddings for {side} x {side} patches and a class token",
                    projector.name()
                )));
            }
        }
        if projector == ProjectorType::MiniCpmV46 {
            let side = (n_pos as f64).sqrt() as usize;
            if side * side != n_pos {
                return Err(err(format!(
                    "minicpmv4_6: {n_pos} position embeddings are not a square grid"
                )));
            }
            if image_size < patch_size * n_merge {
                return Err(err(format!(
                    "minicpmv4_6: image_size {image_size} is below one merged patch ({patch_size} x {n_merge} pixels)"
                )));
            }
        }
        Ok(ClipModel {
            hp,
            patch_embd,
            patch_bias,
            pos_embd,
            n_pos,
            pos_grid,
            pre_ln,
            layers,
            post_ln,
            projector: projector_w,
            gguf: g,
        })
    }

    /// The matrix view of `m`.
    pub fn view<'s>(&'s self, m: &'s Mat) -> Result<MatrixView<'s>, GemvError> {
        MatrixView::new(m.ty, m.rows, m.cols, m.raw(self.gguf.bytes()))
    }

    /// The underlying file.
    pub fn gguf(&self) -> &Gguf<MappedFile> {
        &self.gguf
    }

    /// The total size of the file.
    pub fn file_bytes(&self) -> usize {
        self.gguf.bytes().len()
    }

    /// llama.cpp's `--image-min-tokens` / `--image-max-tokens`: the fewest
    /// and most merged tokens one image is resized to, for projectors that
    /// size images dynamically (Qwen3-VL, Kimi-VL, LFM2-VL; `None` keeps the
    /// projector's [`ProjectorType::token_budget`]); the others take images
    /// at fixed sizes and ignore them, as llama.cpp does.
    /// Each from 1 to [`MAX_IMAGE_TOKENS`], the fewest at most the most (a
    /// bound not given is the projector's default).
    pub fn set_image_tokens(
        &mut self,
        min: Option<usize>,
        max: Option<usize>,
    ) -> Result<(), VisionError> {
        for (name, v) in [("--image-min-tokens", min), ("--image-max-tokens", max)] {
            if let Some(v) = v.filter(|&v| v == 0 || v > MAX_IMAGE_TOKENS) {
                return Err(err(format!(
                    "{name} {v}: an image takes 1 to {MAX_IMAGE_TOKENS} tokens"
                )));
            }
        }
        let Some((min_default, max_default)) = self.hp.projector.token_budget() else {
            return Ok(());
        };
        if self.hp.pixels_from_file {
            return Ok(());
        }
        // Crossed bounds are refused, as llama.cpp refuses them (also where
        // one is the projector's default).
        let name = |given: Option<usize>| {
            if given.is_some() {
                ""
            } else {
                " (the default)"
            }
        };
        let (min_name, max_name) = (name(min), name(max));
        let min = min.unwrap_or(min_default);
        let max = max.unwrap_or(max_default);
        if min > max {
            return Err(err(format!(
                "--image-min-tokens {min}{min_name} is more than --image-max-tokens {max}{max_name}"
            )));
        }
        let merged_area = (self.hp.patch_size * self.hp.n_merge).pow(2);
        self.hp.image_min_pixels = min * merged_area;
        self.hp.image_max_pixels = max * merged_area;
        Ok(())
    }

    /// The width of one output row ("token") of the encoder: `n_mmproj_embd`,
    /// and for Qwen3-VL one more `n_mmproj_embd` per deepstack merger
    /// (llama.cpp's `clip_n_mmproj_embd`; the language model's `n_embd_inp`).
    pub fn row_width(&self) -> usize {
        self.hp.n_mmproj_embd * (1 + self.hp.n_deepstack)
    }
}
