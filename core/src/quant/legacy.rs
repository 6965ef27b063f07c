//! The 32-element ("legacy") formats: `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q8_1`.
//!
//! Dequantization and ggml's reference quantizers (`quantize_row_*_ref`), bit-exact
//! with `gguf.quants` (numpy): every float operation is done in `f32` in the same
//! order, scales are rounded to f16 only when stored, and quants are computed from
//! the unrounded `f32` scale, as the reference does.
//!
//! Float-to-integer conversions follow what numpy's casts do on x86-64 (the
//! `cvttss2si` instruction): truncate toward zero, and a NaN or a value outside the
//! `i32` range becomes `i32::MIN` before the narrowing to 8 bits. With finite input
//! this only matters for blocks whose scale is so small that `1/d` overflows to
//! infinity (|max| below about 1e-37); those quants then come out as numpy's, and
//! their stored f16 scale is zero anyway.

use super::blocks::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1, QK};
use super::{f16_to_f32, f32_to_f16};

#[inline]
fn load_f16(h: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(h))
}

#[inline]
fn store_f16(x: f32) -> [u8; 2] {
    f32_to_f16(x).to_le_bytes()
}

/// `f32 -> i32` truncating toward zero, with x86's "integer indefinite" result
/// (`i32::MIN`) for NaN and out-of-range values, as numpy's float-to-int casts.
#[inline]
fn trunc_i32(v: f32) -> i32 {
    if (-2_147_483_648.0..2_147_483_648.0).contains(&v) {
        v as i32
    } else {
        i32::MIN
    }
}

/// numpy's `np.trunc(v).astype(np.uint8).clip(0, hi)`.
#[inline]
fn trunc_clip(v: f32, hi: u8) -> u8 {
    (trunc_i32(v) as u8).min(hi)
}

/// `roundf(v)` (half away from zero, as `np_roundf`) then numpy's cast to `i8`.
#[inline]
fn round_i8(v: f32) -> i8 {
    if !(-2_147_483_648.0..2_147_483_648.0).contains(&v) {
        return 0; // i32::MIN as i8
    }
    let t = v as i32;
    // Exact: `t` is `v` without its fraction, and both are representable.
    let r = v - t as f32;
    let t = t + (r >= 0.5) as i32 - (r <= -0.5) as i32;
    t as i8
}

/// `1/d`, or 0 when `d` is zero (the reference's `id`).
#[inline]
fn inv(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// The element of largest magnitude (the first one on ties), as numpy's
/// `take_along_axis(x, abs(x).argmax())`.
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = x[0].abs();
    let mut max = x[0];
    for &v in &x[1..] {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    max
}

#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (x[0], x[0]);
    for &v in &x[1..] {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline]
fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

#[track_caller]
fn check_dequant(name: &str, blocks: usize, out: usize) {
    assert!(
        out == blocks * QK,
        "{name}: out.len() == blocks.len() * 32 required (out.len() = {out}, blocks.len() = {blocks})"
    );
}

#[track_caller]
fn check_quant(name: &str, x: usize, blocks: usize) {
    assert!(
        x == blocks * QK,
        "{name}: x.len() == out.len() * 32 required (x.len() = {x}, out.len() = {blocks})"
    );
}

/// The 32 four-bit values of a nibble array: element j in the low nibble of byte j,
/// element j+16 in its high nibble.
#[inline]
fn nibbles(qs: &[u8; QK / 2]) -> [u8; QK] {
    let mut q = [0u8; QK];
    for j in 0..QK / 2 {
        q[j] = qs[j] & 0x0f;
        q[j + QK / 2] = qs[j] >> 4;
    }
    q
}

/// The 32 five-bit values of a nibble array plus its fifth-bit word `qh`.
#[inline]
fn quints(qs: &[u8; QK / 2], qh: [u8; 4]) -> [u8; QK] {
    let qh = u32::from_le_bytes(qh);
    let mut q = nibbles(qs);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) as u8) << 4;
    }
    q
}

/// Packs 32 quants of up to five bits: low four bits as nibbles, fifth bits into `qh`.
#[inline]
fn pack(q: &[u8; QK]) -> ([u8; QK / 2], [u8; 4]) {
    let mut qs = [0u8; QK / 2];
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let (q0, q1) = (q[j], q[j + QK / 2]);
        qs[j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
        qh |= u32::from(q0 >> 4) << j;
        qh |= u32::from(q1 >> 4) << (j + QK / 2);
    }
    (qs, qh.to_le_bytes())
}

/// Dequantizes `Q4_0` blocks: `d * (q - 8)`. `out.len()` must be `blocks.len() * 32`.
pub fn dequantize_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    check_dequant("dequantize_q4_0", blocks.len(), out.len());
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = load_f16(b.d);
        for (o, q) in o.iter_mut().zip(nibbles(&b.qs)) {
            *o = d * (i32::from(q) - 8) as f32;
        }
    }
}

/// Dequantizes `Q4_1` blocks: `d * q + m`. `out.len()` must be `blocks.len() * 32`.
pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    check_dequant("dequantize_q4_1", blocks.len(), out.len());
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (load_f16(b.d), load_f16(b.m));
        for (o, q) in o.iter_mut().zip(nibbles(&b.qs)) {
            *o = d * f32::from(q) + m;
        }
    }
}

/// Dequantizes `Q5_0` blocks: `d * (q - 16)`. `out.len()` must be `blocks.len() * 32`.
pub fn dequantize_q5_0(blocks: &[BlockQ5_0], out: &mut [f32]) {
    check_dequant("dequantize_q5_0", blocks.len(), out.len());
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = load_f16(b.d);
        for (o, q) in o.iter_mut().zip(quints(&b.qs, b.qh)) {
            *o = d * (i32::from(q) - 16) as f32;
        }
    }
}

/// Dequantizes `Q5_1` blocks: `d * q + m`. `out.len()` must be `blocks.len() * 32`.
pub fn dequantize_q5_1(blocks: &[BlockQ5_1], out: &mut [f32]) {
    check_dequant("dequantize_q5_1", blocks.len(), out.len());
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (load_f16(b.d), load_f16(b.m));
        for (o, q) in o.iter_mut().zip(quints(&b.qs, b.qh)) {
            *o = d * f32::from(q) + m;
        }
    }
}

/// Dequantizes `Q8_0` blocks: `d * q`. `out.len()` must be `blocks.len() * 32`.
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    check_dequant("dequantize_q8_0", blocks.len(), out.len());
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = load_f16(b.d);
        for (o, &q) in o.iter_mut().zip(&b.qs) {
            *o = d * f32::from(q);
        }
    }
}

/// Dequantizes `Q8_1` blocks: `d * q` (the stored sum `s` is not needed).
/// `out.len()` must be `blocks.len() * 32`.
pub fn dequantize_q8_1(blocks: &[BlockQ8_1], out: &mut [f32]) {
    check_dequant("dequantize_q8_1", blocks.len(), out.len());
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = load_f16(b.d);
        for (o, &q) in o.iter_mut().zip(&b.qs) {
            *o = d * f32::from(q);
        }
    }
}

/// Quantizes to `Q4_0` (ggml's `quantize_row_q4_0_ref`): `d = max / -8` where `max`
/// is the element of largest magnitude, so that element maps exactly to `q = 0`.
/// `x.len()` must be `out.len() * 32`.
pub fn quantize_q4_0(x: &[f32], out: &mut [BlockQ4_0]) {
    check_quant("quantize_q4_0", x.len(), out.len());
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let d = signed_absmax(xb) / -8.0;
        let id = inv(d);
        let mut q = [0u8; QK];
        for (q, &v) in q.iter_mut().zip(xb) {
            *q = trunc_clip(v * id + 8.5, 15);
        }
        b.d = store_f16(d);
        b.qs = pack(&q).0;
    }
}

/// Quantizes to `Q4_1` (ggml's `quantize_row_q4_1_ref`): `d = (max - min) / 15`,
/// `m = min`. `x.len()` must be `out.len() * 32`.
pub fn quantize_q4_1(x: &[f32], out: &mut [BlockQ4_1]) {
    check_quant("quantize_q4_1", x.len(), out.len());
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (min, max) = min_max(xb);
        let d = (max - min) / 15.0;
        let id = inv(d);
        let mut q = [0u8; QK];
        for (q, &v) in q.iter_mut().zip(xb) {
            *q = trunc_clip((v - min) * id + 0.5, 15);
        }
        b.d = store_f16(d);
        b.m = store_f16(min);
        b.qs = pack(&q).0;
    }
}

/// Quantizes to `Q5_0` (ggml's `quantize_row_q5_0_ref`): `d = max / -16` where `max`
/// is the element of largest magnitude. `x.len()` must be `out.len() * 32`.
pub fn quantize_q5_0(x: &[f32], out: &mut [BlockQ5_0]) {
    check_quant("quantize_q5_0", x.len(), out.len());
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let d = signed_absmax(xb) / -16.0;
        let id = inv(d);
        let mut q = [0u8; QK];
        for (q, &v) in q.iter_mut().zip(xb) {
            *q = trunc_clip(v * id + 16.5, 31);
        }
        b.d = store_f16(d);
        (b.qs, b.qh) = pack(&q);
    }
}

/// Quantizes to `Q5_1` (ggml's `quantize_row_q5_1_ref`): `d = (max - min) / 31`,
/// `m = min`. `x.len()` must be `out.len() * 32`.
pub fn quantize_q5_1(x: &[f32], out: &mut [BlockQ5_1]) {
    check_quant("quantize_q5_1", x.len(), out.len());
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (min, max) = min_max(xb);
        let d = (max - min) / 31.0;
        let id = inv(d);
        let mut q = [0u8; QK];
        for (q, &v) in q.iter_mut().zip(xb) {
            *q = trunc_clip((v - min) * id + 0.5, 31);
        }
        b.d = store_f16(d);
        b.m = store_f16(min);
        (b.qs, b.qh) = pack(&q);
    }
}

/// Quantizes to `Q8_0` (ggml's `quantize_row_q8_0_ref`): `d = amax / 127`,
/// `q = round(x / d)` half away from zero.
///
/// Also the activation quantizer for the integer dot products of `Q4_0`, `Q5_0`,
/// `Q8_0` and `IQ4_NL` weights, hence allocation-free and branch-light.
/// `x.len()` must be `out.len() * 32`.
pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    check_quant("quantize_q8_0", x.len(), out.len());
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let d = absmax(xb) / 127.0;
        let id = inv(d);
        for (q, &v) in b.qs.iter_mut().zip(xb) {
            *q = round_i8(v * id);
        }
        b.d = store_f16(d);
    }
}

/// Quantizes activations to `Q8_1` (ggml's `quantize_row_q8_1_ref`): as
/// [`quantize_q8_0`], plus `s = d * sum(q)` (f32 `d`, stored as f16) so that the
/// `Q4_1`/`Q5_1` dot products can add the `m` term without touching the quants.
/// `x.len()` must be `out.len() * 32`.
pub fn quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    check_quant("quantize_q8_1", x.len(), out.len());
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let d = absmax(xb) / 127.0;
        let id = inv(d);
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(xb) {
            *q = round_i8(v * id);
            sum += i32::from(*q);
        }
        b.d = store_f16(d);
        b.s = store_f16(sum as f32 * d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: [u8; 2] = [0x00, 0x3c]; // f16 1.0
    const HALF: [u8; 2] = [0x00, 0x38]; // f16 0.5
    const MINUS_TWO: [u8; 2] = [0x00, 0xc0]; // f16 -2.0

    #[test]
    fn q4_0_low_nibbles_are_the_first_half() {
        let mut qs = [0x88u8; 16]; // every element q = 8 -> 0
        qs[0] = 0xf0; // element 0: q = 0 -> -8, element 16: q = 15 -> 7
        qs[3] = 0x19; // element 3: 9 -> 1, element 19: 1 -> -7
        let b = BlockQ4_0 { d: HALF, qs };
        let mut out = [0.0f32; 32];
        dequantize_q4_0(&[b], &mut out);
        let mut want = [0.0f32; 32];
        want[0] = -4.0;
        want[16] = 3.5;
        want[3] = 0.5;
        want[19] = -3.5;
        assert_eq!(out, want);
    }

    #[test]
    fn q4_1_adds_the_min() {
        let mut qs = [0u8; 16];
        qs[1] = 0xa3; // element 1: 3, element 17: 10
        let b = BlockQ4_1 {
            d: HALF,
            m: MINUS_TWO,
            qs,
        };
        let mut out = [0.0f32; 32];
        dequantize_q4_1(&[b], &mut out);
        assert_eq!(out[0], -2.0);
        assert_eq!(out[1], -0.5);
        assert_eq!(out[17], 3.0);
    }

    #[test]
    fn q5_0_fifth_bit_from_qh() {
        let qs = [0u8; 16]; // low bits all zero
                            // Fifth bits of elements 0, 2 and 17 (bit j of the little-endian u32).
        let qh = (1u32 | 1 << 2 | 1 << 17).to_le_bytes();
        let b = BlockQ5_0 { d: ONE, qh, qs };
        let mut out = [0.0f32; 32];
        dequantize_q5_0(&[b], &mut out);
        for (j, &v) in out.iter().enumerate() {
            let want = if [0, 2, 17].contains(&j) { 0.0 } else { -16.0 };
            assert_eq!(v, want, "element {j}");
        }
        let mut qs = [0u8; 16];
        qs[5] = 0xf7; // element 5: 7, element 21: 15
        let qh = (1u32 << 21).to_le_bytes();
        dequantize_q5_0(&[BlockQ5_0 { d: ONE, qh, qs }], &mut out);
        assert_eq!(out[5], -9.0);
        assert_eq!(out[21], 15.0);
    }

    #[test]
    fn q5_1_fifth_bit_and_min() {
        let mut qs = [0u8; 16];
        qs[15] = 0x21; // element 15: 1, element 31: 2
        let qh = (1u32 << 31 | 1 << 15).to_le_bytes();
        let b = BlockQ5_1 {
            d: HALF,
            m: ONE,
            qh,
            qs,
        };
        let mut out = [0.0f32; 32];
        dequantize_q5_1(&[b], &mut out);
        assert_eq!(out[15], 0.5 * 17.0 + 1.0);
        assert_eq!(out[31], 0.5 * 18.0 + 1.0);
        assert_eq!(out[0], 1.0);
    }

    #[test]
    fn q8_dequant_is_d_times_q() {
        let mut qs = [0i8; 32];
        qs[0] = -128;
        qs[31] = 127;
        let mut out = [0.0f32; 32];
        dequantize_q8_0(&[BlockQ8_0 { d: HALF, qs }], &mut out);
        assert_eq!((out[0], out[31]), (-64.0, 63.5));
        dequantize_q8_1(
            &[BlockQ8_1 {
                d: HALF,
                s: ONE,
                qs,
            }],
            &mut out,
        );
        assert_eq!((out[0], out[31]), (-64.0, 63.5));
    }

    #[test]
    fn q4_0_quantize_known_block() {
        // max magnitude -4 -> d = 0.5; x = d * (q - 8).
        let mut x = [0.0f32; 32];
        x[0] = -4.0; // q = 0
        x[1] = 3.5; // q = 15
        x[16] = 1.0; // q = 10
        x[17] = 0.74; // 1.48 + 8.5 -> 9
        let mut b = [BlockQ4_0 {
            d: [0; 2],
            qs: [0; 16],
        }];
        quantize_q4_0(&x, &mut b);
        assert_eq!(b[0].d, HALF);
        assert_eq!(b[0].qs[0], 0xa0);
        assert_eq!(b[0].qs[1], 0x9f);
        assert_eq!(b[0].qs[2], 0x88);
    }

    #[test]
    fn q5_0_quantize_sets_fifth_bits() {
        let mut x = [0.0f32; 32];
        x[0] = 16.0; // d = -1: q = 16 - 16 = 0
        x[20] = -15.0; // q = 31
        let mut b = [BlockQ5_0 {
            d: [0; 2],
            qh: [0; 4],
            qs: [0; 16],
        }];
        quantize_q5_0(&x, &mut b);
        assert_eq!(b[0].d, [0x00, 0xbc]); // -1.0
        let qh = u32::from_le_bytes(b[0].qh);
        assert_eq!(qh, !1u32); // everything but element 0 is >= 16
        assert_eq!(b[0].qs[0], 0x00);
        assert_eq!(b[0].qs[4], 0xf0); // element 4: 16 & 15, element 20: 31 & 15
        let mut out = [0.0f32; 32];
        dequantize_q5_0(&b, &mut out);
        assert_eq!(out, x);
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let x = [0.0f32; 32];
        let mut b4 = [BlockQ4_0 {
            d: [1; 2],
            qs: [0; 16],
        }];
        quantize_q4_0(&x, &mut b4);
        // 0 / -8 is -0.0, and the reference stores it so.
        assert_eq!(b4[0].d, [0x00, 0x80]);
        assert_eq!(b4[0].qs, [0x88; 16]);
        let mut b8 = [BlockQ8_1 {
            d: [1; 2],
            s: [1; 2],
            qs: [1; 32],
        }];
        quantize_q8_1(&x, &mut b8);
        assert_eq!(
            b8[0],
            BlockQ8_1 {
                d: [0; 2],
                s: [0; 2],
                qs: [0; 32]
            }
        );
    }

    #[test]
    fn q8_rounds_half_away_from_zero() {
        let mut x = [0.0f32; 32];
        x[0] = 127.0; // d = 1
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.49999997;
        x[4] = -126.5;
        let mut b = [BlockQ8_0 {
            d: [0; 2],
            qs: [0; 32],
        }];
        quantize_q8_0(&x, &mut b);
        assert_eq!(b[0].d, ONE);
        assert_eq!(&b[0].qs[..5], &[127, 3, -3, 0, -127]);
        let mut b1 = [BlockQ8_1 {
            d: [0; 2],
            s: [0; 2],
            qs: [0; 32],
        }];
        quantize_q8_1(&x, &mut b1);
        assert_eq!((b1[0].d, b1[0].qs), (b[0].d, b[0].qs));
        assert_eq!(f16_to_f32(u16::from_le_bytes(b1[0].s)), 0.0); // 127+3-3+0-127
    }

    #[test]
    fn round_i8_matches_roundf() {
        let mut v = -130.0f32;
        while v < 130.0 {
            let want = libm::roundf(v) as i32 as i8;
            assert_eq!(round_i8(v), want, "{v}");
            assert_eq!(
                round_i8(v.next_up_compat()),
                libm::roundf(v.next_up_compat()) as i32 as i8
            );
            v += 0.125;
        }
        assert_eq!(round_i8(f32::NAN), 0);
        assert_eq!(round_i8(f32::INFINITY), 0);
        assert_eq!(trunc_clip(-1.5, 15), 15); // wraps to 255, then clips, as numpy
        assert_eq!(trunc_clip(f32::INFINITY, 15), 0);
    }

    trait NextUp {
        fn next_up_compat(self) -> Self;
    }
    impl NextUp for f32 {
        fn next_up_compat(self) -> f32 {
            if self >= 0.0 {
                f32::from_bits(self.to_bits() + 1)
            } else {
                f32::from_bits(self.to_bits() - 1)
            }
        }
    }

    #[test]
    #[should_panic(expected = "out.len() == blocks.len() * 32")]
    fn dequant_length_mismatch_panics() {
        dequantize_q8_0(
            &[BlockQ8_0 {
                d: [0; 2],
                qs: [0; 32],
            }],
            &mut [0.0; 31],
        );
    }

    #[test]
    #[should_panic(expected = "x.len() == out.len() * 32")]
    fn quant_length_mismatch_panics() {
        quantize_q4_0(
            &[0.0; 33],
            &mut [BlockQ4_0 {
                d: [0; 2],
                qs: [0; 16],
            }],
        );
    }
}
