//! ggml's 3-bit lattice formats `IQ3_XXS` and `IQ3_S`: each group of 4
//! elements is a point of a grid ([`super::iq_grids`]), with a sign per
//! element. `IQ3_XXS` keeps [`BlockIQ2XXS`](super::blocks::BlockIQ2XXS)'s
//! parity-completed sign patterns and scale words (step `d * (0.5 + s) / 2`,
//! odd multiples of 2 in the grid); `IQ3_S` stores 9-bit indices, every sign,
//! and a step `d * (1 + 2s)` per 32 elements over odd magnitudes 1..15.
//! Dequantization is bit-identical to ggml's `dequantize_row_iq3_*` and the
//! `gguf` Python package.

use super::blocks::{BlockIQ3S, BlockIQ3XXS};
use super::iq2::{check_len, h2f, ksign, le32, put_signed};
use super::iq_grids::{IQ3S_GRID, IQ3XXS_GRID};
use super::QK_K;

/// Two 4-element points as one 8-element word (`a` first).
#[inline(always)]
pub(crate) fn pair(a: u32, b: u32) -> u64 {
    a as u64 | (b as u64) << 32
}

/// The two 9-bit grid indices of group `l` (0..4) of sub-block `ib` of an
/// `IQ3_S` block.
#[inline(always)]
pub(crate) fn iq3s_indices(b: &BlockIQ3S, ib: usize, l: usize) -> (usize, usize) {
    let qs = &b.qs[8 * ib..];
    let qh = b.qh[ib] as usize;
    (
        qs[2 * l] as usize | (qh << (8 - 2 * l) & 256),
        qs[2 * l + 1] as usize | (qh << (7 - 2 * l) & 256),
    )
}

/// The odd scale `1 + 2s` of sub-block `ib` of an `IQ3_S` block.
#[inline(always)]
pub(crate) fn iq3s_scale(b: &BlockIQ3S, ib: usize) -> u32 {
    1 + 2 * ((b.scales[ib / 2] >> (4 * (ib % 2))) & 15) as u32
}

/// Dequantizes `IQ3_XXS` super-blocks (256 elements each) into `out`.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_iq3xxs(blocks: &[BlockIQ3XXS], out: &mut [f32]) {
    check_len("dequantize_iq3xxs", blocks.len(), out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let aux = le32(&b.qs, QK_K / 4 + 4 * ib);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            let q = &b.qs[8 * ib..8 * ib + 8];
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let g = pair(
                    IQ3XXS_GRID[q[2 * l] as usize],
                    IQ3XXS_GRID[q[2 * l + 1] as usize],
                );
                put_signed(g, ksign(aux, l), db, y);
            }
        }
    }
}

/// Dequantizes `IQ3_S` super-blocks (256 elements each) into `out`.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_iq3s(blocks: &[BlockIQ3S], out: &mut [f32]) {
    check_len("dequantize_iq3s", blocks.len(), out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let db = d * iq3s_scale(b, ib) as f32;
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let (i1, i2) = iq3s_indices(b, ib, l);
                let g = pair(IQ3S_GRID[i1], IQ3S_GRID[i2]);
                put_signed(g, b.signs[4 * ib + l], db, y);
            }
        }
    }
}
