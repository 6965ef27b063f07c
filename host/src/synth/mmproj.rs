//! Synthetic vision projectors (mmproj GGUFs, `general.architecture = clip`)
//! matching a synthetic language model: the tensors and keys llama.cpp's
//! converter writes for MiniCPM-V 4.6 (`minicpmv4_6`), Gemma 3 (`gemma3`),
//! Qwen3-VL (`qwen3vl_merger`), Kimi-VL (`kimivl`), Kimi K2.5 (`kimik25`),
//! Llama 4 (`llama4`), GLM-4.5V (`glm4v`) or InternVL (`internvl`), at
//! a tiny size, with random weights, so the whole multimodal path runs
//! without downloads.
//!
//! Defaults: 224 x 224 input in 14 x 14 patches (a 16 x 16 grid), 2 blocks 64
//! wide with 4 heads, FFN 128; `minicpmv4_6` puts its window-attention merger
//! after block 0 and makes 16 embeddings per slice (4 x 4), `gemma3` pools 4 x 4
//! into 16 embeddings. `qwen3vl_merger` has 16 x 16 patches, a 16 x 16 table of
//! position embeddings (`image_size` 256), 4 blocks and deepstack mergers on
//! blocks 0 to 2 (as many as the language model's `n_deepstack_layers`, on the
//! blocks before the last), and takes images of any size; so does `kimivl`
//! (a 16 x 16 table, `image_size` 224, 2 x 2 patch merger), and `kimik25`
//! (the same with a `[w, 16, 12]` table: its width and height differ, so the
//! axes of its interpolation show). `llama4` takes
//! 112 x 112 tiles (8 x 8 patches and a class token, a 2 x 2 pixel shuffle:
//! 16 embeddings a tile). `glm4v` has a 16 x 16 table (`image_size` 224),
//! RMSNorms without biases, SwiGLU FFNs with SiLU, a 2x2 convolution merger
//! and a SwiGLU MLP twice the output width, and takes images of any size.
//! `internvl` takes 112 x 112 tiles (8 x 8 patches, a class token after
//! them, layer scales, a 2 x 2 pixel shuffle: 16 embeddings a tile), 1 to 6
//! tiles an image. `lfm2` has 16 x 16 patches and a 16 x 16 table
//! (`image_size` 256, as LFM2-VL's converter writes), a 2 x 2 pixel
//! unshuffle, a LayerNorm and a GELU MLP, and takes images of any size
//! (64 to 256 merged tokens), large ones also in 512-pixel tiles.
//! The output width is
//! the language model's `n_embd`. Matrices are `f16` (as in llama.cpp's
//! `mmproj-*-f16.gguf`), vectors and position embeddings `f32`, patch
//! embeddings as llama.cpp's converter types them.

use std::io::BufWriter;
use std::path::Path;

use les_core::quant::{self, GgmlType};

use super::rng::Rng;
use super::SynthError;
use crate::gguf::{GgufWriter, MetaValue};
use crate::interrupt::TempFile;
use crate::vision::ProjectorType;

/// The dimensions of a synthetic projector.
#[derive(Clone, Debug, PartialEq)]
pub struct MmprojConfig {
    /// The projector type.
    pub projector: ProjectorType,
    /// Width of the embeddings it makes (the language model's `n_embd`).
    pub out_embd: u64,
    /// ViT width.
    pub width: u64,
    /// Attention heads.
    pub heads: u64,
    /// ViT FFN width.
    pub ff: u64,
    /// ViT blocks.
    pub layers: u64,
    /// Input (slice) size in pixels.
    pub image_size: u64,
    /// Patch size in pixels.
    pub patch: u64,
    /// Type of the matrices.
    pub ty: GgmlType,
    /// `qwen3vl_merger`: deepstack mergers (the language model's
    /// `n_deepstack_layers`), on the blocks before the last; 0 for the others.
    pub deepstack: u64,
    /// Random seed.
    pub seed: u64,
}

impl MmprojConfig {
    /// The default tiny projector of `projector` for a model `out_embd` wide.
    pub fn tiny(projector: ProjectorType, out_embd: u64, seed: u64) -> Self {
        let qwen3vl = projector == ProjectorType::Qwen3Vl;
        let p16 = qwen3vl || projector == ProjectorType::Lfm2;
        MmprojConfig {
            projector,
            out_embd,
            width: 64,
            heads: 4,
            ff: 128,
            layers: if qwen3vl { 4 } else { 2 },
            image_size: match projector {
                ProjectorType::Qwen3Vl | ProjectorType::Lfm2 => 256,
                ProjectorType::Llama4 | ProjectorType::InternVl => 112,
                _ => 224,
            },
            patch: if p16 { 16 } else { 14 },
            ty: GgmlType::F16,
            deepstack: if qwen3vl { 3 } else { 0 },
            seed,
        }
    }

    /// The blocks with a deepstack merger: the `deepstack` blocks before the
    /// last (all of them when there are no more blocks).
    pub fn deepstack_layers(&self) -> std::ops::Range<u64> {
        let first = self.layers.saturating_sub(self.deepstack + 1);
        first..first + self.deepstack
    }

    /// Rows of the position-embedding table: MiniCPM-V's 70 x 70 buckets (what
    /// llama.cpp indexes), or one per patch for Gemma 3.
    fn n_pos(&self) -> u64 {
        match self.projector {
            ProjectorType::MiniCpmV46 => 70 * 70,
            ProjectorType::Gemma3
            | ProjectorType::Qwen3Vl
            | ProjectorType::KimiVl
            | ProjectorType::Glm4v
            | ProjectorType::Lfm2 => (self.image_size / self.patch).pow(2),
            ProjectorType::KimiK25 => {
                let (w, h) = self.pos_grid();
                w * h
            }
            // One more for the class token.
            ProjectorType::Llama4 | ProjectorType::InternVl => {
                (self.image_size / self.patch).pow(2) + 1
            }
        }
    }
}

impl MmprojConfig {
    /// Kimi K2.5's position table, `(W, H)`: `image_size / patch` wide and
    /// three quarters of that high.
    fn pos_grid(&self) -> (u64, u64) {
        let side = self.image_size / self.patch;
        (side, (side * 3 / 4).max(1))
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// `1 + 0.02 N(0,1)`.
    Norm,
    /// `N(0, std^2)`.
    Normal(f32),
}

struct Plan {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    init: Init,
}

fn plan(cfg: &MmprojConfig) -> Vec<Plan> {
    let mut out = Vec::new();
    let mat_ty = cfg.ty;
    // As llama.cpp's converter types them: vectors, the position embeddings
    // and (Gemma 3's SigLIP `embeddings.*`) the patch embedding in `f32`;
    // llama.cpp's CPU backend adds no `f16` position embeddings. Qwen3-VL's
    // and GLM-4.xV's patch kernels (and GLM's merger convolution) are `f16`
    // in an `f16` file, else `f32` (the converter's `tensor_force_quant`).
    let gemma3 = cfg.projector == ProjectorType::Gemma3;
    let qwen3vl = cfg.projector == ProjectorType::Qwen3Vl;
    let glm4v = cfg.projector == ProjectorType::Glm4v;
    let internvl = cfg.projector == ProjectorType::InternVl;
    let llama4 = cfg.projector == ProjectorType::Llama4;
    let mut add = |name: &str, dims: &[u64], init: Init| {
        let f32_always = dims.len() == 1
            || name == "v.position_embd.weight"
            || (gemma3 && name == "v.patch_embd.weight");
        let patch = (qwen3vl || glm4v)
            && (name.starts_with("v.patch_embd.weight") || name == "mm.patch_merger.weight");
        let ty = if f32_always || (patch && mat_ty != GgmlType::F16) {
            GgmlType::F32
        } else {
            mat_ty
        };
        out.push(Plan {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            init,
        });
    };
    let inv = |fan_in: u64| Init::Normal(1.0 / (fan_in as f32).sqrt());
    let bias = Init::Normal(0.02);
    let (w, p, ff) = (cfg.width, cfg.patch, cfg.ff);
    let linear = |add: &mut dyn FnMut(&str, &[u64], Init), prefix: &str, cols: u64, rows: u64| {
        add(&format!("{prefix}.weight"), &[cols, rows], inv(cols));
        add(&format!("{prefix}.bias"), &[rows], bias);
    };
    if llama4 {
        // Llama 4's patch embedding is a linear layer over the unfolded
        // patch (converted as a matrix), with no bias.
        add("v.patch_embd.weight", &[3 * p * p, w], inv(3 * p * p));
        add("v.class_embd", &[w], Init::Normal(0.1));
        add("v.pre_ln.weight", &[w], Init::Norm);
        add("v.pre_ln.bias", &[w], bias);
    } else {
        add("v.patch_embd.weight", &[p, p, 3, w], inv(3 * p * p));
    }
    if qwen3vl || glm4v {
        // The second frame's kernel of the temporal patch (Conv3D split in two).
        add("v.patch_embd.weight.1", &[p, p, 3, w], inv(3 * p * p));
    }
    if !llama4 {
        add("v.patch_embd.bias", &[w], bias);
    }
    if internvl {
        add("v.class_embd", &[w], Init::Normal(0.1));
    }
    if glm4v {
        // `post_conv_layernorm`, an RMSNorm.
        add("v.norm_embd.weight", &[w], Init::Norm);
    }
    if cfg.projector == ProjectorType::KimiK25 {
        let (pw, ph) = cfg.pos_grid();
        add("v.position_embd.weight", &[w, pw, ph], Init::Normal(0.1));
    } else {
        add(
            "v.position_embd.weight",
            &[w, cfg.n_pos()],
            Init::Normal(0.1),
        );
    }
    for l in 0..cfg.layers {
        let b = format!("v.blk.{l}");
        if glm4v {
            // RMSNorms, a fused QKV, SwiGLU: no biases (GLM-4.5V's
            // `attention_bias` false, bias-free MLP).
            add(&format!("{b}.ln1.weight"), &[w], Init::Norm);
            add(&format!("{b}.attn_qkv.weight"), &[w, 3 * w], inv(w));
            add(&format!("{b}.attn_out.weight"), &[w, w], inv(w));
            add(&format!("{b}.ln2.weight"), &[w], Init::Norm);
            add(&format!("{b}.ffn_gate.weight"), &[w, ff], inv(w));
            add(&format!("{b}.ffn_up.weight"), &[w, ff], inv(w));
            add(&format!("{b}.ffn_down.weight"), &[ff, w], inv(ff));
            continue;
        }
        add(&format!("{b}.ln1.weight"), &[w], Init::Norm);
        add(&format!("{b}.ln1.bias"), &[w], bias);
        if qwen3vl {
            linear(&mut add, &format!("{b}.attn_qkv"), w, 3 * w);
            linear(&mut add, &format!("{b}.attn_out"), w, w);
        } else {
            for part in ["attn_q", "attn_k", "attn_v", "attn_out"] {
                linear(&mut add, &format!("{b}.{part}"), w, w);
            }
        }
        add(&format!("{b}.ln2.weight"), &[w], Init::Norm);
        add(&format!("{b}.ln2.bias"), &[w], bias);
        linear(&mut add, &format!("{b}.ffn_up"), w, ff);
        linear(&mut add, &format!("{b}.ffn_down"), ff, w);
        if internvl {
            // InternViT's layer scales (`ls1`, `ls2`).
            add(&format!("{b}.ls1.weight"), &[w], Init::Norm);
            add(&format!("{b}.ls2.weight"), &[w], Init::Norm);
        }
    }
    match cfg.projector {
        ProjectorType::MiniCpmV46 => {
            let m = "v.vit_merger";
            add(&format!("{m}.ln1.weight"), &[w], Init::Norm);
            add(&format!("{m}.ln1.bias"), &[w], bias);
            for part in ["attn_q", "attn_k", "attn_v", "attn_out"] {
                linear(&mut add, &format!("{m}.{part}"), w, w);
            }
            add(&format!("{m}.ds_ln.weight"), &[4 * w], Init::Norm);
            add(&format!("{m}.ds_ln.bias"), &[4 * w], bias);
            linear(&mut add, &format!("{m}.ds_ffn_up"), 4 * w, 2 * w);
            linear(&mut add, &format!("{m}.ds_ffn_down"), 2 * w, w);
            add("v.post_ln.weight", &[w], Init::Norm);
            add("v.post_ln.bias", &[w], bias);
            add("mm.input_norm.weight", &[4 * w], Init::Norm);
            add("mm.input_norm.bias", &[4 * w], bias);
            linear(&mut add, "mm.up", 4 * w, 2 * w);
            linear(&mut add, "mm.down", 2 * w, cfg.out_embd);
        }
        ProjectorType::Gemma3 => {
            add("v.post_ln.weight", &[w], Init::Norm);
            add("v.post_ln.bias", &[w], bias);
            add("mm.soft_emb_norm.weight", &[w], Init::Norm);
            add("mm.input_projection.weight", &[cfg.out_embd, w], inv(w));
        }
        ProjectorType::Qwen3Vl => {
            // Deepstack mergers (`visual.deepstack_merger_list.*`, named by
            // block), the merger's norm (`v.post_ln`) and its MLP (`mm.0`,
            // `mm.2`): hidden width 4 * w, as Qwen3-VL's.
            for l in cfg.deepstack_layers() {
                let d = format!("v.deepstack.{l}");
                add(&format!("{d}.norm.weight"), &[4 * w], Init::Norm);
                add(&format!("{d}.norm.bias"), &[4 * w], bias);
                linear(&mut add, &format!("{d}.fc1"), 4 * w, 4 * w);
                linear(&mut add, &format!("{d}.fc2"), 4 * w, cfg.out_embd);
            }
            add("v.post_ln.weight", &[w], Init::Norm);
            add("v.post_ln.bias", &[w], bias);
            linear(&mut add, "mm.0", 4 * w, 4 * w);
            linear(&mut add, "mm.2", 4 * w, cfg.out_embd);
        }
        ProjectorType::KimiVl | ProjectorType::KimiK25 => {
            // MoonViT's final LayerNorm, the projector's per-patch norm
            // (`pre_norm`) and its MLP over 2 x 2 patches (hidden width
            // 4 * w, as Kimi-VL's).
            add("v.post_ln.weight", &[w], Init::Norm);
            add("v.post_ln.bias", &[w], bias);
            add("mm.input_norm.weight", &[w], Init::Norm);
            add("mm.input_norm.bias", &[w], bias);
            linear(&mut add, "mm.1", 4 * w, 4 * w);
            linear(&mut add, "mm.2", 4 * w, cfg.out_embd);
        }
        ProjectorType::Lfm2 => {
            // SigLIP2's final LayerNorm, then the projector: LayerNorm of
            // each unshuffled 2 x 2 block and a GELU MLP (`linear_1`,
            // `linear_2`).
            add("v.post_ln.weight", &[w], Init::Norm);
            add("v.post_ln.bias", &[w], bias);
            add("mm.input_norm.weight", &[4 * w], Init::Norm);
            add("mm.input_norm.bias", &[4 * w], bias);
            linear(&mut add, "mm.1", 4 * w, 4 * w);
            linear(&mut add, "mm.2", 4 * w, cfg.out_embd);
        }
        ProjectorType::InternVl => {
            // `mlp1`: LayerNorm of the shuffled 2 x 2 patches, a GELU MLP to
            // the model's width (InternViT has no final norm).
            add("mm.model.mlp.0.weight", &[4 * w], Init::Norm);
            add("mm.model.mlp.0.bias", &[4 * w], bias);
            linear(&mut add, "mm.model.mlp.1", 4 * w, cfg.out_embd);
            linear(&mut add, "mm.model.mlp.3", cfg.out_embd, cfg.out_embd);
        }
        ProjectorType::Glm4v => {
            // `post_layernorm` (RMS), the `downsample` convolution to the
            // model's width, then the merger: a projection, a LayerNorm and
            // a SwiGLU MLP twice as wide, no biases but the convolution's
            // and the norm's.
            let o = cfg.out_embd;
            add("v.post_ln.weight", &[w], Init::Norm);
            add("mm.patch_merger.weight", &[2, 2, w, o], inv(4 * w));
            add("mm.patch_merger.bias", &[o], bias);
            add("mm.model.fc.weight", &[o, o], inv(o));
            add("mm.post_norm.weight", &[o], Init::Norm);
            add("mm.post_norm.bias", &[o], bias);
            add("mm.gate.weight", &[o, 2 * o], inv(o));
            add("mm.up.weight", &[o, 2 * o], inv(o));
            add("mm.down.weight", &[2 * o, o], inv(2 * o));
        }
        ProjectorType::Llama4 => {
            // The vision adapter's two GELU layers and the projection, no
            // biases (Llama 4: 4 x 1408 -> 4096 -> 4096 -> the model).
            add("v.post_ln.weight", &[w], Init::Norm);
            add("v.post_ln.bias", &[w], bias);
            add("mm.model.mlp.1.weight", &[4 * w, 2 * w], inv(4 * w));
            add("mm.model.mlp.2.weight", &[2 * w, 2 * w], inv(2 * w));
            add("mm.model.fc.weight", &[2 * w, cfg.out_embd], inv(2 * w));
        }
    }
    out
}

fn metadata(cfg: &MmprojConfig) -> Vec<(&'static str, MetaValue)> {
    let u = |v: u64| MetaValue::U32(v as u32);
    let mut m: Vec<(&'static str, MetaValue)> = vec![
        ("general.architecture", "clip".into()),
        ("general.type", "mmproj".into()),
        (
            "general.name",
            format!("LES synthetic {} projector", cfg.projector.name()).into(),
        ),
        ("general.file_type", MetaValue::U32(1)),
        ("clip.has_vision_encoder", true.into()),
        ("clip.projector_type", cfg.projector.name().into()),
        if cfg.projector == ProjectorType::Glm4v {
            ("clip.use_silu", true.into())
        } else {
            ("clip.use_gelu", true.into())
        },
        ("clip.vision.image_size", u(cfg.image_size)),
        ("clip.vision.patch_size", u(cfg.patch)),
        ("clip.vision.embedding_length", u(cfg.width)),
        ("clip.vision.feed_forward_length", u(cfg.ff)),
        ("clip.vision.projection_dim", u(cfg.out_embd)),
        ("clip.vision.block_count", u(cfg.layers)),
        ("clip.vision.attention.head_count", u(cfg.heads)),
        (
            "clip.vision.attention.layer_norm_epsilon",
            MetaValue::F32(1e-6),
        ),
        ("clip.vision.image_mean", vec![0.5f32, 0.5, 0.5].into()),
        ("clip.vision.image_std", vec![0.5f32, 0.5, 0.5].into()),
    ];
    match cfg.projector {
        ProjectorType::MiniCpmV46 => {
            m.push(("clip.vision.projector.scale_factor", MetaValue::U32(4)));
            m.push(("clip.vision.wa_layer_indexes", vec![0i32].into()));
        }
        ProjectorType::Gemma3 => {
            m.push(("clip.vision.projector.scale_factor", MetaValue::U32(4)));
        }
        ProjectorType::Glm4v => {
            m.push(("clip.vision.spatial_merge_size", MetaValue::U32(2)));
        }
        ProjectorType::Qwen3Vl => {
            m.push(("clip.vision.spatial_merge_size", MetaValue::U32(2)));
            let ds = cfg.deepstack_layers();
            let marks: Vec<bool> = (0..cfg.layers).map(|l| ds.contains(&l)).collect();
            m.push(("clip.vision.is_deepstack_layers", marks.into()));
        }
        ProjectorType::KimiVl | ProjectorType::Llama4 | ProjectorType::Lfm2 => {
            m.push(("clip.vision.projector.scale_factor", MetaValue::U32(2)));
        }
        ProjectorType::InternVl => {
            m.push(("clip.vision.projector.scale_factor", MetaValue::U32(2)));
            m.push(("clip.vision.preproc_min_tiles", MetaValue::U32(1)));
            m.push(("clip.vision.preproc_max_tiles", MetaValue::U32(6)));
        }
        ProjectorType::KimiK25 => {
            // Its converter's pixel budget: 8 patches to `in_patch_limit`
            // (16384) patches, which llama.cpp takes over its token bounds.
            m.push(("clip.vision.projector.scale_factor", MetaValue::U32(2)));
            let patch_area = (cfg.patch * cfg.patch) as u32;
            m.push((
                "clip.vision.image_min_pixels",
                MetaValue::U32(8 * patch_area),
            ));
            m.push((
                "clip.vision.image_max_pixels",
                MetaValue::U32(16384 * patch_area),
            ));
        }
    }
    m.push(("les.synth.seed", MetaValue::U64(cfg.seed)));
    m
}

fn values(cfg: &MmprojConfig, p: &Plan) -> Vec<f32> {
    let n: u64 = p.dims.iter().product();
    let mut v = vec![0f32; n as usize];
    let mut rng = Rng::stream(cfg.seed, &format!("mmproj/{}", p.name), 0);
    match p.init {
        Init::Norm => {
            rng.fill_normal(&mut v, 0.02);
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        Init::Normal(std) => rng.fill_normal(&mut v, std),
    }
    v
}

impl MmprojConfig {
    /// Checks the shape before anything is written.
    pub fn validate(&self) -> Result<(), SynthError> {
        let bad = |m: String| Err(SynthError::Config(m));
        // The tensors are generated whole in memory: keep them far below any
        // machine's (real towers: width ~1152, ff ~4304, 27 layers, 448 pixels).
        for (name, v, max) in [
            ("width", self.width, 1 << 14),
            ("heads", self.heads, 1 << 10),
            ("ff", self.ff, 1 << 16),
            ("layers", self.layers, 1 << 8),
            ("image size", self.image_size, 1 << 13),
            ("patch", self.patch, 1 << 8),
            ("output width", self.out_embd, 1 << 17),
        ] {
            if v > max {
                return bad(format!(
                    "mmproj {name} {v} is more than the {max} synth writes"
                ));
            }
        }
        if self.width == 0 || self.heads == 0 || !self.width.is_multiple_of(self.heads) {
            return bad(format!(
                "mmproj width {} is not a multiple of {} heads",
                self.width, self.heads
            ));
        }
        if self.patch == 0 || !self.image_size.is_multiple_of(self.patch * 4) {
            return bad(format!(
                "mmproj image size {} is not a multiple of 4 patches of {}",
                self.image_size, self.patch
            ));
        }
        if self.layers == 0 || self.ff == 0 || self.out_embd == 0 {
            return bad("mmproj layers, ff and output width must be positive".into());
        }
        if self.projector.token_budget().is_some() || self.projector == ProjectorType::Llama4 {
            let name = self.projector.name();
            if !(self.width / self.heads).is_multiple_of(4) {
                return bad(format!(
                    "{name}: head width {} is not a multiple of 4 (2-D RoPE)",
                    self.width / self.heads
                ));
            }
            if self.patch > 32 {
                return bad(format!("{name}: patch {} is more than 32", self.patch));
            }
        }
        if self.projector == ProjectorType::Qwen3Vl {
            if self.deepstack > self.layers {
                return bad(format!(
                    "qwen3vl_merger: {} deepstack mergers need as many blocks, not {}",
                    self.deepstack, self.layers
                ));
            }
        } else if self.deepstack != 0 {
            return bad(format!(
                "{} has no deepstack mergers",
                self.projector.name()
            ));
        }
        Ok(())
    }
}

/// Checks `cfg` and writes the projector to `path` (through a temporary file
/// renamed when complete). Returns the file size.
pub fn write_mmproj(cfg: &MmprojConfig, path: &Path) -> Result<u64, SynthError> {
    cfg.validate()?;
    let mut w = GgufWriter::new();
    for (k, v) in metadata(cfg) {
        w.add_kv(k, v)?;
    }
    let plan = plan(cfg);
    for t in &plan {
        w.add_tensor(t.name.clone(), &t.dims, t.ty)?;
    }
    let total = w.file_len();
    // Removed unless committed, also on interrupt.
    let (tmp, file) = TempFile::create(&super::gen::temp_path(path), false)?;
    let mut data = w.write_header(BufWriter::new(file))?;
    for t in &plan {
        let v = values(cfg, t);
        let n =
            t.ty.row_bytes(v.len())
                .ok_or_else(|| SynthError::Config(format!("{}: bad row length", t.name)))?;
        let mut bytes = vec![0u8; n];
        quant::quantize(t.ty, &v, &mut bytes)
            .map_err(|e| SynthError::Config(format!("{}: {e}", t.name)))?;
        data.write_tensor(&t.name, &bytes)?;
    }
    let file = data
        .finish()?
        .into_inner()
        .map_err(|e| SynthError::Io(e.into_error()))?;
    file.sync_all()?;
    tmp.commit(path)?;
    Ok(total)
}
