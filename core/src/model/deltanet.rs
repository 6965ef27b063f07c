//! Gated DeltaNet, the linear-attention layer of hybrid models (qwen3next,
//! qwen35, qwen35moe), one token at a time over caller-owned state.
//!
//! Per token, with `x` the normed hidden state:
//! 1. `qkv = W_qkv x`, `z = W_gate x`, `beta = sigmoid(W_beta x)`,
//!    `g = softplus(W_alpha x + dt_bias) * a` (one `beta` and `g` per value head;
//!    `a = -exp(A_log)`, stored that way by llama.cpp's converter).
//! 2. A causal depthwise convolution of width `K` over the last `K` `qkv` vectors
//!    (the previous `K - 1` live in the convolution state), then SiLU.
//! 3. `q`, `k`, `v` split from it; `q` and `k` L2-normalised per head.
//! 4. Per value head `h` (key head [`DeltaNetShape::key_head`]), with its state matrix `S`
//!    (`S[i][j]`, `i` over key and `j` over value dimensions):
//!    `S *= exp(g)`, `d = (v - S^T k) * beta`, `S += k d^T`,
//!    `o = S^T q / sqrt(head_dim)` (the delta rule).
//! 5. `o` RMS-normalised per head (weight `ssm_norm`) times `silu(z)`, then
//!    `W_out o` is the layer's output.
//!
//! The state matrix is stored as ggml keeps it, transposed: row `j` holds
//! `S[.][j]`, so every product walks contiguous memory. Prompt tokens go through
//! the same per-token recurrence as generated ones (llama.cpp's chunked prefill
//! computes the same recurrence in another order).

use libm::expf;

use super::config::DeltaNetShape;
use super::forward::MatVec;
use super::ops::{l2_norm_heads, rms_norm_heads, sigmoid, silu, softplus};
use crate::gemv::{vector, Isa, MatrixView};

/// The weights of one gated DeltaNet layer (llama.cpp tensor names in brackets).
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetWeights<'a> {
    /// The layer's shape.
    pub shape: DeltaNetShape,
    /// Query, key and value projection, `conv_dim x n_embd` (`attn_qkv`).
    pub qkv: MatrixView<'a>,
    /// Output gate projection `z`, `value_dim x n_embd` (`attn_gate`).
    pub gate: MatrixView<'a>,
    /// Update strength projection, `n_v_heads x n_embd` (`ssm_beta`).
    pub beta: MatrixView<'a>,
    /// Decay projection, `n_v_heads x n_embd` (`ssm_alpha`).
    pub alpha: MatrixView<'a>,
    /// Decay bias, `n_v_heads` (`ssm_dt.bias`).
    pub dt_bias: &'a [f32],
    /// Decay rate `-exp(A_log)`, `n_v_heads` (`ssm_a`).
    pub a: &'a [f32],
    /// Convolution kernel, `conv_kernel` taps per channel, channel-major
    /// (`ssm_conv1d`).
    pub conv: &'a [f32],
    /// Output RMSNorm weight, `head_dim` (`ssm_norm`).
    pub norm: &'a [f32],
    /// Output projection, `n_embd x value_dim` (`ssm_out`).
    pub out: MatrixView<'a>,
}

impl DeltaNetWeights<'_> {
    /// Checks the weights fit their shape and `n_embd`.
    pub fn check(&self, n_embd: usize) -> Result<(), &'static str> {
        let s = &self.shape;
        s.validate()?;
        let (nv, vd) = (s.n_v_heads, s.value_dim());
        let ok = self.qkv.rows() == s.conv_dim()
            && self.qkv.cols() == n_embd
            && self.gate.rows() == vd
            && self.gate.cols() == n_embd
            && self.beta.rows() == nv
            && self.beta.cols() == n_embd
            && self.alpha.rows() == nv
            && self.alpha.cols() == n_embd
            && self.dt_bias.len() == nv
            && self.a.len() == nv
            && self.conv.len() == s.conv_dim() * s.conv_kernel
            && self.norm.len() == s.head_dim
            && self.out.rows() == n_embd
            && self.out.cols() == vd;
        if ok {
            Ok(())
        } else {
            Err("DeltaNet weights do not match the DeltaNet shape")
        }
    }
}

/// One token's projections, computed by the caller (they are matrix products).
pub struct Projections<'b> {
    /// `W_qkv x` (`conv_dim`); replaced by the convolved, activated, normalised
    /// `q`, `k`, `v`.
    pub qkv: &'b mut [f32],
    /// `W_gate x` (`value_dim`).
    pub z: &'b [f32],
    /// `W_beta x` (`n_v_heads`).
    pub beta: &'b [f32],
    /// `W_alpha x` (`n_v_heads`).
    pub alpha: &'b [f32],
}

/// Runs one token through the convolution and the recurrence, updating
/// `conv_state` (`shape.conv_state_len()`) and `ssm_state`
/// (`shape.ssm_state_len()`), and writes the gated, normalised output
/// (`value_dim`, the input of `W_out`) into `out`. The recurrence runs
/// through [`vector::delta_rule`], one pass over each head's state with the
/// CPU's vector kernels (the same bits on every ISA).
pub fn step<M: MatVec + ?Sized>(
    mv: &mut M,
    w: &DeltaNetWeights<'_>,
    p: Projections<'_>,
    eps: f32,
    conv_state: &mut [f32],
    ssm_state: &mut [f32],
    out: &mut [f32],
) {
    let s = &w.shape;
    let (hd, nv, kd) = (s.head_dim, s.n_v_heads, s.key_dim());
    let taps = s.conv_kernel;
    assert!(
        p.qkv.len() == s.conv_dim()
            && p.z.len() == s.value_dim()
            && p.beta.len() == nv
            && p.alpha.len() == nv
            && conv_state.len() == s.conv_state_len()
            && ssm_state.len() == s.ssm_state_len()
            && out.len() == s.value_dim(),
        "deltanet::step: bad lengths"
    );

    // Causal convolution: window = [state (K-1 oldest first), this token].
    for ((x, kernel), st) in p
        .qkv
        .iter_mut()
        .zip(w.conv.chunks_exact(taps))
        .zip(conv_state.chunks_exact_mut(taps - 1))
    {
        let mut sum = 0f32;
        for (v, c) in st.iter().zip(kernel) {
            sum += v * c;
        }
        sum += *x * kernel[taps - 1];
        st.copy_within(1.., 0);
        st[taps - 2] = *x;
        *x = sum;
    }
    let isa = Isa::detect();
    vector::silu(isa, p.qkv);
    let (q, rest) = p.qkv.split_at_mut(kd);
    let (k, v) = rest.split_at_mut(kd);
    l2_norm_heads(q, hd, eps);
    l2_norm_heads(k, hd, eps);

    let scale = 1.0 / libm::sqrtf(hd as f32);
    let (q, k, v) = (&*q, &*k, &*v);
    let (alpha, beta) = (p.alpha, p.beta);
    // Each head reads only shared inputs and writes only its own state and
    // output: `for_heads` may spread the heads over threads.
    mv.for_heads(nv, ssm_state, out, &|h, m, oh| {
        let kh = s.key_head(h);
        let (qh, khv) = (&q[kh * hd..][..hd], &k[kh * hd..][..hd]);
        let vh = &v[h * hd..][..hd];
        let g = softplus(alpha[h] + w.dt_bias[h]) * w.a[h];
        let b = sigmoid(beta[h]);
        let decay = expf(g);
        vector::delta_rule(isa, m, khv, qh, vh, decay, b, scale, oh);
    });

    // Gated RMSNorm: norm(o) * silu(z), per value head.
    rms_norm_heads(out, w.norm, eps);
    for (o, z) in out.iter_mut().zip(p.z) {
        *o *= silu(*z);
    }
}
