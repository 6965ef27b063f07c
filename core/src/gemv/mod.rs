//! `y = W x` over a row range, for every weight format LES reads.
//!
//! # Pieces
//!
//! - [`MatrixView`]: a row-major weight matrix in one ggml format, over borrowed
//!   bytes (a tensor in a mapped file, an expert slot).
//! - [`Input`]: the activation vector, prepared once per token by the caller in the
//!   formats the weight types need ([`activation_format`]): `f32` for float weights,
//!   `Q8_0` / `Q8_1` / `Q8_K` blocks for the integer dot products of the quantized
//!   weights (filled with the quantizers of [`crate::quant`]).
//! - [`gemv`]: `y[i - rows.start] = W[i] . x` for `i` in a row range, so the host can
//!   split the rows of one matrix across threads.
//! - [`reference`](mod@reference): the scalar kernels, one per weight format; they define the
//!   result.
//! - [`tile`]: float weights times many tokens at once (a vision tower's
//!   products), three rows by four tokens in registers, in an order of its own
//!   (one 8-lane accumulator a product), the same on every ISA.
//! - [`Isa`]: which kernels to run. SIMD kernels exist for AVX2 (+FMA, F16C) and
//!   AVX-512 (F, BW, VL) on x86-64 and NEON on aarch64; a type without a SIMD kernel
//!   for the chosen ISA runs the reference kernel (AVX-512 falls back to AVX2 first).
//!   `Isa::AvxVnni` and `Isa::Avx512Vnni` sum the integer products of `Q4_K`,
//!   `Q5_K`, `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `IQ4_NL` and `MXFP4` (and, with
//!   AVX-512, `Q6_K`) with `vpdpbusd` (one source, both encodings: `vnni`).
//!   From cache here (`cargo bench -p les-core --bench gemv`): `Q4_K`
//!   1.09-1.20x the AVX2 kernel, `Q5_K` 1.27x, `Q8_0` 1.34x, the other
//!   32-element formats 1.01-1.17x, `Q6_K` 1.09x the AVX-512 kernel without
//!   VNNI.
//!   `Isa::NeonDot` computes every integer format's products with ARMv8.2's
//!   `sdot` (one source with the plain NEON kernels, which widen with
//!   `vmull_s8`), detected at run time (`getauxval` on Linux and Android). The
//!   NEON kernels of both sets are tested under QEMU with
//!   `scripts/test-aarch64.sh`; their speed is not measured (no ARM device here).
//! - Prefetching: on Intel's cores the x86-64 kernels request each row's bytes
//!   [`PREFETCH_DISTANCE`] bytes before they compute it ([`gemv_with_prefetch`]
//!   sets the distance), which made a decode's products from RAM 1.4x faster
//!   there; on AMD's they leave it to the hardware prefetchers, which were
//!   faster alone on a Zen 4 ([`default_prefetch`]). Every kernel walks the rows
//!   as two interleaved streams, which the hardware prefetchers follow at once
//!   (1.17-1.25x more from RAM). The NEON kernels rely on the hardware
//!   prefetchers (not measured on an ARM device).
//!
//! # Exactness
//!
//! Every SIMD kernel returns a result **bit-identical** to the reference kernel for
//! all finite inputs (with NaN or infinite inputs both return NaN or infinities, but
//! NaN payloads may differ). This is by construction:
//!
//! - Quantized formats: the integer dot product of a block (32 elements) or
//!   super-block (256 elements) is computed exactly in `i32` (no saturating or
//!   overflowing step on any input bytes), and integer addition is associative, so
//!   every ISA gets the same integer. The float part is then a fixed sequence of
//!   `f32` multiplies and adds, never fused:
//!   - 32-element formats: block `b` goes to accumulator `b % 4`,
//!     `acc[b % 4] += (d_w * d_x) * isum as f32` (plus `m_w * s_x` for `Q4_1`/`Q5_1`),
//!     and the result is `(acc[0] + acc[2]) + (acc[1] + acc[3])`.
//!   - K-quants and `IQ4_XS`: one accumulator in super-block order,
//!     `acc += d * sumi as f32` (minus `dmin * summs as f32` for the formats with
//!     mins), `d = d_w * d_x`, `dmin = dmin_w * d_x`.
//! - Float formats (`F32`, `F16`, `BF16` weights with `f32` activations): element
//!   `i` goes to lane `i % 64` of 64 partial sums, each updated with a fused
//!   multiply-add (`libm::fmaf` in the reference, the FMA instruction in the SIMD
//!   kernels), and the 64 lanes are folded by halves (`s[l] += s[l + 32]`, then
//!   `+ 16`, ... `+ 1`). 64 lanes give AVX2 eight independent FMA chains and
//!   AVX-512 four, enough to hide the FMA latency.
//!
//! The integer math is ggml's (`ggml_vec_dot_*` in `ggml-cpu`); the float
//! accumulation order is LES's own, so results agree with ggml's to rounding, not to
//! the bit.

use core::fmt;
use core::ops::Range;

use crate::quant::blocks::{
    as_blocks, Block, BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S,
    BlockIQ3XXS, BlockIQ4NL, BlockIQ4XS, BlockMXFP4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
    BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
};
use crate::quant::GgmlType;

pub mod reference;
pub mod tile;
pub mod vector;

#[cfg(target_arch = "x86_64")]
mod avx2;
// The AVX-512 intrinsics are stable since Rust 1.89, later than the MSRV the
// workspace declares: building for x86-64 needs 1.89.
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod cpuid;
#[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
mod hwcap;
#[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
mod neon;
#[cfg(target_arch = "x86_64")]
mod vnni;

#[cfg(test)]
mod tests;

/// An instruction set the kernels can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// The scalar reference kernels; always available.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX2 with AVX-VNNI: the integer formats' products with `vpdpbusd`
    /// (VEX), on CPUs such as Intel's since Alder Lake.
    AvxVnni,
    /// x86-64 AVX-512 F, BW and VL (with AVX2, FMA and F16C).
    Avx512,
    /// x86-64 AVX-512 with AVX-512 VNNI: the integer formats' products with
    /// `vpdpbusd`.
    Avx512Vnni,
    /// aarch64 Advanced SIMD.
    Neon,
    /// aarch64 Advanced SIMD with the dot-product instructions (ARMv8.2
    /// `FEAT_DotProd`, `sdot`): the integer formats' products four at a time.
    NeonDot,
}

impl Isa {
    /// Every ISA, best last.
    pub const ALL: [Isa; 7] = [
        Isa::Scalar,
        Isa::Neon,
        Isa::NeonDot,
        Isa::Avx2,
        Isa::AvxVnni,
        Isa::Avx512,
        Isa::Avx512Vnni,
    ];

    /// The best ISA this CPU supports.
    ///
    /// On x86-64 this asks `cpuid` (and `xgetbv`, whether the OS saves the vector
    /// registers) once and caches the answer; `no_std` has no
    /// `is_x86_feature_detected!`. On aarch64, NEON is part of the target
    /// (`target_feature = "neon"`), so no run-time check is needed; the
    /// dot-product instructions are asked of the OS (`getauxval` on Linux and
    /// Android) unless the build targets them.
    pub fn detect() -> Isa {
        let mut best = Isa::Scalar;
        for isa in Isa::ALL {
            if isa.is_available() {
                best = isa;
            }
        }
        best
    }

    /// Whether this CPU can run the kernels of `self`.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => cpuid::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => cpuid::has_avx_vnni(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => cpuid::has_avx512(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => cpuid::has_avx512_vnni(),
            #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
            Isa::Neon => true,
            #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
            Isa::NeonDot => hwcap::has_dotprod(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every ISA this CPU supports, `Scalar` first.
    pub fn available() -> impl Iterator<Item = Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available())
    }

    /// A short lower-case name (`"scalar"`, `"avx2"`, `"avxvnni"`, `"avx512"`,
    /// `"avx512vnni"`, `"neon"`, `"neondot"`).
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Neon => "neon",
            Isa::NeonDot => "neondot",
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The activation format a weight type's dot product consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivationFormat {
    /// Plain `f32` (weights `F32`, `F16`, `BF16`).
    F32,
    /// [`BlockQ8_0`] blocks (weights `Q4_0`, `Q5_0`, `Q8_0`, `IQ4_NL`).
    Q8_0,
    /// [`BlockQ8_1`] blocks (weights `Q4_1`, `Q5_1`).
    Q8_1,
    /// [`BlockQ8K`] blocks (weights `Q2_K` .. `Q6_K`, `IQ4_XS`).
    Q8K,
}

impl ActivationFormat {
    /// Elements per unit of this format (1 for `f32`, else the block size).
    pub const fn block_elems(self) -> usize {
        match self {
            ActivationFormat::F32 => 1,
            ActivationFormat::Q8_0 | ActivationFormat::Q8_1 => 32,
            ActivationFormat::Q8K => crate::quant::QK_K,
        }
    }
}

/// The activation format `ty` pairs with, or `None` if `ty` cannot be a GEMV weight
/// (`Q8_1` and `Q8_K` are activation-only formats).
pub const fn activation_format(ty: GgmlType) -> Option<ActivationFormat> {
    use GgmlType as T;
    match ty {
        T::F32 | T::F16 | T::BF16 => Some(ActivationFormat::F32),
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4NL | T::MXFP4 => Some(ActivationFormat::Q8_0),
        T::Q4_1 | T::Q5_1 => Some(ActivationFormat::Q8_1),
        T::Q2K
        | T::Q3K
        | T::Q4K
        | T::Q5K
        | T::Q6K
        | T::IQ4XS
        | T::IQ2XXS
        | T::IQ2XS
        | T::IQ2S
        | T::IQ3XXS
        | T::IQ3S
        | T::IQ1S
        | T::IQ1M => Some(ActivationFormat::Q8K),
        T::Q8_1 | T::Q8K | T::I8 => None,
    }
}

/// Why a GEMV call was refused. Nothing is written to `y` when it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvError {
    /// The weight type has no dot product (an activation-only format).
    UnsupportedType(GgmlType),
    /// The row length is not a whole number of blocks of the type, or the matrix
    /// size overflows `usize`.
    RowLength {
        /// Weight type.
        ty: GgmlType,
        /// Requested row length in elements.
        cols: usize,
    },
    /// The matrix bytes are not exactly `rows` rows.
    MatrixBytes {
        /// Bytes `rows` rows need.
        expected: usize,
        /// Bytes given.
        len: usize,
    },
    /// The activation buffer the weight type needs has the wrong length.
    InputLength {
        /// The buffer in question.
        format: ActivationFormat,
        /// Units (floats or blocks) one row needs.
        expected: usize,
        /// Units given.
        len: usize,
    },
    /// The row range is reversed or runs past the matrix.
    RowRange {
        /// Range start.
        start: usize,
        /// Range end.
        end: usize,
        /// Rows in the matrix.
        rows: usize,
    },
    /// `y` does not have one element per row of the range.
    OutputLength {
        /// Rows in the range.
        expected: usize,
        /// Length of `y`.
        len: usize,
    },
    /// The ISA is not supported by this CPU or build.
    IsaUnavailable(Isa),
}

impl fmt::Display for GemvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            GemvError::UnsupportedType(ty) => write!(f, "{ty} cannot be a GEMV weight type"),
            GemvError::RowLength { ty, cols } => {
                write!(f, "row length {cols} is not a whole number of {ty} blocks")
            }
            GemvError::MatrixBytes { expected, len } => {
                write!(f, "matrix needs {expected} bytes, got {len}")
            }
            GemvError::InputLength {
                format,
                expected,
                len,
            } => write!(f, "{format:?} activations: need {expected}, got {len}"),
            GemvError::RowRange { start, end, rows } => {
                write!(f, "row range {start}..{end} outside a {rows}-row matrix")
            }
            GemvError::OutputLength { expected, len } => {
                write!(f, "output needs {expected} elements, got {len}")
            }
            GemvError::IsaUnavailable(isa) => write!(f, "{isa} is not available on this CPU"),
        }
    }
}

impl core::error::Error for GemvError {}

/// A row-major weight matrix: `rows` rows of `cols` elements of type `ty`, each row
/// `ty.row_bytes(cols)` bytes, rows back to back (a ggml 2-D tensor with
/// `ne = {cols, rows}`).
#[derive(Clone, Copy, Debug)]
pub struct MatrixView<'a> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: &'a [u8],
}

impl<'a> MatrixView<'a> {
    /// Views `data` as a `rows` x `cols` matrix of `ty`, checking that the type is a
    /// weight type, that `cols` is a whole number of blocks and that `data` holds
    /// exactly `rows` rows.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, GemvError> {
        if activation_format(ty).is_none() {
            return Err(GemvError::UnsupportedType(ty));
        }
        let row_bytes = ty
            .row_bytes(cols)
            .ok_or(GemvError::RowLength { ty, cols })?;
        let expected = row_bytes
            .checked_mul(rows)
            .ok_or(GemvError::RowLength { ty, cols })?;
        if data.len() != expected {
            return Err(GemvError::MatrixBytes {
                expected,
                len: data.len(),
            });
        }
        Ok(MatrixView {
            ty,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// Weight type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// All rows' bytes, back to back.
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    /// The bytes of row `i`, if it exists.
    pub fn row(&self, i: usize) -> Option<&'a [u8]> {
        if i >= self.rows {
            return None;
        }
        self.data.get(i * self.row_bytes..(i + 1) * self.row_bytes)
    }
}

/// The activation vector `x`, in the formats the weight types need.
///
/// Only the buffer of the matrix's [`activation_format`] is read; leave the others
/// empty. The caller fills them once per token: `f32` is `x` itself; the block
/// buffers come from the activation quantizers of [`crate::quant`] (`Q8_0`, `Q8_1`,
/// `Q8_K`) applied to `x`, `cols / 32` or `cols / 256` blocks.
#[derive(Clone, Copy, Debug, Default)]
pub struct Input<'a> {
    /// `x` as `f32`, `cols` elements.
    pub f32: &'a [f32],
    /// `x` as `Q8_0` blocks, `cols / 32` of them.
    pub q8_0: &'a [BlockQ8_0],
    /// `x` as `Q8_1` blocks, `cols / 32` of them.
    pub q8_1: &'a [BlockQ8_1],
    /// `x` as `Q8_K` blocks, `cols / 256` of them.
    pub q8k: &'a [BlockQ8K],
}

impl<'a> Input<'a> {
    /// The length (floats or blocks) of the buffer for `format`.
    pub fn len_of(&self, format: ActivationFormat) -> usize {
        match format {
            ActivationFormat::F32 => self.f32.len(),
            ActivationFormat::Q8_0 => self.q8_0.len(),
            ActivationFormat::Q8_1 => self.q8_1.len(),
            ActivationFormat::Q8K => self.q8k.len(),
        }
    }
}

/// How far ahead, in bytes of the matrix, the x86-64 kernels prefetch the
/// weights on CPUs where that pays ([`default_prefetch`]): while they compute one
/// row, the row that starts this many bytes later is requested from memory.
///
/// A decode reads each weight once, from RAM. On Intel's cores measured here the
/// hardware prefetchers alone left the AVX2 `Q4_K` product at about half the
/// bandwidth of a plain read loop on two cores; requesting the bytes ~4 KiB ahead
/// lets the loads overlap the arithmetic (1.37x on two threads, 1.45x on one;
/// `cargo bench -p les --bench matvec` prints both, side by side).
pub const PREFETCH_DISTANCE: usize = 4096;

/// The prefetch distance [`gemv`] and [`gemm`] use on this CPU: 0 (none) on AMD's
/// (and Hygon's) x86-64 cores, whose hardware prefetchers stream the weights
/// faster alone (a Zen 4 EPYC: the `Q4_K` expert products from RAM 1.00-1.33x
/// faster without, never slower, at any distance from 256 B to 8 KiB), else
/// [`PREFETCH_DISTANCE`]. Only the x86-64 kernels prefetch; the others ignore
/// the distance, and no distance changes a result.
pub fn default_prefetch() -> usize {
    #[cfg(target_arch = "x86_64")]
    if cpuid::is_amd() {
        return 0;
    }
    PREFETCH_DISTANCE
}

/// Runs `$body` with `$k` bound to the kernels token of `$isa` (returning
/// [`GemvError::IsaUnavailable`] from the enclosing function where this CPU or
/// build lacks it): the one dispatch from an [`Isa`] to the [`Kernels`] that
/// implement it.
macro_rules! with_kernels {
    ($isa:expr, |$k:ident| $body:expr) => {
        match $isa {
            Isa::Scalar => {
                let $k = Scalar;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                let $k = avx2::Avx2::new().ok_or(GemvError::IsaUnavailable($isa))?;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => {
                let $k = vnni::AvxVnni::new().ok_or(GemvError::IsaUnavailable($isa))?;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                let $k = avx512::Avx512::new().ok_or(GemvError::IsaUnavailable($isa))?;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                let $k = avx512::Avx512Vnni::new().ok_or(GemvError::IsaUnavailable($isa))?;
                $body
            }
            #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
            Isa::Neon => {
                let $k = neon::Neon;
                $body
            }
            #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
            Isa::NeonDot => {
                let $k = neon::NeonDot::new().ok_or(GemvError::IsaUnavailable($isa))?;
                $body
            }
            #[allow(unreachable_patterns)]
            _ => return Err(GemvError::IsaUnavailable($isa)),
        }
    };
}

/// Computes `y[i - rows.start] = W[i] . x` for every row `i` in `rows`, with the
/// kernels of `isa`, prefetching [`default_prefetch`] bytes ahead.
///
/// Checks every length first (the matrix bytes may come from a file) and returns an
/// error instead of panicking; on error `y` is untouched. The result does not depend
/// on `isa` nor on how the rows are split across calls (see the module docs).
pub fn gemv(
    isa: Isa,
    matrix: &MatrixView<'_>,
    input: &Input<'_>,
    rows: Range<usize>,
    y: &mut [f32],
) -> Result<(), GemvError> {
    gemv_with_prefetch(isa, matrix, input, rows, y, default_prefetch())
}

/// Bytes of weight rows a [`gemm`] tile holds at most: they are read from memory
/// once and stay in cache while every input is multiplied by them.
pub const GEMM_TILE_BYTES: usize = 64 << 10;

/// [`gemv`] of several inputs: `ys[c][i - rows.start] = W[i] . inputs[c]`. The
/// rows are taken in tiles of about [`GEMM_TILE_BYTES`], each multiplied by
/// every input while it is in cache, so the weights are read from memory once
/// instead of once an input. Each element is [`gemv`]'s, bit for bit (the same
/// kernel on the same row and input). On error nothing is written. The first
/// input's pass over a tile prefetches [`default_prefetch`] bytes ahead.
pub fn gemm(
    isa: Isa,
    matrix: &MatrixView<'_>,
    inputs: &[Input<'_>],
    rows: Range<usize>,
    ys: &mut [&mut [f32]],
) -> Result<(), GemvError> {
    gemm_with_prefetch(isa, matrix, inputs, rows, ys, default_prefetch())
}

/// [`gemm`] with the prefetch distance of the first input's pass over each tile
/// given (0 = none; see [`gemv_with_prefetch`]). The result is the same for
/// every distance.
pub fn gemm_with_prefetch(
    isa: Isa,
    matrix: &MatrixView<'_>,
    inputs: &[Input<'_>],
    rows: Range<usize>,
    ys: &mut [&mut [f32]],
    prefetch: usize,
) -> Result<(), GemvError> {
    if ys.len() != inputs.len() {
        return Err(GemvError::OutputLength {
            expected: inputs.len(),
            len: ys.len(),
        });
    }
    // Every error of a tile is one of these: check them before writing.
    for (x, y) in inputs.iter().zip(ys.iter()) {
        gemv(isa, matrix, x, rows.start..rows.start, &mut [])?;
        if y.len() != rows.len() {
            return Err(GemvError::OutputLength {
                expected: rows.len(),
                len: y.len(),
            });
        }
    }
    check_row_range(matrix, &rows)?;
    let tile = (GEMM_TILE_BYTES / matrix.row_bytes.max(1)).max(1);
    let grouped = inputs.len() > 1 && is_grouped(matrix.ty);
    let mut start = rows.start;
    while start < rows.end {
        let end = (start + tile).min(rows.end);
        if grouped {
            let data = &matrix.data[start * matrix.row_bytes..end * matrix.row_bytes];
            let out = start - rows.start;
            with_kernels!(isa, |k| tile_in_groups(
                k, matrix, data, inputs, ys, out, prefetch
            ));
        } else {
            for (c, (x, y)) in inputs.iter().zip(ys.iter_mut()).enumerate() {
                // The first input reads the tile from memory: prefetch for it.
                let ahead = if c == 0 { prefetch } else { 0 };
                let out = &mut y[start - rows.start..end - rows.start];
                gemv_with_prefetch(isa, matrix, x, start..end, out, ahead)?;
            }
        }
        start = end;
    }
    Ok(())
}

/// Whether [`gemm`] takes `ty`'s rows in groups of inputs (the kernels'
/// `_n` methods): every type paired with `Q8_K` activations but `Q2_K` and
/// `Q3_K`.
const fn is_grouped(ty: GgmlType) -> bool {
    matches!(activation_format(ty), Some(ActivationFormat::Q8K))
        && !matches!(ty, GgmlType::Q2K | GgmlType::Q3K)
}

/// Most inputs a [`gemm`] kernel call takes at once (`Q4_K`, `Q5_K`, `Q6_K`,
/// `IQ4_XS` and the lattice types): the row's blocks are unpacked once for
/// all of them.
pub const GEMM_GROUP: usize = 4;

/// A tile of a matrix of a grouped type ([`GEMM_GROUP`]; `data`, whole rows)
/// times every input,
/// into `ys[c][out..]`: the inputs in groups of up to [`GEMM_GROUP`] through
/// the kernels' `_n` methods (the first group prefetches `prefetch` bytes
/// ahead, as the tile comes from memory for it). Lengths are checked by
/// [`gemm`].
fn tile_in_groups<K: Kernels>(
    k: K,
    m: &MatrixView<'_>,
    data: &[u8],
    inputs: &[Input<'_>],
    ys: &mut [&mut [f32]],
    out: usize,
    prefetch: usize,
) {
    let mut c = 0;
    while c < inputs.len() {
        let ahead = if c == 0 { prefetch } else { 0 };
        let (xs, ys) = (&inputs[c..], &mut ys[c..]);
        c += match xs.len() {
            1 => group::<K, 1>(k, m, data, xs, ys, out, ahead),
            2 => group::<K, 2>(k, m, data, xs, ys, out, ahead),
            3 => group::<K, 3>(k, m, data, xs, ys, out, ahead),
            _ => group::<K, GEMM_GROUP>(k, m, data, xs, ys, out, ahead),
        };
    }
}

/// The first `N` of `xs` times every row of `data` into `ys[c][out + row]`;
/// returns `N`.
#[inline(always)]
fn group<K: Kernels, const N: usize>(
    k: K,
    m: &MatrixView<'_>,
    data: &[u8],
    xs: &[Input<'_>],
    ys: &mut [&mut [f32]],
    out: usize,
    prefetch: usize,
) -> usize {
    let x: [&[BlockQ8K]; N] = core::array::from_fn(|c| xs[c].q8k);
    let rb = m.row_bytes.max(1);
    for (i, row) in data.chunks_exact(rb).enumerate() {
        if K::PREFETCHES && prefetch > 0 {
            k.prefetch(bytes_ahead(data, i * rb, prefetch, rb));
        }
        let r = match m.ty {
            GgmlType::Q4K => k.q4_k_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::Q5K => k.q5_k_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::IQ4XS => k.iq4_xs_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::IQ2XXS => k.iq2_xxs_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::IQ2XS => k.iq2_xs_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::IQ2S => k.iq2_s_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::IQ3XXS => k.iq3_xxs_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::IQ3S => k.iq3_s_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::IQ1S => k.iq1_s_n(as_blocks(row).unwrap_or(&[]), x),
            GgmlType::IQ1M => k.iq1_m_n(as_blocks(row).unwrap_or(&[]), x),
            _ => k.q6_k_n(as_blocks(row).unwrap_or(&[]), x),
        };
        for (y, r) in ys.iter_mut().zip(r) {
            y[out + i] = r;
        }
    }
    N
}

/// [`gemv`] with the prefetch distance given: `prefetch` bytes ahead of the row
/// being computed, within `rows` (0 = none). Prefetching is a hint: the result
/// is the same for every distance. Only the x86-64 kernels issue prefetches
/// (`Isa::Avx2`, `Isa::AvxVnni`, `Isa::Avx512`, `Isa::Avx512Vnni`); the others
/// ignore the distance.
pub fn gemv_with_prefetch(
    isa: Isa,
    matrix: &MatrixView<'_>,
    input: &Input<'_>,
    rows: Range<usize>,
    y: &mut [f32],
    prefetch: usize,
) -> Result<(), GemvError> {
    let format = activation_format(matrix.ty).ok_or(GemvError::UnsupportedType(matrix.ty))?;
    let expected = matrix.cols / format.block_elems();
    let len = input.len_of(format);
    if len != expected {
        return Err(GemvError::InputLength {
            format,
            expected,
            len,
        });
    }
    check_row_range(matrix, &rows)?;
    if y.len() != rows.len() {
        return Err(GemvError::OutputLength {
            expected: rows.len(),
            len: y.len(),
        });
    }
    let data = &matrix.data[rows.start * matrix.row_bytes..rows.end * matrix.row_bytes];
    with_kernels!(isa, |k| run(k, matrix, data, input, y, prefetch));
    Ok(())
}

/// `rows` as a range of `matrix`'s rows, or [`GemvError::RowRange`].
pub(crate) fn check_row_range(
    matrix: &MatrixView<'_>,
    rows: &Range<usize>,
) -> Result<(), GemvError> {
    if rows.start > rows.end || rows.end > matrix.rows {
        return Err(GemvError::RowRange {
            start: rows.start,
            end: rows.end,
            rows: matrix.rows,
        });
    }
    Ok(())
}

/// The dot-product kernels of one ISA; every method defaults to the reference
/// kernel, and an ISA overrides those it accelerates. Each takes one weight row and
/// the matching activations, of equal lengths (checked by [`gemv`]).
pub(crate) trait Kernels: Copy {
    /// Whether [`prefetch`](Self::prefetch) does anything (else the row loop
    /// does not compute what to prefetch).
    const PREFETCHES: bool = false;
    /// Hints that `bytes` will be read soon; the default does nothing.
    fn prefetch(self, bytes: &[u8]) {
        let _ = bytes;
    }
    fn f32(self, w: &[u8], x: &[f32]) -> f32 {
        reference::dot_f32(w, x)
    }
    fn f16(self, w: &[u8], x: &[f32]) -> f32 {
        reference::dot_f16(w, x)
    }
    fn bf16(self, w: &[u8], x: &[f32]) -> f32 {
        reference::dot_bf16(w, x)
    }
    fn q4_0(self, w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
        reference::dot_q4_0(w, x)
    }
    fn q4_1(self, w: &[BlockQ4_1], x: &[BlockQ8_1]) -> f32 {
        reference::dot_q4_1(w, x)
    }
    fn q5_0(self, w: &[BlockQ5_0], x: &[BlockQ8_0]) -> f32 {
        reference::dot_q5_0(w, x)
    }
    fn q5_1(self, w: &[BlockQ5_1], x: &[BlockQ8_1]) -> f32 {
        reference::dot_q5_1(w, x)
    }
    fn q8_0(self, w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
        reference::dot_q8_0(w, x)
    }
    fn iq4_nl(self, w: &[BlockIQ4NL], x: &[BlockQ8_0]) -> f32 {
        reference::dot_iq4_nl(w, x)
    }
    fn mxfp4(self, w: &[BlockMXFP4], x: &[BlockQ8_0]) -> f32 {
        reference::dot_mxfp4(w, x)
    }
    fn q2_k(self, w: &[BlockQ2K], x: &[BlockQ8K]) -> f32 {
        reference::dot_q2_k(w, x)
    }
    fn q3_k(self, w: &[BlockQ3K], x: &[BlockQ8K]) -> f32 {
        reference::dot_q3_k(w, x)
    }
    fn q4_k(self, w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
        reference::dot_q4_k(w, x)
    }
    /// [`q4_k`](Self::q4_k) of one row and `N` inputs, each result its bits
    /// (an ISA overrides it where it unpacks the row once for all of them).
    fn q4_k_n<const N: usize>(self, w: &[BlockQ4K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.q4_k(w, x))
    }
    /// [`q6_k`](Self::q6_k) of one row and `N` inputs, as [`q4_k_n`](Self::q4_k_n).
    fn q6_k_n<const N: usize>(self, w: &[BlockQ6K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.q6_k(w, x))
    }
    fn q5_k(self, w: &[BlockQ5K], x: &[BlockQ8K]) -> f32 {
        reference::dot_q5_k(w, x)
    }
    /// [`q5_k`](Self::q5_k) of one row and `N` inputs, as [`q4_k_n`](Self::q4_k_n).
    fn q5_k_n<const N: usize>(self, w: &[BlockQ5K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.q5_k(w, x))
    }
    fn q6_k(self, w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
        reference::dot_q6_k(w, x)
    }
    fn iq4_xs(self, w: &[BlockIQ4XS], x: &[BlockQ8K]) -> f32 {
        reference::dot_iq4_xs(w, x)
    }
    /// [`iq4_xs`](Self::iq4_xs) of one row and `N` inputs, as
    /// [`q4_k_n`](Self::q4_k_n).
    fn iq4_xs_n<const N: usize>(self, w: &[BlockIQ4XS], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.iq4_xs(w, x))
    }
    fn iq2_xxs(self, w: &[BlockIQ2XXS], x: &[BlockQ8K]) -> f32 {
        reference::dot_iq2_xxs(w, x)
    }
    /// [`iq2_xxs`](Self::iq2_xxs) of one row and `N` inputs, as
    /// [`q4_k_n`](Self::q4_k_n); likewise the other lattice types' `_n`.
    fn iq2_xxs_n<const N: usize>(self, w: &[BlockIQ2XXS], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.iq2_xxs(w, x))
    }
    fn iq2_xs(self, w: &[BlockIQ2XS], x: &[BlockQ8K]) -> f32 {
        reference::dot_iq2_xs(w, x)
    }
    fn iq2_xs_n<const N: usize>(self, w: &[BlockIQ2XS], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.iq2_xs(w, x))
    }
    fn iq2_s(self, w: &[BlockIQ2S], x: &[BlockQ8K]) -> f32 {
        reference::dot_iq2_s(w, x)
    }
    fn iq2_s_n<const N: usize>(self, w: &[BlockIQ2S], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.iq2_s(w, x))
    }
    fn iq3_xxs(self, w: &[BlockIQ3XXS], x: &[BlockQ8K]) -> f32 {
        reference::dot_iq3_xxs(w, x)
    }
    fn iq3_xxs_n<const N: usize>(self, w: &[BlockIQ3XXS], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.iq3_xxs(w, x))
    }
    fn iq3_s(self, w: &[BlockIQ3S], x: &[BlockQ8K]) -> f32 {
        reference::dot_iq3_s(w, x)
    }
    fn iq3_s_n<const N: usize>(self, w: &[BlockIQ3S], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.iq3_s(w, x))
    }
    fn iq1_s(self, w: &[BlockIQ1S], x: &[BlockQ8K]) -> f32 {
        reference::dot_iq1_s(w, x)
    }
    fn iq1_s_n<const N: usize>(self, w: &[BlockIQ1S], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.iq1_s(w, x))
    }
    fn iq1_m(self, w: &[BlockIQ1M], x: &[BlockQ8K]) -> f32 {
        reference::dot_iq1_m(w, x)
    }
    fn iq1_m_n<const N: usize>(self, w: &[BlockIQ1M], x: [&[BlockQ8K]; N]) -> [f32; N] {
        x.map(|x| self.iq1_m(w, x))
    }
}

/// The sign multipliers of the lattice kernels: for each sign byte `b`, eight
/// bytes, byte `j` `-1` (`0xff`) where bit `j` of `b` is set, else `1`.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub(crate) const SIGN_BYTES: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut w = 0u64;
        let mut j = 0;
        while j < 8 {
            let byte: u64 = if (b >> j) & 1 != 0 { 0xff } else { 0x01 };
            w |= byte << (8 * j);
            j += 1;
        }
        t[b] = w;
        b += 1;
    }
    t
};

/// Invokes `$m! { $($pre)* ... }` with the lattice types' one-input
/// `Kernels` methods (`iq2_xxs(&[BlockIQ2XXS], &[BlockQ8K]);` and the
/// like), for the ISA tokens' forwarding macros; the block types must be in
/// scope where it expands.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(unused_macros)
)]
macro_rules! lattice_methods {
    ($m:ident! { $($pre:tt)* }) => {
        $m! {
            $($pre)*
            iq2_xxs(&[BlockIQ2XXS], &[BlockQ8K]);
            iq2_xs(&[BlockIQ2XS], &[BlockQ8K]);
            iq2_s(&[BlockIQ2S], &[BlockQ8K]);
            iq3_xxs(&[BlockIQ3XXS], &[BlockQ8K]);
            iq3_s(&[BlockIQ3S], &[BlockQ8K]);
            iq1_s(&[BlockIQ1S], &[BlockQ8K]);
            iq1_m(&[BlockIQ1M], &[BlockQ8K]);
        }
    };
}
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(unused_imports)
)]
pub(crate) use lattice_methods;

/// As [`lattice_methods!`], the grouped methods (`iq2_xxs_n(BlockIQ2XXS);`
/// and the like) of the lattice types that have grouped kernels on every
/// SIMD ISA.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(unused_macros)
)]
macro_rules! lattice_group_methods {
    ($m:ident! { $($pre:tt)* }) => {
        $m! {
            $($pre)*
            iq2_xxs_n(BlockIQ2XXS);
            iq2_xs_n(BlockIQ2XS);
            iq2_s_n(BlockIQ2S);
            iq3_xxs_n(BlockIQ3XXS);
            iq3_s_n(BlockIQ3S);
        }
    };
}
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(unused_imports)
)]
pub(crate) use lattice_group_methods;

/// The reference kernels.
#[derive(Clone, Copy)]
struct Scalar;

impl Kernels for Scalar {}

/// The `len` bytes of `data` that start `ahead` bytes after `at`, cut at its end
/// (empty past it).
#[inline(always)]
fn bytes_ahead(data: &[u8], at: usize, ahead: usize, len: usize) -> &[u8] {
    let start = at.saturating_add(ahead).min(data.len());
    let end = start.saturating_add(len).min(data.len());
    &data[start..end]
}

/// Runs `dot` on every row of `data` as raw bytes, first asking `k` to prefetch
/// the row `prefetch` bytes ahead (none when 0). The rows go in two interleaved
/// streams (row `i` of the first half, then row `i` of the second): from RAM,
/// two threads computed 1 GiB of `Q4_K` expert matrices at 21.8-21.9 GB/s
/// against 18.6-18.8 in one stream, and the 255 MB `Q6_K` output matrix in
/// 12.4-12.7 ms against 15.7-15.8 (`cargo bench -p les --bench matvec`); from
/// cache it costs 4-11%. Each row's result does not depend on the order.
#[inline(always)]
fn rows_of_bytes<K: Kernels>(
    k: K,
    data: &[u8],
    row_bytes: usize,
    y: &mut [f32],
    prefetch: usize,
    mut dot: impl FnMut(&[u8]) -> f32,
) {
    if row_bytes == 0 {
        y.fill(dot(&[]));
        return;
    }
    // Two streams: the first half of the rows and the second, a row of each in
    // turn, so the hardware prefetchers follow two sequences of pages at once.
    let n = (data.len() / row_bytes).min(y.len());
    let half = n / 2;
    let (first, second) = data[..n * row_bytes].split_at(half * row_bytes);
    let (y_first, y_second) = y[..n].split_at_mut(half);
    let mut one = |at: usize, row: &[u8], out: &mut f32| {
        if K::PREFETCHES && prefetch > 0 {
            k.prefetch(bytes_ahead(data, at, prefetch, row_bytes));
        }
        *out = dot(row);
    };
    let pairs = first.chunks_exact(row_bytes).zip(y_first.iter_mut());
    let pairs = pairs.zip(second.chunks_exact(row_bytes).zip(y_second.iter_mut()));
    for (i, ((ra, oa), (rb, ob))) in pairs.enumerate() {
        one(i * row_bytes, ra, oa);
        one((half + i) * row_bytes, rb, ob);
    }
    if n % 2 == 1 {
        let last = (n - 1) * row_bytes;
        one(last, &data[last..last + row_bytes], &mut y[n - 1]);
    }
}

/// [`rows_of_bytes`] with each row viewed as blocks.
#[inline(always)]
fn rows_of<K: Kernels, B: Block>(
    k: K,
    data: &[u8],
    row_bytes: usize,
    y: &mut [f32],
    prefetch: usize,
    mut dot: impl FnMut(&[B]) -> f32,
) {
    // A row is a whole number of blocks (checked by `MatrixView::new`).
    rows_of_bytes(k, data, row_bytes, y, prefetch, |row| {
        dot(as_blocks::<B>(row).unwrap_or(&[]))
    });
}

/// Validated dispatch over the weight type: `data` holds exactly `y.len()` rows.
fn run<K: Kernels>(
    k: K,
    m: &MatrixView<'_>,
    data: &[u8],
    x: &Input<'_>,
    y: &mut [f32],
    prefetch: usize,
) {
    let rb = m.row_bytes;
    use GgmlType as T;
    match m.ty {
        T::F32 => rows_of_bytes(k, data, rb, y, prefetch, |w| k.f32(w, x.f32)),
        T::F16 => rows_of_bytes(k, data, rb, y, prefetch, |w| k.f16(w, x.f32)),
        T::BF16 => rows_of_bytes(k, data, rb, y, prefetch, |w| k.bf16(w, x.f32)),
        T::Q4_0 => rows_of(k, data, rb, y, prefetch, |w| k.q4_0(w, x.q8_0)),
        T::Q4_1 => rows_of(k, data, rb, y, prefetch, |w| k.q4_1(w, x.q8_1)),
        T::Q5_0 => rows_of(k, data, rb, y, prefetch, |w| k.q5_0(w, x.q8_0)),
        T::Q5_1 => rows_of(k, data, rb, y, prefetch, |w| k.q5_1(w, x.q8_1)),
        T::Q8_0 => rows_of(k, data, rb, y, prefetch, |w| k.q8_0(w, x.q8_0)),
        T::IQ4NL => rows_of(k, data, rb, y, prefetch, |w| k.iq4_nl(w, x.q8_0)),
        T::MXFP4 => rows_of(k, data, rb, y, prefetch, |w| k.mxfp4(w, x.q8_0)),
        T::Q2K => rows_of(k, data, rb, y, prefetch, |w| k.q2_k(w, x.q8k)),
        T::Q3K => rows_of(k, data, rb, y, prefetch, |w| k.q3_k(w, x.q8k)),
        T::Q4K => rows_of(k, data, rb, y, prefetch, |w| k.q4_k(w, x.q8k)),
        T::Q5K => rows_of(k, data, rb, y, prefetch, |w| k.q5_k(w, x.q8k)),
        T::Q6K => rows_of(k, data, rb, y, prefetch, |w| k.q6_k(w, x.q8k)),
        T::IQ4XS => rows_of(k, data, rb, y, prefetch, |w| k.iq4_xs(w, x.q8k)),
        T::IQ2XXS => rows_of(k, data, rb, y, prefetch, |w| k.iq2_xxs(w, x.q8k)),
        T::IQ2XS => rows_of(k, data, rb, y, prefetch, |w| k.iq2_xs(w, x.q8k)),
        T::IQ2S => rows_of(k, data, rb, y, prefetch, |w| k.iq2_s(w, x.q8k)),
        T::IQ3XXS => rows_of(k, data, rb, y, prefetch, |w| k.iq3_xxs(w, x.q8k)),
        T::IQ3S => rows_of(k, data, rb, y, prefetch, |w| k.iq3_s(w, x.q8k)),
        T::IQ1S => rows_of(k, data, rb, y, prefetch, |w| k.iq1_s(w, x.q8k)),
        T::IQ1M => rows_of(k, data, rb, y, prefetch, |w| k.iq1_m(w, x.q8k)),
        // Rejected by `MatrixView::new`.
        T::Q8_1 | T::Q8K | T::I8 => y.fill(0.0),
    }
}

/// Computes the dot product of one weight row (`row`, the bytes of `cols` elements
/// of `ty`) with `input`, with the kernels of `isa`: [`gemv`] on a one-row matrix.
pub fn dot(
    isa: Isa,
    ty: GgmlType,
    cols: usize,
    row: &[u8],
    input: &Input<'_>,
) -> Result<f32, GemvError> {
    let m = MatrixView::new(ty, 1, cols, row)?;
    let mut y = [0.0f32];
    gemv(isa, &m, input, 0..1, &mut y)?;
    Ok(y[0])
}
