//! The gated short convolution of Liquid AI's LFM2 models (llama.cpp's
//! `lfm2` and `lfm2moe` "shortconv" layers), one token at a time over
//! caller-owned state.
//!
//! Per token, with `u` the normed hidden state and `d = n_embd` channels:
//! 1. `[b, c, x] = W_in u` (`3d` rows: `b`, then `c`, then `x`).
//! 2. `bx = b * x`, element by element.
//! 3. A causal depthwise convolution of width `K` over the last `K` `bx`
//!    vectors (the previous `K - 1` live in the convolution state), no bias,
//!    no activation.
//! 4. `y = c * conv`, element by element; `W_out y` is the layer's output.
//!
//! The convolution sums its taps oldest first from zero, a multiply then an
//! add per tap (ggml's `ssm_conv`). Prompt tokens go through the same
//! recurrence as generated ones.

use super::config::ShortConvShape;
use crate::gemv::MatrixView;

/// The weights of one short-convolution layer (llama.cpp tensor names in
/// brackets).
#[derive(Clone, Copy, Debug)]
pub struct ShortConvWeights<'a> {
    /// The layer's shape.
    pub shape: ShortConvShape,
    /// Input projection, `3 channels x n_embd` (`shortconv.in_proj`).
    pub in_proj: MatrixView<'a>,
    /// Convolution kernel, `kernel` taps per channel, channel-major
    /// (`shortconv.conv`).
    pub conv: &'a [f32],
    /// Output projection, `n_embd x channels` (`shortconv.out_proj`).
    pub out: MatrixView<'a>,
}

impl ShortConvWeights<'_> {
    /// Checks the weights fit their shape and `n_embd`.
    pub fn check(&self, n_embd: usize) -> Result<(), &'static str> {
        let s = &self.shape;
        s.validate()?;
        let ch = s.channels;
        let ok = self.in_proj.rows() == 3 * ch
            && self.in_proj.cols() == n_embd
            && self.conv.len() == ch * s.kernel
            && self.out.rows() == n_embd
            && self.out.cols() == ch;
        if ok {
            Ok(())
        } else {
            Err("short-convolution weights do not match their shape")
        }
    }
}

/// Runs one token through the gated convolution, updating `conv_state`
/// (`shape.conv_state_len()`), from `bcx` (`W_in u`, `3 channels`), and
/// writes `c * conv(b * x)` (`channels`, the input of `W_out`) into `out`.
pub fn step(w: &ShortConvWeights<'_>, bcx: &[f32], conv_state: &mut [f32], out: &mut [f32]) {
    let s = &w.shape;
    let (ch, taps) = (s.channels, s.kernel);
    assert!(
        bcx.len() == 3 * ch && conv_state.len() == s.conv_state_len() && out.len() == ch,
        "shortconv::step: bad lengths"
    );
    let (b, rest) = bcx.split_at(ch);
    let (c, x) = rest.split_at(ch);
    for (((o, kernel), st), ((&b, &c), &x)) in out
        .iter_mut()
        .zip(w.conv.chunks_exact(taps))
        .zip(conv_state.chunks_exact_mut(taps - 1))
        .zip(b.iter().zip(c).zip(x))
    {
        let bx = b * x;
        let mut sum = 0f32;
        for (v, k) in st.iter().zip(kernel) {
            sum += v * k;
        }
        sum += bx * kernel[taps - 1];
        st.copy_within(1.., 0);
        st[taps - 2] = bx;
        *o = c * sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use std::vec;
    use std::vec::Vec;

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

    const SHAPE: ShortConvShape = ShortConvShape {
        channels: 6,
        kernel: 3,
    };

    /// Weights of [`SHAPE`] over `n_embd = channels` (the projections are
    /// not used by `step`; they only need the right shapes).
    fn weights<'a>(conv: &'a [f32], proj: &'a [u8], out: &'a [u8]) -> ShortConvWeights<'a> {
        let ch = SHAPE.channels;
        ShortConvWeights {
            shape: SHAPE,
            in_proj: MatrixView::new(GgmlType::F32, 3 * ch, ch, proj).unwrap(),
            conv,
            out: MatrixView::new(GgmlType::F32, ch, ch, out).unwrap(),
        }
    }

    /// Each step is the gated convolution spelled out over the whole
    /// history (zeros before the first token), in f64: the state carries
    /// exactly the last `K - 1` gated inputs.
    #[test]
    fn steps_equal_the_convolution_over_the_history() {
        let ch = SHAPE.channels;
        let conv = vals(ch * SHAPE.kernel, 1);
        let (proj, outw) = (vec![0u8; 3 * ch * ch * 4], vec![0u8; ch * ch * 4]);
        let w = weights(&conv, &proj, &outw);
        assert_eq!(w.check(ch), Ok(()));
        let mut state = vec![0f32; SHAPE.conv_state_len()];
        let mut history: Vec<Vec<f64>> = Vec::new();
        for t in 0..7u32 {
            let bcx = vals(3 * ch, 10 + t);
            let mut out = vec![0f32; ch];
            step(&w, &bcx, &mut state, &mut out);
            history.push((0..ch).map(|i| (bcx[i] * bcx[2 * ch + i]) as f64).collect());
            for i in 0..ch {
                let mut want = 0f64;
                for k in 0..SHAPE.kernel {
                    // Tap k sees the input K - 1 - k tokens back.
                    let back = SHAPE.kernel - 1 - k;
                    if let Some(h) = (t as usize).checked_sub(back).map(|j| &history[j]) {
                        want += h[i] * conv[i * SHAPE.kernel + k] as f64;
                    }
                }
                want *= bcx[ch + i] as f64;
                assert!(
                    (out[i] as f64 - want).abs() < 1e-5,
                    "token {t} channel {i}: {} vs {want}",
                    out[i]
                );
            }
        }
    }

    /// The arithmetic is ggml's, operation for operation: taps oldest first
    /// from zero, each a multiply then an add, then the gate.
    #[test]
    fn step_rounds_as_ggml_ssm_conv() {
        let ch = SHAPE.channels;
        let conv = vals(ch * SHAPE.kernel, 2);
        let (proj, outw) = (vec![0u8; 3 * ch * ch * 4], vec![0u8; ch * ch * 4]);
        let w = weights(&conv, &proj, &outw);
        let mut state = vals(SHAPE.conv_state_len(), 3);
        let before = state.clone();
        let bcx = vals(3 * ch, 4);
        let mut out = vec![0f32; ch];
        step(&w, &bcx, &mut state, &mut out);
        for i in 0..ch {
            let bx = bcx[i] * bcx[2 * ch + i];
            let window = [before[2 * i], before[2 * i + 1], bx];
            let mut sum = 0f32;
            for (v, k) in window.iter().zip(&conv[3 * i..3 * i + 3]) {
                let p = v * k;
                sum += p;
            }
            assert_eq!(
                out[i].to_bits(),
                (bcx[ch + i] * sum).to_bits(),
                "channel {i}"
            );
            assert_eq!(&state[2 * i..2 * i + 2], &[before[2 * i + 1], bx]);
        }
    }

    #[test]
    fn mismatched_weights_are_refused() {
        let ch = SHAPE.channels;
        let conv = vals(ch * SHAPE.kernel - 1, 1);
        let (proj, outw) = (vec![0u8; 3 * ch * ch * 4], vec![0u8; ch * ch * 4]);
        assert!(weights(&conv, &proj, &outw).check(ch).is_err());
        let conv = vals(ch * SHAPE.kernel, 1);
        assert!(weights(&conv, &proj, &outw).check(ch + 1).is_err());
        let bad = ShortConvWeights {
            shape: ShortConvShape {
                channels: ch,
                kernel: 1,
            },
            ..weights(&conv, &proj, &outw)
        };
        assert!(bad.check(ch).is_err());
    }
}
