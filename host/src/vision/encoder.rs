//! The vision tower's forward pass: patch embedding, ViT blocks, and the
//! projector into the language model's embedding space, as llama.cpp's clip
//! graphs compute them (`tools/mtmd/clip.cpp` `build_vit`,
//! `models/minicpmv.cpp`, `models/siglip.cpp`).
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

use super::clip::{ClipModel, FfnOp, Linear, Mat, Norm, Projector, VitLayer, VitMerger};
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
    let rounded: Option<Vec<f32>> = round.map(|r| a.x.iter().map(|&v| r(v)).collect());
    let x = rounded.as_deref().unwrap_or(&a.x);
    matmul(ctx.pool, ctx.isa, &w, x, a.n, &mut y)?;
    if let Some(b) = b {
        for row in y.chunks_exact_mut(w.rows()) {
            for (v, b) in row.iter_mut().zip(b) {
                *v += b;
            }
        }
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
            for (u, g) in h.x.iter_mut().zip(&g.x) {
                *u *= act(*g);
            }
        }
        None => h.x.iter_mut().for_each(|v| *v = act(*v)),
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
/// and the weighted sums in [`vector::scaled_dots`]', [`vector::softmax`]'s
/// and [`vector::weighted_rows`]' fixed orders, the same bits with every ISA).
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
            let keys = vector::Strided {
                data: &k.x[h * dh..],
                stride: d,
                n,
                d: dh,
            };
            vector::scaled_dots(isa, &qs, keys, scale, &mut scores);
            for row in scores.chunks_exact_mut(n) {
                vector::softmax(isa, row);
            }
            let values = vector::Strided {
                data: &v.x[h * dh..],
                ..keys
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

/// One ViT block (pre-norm attention and FFN, with residuals).
fn vit_layer(ctx: &mut Ctx<'_>, m: &ClipModel, l: &VitLayer, x: Acts) -> Result<Acts, VisionError> {
    let hp = &m.hp;
    let h = layer_norm(&x, &l.ln1, hp.eps);
    let q = linear(ctx, m, &l.q, &h)?;
    let k = linear(ctx, m, &l.k, &h)?;
    let v = linear(ctx, m, &l.v, &h)?;
    let a = attention(ctx, &q, &k, &v, hp.n_head)?;
    let mut a = linear(ctx, m, &l.o, &a)?;
    if let Some(s) = &l.ls1 {
        mul_rows(&mut a, s);
    }
    add_in_place(&mut a, &x);
    let x = a;
    let h = layer_norm(&x, &l.ln2, hp.eps);
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
    }
}

/// Runs the tower on one preprocessed image (or slice): returns
/// [`output_tokens`] embeddings of `n_mmproj_embd` values, row-major.
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
    let n = pw * ph;
    let d = hp.n_embd;
    let align = match m.projector {
        Projector::MiniCpmV46 { .. } => hp.n_merge,
        Projector::Gemma3 { .. } => hp.n_merge,
    };
    if !pw.is_multiple_of(align) || !ph.is_multiple_of(align) {
        return Err(VisionError::Shape(
            "image size is not a multiple of patch size x merge factor",
        ));
    }

    // Patch embedding: a convolution with stride = kernel = patch, i.e. one GEMM
    // over the patches, columns in (channel, y, x) order, in f16 as llama.cpp's
    // `ggml_conv_2d` computes it (an f32 kernel is rounded to f16 at load,
    // and `linear_wb` rounds the pixels).
    let cols = 3 * p * p;
    let mut patches = vec![0f32; n * cols];
    for py in 0..ph {
        for px in 0..pw {
            let row = &mut patches[(py * pw + px) * cols..(py * pw + px + 1) * cols];
            for c in 0..3 {
                for ky in 0..p {
                    for kx in 0..p {
                        let (x, y) = (px * p + kx, py * p + ky);
                        row[c * p * p + ky * p + kx] = img.data[3 * (y * img.width + x) + c];
                    }
                }
            }
        }
    }
    let mut x = linear_wb(
        ctx,
        m,
        &m.patch_embd,
        m.patch_bias.as_deref(),
        &Acts {
            n,
            dim: cols,
            x: patches,
        },
    )?;

    // Learned position embeddings.
    let rows: Vec<usize> = match m.projector {
        Projector::MiniCpmV46 { .. } => {
            let side = (m.n_pos as f64).sqrt() as usize;
            bucket_positions(pw, ph, side)
        }
        Projector::Gemma3 { .. } => {
            if n != m.n_pos {
                return Err(VisionError::Shape(
                    "gemma3 takes image_size x image_size images",
                ));
            }
            (0..n).collect()
        }
    };
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

    match &m.projector {
        Projector::MiniCpmV46 {
            vit_merger: merger,
            input_norm,
            up,
            down,
        } => {
            let (mut gw, mut gh) = (pw, ph);
            match merger {
                Some(mg) => {
                    for l in &m.layers[..=hp.insert_layer] {
                        x = vit_layer(ctx, m, l, x)?;
                    }
                    x = vit_merger(ctx, m, mg, x, gw, gh)?;
                    (gw, gh) = (gw / 2, gh / 2);
                    for l in &m.layers[hp.insert_layer + 1..] {
                        x = vit_layer(ctx, m, l, x)?;
                    }
                }
                None => {
                    for l in &m.layers {
                        x = vit_layer(ctx, m, l, x)?;
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
        Projector::Gemma3 {
            soft_emb_norm,
            input_proj,
        } => {
            for l in &m.layers {
                x = vit_layer(ctx, m, l, x)?;
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
    }
}
