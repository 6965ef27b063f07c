//! ggml's 2-bit lattice formats `IQ2_XXS`, `IQ2_XS` and `IQ2_S`: each group
//! of 8 elements is a point of a grid ([`super::iq_grids`]) of magnitudes 8,
//! 25 and 43, with a sign per element; a 4-bit scale `s` per 16 or 32
//! elements makes the step `d * (0.5 + s) / 4`, and the magnitudes carry a
//! further factor 8 (the dot products scale by 1/8 at the end).
//!
//! `IQ2_XXS` and `IQ2_XS` store 7 signs per group and the eighth as their
//! parity ([`KSIGNS`]); `IQ2_S` stores all 8. Dequantization is bit-identical
//! to ggml's `dequantize_row_iq2_*` and the `gguf` Python package.

use super::blocks::{BlockIQ2S, BlockIQ2XS, BlockIQ2XXS};
use super::iq_grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID};
use super::{f16_to_f32, QK_K};

/// ggml's `ksigns_iq2xs`: a 7-bit sign pattern (bit `j` set: element `j`
/// negative) completed with an eighth bit that makes the count of negative
/// elements even.
pub const KSIGNS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = i as u8 | (((i as u8).count_ones() & 1) as u8) << 7;
        i += 1;
    }
    t
};

/// The parity-completed sign pattern of group `l` (0..4) of an `IQ2_XXS` or
/// `IQ3_XXS` signs-and-scale word (bits `7l..7l + 7`).
#[inline(always)]
pub(crate) fn ksign(aux: u32, l: usize) -> u8 {
    KSIGNS[(aux >> (7 * l)) as usize & 127]
}

/// The odd multiplier `2s + 1` of a signs-and-scale word's 4-bit scale `s`
/// (its top bits), as the dot products apply it.
#[inline(always)]
pub(crate) fn word_scale(aux: u32) -> i32 {
    2 * (aux >> 28) as i32 + 1
}

/// The odd multipliers `2s + 1` of a byte of two 4-bit scales (`IQ2_XS`,
/// `IQ2_S`: a sub-block's halves, low nibble first).
#[inline(always)]
pub(crate) fn scale_pair(sc: u8) -> [i32; 2] {
    let sc = sc as i32;
    [2 * (sc & 15) + 1, 2 * (sc >> 4) + 1]
}

#[inline]
pub(crate) fn h2f(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

/// Element `j` of the 8-element point `grid` (byte `j`), as an integer.
#[inline(always)]
pub(crate) fn grid_byte(grid: u64, j: usize) -> u8 {
    (grid >> (8 * j)) as u8
}

/// Writes `y[j] = ±(step * grid[j])` for the 8 elements of a point, minus
/// where bit `j` of `signs` is set (ggml's `db * grid[j] * (±1.f)`).
#[inline]
pub(crate) fn put_signed(grid: u64, signs: u8, step: f32, y: &mut [f32]) {
    for (j, v) in y.iter_mut().enumerate().take(8) {
        let p = step * grid_byte(grid, j) as f32;
        *v = if signs >> j & 1 != 0 { -p } else { p };
    }
}

/// The step of a 4-bit scale `s`: `d * (0.5 + s) * 0.25`, rounded as ggml does.
#[inline]
fn step(d: f32, s: u32) -> f32 {
    d * (0.5 + s as f32) * 0.25
}

/// Little-endian `u32` at byte `at`.
#[inline(always)]
pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Little-endian `u16` at byte `at`.
#[inline(always)]
pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Panics unless `out` holds 256 values for each of `blocks` blocks.
pub(crate) fn check_len(name: &str, blocks: usize, out: usize) {
    assert!(
        blocks.checked_mul(QK_K) == Some(out),
        "{name}: out.len() ({out}) must be blocks.len() * 256 ({blocks} blocks)"
    );
}

/// Dequantizes `IQ2_XXS` super-blocks (256 elements each) into `out`.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_iq2xxs(blocks: &[BlockIQ2XXS], out: &mut [f32]) {
    check_len("dequantize_iq2xxs", blocks.len(), out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        for (q, y) in b.qs.chunks_exact(8).zip(y.chunks_exact_mut(32)) {
            let aux = le32(q, 4);
            let db = step(d, aux >> 28);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                put_signed(IQ2XXS_GRID[q[l] as usize], ksign(aux, l), db, y);
            }
        }
    }
}

/// Writes a super-block of `IQ2_XS` or `IQ2_S`: sub-block `ib`'s halves
/// have the 4-bit scales of `scales[ib]` (low nibble first), and its group
/// `l` is `point(ib, l)`, a grid word and its signs.
#[inline]
fn put_two_scales(
    d: f32,
    scales: &[u8; 8],
    y: &mut [f32],
    point: impl Fn(usize, usize) -> (u64, u8),
) {
    for (ib, y) in y.chunks_exact_mut(32).enumerate() {
        let sc = scales[ib] as u32;
        let db = [step(d, sc & 15), step(d, sc >> 4)];
        for (l, y) in y.chunks_exact_mut(8).enumerate() {
            let (grid, signs) = point(ib, l);
            put_signed(grid, signs, db[l / 2], y);
        }
    }
}

/// Dequantizes `IQ2_XS` super-blocks (256 elements each) into `out`.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_iq2xs(blocks: &[BlockIQ2XS], out: &mut [f32]) {
    check_len("dequantize_iq2xs", blocks.len(), out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        put_two_scales(h2f(b.d), &b.scales, y, |ib, l| {
            let w = le16(&b.qs, 2 * (4 * ib + l));
            (IQ2XS_GRID[(w & 511) as usize], KSIGNS[(w >> 9) as usize])
        });
    }
}

/// The 10-bit grid index of group `l` (0..4) of sub-block `ib` of an `IQ2_S` block.
#[inline(always)]
pub(crate) fn iq2s_index(b: &BlockIQ2S, ib: usize, l: usize) -> usize {
    b.qs[4 * ib + l] as usize | ((b.qh[ib] as usize) << (8 - 2 * l) & 0x300)
}

/// Dequantizes `IQ2_S` super-blocks (256 elements each) into `out`.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_iq2s(blocks: &[BlockIQ2S], out: &mut [f32]) {
    check_len("dequantize_iq2s", blocks.len(), out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        put_two_scales(h2f(b.d), &b.scales, y, |ib, l| {
            (IQ2S_GRID[iq2s_index(b, ib, l)], b.qs[QK_K / 8 + 4 * ib + l])
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ksigns_are_ggmls() {
        // The first row of ggml's table, and its last entries.
        assert_eq!(
            KSIGNS[..16],
            [0, 129, 130, 3, 132, 5, 6, 135, 136, 9, 10, 139, 12, 141, 142, 15]
        );
        assert_eq!(KSIGNS[125..], [0x7d, 0x7e, 0xff]);
        assert!(KSIGNS.iter().all(|s| s.count_ones() % 2 == 0));
    }

    #[test]
    fn a_block_dequantizes_by_hand() {
        // IQ2_XXS, d = 1: sub-block 0 has scale 3 (step 0.875), grid points
        // 0 (all 8) and 1 (43, then seven 8s: element j is byte j), the first with sign pattern 1
        // (elements 0 and 7 negative), the second with none.
        let mut b = BlockIQ2XXS {
            d: 0x3c00u16.to_le_bytes(),
            qs: [0; 64],
        };
        b.qs[1] = 1;
        b.qs[4..8].copy_from_slice(&(3u32 << 28 | 1).to_le_bytes());
        let mut y = [0f32; 256];
        dequantize_iq2xxs(&[b], &mut y);
        let s = 0.875f32;
        assert_eq!(y[0], -8.0 * s);
        assert_eq!(y[1..7], [8.0 * s; 6]);
        assert_eq!(y[7], -8.0 * s);
        assert_eq!(y[8], 43.0 * s);
        assert_eq!(y[9..16], [8.0 * s; 7]);
        // Sub-block 1: scale 0 (step 0.125), grid point 0, no signs.
        assert_eq!(y[32..40], [1.0; 8]);
    }
}
