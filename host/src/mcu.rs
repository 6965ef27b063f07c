//! The model index a microcontroller firmware reads instead of parsing GGUF.
//!
//! A firmware embeds the packed GGUF unchanged (experts are read from it at the
//! same offsets as on a host) next to this small index, written by
//! `les mcu-index`. The index holds what loading a [`Model`] on a host works out:
//! the hyperparameters, where each weight matrix lies in the GGUF, the (small)
//! norm and bias vectors as `f32` values, and each expert's extents and checksum.
//! So a firmware needs no GGUF parser, no metadata conventions per architecture,
//! and no allocator: it walks the index once.
//!
//! # Format, version 1
//!
//! A sequence of little-endian 32-bit words (`u32`; floats as their IEEE bits):
//!
//! ```text
//! header   magic "LESM" (0x4d53454c), version 1, word count of the index,
//!          byte length of the GGUF it describes
//! hparams  n_layers n_embd n_head n_head_kv head_dim n_rot n_vocab n_ff
//!          rope_base(f32) rope_style(0 normal, 1 neox) norm_eps(f32)
//!          n_experts(0 = dense model) top_k n_ff_exp gating(0 softmax, 1 sigmoid)
//!          normalize(0/1) weights_scale(f32) n_ff_shared(0 = none)
//!          slot_bytes (largest expert read: the size of a single-class slot)
//! model    embedding:T output:T output_norm:V
//! layers   n_layers times:
//!            attn_norm:V wq:T wk:T wv:T wo:T bq:V? bk:V? bv:V? q_norm:V? k_norm:V?
//!            ffn_norm:V kind(0 dense, 1 moe)
//!            dense: gate:T up:T down:T
//!            moe:   router:T has_shared(0/1) [gate:T up:T down:T gate_inp:T?]
//!                   expert gate/up/down ggml type ids (3 words)
//!                   n_experts times (9 words each): crc32, crc_len,
//!                                    n_parts (1..=3), 3 x (offset, len)
//!                                    (unused parts zero)
//! T   a matrix: ggml type id, rows, cols, byte offset in the GGUF, byte length
//! T?  a type id of 0xffff_ffff means absent (no further words)
//! V   a vector: element count n, then n f32 words; V? absent when n = 0
//! ```
//!
//! An expert's parts go back to back in its slot (slot offset 0, then after the
//! previous part); `crc_len` bytes from the slot start must have CRC-32 `crc`
//! ([`les_core::layout::checksum`]); `crc_len` 0 means no checksum (plain GGUF).
//! A firmware that sizes its slots per expert size (`les_core::slot_classes`, as
//! `tests/firmware` does) takes each layer's sizes from its experts' parts.

use std::fmt;

use les_core::gemv::MatrixView;
use les_core::model::config::ExpertAct;
use les_core::model::forward::{Ffn, Mixer, Weights};
use les_core::model::ops::RopeStyle;
use les_core::router::Gating;
use les_core::slots::ExpertKey;

use crate::model::Model;
use crate::pack::PackedIndex;

/// `"LESM"` read as a little-endian word.
pub const MAGIC: u32 = u32::from_le_bytes(*b"LESM");
/// The index format version this module writes.
pub const VERSION: u32 = 1;
/// Type id marking an absent matrix.
pub const ABSENT: u32 = u32::MAX;
/// Extents recorded per expert (unused ones are zero).
pub const PARTS: usize = 3;
/// Words of one expert record.
pub const EXPERT_WORDS: usize = 3 + 2 * PARTS;

/// Why an index could not be written for a model.
#[derive(Debug)]
pub struct McuIndexError(String);

impl fmt::Display for McuIndexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for McuIndexError {}

struct Writer<'m> {
    words: Vec<u32>,
    base: usize,
    len: usize,
    _model: std::marker::PhantomData<&'m ()>,
}

impl Writer<'_> {
    fn word(&mut self, w: u32) {
        self.words.push(w);
    }

    fn usize(&mut self, v: usize) -> Result<(), McuIndexError> {
        let w = u32::try_from(v)
            .map_err(|_| McuIndexError(format!("{v} does not fit the 32-bit index")))?;
        self.word(w);
        Ok(())
    }

    fn f32(&mut self, v: f32) {
        self.word(v.to_bits());
    }

    /// A matrix viewed in the mapped file: its offset is where its bytes are.
    fn matrix(&mut self, m: &MatrixView<'_>) -> Result<(), McuIndexError> {
        let first = m
            .row(0)
            .ok_or_else(|| McuIndexError("empty matrix".into()))?;
        let offset = (first.as_ptr() as usize)
            .checked_sub(self.base)
            .filter(|o| o + m.rows() * m.row_bytes() <= self.len)
            .ok_or_else(|| McuIndexError("a weight matrix is not in the model file".into()))?;
        self.word(m.ty().id());
        self.usize(m.rows())?;
        self.usize(m.cols())?;
        self.usize(offset)?;
        self.usize(m.rows() * m.row_bytes())
    }

    fn opt_matrix(&mut self, m: Option<&MatrixView<'_>>) -> Result<(), McuIndexError> {
        match m {
            Some(m) => self.matrix(m),
            None => {
                self.word(ABSENT);
                Ok(())
            }
        }
    }

    fn vector(&mut self, v: &[f32]) -> Result<(), McuIndexError> {
        self.usize(v.len())?;
        for &x in v {
            self.f32(x);
        }
        Ok(())
    }

    fn opt_vector(&mut self, v: Option<&[f32]>) -> Result<(), McuIndexError> {
        self.vector(v.unwrap_or(&[]))
    }
}

/// Writes the index of `model` (see the [module](self) documentation).
pub fn write_index(model: &Model) -> Result<Vec<u8>, McuIndexError> {
    let bytes = model.gguf().bytes();
    let hp = &model.hp;
    let mut w = Writer {
        words: Vec::new(),
        base: bytes.as_ptr() as usize,
        len: bytes.len(),
        _model: std::marker::PhantomData,
    };
    w.word(MAGIC);
    w.word(VERSION);
    w.word(0); // word count, patched at the end
    w.usize(bytes.len())?;

    for v in [
        hp.n_layers,
        hp.n_embd,
        hp.n_head,
        hp.n_head_kv,
        hp.head_dim,
        hp.n_rot,
        hp.n_vocab,
        hp.n_ff,
    ] {
        w.usize(v)?;
    }
    w.f32(hp.rope_base);
    w.word(match hp.rope_style {
        RopeStyle::Normal => 0,
        RopeStyle::Neox => 1,
    });
    w.f32(hp.norm_eps);
    match hp.moe {
        Some(m) => {
            if m.groups.is_some() {
                return Err(McuIndexError(
                    "the firmware does not run group-limited routing (expert_group_count)".into(),
                ));
            }
            if m.weight_inputs {
                return Err(McuIndexError(
                    "the firmware does not run Llama 4's experts (weights on their inputs)".into(),
                ));
            }
            w.usize(m.n_experts)?;
            w.usize(m.top_k)?;
            w.usize(m.n_ff_exp)?;
            w.word(match m.gating {
                Gating::Softmax => 0,
                Gating::Sigmoid => 1,
                Gating::SoftmaxWeight => {
                    return Err(McuIndexError(
                        "the firmware does not run gpt-oss's gating (a softmax of the picks)"
                            .into(),
                    ))
                }
                Gating::SigmoidOfLogits => {
                    return Err(McuIndexError(
                        "the firmware does not run Llama 4's gating (picks by logit)".into(),
                    ))
                }
            });
            w.word(m.normalize as u32);
            w.f32(m.weights_scale);
            w.usize(m.n_ff_shared.unwrap_or(0))?;
        }
        None => {
            for _ in 0..4 {
                w.word(0);
            }
            w.word(0);
            w.f32(1.0);
            w.word(0);
        }
    }
    w.usize(model.max_expert_bytes())?;
    if hp.scales.any() {
        return Err(McuIndexError(
            "the firmware does not run Granite's multipliers (embedding, residual, \
             attention and logit scales)"
                .into(),
        ));
    }

    w.matrix(&model.embedding())?;
    w.matrix(&model.output())?;
    w.vector(model.output_norm())?;

    let packed = PackedIndex::from_gguf(model.gguf())
        .map_err(|e| McuIndexError(format!("packed expert index: {e}")))?;
    for l in 0..hp.n_layers {
        let b = model.block(l);
        let Mixer::Attention(a) = b.mixer else {
            return Err(McuIndexError(format!(
                "layer {l} is not an attention layer (the firmware runs plain transformers)"
            )));
        };
        let moe_extras = matches!(
            b.ffn,
            Ffn::Moe {
                router_bias: Some(_),
                ..
            } | Ffn::Moe {
                selection_bias: Some(_),
                ..
            } | Ffn::Moe {
                expert_bias: Some(_),
                ..
            }
        );
        let act = hp.moe.map(|m| m.act);
        if a.bo.is_some()
            || a.sinks.is_some()
            || a.window.is_some()
            || a.rope_freqs.is_some()
            || a.norm_after_rope
            || a.nope.is_some()
            || model.hybrid.rope_sections.is_some()
            || moe_extras
            || hp.rope_yarn.is_some()
            || act.is_some_and(|x| x != ExpertAct::SwiGlu)
        {
            return Err(McuIndexError(format!(
                "layer {l} needs what the firmware does not run (gpt-oss's output and \
                 expert biases, attention sinks, sliding windows or chunks, YaRN, RoPE \
                 frequency factors, M-RoPE sections, Q/K norms after RoPE, layers without RoPE or clamped \
                 SwiGLU, or an expert selection bias)"
            )));
        }
        w.vector(b.attn_norm)?;
        for m in [&a.wq, &a.wk, &a.wv, &a.wo] {
            w.matrix(m)?;
        }
        for v in [a.bq, a.bk, a.bv, a.q_norm, a.k_norm] {
            w.opt_vector(v)?;
        }
        w.vector(b.ffn_norm)?;
        let ungated = || {
            McuIndexError(format!(
                "layer {l} has an FFN without a gate (ReLU^2), which the firmware does not run"
            ))
        };
        match b.ffn {
            Ffn::None => {
                return Err(McuIndexError(format!(
                    "layer {l} has no FFN, which the firmware does not run"
                )))
            }
            Ffn::Dense { gate, up, down } => {
                w.word(0);
                for m in [&gate.ok_or_else(ungated)?, &up, &down] {
                    w.matrix(m)?;
                }
            }
            Ffn::Moe { router, shared, .. } => {
                w.word(1);
                w.matrix(&router)?;
                match shared {
                    Some(s) => {
                        w.word(1);
                        for m in [&s.gate.ok_or_else(ungated)?, &s.up, &s.down] {
                            w.matrix(m)?;
                        }
                        w.opt_matrix(s.gate_inp.as_ref())?;
                    }
                    None => w.word(0),
                }
                let format = model
                    .expert_format(l)
                    .ok_or_else(|| McuIndexError(format!("layer {l} has no expert format")))?;
                for ty in format.types() {
                    w.word(ty.id());
                }
                let layer = packed.as_ref().and_then(|p| p.layer(l));
                let n_experts = hp.moe.map_or(0, |m| m.n_experts);
                for e in 0..n_experts {
                    let key = ExpertKey {
                        layer: l as u16,
                        expert: e as u16,
                    };
                    match layer {
                        Some(p) => {
                            w.word(p.checksums[e]);
                            w.usize(p.expert_bytes as usize)?;
                        }
                        None => {
                            w.word(0);
                            w.word(0);
                        }
                    }
                    let ext = model.expert_extents(key);
                    if ext.is_empty() || ext.len() > PARTS {
                        return Err(McuIndexError(format!("{key} has {} extents", ext.len())));
                    }
                    w.usize(ext.len())?;
                    for i in 0..PARTS {
                        let (offset, len) = ext.get(i).map_or((0, 0), |x| (x.offset, x.len));
                        w.usize(offset as usize)?;
                        w.usize(len as usize)?;
                    }
                }
            }
        }
    }
    let n = w.words.len();
    w.words[2] = u32::try_from(n).map_err(|_| McuIndexError("index too large".into()))?;
    Ok(w.words.iter().flat_map(|x| x.to_le_bytes()).collect())
}
