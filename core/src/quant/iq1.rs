//! ggml's 1-bit lattice formats `IQ1_S` and `IQ1_M`: each group of 8
//! elements is a point of [`IQ1S_GRID`] (elements -1, 0, 1) shifted by
//! ±1/8, times a step `d * (2s + 1)` of a 3-bit scale `s` per 32 (`IQ1_S`)
//! or 16 elements (`IQ1_M`, whose f16 `d` is spread over its scale words).
//! Dequantization is bit-identical to ggml's `dequantize_row_iq1_*` and the
//! `gguf` Python package.

use super::blocks::{BlockIQ1M, BlockIQ1S};
use super::iq2::{check_len, grid_byte, h2f, le16};
use super::iq_grids::IQ1S_GRID;
use super::{f16_to_f32, QK_K};

/// The shift of a group: `IQ1S_DELTA` in ggml.
pub const IQ1_DELTA: f32 = 0.125;

/// Writes `y[j] = step * (grid[j] + delta)` for the 8 elements of a point.
#[inline]
fn put_shifted(grid: u64, delta: f32, step: f32, y: &mut [f32]) {
    for (j, v) in y.iter_mut().enumerate().take(8) {
        *v = step * (grid_byte(grid, j) as i8 as f32 + delta);
    }
}

/// Sub-block `ib`'s `u16` word of an `IQ1_S` block: index high bits (3 per
/// group), the scale (bits 12..15) and the shift's sign (bit 15).
#[inline(always)]
pub(crate) fn iq1s_qh(b: &BlockIQ1S, ib: usize) -> u16 {
    le16(&b.qh, 2 * ib)
}

/// Sub-block `ib`'s odd scale `2s + 1` of an `IQ1_S` block, and whether its
/// shift is negative.
#[inline(always)]
pub(crate) fn iq1s_scale_shift(b: &BlockIQ1S, ib: usize) -> (i32, bool) {
    let qh = iq1s_qh(b, ib);
    (2 * ((qh >> 12) & 7) as i32 + 1, qh & 0x8000 != 0)
}

/// The 11-bit grid index of group `l` (0..4) of sub-block `ib` of an `IQ1_S` block.
#[inline(always)]
pub(crate) fn iq1s_index(b: &BlockIQ1S, ib: usize, l: usize) -> usize {
    b.qs[4 * ib + l] as usize | ((iq1s_qh(b, ib) as usize >> (3 * l)) & 7) << 8
}

/// Dequantizes `IQ1_S` super-blocks (256 elements each) into `out`.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_iq1s(blocks: &[BlockIQ1S], out: &mut [f32]) {
    check_len("dequantize_iq1s", blocks.len(), out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let (ls, negative) = iq1s_scale_shift(b, ib);
            let dl = d * ls as f32;
            let delta = if negative { -IQ1_DELTA } else { IQ1_DELTA };
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                put_shifted(IQ1S_GRID[iq1s_index(b, ib, l)], delta, dl, y);
            }
        }
    }
}

/// The four `u16` scale words of an `IQ1_M` block.
#[inline(always)]
pub(crate) fn iq1m_words(b: &BlockIQ1M) -> [u16; 4] {
    core::array::from_fn(|i| le16(&b.scales, 2 * i))
}

/// An `IQ1_M` block's f16 scale, gathered from the top nibbles of its words.
#[inline(always)]
pub(crate) fn iq1m_d(sc: [u16; 4]) -> f32 {
    f16_to_f32((sc[0] >> 12) | (sc[1] >> 8) & 0x00f0 | (sc[2] >> 4) & 0x0f00 | sc[3] & 0xf000)
}

/// The odd scales `2s + 1` of the two halves of sub-block `ib` of an `IQ1_M` block.
#[inline(always)]
pub(crate) fn iq1m_scales(sc: [u16; 4], ib: usize) -> [i32; 2] {
    let w = sc[ib / 2] >> (6 * (ib % 2));
    [2 * (w & 7) as i32 + 1, 2 * ((w >> 3) & 7) as i32 + 1]
}

/// Group `l`'s (0..4) 11-bit grid index of sub-block `ib` of an `IQ1_M`
/// block, and whether its shift is negative.
#[inline(always)]
pub(crate) fn iq1m_group(b: &BlockIQ1M, ib: usize, l: usize) -> (usize, bool) {
    let nibble = (b.qh[2 * ib + l / 2] >> (4 * (l % 2))) & 15;
    (
        b.qs[4 * ib + l] as usize | ((nibble & 7) as usize) << 8,
        nibble & 8 != 0,
    )
}

/// Dequantizes `IQ1_M` super-blocks (256 elements each) into `out`.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_iq1m(blocks: &[BlockIQ1M], out: &mut [f32]) {
    check_len("dequantize_iq1m", blocks.len(), out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let sc = iq1m_words(b);
        let d = iq1m_d(sc);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let ls = iq1m_scales(sc, ib);
            let dl = [d * ls[0] as f32, d * ls[1] as f32];
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let (index, negative) = iq1m_group(b, ib, l);
                let delta = if negative { -IQ1_DELTA } else { IQ1_DELTA };
                put_shifted(IQ1S_GRID[index], delta, dl[l / 2], y);
            }
        }
    }
}
