//! The resident weights, viewed in flash through the index.

use les_core::gemv::MatrixView;
use les_core::model::experts::ExpertFormat;
use les_core::model::forward::{AttentionWeights, Block, Ffn, Mixer, SharedExpert, Weights};

use crate::index::{FfnDesc, Index, IndexError, Tensor, Vector};

/// Every resident matrix and vector, checked once at start.
pub struct FlashWeights<'a, const L: usize> {
    layers: heapless::Vec<Block<'a>, L>,
    formats: heapless::Vec<Option<ExpertFormat>, L>,
    embedding: MatrixView<'a>,
    output: MatrixView<'a>,
    output_norm: &'a [f32],
}

fn matrix<'a>(model: &'a [u8], t: &Tensor) -> Result<MatrixView<'a>, IndexError> {
    let bytes = model
        .get(t.offset..t.offset + t.len)
        .ok_or("tensor outside the model")?;
    MatrixView::new(t.ty, t.rows, t.cols, bytes).map_err(|_| "a tensor is not a weight matrix")
}

fn vector<'a>(index: &'a [u8], v: &Vector) -> Result<&'a [f32], IndexError> {
    let bytes = index
        .get(v.at..v.at + 4 * v.len)
        .ok_or("vector outside the index")?;
    // Zero-copy: the index is 4-aligned in flash and vectors start on words.
    bytemuck::try_cast_slice(bytes).map_err(|_| "misaligned vector (index not 4-aligned)")
}

impl<'a, const L: usize> FlashWeights<'a, L> {
    /// Views every weight of `index` in `model`.
    pub fn new(index: &Index<'a, L>, model: &'a [u8]) -> Result<Self, IndexError> {
        let ib = index.bytes();
        let opt = |v: &Option<Vector>| v.as_ref().map(|v| vector(ib, v)).transpose();
        let mut layers = heapless::Vec::new();
        let mut formats = heapless::Vec::new();
        for d in &index.layers {
            let (ffn, format) = match d.ffn {
                FfnDesc::Dense { gate, up, down } => (
                    Ffn::Dense {
                        gate: Some(matrix(model, &gate)?),
                        up: matrix(model, &up)?,
                        down: matrix(model, &down)?,
                    },
                    None,
                ),
                FfnDesc::Moe {
                    router,
                    shared,
                    types,
                    ..
                } => {
                    let shared = match shared {
                        Some(s) => Some(SharedExpert {
                            gate: Some(matrix(model, &s.gate)?),
                            up: matrix(model, &s.up)?,
                            down: matrix(model, &s.down)?,
                            gate_inp: s.gate_inp.map(|g| matrix(model, &g)).transpose()?,
                        }),
                        None => None,
                    };
                    let moe = index.hp.moe.ok_or("MoE layer in a dense model")?;
                    let format = ExpertFormat {
                        gate: Some(types[0]),
                        up: types[1],
                        down: types[2],
                        n_embd: index.hp.n_embd,
                        n_ff: moe.n_ff_exp,
                    };
                    (
                        Ffn::Moe {
                            router: matrix(model, &router)?,
                            shared,
                            router_bias: None,
                            selection_bias: None,
                            expert_bias: None,
                        },
                        Some(format),
                    )
                }
            };
            let lw = Block {
                attn_norm: vector(ib, &d.attn_norm)?,
                mixer: Mixer::Attention(AttentionWeights {
                    wq: matrix(model, &d.wq)?,
                    wk: matrix(model, &d.wk)?,
                    wv: matrix(model, &d.wv)?,
                    wo: matrix(model, &d.wo)?,
                    bq: opt(&d.bq)?,
                    bk: opt(&d.bk)?,
                    bv: opt(&d.bv)?,
                    q_norm: opt(&d.q_norm)?,
                    k_norm: opt(&d.k_norm)?,
                    bo: None,
                    sinks: None,
                    window: None,
                    rope_freqs: None,
                    norm_after_rope: false,
                    nope: None,
                }),
                ffn_norm: vector(ib, &d.ffn_norm)?,
                ffn,
            };
            layers.push(lw).map_err(|_| "too many layers")?;
            formats.push(format).map_err(|_| "too many layers")?;
        }
        Ok(FlashWeights {
            layers,
            formats,
            embedding: matrix(model, &index.embedding)?,
            output: matrix(model, &index.output)?,
            output_norm: vector(ib, &index.output_norm)?,
        })
    }

    /// The slot layout of layer `layer`'s experts (`None` for a dense layer).
    pub fn expert_format(&self, layer: usize) -> Option<ExpertFormat> {
        self.formats.get(layer).copied().flatten()
    }
}

impl<const L: usize> Weights for FlashWeights<'_, L> {
    fn block(&self, layer: usize) -> Block<'_> {
        self.layers[layer]
    }

    fn embedding(&self) -> MatrixView<'_> {
        self.embedding
    }

    fn output_norm(&self) -> &[f32] {
        self.output_norm
    }

    fn output(&self) -> MatrixView<'_> {
        self.output
    }
}
