//! Reader of the model index written by `les mcu-index` (format documented in the
//! host crate, `les::mcu`). `no_std`, no allocation; shared with `build.rs`,
//! which sizes the firmware's static buffers from the same header.

use les_core::model::config::{Hparams, MoeParams};
use les_core::model::ops::RopeStyle;
use les_core::quant::GgmlType;
use les_core::router::Gating;

/// `"LESM"` as a little-endian word.
pub const MAGIC: u32 = u32::from_le_bytes(*b"LESM");
/// The version read here.
pub const VERSION: u32 = 1;
const ABSENT: u32 = u32::MAX;
/// Extents per expert record.
pub const PARTS: usize = 3;
const EXPERT_WORDS: usize = 3 + 2 * PARTS;

/// Why the index is unusable.
pub type IndexError = &'static str;

/// A weight matrix in the model file.
#[derive(Clone, Copy, Debug)]
pub struct Tensor {
    /// Weight type.
    pub ty: GgmlType,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Byte offset in the model file.
    pub offset: usize,
    /// Byte length.
    pub len: usize,
}

/// An `f32` vector stored in the index: `len` floats from byte `at` of the index.
#[derive(Clone, Copy, Debug)]
pub struct Vector {
    /// Byte offset in the index.
    pub at: usize,
    /// Elements.
    pub len: usize,
}

/// The shared expert of a MoE layer.
#[derive(Clone, Copy, Debug)]
pub struct Shared {
    /// Gate projection.
    pub gate: Tensor,
    /// Up projection.
    pub up: Tensor,
    /// Down projection.
    pub down: Tensor,
    /// Scalar gate.
    pub gate_inp: Option<Tensor>,
}

/// A layer's FFN.
#[derive(Clone, Copy, Debug)]
pub enum FfnDesc {
    /// Dense SwiGLU.
    Dense {
        /// Gate projection.
        gate: Tensor,
        /// Up projection.
        up: Tensor,
        /// Down projection.
        down: Tensor,
    },
    /// Routed experts.
    Moe {
        /// Router.
        router: Tensor,
        /// Shared expert.
        shared: Option<Shared>,
        /// Types of gate, up and down of every expert.
        types: [GgmlType; 3],
        /// Byte offset in the index of the first expert record.
        experts_at: usize,
    },
}

/// One layer.
#[derive(Clone, Copy, Debug)]
pub struct LayerDesc {
    /// Pre-attention norm.
    pub attn_norm: Vector,
    /// Attention projections q, k, v, o.
    pub wq: Tensor,
    /// Key projection.
    pub wk: Tensor,
    /// Value projection.
    pub wv: Tensor,
    /// Output projection.
    pub wo: Tensor,
    /// Optional biases and q/k norms.
    pub bq: Option<Vector>,
    /// Key bias.
    pub bk: Option<Vector>,
    /// Value bias.
    pub bv: Option<Vector>,
    /// Query norm.
    pub q_norm: Option<Vector>,
    /// Key norm.
    pub k_norm: Option<Vector>,
    /// Pre-FFN norm.
    pub ffn_norm: Vector,
    /// The FFN.
    pub ffn: FfnDesc,
}

/// One expert's place in the model file.
#[derive(Clone, Copy, Debug)]
pub struct ExpertDesc {
    /// CRC-32 of the first `crc_len` slot bytes.
    pub crc: u32,
    /// Bytes the checksum covers (0: none).
    pub crc_len: usize,
    /// (offset, len) of each part, placed back to back in the slot.
    pub parts: [(usize, usize); PARTS],
    /// Parts used.
    pub n_parts: usize,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn word(&mut self) -> Result<u32, IndexError> {
        let b = self
            .bytes
            .get(self.pos..self.pos + 4)
            .ok_or("index truncated")?;
        self.pos += 4;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn usize(&mut self) -> Result<usize, IndexError> {
        self.word().map(|w| w as usize)
    }

    fn f32(&mut self) -> Result<f32, IndexError> {
        self.word().map(f32::from_bits)
    }

    fn tensor_or_absent(&mut self, model_len: usize) -> Result<Option<Tensor>, IndexError> {
        let id = self.word()?;
        if id == ABSENT {
            return Ok(None);
        }
        let ty = GgmlType::from_id(id).map_err(|_| "unknown weight type")?;
        let t = Tensor {
            ty,
            rows: self.usize()?,
            cols: self.usize()?,
            offset: self.usize()?,
            len: self.usize()?,
        };
        if t.offset.checked_add(t.len).is_none_or(|e| e > model_len) {
            return Err("a tensor lies outside the model file");
        }
        Ok(Some(t))
    }

    fn tensor(&mut self, model_len: usize) -> Result<Tensor, IndexError> {
        self.tensor_or_absent(model_len)?
            .ok_or("a required tensor is absent")
    }

    fn vector_or_absent(&mut self) -> Result<Option<Vector>, IndexError> {
        let len = self.usize()?;
        let at = self.pos;
        let end = len
            .checked_mul(4)
            .and_then(|b| at.checked_add(b))
            .filter(|&e| e <= self.bytes.len())
            .ok_or("index truncated in a vector")?;
        self.pos = end;
        Ok((len > 0).then_some(Vector { at, len }))
    }

    fn vector(&mut self) -> Result<Vector, IndexError> {
        self.vector_or_absent()?.ok_or("a required vector is empty")
    }
}

/// A parsed index over its bytes; `L` is the most layers it holds.
pub struct Index<'a, const L: usize> {
    bytes: &'a [u8],
    /// Model shape.
    pub hp: Hparams,
    /// Bytes of the model file the index describes.
    pub model_len: usize,
    /// Slot size: the largest expert read.
    pub slot_bytes: usize,
    /// Token embedding.
    pub embedding: Tensor,
    /// Output projection.
    pub output: Tensor,
    /// Final norm.
    pub output_norm: Vector,
    /// The layers.
    pub layers: heapless::Vec<LayerDesc, L>,
}

fn ty(id: u32) -> Result<GgmlType, IndexError> {
    GgmlType::from_id(id).map_err(|_| "unknown expert type")
}

impl<'a, const L: usize> Index<'a, L> {
    /// Parses and checks `bytes`.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, IndexError> {
        let mut c = Cursor { bytes, pos: 0 };
        if c.word()? != MAGIC {
            return Err("not an LES model index (bad magic)");
        }
        if c.word()? != VERSION {
            return Err("unsupported index version");
        }
        if c.usize()?.checked_mul(4) != Some(bytes.len()) {
            return Err("index length does not match its header");
        }
        let model_len = c.usize()?;
        let mut h = [0usize; 8];
        for v in &mut h {
            *v = c.usize()?;
        }
        let [n_layers, n_embd, n_head, n_head_kv, head_dim, n_rot, n_vocab, n_ff] = h;
        let rope_base = c.f32()?;
        let rope_style = match c.word()? {
            0 => RopeStyle::Normal,
            1 => RopeStyle::Neox,
            _ => return Err("unknown rope style"),
        };
        let norm_eps = c.f32()?;
        let n_experts = c.usize()?;
        let top_k = c.usize()?;
        let n_ff_exp = c.usize()?;
        let gating = match c.word()? {
            0 => Gating::Softmax,
            1 => Gating::Sigmoid,
            _ => return Err("unknown gating"),
        };
        let normalize = c.word()? != 0;
        let weights_scale = c.f32()?;
        let n_ff_shared = c.usize()?;
        let slot_bytes = c.usize()?;
        let moe = (n_experts > 0).then_some(MoeParams {
            n_experts,
            top_k,
            n_ff_exp,
            gating,
            normalize,
            weights_scale,
            n_ff_shared: (n_ff_shared > 0).then_some(n_ff_shared),
            act: les_core::model::config::ExpertAct::SwiGlu,
            groups: None,
            weight_inputs: false,
            route_before_attention: false,
        });
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
            rope_style,
            norm_eps,
            moe,
            rope_yarn: None,
            scales: les_core::model::config::Scales::NONE,
        };
        hp.validate()?;
        let embedding = c.tensor(model_len)?;
        let output = c.tensor(model_len)?;
        let output_norm = c.vector()?;
        let mut layers = heapless::Vec::new();
        for _ in 0..n_layers {
            let attn_norm = c.vector()?;
            let wq = c.tensor(model_len)?;
            let wk = c.tensor(model_len)?;
            let wv = c.tensor(model_len)?;
            let wo = c.tensor(model_len)?;
            let bq = c.vector_or_absent()?;
            let bk = c.vector_or_absent()?;
            let bv = c.vector_or_absent()?;
            let q_norm = c.vector_or_absent()?;
            let k_norm = c.vector_or_absent()?;
            let ffn_norm = c.vector()?;
            let ffn = match c.word()? {
                0 => FfnDesc::Dense {
                    gate: c.tensor(model_len)?,
                    up: c.tensor(model_len)?,
                    down: c.tensor(model_len)?,
                },
                1 => {
                    let router = c.tensor(model_len)?;
                    let shared = match c.word()? {
                        0 => None,
                        _ => Some(Shared {
                            gate: c.tensor(model_len)?,
                            up: c.tensor(model_len)?,
                            down: c.tensor(model_len)?,
                            gate_inp: c.tensor_or_absent(model_len)?,
                        }),
                    };
                    let types = [ty(c.word()?)?, ty(c.word()?)?, ty(c.word()?)?];
                    let experts_at = c.pos;
                    c.pos = n_experts
                        .checked_mul(EXPERT_WORDS * 4)
                        .and_then(|b| b.checked_add(c.pos))
                        .filter(|&e| e <= bytes.len())
                        .ok_or("index truncated in the expert table")?;
                    FfnDesc::Moe {
                        router,
                        shared,
                        types,
                        experts_at,
                    }
                }
                _ => return Err("unknown FFN kind"),
            };
            let layer = LayerDesc {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                bq,
                bk,
                bv,
                q_norm,
                k_norm,
                ffn_norm,
                ffn,
            };
            layers
                .push(layer)
                .map_err(|_| "more layers than this build holds")?;
        }
        if c.pos != bytes.len() {
            return Err("trailing bytes after the last layer");
        }
        let index = Index {
            bytes,
            hp,
            model_len,
            slot_bytes,
            embedding,
            output,
            output_norm,
            layers,
        };
        // Every expert record must be in range too.
        for l in 0..n_layers {
            for e in 0..n_experts {
                if let Some(x) = index.expert(l, e)? {
                    let mut at = 0usize;
                    for &(off, len) in &x.parts[..x.n_parts] {
                        if off.checked_add(len).is_none_or(|end| end > model_len) {
                            return Err("an expert lies outside the model file");
                        }
                        at += len;
                    }
                    if at > slot_bytes || x.crc_len > at {
                        return Err("an expert does not fit its slot");
                    }
                }
            }
        }
        Ok(index)
    }

    /// The index bytes (vectors are read from them).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Expert `expert` of layer `layer`, `None` for a dense layer.
    pub fn expert(&self, layer: usize, expert: usize) -> Result<Option<ExpertDesc>, IndexError> {
        let Some(FfnDesc::Moe { experts_at, .. }) = self.layers.get(layer).map(|l| l.ffn) else {
            return Ok(None);
        };
        let n_experts = self.hp.moe.map_or(0, |m| m.n_experts);
        if expert >= n_experts {
            return Err("expert out of range");
        }
        let mut c = Cursor {
            bytes: self.bytes,
            pos: experts_at + expert * EXPERT_WORDS * 4,
        };
        let crc = c.word()?;
        let crc_len = c.usize()?;
        let n_parts = c.usize()?;
        if n_parts == 0 || n_parts > PARTS {
            return Err("bad part count");
        }
        let mut parts = [(0, 0); PARTS];
        for p in &mut parts {
            *p = (c.usize()?, c.usize()?);
        }
        Ok(Some(ExpertDesc {
            crc,
            crc_len,
            parts,
            n_parts,
        }))
    }

    /// Widest input of any matrix-vector product (sizes the activation buffers;
    /// used by build.rs).
    #[allow(dead_code)]
    pub fn max_cols(&self) -> usize {
        let hp = &self.hp;
        let moe = hp
            .moe
            .map_or(0, |m| m.n_ff_exp.max(m.n_ff_shared.unwrap_or(0)));
        hp.n_embd.max(hp.q_dim()).max(hp.n_ff).max(moe)
    }
}
