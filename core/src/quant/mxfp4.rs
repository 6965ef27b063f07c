//! `MXFP4`, the OCP microscaling 4-bit float format (gpt-oss's experts, llama.cpp's
//! `MXFP4_MOE` files): blocks of 32 E2M1 codes sharing an E8M0 exponent.
//!
//! ggml stores the codes doubled ([`KVALUES_MXFP4`], integers from -12 to 12) and
//! halves the scale to match ([`e8m0_to_f32_half`]), so a block dequantizes to
//! `2^(e - 128) * KVALUES_MXFP4[q]` and the dot product with `Q8_0` activations is an
//! integer sum. Both directions are bit-identical to ggml and the `gguf` Python package.

use super::blocks::{BlockMXFP4, KVALUES_MXFP4, QK};

/// ggml's `GGML_E8M0_TO_FP32_HALF`: `2^(e - 128)` as `f32`, subnormal for `e < 2`.
#[inline]
pub const fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// Dequantizes `MXFP4` blocks (32 elements each) into `out`: element `j < 16` is
/// `e8m0_to_f32_half(e) * KVALUES_MXFP4[qs[j] & 15]`, element `j + 16` uses the high
/// nibble.
///
/// # Panics
/// If `out.len() != blocks.len() * 32`.
pub fn dequantize_mxfp4(blocks: &[BlockMXFP4], out: &mut [f32]) {
    assert!(
        blocks.len().checked_mul(QK) == Some(out.len()),
        "dequantize_mxfp4: out.len() ({}) must be blocks.len() * 32 ({} blocks)",
        out.len(),
        blocks.len()
    );
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = e8m0_to_f32_half(b.e);
        let (lo, hi) = y.split_at_mut(QK / 2);
        for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
            *l = d * KVALUES_MXFP4[(q & 15) as usize] as f32;
            *h = d * KVALUES_MXFP4[(q >> 4) as usize] as f32;
        }
    }
}

/// The shared exponent ggml picks for a block whose largest magnitude is `amax`:
/// `floor(log2(amax)) - 2 + 127` (so the largest code, 6 = 12 / 2, covers `amax`), 0
/// for an all-zero block.
///
/// ggml casts that float to `uint8_t`, which C leaves undefined below 0 (`amax` under
/// `2^-125`) or above 255 (never: `amax` is at most `f32::MAX`, `2^128`); LES clamps
/// it to 0 there, where every code of the block is 0 anyway.
fn shared_exponent(amax: f32) -> u8 {
    if amax <= 0.0 || amax.is_nan() {
        return 0;
    }
    // floor(log2(amax)), exactly: the binary exponent of a normal number, the position
    // of the top set bit for a subnormal one.
    let bits = amax.to_bits();
    let biased = (bits >> 23) as i32;
    let log2 = if biased > 0 {
        biased - 127
    } else {
        (31 - (bits & 0x007f_ffff).leading_zeros() as i32) - 149
    };
    (log2 - 2 + 127).clamp(0, 255) as u8
}

/// The code nearest `x / d` (first of equals, as ggml's `best_index_mxfp4`): the
/// smallest `|KVALUES_MXFP4[i] * d - x|` in `f32`.
fn best_index(x: f32, d: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (KVALUES_MXFP4[0] as f32 * d - x).abs();
    for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
        let err = (k as f32 * d - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// Quantizes `x` into `MXFP4` blocks with ggml's `quantize_row_mxfp4_ref`: the shared
/// exponent from the block's largest magnitude, then each element's nearest code.
///
/// # Panics
/// If `x.len() != out.len() * 32`.
pub fn quantize_mxfp4(x: &[f32], out: &mut [BlockMXFP4]) {
    assert!(
        out.len().checked_mul(QK) == Some(x.len()),
        "quantize_mxfp4: x.len() ({}) must be out.len() * 32 ({} blocks)",
        x.len(),
        out.len()
    );
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb
            .iter()
            .fold(0.0f32, |m, v| if m < v.abs() { v.abs() } else { m });
        b.e = shared_exponent(amax);
        let d = e8m0_to_f32_half(b.e);
        let (lo, hi) = xb.split_at(QK / 2);
        for ((q, &l), &h) in b.qs.iter_mut().zip(lo).zip(hi) {
            *q = best_index(l, d) | (best_index(h, d) << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_is_a_power_of_two() {
        assert_eq!(e8m0_to_f32_half(0), libm::ldexpf(1.0, -128));
        assert_eq!(e8m0_to_f32_half(1), libm::ldexpf(1.0, -127));
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(128), 1.0);
        assert_eq!(e8m0_to_f32_half(255), libm::ldexpf(1.0, 127));
    }

    #[test]
    fn hand_built_block() {
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = (j as u8) | ((15 - j as u8) << 4);
        }
        let b = BlockMXFP4 { e: 130, qs };
        let mut out = [0f32; 32];
        dequantize_mxfp4(&[b], &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 4.0 * KVALUES_MXFP4[j] as f32, "element {j}");
            assert_eq!(out[j + 16], 4.0 * KVALUES_MXFP4[15 - j] as f32);
        }
    }

    #[test]
    fn exponents_cover_every_magnitude() {
        assert_eq!(shared_exponent(0.0), 0);
        assert_eq!(shared_exponent(1.0), 125);
        assert_eq!(shared_exponent(1.999), 125);
        assert_eq!(shared_exponent(2.0), 126);
        assert_eq!(shared_exponent(f32::MAX), 252);
        assert_eq!(shared_exponent(libm::ldexpf(1.0, -125)), 0);
        assert_eq!(shared_exponent(f32::from_bits(1)), 0); // below 2^-125: clamped
        assert_eq!(shared_exponent(libm::ldexpf(1.5, -120)), 5);
    }

    #[test]
    fn round_trip_keeps_codebook_values() {
        // Values on the codebook at the block's scale come back exactly.
        let x: [f32; 32] = core::array::from_fn(|i| {
            0.25 * KVALUES_MXFP4[i % 16] as f32 * if i < 16 { 1.0 } else { -1.0 }
        });
        let mut b = [BlockMXFP4 { e: 0, qs: [0; 16] }];
        quantize_mxfp4(&x, &mut b);
        let mut y = [0f32; 32];
        dequantize_mxfp4(&b, &mut y);
        assert_eq!(x, y);
    }
}
