//! Requantization through f32, one expert at a time, and the reconstruction
//! error that the bits-per-weight planner weighs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use les_core::layout;
use les_core::quant::{dequantize, quantize, GgmlType, QuantError};

use super::source::{Matrix, SourceLayer};

/// Below this many elements a matrix is converted on the calling thread.
const PARALLEL_MIN_ELEMS: usize = 1 << 16;

/// Converts `rows` rows of `cols` elements from `src` (type `from`) into `dst`
/// (type `to`), splitting the rows across up to `threads` threads. The output
/// does not depend on the thread count: rows are independent.
pub(crate) fn convert_matrix(
    from: GgmlType,
    src: &[u8],
    to: GgmlType,
    dst: &mut [u8],
    rows: usize,
    cols: usize,
    threads: usize,
) -> Result<(), QuantError> {
    if from == to {
        dst.copy_from_slice(src);
        return Ok(());
    }
    let len_err = QuantError::Length {
        ty: from,
        bytes: src.len(),
        values: rows * cols,
    };
    let (Some(src_row), Some(dst_row)) = (from.row_bytes(cols), to.row_bytes(cols)) else {
        return Err(len_err);
    };
    if src.len() != src_row * rows || dst.len() != dst_row * rows {
        return Err(len_err);
    }
    let rows_of = |src: &[u8], dst: &mut [u8]| -> Result<(), QuantError> {
        let mut x = vec![0f32; cols];
        for (s, d) in src.chunks_exact(src_row).zip(dst.chunks_exact_mut(dst_row)) {
            dequantize(from, s, &mut x)?;
            quantize(to, &x, d)?;
        }
        Ok(())
    };
    let threads = threads.clamp(1, rows.max(1));
    if threads == 1 || rows * cols < PARALLEL_MIN_ELEMS {
        return rows_of(src, dst);
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = src
            .chunks(per * src_row)
            .zip(dst.chunks_mut(per * dst_row))
            .map(|(s_part, d_part)| s.spawn(move || rows_of(s_part, d_part)))
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("conversion thread panicked"))
    })
}

/// Builds expert `e` of `layer` with types `to` into `buf` (its matrices back to
/// back, zero padding to `buf.len()`), and returns the checksum of the unpadded bytes.
pub(crate) fn build_expert(
    file: &[u8],
    layer: &SourceLayer,
    to: &[GgmlType],
    e: usize,
    buf: &mut [u8],
    threads: usize,
) -> Result<u32, QuantError> {
    let mut at = 0;
    for (m, &ty) in layer.mats.iter().zip(to) {
        let n = ty.row_bytes(m.cols).ok_or(QuantError::Length {
            ty,
            bytes: 0,
            values: m.cols,
        })? * m.rows;
        convert_matrix(
            m.ty,
            m.expert(file, e),
            ty,
            &mut buf[at..at + n],
            m.rows,
            m.cols,
            threads,
        )?;
        at += n;
    }
    buf[at..].fill(0);
    Ok(layout::checksum(&buf[..at]))
}

/// `k` indices spread evenly over `0..n` (all of them when `k >= n`).
pub(crate) fn spread(n: usize, k: usize) -> Vec<usize> {
    let k = k.min(n);
    (0..k).map(|i| i * n / k).collect()
}

/// The relative reconstruction error of each candidate's types on a
/// sample of `layer`: sum of squared error over sum of squares, against the
/// source dequantized to f32. A matrix whose candidate type equals its source
/// type is copied by the packer, so it contributes no error.
pub(crate) fn measure_layer(
    file: &[u8],
    layer: &SourceLayer,
    n_experts: usize,
    candidates: &[Vec<GgmlType>],
    sample_experts: usize,
    sample_rows: usize,
) -> Result<Vec<f64>, QuantError> {
    let mut sse = vec![0f64; candidates.len()];
    let mut energy = 0f64;
    for e in spread(n_experts, sample_experts.max(1)) {
        for (mi, m) in layer.mats.iter().enumerate() {
            measure_matrix(
                file,
                m,
                e,
                mi,
                candidates,
                sample_rows,
                &mut sse,
                &mut energy,
            )?;
        }
    }
    Ok(sse
        .into_iter()
        .map(|s| if energy > 0.0 { s / energy } else { 0.0 })
        .collect())
}

#[allow(clippy::too_many_arguments)]
fn measure_matrix(
    file: &[u8],
    m: &Matrix,
    e: usize,
    mi: usize,
    candidates: &[Vec<GgmlType>],
    sample_rows: usize,
    sse: &mut [f64],
    energy: &mut f64,
) -> Result<(), QuantError> {
    let data = m.expert(file, e);
    let row_bytes = m.row_bytes();
    let mut x = vec![0f32; m.cols];
    let mut y = vec![0f32; m.cols];
    let mut q = Vec::new();
    for r in spread(m.rows, sample_rows.max(1)) {
        dequantize(m.ty, &data[r * row_bytes..(r + 1) * row_bytes], &mut x)?;
        *energy += x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>();
        for (c, err) in candidates.iter().zip(sse.iter_mut()) {
            let ty = c[mi];
            if ty == m.ty {
                continue;
            }
            let n = ty.row_bytes(m.cols).ok_or(QuantError::Length {
                ty,
                bytes: 0,
                values: m.cols,
            })?;
            q.resize(n, 0);
            quantize(ty, &x, &mut q)?;
            dequantize(ty, &q, &mut y)?;
            *err += x
                .iter()
                .zip(&y)
                .map(|(&a, &b)| {
                    let d = f64::from(a) - f64::from(b);
                    d * d
                })
                .sum::<f64>();
        }
    }
    Ok(())
}

/// Runs `f(i)` for `i in 0..n` on up to `threads` threads; results in index order.
pub(crate) fn par_map<T: Send, E: Send>(
    n: usize,
    threads: usize,
    f: impl Fn(usize) -> Result<T, E> + Sync,
) -> Result<Vec<T>, E> {
    let threads = threads.clamp(1, n.max(1));
    if threads == 1 {
        return (0..n).map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<T, E>>>> = Mutex::new((0..n).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                results.lock().expect("no panics while locked")[i] = Some(r);
            });
        }
    });
    results
        .into_inner()
        .expect("no panics while locked")
        .into_iter()
        .map(|r| r.expect("every index was run"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn convert_is_thread_count_independent() {
        let (rows, cols) = (64, 2048);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| 0.1 + 2.0 * (i as f32 * 0.37).cos())
            .collect();
        let mut src = vec![0u8; GgmlType::F16.row_bytes(cols).unwrap() * rows];
        quantize(GgmlType::F16, &x, &mut src).unwrap();
        let n = GgmlType::Q4K.row_bytes(cols).unwrap() * rows;
        let (mut a, mut b) = (vec![0u8; n], vec![1u8; n]);
        convert_matrix(GgmlType::F16, &src, GgmlType::Q4K, &mut a, rows, cols, 1).unwrap();
        convert_matrix(GgmlType::F16, &src, GgmlType::Q4K, &mut b, rows, cols, 5).unwrap();
        assert_eq!(a, b);
        let mut wrong = vec![0u8; n + 1];
        assert!(convert_matrix(
            GgmlType::F16,
            &src,
            GgmlType::Q4K,
            &mut wrong,
            rows,
            cols,
            2
        )
        .is_err());
    }

    #[test]
    fn spread_and_par_map() {
        assert_eq!(spread(8, 4), [0, 2, 4, 6]);
        assert_eq!(spread(3, 4), [0, 1, 2]);
        assert_eq!(spread(0, 4), Vec::<usize>::new());
        let v: Result<Vec<usize>, ()> = par_map(50, 4, |i| Ok(i * i));
        assert_eq!(v.unwrap(), (0..50).map(|i| i * i).collect::<Vec<_>>());
        let e: Result<Vec<usize>, usize> = par_map(10, 3, |i| if i == 7 { Err(i) } else { Ok(i) });
        assert_eq!(e, Err(7));
    }
}
