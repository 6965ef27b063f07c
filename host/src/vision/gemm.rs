//! Matrix products over many tokens (`Y = X W^T`), multi-threaded on a [`Pool`].
//!
//! A vision transformer multiplies every weight matrix by hundreds or thousands
//! of patch vectors at once: a GEMM, not a GEMV. [`matmul`] tiles the product
//! into (token block) x (row block) tasks that the pool's threads claim
//! dynamically. Within a tile, each token's activations are multiplied by a block
//! of weight rows small enough to stay in cache while the block's tokens go by,
//! so the weights stream from memory once per token block instead of once per
//! token.
//!
//! Float weights (f32, f16, bf16: what vision towers ship) go through
//! [`les_core::gemv::tile::float_tile`], three rows by four tokens in registers;
//! every other type through [`les_core::gemv::gemv`], one token at a time, with
//! the activations quantized once per token as that type's dot product
//! requires. Either way each output element is computed in one fixed order, so
//! the result does not depend on the tiling or the thread count.

use std::sync::Mutex;

use les_core::gemv::tile::{self, float_tile, tiles};
use les_core::gemv::{
    activation_format, gemv, gemv_with_prefetch, ActivationFormat, GemvError, Input, Isa,
    MatrixView,
};
use les_core::quant::blocks::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use les_core::quant::{kquants, legacy, QK_K};

use crate::compute::Pool;

/// Tokens per tile.
const TOKEN_BLOCK: usize = 16;
/// Weight bytes per row block (about half a typical L2 cache).
const ROW_BLOCK_BYTES: usize = 128 * 1024;

/// The activations of all tokens, in the format one weight type consumes.
enum Activations<'x> {
    F32(&'x [f32]),
    Q8_0(Vec<BlockQ8_0>),
    Q8_1(Vec<BlockQ8_1>),
    Q8K(Vec<BlockQ8K>),
}

impl Activations<'_> {
    /// The [`Input`] of token `t` (of `cols` elements).
    fn input(&self, t: usize, cols: usize) -> Input<'_> {
        let mut input = Input::default();
        match self {
            Activations::F32(x) => input.f32 = &x[t * cols..(t + 1) * cols],
            Activations::Q8_0(b) => input.q8_0 = &b[t * cols / 32..(t + 1) * cols / 32],
            Activations::Q8_1(b) => input.q8_1 = &b[t * cols / 32..(t + 1) * cols / 32],
            Activations::Q8K(b) => input.q8k = &b[t * cols / QK_K..(t + 1) * cols / QK_K],
        }
        input
    }
}

fn quantize_all<'x>(
    format: ActivationFormat,
    x: &'x [f32],
    cols: usize,
) -> Result<Activations<'x>, GemvError> {
    let bad = |block: usize| GemvError::InputLength {
        format,
        expected: cols / block,
        len: 0,
    };
    Ok(match format {
        ActivationFormat::F32 => Activations::F32(x),
        ActivationFormat::Q8_0 | ActivationFormat::Q8_1 => {
            if !cols.is_multiple_of(32) {
                return Err(bad(32));
            }
            let n = x.len() / 32;
            if format == ActivationFormat::Q8_0 {
                let mut b = vec![
                    BlockQ8_0 {
                        d: [0; 2],
                        qs: [0; 32]
                    };
                    n
                ];
                for (xs, bs) in x.chunks_exact(cols).zip(b.chunks_exact_mut(cols / 32)) {
                    legacy::quantize_q8_0(xs, bs);
                }
                Activations::Q8_0(b)
            } else {
                let mut b = vec![
                    BlockQ8_1 {
                        d: [0; 2],
                        s: [0; 2],
                        qs: [0; 32]
                    };
                    n
                ];
                for (xs, bs) in x.chunks_exact(cols).zip(b.chunks_exact_mut(cols / 32)) {
                    legacy::quantize_q8_1(xs, bs);
                }
                Activations::Q8_1(b)
            }
        }
        ActivationFormat::Q8K => {
            if !cols.is_multiple_of(QK_K) {
                return Err(bad(QK_K));
            }
            let mut b = vec![
                BlockQ8K {
                    d: [0; 4],
                    qs: [0; QK_K],
                    bsums: [[0; 2]; QK_K / 16],
                };
                x.len() / QK_K
            ];
            for (xs, bs) in x.chunks_exact(cols).zip(b.chunks_exact_mut(cols / QK_K)) {
                kquants::quantize_q8k(xs, bs);
            }
            Activations::Q8K(b)
        }
    })
}

/// Computes `y[t][r] = W[r] . x[t]` for `n` tokens: `x` is `n` rows of `w.cols()`
/// floats, `y` gets `n` rows of `w.rows()` floats. Runs on `pool` when the product
/// is big enough to be worth it.
pub fn matmul(
    pool: &mut Pool,
    isa: Isa,
    w: &MatrixView<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<(), GemvError> {
    let (rows, cols) = (w.rows(), w.cols());
    if x.len() != n * cols {
        return Err(GemvError::InputLength {
            format: ActivationFormat::F32,
            expected: n * cols,
            len: x.len(),
        });
    }
    if y.len() != n * rows {
        return Err(GemvError::OutputLength {
            expected: n * rows,
            len: y.len(),
        });
    }
    if n == 0 || rows == 0 {
        return Ok(());
    }
    let format = activation_format(w.ty()).ok_or(GemvError::UnsupportedType(w.ty()))?;
    let float = tiles(w.ty());
    let acts = quantize_all(format, x, cols)?;
    // Every error that does not depend on the row range, checked once.
    if float {
        float_tile(isa, w, &x[..cols], 1, 0..0, &mut [])?;
    } else {
        gemv(isa, w, &acts.input(0, cols), 0..0, &mut [])?;
    }

    // Float weights: whole register tiles of rows (a leftover row per block
    // would take `float_tile`'s one-row path: 6% of a 4608-wide f16
    // matrix's rows in blocks of 16 cost 15% of its time).
    let step = if float { 16 * tile::ROWS } else { 16 };
    let row_block = (ROW_BLOCK_BYTES / w.row_bytes().max(1))
        .clamp(step, rows.max(step))
        .next_multiple_of(step)
        .min(rows);
    let token_blocks = n.div_ceil(TOKEN_BLOCK);
    let row_blocks = rows.div_ceil(row_block);
    let tasks = token_blocks * row_blocks;
    let out = Mutex::new(y);
    let first_error: Mutex<Option<GemvError>> = Mutex::new(None);
    let acts = &acts;
    let task = |i: usize| {
        let (tb, rb) = (i / row_blocks, i % row_blocks);
        let tokens = tb * TOKEN_BLOCK..((tb + 1) * TOKEN_BLOCK).min(n);
        let r = rb * row_block..((rb + 1) * row_block).min(rows);
        let mut tile = vec![0f32; tokens.len() * r.len()];
        let done = if float {
            let xs = &x[tokens.start * cols..tokens.end * cols];
            float_tile(isa, w, xs, tokens.len(), r.clone(), &mut tile)
        } else {
            tokens
                .clone()
                .zip(tile.chunks_exact_mut(r.len()))
                .try_for_each(|(t, out_t)| {
                    // The tile's rows come from RAM for its first token only;
                    // the others find them in cache, where prefetching only
                    // costs.
                    let prefetch = if t == tokens.start {
                        crate::compute::kernel_prefetch()
                    } else {
                        0
                    };
                    let input = acts.input(t, cols);
                    gemv_with_prefetch(isa, w, &input, r.clone(), out_t, prefetch)
                })
        };
        if let Err(e) = done {
            if let Ok(mut f) = first_error.lock() {
                f.get_or_insert(e);
            }
            return;
        }
        let mut y = out.lock().unwrap_or_else(|p| p.into_inner());
        for (t, tile_t) in tokens.zip(tile.chunks_exact(r.len())) {
            y[t * rows + r.start..t * rows + r.end].copy_from_slice(tile_t);
        }
    };
    if tasks == 1 || n * rows * cols < 1 << 16 {
        (0..tasks).for_each(task);
    } else {
        pool.for_each(tasks, &task);
    }
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::ThreadedMatVec;
    use les_core::model::forward::MatVec;
    use les_core::quant::{quantize, GgmlType};

    fn noise(state: &mut u64) -> f32 {
        *state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Tiles over several row blocks and token blocks (with the prefetch only on
    /// each tile's first token) give every token's product bit for bit: `gemv`'s
    /// for quantized weights, `float_tile`'s (one token at a time, scalar) for
    /// float ones.
    #[test]
    fn matmul_equals_one_product_per_token() {
        let (rows, cols, n) = (300, 2048, 2 * TOKEN_BLOCK + 5);
        let mut st = 7;
        for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::F32, GgmlType::F16] {
            let vals: Vec<f32> = (0..rows * cols).map(|_| noise(&mut st)).collect();
            let mut data = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
            quantize(ty, &vals, &mut data).unwrap();
            let w = MatrixView::new(ty, rows, cols, &data).unwrap();
            assert!(
                rows > ROW_BLOCK_BYTES / w.row_bytes(),
                "{ty:?}: one row block"
            );
            let x: Vec<f32> = (0..n * cols).map(|_| noise(&mut st)).collect();
            let isa = Isa::detect();
            let mut y = vec![f32::NAN; n * rows];
            let mut pool = Pool::new(2);
            matmul(&mut pool, isa, &w, &x, n, &mut y).unwrap();
            let mut mv = ThreadedMatVec::new(1, isa);
            let mut want = vec![0f32; rows];
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                if tiles(ty) {
                    float_tile(Isa::Scalar, &w, xt, 1, 0..rows, &mut want).unwrap();
                } else {
                    mv.matvec(&w, xt, &mut want).unwrap();
                }
                let got = &y[t * rows..(t + 1) * rows];
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{ty:?} token {t}"
                );
            }
        }
    }
}
