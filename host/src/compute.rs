//! Multi-threaded matrix-vector products.
//!
//! - [`Pool`]: a persistent pool of worker threads for short, frequent, blocking
//!   parallel calls ([`Pool::run`]); waiting threads poll briefly (spinning, then
//!   yielding the CPU) before parking, so a stream of calls a few microseconds
//!   apart costs no sleeping and waking.
//! - [`ThreadedMatVec`]: the [`MatVec`] of the forward pass on a [`Pool`]: quantizes
//!   `x` once, then splits the rows of `W` into a few contiguous ranges per thread,
//!   which the threads claim dynamically ([`Pool::for_each`]).
//!   Attention over the KV cache splits its query heads the same way.
//! - [`default_threads`]: the number of physical cores this process may use.
//! - [`kernel_prefetch`]: how far ahead the kernels prefetch weights: this CPU's
//!   default, or [`PREFETCH_ENV`].
//!
//! # Exactness
//!
//! Each output row is computed by exactly one [`gemv`] call over a row range, and
//! [`gemv`]'s result does not depend on how rows are split (see
//! [`les_core::gemv`]); each attention head is computed by one
//! [`ops::attention_heads`] call, whichever range it falls in. So
//! [`ThreadedMatVec`] is bit-identical to
//! [`SerialMatVec`](les_core::model::forward::SerialMatVec) for any thread count.

use std::ops::Range;
use std::sync::Mutex;

use les_core::gemv::{
    default_prefetch, gemm, gemm_with_prefetch, gemv, gemv_with_prefetch, GemvError, Input, Isa,
    MatrixView,
};
use les_core::layout::{checksum, checksum_concat};
use les_core::model::forward::{attention_each_position, each_head, prepare_input, HeadFn, MatVec};
use les_core::model::ops::{self, AttnShape, KvView};
use les_core::quant::blocks::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use les_core::quant::QK_K;

pub use pool::Pool;

/// Rows per alignment unit: 16 `f32` are one 64-byte cache line of `y`.
const ROW_ALIGN: usize = 16;
/// Matrices with fewer rows run on the calling thread.
const MIN_PARALLEL_ROWS: usize = 64;
/// Weight bytes per thread below which a product is split for fewer threads (and
/// run serially when that is one): waking the pool costs about as much as
/// streaming this much weight data.
const MIN_BYTES_PER_THREAD: usize = 32 * 1024;
/// Row ranges per thread, claimed dynamically: a thread slowed down (by the OS,
/// another process) leaves its share to the others.
const CHUNKS_PER_THREAD: usize = 4;
/// Each chunk has at least this many weight bytes (when there are more chunks
/// than threads).
const MIN_BYTES_PER_CHUNK: usize = 16 * 1024;
/// Most scores of one group of positions in [`MatVec::attention_causal`]
/// (query heads of a KV head x positions x cached positions): 512 KiB, in a
/// core's L2 with the keys and values streaming past.
const CAUSAL_SCORES: usize = 1 << 17;
/// Most positions in one group of [`MatVec::attention_causal`].
const MAX_CAUSAL_GROUP: usize = 16;
/// Attention with fewer query-head x position x dimension products than this
/// runs on the calling thread (about as long as waking the pool).
const MIN_PARALLEL_ATTENTION: usize = 1 << 15;
/// Recurrent layers with less state than this many floats run their heads on
/// the calling thread ([`MatVec::for_heads`]).
const MIN_PARALLEL_STATE: usize = 1 << 15;

/// A [`MatVec`] that splits the rows of each product across a [`Pool`].
///
/// The activation scratch buffers are owned and grow to the largest row length
/// seen; they never shrink. Products too small to be worth waking the pool (fewer
/// than 64 rows, or less than 32 KiB of weights per thread) run on the calling
/// thread alone.
pub struct ThreadedMatVec {
    isa: Isa,
    pool: Pool,
    q8_0: Vec<BlockQ8_0>,
    q8_1: Vec<BlockQ8_1>,
    q8k: Vec<BlockQ8K>,
    /// Attention scores: per chunk of heads, one row of positions per head.
    scores: Vec<f32>,
    /// Prefetch distance of the kernels, in weight bytes.
    prefetch: usize,
}

impl ThreadedMatVec {
    /// A product over `threads` threads (the caller plus `threads - 1` workers; 0 is
    /// taken as 1) using the kernels of `isa`.
    ///
    /// If the OS refuses to start a worker, the pool keeps the workers it got:
    /// see [`threads`](Self::threads).
    pub fn new(threads: usize, isa: Isa) -> Self {
        ThreadedMatVec {
            isa,
            pool: Pool::new(threads),
            q8_0: Vec::new(),
            q8_1: Vec::new(),
            q8k: Vec::new(),
            scores: Vec::new(),
            prefetch: kernel_prefetch(),
        }
    }

    /// The same, with the kernels prefetching `bytes` ahead of the row they
    /// compute (0 = none) instead of [`kernel_prefetch`]'s distance; the
    /// results do not change, only the speed (`cargo bench -p les --bench
    /// matvec` compares).
    pub fn with_prefetch(mut self, bytes: usize) -> Self {
        self.prefetch = bytes;
        self
    }

    /// Threads that compute a product, the caller included.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The kernels in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The pool, for other parallel work between products (attention heads,
    /// experts): one set of threads serves both.
    pub fn pool(&mut self) -> &mut Pool {
        &mut self.pool
    }

    /// How many threads a product over `w` is split over, and into how many row
    /// ranges (claimed dynamically by the threads).
    fn shares(&self, w: &MatrixView<'_>) -> (usize, usize) {
        let rows = w.rows();
        let bytes = rows.saturating_mul(w.row_bytes());
        let parts = if rows < MIN_PARALLEL_ROWS {
            1
        } else {
            self.threads()
                .min(bytes / MIN_BYTES_PER_THREAD)
                .min(rows.div_ceil(ROW_ALIGN))
                .max(1)
        };
        let chunks = (parts * CHUNKS_PER_THREAD)
            .min(rows.div_ceil(ROW_ALIGN))
            .min((bytes / MIN_BYTES_PER_CHUNK).max(parts));
        (parts, chunks)
    }
}

/// A range of rows and its part of each output, for one thread of `matmul`.
type RowsJob<'a> = (Range<usize>, Vec<&'a mut [f32]>);

/// A run of a batch's inputs and the activation blocks to quantize them into
/// (the buffer of their format; the others empty).
type QuantizeJob<'a> = (
    &'a [f32],
    &'a mut [BlockQ8_0],
    &'a mut [BlockQ8_1],
    &'a mut [BlockQ8K],
);

/// One group of positions for [`ops::attention_causal`]: its first position,
/// its queries and its outputs.
type CausalGroup<'a> = (usize, &'a [f32], &'a mut [f32]);

/// Work cut into parts for the pool's threads, each part taken once by
/// whichever thread runs it.
struct Parts<T>(Vec<Mutex<Option<T>>>);

impl<T> Parts<T> {
    fn new(parts: impl IntoIterator<Item = T>) -> Self {
        Parts(parts.into_iter().map(|p| Mutex::new(Some(p))).collect())
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    /// Part `i`, the first time it is asked for.
    fn take(&self, i: usize) -> Option<T> {
        self.0.get(i).and_then(|s| s.lock().ok()?.take())
    }
}

/// The error of the lowest-numbered part that failed: the same whichever
/// order the threads ran the parts in.
struct FirstError(Mutex<Option<(usize, GemvError)>>);

impl FirstError {
    fn new() -> Self {
        FirstError(Mutex::new(None))
    }

    fn record(&self, part: usize, e: GemvError) {
        if let Ok(mut first) = self.0.lock() {
            if first.as_ref().is_none_or(|(i, _)| part < *i) {
                *first = Some((part, e));
            }
        }
    }

    fn into_result(self) -> Result<(), GemvError> {
        match self.0.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }
}

/// Grows `v` to at least `n` elements of `zero`.
fn grow<T: Copy>(v: &mut Vec<T>, n: usize, zero: T) {
    if v.len() < n {
        v.resize(n, zero);
    }
}

const ZERO_Q8_0: BlockQ8_0 = BlockQ8_0 {
    d: [0; 2],
    qs: [0; 32],
};
const ZERO_Q8_1: BlockQ8_1 = BlockQ8_1 {
    d: [0; 2],
    s: [0; 2],
    qs: [0; 32],
};
const ZERO_Q8K: BlockQ8K = BlockQ8K {
    d: [0; 4],
    qs: [0; QK_K],
    bsums: [[0; 2]; QK_K / 16],
};

impl MatVec for ThreadedMatVec {
    /// Attention with the query heads split into contiguous ranges that the
    /// threads claim dynamically, each range computed by
    /// [`ops::attention_heads`] with scores for all its heads (a KV head's
    /// query heads batched); the result is the serial one, bit for bit.
    fn attention(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let AttnShape {
            n_head,
            n_head_kv,
            head_dim,
        } = shape;
        let n = kv.positions;
        let valid = ops::attention_fits(shape, &(0..n_head), q, kv, scores, out);
        let parts = self.threads().min(n_head);
        if !valid || n_head.saturating_mul(n).saturating_mul(head_dim) < MIN_PARALLEL_ATTENTION {
            // Small, or malformed (then `attention` panics with its message).
            return ops::attention(self.isa, shape, q, kv, scores, out);
        }
        // One chunk per KV head (its query heads read each key and value once),
        // or, with fewer KV heads than threads, as many chunks as threads.
        let chunks = n_head_kv.max(parts);
        let widest = n_head.div_ceil(chunks);
        grow(&mut self.scores, chunks * widest * n.max(1), 0.0);
        let mut jobs = Vec::with_capacity(chunks);
        let (mut out_rest, mut scores_rest) = (&mut *out, &mut self.scores[..]);
        for c in 0..chunks {
            let heads = c * n_head / chunks..(c + 1) * n_head / chunks;
            let (o, tail) = out_rest.split_at_mut(heads.len() * head_dim);
            out_rest = tail;
            let (sc, tail) = scores_rest.split_at_mut(widest * n.max(1));
            scores_rest = tail;
            jobs.push((heads, o, sc));
        }
        let jobs = Parts::new(jobs);
        let isa = self.isa;
        self.pool.for_each(chunks, &|c| {
            if let Some((heads, o, sc)) = jobs.take(c) {
                ops::attention_heads(isa, shape, heads, q, kv, sc, o);
            }
        });
    }

    /// The positions in groups ([`ops::attention_causal`]: each cached key and
    /// value read once for a group), as many as keep a group's scores within
    /// `CAUSAL_SCORES` (512 Ki) floats and at most `MAX_CAUSAL_GROUP` (16); the groups
    /// dealt to the threads in turn, each thread with its own scratch. With
    /// fewer groups than threads, a position at a time, its heads split across
    /// the threads. Each position's output is [`attention`](Self::attention)'s
    /// either way, bit for bit.
    fn attention_causal(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        first: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let q_dim = shape.n_head.saturating_mul(shape.head_dim).max(1);
        let n = kv.positions;
        let per_key = (shape.n_head / shape.n_head_kv.max(1)).saturating_mul(n);
        let g = (CAUSAL_SCORES / per_key.max(1)).clamp(1, MAX_CAUSAL_GROUP);
        let groups = (q.len() / q_dim).div_ceil(g);
        let parts = self.threads().min(groups);
        let valid = ops::attention_causal_fits(shape, q, kv, first, usize::MAX, out);
        if !valid || parts < 2 {
            // Few positions, or malformed (then `attention` panics with its
            // message): one position at a time.
            return attention_each_position(self, shape, q, kv, first, scores, out);
        }
        let per = ops::attention_causal_scratch(shape, g, n);
        grow(&mut self.scores, parts * per, 0.0);
        // Part `p` takes groups `p`, `p + parts`, ...: the later groups, which
        // attend to more positions, shared out evenly.
        let mut dealt: Vec<Vec<CausalGroup<'_>>> = (0..parts).map(|_| Vec::new()).collect();
        let span = g * q_dim;
        for (c, (qc, oc)) in q.chunks(span).zip(out.chunks_mut(span)).enumerate() {
            dealt[c % parts].push((first + c * g, qc, oc));
        }
        let jobs = Parts::new(dealt.into_iter().zip(self.scores.chunks_mut(per)));
        let isa = self.isa;
        self.pool.for_each(parts, &|p| {
            if let Some((groups, scratch)) = jobs.take(p) {
                for (from, qc, oc) in groups {
                    let cut = KvView {
                        positions: from + qc.len() / q_dim,
                        ..kv
                    };
                    ops::attention_causal(isa, shape, qc, cut, from, scratch, oc);
                }
            }
        });
    }

    fn matvec(&mut self, w: &MatrixView<'_>, x: &[f32], y: &mut [f32]) -> Result<(), GemvError> {
        self.product(w, x, y, false).map(|_| ())
    }

    /// The rows split across the threads as for [`matvec`](Self::matvec), each
    /// thread's range multiplied by every input with [`gemm`] (tiles of rows
    /// kept in cache across the inputs); each output is `matvec`'s, bit for bit.
    fn matmul(&mut self, w: &MatrixView<'_>, xs: &[f32], ys: &mut [f32]) -> Result<(), GemvError> {
        use les_core::gemv::{activation_format, ActivationFormat as F};
        let (cols, rows) = (w.cols(), w.rows());
        let n = xs.len().checked_div(cols).unwrap_or(0);
        if cols == 0 || n * cols != xs.len() || ys.len() != n * rows {
            return Err(GemvError::OutputLength {
                expected: n * rows,
                len: ys.len(),
            });
        }
        if n <= 1 {
            return if n == 1 {
                self.matvec(w, xs, ys)
            } else {
                Ok(())
            };
        }
        let (parts, chunks) = self.shares(w);
        let format = activation_format(w.ty()).ok_or(GemvError::UnsupportedType(w.ty()))?;
        let blocks = (cols / format.block_elems()).max(1);
        match format {
            F::Q8_0 => grow(&mut self.q8_0, n * blocks, ZERO_Q8_0),
            F::Q8_1 => grow(&mut self.q8_1, n * blocks, ZERO_Q8_1),
            F::Q8K => grow(&mut self.q8k, n * blocks, ZERO_Q8K),
            F::F32 => {}
        }
        // Quantize the inputs, a run of them per thread (each input on its
        // own, so the blocks are those of one after another).
        let per = n.div_ceil(self.pool.threads().max(1));
        // Only the format's buffer was grown to `n * blocks`.
        let used = |f: bool| if f { n * blocks } else { 0 };
        let (mut q0, mut q1, mut qk) = (
            self.q8_0[..used(matches!(format, F::Q8_0))].chunks_mut(per * blocks),
            self.q8_1[..used(matches!(format, F::Q8_1))].chunks_mut(per * blocks),
            self.q8k[..used(matches!(format, F::Q8K))].chunks_mut(per * blocks),
        );
        let quantize_jobs = Parts::new(xs.chunks(per * cols).map(|x| -> QuantizeJob<'_> {
            match format {
                F::Q8_0 => (x, q0.next().unwrap_or_default(), &mut [], &mut []),
                F::Q8_1 => (x, &mut [], q1.next().unwrap_or_default(), &mut []),
                F::Q8K => (x, &mut [], &mut [], qk.next().unwrap_or_default()),
                F::F32 => (x, &mut [], &mut [], &mut []),
            }
        }));
        let first_error = FirstError::new();
        let ty = w.ty();
        let quantize = |c: usize| {
            let Some((xs, a, b, k)) = quantize_jobs.take(c) else {
                return;
            };
            for (i, x) in xs.chunks_exact(cols).enumerate() {
                let at = i * blocks;
                let (a, b, k) = (
                    a.get_mut(at..).unwrap_or_default(),
                    b.get_mut(at..).unwrap_or_default(),
                    k.get_mut(at..).unwrap_or_default(),
                );
                if let Err(e) = prepare_input(ty, x, a, b, k) {
                    return first_error.record(c, e);
                }
            }
        };
        self.pool.for_each(quantize_jobs.len(), &quantize);
        drop(quantize_jobs);
        first_error.into_result()?;
        let inputs: Vec<Input<'_>> = xs
            .chunks_exact(cols)
            .enumerate()
            .map(|(i, x)| {
                let at = i * blocks..(i + 1) * blocks;
                let mut input = Input::default();
                match format {
                    F::F32 => input.f32 = x,
                    F::Q8_0 => input.q8_0 = &self.q8_0[at],
                    F::Q8_1 => input.q8_1 = &self.q8_1[at],
                    F::Q8K => input.q8k = &self.q8k[at],
                }
                input
            })
            .collect();
        // Every error is the same for every range: check once, write nothing on error.
        let mut empty: Vec<&mut [f32]> = (0..n).map(|_| &mut [][..]).collect();
        gemm(self.isa, w, &inputs, 0..0, &mut empty)?;
        let ranges = if parts <= 1 {
            std::iter::once(0..rows).collect()
        } else {
            split_rows(rows, chunks, ys.as_ptr() as usize)
        };
        // Each range's part of every output.
        let mut outs: Vec<Vec<&mut [f32]>> = ranges.iter().map(|_| Vec::with_capacity(n)).collect();
        for y in ys.chunks_exact_mut(rows.max(1)) {
            let mut rest = y;
            for (r, out) in ranges.iter().zip(outs.iter_mut()) {
                let (part, tail) = rest.split_at_mut(r.len());
                rest = tail;
                out.push(part);
            }
        }
        let jobs: Parts<RowsJob<'_>> = Parts::new(ranges.into_iter().zip(outs));
        let first_error = FirstError::new();
        let (isa, inputs, prefetch) = (self.isa, &inputs, self.prefetch);
        let run = |c: usize| {
            if let Some((range, mut out)) = jobs.take(c) {
                if let Err(e) = gemm_with_prefetch(isa, w, inputs, range, &mut out, prefetch) {
                    first_error.record(c, e);
                }
            }
        };
        if jobs.len() == 1 {
            run(0);
        } else {
            self.pool.for_each(jobs.len(), &run);
        }
        first_error.into_result()
    }

    /// Each thread hashes the rows it computed right after their product, while
    /// they are in its cache; the parts' CRCs are combined in row order.
    fn matvec_checksum(
        &mut self,
        w: &MatrixView<'_>,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<u32, GemvError> {
        let crc = self.product(w, x, y, true)?;
        Ok(crc.unwrap_or_else(|| checksum(w.bytes())))
    }

    /// The heads in as many contiguous runs as threads, each run's heads in
    /// order on one thread: each head's bits are [`each_head`]'s. Layers with
    /// less than 32 Ki floats of state (`MIN_PARALLEL_STATE`) stay on this thread.
    fn for_heads(&mut self, n: usize, state: &mut [f32], out: &mut [f32], f: &HeadFn<'_>) {
        let parts = self.threads().min(n);
        let divides = n > 0 && state.len().is_multiple_of(n) && out.len().is_multiple_of(n);
        if parts < 2 || !divides || state.len() < MIN_PARALLEL_STATE {
            // Small, or malformed (then `each_head` panics with its message).
            return each_head(n, state, out, f);
        }
        let (sl, ol) = (state.len() / n, out.len() / n);
        let mut jobs = Vec::with_capacity(parts);
        let (mut st_rest, mut out_rest) = (state, out);
        for p in 0..parts {
            let heads = p * n / parts..(p + 1) * n / parts;
            let (st, tail) = st_rest.split_at_mut(heads.len() * sl);
            st_rest = tail;
            let (o, tail) = out_rest.split_at_mut(heads.len() * ol);
            out_rest = tail;
            jobs.push((heads, st, o));
        }
        let jobs = Parts::new(jobs);
        self.pool.for_each(parts, &|p| {
            if let Some((heads, st, o)) = jobs.take(p) {
                let first = heads.start;
                each_head(heads.len(), st, o, &|h, s, y| f(first + h, s, y));
            }
        });
    }
}

impl ThreadedMatVec {
    /// `y = w x` over the pool; with `hash`, also the CRC-32 of `w`'s bytes where
    /// the product was split (`None` where it ran in one call: hash it whole).
    fn product(
        &mut self,
        w: &MatrixView<'_>,
        x: &[f32],
        y: &mut [f32],
        hash: bool,
    ) -> Result<Option<u32>, GemvError> {
        // Only the buffer of `w`'s activation format is used; `prepare_input` checks
        // the length against `x`.
        use les_core::gemv::{activation_format, ActivationFormat as F};
        match activation_format(w.ty()) {
            Some(F::Q8_0) => grow(&mut self.q8_0, x.len() / 32, ZERO_Q8_0),
            Some(F::Q8_1) => grow(&mut self.q8_1, x.len() / 32, ZERO_Q8_1),
            Some(F::Q8K) => grow(&mut self.q8k, x.len() / QK_K, ZERO_Q8K),
            Some(F::F32) | None => {}
        }
        let rows = w.rows();
        let (parts, chunks) = self.shares(w);
        let input = prepare_input(w.ty(), x, &mut self.q8_0, &mut self.q8_1, &mut self.q8k)?;
        if parts <= 1 || y.len() != rows {
            // Small, or malformed: one call, with exactly `SerialMatVec`'s errors.
            return gemv_with_prefetch(self.isa, w, &input, 0..rows, y, self.prefetch)
                .map(|()| None);
        }
        // Every remaining error (input length, ISA) is the same for every range:
        // check once here, so nothing is written to `y` on error.
        gemv(self.isa, w, &input, 0..0, &mut [])?;

        let ranges = split_rows(rows, chunks, y.as_ptr() as usize);
        let mut jobs = Vec::with_capacity(chunks);
        let mut rest = &mut *y;
        for r in &ranges {
            let (chunk, tail) = rest.split_at_mut(r.len());
            rest = tail;
            jobs.push((r.clone(), chunk));
        }
        let jobs = Parts::new(jobs);
        let crcs: Vec<Mutex<u32>> = (0..if hash { chunks } else { 0 })
            .map(|_| Mutex::new(0))
            .collect();
        let first_error = FirstError::new();
        let (isa, prefetch) = (self.isa, self.prefetch);
        let input = &input;
        let row_bytes = w.row_bytes();
        self.pool.for_each(chunks, &|c| {
            let Some((range, chunk)) = jobs.take(c) else {
                return;
            };
            let bytes = range.start * row_bytes..range.end * row_bytes;
            match gemv_with_prefetch(isa, w, input, range, chunk, prefetch) {
                Ok(()) => {
                    if let (Some(crc), Some(part)) = (crcs.get(c), w.bytes().get(bytes)) {
                        *crc.lock().unwrap_or_else(|p| p.into_inner()) = checksum(part);
                    }
                }
                Err(e) => first_error.record(c, e),
            }
        });
        first_error.into_result()?;
        if !hash {
            return Ok(None);
        }
        // The ranges cover 0..rows in order, so the parts are `w`'s bytes in order.
        let mut crc = checksum(&[]);
        for (part, r) in crcs.into_iter().zip(&ranges) {
            let part = part.into_inner().unwrap_or_else(|p| p.into_inner());
            crc = checksum_concat(crc, part, (r.len() * row_bytes) as u64);
        }
        Ok(Some(crc))
    }
}

/// Splits `0..rows` into `parts` contiguous ranges, as equal as possible, with
/// every inner boundary on a 64-byte line of the output whose first element is at
/// address `y_addr` (when `y_addr` is `f32`-aligned), so that no two threads
/// write the same cache line.
fn split_rows(rows: usize, parts: usize, y_addr: usize) -> Vec<Range<usize>> {
    let parts = parts.max(1);
    // Index of the first row that starts a cache line.
    let shift = (ROW_ALIGN - (y_addr % 64) / 4 % ROW_ALIGN) % ROW_ALIGN;
    let mut out = Vec::with_capacity(parts);
    let mut start = 0;
    for i in 1..=parts {
        let end = if i == parts {
            rows
        } else {
            let target = i * rows / parts;
            // Nearest aligned boundary: shift + ROW_ALIGN * k.
            let k = (target.saturating_sub(shift) + ROW_ALIGN / 2) / ROW_ALIGN;
            (shift + k * ROW_ALIGN).clamp(start, rows)
        };
        out.push(start..end);
        start = end;
    }
    out
}

/// The environment variable that sets [`kernel_prefetch`]: bytes, e.g. `0` or
/// `4096`.
pub const PREFETCH_ENV: &str = "LES_KERNEL_PREFETCH";

/// Most bytes [`PREFETCH_ENV`] may ask for (beyond it a hint only evicts).
pub const MAX_PREFETCH: usize = 1 << 20;

/// How far ahead, in weight bytes, [`ThreadedMatVec`]'s kernels prefetch: the
/// value of [`PREFETCH_ENV`] if set (see [`prefetch_from_env`]), else this CPU's
/// default ([`default_prefetch`]: none on AMD's cores, 4 KiB on others).
/// Results never depend on it.
pub fn kernel_prefetch() -> usize {
    static CHOSEN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        prefetch_from_env()
            .ok()
            .flatten()
            .unwrap_or_else(default_prefetch)
    })
}

/// [`PREFETCH_ENV`] parsed: `None` when unset, an error naming the variable
/// when it is not a byte count up to [`MAX_PREFETCH`]. The CLI checks it at
/// start; [`kernel_prefetch`] ignores a bad value.
pub fn prefetch_from_env() -> Result<Option<usize>, String> {
    match std::env::var(PREFETCH_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) => parse_prefetch(&v).map(Some),
        Err(_) => Err(format!("{PREFETCH_ENV}: not valid UTF-8")),
    }
}

fn parse_prefetch(v: &str) -> Result<usize, String> {
    match v.trim().parse::<usize>() {
        Ok(n) if n <= MAX_PREFETCH => Ok(n),
        _ => Err(format!(
            "{PREFETCH_ENV}={v:?}: expected a number of bytes from 0 (no prefetch) to {MAX_PREFETCH}, e.g. 4096"
        )),
    }
}

/// The default thread count: physical cores this process may run on.
///
/// On Linux, counts the distinct (package, core) pairs in
/// `/sys/devices/system/cpu/cpu*/topology` of the CPUs in this process's
/// `Cpus_allowed_list`, capped by [`std::thread::available_parallelism`] (which
/// also honours cgroup CPU quotas). Elsewhere, or when that fails, it is
/// `available_parallelism` (logical CPUs) itself; at least 1.
pub fn default_threads() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    match physical_cores() {
        Some(p) if p > 0 => p.min(logical),
        _ => logical,
    }
}

/// Physical cores among the CPUs this process may run on (Linux only).
fn physical_cores() -> Option<usize> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let cpus: Vec<usize> = match std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(|l| parse_cpu_list(l.trim()))
        }) {
        Some(c) => c,
        None => std::fs::read_dir("/sys/devices/system/cpu")
            .ok()?
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("cpu")?.parse().ok()
            })
            .collect(),
    };
    let read = |cpu: usize, what: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{cpu}/topology/{what}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let mut cores: Vec<(u64, u64)> = cpus
        .into_iter()
        .filter_map(|c| Some((read(c, "physical_package_id")?, read(c, "core_id")?)))
        .collect();
    cores.sort_unstable();
    cores.dedup();
    (!cores.is_empty()).then_some(cores.len())
}

/// Parses a Linux CPU list (`"0-3,8,10-11"`); `None` if malformed or absurd.
fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
            None => {
                let a: usize = part.parse().ok()?;
                (a, a)
            }
        };
        if a > b || b - a > 1 << 16 || out.len() > 1 << 16 {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

mod pool {
    //! The worker pool; the only `unsafe` of this module is here.
    //!
    //! # Protocol
    //!
    //! The caller publishes a job (a pointer to a `&Job` on its stack), marks each
    //! worker's `state` `OFFERED` and increments `epoch`. A worker that sees a new
    //! epoch claims the job by switching its state from `OFFERED` to `RUNNING`,
    //! runs it, sets `IDLE` and decrements `pending`. For [`Pool::for_each`], the
    //! caller, once its own share is done (no task left to claim), withdraws the
    //! offers not yet claimed (`OFFERED` to `IDLE`, decrementing `pending` itself),
    //! so a worker the OS has not scheduled never delays the call. The caller
    //! returns only when `pending` is 0: no worker is running the job any more and
    //! none can start it.
    #![allow(unsafe_code)]

    use std::panic::{self, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
    use std::sync::{Arc, Condvar, Mutex, MutexGuard};
    use std::thread::{self, JoinHandle};
    use std::time::{Duration, Instant};

    /// A job: called with the index of the thread running it.
    type Job<'a> = dyn Fn(usize) + Sync + 'a;

    /// Worker states.
    const IDLE: u8 = 0;
    const OFFERED: u8 = 1;
    const RUNNING: u8 = 2;

    /// How long a waiting thread polls with `spin_loop` alone.
    const SPIN_HOT: Duration = Duration::from_micros(10);
    /// How long a waiting thread polls (with `yield_now` after [`SPIN_HOT`], so
    /// that an oversubscribed CPU runs the threads being waited for) before
    /// parking on a condition variable.
    const SPIN: Duration = Duration::from_micros(200);

    /// The polling phase of a wait.
    struct Spinner {
        start: Instant,
        polls: u32,
        hot: bool,
    }

    impl Spinner {
        fn new() -> Self {
            Spinner {
                start: Instant::now(),
                polls: 0,
                hot: true,
            }
        }

        /// Pauses once; `false` once it is time to park instead.
        fn step(&mut self) -> bool {
            self.polls = self.polls.wrapping_add(1);
            if self.hot {
                if self.polls.is_multiple_of(32) && self.start.elapsed() > SPIN_HOT {
                    self.hot = false;
                }
                std::hint::spin_loop();
                return true;
            }
            if self.start.elapsed() > SPIN {
                return false;
            }
            thread::yield_now();
            true
        }
    }

    /// State shared by the caller and the workers.
    struct Shared {
        /// Incremented by the caller to start a job (or to shut down).
        epoch: AtomicU64,
        /// The current job: points at a `&Job` on the stack of `Pool::execute`,
        /// valid while any worker's state is `OFFERED` or `RUNNING`.
        job: AtomicPtr<&'static Job<'static>>,
        /// Per worker: `IDLE`, `OFFERED` or `RUNNING`.
        state: Box<[AtomicU8]>,
        /// Offers of the current job neither finished nor withdrawn.
        pending: AtomicUsize,
        /// A worker's job call panicked.
        panicked: AtomicBool,
        /// The pool is being dropped.
        shutdown: AtomicBool,
        /// Workers parked (or about to park) on `wake`.
        sleepers: AtomicUsize,
        /// The caller is parked (or about to park) on `done`.
        caller_sleeping: AtomicBool,
        /// Guards the parking protocol of both condition variables.
        lock: Mutex<()>,
        /// Workers wait here for a new epoch.
        wake: Condvar,
        /// The caller waits here for `pending == 0`.
        done: Condvar,
    }

    impl Shared {
        fn lock(&self) -> MutexGuard<'_, ()> {
            // The lock guards no data, so a poisoned lock is still usable.
            self.lock.lock().unwrap_or_else(|p| p.into_inner())
        }
    }

    /// A persistent pool of worker threads for blocking parallel calls.
    ///
    /// The calling thread takes part as thread 0. Idle workers poll for about
    /// 200 µs (spinning, then yielding), then park; dropping the pool stops and
    /// joins them.
    pub struct Pool {
        shared: Arc<Shared>,
        workers: Vec<JoinHandle<()>>,
    }

    impl Pool {
        /// A pool of `threads` threads: the caller and `threads - 1` workers (0 is
        /// taken as 1). Workers the OS refuses to start are left out.
        pub fn new(threads: usize) -> Pool {
            let n = threads.max(1) - 1;
            let shared = Arc::new(Shared {
                epoch: AtomicU64::new(0),
                job: AtomicPtr::new(std::ptr::null_mut()),
                state: (0..n).map(|_| AtomicU8::new(IDLE)).collect(),
                pending: AtomicUsize::new(0),
                panicked: AtomicBool::new(false),
                shutdown: AtomicBool::new(false),
                sleepers: AtomicUsize::new(0),
                caller_sleeping: AtomicBool::new(false),
                lock: Mutex::new(()),
                wake: Condvar::new(),
                done: Condvar::new(),
            });
            let mut workers = Vec::new();
            for w in 0..n {
                let s = Arc::clone(&shared);
                match thread::Builder::new()
                    .name(format!("les-worker-{}", w + 1))
                    .spawn(move || worker(&s, w))
                {
                    Ok(h) => workers.push(h),
                    Err(_) => break,
                }
            }
            Pool { shared, workers }
        }

        /// Threads a job runs on, the caller included.
        pub fn threads(&self) -> usize {
            self.workers.len() + 1
        }

        /// Calls `job(i)` exactly once for every `i` in `0..threads()`, `job(0)` on
        /// this thread and the others on the workers, and returns once all have
        /// returned.
        ///
        /// # Panics
        ///
        /// If any call panics, after all calls have returned (the pool stays
        /// usable).
        pub fn run(&mut self, job: &(dyn Fn(usize) + Sync)) {
            self.execute(job, false);
        }

        /// Calls `task(i)` exactly once for every `i` in `0..tasks`, spread over
        /// the threads of the pool (each claims the next unclaimed task until none
        /// is left), and returns once all have returned.
        ///
        /// Workers that have not started by the time the calling thread runs out
        /// of tasks are skipped: a descheduled worker never delays the call.
        ///
        /// # Panics
        ///
        /// If any task panics, after all claimed tasks have returned (tasks not
        /// claimed by the panicking thread still run; the pool stays usable).
        pub fn for_each(&mut self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
            if tasks <= 1 || self.workers.is_empty() {
                (0..tasks).for_each(task);
                return;
            }
            let next = AtomicUsize::new(0);
            self.execute(
                &|_| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= tasks {
                        break;
                    }
                    task(i);
                },
                true,
            );
        }

        /// Offers `job` to every worker, runs `job(0)`, withdraws unclaimed offers
        /// if `withdraw`, and waits for the workers that claimed it.
        fn execute(&mut self, job: &(dyn Fn(usize) + Sync), withdraw: bool) {
            let s = &*self.shared;
            let n = self.workers.len();
            if n == 0 {
                job(0);
                return;
            }
            let job_ref: &Job<'_> = job;
            // Workers reach the job through a pointer to `job_ref` with its
            // lifetime erased; see the SAFETY comment in `worker` for why it stays
            // valid while they use it.
            let ptr = (&job_ref as *const &Job<'_>)
                .cast::<&'static Job<'static>>()
                .cast_mut();
            s.job.store(ptr, Ordering::Relaxed);
            s.pending.store(n, Ordering::Relaxed);
            for st in &s.state[..n] {
                // Release: a worker that claims this offer sees `job` and `pending`.
                st.store(OFFERED, Ordering::Release);
            }
            // SeqCst: pairs with the `sleepers` announcement in `wait_for_epoch`.
            s.epoch.fetch_add(1, Ordering::SeqCst);
            if s.sleepers.load(Ordering::SeqCst) > 0 {
                let _g = s.lock();
                s.wake.notify_all();
            }
            let mine = panic::catch_unwind(AssertUnwindSafe(|| job(0)));
            if withdraw {
                for st in &s.state[..n] {
                    if st
                        .compare_exchange(OFFERED, IDLE, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                    {
                        // That worker will not claim this job: count it done.
                        s.pending.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            }
            self.wait_done();
            s.job.store(std::ptr::null_mut(), Ordering::Relaxed);
            if let Err(p) = mine {
                panic::resume_unwind(p);
            }
            if s.panicked.swap(false, Ordering::Relaxed) {
                panic!("a Pool worker panicked");
            }
        }

        /// Waits until `pending` is 0: every offer finished or withdrawn.
        fn wait_done(&self) {
            let s = &*self.shared;
            let mut spin = Spinner::new();
            // Acquire: the workers' writes (their decrements are releases) are
            // visible once `pending` reads 0.
            while s.pending.load(Ordering::Acquire) != 0 {
                if !spin.step() {
                    let mut g = s.lock();
                    // Same handshake as `wait_for_epoch`, with `pending`.
                    s.caller_sleeping.store(true, Ordering::SeqCst);
                    while s.pending.load(Ordering::SeqCst) != 0 {
                        g = s.done.wait(g).unwrap_or_else(|p| p.into_inner());
                    }
                    s.caller_sleeping.store(false, Ordering::Relaxed);
                    return;
                }
            }
        }
    }

    impl Drop for Pool {
        fn drop(&mut self) {
            let s = &*self.shared;
            s.shutdown.store(true, Ordering::Relaxed);
            s.epoch.fetch_add(1, Ordering::SeqCst);
            {
                let _g = s.lock();
                s.wake.notify_all();
            }
            for h in self.workers.drain(..) {
                // Job panics are caught in the worker, so join only fails if the
                // thread died some other way; nothing to do about it here.
                let _ = h.join();
            }
        }
    }

    impl std::fmt::Debug for Pool {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Pool")
                .field("threads", &self.threads())
                .finish()
        }
    }

    /// Waits until the epoch differs from `seen`: polls, then parks.
    fn wait_for_epoch(s: &Shared, seen: u64) -> u64 {
        let mut spin = Spinner::new();
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                return e;
            }
            if !spin.step() {
                break;
            }
        }
        let mut g = s.lock();
        // Announce the sleeper before the last check (both SeqCst): either the
        // caller's increment of `epoch` comes first in the total order and this
        // load sees it, or the caller's load of `sleepers` sees this one and it
        // notifies under the lock, which it can only take once this thread waits.
        s.sleepers.fetch_add(1, Ordering::SeqCst);
        loop {
            let e = s.epoch.load(Ordering::SeqCst);
            if e != seen {
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                return e;
            }
            g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Worker `w` (thread index `w + 1`).
    fn worker(s: &Shared, w: usize) {
        let mut seen = 0;
        loop {
            seen = wait_for_epoch(s, seen);
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            // Claim the offer; it may have been withdrawn, or this may be a later
            // job than the epoch seen (then the next wait returns at once).
            if s.state[w]
                .compare_exchange(OFFERED, RUNNING, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            let ptr = s.job.load(Ordering::Relaxed);
            // SAFETY: the claimed `OFFERED` was stored (Release, read here with
            // Acquire) by `Pool::execute` after it stored `ptr`, a pointer to a
            // `&Job` on its stack. `execute` does not return or unwind before
            // `pending` is 0, and this claim keeps `pending` above 0 until this
            // thread's decrement below: until then both the `&Job` and the job it
            // points to are alive and unchanged. `job` is not used after the
            // decrement, and the fictitious `'static` lifetimes do not let it
            // escape this iteration. The job is `Sync`, so calling it from here
            // while the caller also calls it is allowed.
            let job: &Job<'_> = unsafe { *ptr };
            if panic::catch_unwind(AssertUnwindSafe(|| job(w + 1))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
            s.state[w].store(IDLE, Ordering::Relaxed);
            // SeqCst (a release): the job's writes and `IDLE` happen before the
            // caller reads 0; pairs with `caller_sleeping` as in `wait_done`.
            if s.pending.fetch_sub(1, Ordering::SeqCst) == 1
                && s.caller_sleeping.load(Ordering::SeqCst)
            {
                let _g = s.lock();
                s.done.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use les_core::model::ops::KvRows;

    #[test]
    fn prefetch_distance_parses_bytes_within_bounds() {
        assert_eq!(parse_prefetch("0"), Ok(0));
        assert_eq!(parse_prefetch(" 4096 "), Ok(4096));
        assert_eq!(parse_prefetch("1048576"), Ok(MAX_PREFETCH));
        for bad in ["", "4KiB", "-1", "1048577", "99999999999999999999999"] {
            let e = parse_prefetch(bad).unwrap_err();
            assert!(
                e.contains(PREFETCH_ENV) && e.contains("0 (no prefetch)"),
                "{e}"
            );
        }
    }

    #[test]
    fn threaded_attention_equals_serial_bit_for_bit() {
        let mut st = 0x9e37_79b9_u32;
        let mut val = move || {
            st ^= st << 13;
            st ^= st >> 17;
            st ^= st << 5;
            (st >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        };
        for (n_head, n_head_kv, head_dim) in [(32, 4, 128), (6, 2, 16), (3, 3, 8)] {
            let shape = AttnShape {
                n_head,
                n_head_kv,
                head_dim,
            };
            for n in [1, 7, 64, 300] {
                let kv = n * n_head_kv * head_dim;
                let q: Vec<f32> = (0..n_head * head_dim).map(|_| val()).collect();
                let k: Vec<f32> = (0..kv).map(|_| 3.0 * val()).collect();
                let v: Vec<f32> = (0..kv).map(|_| val()).collect();
                let mut want = vec![0.0; q.len()];
                let kv = KvView {
                    k: KvRows::F32(&k),
                    v: KvRows::F32(&v),
                    positions: n,
                    sinks: None,
                };
                ops::attention(Isa::Scalar, shape, &q, kv, &mut vec![0.0; n], &mut want);
                for threads in [1, 2, 3] {
                    let mut mv = ThreadedMatVec::new(threads, Isa::detect());
                    let mut got = vec![0.0; q.len()];
                    mv.attention(shape, &q, kv, &mut vec![0.0; n], &mut got);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{shape:?} n={n} threads={threads}"
                    );
                }
            }
        }
    }

    /// Positions in groups on several threads: each position's output is
    /// `attention`'s over the cache cut at it, for group sizes from one to the
    /// largest, batches shorter and longer than a group, and KV caches too long
    /// for more than one position a group.
    #[test]
    fn threaded_causal_attention_equals_each_position_bit_for_bit() {
        let mut st = 0x2545_f491_u32;
        let mut val = move || {
            st ^= st << 13;
            st ^= st >> 17;
            st ^= st << 5;
            (st >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        };
        for (n_head, n_head_kv, head_dim) in [(16, 4, 64), (6, 2, 16), (3, 3, 8)] {
            let shape = AttnShape {
                n_head,
                n_head_kv,
                head_dim,
            };
            let q_dim = n_head * head_dim;
            let long = CAUSAL_SCORES / (n_head / n_head_kv) + 5; // groups of 1
            for (first, count) in [(0, 1), (0, 40), (5, 17), (300, 70), (long, 3)] {
                let n = first + count;
                let kv_len = n * n_head_kv * head_dim;
                let q: Vec<f32> = (0..count * q_dim).map(|_| val()).collect();
                let k: Vec<f32> = (0..kv_len).map(|_| 3.0 * val()).collect();
                let v: Vec<f32> = (0..kv_len).map(|_| val()).collect();
                let mut want = vec![0.0; q.len()];
                for i in 0..count {
                    let kv = KvView {
                        k: KvRows::F32(&k),
                        v: KvRows::F32(&v),
                        positions: first + i + 1,
                        sinks: None,
                    };
                    let qi = &q[i * q_dim..][..q_dim];
                    let oi = &mut want[i * q_dim..][..q_dim];
                    ops::attention(Isa::Scalar, shape, qi, kv, &mut vec![0.0; n], oi);
                }
                let kv = KvView {
                    k: KvRows::F32(&k),
                    v: KvRows::F32(&v),
                    positions: n,
                    sinks: None,
                };
                for threads in [1, 2, 3] {
                    let mut mv = ThreadedMatVec::new(threads, Isa::detect());
                    let mut got = vec![f32::NAN; q.len()];
                    mv.attention_causal(shape, &q, kv, first, &mut vec![0.0; n], &mut got);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{shape:?} first={first} count={count} threads={threads}"
                    );
                }
            }
        }
    }

    /// Heads spread over the threads give [`each_head`]'s bits, whatever the
    /// threads and heads (runs of unequal length included), and every head
    /// runs once with its own chunks.
    #[test]
    fn threaded_heads_equal_serial_bit_for_bit() {
        let f = |h: usize, st: &mut [f32], o: &mut [f32]| {
            let mut acc = 0f32;
            for (i, x) in st.iter_mut().enumerate() {
                *x = *x * 0.9 + (h * 7 + i) as f32 * 1e-3;
                acc += *x;
            }
            o[0] = acc;
            o[1] += h as f32 + 1.0;
        };
        for threads in [1, 2, 3] {
            let mut mv = ThreadedMatVec::new(threads, Isa::detect());
            for n in [1, 3, 8, 13, 64] {
                let per = 4096;
                let init: Vec<f32> = (0..n * per).map(|i| (i % 97) as f32 * 0.01).collect();
                let (mut a, mut b) = (init.clone(), init);
                let (mut oa, mut ob) = (vec![0f32; 2 * n], vec![0f32; 2 * n]);
                mv.for_heads(n, &mut a, &mut oa, &f);
                each_head(n, &mut b, &mut ob, &f);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{threads} threads, {n} heads");
                assert_eq!(bits(&oa), bits(&ob), "{threads} threads, {n} heads");
                let once: Vec<f32> = (0..n).map(|h| h as f32 + 1.0).collect();
                let ran: Vec<f32> = oa.chunks(2).map(|o| o[1]).collect();
                assert_eq!(ran, once, "each head once");
            }
        }
    }

    #[test]
    fn compute_split_rows_balanced_and_aligned() {
        for rows in [0, 1, 15, 16, 17, 64, 100, 1000, 2048, 151_936] {
            for parts in 1..=9 {
                for addr in (0..64).step_by(4) {
                    let r = split_rows(rows, parts, 0x1000 + addr);
                    assert_eq!(r.len(), parts);
                    assert_eq!(r[0].start, 0);
                    assert_eq!(r[parts - 1].end, rows);
                    for w in r.windows(2) {
                        assert_eq!(w[0].end, w[1].start);
                        let b = w[0].end;
                        if b != 0 && b != rows {
                            assert_eq!((addr / 4 + b) % ROW_ALIGN, 0, "{rows} {parts} {addr}");
                        }
                    }
                    if rows >= 64 * parts {
                        let ideal = rows / parts;
                        for x in &r {
                            assert!(x.len().abs_diff(ideal) <= ROW_ALIGN, "{r:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn compute_parse_cpu_list() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn compute_default_threads_positive() {
        let n = default_threads();
        assert!(n >= 1);
        assert!(n <= std::thread::available_parallelism().map_or(1, |n| n.get()));
    }
}
