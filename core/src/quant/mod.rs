//! ggml block quantization formats, bit-exact with ggml and the `gguf` Python package.
//!
//! Every format is a `#[repr(C)]` block struct of alignment 1 (see [`blocks`]), so a
//! byte slice from a file or a slot can be viewed as blocks without alignment checks.
//! Half-precision scales are stored as `[u8; 2]` and converted with [`f16_to_f32`].
//!
//! Weight formats dequantize to `f32`; the activation formats ([`blocks::BlockQ8_0`],
//! [`blocks::BlockQ8_1`], [`blocks::BlockQ8K`]) quantize `f32` activations so that
//! [`crate::gemv`] can use integer dot products.

pub mod blocks;
pub mod float;
mod half;
pub mod iq1;
pub mod iq2;
pub mod iq3;
pub mod iq4;
pub mod iq_grids;
pub mod kquants;
pub mod kscales;
pub mod legacy;
pub mod mxfp4;

pub use half::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

use core::fmt;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// A ggml tensor element type, with the numeric id GGUF stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
#[allow(missing_docs)] // The names are ggml's.
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    IQ2XXS = 16,
    IQ2XS = 17,
    IQ3XXS = 18,
    IQ1S = 19,
    IQ4NL = 20,
    IQ3S = 21,
    IQ2S = 22,
    IQ4XS = 23,
    /// Plain bytes (`GGML_TYPE_I8`); LES stores packed expert extents as I8 tensors.
    I8 = 24,
    IQ1M = 29,
    BF16 = 30,
    MXFP4 = 39,
}

/// A ggml type id that LES does not support.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnsupportedType(pub u32);

impl fmt::Display for UnsupportedType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unsupported ggml type id {}", self.0)
    }
}

impl core::error::Error for UnsupportedType {}

impl GgmlType {
    /// Every supported type, in id order.
    pub const ALL: [GgmlType; 26] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::IQ2XXS,
        GgmlType::IQ2XS,
        GgmlType::IQ3XXS,
        GgmlType::IQ1S,
        GgmlType::IQ4NL,
        GgmlType::IQ3S,
        GgmlType::IQ2S,
        GgmlType::IQ4XS,
        GgmlType::I8,
        GgmlType::IQ1M,
        GgmlType::BF16,
        GgmlType::MXFP4,
    ];

    /// The type with GGUF id `id`.
    pub fn from_id(id: u32) -> Result<Self, UnsupportedType> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| *t as u32 == id)
            .ok_or(UnsupportedType(id))
    }

    /// The GGUF id.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// Elements per block.
    pub const fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::I8 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::IQ4NL
            | GgmlType::MXFP4 => 32,
            GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::Q8K
            | GgmlType::IQ2XXS
            | GgmlType::IQ2XS
            | GgmlType::IQ2S
            | GgmlType::IQ3XXS
            | GgmlType::IQ3S
            | GgmlType::IQ1S
            | GgmlType::IQ1M
            | GgmlType::IQ4XS => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        use core::mem::size_of;
        match self {
            GgmlType::F32 => 4,
            GgmlType::I8 => 1,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => size_of::<blocks::BlockQ4_0>(),
            GgmlType::Q4_1 => size_of::<blocks::BlockQ4_1>(),
            GgmlType::Q5_0 => size_of::<blocks::BlockQ5_0>(),
            GgmlType::Q5_1 => size_of::<blocks::BlockQ5_1>(),
            GgmlType::Q8_0 => size_of::<blocks::BlockQ8_0>(),
            GgmlType::Q8_1 => size_of::<blocks::BlockQ8_1>(),
            GgmlType::Q2K => size_of::<blocks::BlockQ2K>(),
            GgmlType::Q3K => size_of::<blocks::BlockQ3K>(),
            GgmlType::Q4K => size_of::<blocks::BlockQ4K>(),
            GgmlType::Q5K => size_of::<blocks::BlockQ5K>(),
            GgmlType::Q6K => size_of::<blocks::BlockQ6K>(),
            GgmlType::Q8K => size_of::<blocks::BlockQ8K>(),
            GgmlType::IQ4NL => size_of::<blocks::BlockIQ4NL>(),
            GgmlType::IQ4XS => size_of::<blocks::BlockIQ4XS>(),
            GgmlType::IQ2XXS => size_of::<blocks::BlockIQ2XXS>(),
            GgmlType::IQ2XS => size_of::<blocks::BlockIQ2XS>(),
            GgmlType::IQ2S => size_of::<blocks::BlockIQ2S>(),
            GgmlType::IQ3XXS => size_of::<blocks::BlockIQ3XXS>(),
            GgmlType::IQ3S => size_of::<blocks::BlockIQ3S>(),
            GgmlType::IQ1S => size_of::<blocks::BlockIQ1S>(),
            GgmlType::IQ1M => size_of::<blocks::BlockIQ1M>(),
            GgmlType::MXFP4 => size_of::<blocks::BlockMXFP4>(),
        }
    }

    /// Bytes of a row of `n` elements, or `None` if `n` is not a whole number of
    /// blocks or the size overflows.
    pub const fn row_bytes(self, n: usize) -> Option<usize> {
        let be = self.block_elems();
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes())
    }

    /// ggml's lower-case name (`"q4_k"`, `"iq4_xs"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q8_1 => "q8_1",
            GgmlType::Q2K => "q2_k",
            GgmlType::Q3K => "q3_k",
            GgmlType::Q4K => "q4_k",
            GgmlType::Q5K => "q5_k",
            GgmlType::Q6K => "q6_k",
            GgmlType::Q8K => "q8_k",
            GgmlType::IQ4NL => "iq4_nl",
            GgmlType::IQ4XS => "iq4_xs",
            GgmlType::IQ2XXS => "iq2_xxs",
            GgmlType::IQ2XS => "iq2_xs",
            GgmlType::IQ2S => "iq2_s",
            GgmlType::IQ3XXS => "iq3_xxs",
            GgmlType::IQ3S => "iq3_s",
            GgmlType::IQ1S => "iq1_s",
            GgmlType::IQ1M => "iq1_m",
            GgmlType::BF16 => "bf16",
            GgmlType::I8 => "i8",
            GgmlType::MXFP4 => "mxfp4",
        }
    }

    /// The type named `name` (case-insensitive ggml name).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Whether the type only serves as an activation format (never a weight).
    pub const fn is_activation_only(self) -> bool {
        matches!(self, GgmlType::Q8_1 | GgmlType::Q8K | GgmlType::I8)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a row could not be (de)quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantError {
    /// The byte length is not a whole number of blocks, or does not match the
    /// number of values.
    Length {
        /// The type.
        ty: GgmlType,
        /// Bytes given.
        bytes: usize,
        /// Values given.
        values: usize,
    },
    /// LES has no quantizer for this type (it can still dequantize it).
    NoQuantizer(GgmlType),
}

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantError::Length { ty, bytes, values } => {
                write!(f, "{bytes} bytes of {ty} cannot hold {values} values")
            }
            QuantError::NoQuantizer(ty) => write!(f, "no quantizer for {ty}"),
        }
    }
}

impl core::error::Error for QuantError {}

fn check(ty: GgmlType, bytes: usize, values: usize) -> Result<(), QuantError> {
    if ty.row_bytes(values) == Some(bytes) {
        Ok(())
    } else {
        Err(QuantError::Length { ty, bytes, values })
    }
}

/// Dequantizes `src` (blocks of `ty`) into `out`; `out.len()` values.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    use blocks::as_blocks;
    check(ty, src.len(), out.len())?;
    // `check` made the length a whole number of blocks, so the views succeed.
    let err = QuantError::Length {
        ty,
        bytes: src.len(),
        values: out.len(),
    };
    match ty {
        GgmlType::F32 => float::dequantize_f32(src, out),
        GgmlType::F16 => float::dequantize_f16(src, out),
        GgmlType::BF16 => float::dequantize_bf16(src, out),
        GgmlType::Q4_0 => legacy::dequantize_q4_0(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q4_1 => legacy::dequantize_q4_1(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q5_0 => legacy::dequantize_q5_0(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q5_1 => legacy::dequantize_q5_1(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q8_0 => legacy::dequantize_q8_0(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q8_1 => legacy::dequantize_q8_1(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q2K => kquants::dequantize_q2k(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q3K => kquants::dequantize_q3k(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q4K => kquants::dequantize_q4k(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q5K => kquants::dequantize_q5k(as_blocks(src).ok_or(err)?, out),
        GgmlType::Q6K => kquants::dequantize_q6k(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ4NL => iq4::dequantize_iq4nl(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ4XS => iq4::dequantize_iq4xs(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ2XXS => iq2::dequantize_iq2xxs(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ2XS => iq2::dequantize_iq2xs(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ2S => iq2::dequantize_iq2s(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ3XXS => iq3::dequantize_iq3xxs(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ3S => iq3::dequantize_iq3s(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ1S => iq1::dequantize_iq1s(as_blocks(src).ok_or(err)?, out),
        GgmlType::IQ1M => iq1::dequantize_iq1m(as_blocks(src).ok_or(err)?, out),
        GgmlType::MXFP4 => mxfp4::dequantize_mxfp4(as_blocks(src).ok_or(err)?, out),
        GgmlType::I8 => {
            for (b, o) in src.iter().zip(out.iter_mut()) {
                *o = *b as i8 as f32;
            }
        }
        GgmlType::Q8K => {
            for (b, o) in as_blocks::<blocks::BlockQ8K>(src)
                .ok_or(err)?
                .iter()
                .zip(out.chunks_exact_mut(QK_K))
            {
                let d = f32::from_le_bytes(b.d);
                for (q, v) in b.qs.iter().zip(o) {
                    *v = d * *q as f32;
                }
            }
        }
    }
    Ok(())
}

/// Quantizes `x` into `out` as blocks of `ty`, with ggml's reference algorithm.
pub fn quantize(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    use blocks::as_blocks_mut;
    check(ty, out.len(), x.len())?;
    let err = QuantError::Length {
        ty,
        bytes: out.len(),
        values: x.len(),
    };
    match ty {
        GgmlType::F32 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => float::quantize_f16(x, out),
        GgmlType::BF16 => float::quantize_bf16(x, out),
        GgmlType::Q4_0 => legacy::quantize_q4_0(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q4_1 => legacy::quantize_q4_1(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q5_0 => legacy::quantize_q5_0(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q5_1 => legacy::quantize_q5_1(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q8_0 => legacy::quantize_q8_0(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q8_1 => legacy::quantize_q8_1(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q4K => kquants::quantize_q4k(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q5K => kquants::quantize_q5k(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q6K => kquants::quantize_q6k(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::Q8K => kquants::quantize_q8k(x, as_blocks_mut(out).ok_or(err)?),
        GgmlType::MXFP4 => mxfp4::quantize_mxfp4(x, as_blocks_mut(out).ok_or(err)?),
        // The types `can_quantize` refuses (`dispatch_checks_lengths_and_round_trips`
        // holds the two to agreeing).
        _ => return Err(QuantError::NoQuantizer(ty)),
    }
    Ok(())
}

/// Whether [`quantize`] supports `ty`.
pub const fn can_quantize(ty: GgmlType) -> bool {
    !matches!(
        ty,
        GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::IQ4NL
            | GgmlType::IQ4XS
            | GgmlType::IQ2XXS
            | GgmlType::IQ2XS
            | GgmlType::IQ2S
            | GgmlType::IQ3XXS
            | GgmlType::IQ3S
            | GgmlType::IQ1S
            | GgmlType::IQ1M
            | GgmlType::I8
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_ggml() {
        let expect = [
            (GgmlType::F32, 1, 4),
            (GgmlType::F16, 1, 2),
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q4_1, 32, 20),
            (GgmlType::Q5_0, 32, 22),
            (GgmlType::Q5_1, 32, 24),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q8_1, 32, 36),
            (GgmlType::Q2K, 256, 84),
            (GgmlType::Q3K, 256, 110),
            (GgmlType::Q4K, 256, 144),
            (GgmlType::Q5K, 256, 176),
            (GgmlType::Q6K, 256, 210),
            (GgmlType::Q8K, 256, 292),
            (GgmlType::IQ4NL, 32, 18),
            (GgmlType::IQ4XS, 256, 136),
            (GgmlType::BF16, 1, 2),
            (GgmlType::I8, 1, 1),
            (GgmlType::MXFP4, 32, 17),
            (GgmlType::IQ2XXS, 256, 66),
            (GgmlType::IQ2XS, 256, 74),
            (GgmlType::IQ2S, 256, 82),
            (GgmlType::IQ3XXS, 256, 98),
            (GgmlType::IQ3S, 256, 110),
            (GgmlType::IQ1S, 256, 50),
            (GgmlType::IQ1M, 256, 56),
        ];
        for (t, elems, bytes) in expect {
            assert_eq!(t.block_elems(), elems, "{t}");
            assert_eq!(t.block_bytes(), bytes, "{t}");
            assert_eq!(GgmlType::from_id(t.id()), Ok(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), Err(UnsupportedType(4)));
        assert_eq!(GgmlType::Q4K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4K.row_bytes(100), None);
    }

    #[test]
    fn dispatch_checks_lengths_and_round_trips() {
        // ggml's test data and error measure (test-quantize-fns.cpp).
        const N: usize = 4096;
        let x: std::vec::Vec<f32> = (0..N).map(|i| 0.1 + 2.0 * libm::cosf(i as f32)).collect();
        let mut y = std::vec![0f32; N];
        let mut buf = std::vec![0u8; 4 * N + 1];
        for ty in GgmlType::ALL {
            let n = ty.row_bytes(N).unwrap();
            assert_eq!(
                dequantize(ty, &buf[..n + 1], &mut y),
                Err(QuantError::Length {
                    ty,
                    bytes: n + 1,
                    values: N
                })
            );
            if !can_quantize(ty) {
                assert_eq!(
                    quantize(ty, &x, &mut buf[..n]),
                    Err(QuantError::NoQuantizer(ty))
                );
                continue;
            }
            quantize(ty, &x, &mut buf[..n]).unwrap();
            dequantize(ty, &buf[..n], &mut y).unwrap();
            let err = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>();
            assert!(libm::sqrtf(err) / (N as f32) < 0.002, "{ty}: {err}");
        }
    }
}
