//! Block structs of the ggml formats, laid out exactly as `ggml-common.h`.
//!
//! Every struct is `#[repr(C)]` with only byte-array fields, so it has alignment 1,
//! no padding, and every bit pattern is valid. That makes [`as_blocks`] a sound
//! zero-copy view of any byte slice whose length is a multiple of the block size:
//! the one place in this crate where bytes become typed blocks.
#![allow(unsafe_code)] // `as_blocks` / `as_blocks_mut` only; see the SAFETY comments.

use core::mem::{align_of, size_of};
use static_assertions::const_assert_eq;

use super::QK_K;

/// Elements per block of the 32-element formats.
pub const QK: usize = 32;

/// `Q4_0`: `d * (q - 8)`, q a 4-bit nibble.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale (f16 bits, little-endian).
    pub d: [u8; 2],
    /// Element j in the low nibble of byte j, element j+16 in its high nibble.
    pub qs: [u8; QK / 2],
}

/// `Q4_1`: `d * q + m`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Minimum (f16).
    pub m: [u8; 2],
    /// Nibbles, as in [`BlockQ4_0`].
    pub qs: [u8; QK / 2],
}

/// `Q5_0`: `d * (q - 16)`, q a 5-bit value whose top bit lives in `qh`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Fifth bits, a little-endian u32: bit j belongs to element j.
    pub qh: [u8; 4],
    /// Low four bits, as in [`BlockQ4_0`].
    pub qs: [u8; QK / 2],
}

/// `Q5_1`: `d * q + m` with 5-bit q.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ5_1 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Minimum (f16).
    pub m: [u8; 2],
    /// Fifth bits (u32 LE).
    pub qh: [u8; 4],
    /// Low four bits.
    pub qs: [u8; QK / 2],
}

/// `Q8_0`: `d * q`, q an i8. Also the activation format for 32-element weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Quants.
    pub qs: [i8; QK],
}

/// `Q8_1`: activation format paired with `Q4_1`/`Q5_1`; `s = d * sum(qs)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_1 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// `d * sum(qs)` (f16).
    pub s: [u8; 2],
    /// Quants.
    pub qs: [i8; QK],
}

/// `Q2_K`: 16 sub-blocks of 16, 4-bit scale and min per sub-block, 2-bit quants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ2K {
    /// Low nibble scale, high nibble min, per sub-block.
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale of the scales (f16).
    pub d: [u8; 2],
    /// Super-block scale of the mins (f16).
    pub dmin: [u8; 2],
}

/// `Q3_K`: 16 sub-blocks of 16, 6-bit scales, 3-bit quants (high bit in `hmask`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ3K {
    /// High bits of the quants.
    pub hmask: [u8; QK_K / 8],
    /// Low two bits of the quants.
    pub qs: [u8; QK_K / 4],
    /// Sixteen packed 6-bit scales.
    pub scales: [u8; 12],
    /// Super-block scale (f16).
    pub d: [u8; 2],
}

/// `Q4_K`: 8 sub-blocks of 32, 6-bit scale and min each, 4-bit quants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale of the scales (f16).
    pub d: [u8; 2],
    /// Super-block scale of the mins (f16).
    pub dmin: [u8; 2],
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// Nibbles: per 64 elements, 32 bytes; low nibbles first 32, high nibbles next 32.
    pub qs: [u8; QK_K / 2],
}

/// `Q5_K`: as [`BlockQ4K`] plus a fifth bit per quant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ5K {
    /// Super-block scale of the scales (f16).
    pub d: [u8; 2],
    /// Super-block scale of the mins (f16).
    pub dmin: [u8; 2],
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// Fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Low four bits.
    pub qs: [u8; QK_K / 2],
}

/// `Q6_K`: 16 sub-blocks of 16, i8 scales, 6-bit quants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low four bits.
    pub ql: [u8; QK_K / 2],
    /// High two bits.
    pub qh: [u8; QK_K / 4],
    /// Sub-block scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale (f16).
    pub d: [u8; 2],
}

/// `Q8_K`: activation format for the K-quants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale (f32 bits, little-endian).
    pub d: [u8; 4],
    /// Quants.
    pub qs: [i8; QK_K],
    /// Sums of each group of 16 quants (i16 little-endian).
    pub bsums: [[u8; 2]; QK_K / 16],
}

/// `IQ4_NL`: `d * KVALUES_IQ4NL[q]`, nibble layout as [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ4NL {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// `IQ4_XS`: super-block of 8 sub-blocks of 32 with 6-bit scales, non-linear 4-bit quants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ4XS {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// High two bits of the eight scales (u16 LE).
    pub scales_h: [u8; 2],
    /// Low four bits of the eight scales.
    pub scales_l: [u8; QK_K / 64],
    /// Nibbles.
    pub qs: [u8; QK_K / 2],
}

/// `IQ2_XXS` (2.06 bits a weight): per 32 elements, four 8-bit indices into
/// [`IQ2XXS_GRID`](super::iq_grids::IQ2XXS_GRID) and a little-endian `u32`
/// holding four 7-bit sign patterns (bits 0..28) and a 4-bit scale (28..32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ2XXS {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// Per 32 elements: 4 grid indices, then the signs-and-scale word.
    pub qs: [u8; QK_K / 4],
}

/// `IQ2_XS` (2.31 bits a weight): per 8 elements a little-endian `u16` of a
/// 9-bit index into [`IQ2XS_GRID`](super::iq_grids::IQ2XS_GRID) and a 7-bit
/// sign pattern; two 4-bit scales per 32 elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ2XS {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// 32 index-and-signs words (`u16` LE).
    pub qs: [u8; QK_K / 4],
    /// Per 32 elements, the scales of its halves (low nibble first).
    pub scales: [u8; QK_K / 32],
}

/// `IQ2_S` (2.56 bits a weight): 10-bit indices into
/// [`IQ2S_GRID`](super::iq_grids::IQ2S_GRID) (low bytes in `qs`, two high
/// bits each in `qh`), 8 explicit sign bits per 8 elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ2S {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// 32 index low bytes, then 32 sign bytes.
    pub qs: [u8; QK_K / 4],
    /// Per 32 elements, the high bits of its 4 indices (2 each).
    pub qh: [u8; QK_K / 32],
    /// Per 32 elements, the scales of its halves (low nibble first).
    pub scales: [u8; QK_K / 32],
}

/// `IQ3_XXS` (3.06 bits a weight): 8-bit indices into
/// [`IQ3XXS_GRID`](super::iq_grids::IQ3XXS_GRID) (4 elements each), and per
/// 32 elements a little-endian `u32` of four 7-bit sign patterns and a 4-bit
/// scale, as [`BlockIQ2XXS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ3XXS {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// 64 grid indices, then 8 signs-and-scale words.
    pub qs: [u8; 3 * QK_K / 8],
}

/// `IQ3_S` (3.44 bits a weight): 9-bit indices into
/// [`IQ3S_GRID`](super::iq_grids::IQ3S_GRID) (low bytes in `qs`, ninth bits
/// in `qh`), 8 explicit sign bits per 8 elements, a 4-bit scale per 32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ3S {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// Index low bytes.
    pub qs: [u8; QK_K / 4],
    /// Per 32 elements, the ninth bits of its 8 indices.
    pub qh: [u8; QK_K / 32],
    /// Sign bits, one byte per 8 elements.
    pub signs: [u8; QK_K / 8],
    /// Per 64 elements, the scales of its halves (low nibble first).
    pub scales: [u8; QK_K / 64],
}

/// `IQ1_S` (1.56 bits a weight): 11-bit indices into
/// [`IQ1S_GRID`](super::iq_grids::IQ1S_GRID) (low bytes in `qs`, three high
/// bits each in `qh`), per 32 elements a 3-bit scale and the sign of a
/// shift of 1/8 (`qh`, `u16` LE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ1S {
    /// Super-block scale (f16).
    pub d: [u8; 2],
    /// Index low bytes.
    pub qs: [u8; QK_K / 8],
    /// Per 32 elements: index high bits (0..12), scale (12..15), shift sign (15).
    pub qh: [u8; QK_K / 16],
}

/// `IQ1_M` (1.75 bits a weight): [`BlockIQ1S`]'s grid with a 3-bit scale per
/// 16 elements, a shift sign per 8, and the f16 super-block scale spread over
/// the top nibbles of the four `u16` scale words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIQ1M {
    /// Index low bytes.
    pub qs: [u8; QK_K / 8],
    /// Per 8 elements a nibble: index high bits (0..3), shift sign (3).
    pub qh: [u8; QK_K / 16],
    /// Four `u16` LE: 3-bit scales (0..12) and a nibble of the f16 scale.
    pub scales: [u8; QK_K / 32],
}

/// `MXFP4` (OCP microscaling FP4): `2^(e - 128) * KVALUES_MXFP4[q]`, a shared
/// E8M0 exponent and 4-bit E2M1 codes, nibble layout as [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockMXFP4 {
    /// Shared exponent (E8M0: the scale is `2^(e - 127)`, halved with the doubled codebook).
    pub e: u8,
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// The MXFP4 codebook: the E2M1 values doubled (0, 0.5, 1, ..., 6 become 0, 1, 2, ..., 12),
/// so that they are integers; [`BlockMXFP4`]'s scale is halved to match.
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The IQ4_NL / IQ4_XS non-linear codebook.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

macro_rules! assert_layout {
    ($($t:ty => $size:expr),* $(,)?) => {
        $(
            const_assert_eq!(size_of::<$t>(), $size);
            const_assert_eq!(align_of::<$t>(), 1);
            impl sealed::Sealed for $t {}
            impl Block for $t {}
        )*
    };
}

assert_layout! {
    BlockQ4_0 => 18,
    BlockQ4_1 => 20,
    BlockQ5_0 => 22,
    BlockQ5_1 => 24,
    BlockQ8_0 => 34,
    BlockQ8_1 => 36,
    BlockQ2K => 84,
    BlockQ3K => 110,
    BlockQ4K => 144,
    BlockQ5K => 176,
    BlockQ6K => 210,
    BlockQ8K => 292,
    BlockIQ4NL => 18,
    BlockIQ4XS => 136,
    BlockIQ2XXS => 66,
    BlockIQ2XS => 74,
    BlockIQ2S => 82,
    BlockIQ3XXS => 98,
    BlockIQ3S => 110,
    BlockIQ1S => 50,
    BlockIQ1M => 56,
    BlockMXFP4 => 17,
}

mod sealed {
    pub trait Sealed {}
}

/// A block struct of this module: alignment 1, no padding, any bit pattern valid.
/// Sealed so that [`as_blocks`] stays sound.
pub trait Block: sealed::Sealed + Copy + 'static {}

/// Views `bytes` as blocks, or `None` if its length is not a multiple of the block size.
pub fn as_blocks<B: Block>(bytes: &[u8]) -> Option<&[B]> {
    let size = size_of::<B>();
    if !bytes.len().is_multiple_of(size) {
        return None;
    }
    // SAFETY: `B` is one of the sealed block structs above: `repr(C)` over byte
    // arrays only, so its alignment is 1 (asserted), it has no padding (sizes
    // asserted equal to the sum of the fields) and every bit pattern is a valid
    // value. The length is a whole number of blocks, and the returned slice borrows
    // `bytes`, so it cannot outlive or alias a mutable use of the memory.
    Some(unsafe { core::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), bytes.len() / size) })
}

/// Mutable version of [`as_blocks`].
pub fn as_blocks_mut<B: Block>(bytes: &mut [u8]) -> Option<&mut [B]> {
    let size = size_of::<B>();
    if !bytes.len().is_multiple_of(size) {
        return None;
    }
    // SAFETY: as in `as_blocks`; additionally any value written through the block
    // view is a valid byte sequence, and the unique borrow of `bytes` is moved into
    // the returned slice.
    Some(unsafe {
        core::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<B>(), bytes.len() / size)
    })
}

/// Views blocks as their bytes.
pub fn block_bytes<B: Block>(blocks: &[B]) -> &[u8] {
    // SAFETY: blocks have no padding and alignment 1, so every byte of the slice is
    // initialised and the byte view covers exactly the same memory.
    unsafe {
        core::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), core::mem::size_of_val(blocks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_round_trip() {
        let mut bytes = [0u8; 36];
        bytes[0] = 1;
        bytes[18] = 2;
        let blocks: &[BlockQ4_0] = as_blocks(&bytes).unwrap();
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[1].d, [2, 0]);
        assert_eq!(block_bytes(blocks), &bytes[..]);
        assert!(as_blocks::<BlockQ4_0>(&bytes[..35]).is_none());
        let m: &mut [BlockQ4_0] = as_blocks_mut(&mut bytes).unwrap();
        m[0].qs[0] = 7;
        assert_eq!(bytes[2], 7);
    }
}
