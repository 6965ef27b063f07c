//! A GGUF file as a runnable model: hyperparameters and weights per architecture,
//! with the conventions llama.cpp gives each one.
//!
//! Every tensor is checked once at load (present, right type and shape), so the
//! [`Weights`] accessors the forward pass calls per token cannot fail. Experts stay
//! where they are in the file: [`Model::expert`] views them in the mapping (the
//! resident schedule), and [`Model::expert_extents`] names their byte ranges so
//! they can be read into slots instead (the streamed schedules).

use std::fmt;
use std::path::Path;

use les_core::gemv::MatrixView;
use les_core::model::config::{Hparams, MoeParams};
use les_core::model::experts::ExpertFormat;
use les_core::model::forward::{ExpertMatrices, Ffn, LayerWeights, SharedExpert, Weights};
use les_core::model::ops::RopeStyle;
use les_core::quant::{self, GgmlType};
use les_core::router::Gating;
use les_core::schedule::{Extent, Extents};
use les_core::slots::ExpertKey;

use crate::gguf::{Gguf, GgufError, MappedFile, OptionalKey};

/// Why a model could not be loaded.
#[derive(Debug)]
pub enum ModelError {
    /// The file is not a valid GGUF.
    Gguf(GgufError),
    /// The architecture is not supported.
    Unsupported(String),
    /// A tensor or key is missing or inconsistent.
    Invalid(String),
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Gguf(e) => e.fmt(f),
            ModelError::Unsupported(a) => write!(f, "unsupported architecture: {a}"),
            ModelError::Invalid(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for ModelError {}

impl From<GgufError> for ModelError {
    fn from(e: GgufError) -> Self {
        ModelError::Gguf(e)
    }
}

fn invalid(msg: impl Into<String>) -> ModelError {
    ModelError::Invalid(msg.into())
}

/// Architectures LES runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama (dense) and Mixtral (llama with experts).
    Llama,
    /// Qwen3-MoE.
    Qwen3Moe,
    /// Qwen2-MoE (shared expert with a sigmoid gate, attention biases).
    Qwen2Moe,
    /// OLMoE.
    Olmoe,
}

impl Arch {
    /// From `general.architecture`.
    pub fn from_name(name: &str) -> Option<Arch> {
        Some(match name {
            "llama" => Arch::Llama,
            "qwen3moe" => Arch::Qwen3Moe,
            "qwen2moe" => Arch::Qwen2Moe,
            "olmoe" => Arch::Olmoe,
            _ => return None,
        })
    }

    /// The GGUF name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Olmoe => "olmoe",
        }
    }

    /// llama.cpp's default for renormalising the top-k weights.
    fn default_norm_topk(self) -> bool {
        matches!(self, Arch::Llama | Arch::Qwen3Moe)
    }

    fn rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama => RopeStyle::Normal,
            _ => RopeStyle::Neox,
        }
    }
}

/// Where a tensor's bytes are in the file, checked at load.
#[derive(Clone, Copy, Debug)]
struct Tref {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    offset: usize,
    len: usize,
}

/// A routed-expert tensor stack (`{cols, rows, n_expert}`).
#[derive(Clone, Copy, Debug)]
struct ExpertStack {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    offset: usize,
    /// Bytes of one expert.
    stride: usize,
}

/// Where a layer's routed experts are.
#[derive(Debug)]
enum ExpertStore {
    /// Three stacked tensors (a plain GGUF): three scattered reads per expert.
    Plain([ExpertStack; 3]),
    /// One packed tensor (`les pack`): one aligned extent per expert, checksummed.
    Packed(Box<crate::pack::PackedLayer>),
}

#[derive(Debug)]
enum FfnRefs {
    Dense([Tref; 3]),
    Moe {
        router: Tref,
        experts: ExpertStore,
        shared: Option<([Tref; 3], Option<Tref>)>,
    },
}

#[derive(Debug)]
struct LayerRefs {
    attn_norm: Vec<f32>,
    wq: Tref,
    wk: Tref,
    wv: Tref,
    wo: Tref,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    ffn: FfnRefs,
}

/// A loaded model: the mapped GGUF plus validated views of its weights.
pub struct Model {
    gguf: Gguf<MappedFile>,
    /// The architecture.
    pub arch: Arch,
    /// The model shape.
    pub hp: Hparams,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
    layers: Vec<LayerRefs>,
    embedding: Tref,
    output: Tref,
    output_norm: Vec<f32>,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("arch", &self.arch)
            .field("hp", &self.hp)
            .finish_non_exhaustive()
    }
}

fn tensor_ref(
    g: &Gguf<MappedFile>,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Tref, ModelError> {
    let t = g.require_tensor(name)?;
    let dims = t.dims();
    let ok = match dims {
        [c] => *c as usize == cols && rows == 1,
        [c, r] => *c as usize == cols && *r as usize == rows,
        _ => false,
    };
    if !ok {
        return Err(invalid(format!(
            "tensor {name} has shape {dims:?}, expected [{cols}, {rows}]"
        )));
    }
    let ty = t.ggml_type();
    MatrixView::new(ty, rows, cols, t.data()).map_err(|e| {
        invalid(format!(
            "tensor {name} ({ty}) cannot be a weight matrix: {e}"
        ))
    })?;
    Ok(Tref {
        ty,
        rows,
        cols,
        offset: t.offset() as usize,
        len: t.size() as usize,
    })
}

fn vector(g: &Gguf<MappedFile>, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = g.require_tensor(name)?;
    if t.n_elements() != len as u64 {
        return Err(invalid(format!(
            "tensor {name} has {} elements, expected {len}",
            t.n_elements()
        )));
    }
    let mut out = vec![0f32; len];
    quant::dequantize(t.ggml_type(), t.data(), &mut out)
        .map_err(|e| invalid(format!("tensor {name}: {e}")))?;
    Ok(out)
}

fn optional_vector(
    g: &Gguf<MappedFile>,
    name: &str,
    len: usize,
) -> Result<Option<Vec<f32>>, ModelError> {
    if g.tensor(name).is_some() {
        vector(g, name, len).map(Some)
    } else {
        Ok(None)
    }
}

fn expert_stack(
    g: &Gguf<MappedFile>,
    name: &str,
    rows: usize,
    cols: usize,
    n_expert: usize,
) -> Result<ExpertStack, ModelError> {
    let t = g.require_tensor(name)?;
    let dims = t.dims();
    if dims != [cols as u64, rows as u64, n_expert as u64] {
        return Err(invalid(format!(
            "tensor {name} has shape {dims:?}, expected [{cols}, {rows}, {n_expert}]"
        )));
    }
    let ty = t.ggml_type();
    let stride = ty
        .row_bytes(cols)
        .and_then(|b| b.checked_mul(rows))
        .ok_or_else(|| invalid(format!("tensor {name}: bad row length for {ty}")))?;
    MatrixView::new(ty, rows, cols, &t.data()[..stride])
        .map_err(|e| invalid(format!("tensor {name} ({ty}) cannot hold experts: {e}")))?;
    Ok(ExpertStack {
        ty,
        rows,
        cols,
        offset: t.offset() as usize,
        stride,
    })
}

fn key_usize(g: &Gguf<MappedFile>, key: &str) -> Result<usize, ModelError> {
    Ok(g.get_u64(key)? as usize)
}

fn opt_usize(g: &Gguf<MappedFile>, key: &str) -> Result<Option<usize>, ModelError> {
    Ok(g.get_u64(key).optional()?.map(|v| v as usize))
}

/// Largest dimension accepted from metadata, to bound allocations made from it.
const MAX_DIM: usize = 1 << 20;

impl Model {
    /// Loads and validates the model in `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        let g = Gguf::open(path)?;
        Self::from_gguf(g)
    }

    /// Validates an opened GGUF as a model.
    pub fn from_gguf(g: Gguf<MappedFile>) -> Result<Model, ModelError> {
        let arch_name = g.architecture()?.to_string();
        let arch = Arch::from_name(&arch_name).ok_or(ModelError::Unsupported(arch_name.clone()))?;
        let a = arch.name();
        let k = |s: &str| format!("{a}.{s}");
        let n_layers = key_usize(&g, &k("block_count"))?;
        let n_embd = key_usize(&g, &k("embedding_length"))?;
        let n_head = key_usize(&g, &k("attention.head_count"))?;
        let n_head_kv = opt_usize(&g, &k("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_head == 0 || n_embd == 0 {
            return Err(invalid("head_count and embedding_length must be positive"));
        }
        let head_dim = opt_usize(&g, &k("attention.key_length"))?.unwrap_or(n_embd / n_head);
        let n_rot = opt_usize(&g, &k("rope.dimension_count"))?.unwrap_or(head_dim);
        let n_ff = opt_usize(&g, &k("feed_forward_length"))?.unwrap_or(0);
        let rope_base = g
            .get_f32(&k("rope.freq_base"))
            .optional()?
            .unwrap_or(10000.0);
        let norm_eps = g
            .get_f32(&k("attention.layer_norm_rms_epsilon"))
            .optional()?
            .unwrap_or(1e-6);
        let n_ctx_train = opt_usize(&g, &k("context_length"))?.unwrap_or(4096);
        let emb = g.require_tensor("token_embd.weight")?;
        let n_vocab =
            *emb.dims()
                .get(1)
                .ok_or_else(|| invalid("token_embd.weight must be 2-D"))? as usize;
        for (name, v) in [
            ("block_count", n_layers),
            ("embedding_length", n_embd),
            ("head_count", n_head),
            ("head_count_kv", n_head_kv),
            ("key_length", head_dim),
            ("feed_forward_length", n_ff),
        ] {
            if v > MAX_DIM {
                return Err(invalid(format!("{a}.{name} = {v} is implausibly large")));
            }
        }
        let n_experts = opt_usize(&g, &k("expert_count"))?.unwrap_or(0);
        let moe = if n_experts > 0 {
            let top_k = key_usize(&g, &k("expert_used_count"))?;
            let n_ff_exp = opt_usize(&g, &k("expert_feed_forward_length"))?.unwrap_or(n_ff);
            let gating = match opt_usize(&g, &k("expert_gating_func"))? {
                None | Some(0) | Some(1) => Gating::Softmax,
                Some(2) => Gating::Sigmoid,
                Some(x) => return Err(invalid(format!("{a}.expert_gating_func = {x} is unknown"))),
            };
            let normalize = g
                .get_bool(&k("expert_weights_norm"))
                .optional()?
                .unwrap_or(arch.default_norm_topk());
            let weights_scale = g
                .get_f32(&k("expert_weights_scale"))
                .optional()?
                .unwrap_or(1.0);
            let n_ff_shared = opt_usize(&g, &k("expert_shared_feed_forward_length"))?;
            Some(MoeParams {
                n_experts,
                top_k,
                n_ff_exp,
                gating,
                normalize,
                weights_scale,
                n_ff_shared,
            })
        } else {
            None
        };
        let hp = Hparams {
            n_layers,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            n_vocab,
            n_ff,
            rope_base,
            rope_style: arch.rope_style(),
            norm_eps,
            moe,
        };
        hp.validate().map_err(|e| invalid(format!("{a}: {e}")))?;

        let packed = crate::pack::PackedIndex::from_gguf(&g)
            .map_err(|e| invalid(format!("packed expert index: {e}")))?;
        let mut layers = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let t = |s: &str| format!("blk.{l}.{s}");
            let (q_dim, kv_dim) = (hp.q_dim(), hp.kv_dim());
            // Q/K norms: per head (qwen3) or over the whole vector (olmoe).
            let qk_norm = |name: &str, full: usize| -> Result<Option<Vec<f32>>, ModelError> {
                match g.tensor(&t(name)) {
                    None => Ok(None),
                    Some(x) if x.n_elements() == head_dim as u64 => {
                        vector(&g, &t(name), head_dim).map(Some)
                    }
                    Some(_) => vector(&g, &t(name), full).map(Some),
                }
            };
            let packed_layer = packed.as_ref().and_then(|p| p.layer(l)).cloned();
            let ffn = if g.tensor(&t("ffn_gate_inp.weight")).is_some() {
                let m = moe.ok_or_else(|| {
                    invalid(format!("layer {l} has a router but no {a}.expert_count"))
                })?;
                let shared = match (g.tensor(&t("ffn_gate_shexp.weight")), m.n_ff_shared) {
                    (None, _) => None,
                    (Some(sh), n) => {
                        let n_sh = n.unwrap_or(*sh.dims().get(1).unwrap_or(&0) as usize);
                        Some((
                            [
                                tensor_ref(&g, &t("ffn_gate_shexp.weight"), n_sh, n_embd)?,
                                tensor_ref(&g, &t("ffn_up_shexp.weight"), n_sh, n_embd)?,
                                tensor_ref(&g, &t("ffn_down_shexp.weight"), n_embd, n_sh)?,
                            ],
                            match g.tensor(&t("ffn_gate_inp_shexp.weight")) {
                                Some(_) => Some(tensor_ref(
                                    &g,
                                    &t("ffn_gate_inp_shexp.weight"),
                                    1,
                                    n_embd,
                                )?),
                                None => None,
                            },
                        ))
                    }
                };
                FfnRefs::Moe {
                    router: tensor_ref(&g, &t("ffn_gate_inp.weight"), m.n_experts, n_embd)?,
                    experts: match packed_layer {
                        Some(p) => {
                            let f = p.format;
                            if f.n_embd != n_embd || f.n_ff != m.n_ff_exp {
                                return Err(invalid(format!(
                                    "packed layer {l} has the wrong expert shape"
                                )));
                            }
                            ExpertStore::Packed(Box::new(p))
                        }
                        None => {
                            let stack = |name: &str, rows, cols| {
                                expert_stack(&g, &t(name), rows, cols, m.n_experts)
                            };
                            ExpertStore::Plain([
                                stack("ffn_gate_exps.weight", m.n_ff_exp, n_embd)?,
                                stack("ffn_up_exps.weight", m.n_ff_exp, n_embd)?,
                                stack("ffn_down_exps.weight", n_embd, m.n_ff_exp)?,
                            ])
                        }
                    },
                    shared,
                }
            } else {
                FfnRefs::Dense([
                    tensor_ref(&g, &t("ffn_gate.weight"), n_ff, n_embd)?,
                    tensor_ref(&g, &t("ffn_up.weight"), n_ff, n_embd)?,
                    tensor_ref(&g, &t("ffn_down.weight"), n_embd, n_ff)?,
                ])
            };
            layers.push(LayerRefs {
                attn_norm: vector(&g, &t("attn_norm.weight"), n_embd)?,
                wq: tensor_ref(&g, &t("attn_q.weight"), q_dim, n_embd)?,
                wk: tensor_ref(&g, &t("attn_k.weight"), kv_dim, n_embd)?,
                wv: tensor_ref(&g, &t("attn_v.weight"), kv_dim, n_embd)?,
                wo: tensor_ref(&g, &t("attn_output.weight"), n_embd, q_dim)?,
                bq: optional_vector(&g, &t("attn_q.bias"), q_dim)?,
                bk: optional_vector(&g, &t("attn_k.bias"), kv_dim)?,
                bv: optional_vector(&g, &t("attn_v.bias"), kv_dim)?,
                q_norm: qk_norm("attn_q_norm.weight", q_dim)?,
                k_norm: qk_norm("attn_k_norm.weight", kv_dim)?,
                ffn_norm: vector(&g, &t("ffn_norm.weight"), n_embd)?,
                ffn,
            });
        }
        let embedding = tensor_ref(&g, "token_embd.weight", n_vocab, n_embd)?;
        let output = if g.tensor("output.weight").is_some() {
            tensor_ref(&g, "output.weight", n_vocab, n_embd)?
        } else {
            embedding // tied embeddings
        };
        let output_norm = vector(&g, "output_norm.weight", n_embd)?;
        Ok(Model {
            gguf: g,
            arch,
            hp,
            n_ctx_train,
            layers,
            embedding,
            output,
            output_norm,
        })
    }

    /// The underlying GGUF.
    pub fn gguf(&self) -> &Gguf<MappedFile> {
        &self.gguf
    }

    fn view(&self, t: &Tref) -> MatrixView<'_> {
        let bytes = &self.gguf.bytes()[t.offset..t.offset + t.len];
        MatrixView::new(t.ty, t.rows, t.cols, bytes).expect("shape and bytes validated at load")
    }

    fn store(&self, layer: usize) -> Option<&ExpertStore> {
        match &self.layers.get(layer)?.ffn {
            FfnRefs::Moe { experts, .. } => Some(experts),
            FfnRefs::Dense(_) => None,
        }
    }

    /// Whether layer `layer` has routed experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.store(layer).is_some()
    }

    /// Whether the experts are packed (`les pack`): one aligned extent each.
    pub fn is_packed(&self) -> bool {
        (0..self.hp.n_layers).any(|l| matches!(self.store(l), Some(ExpertStore::Packed(_))))
    }

    /// The layout of layer `layer`'s expert in a slot (gate, up, down back to back).
    pub fn expert_format(&self, layer: usize) -> Option<ExpertFormat> {
        Some(match self.store(layer)? {
            ExpertStore::Plain([g, u, d]) => ExpertFormat {
                gate: g.ty,
                up: u.ty,
                down: d.ty,
                n_embd: g.cols,
                n_ff: g.rows,
            },
            ExpertStore::Packed(p) => p.format,
        })
    }

    /// Bytes read for one expert of `layer` (a packed expert is read whole,
    /// padding included, so O_DIRECT can serve it).
    fn expert_read_bytes(&self, layer: usize) -> Option<usize> {
        Some(match self.store(layer)? {
            ExpertStore::Plain(s) => s.iter().map(|x| x.stride).sum(),
            ExpertStore::Packed(p) => p.stride as usize,
        })
    }

    /// Bytes of the largest expert read of any layer (the slot size).
    pub fn max_expert_bytes(&self) -> usize {
        (0..self.hp.n_layers)
            .filter_map(|l| self.expert_read_bytes(l))
            .max()
            .unwrap_or(0)
    }

    /// Total bytes of routed experts in the file.
    pub fn total_expert_bytes(&self) -> u64 {
        let n = self.hp.moe.map_or(0, |m| m.n_experts) as u64;
        (0..self.hp.n_layers)
            .filter_map(|l| self.expert_read_bytes(l))
            .map(|b| b as u64 * n)
            .sum()
    }

    /// Expert `expert` of layer `layer`, viewed in the mapped file.
    pub fn expert(&self, layer: usize, expert: u16) -> Option<ExpertMatrices<'_>> {
        if expert as usize >= self.hp.moe?.n_experts {
            return None;
        }
        let bytes = self.gguf.bytes();
        match self.store(layer)? {
            ExpertStore::Plain(s) => {
                let view = |x: &ExpertStack| {
                    let start = x.offset + expert as usize * x.stride;
                    MatrixView::new(x.ty, x.rows, x.cols, &bytes[start..start + x.stride])
                        .expect("expert stacks validated at load")
                };
                Some(ExpertMatrices {
                    gate: view(&s[0]),
                    up: view(&s[1]),
                    down: view(&s[2]),
                })
            }
            ExpertStore::Packed(p) => {
                let e = p.extent(expert as usize)?;
                let slot = &bytes[e.offset as usize..(e.offset + e.len) as usize];
                Some(
                    p.format
                        .matrices(slot)
                        .expect("packed index validated at load"),
                )
            }
        }
    }

    /// The file extents of an expert, placed back to back in the slot: three for a
    /// plain GGUF (gate, up, down), one aligned extent for a packed file.
    pub fn expert_extents(&self, key: ExpertKey) -> Extents {
        let mut ext = Extents::new();
        match self.store(key.layer as usize) {
            Some(ExpertStore::Plain(s)) => {
                let mut at = 0u32;
                for x in s {
                    let _ = ext.push(Extent {
                        offset: (x.offset + key.expert as usize * x.stride) as u64,
                        len: x.stride as u32,
                        slot_offset: at,
                    });
                    at += x.stride as u32;
                }
            }
            Some(ExpertStore::Packed(p)) => {
                if let Some(e) = p.extent(key.expert as usize) {
                    let _ = ext.push(Extent {
                        offset: e.offset,
                        len: e.padded_len as u32,
                        slot_offset: 0,
                    });
                }
            }
            None => {}
        }
        ext
    }

    /// Whether the bytes read for `key` match its checksum (packed files; plain
    /// GGUFs carry none).
    pub fn verify_expert(&self, key: ExpertKey, slot: &[u8]) -> bool {
        match self.store(key.layer as usize) {
            Some(ExpertStore::Packed(p)) => p.verify(key.expert as usize, slot),
            _ => true,
        }
    }
}

impl Weights for Model {
    fn layer(&self, layer: usize) -> LayerWeights<'_> {
        let l = &self.layers[layer];
        let ffn = match &l.ffn {
            FfnRefs::Dense([g, u, d]) => Ffn::Dense {
                gate: self.view(g),
                up: self.view(u),
                down: self.view(d),
            },
            FfnRefs::Moe { router, shared, .. } => Ffn::Moe {
                router: self.view(router),
                shared: shared.as_ref().map(|([g, u, d], gi)| SharedExpert {
                    gate: self.view(g),
                    up: self.view(u),
                    down: self.view(d),
                    gate_inp: gi.as_ref().map(|t| self.view(t)),
                }),
            },
        };
        LayerWeights {
            attn_norm: &l.attn_norm,
            wq: self.view(&l.wq),
            wk: self.view(&l.wk),
            wv: self.view(&l.wv),
            wo: self.view(&l.wo),
            bq: l.bq.as_deref(),
            bk: l.bk.as_deref(),
            bv: l.bv.as_deref(),
            q_norm: l.q_norm.as_deref(),
            k_norm: l.k_norm.as_deref(),
            ffn_norm: &l.ffn_norm,
            ffn,
        }
    }

    fn embedding(&self) -> MatrixView<'_> {
        self.view(&self.embedding)
    }

    fn output_norm(&self) -> &[f32] {
        &self.output_norm
    }

    fn output(&self) -> MatrixView<'_> {
        self.view(&self.output)
    }
}
