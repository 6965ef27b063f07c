//! The float "formats": `F32`, `F16` and `BF16` tensors as little-endian bytes.
//!
//! They have one element per block, so they take raw bytes rather than block
//! structs. Conversions are bit-exact with ggml and with numpy as the `gguf`
//! package uses it (round to nearest even; `BF16` forces NaNs quiet).

use super::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// Decodes little-endian `f32` bytes; `src.len()` must be `out.len() * 4`.
pub fn dequantize_f32(src: &[u8], out: &mut [f32]) {
    assert_eq!(
        src.len(),
        out.len() * 4,
        "dequantize_f32: src.len() == out.len() * 4"
    );
    for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Decodes little-endian IEEE half bytes (exact); `src.len()` must be `out.len() * 2`.
pub fn dequantize_f16(src: &[u8], out: &mut [f32]) {
    assert_eq!(
        src.len(),
        out.len() * 2,
        "dequantize_f16: src.len() == out.len() * 2"
    );
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Decodes little-endian bfloat16 bytes (exact); `src.len()` must be `out.len() * 2`.
pub fn dequantize_bf16(src: &[u8], out: &mut [f32]) {
    assert_eq!(
        src.len(),
        out.len() * 2,
        "dequantize_bf16: src.len() == out.len() * 2"
    );
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Encodes `x` as little-endian IEEE halves, rounding to nearest even (overflow
/// becomes infinity, as numpy's `astype(float16)`); `out.len()` must be `x.len() * 2`.
pub fn quantize_f16(x: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        x.len() * 2,
        "quantize_f16: out.len() == x.len() * 2"
    );
    for (&v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f32_to_f16(v).to_le_bytes());
    }
}

/// Encodes `x` as little-endian bfloat16 as ggml does (nearest even, NaN kept
/// quiet); `out.len()` must be `x.len() * 2`.
pub fn quantize_bf16(x: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        x.len() * 2,
        "quantize_bf16: out.len() == x.len() * 2"
    );
    for (&v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_little_endian() {
        let mut out = [0.0f32; 2];
        dequantize_f32(&[0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0], &mut out);
        assert_eq!(out, [1.0, -2.0]);
        dequantize_f16(&[0x00, 0x3c, 0x00, 0xc0], &mut out);
        assert_eq!(out, [1.0, -2.0]);
        dequantize_bf16(&[0x80, 0x3f, 0x00, 0xc0], &mut out);
        assert_eq!(out, [1.0, -2.0]);
    }

    #[test]
    fn encodes_little_endian_with_rounding() {
        let x = [1.0f32, -2.0, 1.0 + 1.0 / 2048.0, 1e6];
        let mut out = [0u8; 8];
        quantize_f16(&x, &mut out);
        assert_eq!(out, [0x00, 0x3c, 0x00, 0xc0, 0x00, 0x3c, 0x00, 0x7c]);
        let x = [1.0f32, -2.0, f32::from_bits(0x3f81_8000), f32::NAN];
        quantize_bf16(&x, &mut out);
        assert_eq!(out, [0x80, 0x3f, 0x00, 0xc0, 0x82, 0x3f, 0xc0, 0x7f]);
    }

    #[test]
    fn round_trips() {
        let x = [0.0f32, -0.0, 0.5, -65504.0, 6.1035156e-5];
        let mut bytes = [0u8; 10];
        let mut back = [0.0f32; 5];
        quantize_f16(&x, &mut bytes);
        dequantize_f16(&bytes, &mut back);
        assert_eq!(x.map(f32::to_bits), back.map(f32::to_bits));
        quantize_bf16(&x[..4], &mut bytes[..8]);
        dequantize_bf16(&bytes[..8], &mut back[..4]);
        assert_eq!(x[..3], back[..3]);
        assert_eq!(back[3], -65536.0); // bf16 keeps 8 mantissa bits
    }

    #[test]
    #[should_panic(expected = "out.len() * 2")]
    fn length_mismatch_panics() {
        dequantize_f16(&[0; 3], &mut [0.0; 2]);
    }
}
