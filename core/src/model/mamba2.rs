//! Mamba2, the selective state-space layer of hybrid models (Granite 4.0-H,
//! llama.cpp's `granitehybrid`), one token at a time over caller-owned state.
//!
//! Per token, with `u` the normed hidden state and the shape's `d_inner`,
//! `d_state`, heads and groups:
//! 1. `[z, xBC, dt] = W_in u`.
//! 2. A causal depthwise convolution of width `K` over the last `K` `xBC`
//!    vectors (the previous `K - 1` live in the convolution state), plus its
//!    bias, then SiLU; `x`, `B` (`n_group x d_state`) and `C` split from it.
//! 3. Per head `h` (group `g`), `dt_h = softplus(dt_h + dt_bias_h)`,
//!    `dA = exp(dt_h A_h)`, and for each of the head's channels `i` with state
//!    row `s_i` (`d_state`): `s_i = s_i dA + B_g (x_i dt_h)`,
//!    `y_i = s_i . C_g + x_i D_h`.
//! 4. `y *= silu(z)`, RMS-normalised per group (weight `ssm_norm`), then
//!    `W_out y` is the layer's output.
//!
//! The operations and their rounding follow ggml's `ssm_conv` and `ssm_scan`
//! (scalar path: a multiply, then an add; never fused), except the dot
//! product `s_i . C_g`, which runs in [`vector::dot`]'s fixed order (ggml's
//! own depends on the ISA), and SiLU, with LES's own `exp` ([`vector::silu`]). Prompt tokens go through the same recurrence as
//! generated ones.

use libm::expf;

use super::config::Mamba2Shape;
use super::forward::MatVec;
use super::ops::{rms_norm_heads, softplus};
use crate::gemv::{vector, Isa, MatrixView};

/// The weights of one Mamba2 layer (llama.cpp tensor names in brackets).
#[derive(Clone, Copy, Debug)]
pub struct Mamba2Weights<'a> {
    /// The layer's shape.
    pub shape: Mamba2Shape,
    /// Input projection, `in_proj_dim x n_embd` (`ssm_in`).
    pub in_proj: MatrixView<'a>,
    /// Convolution kernel, `conv_kernel` taps per channel, channel-major
    /// (`ssm_conv1d.weight`).
    pub conv: &'a [f32],
    /// Convolution bias, `conv_dim` (`ssm_conv1d.bias`).
    pub conv_bias: Option<&'a [f32]>,
    /// Time step bias, `n_head` (`ssm_dt.bias`).
    pub dt_bias: &'a [f32],
    /// Decay rate `-exp(A_log)`, `n_head` (`ssm_a`).
    pub a: &'a [f32],
    /// Skip connection, `n_head` (`ssm_d`).
    pub d: &'a [f32],
    /// Grouped RMSNorm weight, `d_inner` (`ssm_norm`).
    pub norm: &'a [f32],
    /// Output projection, `n_embd x d_inner` (`ssm_out`).
    pub out: MatrixView<'a>,
}

impl Mamba2Weights<'_> {
    /// Checks the weights fit their shape and `n_embd`.
    pub fn check(&self, n_embd: usize) -> Result<(), &'static str> {
        let s = &self.shape;
        s.validate()?;
        let (nh, di, cd) = (s.n_head, s.d_inner, s.conv_dim());
        let ok = self.in_proj.rows() == s.in_proj_dim()
            && self.in_proj.cols() == n_embd
            && self.conv.len() == cd * s.conv_kernel
            && self.conv_bias.is_none_or(|b| b.len() == cd)
            && self.dt_bias.len() == nh
            && self.a.len() == nh
            && self.d.len() == nh
            && self.norm.len() == di
            && self.out.rows() == n_embd
            && self.out.cols() == di;
        if ok {
            Ok(())
        } else {
            Err("Mamba2 weights do not match the Mamba2 shape")
        }
    }
}

/// Runs one token through the convolution and the scan, updating
/// `conv_state` (`shape.conv_state_len()`) and `ssm_state`
/// (`shape.ssm_state_len()`), from `zxbcdt` (`W_in u`, `in_proj_dim`; its
/// `xBC` part is overwritten), and writes the gated, normalised output
/// (`d_inner`, the input of `W_out`) into `out`.
pub fn step<M: MatVec + ?Sized>(
    mv: &mut M,
    w: &Mamba2Weights<'_>,
    zxbcdt: &mut [f32],
    eps: f32,
    conv_state: &mut [f32],
    ssm_state: &mut [f32],
    out: &mut [f32],
) {
    let s = &w.shape;
    let (di, ds, nh, ng) = (s.d_inner, s.d_state, s.n_head, s.n_group);
    let taps = s.conv_kernel;
    assert!(
        zxbcdt.len() == s.in_proj_dim()
            && conv_state.len() == s.conv_state_len()
            && ssm_state.len() == s.ssm_state_len()
            && out.len() == di,
        "mamba2::step: bad lengths"
    );
    let (z, rest) = zxbcdt.split_at_mut(di);
    let (xbc, dt) = rest.split_at_mut(s.conv_dim());

    // Causal convolution: window = [state (K-1 oldest first), this token],
    // summed in order from 0 (ggml's `ssm_conv`), then the bias and SiLU.
    let isa = Isa::detect();
    for (c, ((x, kernel), st)) in xbc
        .iter_mut()
        .zip(w.conv.chunks_exact(taps))
        .zip(conv_state.chunks_exact_mut(taps - 1))
        .enumerate()
    {
        let mut sum = 0f32;
        for (v, k) in st.iter().zip(kernel) {
            sum += v * k;
        }
        sum += *x * kernel[taps - 1];
        st.copy_within(1.., 0);
        st[taps - 2] = *x;
        if let Some(b) = w.conv_bias {
            sum += b[c];
        }
        *x = sum;
    }
    vector::silu(isa, xbc);
    let (x, bc) = xbc.split_at(di);
    let (b, c) = bc.split_at(ng * ds);

    let hd = s.head_dim();
    let dt = &*dt;
    // Each head's scan reads only shared inputs and writes only its own
    // state rows and outputs: `for_heads` may spread the heads over threads.
    mv.for_heads(nh, ssm_state, out, &|h, rows, oh| {
        let dt_h = softplus(dt[h] + w.dt_bias[h]);
        let da = expf(dt_h * w.a[h]);
        let g = s.group(h);
        let (bg, cg) = (&b[g * ds..][..ds], &c[g * ds..][..ds]);
        for (i, (row, o)) in rows.chunks_exact_mut(ds).zip(oh.iter_mut()).enumerate() {
            let xi = x[h * hd + i];
            let x_dt = xi * dt_h;
            for (st, bv) in row.iter_mut().zip(bg) {
                *st = *st * da + *bv * x_dt;
            }
            let y = vector::dot(row, cg);
            *o = y + xi * w.d[h];
        }
    });

    // Gate, then RMSNorm per group (ggml: swiglu_split(z, y), then rms_norm
    // of each `d_inner / n_group` group times the weight).
    vector::swiglu(isa, z, out);
    out.copy_from_slice(z);
    let gw = di / ng;
    for (group, weight) in out.chunks_exact_mut(gw).zip(w.norm.chunks_exact(gw)) {
        rms_norm_heads(group, weight, eps);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::forward::SerialMatVec;
    use crate::model::ops::silu;
    use crate::quant::GgmlType;
    use std::vec;
    use std::vec::Vec;

    /// A [`MatVec`] for the heads only (no products: no activation scratch).
    fn serial() -> SerialMatVec<'static> {
        SerialMatVec {
            isa: Isa::detect(),
            q8_0: &mut [],
            q8_1: &mut [],
            q8k: &mut [],
        }
    }

    fn shape() -> Mamba2Shape {
        Mamba2Shape {
            d_inner: 8,
            d_state: 4,
            n_head: 4,
            n_group: 2,
            conv_kernel: 3,
        }
    }

    /// Deterministic small values.
    fn vals(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    struct Layer {
        conv: Vec<f32>,
        conv_bias: Vec<f32>,
        dt_bias: Vec<f32>,
        a: Vec<f32>,
        d: Vec<f32>,
        norm: Vec<f32>,
        proj: Vec<u8>,
    }

    fn layer(s: Mamba2Shape) -> Layer {
        Layer {
            conv: vals(s.conv_dim() * s.conv_kernel, 1),
            conv_bias: vals(s.conv_dim(), 2),
            dt_bias: vals(s.n_head, 3),
            a: vals(s.n_head, 4)
                .iter()
                .map(|v| -1.0 - 4.0 * v.abs())
                .collect(),
            d: vals(s.n_head, 5),
            norm: vals(s.d_inner, 6).iter().map(|v| 1.0 + v / 4.0).collect(),
            proj: Vec::new(),
        }
    }

    fn weights<'a>(s: Mamba2Shape, l: &'a Layer) -> Mamba2Weights<'a> {
        let m = |rows, cols| MatrixView::new(GgmlType::F32, rows, cols, &l.proj).unwrap();
        Mamba2Weights {
            shape: s,
            in_proj: m(0, 0),
            conv: &l.conv,
            conv_bias: Some(&l.conv_bias),
            dt_bias: &l.dt_bias,
            a: &l.a,
            d: &l.d,
            norm: &l.norm,
            out: m(0, 0),
        }
    }

    /// The recurrence written out from its definition over the whole
    /// sequence: the convolution over the zero-padded inputs, and the state
    /// of each channel as the decayed sum of its past inputs.
    fn reference(s: Mamba2Shape, l: &Layer, inputs: &[Vec<f32>], eps: f32) -> Vec<Vec<f32>> {
        let (di, ds, ng, k) = (s.d_inner, s.d_state, s.n_group, s.conv_kernel);
        let cd = s.conv_dim();
        let hd = s.head_dim();
        let mut state = vec![0f32; s.ssm_state_len()];
        let mut outs = Vec::new();
        for t in 0..inputs.len() {
            let p = &inputs[t];
            let mut xbc = vec![0f32; cd];
            for (ch, v) in xbc.iter_mut().enumerate() {
                let mut sum = 0f32;
                for tap in 0..k {
                    // Tap `tap` sees the input `k - 1 - tap` tokens back.
                    let back = k - 1 - tap;
                    let input = if t >= back {
                        inputs[t - back][di + ch]
                    } else {
                        0.0
                    };
                    sum += input * l.conv[ch * k + tap];
                }
                *v = silu(sum + l.conv_bias[ch]);
            }
            let mut y = vec![0f32; di];
            for h in 0..s.n_head {
                let dt = softplus(p[di + cd + h] + l.dt_bias[h]);
                let da = expf(dt * l.a[h]);
                let g = h / (s.n_head / ng);
                for i in 0..hd {
                    let c = h * hd + i;
                    for n in 0..ds {
                        let st = &mut state[c * ds + n];
                        *st = *st * da + xbc[di + g * ds + n] * (xbc[c] * dt);
                    }
                    y[c] = vector::dot(&state[c * ds..][..ds], &xbc[di + ng * ds + g * ds..][..ds])
                        + xbc[c] * l.d[h];
                }
            }
            for (v, z) in y.iter_mut().zip(&p[..di]) {
                *v *= silu(*z);
            }
            let gw = di / ng;
            for (grp, w) in y.chunks_exact_mut(gw).zip(l.norm.chunks_exact(gw)) {
                let ms: f64 =
                    grp.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / gw as f64;
                let sc = 1.0 / libm::sqrtf(ms as f32 + eps);
                for (v, w) in grp.iter_mut().zip(w) {
                    *v = (*v * sc) * w;
                }
            }
            outs.push(y);
        }
        outs
    }

    /// Each input through [`step`] in order from a zero state: every
    /// output, and the final recurrent state.
    fn steps(
        s: Mamba2Shape,
        w: &Mamba2Weights<'_>,
        inputs: &[Vec<f32>],
    ) -> (Vec<Vec<f32>>, Vec<f32>) {
        let mut conv = vec![0f32; s.conv_state_len()];
        let mut ssm = vec![0f32; s.ssm_state_len()];
        let outs = inputs
            .iter()
            .map(|input| {
                let mut p = input.clone();
                let mut out = vec![0f32; s.d_inner];
                step(
                    &mut serial(),
                    w,
                    &mut p,
                    1e-6,
                    &mut conv,
                    &mut ssm,
                    &mut out,
                );
                out
            })
            .collect();
        (outs, ssm)
    }

    #[test]
    fn steps_equal_the_recurrence_written_out() {
        let s = shape();
        let l = layer(s);
        let w = weights(s, &l);
        let inputs: Vec<Vec<f32>> = (0..7).map(|t| vals(s.in_proj_dim(), 100 + t)).collect();
        let want = reference(s, &l, &inputs, 1e-6);
        let (got, ssm) = steps(s, &w, &inputs);
        assert_eq!(got.len(), want.len());
        for (t, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "token {t}");
        }
        // The state moved, and every output is finite.
        assert!(ssm.iter().any(|v| *v != 0.0));
        assert!(want.iter().flatten().all(|v| v.is_finite()));
    }

    #[test]
    fn the_state_carries_the_past() {
        // The same last tokens after different histories give different
        // outputs: beyond the convolution's window (3 tokens), only the
        // state remembers the first token.
        let s = shape();
        let l = layer(s);
        let w = weights(s, &l);
        let run = |tokens: &[u32]| {
            let inputs: Vec<Vec<f32>> = tokens.iter().map(|&t| vals(s.in_proj_dim(), t)).collect();
            steps(s, &w, &inputs).0.pop().unwrap()
        };
        assert_ne!(run(&[1, 2, 3, 6, 7]), run(&[4, 2, 3, 6, 7]));
        assert_ne!(run(&[1, 5, 3]), run(&[1, 2, 3]));
        assert_eq!(run(&[1, 2, 3, 6, 7]), run(&[1, 2, 3, 6, 7]));
    }

    #[test]
    fn check_names_mismatched_weights() {
        let s = shape();
        let l = layer(s);
        let w = weights(s, &l);
        // The zero-sized projections do not fit.
        assert!(w.check(4).is_err());
        let bad = Mamba2Shape { n_group: 3, ..s };
        assert!(bad.validate().is_err());
        assert!(Mamba2Shape { d_inner: 9, ..s }.validate().is_err());
        assert!(Mamba2Shape {
            conv_kernel: 1,
            ..s
        }
        .validate()
        .is_err());
        assert!(s.validate().is_ok());
        assert_eq!(s.group(0), 0);
        assert_eq!(s.group(1), 0);
        assert_eq!(s.group(2), 1);
        assert_eq!(s.in_proj_dim(), 8 + 8 + 2 * 2 * 4 + 4);
    }
}
