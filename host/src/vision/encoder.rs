//! The vision tower's forward pass: patch embedding, ViT blocks, and the
//! projector into the language model's embedding space, as llama.cpp's clip
//! graphs compute them (`tools/mtmd/clip.cpp` `build_vit`,
//! `models/minicpmv.cpp`, `models/siglip.cpp`, `models/qwen3vl.cpp`,
//! `models/kimivl.cpp`, `models/llama4.cpp`, `models/glm4v.cpp`,
//! `models/internvl.cpp`).
//!
//! Qwen3-VL's tower works on its tokens in the 2x2 merge order throughout
//! (each 2x2 block of patches, blocks row by row, within a block top-left,
//! top-right, bottom-left, bottom-right), rotates queries and keys by ggml's
//! vision M-RoPE (half of each head by the patch's row, half by its column),
//! and writes rows of its merger's output followed by each deepstack
//! merger's. GLM-4.xV's tower takes the same order, patches and rotation
//! (with RMSNorms and a SwiGLU FFN) and merges each 2x2 block by a
//! convolution.
//!
//! Kimi-VL's tower works on its patches row by row, rotates the first half of
//! each head by the patch's column and the second half by its row (ggml's
//! normal RoPE, adjacent pairs, on each half), and merges each n x n block of
//! patches into one row at the end. Llama 4's appends a class token after the
//! patches (RoPE positions from 1, the class token at 0), drops it after the
//! blocks and shuffles each n x n block of patches into one row, blocks
//! column by column (llama.cpp's order). InternVL's also appends its class
//! token after the patches (no RoPE) and shuffles blocks row by row.
//!
//! Activations are `f32`, `tokens x width`, row-major. Matrix products run on a
//! [`Pool`] ([`super::gemm::matmul`], [`les_core::gemv`]'s kernels for every
//! weight type); so does attention, by blocks of query tokens.
//!
//! Element-wise functions follow ggml's CPU backend: LayerNorm and RMSNorm
//! accumulate in `f64`; GELU (tanh) and quick-GELU go through `f16` as ggml's
//! lookup tables do (`GGML_GELU_FP16`); GELU-erf is computed directly.

use std::sync::{Mutex, OnceLock};

use les_core::gemv::{vector, Isa};
use les_core::quant::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, GgmlType};

use super::clip::{
    ClipHparams, ClipModel, Deepstack, FfnOp, Glm4vMerger, Linear, Mat, Norm, Projector,
    ProjectorType, VitLayer, VitMerger,
};
use super::gemm::matmul;
use super::preprocess::ImageF32;
use super::VisionError;
use crate::compute::Pool;

/// Where the tower runs: a thread pool and the kernels to use.
pub struct Ctx<'p> {
    /// Threads.
    pub pool: &'p mut Pool,
    /// Kernels.
    pub isa: Isa,
}

/// Activations of `n` tokens of `dim` values each.
#[derive(Clone, Debug)]
struct Acts {
    n: usize,
    dim: usize,
    x: Vec<f32>,
}

impl Acts {
    fn row(&self, i: usize) -> &[f32] {
        &self.x[i * self.dim..(i + 1) * self.dim]
    }
}

/// Values per task of [`par_chunks`].
const ELEMENTWISE_CHUNK: usize = 1 << 14;

/// Calls `f(offset, chunk)` for consecutive chunks of `x` (`chunk` values
/// each, the last shorter; `offset` where it starts in `x`) on the pool:
/// for element-wise work, whose results do not depend on the threads.
fn par_chunks(
    pool: &mut Pool,
    x: &mut [f32],
    chunk: usize,
    f: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    let chunk = chunk.max(1);
    if x.len() <= chunk {
        f(0, x);
        return;
    }
    let parts: Vec<Mutex<&mut [f32]>> = x.chunks_mut(chunk).map(Mutex::new).collect();
    pool.for_each(parts.len(), &|i| {
        let mut part = parts[i].lock().unwrap_or_else(|p| p.into_inner());
        f(i * chunk, &mut part);
    });
}

/// `x[i] = f(x[i])` for every value, on the pool.
fn par_map(pool: &mut Pool, x: &mut [f32], f: fn(f32) -> f32) {
    par_chunks(pool, x, ELEMENTWISE_CHUNK, &|_, c| {
        c.iter_mut().for_each(|v| *v = f(*v))
    });
}

fn linear(ctx: &mut Ctx<'_>, m: &ClipModel, l: &Linear, a: &Acts) -> Result<Acts, VisionError> {
    linear_wb(ctx, m, &l.w, l.b.as_deref(), a)
}

fn linear_wb(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    w: &Mat,
    b: Option<&[f32]>,
    a: &Acts,
) -> Result<Acts, VisionError> {
    let w = m.view(w)?;
    if w.cols() != a.dim {
        return Err(VisionError::Shape("linear input width"));
    }
    let mut y = vec![0f32; a.n * w.rows()];
    // ggml multiplies f16 and bf16 weights by activations rounded to their type.
    let round: Option<fn(f32) -> f32> = match w.ty() {
        GgmlType::F16 => Some(|v| f16_to_f32(f32_to_f16(v))),
        GgmlType::BF16 => Some(|v| bf16_to_f32(f32_to_bf16(v))),
        _ => None,
    };
    let rounded: Option<Vec<f32>> = round.map(|r| {
        let mut x = a.x.clone();
        par_map(ctx.pool, &mut x, r);
        x
    });
    let x = rounded.as_deref().unwrap_or(&a.x);
    matmul(ctx.pool, ctx.isa, &w, x, a.n, &mut y)?;
    if let Some(b) = b {
        let width = w.rows();
        let rows = ELEMENTWISE_CHUNK.div_ceil(width);
        par_chunks(ctx.pool, &mut y, rows * width, &|_, c| {
            for row in c.chunks_exact_mut(width) {
                for (v, b) in row.iter_mut().zip(b) {
                    *v += b;
                }
            }
        });
    }
    Ok(Acts {
        n: a.n,
        dim: w.rows(),
        x: y,
    })
}

/// ggml's `ggml_norm` (mean and variance in `f64`), then `* w + b`.
fn layer_norm(a: &Acts, norm: &Norm, eps: f32) -> Acts {
    let mut out = a.clone();
    for row in out.x.chunks_exact_mut(a.dim) {
        let n = row.len();
        let sum: f64 = row.iter().map(|&v| f64::from(v)).sum();
        let mean = (sum / n as f64) as f32;
        let mut sum2 = 0f64;
        for v in row.iter_mut() {
            *v -= mean;
            sum2 += f64::from(*v * *v);
        }
        let variance = (sum2 / n as f64) as f32;
        let scale = 1.0 / (variance + eps).sqrt();
        for (i, v) in row.iter_mut().enumerate() {
            *v *= scale;
            *v *= norm.w[i];
            if let Some(b) = &norm.b {
                *v += b[i];
            }
        }
    }
    out
}

/// ggml's `ggml_rms_norm` (mean square in `f64`), then `* w`.
fn rms_norm(a: &mut Acts, w: &[f32], eps: f32) {
    for row in a.x.chunks_exact_mut(a.dim) {
        let sum: f64 = row.iter().map(|&v| f64::from(v * v)).sum();
        let mean = (sum / row.len() as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, w) in row.iter_mut().zip(w) {
            *v *= scale;
            *v *= w;
        }
    }
}

/// The tower's norm (`build_norm` with clip.cpp's `norm_t`): a LayerNorm, or
/// GLM-4.xV's RMSNorm, then `* w + b`.
fn vit_norm(hp: &ClipHparams, a: &Acts, norm: &Norm) -> Acts {
    if !hp.rms_norm {
        return layer_norm(a, norm, hp.eps);
    }
    let mut out = a.clone();
    rms_norm(&mut out, &norm.w, hp.eps);
    if let Some(b) = &norm.b {
        for row in out.x.chunks_exact_mut(a.dim) {
            for (v, b) in row.iter_mut().zip(b) {
                *v += b;
            }
        }
    }
    out
}

const GELU_COEF_A: f32 = 0.044_715;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const SQRT_2_INV: f32 = std::f32::consts::FRAC_1_SQRT_2;

fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::tanhf(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))
}

/// A table of `f16(f(f16 value))` for every `f16` bit pattern, as ggml keeps
/// for GELU and quick GELU.
fn f16_table(f: fn(f32) -> f32) -> Box<[u16]> {
    (0..=u16::MAX)
        .map(|h| f32_to_f16(f(f16_to_f32(h))))
        .collect()
}

/// ggml's GELU on `f32`: through its `f16` table for |x| < 10.
pub fn gelu(x: f32) -> f32 {
    static TABLE: OnceLock<Box<[u16]>> = OnceLock::new();
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let t = TABLE.get_or_init(|| f16_table(gelu_tanh));
        f16_to_f32(t[usize::from(f32_to_f16(x))])
    }
}

/// GELU with `erf`, as ggml computes it in `f32`.
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * SQRT_2_INV))
}

/// ggml's quick GELU on `f32` (`x * sigmoid(1.702 x)`), through its `f16` table.
pub fn gelu_quick(x: f32) -> f32 {
    static TABLE: OnceLock<Box<[u16]>> = OnceLock::new();
    let t = TABLE.get_or_init(|| f16_table(|h| h * (1.0 / (1.0 + libm::expf(-1.702 * h)))));
    f16_to_f32(t[usize::from(f32_to_f16(x))])
}

/// `x * sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + libm::expf(-x))
}

fn activation(op: FfnOp) -> fn(f32) -> f32 {
    match op {
        FfnOp::Gelu => gelu,
        FfnOp::GeluErf => gelu_erf,
        FfnOp::GeluQuick => gelu_quick,
        FfnOp::Silu => silu,
    }
}

/// `down(act(up x))`, or `down(act(gate x) * up x)` when gated.
fn ffn(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    x: &Acts,
    up: &Linear,
    gate: Option<&Linear>,
    down: &Linear,
    op: FfnOp,
) -> Result<Acts, VisionError> {
    let act = activation(op);
    let mut h = linear(ctx, m, up, x)?;
    match gate {
        Some(g) => {
            let g = linear(ctx, m, g, x)?;
            par_chunks(ctx.pool, &mut h.x, ELEMENTWISE_CHUNK, &|at, c| {
                for (u, g) in c.iter_mut().zip(&g.x[at..]) {
                    *u *= act(*g);
                }
            });
        }
        None => par_map(ctx.pool, &mut h.x, act),
    }
    linear(ctx, m, down, &h)
}

/// Softmax of `scores * scale` in place: `expf` per value, the sum in `f64`
/// (ggml's `soft_max`).
fn softmax_scaled(scores: &mut [f32], scale: f32) {
    let mut max = f32::NEG_INFINITY;
    for s in scores.iter_mut() {
        *s *= scale;
        max = max.max(*s);
    }
    let mut sum = 0f64;
    for s in scores.iter_mut() {
        *s = libm::expf(*s - max);
        sum += f64::from(*s);
    }
    let inv = (1.0 / sum) as f32;
    scores.iter_mut().for_each(|s| *s *= inv);
}

/// Queries per attention task.
const QUERY_BLOCK: usize = 16;

/// Multi-head self-attention of all tokens with all: `softmax(q k^T * scale) v`
/// per head, heads concatenated. Blocks of queries run on the pool; a block's
/// queries of one head go through [`vector`]'s kernels together, so each key
/// and value of the head is read once for the block (the scores, the softmax
/// and the weighted sums in [`vector::scaled_dots_by_key`]'s (over each
/// head's keys transposed once), [`vector::softmax`]'s and
/// [`vector::weighted_rows`]' fixed orders, the same bits with every ISA).
/// Each query's arithmetic is the same whatever the block or thread.
fn attention(
    ctx: &mut Ctx<'_>,
    q: &Acts,
    k: &Acts,
    v: &Acts,
    n_head: usize,
) -> Result<Acts, VisionError> {
    let (n, d) = (q.n, q.dim);
    if k.n != n || v.n != n || k.dim != d || v.dim != d || n_head == 0 || d % n_head != 0 {
        return Err(VisionError::Shape("attention operands"));
    }
    let dh = d / n_head;
    let scale = 1.0 / (dh as f32).sqrt();
    let isa = ctx.isa;
    // Each head's keys transposed (`dh` rows of `n`), for the scores' kernel
    // that runs its lanes over keys.
    let mut kt = vec![0f32; n * d];
    for (h, kth) in kt.chunks_exact_mut(dh * n).enumerate() {
        for (t, key) in k.x.chunks_exact(d).enumerate() {
            for (i, &x) in key[h * dh..][..dh].iter().enumerate() {
                kth[i * n + t] = x;
            }
        }
    }
    let mut out = vec![0f32; n * d];
    let blocks: Vec<Mutex<&mut [f32]>> = out.chunks_mut(QUERY_BLOCK * d).map(Mutex::new).collect();
    let task = |b: usize| {
        let Some(block) = blocks.get(b) else { return };
        let mut block = block.lock().unwrap_or_else(|p| p.into_inner());
        let nq = block.len() / d;
        let mut qs = vec![0f32; nq * dh];
        let mut os = vec![0f32; nq * dh];
        let mut scores = vec![0f32; nq * n];
        for h in 0..n_head {
            for (i, qh) in qs.chunks_exact_mut(dh).enumerate() {
                qh.copy_from_slice(&q.row(b * QUERY_BLOCK + i)[h * dh..][..dh]);
            }
            let kth = &kt[h * dh * n..][..dh * n];
            vector::scaled_dots_by_key(isa, &qs, dh, kth, n, scale, &mut scores);
            for row in scores.chunks_exact_mut(n) {
                vector::softmax(isa, row);
            }
            let values = vector::Strided {
                data: &v.x[h * dh..],
                stride: d,
                n,
                d: dh,
            };
            os.fill(0.0);
            vector::weighted_rows(isa, &scores, values, &mut os);
            for (row, oh) in block.chunks_exact_mut(d).zip(os.chunks_exact(dh)) {
                row[h * dh..][..dh].copy_from_slice(oh);
            }
        }
    };
    let tasks = blocks.len();
    if n * n * d < 1 << 16 {
        (0..tasks).for_each(task);
    } else {
        ctx.pool.for_each(tasks, &task);
    }
    drop(blocks);
    Ok(Acts { n, dim: d, x: out })
}

fn add_in_place(a: &mut Acts, b: &Acts) {
    for (x, y) in a.x.iter_mut().zip(&b.x) {
        *x += y;
    }
}

fn mul_rows(a: &mut Acts, s: &[f32]) {
    for row in a.x.chunks_exact_mut(a.dim) {
        for (v, s) in row.iter_mut().zip(s) {
            *v *= s;
        }
    }
}

/// ggml's vision M-RoPE (`ggml_rope_multi`, `GGML_ROPE_TYPE_VISION`, as
/// Qwen-VL's towers call it: `n_dims` half a head, four sections of a quarter
/// head each, base 10000, no scaling): for each token, the cosines and sines
/// of the angles of a head's `d_head / 2` pairs; pair `i` rotates values `i`
/// and `i + d_head / 2`. Pairs of the first quarter turn by the token's first
/// position (clip.cpp's row), those of the second quarter by its second (the
/// column), each section's angle restarting at its position and shrinking by
/// `10000^(-4 / d_head)` a pair, multiplied in `f32` one step at a time as
/// ggml's cache does.
struct VisionRope {
    half: usize,
    /// `(cos, sin)` of every pair of every token.
    cs: Vec<(f32, f32)>,
}

impl VisionRope {
    /// The rotation of heads `d_head` wide (a multiple of 4) for tokens at
    /// `positions`: `(first, second)` = (row, column) for clip.cpp's Qwen-VL
    /// positions.
    fn new(d_head: usize, positions: &[(usize, usize)]) -> VisionRope {
        let half = d_head / 2;
        let quarter = d_head / 4;
        let theta_scale = libm::powf(10000.0, -2.0 / half as f32);
        let mut cs = Vec::with_capacity(positions.len() * half);
        for &(p0, p1) in positions {
            let (mut t0, mut t1) = (p0 as f32, p1 as f32);
            for i in 0..half {
                if i == 0 {
                    t0 = p0 as f32;
                } else if i == quarter {
                    t1 = p1 as f32;
                }
                let theta = if i < quarter { t0 } else { t1 };
                cs.push((libm::cosf(theta), libm::sinf(theta)));
                t0 *= theta_scale;
                t1 *= theta_scale;
            }
        }
        VisionRope { half, cs }
    }

    /// Rotates every head of every token of `a` (`n_head` heads of
    /// `2 * half` values per token) in place.
    fn apply(&self, a: &mut Acts, n_head: usize) -> Result<(), VisionError> {
        let (half, dh) = (self.half, 2 * self.half);
        if a.dim != n_head * dh || self.cs.len() != a.n * half {
            return Err(VisionError::Shape("rope operands"));
        }
        for (row, cs) in a.x.chunks_exact_mut(a.dim).zip(self.cs.chunks_exact(half)) {
            for head in row.chunks_exact_mut(dh) {
                let (lo, hi) = head.split_at_mut(half);
                for ((x0, x1), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                    let (a0, a1) = (*x0, *x1);
                    *x0 = a0 * c - a1 * s;
                    *x1 = a0 * s + a1 * c;
                }
            }
        }
        Ok(())
    }
}

/// How a tower rotates its queries and keys.
enum Rope {
    /// Qwen3-VL's vision M-RoPE.
    Vision(VisionRope),
    /// Kimi-VL's and Llama 4's 2-D RoPE.
    Split(Rope2d),
}

impl Rope {
    fn apply(&self, a: &mut Acts, n_head: usize) -> Result<(), VisionError> {
        match self {
            Rope::Vision(r) => r.apply(a, n_head),
            Rope::Split(r) => r.apply(a, n_head),
        }
    }
}

/// One ViT block (pre-norm attention and FFN, with residuals); queries and
/// keys rotated by `rope` where given.
fn vit_layer(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    l: &VitLayer,
    x: Acts,
    rope: Option<&Rope>,
) -> Result<Acts, VisionError> {
    let hp = &m.hp;
    let h = vit_norm(hp, &x, &l.ln1);
    let mut q = linear(ctx, m, &l.q, &h)?;
    let mut k = linear(ctx, m, &l.k, &h)?;
    let v = linear(ctx, m, &l.v, &h)?;
    if let Some(n) = &l.q_norm {
        q = vit_norm(hp, &q, n);
    }
    if let Some(n) = &l.k_norm {
        k = vit_norm(hp, &k, n);
    }
    if let Some(r) = rope {
        r.apply(&mut q, hp.n_head)?;
        r.apply(&mut k, hp.n_head)?;
    }
    let a = attention(ctx, &q, &k, &v, hp.n_head)?;
    let mut a = linear(ctx, m, &l.o, &a)?;
    if let Some(s) = &l.ls1 {
        mul_rows(&mut a, s);
    }
    add_in_place(&mut a, &x);
    let x = a;
    let h = vit_norm(hp, &x, &l.ln2);
    let mut f = ffn(
        ctx,
        m,
        &h,
        &l.ffn_up,
        l.ffn_gate.as_ref(),
        &l.ffn_down,
        hp.ffn_op,
    )?;
    if let Some(s) = &l.ls2 {
        mul_rows(&mut f, s);
    }
    let mut out = x;
    add_in_place(&mut out, &f);
    Ok(out)
}

/// The 2x2 neighbourhoods of a `w` x `h` token grid (both even): for each output
/// position (row-major over the `w/2` x `h/2` grid) the four token indices
/// top-left, top-right, bottom-left, bottom-right.
pub fn windows_2x2(w: usize, h: usize) -> Vec<[usize; 4]> {
    let mut out = Vec::with_capacity(w * h / 4);
    for i in 0..h / 2 {
        for j in 0..w / 2 {
            let tl = 2 * i * w + 2 * j;
            out.push([tl, tl + 1, tl + w, tl + w + 1]);
        }
    }
    out
}

/// Concatenates the four tokens of every 2x2 window: `n/4` tokens of `4 * dim`.
fn concat_2x2(x: &Acts, w: usize, h: usize) -> Acts {
    let wins = windows_2x2(w, h);
    let mut out = Vec::with_capacity(x.x.len());
    for win in &wins {
        for &t in win {
            out.extend_from_slice(x.row(t));
        }
    }
    Acts {
        n: wins.len(),
        dim: 4 * x.dim,
        x: out,
    }
}

/// MiniCPM-V 4.6's merger inside the tower, on a `w` x `h` grid: window
/// attention within each 2x2 window (residual), then the 2x2 downsample MLP plus
/// the mean of the window.
fn vit_merger(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    mg: &VitMerger,
    x: Acts,
    w: usize,
    h: usize,
) -> Result<Acts, VisionError> {
    let hp = &m.hp;
    let normed = layer_norm(&x, &mg.ln1, hp.eps);
    let q = linear(ctx, m, &mg.q, &normed)?;
    let k = linear(ctx, m, &mg.k, &normed)?;
    let v = linear(ctx, m, &mg.v, &normed)?;
    let (d, n_head) = (hp.n_embd, hp.n_head);
    let dh = d / n_head;
    let scale = 1.0 / (dh as f32).sqrt();
    let mut att = Acts {
        n: x.n,
        dim: d,
        x: vec![0f32; x.n * d],
    };
    for win in windows_2x2(w, h) {
        for &qi in &win {
            for hd in 0..n_head {
                let r = hd * dh..(hd + 1) * dh;
                let qv = &q.row(qi)[r.clone()];
                let mut s = [0f32; 4];
                for (s, &kj) in s.iter_mut().zip(&win) {
                    *s = dot(qv, &k.row(kj)[r.clone()]);
                }
                softmax_scaled(&mut s, scale);
                let out = &mut att.x[qi * d + hd * dh..qi * d + (hd + 1) * dh];
                for (p, &vj) in s.iter().zip(&win) {
                    for (o, vv) in out.iter_mut().zip(&v.row(vj)[r.clone()]) {
                        *o += p * vv;
                    }
                }
            }
        }
    }
    let mut a = linear(ctx, m, &mg.o, &att)?;
    add_in_place(&mut a, &x);
    // 2x2 downsample: MLP of the concatenation plus the mean.
    let cat = concat_2x2(&a, w, h);
    let mut mean = Acts {
        n: cat.n,
        dim: d,
        x: Vec::with_capacity(cat.n * d),
    };
    for win in windows_2x2(w, h) {
        for c in 0..d {
            let s = a.x[win[0] * d + c]
                + a.x[win[1] * d + c]
                + a.x[win[2] * d + c]
                + a.x[win[3] * d + c];
            mean.x.push(s * 0.25);
        }
    }
    let normed = layer_norm(&cat, &mg.ds_ln, hp.eps);
    let mut out = ffn(ctx, m, &normed, &mg.ds_up, None, &mg.ds_down, FfnOp::Gelu)?;
    add_in_place(&mut out, &mean);
    Ok(out)
}

/// `a . b` with eight partial sums (vectorizes), the tail added last.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ta.iter().zip(tb) {
        s += x * y;
    }
    s
}

/// The position-embedding row of each patch of a `pw` x `ph` grid, for
/// MiniCPM-V: the patch's coordinates scaled onto the `side` x `side` table
/// (`floor(side * i / ph)`, as SigLIP-navit buckets them; llama.cpp hard-codes
/// `side` = 70, the table of every MiniCPM-V release).
pub fn bucket_positions(pw: usize, ph: usize, side: usize) -> Vec<usize> {
    let bh: Vec<usize> = (0..ph)
        .map(|i| (side as f64 * i as f64 / ph as f64).floor() as usize)
        .collect();
    let bw: Vec<usize> = (0..pw)
        .map(|j| (side as f64 * j as f64 / pw as f64).floor() as usize)
        .collect();
    let mut out = Vec::with_capacity(pw * ph);
    for &h in &bh {
        for &w in &bw {
            out.push(h * side + w);
        }
    }
    out
}

/// Number of output embeddings for an input of `width` x `height` pixels.
pub fn output_tokens(m: &ClipModel, width: usize, height: usize) -> usize {
    let p = m.hp.patch_size;
    let (pw, ph) = (width / p, height / p);
    match m.projector {
        Projector::MiniCpmV46 { .. } => {
            let f = m.hp.n_merge;
            (pw / f) * (ph / f)
        }
        Projector::Gemma3 { .. } => (pw / m.hp.n_merge) * (ph / m.hp.n_merge),
        Projector::Qwen3Vl { .. } | Projector::Glm4v { .. } => (pw / 2) * (ph / 2),
        Projector::KimiVl { .. } => {
            let f = m.hp.n_merge;
            pw.div_ceil(f) * ph.div_ceil(f)
        }
        Projector::Lfm2 { .. } => (pw / m.hp.n_merge) * (ph / m.hp.n_merge),
        Projector::Llama4 { .. } | Projector::InternVl { .. } => {
            (pw / m.hp.n_merge) * (ph / m.hp.n_merge)
        }
    }
}

/// The rows of the patches of `img` (`p` x `p` pixels each, on a grid `pw`
/// patches wide) in the order `order` gives (row-major patch indices), each
/// row in the kernel's (channel, y, x) order.
fn patch_rows(img: &ImageF32, p: usize, pw: usize, order: impl Iterator<Item = usize>) -> Acts {
    let cols = 3 * p * p;
    let mut x = Vec::new();
    let mut n = 0;
    for t in order {
        let (py, px) = (t / pw, t % pw);
        let start = x.len();
        x.resize(start + cols, 0.0);
        let row = &mut x[start..];
        for c in 0..3 {
            for ky in 0..p {
                for kx in 0..p {
                    let (x, y) = (px * p + kx, py * p + ky);
                    row[c * p * p + ky * p + kx] = img.data[3 * (y * img.width + x) + c];
                }
            }
        }
        n += 1;
    }
    Acts { n, dim: cols, x }
}

/// ggml's bilinear interpolation with aligned corners (`ggml_interpolate`,
/// `GGML_SCALE_MODE_BILINEAR | GGML_SCALE_FLAG_ALIGN_CORNERS`, its CPU
/// arithmetic in `f32`) of a `side` x `side` table of rows of `d` values to
/// `pw` x `ph`, row-major; the table itself when the sizes are equal (as
/// clip.cpp's `resize_position_embeddings` skips it).
pub fn interpolate_positions(
    table: &[f32],
    side: usize,
    d: usize,
    pw: usize,
    ph: usize,
) -> Vec<f32> {
    if pw == side && ph == side {
        return table.to_vec();
    }
    let scale = |out: usize, inp: usize| {
        if out > 1 && inp > 1 {
            (out - 1) as f32 / (inp - 1) as f32
        } else {
            out as f32 / inp as f32
        }
    };
    let (sf0, sf1) = (scale(pw, side), scale(ph, side));
    let last = side as i64 - 1;
    let at = |v: f32| {
        let v0 = v.floor() as i64;
        let (i0, i1) = (v0.clamp(0, last), (v0 + 1).clamp(0, last));
        let dv = (v - i0 as f32).clamp(0.0, 1.0);
        (i0 as usize, i1 as usize, dv)
    };
    let mut out = Vec::with_capacity(pw * ph * d);
    for y in 0..ph {
        let (y0, y1, dy) = at(y as f32 / sf1);
        for x in 0..pw {
            let (x0, x1, dx) = at(x as f32 / sf0);
            let row = |yy: usize, xx: usize| &table[(yy * side + xx) * d..][..d];
            let (a, b, c, e) = (row(y0, x0), row(y0, x1), row(y1, x0), row(y1, x1));
            for i in 0..d {
                out.push(
                    a[i] * (1.0 - dx) * (1.0 - dy)
                        + b[i] * dx * (1.0 - dy)
                        + c[i] * (1.0 - dx) * dy
                        + e[i] * dx * dy,
                );
            }
        }
    }
    out
}

/// The patch embeddings of Qwen3-VL's and GLM-4.xV's towers on a `pw` x
/// `ph` grid (both even), in the 2x2 merge order, and that order (the
/// row-major patch index of each token).
fn merge_ordered_patches(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    patch_embd_1: &Mat,
) -> Result<(Acts, Vec<usize>), VisionError> {
    let hp = &m.hp;
    let order: Vec<usize> = windows_2x2(pw, ph).into_iter().flatten().collect();
    // Both temporal kernels over the same picture (a still image is both
    // frames), summed, then the bias: each product in f16 as `ggml_conv_2d`.
    let patches = patch_rows(img, hp.patch_size, pw, order.iter().copied());
    let mut x = linear_wb(ctx, m, &m.patch_embd, None, &patches)?;
    let x1 = linear_wb(ctx, m, patch_embd_1, None, &patches)?;
    drop(patches);
    add_in_place(&mut x, &x1);
    drop(x1);
    if let Some(b) = &m.patch_bias {
        for row in x.x.chunks_exact_mut(hp.n_embd) {
            for (v, b) in row.iter_mut().zip(b) {
                *v += b;
            }
        }
    }
    Ok((x, order))
}

/// The side of `m`'s square position table.
fn square_side(m: &ClipModel) -> Result<usize, VisionError> {
    let side = (m.n_pos as f64).sqrt() as usize;
    if side * side != m.n_pos || m.pos_embd.len() != m.n_pos * m.hp.n_embd {
        return Err(VisionError::Shape(
            "position embeddings are not a square table",
        ));
    }
    Ok(side)
}

/// Adds to each token of `x` the row of `pos` (a row-major grid's) of its
/// patch, `order[token]`.
fn add_positions(x: &mut Acts, pos: &[f32], order: &[usize]) {
    let d = x.dim;
    for (row, &t) in x.x.chunks_exact_mut(d).zip(order) {
        for (v, e) in row.iter_mut().zip(&pos[t * d..(t + 1) * d]) {
            *v += e;
        }
    }
}

/// Qwen3-VL's tower on a `pw` x `ph` patch grid (both even): see
/// [`encode`].
#[allow(clippy::too_many_arguments)]
fn encode_qwen3vl(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    patch_embd_1: &Mat,
    deepstack: &[Deepstack],
    up: &Linear,
    down: &Linear,
) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let d = hp.n_embd;
    let n = pw * ph;
    let (mut x, order) = merge_ordered_patches(ctx, m, img, (pw, ph), patch_embd_1)?;
    // The learned position embeddings, interpolated to the grid.
    let side = square_side(m)?;
    let pos = interpolate_positions(&m.pos_embd, side, d, pw, ph);
    add_positions(&mut x, &pos, &order);
    drop(pos);
    if let Some(ln) = &m.pre_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    // clip.cpp's positions: (row, column) of each token's patch.
    let positions: Vec<(usize, usize)> = order.iter().map(|&t| (t / pw, t % pw)).collect();
    let rope = Rope::Vision(VisionRope::new(d / hp.n_head, &positions));
    let merged = |a: Acts| Acts {
        n: a.n / 4,
        dim: 4 * a.dim,
        x: a.x,
    };
    let mut features = Vec::with_capacity(deepstack.len());
    let mut ds = deepstack.iter().peekable();
    for (il, l) in m.layers.iter().enumerate() {
        x = vit_layer(ctx, m, l, x, Some(&rope))?;
        if let Some(dsm) = ds.next_if(|dsm| dsm.layer == il) {
            // Four consecutive tokens are a 2x2 block: a row of 4 * d.
            let normed = layer_norm(&merged(x.clone()), &dsm.norm, hp.eps);
            features.push(ffn(ctx, m, &normed, &dsm.fc1, None, &dsm.fc2, FfnOp::Gelu)?);
        }
    }
    if let Some(ln) = &m.post_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    let out = ffn(ctx, m, &merged(x), up, None, down, FfnOp::Gelu)?;
    let width = out.dim * (1 + features.len());
    let mut rows = Vec::with_capacity(out.n * width);
    for t in 0..out.n {
        rows.extend_from_slice(out.row(t));
        for f in &features {
            rows.extend_from_slice(f.row(t));
        }
    }
    debug_assert_eq!(n / 4, out.n);
    Ok(rows)
}

/// GLM-4.xV's tower on a `pw` x `ph` patch grid (both even): see
/// [`encode`].
fn encode_glm4v(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    patch_embd_1: &Mat,
    norm_embd: Option<&Norm>,
    mg: &Glm4vMerger,
) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let d = hp.n_embd;
    let (mut x, order) = merge_ordered_patches(ctx, m, img, (pw, ph), patch_embd_1)?;
    if let Some(n) = norm_embd {
        x = vit_norm(hp, &x, n);
    }
    // The learned position embeddings, interpolated bicubically to the
    // grid (ggml's first axis the width), in the merge order.
    let side = square_side(m)?;
    let pos = interpolate_positions_bicubic(&m.pos_embd, (side, side), d, (pw, ph), false);
    add_positions(&mut x, &pos, &order);
    drop(pos);
    if let Some(ln) = &m.pre_ln {
        x = vit_norm(hp, &x, ln);
    }
    // clip.cpp's positions: (row, column) of each token's patch.
    let positions: Vec<(usize, usize)> = order.iter().map(|&t| (t / pw, t % pw)).collect();
    let rope = Rope::Vision(VisionRope::new(d / hp.n_head, &positions));
    for l in &m.layers {
        x = vit_layer(ctx, m, l, x, Some(&rope))?;
    }
    if let Some(ln) = &m.post_ln {
        x = vit_norm(hp, &x, ln);
    }
    // The merger's 2x2 convolution: each block's four tokens (top-left,
    // top-right, bottom-left, bottom-right) as one row in the kernel's
    // (channel, row, column) order.
    let mut blocks = Acts {
        n: x.n / 4,
        dim: 4 * d,
        x: vec![0f32; x.x.len()],
    };
    for (block, out) in
        x.x.chunks_exact(4 * d)
            .zip(blocks.x.chunks_exact_mut(4 * d))
    {
        for (k, token) in block.chunks_exact(d).enumerate() {
            for (c, &v) in token.iter().enumerate() {
                out[4 * c + k] = v;
            }
        }
    }
    drop(x);
    let merged = linear(ctx, m, &mg.conv, &blocks)?;
    drop(blocks);
    // The projection, LayerNorm (clip.cpp's 1e-5), GELU (erf) and the
    // SwiGLU MLP.
    let mut h = linear_wb(ctx, m, &mg.fc, None, &merged)?;
    h = layer_norm(&h, &mg.post_norm, 1e-5);
    par_map(ctx.pool, &mut h.x, gelu_erf);
    let out = ffn(ctx, m, &h, &mg.up, Some(&mg.gate), &mg.down, hp.ffn_op)?;
    Ok(out.x)
}

/// clip.cpp's `build_rope_2d` without interleaved frequencies (Kimi-VL's and
/// Llama 4's):
/// ggml's normal RoPE (`mode` 0: adjacent pairs) over the first half of each
/// head by the first position (clip.cpp's column), then over the second half
/// by the second (the row), each half's pair `i` turning by
/// `pos * 10000^(-4 i / d_head)`, the angles multiplied in `f32` one step at
/// a time as ggml's cache does.
struct Rope2d {
    quarter: usize,
    /// `(cos, sin)` of every pair, for each token: the first half's pairs,
    /// then the second's.
    cs: Vec<(f32, f32)>,
}

impl Rope2d {
    /// The rotation of heads `d_head` wide (a multiple of 4) for tokens at
    /// `positions`: `(first half, second half)` = (column, row).
    fn new(d_head: usize, base: f32, positions: &[(usize, usize)]) -> Rope2d {
        let quarter = d_head / 4;
        let theta_scale = libm::powf(base, -2.0 / (d_head / 2) as f32);
        let mut cs = Vec::with_capacity(positions.len() * 2 * quarter);
        for &(a, b) in positions {
            for p in [a, b] {
                let mut theta = p as f32;
                for _ in 0..quarter {
                    cs.push((libm::cosf(theta), libm::sinf(theta)));
                    theta *= theta_scale;
                }
            }
        }
        Rope2d { quarter, cs }
    }

    /// Rotates every head of every token of `a` (`n_head` heads of
    /// `4 * quarter` values per token) in place.
    fn apply(&self, a: &mut Acts, n_head: usize) -> Result<(), VisionError> {
        let (pairs, dh) = (2 * self.quarter, 4 * self.quarter);
        if a.dim != n_head * dh || self.cs.len() != a.n * pairs {
            return Err(VisionError::Shape("rope operands"));
        }
        for (row, cs) in a.x.chunks_exact_mut(a.dim).zip(self.cs.chunks_exact(pairs)) {
            for head in row.chunks_exact_mut(dh) {
                for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(cs) {
                    let (x0, x1) = (pair[0], pair[1]);
                    pair[0] = x0 * c - x1 * s;
                    pair[1] = x0 * s + x1 * c;
                }
            }
        }
        Ok(())
    }
}

/// ggml's antialiased bilinear interpolation (`ggml_interpolate`,
/// `GGML_SCALE_MODE_BILINEAR | GGML_SCALE_FLAG_ANTIALIAS`: PyTorch's
/// `interpolate(bilinear, align_corners=False, antialias=True)`, ggml's CPU
/// arithmetic in `f32`) of a `side` x `side` table of rows of `d` values to
/// `pw` x `ph`, row-major; the table itself when the sizes are equal (as
/// clip.cpp's `resize_position_embeddings` skips it).
pub fn interpolate_positions_antialiased(
    table: &[f32],
    side: usize,
    d: usize,
    pw: usize,
    ph: usize,
) -> Vec<f32> {
    if pw == side && ph == side {
        return table.to_vec();
    }
    // For each output coordinate along an axis: the source indices it reads
    // and their triangle-filter weights (support at least one pixel).
    let taps = |out: usize| -> Vec<Vec<(usize, f32)>> {
        let sf = out as f32 / side as f32;
        let support = (1.0 / sf).max(1.0);
        let invscale = 1.0 / support;
        (0..out)
            .map(|i| {
                let x = (i as f32 + 0.5) / sf;
                // C++'s float-to-int64 conversion truncates toward zero.
                let lo = ((x - support + 0.5) as i64).max(0);
                let hi = ((x + support + 0.5) as i64).min(side as i64);
                (lo..hi)
                    .map(|s| {
                        let w = (1.0 - ((s as f32 - x + 0.5) * invscale).abs()).max(0.0);
                        (s as usize, w)
                    })
                    .collect()
            })
            .collect()
    };
    let (tx, ty) = (taps(pw), taps(ph));
    let mut out = vec![0f32; pw * ph * d];
    for (y, wys) in ty.iter().enumerate() {
        for (x, wxs) in tx.iter().enumerate() {
            let o = &mut out[(y * pw + x) * d..][..d];
            // ggml sums each value's taps row by row, skipping zero weights,
            // then divides by the sum of the weights.
            let mut total = 0f32;
            for &(sy, wy) in wys {
                for &(sx, wx) in wxs {
                    let w = wx * wy;
                    if w <= 0.0 {
                        continue;
                    }
                    total += w;
                    let src = &table[(sy * side + sx) * d..][..d];
                    for (o, v) in o.iter_mut().zip(src) {
                        *o += v * w;
                    }
                }
            }
            if total > 0.0 {
                o.iter_mut().for_each(|o| *o /= total);
            }
        }
    }
    out
}

/// The patches of a `pw` x `ph` grid (the first `pw * ph` rows of `x`, row
/// by row) merged `f` x `f`: each block as one row of `f² * x.dim` values
/// (within a block, its rows top to bottom, each left to right), the blocks
/// row by row, or column by column where `column_major`.
fn merge_blocks(x: &Acts, pw: usize, ph: usize, f: usize, column_major: bool) -> Vec<f32> {
    let (d, gw, gh) = (x.dim, pw / f, ph / f);
    let mut out = Vec::with_capacity(pw * ph * d);
    for outer in 0..if column_major { gw } else { gh } {
        for inner in 0..if column_major { gh } else { gw } {
            let (bx, by) = if column_major {
                (outer, inner)
            } else {
                (inner, outer)
            };
            for dy in 0..f {
                let start = (f * by + dy) * pw + f * bx;
                out.extend_from_slice(&x.x[start * d..(start + f) * d]);
            }
        }
    }
    out
}

/// ggml's bicubic interpolation (`ggml_interpolate`,
/// `GGML_SCALE_MODE_BICUBIC`: PyTorch's convolution with `a = -0.75`, pixel
/// centres, edges clamped, its CPU arithmetic in `f32`) of a `w0` x `h0`
/// table of rows of `d` values (row-major) to `pw` x `ph`. ggml takes the
/// bicubic along its second axis of four along its first: with
/// `height_first` (Kimi K2.5's graph, whose first axis is the height) each
/// output value is the bicubic along the width of four along the height,
/// else (GLM-4.xV's) along the height of four along the width. The table
/// itself when the sizes are equal.
pub fn interpolate_positions_bicubic(
    table: &[f32],
    (w0, h0): (usize, usize),
    d: usize,
    (pw, ph): (usize, usize),
    height_first: bool,
) -> Vec<f32> {
    if (pw, ph) == (w0, h0) {
        return table.to_vec();
    }
    const A: f32 = -0.75;
    let weight1 = |x: f32| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
    let weight2 = |x: f32| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
    // Per output coordinate of an axis: its four taps (edges clamped) and
    // their weights, the same for every value of a row.
    let axis = |out: usize, inp: usize| -> Vec<([usize; 4], [f32; 4])> {
        let sf = out as f32 / inp as f32;
        (0..out)
            .map(|i| {
                let x = (i as f32 + 0.5) / sf - 0.5;
                let x0 = x.floor();
                let t = x - x0;
                let at = |o: i64| (x0 as i64 + o).clamp(0, inp as i64 - 1) as usize;
                let taps = [at(-1), at(0), at(1), at(2)];
                let w = [
                    weight2(t + 1.0),
                    weight1(t),
                    weight1(1.0 - t),
                    weight2(2.0 - t),
                ];
                (taps, w)
            })
            .collect()
    };
    let cubic = |p: [f32; 4], w: &[f32; 4]| p[0] * w[0] + p[1] * w[1] + p[2] * w[2] + p[3] * w[3];
    let (hs, ws) = (axis(ph, h0), axis(pw, w0));
    let mut out = Vec::with_capacity(pw * ph * d);
    for (ht, hw) in &hs {
        for (wt, ww) in &ws {
            for c in 0..d {
                let at = |hy: usize, wx: usize| table[(hy * w0 + wx) * d + c];
                out.push(if height_first {
                    cubic(wt.map(|wx| cubic(ht.map(|hy| at(hy, wx)), hw)), ww)
                } else {
                    cubic(ht.map(|hy| cubic(wt.map(|wx| at(hy, wx)), ww)), hw)
                });
            }
        }
    }
    out
}

/// Kimi-VL's tower on a `pw` x `ph` patch grid (both multiples of the
/// merge): see [`encode`].
fn encode_kimivl(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    input_norm: &Norm,
    up: &Linear,
    down: &Linear,
) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let d = hp.n_embd;
    let f = hp.n_merge;
    // The learned position embeddings, interpolated to the grid: Kimi-VL's
    // square table with antialiasing, Kimi K2.5's W x H one bicubically.
    let kimik25 = hp.projector == ProjectorType::KimiK25;
    let mut x = if kimik25 {
        if m.pos_embd.len() != m.n_pos * d {
            return Err(VisionError::Shape(
                "position embeddings are not a square table",
            ));
        }
        let pos = interpolate_positions_bicubic(&m.pos_embd, m.pos_grid, d, (pw, ph), true);
        patches_with_positions(ctx, m, img, (pw, ph), pos)?
    } else {
        patches_with_resized_table(ctx, m, img, (pw, ph))?
    };
    // clip.cpp's positions: the first half of a head by the patch's column,
    // the second by its row (clip.cpp's `rope_theta` 10000).
    let positions: Vec<(usize, usize)> = (0..pw * ph).map(|t| (t % pw, t / pw)).collect();
    let rope = Rope::Split(Rope2d::new(d / hp.n_head, 10000.0, &positions));
    for l in &m.layers {
        x = vit_layer(ctx, m, l, x, Some(&rope))?;
    }
    if let Some(ln) = &m.post_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    // Each f x f block of patches as one row (blocks row by row), each
    // patch normalised (Kimi-VL: clip.cpp's fixed epsilon; Kimi K2.5: the
    // file's), then the MLP.
    let (gw, gh) = (pw / f, ph / f);
    let merged = merge_blocks(&x, pw, ph, f, false);
    drop(x);
    let normed = layer_norm(
        &Acts {
            n: gw * gh * f * f,
            dim: d,
            x: merged,
        },
        input_norm,
        if kimik25 { hp.eps } else { 1e-5 },
    );
    let normed = Acts {
        n: gw * gh,
        dim: f * f * d,
        x: normed.x,
    };
    let out = ffn(ctx, m, &normed, up, None, down, FfnOp::Gelu)?;
    Ok(out.x)
}

/// The tokens of a tile of Llama 4's or InternVL's tower (`pw` x `ph`
/// patches, square, the position table's size): the patch embeddings (and
/// their bias where the file has one), then the class token after them,
/// and the position table added row by row to all `pw * ph + 1`.
fn tile_with_class_token(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    class_embd: &[f32],
) -> Result<Acts, VisionError> {
    let hp = &m.hp;
    let n = pw * ph;
    if pw != ph || n + 1 != m.n_pos || m.pos_embd.len() != m.n_pos * hp.n_embd {
        return Err(VisionError::Shape(
            "the tower takes image_size x image_size tiles",
        ));
    }
    let patches = patch_rows(img, hp.patch_size, pw, 0..n);
    let mut x = linear_wb(ctx, m, &m.patch_embd, m.patch_bias.as_deref(), &patches)?;
    drop(patches);
    x.x.extend_from_slice(class_embd);
    x.n += 1;
    for (v, e) in x.x.iter_mut().zip(&m.pos_embd) {
        *v += e;
    }
    Ok(x)
}

/// Llama 4's tower on one `pw` x `ph` tile (`image_size` a side): see
/// [`encode`].
fn encode_llama4(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    class_embd: &[f32],
    [mlp1, mlp2, fc]: [&Mat; 3],
) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let (d, f) = (hp.n_embd, hp.n_merge);
    let n = pw * ph;
    // The patches (unfolded, times the matrix, no bias).
    let mut x = tile_with_class_token(ctx, m, img, (pw, ph), class_embd)?;
    if let Some(ln) = &m.pre_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    // clip.cpp's positions: (column + 1, row + 1), the class token (0, 0).
    let positions: Vec<(usize, usize)> = (0..n)
        .map(|t| (t % pw + 1, t / pw + 1))
        .chain([(0, 0)])
        .collect();
    let rope = Rope::Split(Rope2d::new(d / hp.n_head, 10000.0, &positions));
    for l in &m.layers {
        x = vit_layer(ctx, m, l, x, Some(&rope))?;
    }
    if let Some(ln) = &m.post_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    // The class token dropped (it is the last row); each f x f block of
    // patches as one row, the blocks column by column: the order llama.cpp's
    // reshapes leave.
    let g = pw / f;
    let shuffled = merge_blocks(&x, pw, ph, f, true);
    drop(x);
    let mut h = Acts {
        n: g * g,
        dim: f * f * d,
        x: shuffled,
    };
    for w in [mlp1, mlp2] {
        h = linear_wb(ctx, m, w, None, &h)?;
        par_map(ctx.pool, &mut h.x, gelu);
    }
    Ok(linear_wb(ctx, m, fc, None, &h)?.x)
}

/// InternVL's tower on one `image_size` tile (`pw` x `ph` patches, square):
/// see [`encode`].
fn encode_internvl(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    class_embd: &[f32],
    (norm, up, down): (&Norm, &Linear, &Linear),
) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let (d, f) = (hp.n_embd, hp.n_merge);
    let n = pw * ph;
    // The patches (in f16 as `ggml_conv_2d`) and their bias; the table's
    // first row goes to the first patch, its last to the class token, as
    // clip.cpp adds them.
    let mut x = tile_with_class_token(ctx, m, img, (pw, ph), class_embd)?;
    if let Some(ln) = &m.pre_ln {
        x = vit_norm(hp, &x, ln);
    }
    for l in &m.layers {
        x = vit_layer(ctx, m, l, x, None)?;
    }
    if let Some(ln) = &m.post_ln {
        x = vit_norm(hp, &x, ln);
    }
    // The class token dropped (the last row); each f x f block of patches
    // as one row, blocks row by row (llama.cpp's reshapes on a square
    // tile), then LayerNorm (PyTorch's 1e-5) and the GELU MLP.
    x.x.truncate(n * d);
    x.n = n;
    let g = pw / f;
    let shuffled = Acts {
        n: g * g,
        dim: f * f * d,
        x: merge_blocks(&x, pw, ph, f, false),
    };
    drop(x);
    let normed = layer_norm(&shuffled, norm, 1e-5);
    Ok(ffn(ctx, m, &normed, up, None, down, FfnOp::Gelu)?.x)
}

/// Runs the tower on one preprocessed image (or slice): returns
/// [`output_tokens`] embeddings of [`ClipModel::row_width`] values (the
/// projector's `n_mmproj_embd`, and for Qwen3-VL each deepstack merger's
/// after it), row-major; Qwen3-VL's in the merged grid's row-major order.
pub fn encode(ctx: &mut Ctx<'_>, m: &ClipModel, img: &ImageF32) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let p = hp.patch_size;
    if img.width == 0
        || img.height == 0
        || !img.width.is_multiple_of(p)
        || !img.height.is_multiple_of(p)
    {
        return Err(VisionError::Shape(
            "image size is not a multiple of the patch size",
        ));
    }
    let (pw, ph) = (img.width / p, img.height / p);
    let align = match m.projector {
        Projector::MiniCpmV46 { .. } => hp.n_merge,
        Projector::Gemma3 { .. } => hp.n_merge,
        Projector::Qwen3Vl { .. } | Projector::Glm4v { .. } => 2,
        Projector::KimiVl { .. }
        | Projector::Llama4 { .. }
        | Projector::InternVl { .. }
        | Projector::Lfm2 { .. } => hp.n_merge,
    };
    if !pw.is_multiple_of(align) || !ph.is_multiple_of(align) {
        return Err(VisionError::Shape(
            "image size is not a multiple of patch size x merge factor",
        ));
    }
    match &m.projector {
        Projector::MiniCpmV46 {
            vit_merger,
            input_norm,
            up,
            down,
        } => {
            let side = (m.n_pos as f64).sqrt() as usize;
            let rows = bucket_positions(pw, ph, side);
            let x = siglip_embeddings(ctx, m, img, pw, &rows)?;
            encode_minicpmv46(
                ctx,
                m,
                x,
                (pw, ph),
                vit_merger.as_deref(),
                input_norm,
                up,
                down,
            )
        }
        Projector::Gemma3 {
            soft_emb_norm,
            input_proj,
        } => {
            if pw * ph != m.n_pos {
                return Err(VisionError::Shape(
                    "gemma3 takes image_size x image_size images",
                ));
            }
            let rows: Vec<usize> = (0..pw * ph).collect();
            let x = siglip_embeddings(ctx, m, img, pw, &rows)?;
            encode_gemma3(ctx, m, x, (pw, ph), soft_emb_norm, input_proj)
        }
        Projector::Qwen3Vl {
            patch_embd_1,
            deepstack,
            up,
            down,
        } => encode_qwen3vl(ctx, m, img, (pw, ph), patch_embd_1, deepstack, up, down),
        Projector::KimiVl {
            input_norm,
            up,
            down,
        } => encode_kimivl(ctx, m, img, (pw, ph), input_norm, up, down),
        Projector::Llama4 {
            class_embd,
            mlp1,
            mlp2,
            fc,
        } => encode_llama4(ctx, m, img, (pw, ph), class_embd, [mlp1, mlp2, fc]),
        Projector::Glm4v {
            patch_embd_1,
            norm_embd,
            merger,
        } => encode_glm4v(
            ctx,
            m,
            img,
            (pw, ph),
            patch_embd_1,
            norm_embd.as_ref(),
            merger,
        ),
        Projector::InternVl {
            class_embd,
            norm,
            up,
            down,
        } => encode_internvl(ctx, m, img, (pw, ph), class_embd, (norm, up, down)),
        Projector::Lfm2 {
            input_norm,
            up,
            down,
        } => encode_lfm2(ctx, m, img, (pw, ph), input_norm.as_ref(), up, down),
    }
}

/// The input of a tower whose square position table is resized to the
/// image's `pw` x `ph` patch grid with antialiasing (Kimi-VL's, LFM2-VL's:
/// clip.cpp's `resize_position_embeddings`): see [`patches_with_positions`].
fn patches_with_resized_table(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
) -> Result<Acts, VisionError> {
    let d = m.hp.n_embd;
    let side = (m.n_pos as f64).sqrt() as usize;
    if side * side != m.n_pos || m.pos_embd.len() != m.n_pos * d {
        return Err(VisionError::Shape(
            "position embeddings are not a square table",
        ));
    }
    let pos = interpolate_positions_antialiased(&m.pos_embd, side, d, pw, ph);
    patches_with_positions(ctx, m, img, (pw, ph), pos)
}

/// The patch embedding of `img` (in f16, as `ggml_conv_2d`) and its bias,
/// plus `pos` (a row per patch of the `pw` x `ph` grid, row-major), then
/// `pre_ln` where the file has it.
fn patches_with_positions(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    pos: Vec<f32>,
) -> Result<Acts, VisionError> {
    let hp = &m.hp;
    let patches = patch_rows(img, hp.patch_size, pw, 0..pw * ph);
    let mut x = linear_wb(ctx, m, &m.patch_embd, m.patch_bias.as_deref(), &patches)?;
    drop(patches);
    add_in_place(
        &mut x,
        &Acts {
            n: pw * ph,
            dim: hp.n_embd,
            x: pos,
        },
    );
    if let Some(ln) = &m.pre_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    Ok(x)
}

/// LFM2-VL's tower and projector on one image of `pw` x `ph` patches (each
/// side a multiple of the merge): clip.cpp's `clip_graph_siglip` for
/// `PROJECTOR_TYPE_LFM2`. The patch embedding and its bias, the square
/// position table resized to the grid (antialiased bilinear, clip.cpp's
/// `resize_position_embeddings`), `pre_ln` where the file has it, the
/// blocks (no RoPE), `post_ln` where the file has it; then each `n_merge` x
/// `n_merge` block of patches as one row (blocks row by row: clip.cpp's
/// `build_patch_merge_permute`), LayerNormed at epsilon 1e-5 where the file
/// has the norm, and the GELU MLP.
fn encode_lfm2(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    (pw, ph): (usize, usize),
    input_norm: Option<&Norm>,
    up: &Linear,
    down: &Linear,
) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let d = hp.n_embd;
    let f = hp.n_merge;
    let mut x = patches_with_resized_table(ctx, m, img, (pw, ph))?;
    for l in &m.layers {
        x = vit_layer(ctx, m, l, x, None)?;
    }
    if let Some(ln) = &m.post_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    let (gw, gh) = (pw / f, ph / f);
    let mut merged = Acts {
        n: gw * gh,
        dim: f * f * d,
        x: merge_blocks(&x, pw, ph, f, false),
    };
    drop(x);
    if let Some(norm) = input_norm {
        merged = layer_norm(&merged, norm, 1e-5);
    }
    let out = ffn(ctx, m, &merged, up, None, down, FfnOp::Gelu)?;
    Ok(out.x)
}

/// The SigLIP towers' (MiniCPM-V's, Gemma 3's) input: the patch embedding,
/// a convolution with stride = kernel = patch, i.e. one GEMM over the patches
/// of a `pw`-wide grid, columns in (channel, y, x) order, in f16 as
/// llama.cpp's `ggml_conv_2d` computes it (an f32 kernel is rounded to f16 at
/// load, and `linear_wb` rounds the pixels); then each patch's learned
/// position embedding, row `rows[patch]` of the table; then `pre_ln`.
fn siglip_embeddings(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    img: &ImageF32,
    pw: usize,
    rows: &[usize],
) -> Result<Acts, VisionError> {
    let hp = &m.hp;
    let d = hp.n_embd;
    let patches = patch_rows(img, hp.patch_size, pw, 0..rows.len());
    let mut x = linear_wb(ctx, m, &m.patch_embd, m.patch_bias.as_deref(), &patches)?;
    for (i, &r) in rows.iter().enumerate() {
        if r >= m.n_pos {
            return Err(VisionError::Shape("position embedding index out of range"));
        }
        for (v, e) in x.x[i * d..(i + 1) * d]
            .iter_mut()
            .zip(&m.pos_embd[r * d..(r + 1) * d])
        {
            *v += e;
        }
    }
    if let Some(ln) = &m.pre_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    Ok(x)
}

/// MiniCPM-V 4.6's tower after [`siglip_embeddings`] (`x`, a `pw` x `ph`
/// grid): the blocks with the window-attention merger after block
/// `insert_layer` where there is one, `post_ln`, then the 2x2 merger MLP.
#[allow(clippy::too_many_arguments)]
fn encode_minicpmv46(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    mut x: Acts,
    (pw, ph): (usize, usize),
    merger: Option<&VitMerger>,
    input_norm: &Norm,
    up: &Linear,
    down: &Linear,
) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let (mut gw, mut gh) = (pw, ph);
    match merger {
        Some(mg) => {
            for l in &m.layers[..=hp.insert_layer] {
                x = vit_layer(ctx, m, l, x, None)?;
            }
            x = vit_merger(ctx, m, mg, x, gw, gh)?;
            (gw, gh) = (gw / 2, gh / 2);
            for l in &m.layers[hp.insert_layer + 1..] {
                x = vit_layer(ctx, m, l, x, None)?;
            }
        }
        None => {
            for l in &m.layers {
                x = vit_layer(ctx, m, l, x, None)?;
            }
        }
    }
    if let Some(ln) = &m.post_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    let cat = concat_2x2(&x, gw, gh);
    let normed = layer_norm(&cat, input_norm, hp.eps);
    let out = ffn(ctx, m, &normed, up, None, down, FfnOp::GeluErf)?;
    Ok(out.x)
}

/// Gemma 3's tower after [`siglip_embeddings`] (`x`, a `pw` x `ph` grid):
/// the blocks, `post_ln`, average pooling of `n_merge` x `n_merge` patches,
/// RMSNorm and the projection.
fn encode_gemma3(
    ctx: &mut Ctx<'_>,
    m: &ClipModel,
    mut x: Acts,
    (pw, ph): (usize, usize),
    soft_emb_norm: &[f32],
    input_proj: &Mat,
) -> Result<Vec<f32>, VisionError> {
    let hp = &m.hp;
    let d = hp.n_embd;
    for l in &m.layers {
        x = vit_layer(ctx, m, l, x, None)?;
    }
    if let Some(ln) = &m.post_ln {
        x = layer_norm(&x, ln, hp.eps);
    }
    let k = hp.n_merge;
    let (ow, oh) = (pw / k, ph / k);
    let mut pooled = Acts {
        n: ow * oh,
        dim: d,
        x: vec![0f32; ow * oh * d],
    };
    for oy in 0..oh {
        for ox in 0..ow {
            let out = &mut pooled.x[(oy * ow + ox) * d..(oy * ow + ox + 1) * d];
            for ky in 0..k {
                for kx in 0..k {
                    let t = (oy * k + ky) * pw + ox * k + kx;
                    for (o, v) in out.iter_mut().zip(x.row(t)) {
                        *o += v;
                    }
                }
            }
            let ka = (k * k) as f32;
            out.iter_mut().for_each(|v| *v /= ka);
        }
    }
    rms_norm(&mut pooled, soft_emb_norm, hp.eps);
    let out = linear_wb(ctx, m, input_proj, None, &pooled)?;
    Ok(out.x)
}
