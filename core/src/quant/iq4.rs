//! Non-linear 4-bit formats `IQ4_NL` and `IQ4_XS`: each nibble indexes the codebook
//! [`KVALUES_IQ4NL`], scaled per block (`IQ4_NL`) or per 32-element sub-block with
//! 6-bit sub-scales (`IQ4_XS`).
//!
//! Dequantization is bit-identical to the `gguf` Python package and ggml: the
//! sub-block scale `d * (ls - 32)` is rounded to f32 first, then multiplied by the
//! codebook value.

use super::blocks::{BlockIQ4NL, BlockIQ4XS, KVALUES_IQ4NL, QK};
use super::{f16_to_f32, QK_K};

#[inline]
fn h2f(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

#[inline]
fn kv(nibble: u8) -> f32 {
    KVALUES_IQ4NL[(nibble & 0x0f) as usize] as f32
}

/// Dequantizes `IQ4_NL` blocks (32 elements each) into `out`: element `j < 16` is
/// `d * KVALUES_IQ4NL[qs[j] & 15]`, element `j + 16` uses the high nibble.
///
/// # Panics
/// If `out.len() != blocks.len() * 32`.
pub fn dequantize_iq4nl(blocks: &[BlockIQ4NL], out: &mut [f32]) {
    assert!(
        blocks.len().checked_mul(QK) == Some(out.len()),
        "dequantize_iq4nl: out.len() ({}) must be blocks.len() * 32 ({} blocks)",
        out.len(),
        blocks.len()
    );
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = h2f(b.d);
        let (lo, hi) = y.split_at_mut(QK / 2);
        for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
            *l = d * kv(q);
            *h = d * kv(q >> 4);
        }
    }
}

/// Dequantizes `IQ4_XS` super-blocks (256 elements each) into `out`. Sub-block `ib`
/// (32 elements) has the 6-bit scale `ls` made of nibble `ib` of `scales_l` and bits
/// `2*ib..2*ib+2` of `scales_h`; its elements are `(d * (ls - 32)) * KVALUES_IQ4NL[q]`,
/// with the nibbles laid out as in [`dequantize_iq4nl`] within each sub-block.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_iq4xs(blocks: &[BlockIQ4XS], out: &mut [f32]) {
    assert!(
        blocks.len().checked_mul(QK_K) == Some(out.len()),
        "dequantize_iq4xs: out.len() ({}) must be blocks.len() * 256 ({} blocks)",
        out.len(),
        blocks.len()
    );
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        let scales_h = u16::from_le_bytes(b.scales_h);
        for (ib, (qs, ys)) in
            b.qs.chunks_exact(16)
                .zip(y.chunks_exact_mut(32))
                .enumerate()
        {
            let lo4 = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
            let hi2 = ((scales_h >> (2 * ib)) & 3) as u8;
            let ls = (lo4 | (hi2 << 4)) as i32 - 32;
            let dl = d * ls as f32;
            let (lo, hi) = ys.split_at_mut(16);
            for ((&q, l), h) in qs.iter().zip(lo).zip(hi) {
                *l = dl * kv(q);
                *h = dl * kv(q >> 4);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::f32_to_f16;

    fn f16b(x: f32) -> [u8; 2] {
        f32_to_f16(x).to_le_bytes()
    }

    #[test]
    fn iq4nl_hand_built_block() {
        // Byte j holds element j (low nibble) and element j + 16 (high nibble).
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = (j as u8) | ((15 - j as u8) << 4);
        }
        let b = BlockIQ4NL { d: f16b(0.5), qs };
        let mut out = [0f32; 32];
        dequantize_iq4nl(&[b], &mut out);
        let table = [
            -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
        ];
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * table[j] as f32, "element {j}");
            assert_eq!(
                out[j + 16],
                0.5 * table[15 - j] as f32,
                "element {}",
                j + 16
            );
        }
    }

    #[test]
    fn iq4xs_hand_built_block() {
        // Sub-block ib: scale ls = 32 + ib - 3 (so ls - 32 runs -3..=4), split into
        // a low nibble in scales_l and two high bits in scales_h.
        let mut scales_l = [0u8; 4];
        let mut scales_h = 0u16;
        for ib in 0..8 {
            let ls = (32 + ib as i32 - 3) as u8;
            scales_l[ib / 2] |= (ls & 0x0f) << (4 * (ib % 2));
            scales_h |= ((ls >> 4) as u16 & 3) << (2 * ib);
        }
        let mut qs = [0u8; 128];
        for (i, q) in qs.iter_mut().enumerate() {
            *q = (i % 16) as u8 | (((i / 16) as u8 & 15) << 4);
        }
        let b = BlockIQ4XS {
            d: f16b(0.25),
            scales_h: scales_h.to_le_bytes(),
            scales_l,
            qs,
        };
        let mut out = [0f32; 256];
        dequantize_iq4xs(&[b], &mut out);
        for (e, &v) in out.iter().enumerate() {
            let ib = e / 32;
            let within = e % 32;
            let byte = qs[ib * 16 + within % 16];
            let nib = if within < 16 { byte & 15 } else { byte >> 4 };
            let want = 0.25 * (ib as f32 - 3.0) * KVALUES_IQ4NL[nib as usize] as f32;
            assert_eq!(v, want, "element {e}");
        }
    }

    #[test]
    #[should_panic(expected = "dequantize_iq4xs")]
    fn iq4xs_rejects_wrong_length() {
        let b = BlockIQ4XS {
            d: [0; 2],
            scales_h: [0; 2],
            scales_l: [0; 4],
            qs: [0; 128],
        };
        dequantize_iq4xs(&[b], &mut [0f32; 255]);
    }
}
