//! Multi-token prediction: the nextn block of qwen35moe (Qwen3.5 / Qwen3.6 MoE,
//! MiniCPM-V 4.7's language model), which guesses the token after next for
//! speculative decoding, as llama.cpp's `draft-mtp` runs it.
//!
//! At position `p` the block takes the token `x_p` and the main model's final
//! hidden state at `p - 1` after the output norm (`h_{p-1}`, zeros at `p = 0`),
//! and predicts `x_{p+1}`:
//!
//! ```text
//! h  = eh_proj · [enorm(embed(x_p)); hnorm(h_{p-1})]
//! h += attention(attn_norm(h))                    // its own KV cache, position p
//! h += moe(post_attention_norm(h))                // routed experts + (gated) shared one
//! h' = head_norm(h);  logits = head · h'
//! ```
//!
//! `h'` stands in for the main model's hidden state when the block drafts
//! further: the draft after `x_{p+1}` runs it at `p + 1` on `(x_{p+1}, h')`.
//! The block's KV cache must hold every earlier position's entry, so after
//! each pass of the main model its positions go through the block too (with
//! the true hidden states); entries a rejected draft wrote are overwritten then.

use super::super::config::{Hparams, HybridParams};
use super::super::ops::rms_norm;
use super::{
    compute_picks, embed, mix, route, router_config, Block, Experts, Ffn, ForwardError, KvCache,
    MatVec, Mixer, MoeFfn, Place, RecurrentState, RouterBiases, Scratch, TokenInput,
};
use crate::gemv::MatrixView;
use crate::router::Routing;

/// The weights of one nextn block.
#[derive(Clone, Copy, Debug)]
pub struct NextnBlock<'a> {
    /// A full-attention decoder layer with routed experts (its `ffn_norm` is
    /// `post_attention_norm`).
    pub block: Block<'a>,
    /// Projection of the normed embedding and hidden state, concatenated
    /// (`n_embd` x `2 n_embd`).
    pub eh_proj: MatrixView<'a>,
    /// RMSNorm weight of the token's embedding.
    pub enorm: &'a [f32],
    /// RMSNorm weight of the hidden state.
    pub hnorm: &'a [f32],
    /// Token embeddings (the block's own, else the model's).
    pub embedding: MatrixView<'a>,
    /// RMSNorm weight before the head (the block's own, else the output norm).
    pub head_norm: &'a [f32],
    /// The head (`n_vocab` x `n_embd`: the block's own, else the output).
    pub head: MatrixView<'a>,
}

/// The shape of a nextn block's KV cache: one attention layer.
pub fn cache_params(hy: &HybridParams) -> HybridParams {
    HybridParams {
        n_attn_layers: 1,
        linear: None,
        n_ffn_only_layers: 0,
        ..*hy
    }
}

/// Runs the block at position `pos` on `input` (the token `x_pos`, or an
/// embedding in its place) and `h_prev` (the main model's normed final hidden
/// state at `pos - 1`, or the block's own `h_out` when drafting further), with
/// its routed experts from `experts` as layer `layer`. Writes the normed hidden
/// state into `h_out` and, when given, the next-token logits (`n_vocab`).
/// `kv` is a one-layer cache ([`cache_params`]); `cat` holds `2 n_embd` floats.
#[allow(clippy::too_many_arguments)]
pub fn forward_nextn<M: MatVec, X: Experts>(
    hp: &Hparams,
    hy: &HybridParams,
    w: &NextnBlock<'_>,
    layer: usize,
    mv: &mut M,
    experts: &mut X,
    input: TokenInput<'_>,
    h_prev: &[f32],
    pos: usize,
    kv: &mut KvCache<'_>,
    s: &mut Scratch<'_>,
    cat: &mut [f32],
    h_out: &mut [f32],
    logits: Option<&mut [f32]>,
) -> Result<(), ForwardError<X::Error>> {
    let at = Place::text(pos);
    forward_nextn_at(
        hp, hy, w, layer, mv, experts, input, h_prev, at, kv, s, cat, h_out, logits,
    )
}

/// [`forward_nextn`] at an explicit [`Place`] (the main model's M-RoPE
/// positions where they are not the cache index: after an image).
#[allow(clippy::too_many_arguments)]
pub fn forward_nextn_at<M: MatVec, X: Experts>(
    hp: &Hparams,
    hy: &HybridParams,
    w: &NextnBlock<'_>,
    layer: usize,
    mv: &mut M,
    experts: &mut X,
    input: TokenInput<'_>,
    h_prev: &[f32],
    at: Place,
    kv: &mut KvCache<'_>,
    s: &mut Scratch<'_>,
    cat: &mut [f32],
    h_out: &mut [f32],
    logits: Option<&mut [f32]>,
) -> Result<(), ForwardError<X::Error>> {
    let pos = at.index;
    let e = hp.n_embd;
    if pos >= kv.max_positions() {
        return Err(ForwardError::ContextFull(kv.max_positions()));
    }
    if h_prev.len() != e || h_out.len() != e || cat.len() != 2 * e || s.h.len() != e {
        return Err(ForwardError::Shape("nextn buffers"));
    }
    if !matches!(w.block.mixer, Mixer::Attention(_) | Mixer::Mla(_)) {
        return Err(ForwardError::Shape("a nextn block without attention"));
    }
    let Ffn::Moe {
        router,
        shared,
        router_bias,
        selection_bias,
        expert_bias,
    } = w.block.ffn
    else {
        return Err(ForwardError::Shape("a nextn block without routed experts"));
    };
    let rc = router_config::<X::Error>(hp)?
        .ok_or(ForwardError::Shape("a nextn block without MoE parameters"))?;
    embed(&w.embedding, input, 0, s.h)?;
    let (ce, ch) = cat.split_at_mut(e);
    rms_norm(s.h, w.enorm, hp.norm_eps, ce);
    rms_norm(h_prev, w.hnorm, hp.norm_eps, ch);
    mv.matvec(&w.eh_proj, cat, s.h)?;

    let hy1 = cache_params(hy);
    mix(
        hp,
        &hy1,
        &w.block,
        mv,
        s,
        kv,
        &mut RecurrentState::empty(),
        (&mut 0, &mut 0),
        at,
    )?;
    rms_norm(s.h, w.block.ffn_norm, hp.norm_eps, s.x);
    let mut routing = Routing::new();
    let biases = RouterBiases {
        logits: router_bias,
        selection: selection_bias,
    };
    route(layer, &router, biases, &rc, mv, s, experts, &mut routing)?;
    let ffn = MoeFfn {
        shared: shared.as_ref(),
        expert_bias: expert_bias.as_ref(),
    };
    compute_picks(hp, mv, s, experts, &routing, ffn)?;

    rms_norm(s.h, w.head_norm, hp.norm_eps, h_out);
    if let Some(logits) = logits {
        if logits.len() != hp.n_vocab {
            return Err(ForwardError::Shape("logits length"));
        }
        mv.matvec(&w.head, h_out, logits)?;
    }
    Ok(())
}
