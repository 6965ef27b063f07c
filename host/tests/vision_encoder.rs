//! The vision encoder against an independent plain-`f32` reference, on tiny
//! synthetic projectors (`minicpmv4_6`, `gemma3`, `qwen3vl_merger` and
//! `kimivl`, `f32` and `f16` weights).
//!
//! The reference follows llama.cpp's graphs literally: the patch embedding as a
//! convolution, attention with full score matrices and, for MiniCPM-V 4.6's
//! merger, the window-major reorder with a block-diagonal mask and the gather
//! indices of `clip.cpp`; every weight dequantized to `f32` first. Element-wise
//! functions have ggml's semantics (GELU through `f16`), written out here again.

mod common;

use std::path::PathBuf;

use les::compute::Pool;
use les::gguf::Gguf;
use les::synth::{write_mmproj, MmprojConfig};
use les::vision::encoder::{encode, output_tokens, Ctx};
use les::vision::{ClipModel, ImageF32, ProjectorType};
use les_core::gemv::Isa;
use les_core::quant::{dequantize, f16_to_f32, f32_to_f16, GgmlType};

fn tmp(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name)
}

struct Weights(Gguf);

impl Weights {
    fn get(&self, name: &str) -> Vec<f32> {
        let t = self.0.tensor(name).unwrap_or_else(|| panic!("{name}"));
        let n: u64 = t.dims().iter().product();
        let mut v = vec![0f32; n as usize];
        dequantize(t.ggml_type(), t.data(), &mut v).unwrap();
        v
    }

    fn has(&self, name: &str) -> bool {
        self.0.tensor(name).is_some()
    }
}

/// `v` rounded to f16.
fn f16(v: f32) -> f32 {
    f16_to_f32(f32_to_f16(v))
}

/// `y = W x + b` for each row of `x` (`W` stored as ggml: `rows` rows of `cols`);
/// as ggml multiplies an f16 `W`, by `x` rounded to f16.
fn linear(w: &Weights, prefix: &str, x: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let name = format!("{prefix}.weight");
    let wt = w.get(&name);
    let x_f16: Vec<Vec<f32>>;
    let x = if w.0.tensor(&name).unwrap().ggml_type() == GgmlType::F16 {
        x_f16 = x
            .iter()
            .map(|r| r.iter().map(|&v| f16(v)).collect())
            .collect();
        &x_f16[..]
    } else {
        x
    };
    let b = if w.has(&format!("{prefix}.bias")) {
        Some(w.get(&format!("{prefix}.bias")))
    } else {
        None
    };
    let cols = x[0].len();
    let rows = wt.len() / cols;
    x.iter()
        .map(|xi| {
            (0..rows)
                .map(|r| {
                    let mut s = 0f64;
                    for c in 0..cols {
                        s += f64::from(wt[r * cols + c]) * f64::from(xi[c]);
                    }
                    s as f32 + b.as_ref().map_or(0.0, |b| b[r])
                })
                .collect()
        })
        .collect()
}

fn layer_norm(w: &Weights, prefix: &str, x: &[Vec<f32>], eps: f32) -> Vec<Vec<f32>> {
    let g = w.get(&format!("{prefix}.weight"));
    let b = w.get(&format!("{prefix}.bias"));
    x.iter()
        .map(|xi| {
            let n = xi.len() as f64;
            let mean = xi.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
            let var = xi
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / n;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            xi.iter()
                .enumerate()
                .map(|(i, &v)| ((f64::from(v) - mean) * inv) as f32 * g[i] + b[i])
                .collect()
        })
        .collect()
}

/// RMSNorm (`* w`, `+ b` where the file has a bias), in `f64`.
fn rms_norm(w: &Weights, prefix: &str, x: &[Vec<f32>], eps: f32) -> Vec<Vec<f32>> {
    let g = w.get(&format!("{prefix}.weight"));
    let bias = format!("{prefix}.bias");
    let b = w.has(&bias).then(|| w.get(&bias));
    x.iter()
        .map(|xi| {
            let n = xi.len() as f64;
            let ms = xi.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            xi.iter()
                .enumerate()
                .map(|(i, &v)| {
                    (f64::from(v) * inv) as f32 * g[i] + b.as_ref().map_or(0.0, |b| b[i])
                })
                .collect()
        })
        .collect()
}

/// The tower's norm: RMSNorm where `hp.rms` (GLM-4.xV), else LayerNorm.
fn norm(w: &Weights, hp: &Hp, prefix: &str, x: &[Vec<f32>]) -> Vec<Vec<f32>> {
    if hp.rms {
        rms_norm(w, prefix, x, hp.eps)
    } else {
        layer_norm(w, prefix, x, hp.eps)
    }
}

/// `x * sigmoid(x)`, in `f64`.
fn silu(x: f32) -> f32 {
    let x = f64::from(x);
    (x / (1.0 + (-x).exp())) as f32
}

fn f16_round(x: f32) -> f32 {
    f16_to_f32(f32_to_f16(x))
}

/// ggml's f32 GELU: a table of f16 results indexed by the f16 input.
fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let h = f64::from(f16_round(x));
    let y = 0.5 * h * (1.0 + (0.797_884_560_802_865_4 * h * (1.0 + 0.044_715 * h * h)).tanh());
    f16_round(y as f32)
}

fn gelu_erf(x: f32) -> f32 {
    let x = f64::from(x);
    (0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))) as f32
}

fn add(a: &[Vec<f32>], b: &[Vec<f32>]) -> Vec<Vec<f32>> {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p + q).collect())
        .collect()
}

/// Multi-head attention with an optional additive mask (`mask[i][j]`).
fn attention(
    q: &[Vec<f32>],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    heads: usize,
    mask: Option<&dyn Fn(usize, usize) -> f32>,
) -> Vec<Vec<f32>> {
    let (n, d) = (q.len(), q[0].len());
    let dh = d / heads;
    let scale = 1.0 / (dh as f64).sqrt();
    let mut out = vec![vec![0f32; d]; n];
    for h in 0..heads {
        for i in 0..n {
            let mut s: Vec<f64> = (0..n)
                .map(|j| {
                    let dot: f64 = (0..dh)
                        .map(|c| f64::from(q[i][h * dh + c]) * f64::from(k[j][h * dh + c]))
                        .sum();
                    dot * scale + mask.map_or(0.0, |m| f64::from(m(i, j)))
                })
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            s.iter_mut().for_each(|x| *x = (*x - max).exp());
            let sum: f64 = s.iter().sum();
            for c in 0..dh {
                let o: f64 = (0..n)
                    .map(|j| s[j] / sum * f64::from(v[j][h * dh + c]))
                    .sum();
                out[i][h * dh + c] = o as f32;
            }
        }
    }
    out
}

struct Hp {
    width: usize,
    heads: usize,
    patch: usize,
    layers: usize,
    eps: f32,
    /// RMSNorms (GLM-4.xV's tower), not LayerNorms.
    rms: bool,
}

/// A tower without position rotation (`vit_block`'s `rope`).
fn no_rope(_: &mut [Vec<f32>]) {}

/// ViT block `l`: the tower's norm, attention (queries, keys and values from
/// `attn_q`/`attn_k`/`attn_v`, or split from a fused `attn_qkv`; queries and
/// keys turned by `rope`), the residual, the norm, a GELU FFN (SwiGLU where
/// the block has `ffn_gate`), the residual.
fn vit_block(
    w: &Weights,
    hp: &Hp,
    l: usize,
    x: Vec<Vec<f32>>,
    rope: &dyn Fn(&mut [Vec<f32>]),
) -> Vec<Vec<f32>> {
    let b = format!("v.blk.{l}");
    let h = norm(w, hp, &format!("{b}.ln1"), &x);
    let (mut q, mut k, v) = if w.has(&format!("{b}.attn_qkv.weight")) {
        let qkv = linear(w, &format!("{b}.attn_qkv"), &h);
        let d = hp.width;
        let part = |i: usize| -> Vec<Vec<f32>> {
            qkv.iter().map(|r| r[i * d..(i + 1) * d].to_vec()).collect()
        };
        (part(0), part(1), part(2))
    } else {
        (
            linear(w, &format!("{b}.attn_q"), &h),
            linear(w, &format!("{b}.attn_k"), &h),
            linear(w, &format!("{b}.attn_v"), &h),
        )
    };
    rope(&mut q);
    rope(&mut k);
    let a = attention(&q, &k, &v, hp.heads, None);
    let a = layer_scale(
        w,
        &format!("{b}.ls1"),
        linear(w, &format!("{b}.attn_out"), &a),
    );
    let x = add(&a, &x);
    let h = norm(w, hp, &format!("{b}.ln2"), &x);
    let u = linear(w, &format!("{b}.ffn_up"), &h);
    let u = if w.has(&format!("{b}.ffn_gate.weight")) {
        swiglu(&linear(w, &format!("{b}.ffn_gate"), &h), &u)
    } else {
        gelu_all(u)
    };
    let f = layer_scale(
        w,
        &format!("{b}.ls2"),
        linear(w, &format!("{b}.ffn_down"), &u),
    );
    add(&x, &f)
}

/// `x` times the layer scale `prefix` value by value, where the file has it.
fn layer_scale(w: &Weights, prefix: &str, mut x: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
    let name = format!("{prefix}.weight");
    if w.has(&name) {
        let s = w.get(&name);
        for row in &mut x {
            row.iter_mut().zip(&s).for_each(|(v, s)| *v *= s);
        }
    }
    x
}

/// `silu(gate) * up`, value by value.
fn swiglu(gate: &[Vec<f32>], up: &[Vec<f32>]) -> Vec<Vec<f32>> {
    gate.iter()
        .zip(up)
        .map(|(g, u)| g.iter().zip(u).map(|(&g, &u)| silu(g) * u).collect())
        .collect()
}

/// Patch embedding as a convolution (kernel ne = [P, P, 3, width]) plus bias,
/// in f16 as llama.cpp's `ggml_conv_2d` makes it: its `im2col` rounds the
/// pixels to f16, and the product then the kernel.
fn patch_embed(w: &Weights, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let k: Vec<f32> = w.get("v.patch_embd.weight").into_iter().map(f16).collect();
    let pixels: Vec<f32> = img.data.iter().map(|&v| f16(v)).collect();
    let b = w.get("v.patch_embd.bias");
    let p = hp.patch;
    let (pw, ph) = (img.width / p, img.height / p);
    let mut out = Vec::new();
    for py in 0..ph {
        for px in 0..pw {
            let mut e = vec![0f32; hp.width];
            for (oc, e) in e.iter_mut().enumerate() {
                let mut s = 0f64;
                for c in 0..3 {
                    for ky in 0..p {
                        for kx in 0..p {
                            let wv = k[((oc * 3 + c) * p + ky) * p + kx];
                            let xv = pixels[3 * ((py * p + ky) * img.width + px * p + kx) + c];
                            s += f64::from(wv) * f64::from(xv);
                        }
                    }
                }
                *e = s as f32 + b[oc];
            }
            out.push(e);
        }
    }
    out
}

fn gather(x: &[Vec<f32>], idx: &[usize]) -> Vec<Vec<f32>> {
    idx.iter().map(|&i| x[i].clone()).collect()
}

/// clip.cpp's `make_ds_idx`.
fn ds_idx(off_r: usize, off_c: usize, h: usize, w: usize, stride: usize) -> Vec<usize> {
    let mut v = Vec::new();
    for i in 0..h {
        for j in 0..w {
            v.push((2 * i + off_r) * stride + 2 * j + off_c);
        }
    }
    v
}

fn concat4(p: [&[Vec<f32>]; 4]) -> Vec<Vec<f32>> {
    (0..p[0].len())
        .map(|i| p.iter().flat_map(|x| x[i].iter().copied()).collect())
        .collect()
}

/// MiniCPM-V 4.6 exactly as `clip_graph_minicpmv4_6::build` and its inputs.
fn reference_minicpmv46(w: &Weights, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let (pw, ph) = (img.width / hp.patch, img.height / hp.patch);
    let n = pw * ph;
    let pos = w.get("v.position_embd.weight");
    let mut x = patch_embed(w, hp, img);
    for i in 0..ph {
        for j in 0..pw {
            let r = (70 * i / ph) * 70 + 70 * j / pw;
            for (c, v) in x[i * pw + j].iter_mut().enumerate() {
                *v += pos[r * hp.width + c];
            }
        }
    }
    let insert = 0;
    for l in 0..=insert {
        x = vit_block(w, hp, l, x, &no_rope);
    }
    // Window attention: reorder to window-major, block-diagonal mask, reorder back.
    let (hh, hw) = (ph / 2, pw / 2);
    let mut window_idx = Vec::new();
    for wi in 0..hh {
        for wj in 0..hw {
            for (a, b) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                window_idx.push((2 * wi + a) * pw + 2 * wj + b);
            }
        }
    }
    let mut inv = vec![0; n];
    for (i, &t) in window_idx.iter().enumerate() {
        inv[t] = i;
    }
    let normed = layer_norm(w, "v.vit_merger.ln1", &x, hp.eps);
    let cur = gather(&normed, &window_idx);
    let q = linear(w, "v.vit_merger.attn_q", &cur);
    let k = linear(w, "v.vit_merger.attn_k", &cur);
    let v = linear(w, "v.vit_merger.attn_v", &cur);
    let mask = |i: usize, j: usize| if i / 4 == j / 4 { 0.0 } else { f32::MIN };
    let a = attention(&q, &k, &v, hp.heads, Some(&mask));
    let a = linear(w, "v.vit_merger.attn_out", &a);
    let a = gather(&a, &inv);
    let x1 = add(&a, &x);
    // 2x2 downsample MLP plus mean.
    let p: Vec<Vec<Vec<f32>>> = [(0, 0), (0, 1), (1, 0), (1, 1)]
        .iter()
        .map(|&(r, c)| gather(&x1, &ds_idx(r, c, hh, hw, pw)))
        .collect();
    let mean: Vec<Vec<f32>> = (0..hh * hw)
        .map(|i| {
            (0..hp.width)
                .map(|c| (p[0][i][c] + p[1][i][c] + p[2][i][c] + p[3][i][c]) * 0.25)
                .collect()
        })
        .collect();
    let cat = concat4([&p[0], &p[1], &p[2], &p[3]]);
    let normed = layer_norm(w, "v.vit_merger.ds_ln", &cat, hp.eps);
    let mut u = linear(w, "v.vit_merger.ds_ffn_up", &normed);
    u.iter_mut().flatten().for_each(|v| *v = gelu(*v));
    let d = linear(w, "v.vit_merger.ds_ffn_down", &u);
    let mut x = add(&d, &mean);
    for l in insert + 1..hp.layers {
        x = vit_block(w, hp, l, x, &no_rope);
    }
    let x = layer_norm(w, "v.post_ln", &x, hp.eps);
    // Final merger over the hw x hh grid.
    let (qh, qw) = (hh / 2, hw / 2);
    let p: Vec<Vec<Vec<f32>>> = [(0, 0), (0, 1), (1, 0), (1, 1)]
        .iter()
        .map(|&(r, c)| gather(&x, &ds_idx(r, c, qh, qw, hw)))
        .collect();
    let cat = concat4([&p[0], &p[1], &p[2], &p[3]]);
    let normed = layer_norm(w, "mm.input_norm", &cat, hp.eps);
    let mut u = linear(w, "mm.up", &normed);
    u.iter_mut().flatten().for_each(|v| *v = gelu_erf(*v));
    linear(w, "mm.down", &u)
}

/// Gemma 3 as `clip_graph_siglip::build`.
fn reference_gemma3(w: &Weights, hp: &Hp, img: &ImageF32, k: usize) -> Vec<Vec<f32>> {
    let side = img.width / hp.patch;
    let pos = w.get("v.position_embd.weight");
    let mut x = patch_embed(w, hp, img);
    for (i, xi) in x.iter_mut().enumerate() {
        for (c, v) in xi.iter_mut().enumerate() {
            *v += pos[i * hp.width + c];
        }
    }
    for l in 0..hp.layers {
        x = vit_block(w, hp, l, x, &no_rope);
    }
    let x = layer_norm(w, "v.post_ln", &x, hp.eps);
    let o = side / k;
    let norm_w = w.get("mm.soft_emb_norm.weight");
    let mut pooled = Vec::new();
    for oy in 0..o {
        for ox in 0..o {
            let mut e = vec![0f64; hp.width];
            for ky in 0..k {
                for kx in 0..k {
                    for (c, v) in e.iter_mut().enumerate() {
                        *v += f64::from(x[(oy * k + ky) * side + ox * k + kx][c]);
                    }
                }
            }
            let e: Vec<f64> = e.iter().map(|v| v / (k * k) as f64).collect();
            let ms = e.iter().map(|v| v * v).sum::<f64>() / hp.width as f64;
            let inv = 1.0 / (ms + f64::from(hp.eps)).sqrt();
            pooled.push(
                e.iter()
                    .zip(&norm_w)
                    .map(|(v, g)| (v * inv) as f32 * g)
                    .collect::<Vec<f32>>(),
            );
        }
    }
    // mm.input_projection.weight has ne = [n_text, width]: y = W^T x.
    let proj = w.get("mm.input_projection.weight");
    let n_text = proj.len() / hp.width;
    pooled
        .iter()
        .map(|p| {
            (0..n_text)
                .map(|t| {
                    (0..hp.width)
                        .map(|c| f64::from(proj[c * n_text + t]) * f64::from(p[c]))
                        .sum::<f64>() as f32
                })
                .collect()
        })
        .collect()
}

/// A convolution of `img` with the kernel `name` (ne = [P, P, 3, width]) at
/// every patch, row-major, without bias, in f16 as `ggml_conv_2d` makes it
/// (pixels and kernel rounded to f16, products summed).
fn conv(w: &Weights, name: &str, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let k: Vec<f32> = w.get(name).into_iter().map(f16).collect();
    let pixels: Vec<f32> = img.data.iter().map(|&v| f16(v)).collect();
    let p = hp.patch;
    let (pw, ph) = (img.width / p, img.height / p);
    let mut out = Vec::new();
    for py in 0..ph {
        for px in 0..pw {
            let e = (0..hp.width)
                .map(|oc| {
                    let mut s = 0f64;
                    for c in 0..3 {
                        for ky in 0..p {
                            for kx in 0..p {
                                let wv = k[((oc * 3 + c) * p + ky) * p + kx];
                                let xv = pixels[3 * ((py * p + ky) * img.width + px * p + kx) + c];
                                s += f64::from(wv) * f64::from(xv);
                            }
                        }
                    }
                    s as f32
                })
                .collect();
            out.push(e);
        }
    }
    out
}

/// Bilinear interpolation with aligned corners of the `side` x `side` table
/// `pos` (rows of `d`) at the centres of a `pw` x `ph` grid: grid point
/// `(x, y)` reads the table at `(x (side - 1) / (pw - 1), y (side - 1) / (ph -
/// 1))`, weighted by distance (in f64).
fn bilinear(pos: &[f32], side: usize, d: usize, pw: usize, ph: usize) -> Vec<Vec<f32>> {
    let src = |i: usize, n: usize| {
        if n > 1 && side > 1 {
            i as f64 * (side - 1) as f64 / (n - 1) as f64
        } else {
            i as f64 * side as f64 / n as f64
        }
    };
    let mut out = Vec::new();
    for y in 0..ph {
        for x in 0..pw {
            let (sx, sy) = (src(x, pw), src(y, ph));
            let (x0, y0) = (sx.floor() as usize, sy.floor() as usize);
            let (x1, y1) = ((x0 + 1).min(side - 1), (y0 + 1).min(side - 1));
            let (fx, fy) = (sx - x0 as f64, sy - y0 as f64);
            let at = |yy: usize, xx: usize, c: usize| f64::from(pos[(yy * side + xx) * d + c]);
            out.push(
                (0..d)
                    .map(|c| {
                        (at(y0, x0, c) * (1.0 - fx) * (1.0 - fy)
                            + at(y0, x1, c) * fx * (1.0 - fy)
                            + at(y1, x0, c) * (1.0 - fx) * fy
                            + at(y1, x1, c) * fx * fy) as f32
                    })
                    .collect(),
            );
        }
    }
    out
}

/// Rotates each head of `x` (tokens row-major on a `pw`-wide grid) as
/// Qwen-VL's vision M-RoPE does: with head width `dh`, values `i` and
/// `i + dh/2` turn together by `row * 10000^(-4i/dh)` for `i < dh/4` and by
/// `column * 10000^(-4(i - dh/4)/dh)` for the rest of the first half.
fn mrope_vision(x: &mut [Vec<f32>], heads: usize, pw: usize) {
    for (t, xt) in x.iter_mut().enumerate() {
        let (row, col) = ((t / pw) as f64, (t % pw) as f64);
        let dh = xt.len() / heads;
        for h in 0..heads {
            let v = &mut xt[h * dh..(h + 1) * dh];
            for i in 0..dh / 2 {
                let (p, j) = if i < dh / 4 {
                    (row, i)
                } else {
                    (col, i - dh / 4)
                };
                let a = p * 10000f64.powf(-4.0 * j as f64 / dh as f64);
                let (x0, x1) = (f64::from(v[i]), f64::from(v[i + dh / 2]));
                v[i] = (x0 * a.cos() - x1 * a.sin()) as f32;
                v[i + dh / 2] = (x0 * a.sin() + x1 * a.cos()) as f32;
            }
        }
    }
}

/// The tokens of a `pw` x `ph` grid (row-major) merged 2x2: for each 2x2
/// block, blocks row by row, its top-left, top-right, bottom-left and
/// bottom-right tokens concatenated.
fn merge_2x2(x: &[Vec<f32>], pw: usize, ph: usize) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for by in 0..ph / 2 {
        for bx in 0..pw / 2 {
            let mut row = Vec::new();
            for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                row.extend_from_slice(&x[(2 * by + dy) * pw + 2 * bx + dx]);
            }
            out.push(row);
        }
    }
    out
}

fn gelu_all(mut x: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
    x.iter_mut().flatten().for_each(|v| *v = gelu(*v));
    x
}

/// Qwen3-VL as `clip_graph_qwen3vl::build` computes it, written in the
/// image's own (row-major) token order: attention does not depend on the
/// order, so the 2x2 merge order only shows where tokens are merged.
fn reference_qwen3vl(w: &Weights, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let (pw, ph) = (img.width / hp.patch, img.height / hp.patch);
    let d = hp.width;
    // Both temporal kernels over the same picture, then the bias.
    let bias = w.get("v.patch_embd.bias");
    let c0 = conv(w, "v.patch_embd.weight", hp, img);
    let c1 = conv(w, "v.patch_embd.weight.1", hp, img);
    let mut x: Vec<Vec<f32>> = c0
        .iter()
        .zip(&c1)
        .map(|(a, b)| (0..d).map(|c| a[c] + b[c] + bias[c]).collect())
        .collect();
    let pos = w.get("v.position_embd.weight");
    let side = ((pos.len() / d) as f64).sqrt() as usize;
    let pos = bilinear(&pos, side, d, pw, ph);
    x = add(&x, &pos);
    let mut features = Vec::new();
    for l in 0..hp.layers {
        x = vit_block(w, hp, l, x, &|t| mrope_vision(t, hp.heads, pw));
        let ds = format!("v.deepstack.{l}");
        if w.has(&format!("{ds}.fc1.weight")) {
            let h = layer_norm(w, &format!("{ds}.norm"), &merge_2x2(&x, pw, ph), hp.eps);
            let u = gelu_all(linear(w, &format!("{ds}.fc1"), &h));
            features.push(linear(w, &format!("{ds}.fc2"), &u));
        }
    }
    let x = layer_norm(w, "v.post_ln", &x, hp.eps);
    let u = gelu_all(linear(w, "mm.0", &merge_2x2(&x, pw, ph)));
    let out = linear(w, "mm.2", &u);
    out.into_iter()
        .enumerate()
        .map(|(t, mut row)| {
            for f in &features {
                row.extend_from_slice(&f[t]);
            }
            row
        })
        .collect()
}

/// PyTorch's `interpolate(bilinear, align_corners=False, antialias=True)` of
/// the `side` x `side` table `pos` (rows of `d`) to a `pw` x `ph` grid, in
/// `f64`: per axis, output `i` reads the inputs within `support = max(1,
/// in / out)` of its centre `(i + 0.5) in / out`, weighted by the triangle
/// `1 - |j + 0.5 - centre| / support`, normalised; the two axes' weights
/// multiply.
fn bilinear_antialiased(pos: &[f32], side: usize, d: usize, pw: usize, ph: usize) -> Vec<Vec<f32>> {
    let weights = |out: usize| -> Vec<Vec<(usize, f64)>> {
        let scale = side as f64 / out as f64;
        let support = scale.max(1.0);
        (0..out)
            .map(|i| {
                let centre = (i as f64 + 0.5) * scale;
                let taps: Vec<(usize, f64)> = (0..side)
                    .map(|j| (j, 1.0 - ((j as f64 + 0.5 - centre) / support).abs()))
                    .filter(|&(_, w)| w > 0.0)
                    .collect();
                let total: f64 = taps.iter().map(|t| t.1).sum();
                taps.into_iter().map(|(j, w)| (j, w / total)).collect()
            })
            .collect()
    };
    separable(pos, side, d, &weights(pw), &weights(ph))
}

/// The `pw` x `ph` grid whose point `(x, y)` sums the table's rows (a table
/// `w0` wide, rows of `d`) weighted by `wx[x]`'s and `wy[y]`'s taps
/// (`(index, weight)`) multiplied, in `f64`.
fn separable(
    pos: &[f32],
    w0: usize,
    d: usize,
    wx: &[Vec<(usize, f64)>],
    wy: &[Vec<(usize, f64)>],
) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for ys in wy {
        for xs in wx {
            let mut row = vec![0f64; d];
            for &(y, a) in ys {
                for &(x, b) in xs {
                    for (c, r) in row.iter_mut().enumerate() {
                        *r += a * b * f64::from(pos[(y * w0 + x) * d + c]);
                    }
                }
            }
            out.push(row.into_iter().map(|v| v as f32).collect());
        }
    }
    out
}

/// PyTorch's `interpolate(bicubic, align_corners=False)` (`a = -0.75`,
/// edges clamped) of the `w0` x `h0` table `pos` (rows of `d`, row-major) to
/// a `pw` x `ph` grid, in `f64`, separably; the table itself at its own size.
fn bicubic(pos: &[f32], (w0, h0): (usize, usize), d: usize, pw: usize, ph: usize) -> Vec<Vec<f32>> {
    if (pw, ph) == (w0, h0) {
        return pos.chunks(d).map(<[f32]>::to_vec).collect();
    }
    let kernel = |t: f64| {
        let (a, t) = (-0.75f64, t.abs());
        if t <= 1.0 {
            ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0
        } else if t < 2.0 {
            ((a * t - 5.0 * a) * t + 8.0 * a) * t - 4.0 * a
        } else {
            0.0
        }
    };
    // Per output coordinate: four (clamped index, weight) taps.
    let taps = |out: usize, inp: usize| -> Vec<Vec<(usize, f64)>> {
        (0..out)
            .map(|i| {
                let x = (i as f64 + 0.5) * inp as f64 / out as f64 - 0.5;
                let x0 = x.floor();
                let t = x - x0;
                (0..4)
                    .map(|j| {
                        let at = (x0 as i64 + j - 1).clamp(0, inp as i64 - 1) as usize;
                        (at, kernel(t - (j as f64 - 1.0)))
                    })
                    .collect()
            })
            .collect()
    };
    separable(pos, w0, d, &taps(pw, w0), &taps(ph, h0))
}

/// Rotates each head of `x` (tokens row-major on a `pw`-wide grid) as
/// Kimi-VL's 2-D RoPE does: with head width `dh`, values `2i` and `2i + 1`
/// of the first half turn by `column * 10000^(-4i/dh)`, those of the second
/// half by `row` with the same frequencies.
fn rope_2d(x: &mut [Vec<f32>], heads: usize, pw: usize) {
    let positions: Vec<(usize, usize)> = (0..x.len()).map(|t| (t % pw, t / pw)).collect();
    rope_2d_at(x, heads, &positions);
}

/// [`rope_2d`] with each token's `(column, row)` given.
fn rope_2d_at(x: &mut [Vec<f32>], heads: usize, positions: &[(usize, usize)]) {
    for (xt, &(col, row)) in x.iter_mut().zip(positions) {
        let (col, row) = (col as f64, row as f64);
        let dh = xt.len() / heads;
        for h in 0..heads {
            let v = &mut xt[h * dh..(h + 1) * dh];
            for (half, p) in [(0, col), (dh / 2, row)] {
                for i in 0..dh / 4 {
                    let a = p * 10000f64.powf(-4.0 * i as f64 / dh as f64);
                    let (j0, j1) = (half + 2 * i, half + 2 * i + 1);
                    let (x0, x1) = (f64::from(v[j0]), f64::from(v[j1]));
                    v[j0] = (x0 * a.cos() - x1 * a.sin()) as f32;
                    v[j1] = (x0 * a.sin() + x1 * a.cos()) as f32;
                }
            }
        }
    }
}

/// Kimi-VL as `clip_graph_kimivl::build` computes it: the patch embedding,
/// the position table interpolated with antialiasing, blocks with the 2-D
/// RoPE, the final norm, then each 2 x 2 block of patches (top-left,
/// top-right, bottom-left, bottom-right) with each patch LayerNormed
/// (epsilon 1e-5), through the GELU MLP.
fn reference_kimivl(w: &Weights, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let (pw, ph) = (img.width / hp.patch, img.height / hp.patch);
    let d = hp.width;
    let mut x = patch_embed(w, hp, img);
    let pos_t = w.0.tensor("v.position_embd.weight").unwrap();
    // Kimi K2.5's table is [d, W, H], interpolated bicubically, and its
    // projector's norm takes the file's epsilon.
    let kimik25 = pos_t.dims().len() == 3;
    let (tw, th) = (
        pos_t.dims()[1] as usize,
        *pos_t.dims().get(2).unwrap_or(&1) as usize,
    );
    let pos = w.get("v.position_embd.weight");
    if kimik25 {
        x = add(&x, &bicubic(&pos, (tw, th), d, pw, ph));
    } else {
        let side = ((pos.len() / d) as f64).sqrt() as usize;
        x = add(&x, &bilinear_antialiased(&pos, side, d, pw, ph));
    }
    for l in 0..hp.layers {
        x = vit_block(w, hp, l, x, &|t| rope_2d(t, hp.heads, pw));
    }
    let x = layer_norm(w, "v.post_ln", &x, hp.eps);
    let normed = layer_norm(w, "mm.input_norm", &x, if kimik25 { hp.eps } else { 1e-5 });
    let u = gelu_all(linear(w, "mm.1", &merge_2x2(&normed, pw, ph)));
    linear(w, "mm.2", &u)
}

/// LFM2-VL as `clip_graph_siglip::build` computes it for `lfm2`: the patch
/// embedding, the position table resized with antialiasing, blocks without
/// RoPE, the final norm, then each 2 x 2 block of patches (top-left,
/// top-right, bottom-left, bottom-right) as one row, that row LayerNormed
/// (epsilon 1e-5) where the file has the norm, through the GELU MLP.
fn reference_lfm2(w: &Weights, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let (pw, ph) = (img.width / hp.patch, img.height / hp.patch);
    let d = hp.width;
    let mut x = patch_embed(w, hp, img);
    let pos = w.get("v.position_embd.weight");
    let side = ((pos.len() / d) as f64).sqrt() as usize;
    x = add(&x, &bilinear_antialiased(&pos, side, d, pw, ph));
    for l in 0..hp.layers {
        x = vit_block(w, hp, l, x, &no_rope);
    }
    let x = layer_norm(w, "v.post_ln", &x, hp.eps);
    let mut rows = merge_2x2(&x, pw, ph);
    if w.has("mm.input_norm.weight") {
        rows = layer_norm(w, "mm.input_norm", &rows, 1e-5);
    }
    let u = gelu_all(linear(w, "mm.1", &rows));
    linear(w, "mm.2", &u)
}

/// GLM-4.5V as `clip_graph_glm4v::build` computes it, in the image's own
/// (row-major) token order: both temporal kernels and the bias, the
/// RMSNorm after them, the position table interpolated bicubically, blocks
/// with RMSNorms, Qwen-VL's vision M-RoPE and SwiGLU, `post_ln`, then each
/// 2 x 2 block through the merger's convolution (kernel `[2, 2, d, out]`,
/// both it and the block's values in f16 as `ggml_conv_2d`), the projection,
/// LayerNorm (1e-5), GELU (erf) and the SwiGLU MLP.
fn reference_glm4v(w: &Weights, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let (pw, ph) = (img.width / hp.patch, img.height / hp.patch);
    let d = hp.width;
    let bias = w.get("v.patch_embd.bias");
    let c0 = conv(w, "v.patch_embd.weight", hp, img);
    let c1 = conv(w, "v.patch_embd.weight.1", hp, img);
    let mut x: Vec<Vec<f32>> = c0
        .iter()
        .zip(&c1)
        .map(|(a, b)| (0..d).map(|c| a[c] + b[c] + bias[c]).collect())
        .collect();
    x = norm(w, hp, "v.norm_embd", &x);
    let pos = w.get("v.position_embd.weight");
    let side = ((pos.len() / d) as f64).sqrt() as usize;
    x = add(&x, &bicubic(&pos, (side, side), d, pw, ph));
    for l in 0..hp.layers {
        x = vit_block(w, hp, l, x, &|t| mrope_vision(t, hp.heads, pw));
    }
    let x = norm(w, hp, "v.post_ln", &x);
    let k: Vec<f32> = w
        .get("mm.patch_merger.weight")
        .into_iter()
        .map(f16)
        .collect();
    let kb = w.get("mm.patch_merger.bias");
    let out = kb.len();
    let merged: Vec<Vec<f32>> = merge_2x2(&x, pw, ph)
        .iter()
        .map(|block| {
            // The block is [top-left, top-right, bottom-left, bottom-right]:
            // token `2 ky + kx`, the kernel's (row ky, column kx).
            (0..out)
                .map(|o| {
                    let mut s = 0f64;
                    for c in 0..d {
                        for ky in 0..2 {
                            for kx in 0..2 {
                                let kv = k[((o * d + c) * 2 + ky) * 2 + kx];
                                let xv = f16(block[(2 * ky + kx) * d + c]);
                                s += f64::from(kv) * f64::from(xv);
                            }
                        }
                    }
                    s as f32 + kb[o]
                })
                .collect()
        })
        .collect();
    let h = linear(w, "mm.model.fc", &merged);
    let mut h = layer_norm(w, "mm.post_norm", &h, 1e-5);
    h.iter_mut().flatten().for_each(|v| *v = gelu_erf(*v));
    let u = swiglu(&linear(w, "mm.gate", &h), &linear(w, "mm.up", &h));
    linear(w, "mm.down", &u)
}

/// InternVL as `clip_graph_internvl::build` computes it on one tile: the
/// patches (in f16) and their bias, the class token after them, the
/// position table's rows added in that order, blocks with layer scales and
/// no rotation, the class token dropped, each 2 x 2 block of patches
/// (top-left, top-right, bottom-left, bottom-right) as a row with the blocks
/// row by row, LayerNorm (1e-5), a GELU MLP.
fn reference_internvl(w: &Weights, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let (pw, ph) = (img.width / hp.patch, img.height / hp.patch);
    let mut x = patch_embed(w, hp, img);
    x.push(w.get("v.class_embd"));
    let pos = w.get("v.position_embd.weight");
    let pos: Vec<Vec<f32>> = pos.chunks(hp.width).map(<[f32]>::to_vec).collect();
    x = add(&x, &pos);
    for l in 0..hp.layers {
        x = vit_block(w, hp, l, x, &no_rope);
    }
    x.pop();
    let h = layer_norm(w, "mm.model.mlp.0", &merge_2x2(&x, pw, ph), 1e-5);
    let u = gelu_all(linear(w, "mm.model.mlp.1", &h));
    linear(w, "mm.model.mlp.3", &u)
}

/// Llama 4 as `clip_graph_llama4::build` computes it on one tile: the
/// patches through the unfold matrix, the class token after them, the
/// position embeddings, `pre_ln`, blocks with the 2-D RoPE at (column + 1,
/// row + 1) and the class token at (0, 0), `post_ln`, the class token
/// dropped, each 2 x 2 block of patches (top-left, top-right, bottom-left,
/// bottom-right) as a row with the blocks column by column, then two GELU
/// layers and the projection, none with a bias.
fn reference_llama4(w: &Weights, hp: &Hp, img: &ImageF32) -> Vec<Vec<f32>> {
    let (pw, ph) = (img.width / hp.patch, img.height / hp.patch);
    let d = hp.width;
    let p = hp.patch;
    // The unfolded patches, (channel, y, x) within each, row by row.
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for py in 0..ph {
        for px in 0..pw {
            let mut r = Vec::new();
            for c in 0..3 {
                for ky in 0..p {
                    for kx in 0..p {
                        r.push(img.data[3 * ((py * p + ky) * img.width + px * p + kx) + c]);
                    }
                }
            }
            rows.push(r);
        }
    }
    let mut x = linear(w, "v.patch_embd", &rows);
    x.push(w.get("v.class_embd"));
    let pos = w.get("v.position_embd.weight");
    let pos: Vec<Vec<f32>> = pos.chunks(d).map(<[f32]>::to_vec).collect();
    x = add(&x, &pos);
    x = layer_norm(w, "v.pre_ln", &x, hp.eps);
    let mut positions: Vec<(usize, usize)> =
        (0..pw * ph).map(|t| (t % pw + 1, t / pw + 1)).collect();
    positions.push((0, 0));
    for l in 0..hp.layers {
        x = vit_block(w, hp, l, x, &|t| rope_2d_at(t, hp.heads, &positions));
    }
    let x = layer_norm(w, "v.post_ln", &x, hp.eps);
    let mut shuffled = Vec::new();
    for bx in 0..pw / 2 {
        for by in 0..ph / 2 {
            let mut row = Vec::new();
            for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                row.extend_from_slice(&x[(2 * by + dy) * pw + 2 * bx + dx]);
            }
            shuffled.push(row);
        }
    }
    let h = gelu_all(linear(w, "mm.model.mlp.1", &shuffled));
    let h = gelu_all(linear(w, "mm.model.mlp.2", &h));
    linear(w, "mm.model.fc", &h)
}

fn test_image(width: usize, height: usize, seed: u32) -> ImageF32 {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let data = (0..width * height * 3)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2001) as f32 / 1000.0 - 1.0
        })
        .collect();
    ImageF32 {
        width,
        height,
        data,
    }
}

/// `got` against `want` within `tolerance` of the output's scale.
fn compare(got: &[f32], want: &[Vec<f32>], what: &str, tolerance: f64) {
    let want: Vec<f32> = want.iter().flatten().copied().collect();
    assert_eq!(got.len(), want.len(), "{what}: length");
    let rms = (want.iter().map(|v| f64::from(v * v)).sum::<f64>() / want.len() as f64).sqrt();
    let max_err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0f64, f64::max);
    eprintln!("{what}: max error {max_err:e}, rms {rms}");
    assert!(rms > 0.05, "{what}: degenerate output (rms {rms})");
    assert!(
        max_err <= tolerance * rms.max(1.0),
        "{what}: max error {max_err} (rms {rms})"
    );
}

/// How close les's encoder is to the reference with matrices of `ty`: with
/// f16 ones both round each product's activations to f16 (as ggml does), so
/// a last-bit difference of a sum can round an activation to the
/// neighbouring f16 (2^-11 of it away), which the next layers carry on.
fn tolerance(ty: GgmlType) -> f64 {
    if ty == GgmlType::F16 {
        4e-3
    } else {
        1e-3
    }
}

fn projector(ptype: ProjectorType, ty: GgmlType, name: &str) -> (PathBuf, MmprojConfig) {
    let mut cfg = MmprojConfig::tiny(ptype, 48, 11);
    cfg.ty = ty;
    let path = tmp(name);
    write_mmproj(&cfg, &path).unwrap();
    (path, cfg)
}

fn hp_of(cfg: &MmprojConfig) -> Hp {
    Hp {
        width: cfg.width as usize,
        heads: cfg.heads as usize,
        patch: cfg.patch as usize,
        layers: cfg.layers as usize,
        eps: 1e-6,
        rms: cfg.projector == ProjectorType::Glm4v,
    }
}

#[test]
fn minicpmv46_encoder_matches_the_reference() {
    for (ty, name) in [(GgmlType::F32, "f32"), (GgmlType::F16, "f16")] {
        let (path, cfg) = projector(
            ProjectorType::MiniCpmV46,
            ty,
            &format!("enc_mcv_{name}.gguf"),
        );
        let model = ClipModel::open(&path).unwrap();
        assert_eq!(model.hp.n_mmproj_embd, 48);
        let w = Weights(Gguf::open(&path).unwrap());
        let hp = hp_of(&cfg);
        let mut pool = Pool::new(3);
        // A square slice and a non-square one (a 16 x 8 patch grid).
        for (iw, ih) in [(224, 224), (224, 112)] {
            let img = test_image(iw, ih, 5);
            let mut ctx = Ctx {
                pool: &mut pool,
                isa: Isa::detect(),
            };
            let got = encode(&mut ctx, &model, &img).unwrap();
            assert_eq!(got.len(), output_tokens(&model, iw, ih) * 48);
            assert_eq!(output_tokens(&model, iw, ih), (iw / 56) * (ih / 56));
            let want = reference_minicpmv46(&w, &hp, &img);
            compare(
                &got,
                &want,
                &format!("minicpmv4_6 {name} {iw}x{ih}"),
                tolerance(ty),
            );
        }
    }
}

#[test]
fn gemma3_encoder_matches_the_reference() {
    for (ty, name) in [(GgmlType::F32, "f32"), (GgmlType::F16, "f16")] {
        let (path, cfg) = projector(ProjectorType::Gemma3, ty, &format!("enc_g3_{name}.gguf"));
        let model = ClipModel::open(&path).unwrap();
        let w = Weights(Gguf::open(&path).unwrap());
        let hp = hp_of(&cfg);
        let img = test_image(224, 224, 9);
        let mut pool = Pool::new(2);
        let mut ctx = Ctx {
            pool: &mut pool,
            isa: Isa::detect(),
        };
        let got = encode(&mut ctx, &model, &img).unwrap();
        assert_eq!(output_tokens(&model, 224, 224), 16);
        let want = reference_gemma3(&w, &hp, &img, 4);
        compare(&got, &want, &format!("gemma3 {name}"), tolerance(ty));
    }
}

#[test]
fn qwen3vl_encoder_matches_the_reference() {
    // f32 and f16 weights with three deepstack mergers (blocks 0 to 2 of 4),
    // and a tower without any.
    for (ty, deepstack, layers, name) in [
        (GgmlType::F32, 3, 4, "f32"),
        (GgmlType::F16, 3, 4, "f16"),
        (GgmlType::F16, 0, 2, "f16 no deepstack"),
    ] {
        let mut cfg = MmprojConfig::tiny(ProjectorType::Qwen3Vl, 48, 11);
        cfg.ty = ty;
        cfg.deepstack = deepstack;
        cfg.layers = layers;
        let path = tmp(&format!("enc_q3vl_{}.gguf", name.replace(' ', "_")));
        write_mmproj(&cfg, &path).unwrap();
        let model = ClipModel::open(&path).unwrap();
        assert_eq!(model.hp.n_mmproj_embd, 48);
        assert_eq!(model.hp.n_deepstack, deepstack as usize);
        assert_eq!(model.row_width(), 48 * (1 + deepstack as usize));
        let w = Weights(Gguf::open(&path).unwrap());
        let hp = hp_of(&cfg);
        // The table's own 16 x 16 grid (no interpolation), grids smaller and
        // larger than it, square and not, wide and tall.
        encodes_as_reference(
            &model,
            &[(256, 256), (96, 64), (64, 160), (320, 96), (32, 32)],
            32,
            &|img| reference_qwen3vl(&w, &hp, img),
            &format!("qwen3vl_merger {name}"),
            tolerance(ty),
        );
    }
}

/// `model`'s tower on a test image of each of `sizes` makes one row of
/// `row_width` values per `merged` x `merged` pixels, within `tolerance` of
/// `reference`'s (`what` names the case).
fn encodes_as_reference(
    model: &ClipModel,
    sizes: &[(usize, usize)],
    merged: usize,
    reference: &dyn Fn(&ImageF32) -> Vec<Vec<f32>>,
    what: &str,
    tolerance: f64,
) {
    let mut pool = Pool::new(3);
    for &(iw, ih) in sizes {
        let img = test_image(iw, ih, 7);
        let mut ctx = Ctx {
            pool: &mut pool,
            isa: Isa::detect(),
        };
        let got = encode(&mut ctx, model, &img).unwrap();
        let tokens = (iw / merged) * (ih / merged);
        assert_eq!(output_tokens(model, iw, ih), tokens, "{what} {iw}x{ih}");
        assert_eq!(got.len(), tokens * model.row_width(), "{what} {iw}x{ih}");
        compare(
            &got,
            &reference(&img),
            &format!("{what} {iw}x{ih}"),
            tolerance,
        );
    }
}

/// Kimi-VL's, Kimi K2.5's and GLM-4.5V's towers (images of any size, 28-pixel
/// merged patches) against their references.
#[test]
fn kimivl_and_glm4v_encoders_match_their_references() {
    for (ptype, ty, name) in [
        (ProjectorType::KimiVl, GgmlType::F32, "f32"),
        (ProjectorType::KimiVl, GgmlType::F16, "f16"),
        (ProjectorType::KimiK25, GgmlType::F32, "k25_f32"),
        (ProjectorType::KimiK25, GgmlType::F16, "k25_f16"),
        (ProjectorType::Glm4v, GgmlType::F32, "glm4v_f32"),
        (ProjectorType::Glm4v, GgmlType::F16, "glm4v_f16"),
    ] {
        let (path, cfg) = projector(ptype, ty, &format!("enc_kimivl_{name}.gguf"));
        let model = ClipModel::open(&path).unwrap();
        assert_eq!((model.hp.n_mmproj_embd, model.hp.n_merge), (48, 2));
        assert_eq!(model.row_width(), 48);
        assert_eq!(model.hp.rms_norm, ptype == ProjectorType::Glm4v);
        let w = Weights(Gguf::open(&path).unwrap());
        let hp = hp_of(&cfg);
        let reference = |img: &ImageF32| match ptype {
            ProjectorType::Glm4v => reference_glm4v(&w, &hp, img),
            _ => reference_kimivl(&w, &hp, img),
        };
        // The table's own 16 x 16 grid (no interpolation), grids smaller and
        // larger than it (up and down on each axis), square and not.
        encodes_as_reference(
            &model,
            &[(224, 224), (84, 56), (56, 168), (336, 84), (28, 28)],
            28,
            &reference,
            &format!("{} {name}", ptype.name()),
            tolerance(ty),
        );
    }
}

/// LFM2-VL's tower (images of any size in 32-pixel merged patches, its
/// 16 x 16 table resized) against its reference, with the projector's norm
/// and without it (clip.cpp's optional `mm.input_norm`).
#[test]
fn lfm2_encoder_matches_the_reference() {
    for (ty, name) in [(GgmlType::F32, "f32"), (GgmlType::F16, "f16")] {
        let (path, cfg) = projector(ProjectorType::Lfm2, ty, &format!("enc_lfm2_{name}.gguf"));
        let model = ClipModel::open(&path).unwrap();
        assert_eq!((model.hp.n_mmproj_embd, model.hp.n_merge), (48, 2));
        // 64 to 256 merged tokens of 32 x 32 pixels.
        assert_eq!(
            (model.hp.image_min_pixels, model.hp.image_max_pixels),
            (64 * 1024, 256 * 1024)
        );
        let w = Weights(Gguf::open(&path).unwrap());
        let hp = hp_of(&cfg);
        // The table's own 16 x 16 grid, smaller and larger ones, a tile.
        let sizes = [(256, 256), (96, 64), (64, 320), (512, 512), (32, 32)];
        encodes_as_reference(
            &model,
            &sizes,
            32,
            &|img| reference_lfm2(&w, &hp, img),
            &format!("lfm2 {name}"),
            tolerance(ty),
        );
        // Without the projector's norm: the merged rows go straight to the MLP.
        let bare = tmp(&format!("enc_lfm2_{name}_bare.gguf"));
        common::rewrite_gguf_tensors(&path, &bare, |t| !t.starts_with("mm.input_norm"));
        let model = ClipModel::open(&bare).unwrap();
        let w = Weights(Gguf::open(&bare).unwrap());
        assert!(!w.has("mm.input_norm.weight"));
        encodes_as_reference(
            &model,
            &sizes[..2],
            32,
            &|img| reference_lfm2(&w, &hp, img),
            &format!("lfm2 {name} without the input norm"),
            tolerance(ty),
        );
    }
}

/// LFM2-VL files clip.cpp cannot run, or would run other than LES, are
/// refused with the reason: no or a unit merge factor (clip.cpp asserts one
/// above 1), a norm bias without its weight, the MLP without its biases.
#[test]
fn lfm2_projector_files_are_checked() {
    use les::gguf::MetaValue;
    let (path, _) = projector(ProjectorType::Lfm2, GgmlType::F16, "enc_lfm2_bad_src.gguf");
    let bad = tmp("enc_lfm2_bad.gguf");
    let key = "clip.vision.projector.scale_factor";
    for (scale, want) in [
        (None, "lfm2: clip.vision.projector.scale_factor is missing"),
        (Some(1u32), "lfm2: scale_factor 1 (must be 2 to 4)"),
    ] {
        let extra: Vec<(&str, MetaValue)> = scale.map(|v| (key, v.into())).into_iter().collect();
        common::rewrite_gguf(&path, &bad, |k, v| (k != key).then_some(v), extra);
        let e = ClipModel::open(&bad).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    for (dropped, want) in [
        (
            "mm.input_norm.weight",
            "lfm2: mm.input_norm.bias without mm.input_norm.weight",
        ),
        ("mm.1.bias", "lfm2: mm.1.bias and mm.2.bias are required"),
        ("mm.2.bias", "lfm2: mm.1.bias and mm.2.bias are required"),
        ("mm.1.weight", "mm.1.weight"),
    ] {
        common::rewrite_gguf_tensors(&path, &bad, |t| t != dropped);
        let e = ClipModel::open(&bad).unwrap_err().to_string();
        assert!(e.contains(want), "without {dropped}: {e}");
    }
    // Token bounds crossing the other's default (64 to 256) are refused, as
    // llama.cpp refuses them; within it they move both sizes.
    let mut m = ClipModel::open(&path).unwrap();
    for (min, max, want) in [
        (
            None,
            Some(20),
            "--image-min-tokens 64 (the default) is more than --image-max-tokens 20",
        ),
        (
            Some(300),
            None,
            "--image-min-tokens 300 is more than --image-max-tokens 256 (the default)",
        ),
    ] {
        let e = m.set_image_tokens(min, max).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    m.set_image_tokens(Some(16), Some(100)).unwrap();
    assert_eq!(
        (m.hp.image_min_pixels, m.hp.image_max_pixels),
        (16 * 1024, 100 * 1024)
    );
}

#[test]
fn internvl_encoder_matches_the_reference() {
    for (ty, name) in [(GgmlType::F32, "f32"), (GgmlType::F16, "f16")] {
        let (path, cfg) = projector(
            ProjectorType::InternVl,
            ty,
            &format!("enc_internvl_{name}.gguf"),
        );
        let model = ClipModel::open(&path).unwrap();
        assert_eq!((model.hp.n_mmproj_embd, model.hp.n_merge), (48, 2));
        assert_eq!(model.hp.tiles, (1, 6));
        assert!(model
            .layers
            .iter()
            .all(|l| l.ls1.is_some() && l.ls2.is_some()));
        let w = Weights(Gguf::open(&path).unwrap());
        let hp = hp_of(&cfg);
        let mut pool = Pool::new(3);
        let img = test_image(112, 112, 6);
        let mut ctx = Ctx {
            pool: &mut pool,
            isa: Isa::detect(),
        };
        let got = encode(&mut ctx, &model, &img).unwrap();
        assert_eq!(output_tokens(&model, 112, 112), 16);
        let want = reference_internvl(&w, &hp, &img);
        compare(&got, &want, &format!("internvl {name}"), tolerance(ty));
        // Tiles only: another size is refused.
        let e = encode(&mut ctx, &model, &test_image(56, 56, 1)).unwrap_err();
        assert!(e.to_string().contains("tiles"), "{e}");
    }
}

#[test]
fn llama4_encoder_matches_the_reference() {
    for (ty, name) in [(GgmlType::F32, "f32"), (GgmlType::F16, "f16")] {
        let (path, cfg) = projector(
            ProjectorType::Llama4,
            ty,
            &format!("enc_llama4_{name}.gguf"),
        );
        let model = ClipModel::open(&path).unwrap();
        assert_eq!((model.hp.n_mmproj_embd, model.hp.n_merge), (48, 2));
        let w = Weights(Gguf::open(&path).unwrap());
        let hp = hp_of(&cfg);
        let mut pool = Pool::new(3);
        let img = test_image(112, 112, 4);
        let mut ctx = Ctx {
            pool: &mut pool,
            isa: Isa::detect(),
        };
        let got = encode(&mut ctx, &model, &img).unwrap();
        assert_eq!(output_tokens(&model, 112, 112), 16);
        assert_eq!(got.len(), 16 * 48);
        let want = reference_llama4(&w, &hp, &img);
        compare(&got, &want, &format!("llama4 {name}"), tolerance(ty));
        // Tiles only: another size is refused.
        let e = encode(&mut ctx, &model, &test_image(56, 56, 1)).unwrap_err();
        assert!(e.to_string().contains("tiles"), "{e}");
    }
}

#[test]
fn encoder_output_does_not_depend_on_threads_or_kernels() {
    for (ptype, (w, h)) in [
        (ProjectorType::MiniCpmV46, (224, 168)),
        (ProjectorType::Qwen3Vl, (192, 128)),
        (ProjectorType::KimiVl, (196, 112)),
        (ProjectorType::Llama4, (112, 112)),
        (ProjectorType::Glm4v, (140, 84)),
        (ProjectorType::InternVl, (112, 112)),
    ] {
        let name = format!("enc_threads_{}.gguf", ptype.name());
        let (path, _) = projector(ptype, GgmlType::F16, &name);
        let model = ClipModel::open(&path).unwrap();
        let img = test_image(w, h, 3);
        let run = |threads: usize, isa: Isa| {
            let mut pool = Pool::new(threads);
            let mut ctx = Ctx {
                pool: &mut pool,
                isa,
            };
            encode(&mut ctx, &model, &img).unwrap()
        };
        let base = run(1, Isa::Scalar);
        for isa in Isa::available() {
            for threads in [1, 2, 4] {
                assert!(
                    run(threads, isa) == base,
                    "{ptype:?}: {isa} x {threads} threads"
                );
            }
        }
    }
}

#[test]
fn encoder_rejects_bad_inputs_and_files() {
    let (path, _) = projector(ProjectorType::MiniCpmV46, GgmlType::F16, "enc_bad.gguf");
    let model = ClipModel::open(&path).unwrap();
    let mut pool = Pool::new(1);
    let mut ctx = Ctx {
        pool: &mut pool,
        isa: Isa::detect(),
    };
    // Not a multiple of patch x merge.
    let e = encode(&mut ctx, &model, &test_image(100, 56, 1)).unwrap_err();
    assert!(e.to_string().contains("multiple"), "{e}");
    let e = encode(&mut ctx, &model, &test_image(70, 56, 1)).unwrap_err();
    assert!(e.to_string().contains("multiple"), "{e}");
    // A language model is not an mmproj file.
    let lm = tmp("enc_not_clip.gguf");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_les"))
        .args([
            "synth", "--arch", "qwen3moe", "--layers", "1", "--quiet", "-o",
        ])
        .arg(&lm)
        .output()
        .unwrap();
    assert!(out.status.success());
    let e = ClipModel::open(&lm).unwrap_err().to_string();
    assert!(e.contains("not an mmproj"), "{e}");
}

#[test]
fn legacy_swapped_ffn_names_are_undone() {
    // Old conversions named the ViT's fc1 `ffn_down` and fc2 `ffn_up`; llama.cpp
    // (and LES) swap them back by shape. Rewrite a projector that way.
    let (path, _) = projector(ProjectorType::Gemma3, GgmlType::F16, "enc_swap_src.gguf");
    let src = Gguf::open(&path).unwrap();
    let rename = |n: &str| {
        if n.contains(".ffn_up.") {
            n.replace(".ffn_up.", ".ffn_down.")
        } else if n.contains(".ffn_down.") {
            n.replace(".ffn_down.", ".ffn_up.")
        } else {
            n.to_string()
        }
    };
    let mut w = les::gguf::GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add_kv(k, v.to_meta()).unwrap();
    }
    for t in src.tensors() {
        w.add_tensor(rename(t.name()), t.dims(), t.ggml_type())
            .unwrap();
    }
    let swapped = tmp("enc_swap.gguf");
    let mut data = w
        .write_header(std::fs::File::create(&swapped).unwrap())
        .unwrap();
    for t in src.tensors() {
        data.write_tensor(&rename(t.name()), t.data()).unwrap();
    }
    data.finish().unwrap();
    let img = test_image(224, 224, 4);
    let run = |p: &PathBuf| {
        let m = ClipModel::open(p).unwrap();
        let mut pool = Pool::new(1);
        let mut ctx = Ctx {
            pool: &mut pool,
            isa: Isa::detect(),
        };
        encode(&mut ctx, &m, &img).unwrap()
    };
    assert!(run(&path) == run(&swapped));
}

/// An image of `w` x `h` whose pixels vary in every direction, as PNG.
fn png_of(w: u32, h: u32, path: &std::path::Path) {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        let v = |c: u32| ((x * 7 + y * 13 + c * 29 + (x * y) % 17 + ((x ^ y) & 8) * 9) % 256) as u8;
        image::Rgb([v(0), v(1), v(2)])
    });
    img.save(path).unwrap();
}

/// les's image embeddings against llama.cpp's own (`libmtmd` through
/// llama-cpp-python, `scripts/mtmd_llama.py`), for both projectors on
/// images that are sliced, resized up and down, and padded: the same
/// chunks, in order, of the same token counts, and embeddings within float
/// error, in the same prompt layout. Needs llama-cpp-python with its `mtmd`
/// library (see the README's "Against llama.cpp").
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn embeddings_equal_llama_cpps() {
    let model = tiny_text_model("qwen3moe", "mtmd_text.gguf");
    let mut pool = Pool::new(2);
    let mut failures = Vec::new();
    // Through SiLU (computed in f32 by both), f32 weights: the two differ by
    // the order of their sums (gemma3: 3e-7; MiniCPM-V's merger has GELUs of
    // its own). Through ggml's GELU, a table over f16 inputs, an input near
    // the middle of two f16 values rounds to either side (5e-4 apart) on a
    // last-bit difference, and the rest follows. With f16 weights both round
    // each product's activations to f16 (ggml converts them to its f16 dot
    // product's input), and the same happens there: an activation one f32 bit
    // apart (their sums run in different orders) now and then rounds to the
    // other f16 neighbour. Measured on gemma3 through SiLU, one matrix in f16
    // at a time: 2e-6 to 1.5e-5 for each ViT matrix, 1e-4 for the input
    // projection (the last product, nothing after it to average the flip
    // out), 3e-4 with all of them. Moving les's activations by a few f32 bits
    // before the rounding moves les's output as far (the input projection's
    // case: by the very same 9.8e-5); ggml's f16 product alone matches "round
    // the activations, then sum in f32" to 1e-7.
    // Measured: with the resize kernels llama.cpp replaced by Pillow's, the
    // first case differed by 15% of the largest value; with the patch
    // embedding in f32 instead of llama.cpp's f16 (`ggml_conv_2d`), 3e-4.
    for (ptype, ty, silu, tolerance) in [
        (ProjectorType::MiniCpmV46, GgmlType::F32, true, 1e-4),
        (ProjectorType::Gemma3, GgmlType::F32, true, 1e-4),
        (ProjectorType::MiniCpmV46, GgmlType::F32, false, 5e-4),
        (ProjectorType::Gemma3, GgmlType::F32, false, 1e-4),
        (ProjectorType::Gemma3, GgmlType::F16, true, 1e-3),
        // bf16 weights: ggml rounds the activations to bf16 (8 bits), so a
        // flip costs 8 times more (measured 1.6e-3 to 2.4e-3; 3.1e-3 before
        // les rounded them too).
        (ProjectorType::Gemma3, GgmlType::BF16, true, 5e-3),
        (ProjectorType::MiniCpmV46, GgmlType::F16, false, 2e-3),
        (ProjectorType::Gemma3, GgmlType::F16, false, 2e-3),
    ] {
        mtmd_embeddings_of(&model, ptype, ty, silu, tolerance, &mut pool, &mut failures);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Llama 4's tiles and overview against llama.cpp's (`libmtmd`): a synthetic
/// `llama4` model and a matching `llama4` projector (112-pixel tiles, a
/// class token, a 2 x 2 pixel shuffle), on the images
/// [`embeddings_equal_llama_cpps`] uses: the same tile grids (up to 3 x 3
/// candidates), the tiles then the overview between `<|image_start|>` and
/// `<|image_end|>`, and embeddings within float error.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn llama4_embeddings_equal_llama_cpps() {
    // Every value goes through two of ggml's f16-table GELUs in the adapter
    // after the ViT (SiLU or not in the ViT), so flips show in every variant.
    // Measured (2026-12-05): f32 through SiLU 5.5e-5 to 4.0e-4, through GELU
    // 3.3e-4 to 4.6e-4; f16 5.3e-4 to 1.1e-3; bf16 up to 4.6e-3.
    let model = tiny_text_model("llama4", "mtmd_llama4_text.gguf");
    tiled_embeddings_equal_llama_cpps(&model, ProjectorType::Llama4);
}

/// A tiling projector (`ptype`: Llama 4's, InternVL's) before `model` against
/// libmtmd ([`mtmd_embeddings_of`]) with f32 weights through SiLU and GELU,
/// f16 and bf16 ones.
fn tiled_embeddings_equal_llama_cpps(model: &PathBuf, ptype: ProjectorType) {
    let mut pool = Pool::new(2);
    let mut failures = Vec::new();
    for (ty, silu, tolerance) in [
        (GgmlType::F32, true, 1e-3),
        (GgmlType::F32, false, 1e-3),
        (GgmlType::F16, false, 3e-3),
        (GgmlType::BF16, false, 1e-2),
    ] {
        mtmd_embeddings_of(model, ptype, ty, silu, tolerance, &mut pool, &mut failures);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A `les synth --preset tiny` model of `arch` written to `file`.
fn tiny_text_model(arch: &str, file: &str) -> PathBuf {
    tiny_text_model_with(arch, file, &[])
}

/// [`tiny_text_model`] with more `les synth` arguments.
fn tiny_text_model_with(arch: &str, file: &str, extra: &[&str]) -> PathBuf {
    let model = tmp(file);
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_les"))
        .args(["synth", "--quiet", "--arch", arch, "--preset", "tiny", "-o"])
        .arg(&model)
        .args(extra)
        .status()
        .unwrap();
    assert!(status.success());
    model
}

/// InternVL's tiles and overview against llama.cpp's (`libmtmd`), as
/// [`llama4_embeddings_equal_llama_cpps`]: a synthetic `qwen3moe` (as
/// InternVL3.5-30B-A3B's) with `<img>` and `</img>` in its vocabulary and an
/// `internvl` projector (112-pixel tiles, 1 to 6 a picture, a class token
/// after the patches, layer scales, a 2 x 2 pixel shuffle): the same tile
/// grids, the tiles then the overview between `<img>` and `</img>`, and
/// embeddings within float error.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn internvl_embeddings_equal_llama_cpps() {
    let mmproj = tmp("mtmd_internvl_text_mmproj.gguf");
    let model = tiny_text_model_with(
        "qwen3moe",
        "mtmd_internvl_text.gguf",
        &[
            "--projector",
            "internvl",
            "--mmproj-out",
            mmproj.to_str().unwrap(),
        ],
    );
    // Every value goes through the MLP's f16-table GELU after the ViT.
    // Measured (2026-12-05): f32 through SiLU 5e-8 to 2.2e-4, through GELU
    // 1.4e-4 to 4.1e-4; f16 3.9e-4 to 8.7e-4; bf16 3.2e-3 to 5.1e-3.
    tiled_embeddings_equal_llama_cpps(&model, ProjectorType::InternVl);
}

/// LFM2-VL's images against llama.cpp's (`libmtmd`): a synthetic dense
/// `lfm2` model with LFM2-VL's markers in its vocabulary and an `lfm2`
/// projector (16-pixel patches, a 2 x 2 unshuffle, 64 to 256 tokens an
/// image): the same overview sizes, the same tile grids for large images
/// (512-pixel tiles, `<|img_row_R_col_C|>` before each, then
/// `<|img_thumbnail|>` and the overview), and embeddings within float
/// error (measured 2026-12-06 over ten images, four tiled: f32 through
/// SiLU 2.1e-5 to 1.7e-4, through GELU 9.7e-5 to 3.7e-4; f16 3.4e-4 to
/// 5.9e-4; bf16 2.1e-3 to 3.5e-3).
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn lfm2_embeddings_equal_llama_cpps() {
    let mmproj = tmp("mtmd_lfm2_text_mmproj.gguf");
    let model = tiny_text_model_with(
        "lfm2",
        "mtmd_lfm2_text.gguf",
        &[
            "--projector",
            "lfm2",
            "--mmproj-out",
            mmproj.to_str().unwrap(),
        ],
    );
    tiled_embeddings_equal_llama_cpps(&model, ProjectorType::Lfm2);
}

/// LFM2-VL's token bounds as llama.cpp applies them (`image_min_tokens` /
/// `image_max_tokens`, which also move its tiling threshold): the same
/// chunks of the same sizes, in prompt order, for images of many shapes.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn lfm2_token_bounds_equal_llama_cpps() {
    let mmproj = tmp("mtmd_lfm2_bounds_mmproj.gguf");
    let model = tiny_text_model_with(
        "lfm2",
        "mtmd_lfm2_bounds.gguf",
        &[
            "--projector",
            "lfm2",
            "--mmproj-out",
            mmproj.to_str().unwrap(),
        ],
    );
    let sizes = [
        (320, 240),
        (1024, 768),
        (720, 760),
        (2000, 1500),
        (40, 30),
        (6000, 100),
        (500, 420),
    ];
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/mtmd_llama.py");
    // A bound crossing the other's default fails in llama.cpp ("image_max_pixels
    // (262144) is less than image_min_pixels (307200)") and here.
    let mut clip = ClipModel::open(&mmproj).unwrap();
    let e = clip
        .set_image_tokens(Some(300), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--image-min-tokens 300 is more than --image-max-tokens 256 (the default)"),
        "{e}"
    );
    for (min, max) in [(None, None), (None, Some(64)), (Some(16), Some(100))] {
        let mut clip = ClipModel::open(&mmproj).unwrap();
        clip.set_image_tokens(min, max).unwrap();
        for (w, h) in sizes {
            let mut cmd = std::process::Command::new("python3");
            cmd.arg(script)
                .arg("grid")
                .arg(&model)
                .arg(&mmproj)
                .arg(format!("{w}x{h}"));
            if let Some(v) = min {
                cmd.env("MTMD_IMAGE_MIN_TOKENS", v.to_string());
            }
            if let Some(v) = max {
                cmd.env("MTMD_IMAGE_MAX_TOKENS", v.to_string());
            }
            let out = cmd.output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let chunks: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let theirs: Vec<usize> = chunks
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["n"].as_u64().unwrap() as usize)
                .collect();
            let layout = les::vision::image_layout(&clip, (w, h));
            let mut ours = layout.chunk_tokens.clone();
            ours.rotate_left(1); // tiles, then the overview
            assert_eq!(ours, theirs, "{w}x{h}, min {min:?}, max {max:?}");
        }
    }
}

/// One projector of `ptype` with `ty` weights (its ViT's FFN through SiLU
/// where `silu`) before the language model `model`, against libmtmd on six
/// images: the prompt's layout, the chunks in prompt order, embeddings within
/// `tolerance` of the largest value (a miss is pushed to `failures`).
fn mtmd_embeddings_of(
    model: &PathBuf,
    ptype: ProjectorType,
    ty: GgmlType,
    silu: bool,
    tolerance: f32,
    pool: &mut Pool,
    failures: &mut Vec<String>,
) {
    let g = Gguf::open(model).unwrap();
    let arch = g.architecture().unwrap().to_string();
    let n_embd = g.get_u64(&format!("{arch}.embedding_length")).unwrap();
    let tok = les::tokenizer::Tokenizer::from_gguf(&g).unwrap();
    drop(g);
    let act = if silu { "silu" } else { "gelu" };
    let projector = format!("{} {ty} {act}", ptype.name());
    let mmproj = tmp(&format!("mtmd_{}_{ty}_{act}.gguf", ptype.name()));
    let mut cfg = MmprojConfig::tiny(ptype, n_embd, 3);
    cfg.ty = ty;
    write_mmproj(&cfg, &mmproj).unwrap();
    if silu {
        use les::gguf::MetaValue;
        let src = tmp(&format!("mtmd_{}_{ty}_gelu0.gguf", ptype.name()));
        std::fs::rename(&mmproj, &src).unwrap();
        common::rewrite_gguf(
            &src,
            &mmproj,
            |k, v| (k != "clip.use_gelu").then_some(v),
            vec![("clip.use_silu", MetaValue::Bool(true))],
        );
    }
    let m = ClipModel::open(&mmproj).unwrap();
    let jpeg = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/jpeg/b422.jpg");
    let mut sizes = vec![
        (300, 200),
        (640, 480),
        (97, 411),
        (224, 224),
        (1000, 180),
        (0, 0),
    ];
    if ptype == ProjectorType::Lfm2 {
        // Large enough for LFM2's tiles (over twice 512 x 512 pixels): 3 x 2,
        // 1 x 3 and 4 x 2 tiles, and 720 x 760 (720 / 32 rounds to even, 22).
        sizes.extend([(1024, 768), (800, 2100), (2048, 1024), (720, 760)]);
    }
    for (w, h) in sizes {
        // PNGs of five shapes, and a JPEG (4:2:2, decoded as llama.cpp does).
        let png = if w == 0 {
            PathBuf::from(jpeg)
        } else {
            tmp(&format!("mtmd_{w}x{h}.png"))
        };
        if w > 0 {
            png_of(w, h, &png);
        }
        let chunks = mtmd_llama([
            "embed".as_ref(),
            model.as_ref(),
            mmproj.as_ref(),
            png.as_ref(),
        ]);
        let theirs: Vec<Vec<f32>> = chunks
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c.get("image"))
            .map(|e| {
                e.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect();
        let img = les::vision::image::load_image(&png).unwrap();
        let mut ctx = Ctx {
            pool,
            isa: Isa::detect(),
        };
        let ours = les::vision::encode_image(&mut ctx, &m, &img).unwrap();
        let what = format!("{projector} {}", png.file_name().unwrap().to_string_lossy());
        // The prompt's layout: the same tokens around the same chunks.
        let prompt = les::vision::prompt::build_prompt(
            &tok,
            ptype,
            les::vision::prompt::MEDIA_MARKER,
            false,
            std::slice::from_ref(&ours),
            n_embd as usize,
        )
        .unwrap();
        let mut layout: Vec<serde_json::Value> = Vec::new();
        for item in &prompt.items {
            use les::vision::prompt::PromptItem;
            match (item, layout.last_mut()) {
                (PromptItem::Token(t), Some(serde_json::Value::Array(ids))) => {
                    ids.push((*t).into())
                }
                (PromptItem::Token(t), _) => layout.push(serde_json::json!([t])),
                (PromptItem::Embedding(_), Some(serde_json::Value::Number(n))) => {
                    *n = (n.as_u64().unwrap() + 1).into()
                }
                (PromptItem::Embedding(_), _) => layout.push(1.into()),
            }
        }
        // Runs of tokens and of embeddings (chunks with nothing between them,
        // as Llama 4's tiles, counted together; each chunk's size below).
        let mut theirs_layout: Vec<serde_json::Value> = Vec::new();
        for c in chunks.as_array().unwrap() {
            match (c.get("text"), theirs_layout.last_mut()) {
                (Some(t), _) => theirs_layout.push(t.clone()),
                (None, Some(serde_json::Value::Number(n))) => {
                    *n = (n.as_u64().unwrap() + c["n"].as_u64().unwrap()).into()
                }
                (None, _) => theirs_layout.push(c["n"].clone()),
            }
        }
        assert_eq!(layout, theirs_layout, "{what}: the prompt's layout");
        assert_eq!(ours.chunks.len(), theirs.len(), "{what}: chunks");
        // llama.cpp's chunks come in prompt order: Llama 4's and InternVL's
        // tiles before the overview (les's chunk 0).
        let mut in_prompt: Vec<&Vec<f32>> = ours.chunks.iter().collect();
        if matches!(
            ptype,
            ProjectorType::Llama4 | ProjectorType::InternVl | ProjectorType::Lfm2
        ) {
            in_prompt.rotate_left(1);
        }
        let mut worst = 0f32;
        for (i, (a, b)) in in_prompt.into_iter().zip(&theirs).enumerate() {
            assert_eq!(a.len(), b.len(), "{what}: chunk {i}'s size");
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            for (x, y) in a.iter().zip(b) {
                worst = worst.max((x - y).abs() / scale);
            }
        }
        eprintln!(
            "{what}: {} chunks, largest difference {worst:.2e} of the largest value",
            theirs.len()
        );
        if worst >= tolerance {
            failures.push(format!("{what}: {worst:.2e} >= {tolerance:.0e}"));
        }
    }
}

/// les's Qwen3-VL image embeddings against llama.cpp's own (`libmtmd`
/// through llama-cpp-python, `scripts/mtmd_llama.py`'s `embed`) on a
/// synthetic qwen3vlmoe language model and a matching `qwen3vl_merger`
/// projector made by one `les synth` command (`f16`, three deepstack
/// mergers: rows of 4 x n_embd, the model's `n_embd_inp`), and on `f32`
/// (GELU, and SiLU in the ViT) and `bf16` variants of it: the token grid
/// ([`les::vision::merged_grid`], llama.cpp's `nx` x `ny`) of fifteen image
/// sizes, then images resized up to the token minimum, down to the maximum,
/// and neither, square, wide and tall: one image chunk each, its rows within
/// float error. Needs llama-cpp-python with its `mtmd` library.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn qwen3vl_embeddings_equal_llama_cpps() {
    dyn_size_embeddings_equal_llama_cpps("qwen3vlmoe", ProjectorType::Qwen3Vl, 5e-3);
}

/// les's Kimi-VL image embeddings against llama.cpp's, as
/// [`qwen3vl_embeddings_equal_llama_cpps`] compares Qwen3-VL's: a synthetic
/// `deepseek2` language model (Kimi-VL's) and a matching `kimivl` projector
/// (antialiased position embeddings, 2-D RoPE, 2 x 2 patch merger), the
/// token grids of the same sizes under its 8 to 1024 token budget, and the
/// embeddings of `f16`, `f32` (GELU and SiLU) and `bf16` towers. Needs
/// llama-cpp-python with its `mtmd` library.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn kimivl_embeddings_equal_llama_cpps() {
    // bf16: measured 6.8e-4 to 2.4e-3 since bf16 patch kernels multiply
    // unrounded pixels, as ggml does (3.2e-3 to 5.8e-3 before; f16 3.8e-4 to
    // 5.4e-4; Qwen3-VL's tower 1.2e-3 to 3.0e-3).
    dyn_size_embeddings_equal_llama_cpps("deepseek2", ProjectorType::KimiVl, 1e-2);
}

/// Kimi K2.5's tower (`kimik25`) against llama.cpp's, as
/// [`kimivl_embeddings_equal_llama_cpps`]: its `[n_embd, 16, 12]` position
/// table interpolated bicubically (height first, as its graph permutes it),
/// its 2 to 4096 token budget, `<|media_begin|>` and `<|media_end|>`.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn kimik25_embeddings_equal_llama_cpps() {
    dyn_size_embeddings_equal_llama_cpps("deepseek2", ProjectorType::KimiK25, 1e-2);
}

/// GLM-4.5V's tower (`glm4v`) against llama.cpp's, as
/// [`qwen3vl_embeddings_equal_llama_cpps`]: a synthetic `glm4moe` language
/// model with M-RoPE sections (GLM-4.5V's) and a matching projector
/// (Qwen3-VL's patches, order and rotation with RMSNorms, SwiGLU FFNs, the
/// position table interpolated bicubically, the convolution merger and the
/// SwiGLU MLP), its 8 to 4096 token budget and `<|begin_of_image|>`.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn glm4v_embeddings_equal_llama_cpps() {
    dyn_size_embeddings_equal_llama_cpps("glm4moe", ProjectorType::Glm4v, 1e-2);
}

/// The body of the tests above: a synthetic `arch` language model with a
/// `ptype` projector (a projector that sizes images to a token budget);
/// `bf16_tolerance` bounds its `bf16` tower (a rounding flip there costs 8
/// times one in `f16`).
fn dyn_size_embeddings_equal_llama_cpps(arch: &str, ptype: ProjectorType, bf16_tolerance: f32) {
    let les = env!("CARGO_BIN_EXE_les");
    let name = ptype.name();
    let model = tmp(&format!("mtmd_{name}_text.gguf"));
    let mmproj_f16 = tmp(&format!("mtmd_{name}_F16.gguf"));
    let status = std::process::Command::new(les)
        .args(["synth", "--quiet", "--arch", arch, "--preset", "tiny"])
        .args(["--projector", name, "--mmproj-out"])
        .arg(&mmproj_f16)
        .arg("-o")
        .arg(&model)
        .status()
        .unwrap();
    assert!(status.success());
    let g = Gguf::open(&model).unwrap();
    let n_embd = g.get_u64(&format!("{arch}.embedding_length")).unwrap();
    let n_deepstack = g
        .get_u64(&format!("{arch}.n_deepstack_layers"))
        .unwrap_or(0);
    drop(g);
    // The token grid of images of many sizes, resized up, down and not
    // (llama.cpp's `nx` x `ny` after its preprocessing; nothing encoded).
    let sizes = [
        (1, 1),
        (31, 33),
        (64, 64),
        (100, 100),
        (90, 91),
        (97, 411),
        (300, 200),
        (333, 777),
        (1023, 1025),
        (5000, 20),
        (20, 5000),
        (2200, 2000),
        (4000, 3000),
        (6000, 4000),
        (16384, 1),
    ];
    let sizes_arg: Vec<String> = sizes.iter().map(|(w, h)| format!("{w}x{h}")).collect();
    let mut args: Vec<&std::ffi::OsStr> =
        vec!["grid".as_ref(), model.as_ref(), mmproj_f16.as_ref()];
    args.extend(sizes_arg.iter().map(std::ffi::OsStr::new));
    let grids = mtmd_llama(args);
    let m = ClipModel::open(&mmproj_f16).unwrap();
    for ((w, h), g) in sizes.iter().zip(grids.as_array().unwrap()) {
        let ours = les::vision::merged_grid(&m, *w, *h);
        let theirs = (
            g["nx"].as_u64().unwrap() as usize,
            g["ny"].as_u64().unwrap() as usize,
        );
        assert_eq!(ours, theirs, "{w}x{h}: the token grid");
        assert_eq!(ours.0 * ours.1, g["n"].as_u64().unwrap() as usize);
        eprintln!("{w}x{h}: {} x {} tokens, as llama.cpp", ours.0, ours.1);
    }
    assert_eq!(grids.as_array().unwrap().len(), sizes.len());
    drop(m);
    let mut pool = Pool::new(2);
    let mut failures = Vec::new();
    // Every FFN here is ggml's GELU, a table over f16 inputs: an input near
    // the middle of two f16 values rounds to either side on a last-bit
    // difference of the sums before it (see `embeddings_equal_llama_cpps`);
    // with f16 or bf16 matrices both round the activations of each product
    // to that type too.
    // The synthetic towers' own activation (GLM-4.xV's SiLU, the others'
    // GELU), and the other one written over it.
    let native_silu = ptype == ProjectorType::Glm4v;
    let mut variants = vec![(GgmlType::F16, native_silu, mmproj_f16, 2e-3)];
    // GLM-4.xV's SiLU tower has no table activation at all (its merger's
    // GELU is erf's): nothing can flip, every value stays within float
    // rounding (measured 1.2e-5 to 8.0e-5 of the largest); its GELU variant
    // gates the table's GELU by the up projection (measured 1.6e-4 to
    // 5.4e-4).
    let (gelu_f32, silu_f32) = if native_silu {
        (1e-3, 2e-4)
    } else {
        (5e-4, 5e-4)
    };
    for (ty, silu, tolerance) in [
        (GgmlType::F32, false, gelu_f32),
        (GgmlType::F32, true, silu_f32),
        (GgmlType::BF16, native_silu, bf16_tolerance),
    ] {
        let mut cfg = MmprojConfig::tiny(ptype, n_embd, 3);
        cfg.ty = ty;
        cfg.deepstack = n_deepstack;
        let act = if silu { "silu" } else { "gelu" };
        let path = tmp(&format!("mtmd_{name}_{ty}_{act}.gguf"));
        write_mmproj(&cfg, &path).unwrap();
        if silu != native_silu {
            use les::gguf::MetaValue;
            let src = tmp(&format!("mtmd_{name}_{ty}_{act}0.gguf"));
            std::fs::rename(&path, &src).unwrap();
            let (from, to) = if silu {
                ("clip.use_gelu", "clip.use_silu")
            } else {
                ("clip.use_silu", "clip.use_gelu")
            };
            common::rewrite_gguf(
                &src,
                &path,
                |k, v| (k != from).then_some(v),
                vec![(to, MetaValue::Bool(true))],
            );
        }
        variants.push((ty, silu, path, tolerance));
    }
    for (ty, silu, mmproj, tolerance) in variants {
        let m = ClipModel::open(&mmproj).unwrap();
        assert_eq!(m.hp.n_deepstack as u64, n_deepstack);
        let width = m.row_width();
        assert_eq!(width as u64, n_embd * (1 + n_deepstack));
        // Qwen3-VL (Kimi-VL): 64 x 64 is under the 8-token minimum (scaled
        // up to 96 x 96, 84 x 84); 300 x 200 and 97 x 411 are rounded to
        // multiples of a merged patch (32, 28); 256 x 256 (224 x 224) is the
        // table's own grid; 1000 x 180 is wide; 2200 x 2000 is over the
        // maximum (4096 tokens: scaled down to 2144 x 1952, 16348 patches, a
        // minute and 4 GiB for llama.cpp's attention scores, so once; 1024
        // tokens: 4092 patches).
        let table = m.hp.image_size as u32;
        let mut sizes: Vec<(u32, u32)> =
            vec![(300, 200), (97, 411), (64, 64), (table, table), (1000, 180)];
        if ty == GgmlType::F16 {
            sizes.push((2200, 2000));
        }
        for (w, h) in sizes {
            let png = tmp(&format!("mtmd_{w}x{h}.png"));
            png_of(w, h, &png);
            let chunks = mtmd_llama([
                "embed".as_ref(),
                model.as_ref(),
                mmproj.as_ref(),
                png.as_ref(),
            ]);
            let images: Vec<&serde_json::Value> = chunks
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| c.get("image").is_some())
                .collect();
            let act = if silu { "silu" } else { "gelu" };
            let what = format!("{name} {ty} {act} {w}x{h}");
            assert_eq!(images.len(), 1, "{what}: image chunks");
            let theirs: Vec<f32> = images[0]["image"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            let grid = les::vision::merged_grid(&m, w as usize, h as usize);
            let their_grid = (
                images[0]["nx"].as_u64().unwrap() as usize,
                images[0]["ny"].as_u64().unwrap() as usize,
            );
            assert_eq!(grid, their_grid, "{what}: the token grid");
            let layout = les::vision::image_layout(&m, (w as usize, h as usize));
            assert_eq!(layout.chunk_tokens, [grid.0 * grid.1], "{what}: layout");
            let img = les::vision::image::load_image(&png).unwrap();
            let mut ctx = Ctx {
                pool: &mut pool,
                isa: Isa::detect(),
            };
            let ours = les::vision::encode_image(&mut ctx, &m, &img).unwrap();
            assert_eq!(ours.chunks.len(), 1, "{what}: chunks");
            assert_eq!(ours.n_embd, width, "{what}: row width");
            assert_eq!(ours.chunks[0].len(), theirs.len(), "{what}: size");
            assert_eq!(theirs.len(), grid.0 * grid.1 * width, "{what}: size");
            let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            let worst = ours.chunks[0]
                .iter()
                .zip(&theirs)
                .map(|(a, b)| (a - b).abs() / scale)
                .fold(0f32, f32::max);
            // Where they differ: the parts of rows (the merger's output, each
            // deepstack merger's) with a value more than 1e-5 apart. A GELU
            // flip in a merger's hidden layer moves one part of one row; one
            // in the ViT moves every token after it (attention mixes them).
            let part = m.hp.n_mmproj_embd;
            let apart = ours.chunks[0]
                .chunks(part)
                .zip(theirs.chunks(part))
                .filter(|(a, b)| a.iter().zip(*b).any(|(x, y)| (x - y).abs() > 1e-5 * scale))
                .count();
            eprintln!(
                "{what}: {} x {} tokens of {width}, largest difference {worst:.2e} of the \
                 largest value ({scale:.3}); {apart} of {} row parts more than 1e-5 apart",
                grid.0,
                grid.1,
                theirs.len() / part
            );
            if worst >= tolerance {
                failures.push(format!("{what}: {worst:.2e} >= {tolerance:.0e}"));
            }
            // With SiLU in the ViT and f32 weights only the mergers' GELUs can
            // flip: all but a few row parts agree to float rounding (measured:
            // 0 to 12 of 36 to 744), where a systematic difference (an order,
            // a position, an interpolation) would move them all. (GLM-4.xV's
            // has no GELU table to flip: its tight bound above says it.)
            if silu && ty == GgmlType::F32 && !native_silu && apart > theirs.len() / part / 8 {
                failures.push(format!("{what}: {apart} row parts apart"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn malformed_kimik25_files_are_errors() {
    use les::gguf::MetaValue;
    assert_malformed_refused(
        ProjectorType::KimiK25,
        vec![
            (
                "clip.vision.projector.scale_factor",
                None,
                "scale_factor is missing",
            ),
            // The file's pixel budget, the fewest more than the most.
            (
                "clip.vision.image_min_pixels",
                Some(MetaValue::U32(1 << 23)),
                "image pixels",
            ),
        ],
        &[
            ("v.position_embd.weight", "v.position_embd.weight"),
            ("mm.input_norm.weight", "mm.input_norm.weight"),
            ("mm.input_norm.bias", "mm.input_norm.bias"),
            ("mm.2.bias", "mm.2.bias"),
        ],
        Some((42, 56)),
    );
}

#[test]
fn malformed_llama4_files_are_errors() {
    use les::gguf::MetaValue;
    assert_malformed_refused(
        ProjectorType::Llama4,
        vec![
            (
                "clip.vision.projector.scale_factor",
                Some(MetaValue::U32(0)),
                "scale_factor 0",
            ),
            (
                "clip.vision.projector.scale_factor",
                None,
                "scale_factor is missing",
            ),
            // 70 is not a multiple of 14 x 2; 56 is, but the table is 8 x 8 + 1.
            (
                "clip.vision.image_size",
                Some(MetaValue::U32(70)),
                "image_size 70",
            ),
            (
                "clip.vision.image_size",
                Some(MetaValue::U32(56)),
                "65 position embeddings",
            ),
            (
                "clip.vision.attention.head_count",
                Some(MetaValue::U32(32)),
                "multiple of 4",
            ),
        ],
        &[
            ("v.class_embd", "v.class_embd"),
            ("mm.model.mlp.1.weight", "mm.model.mlp.1.weight"),
            ("mm.model.mlp.2.weight", "mm.model.mlp.2.weight"),
            ("mm.model.fc.weight", "mm.model.fc.weight"),
            ("v.patch_embd.weight", "v.patch_embd.weight"),
        ],
        // Its tower takes only whole tiles (`llama4_encoder_matches_the_reference`).
        None,
    );
}

/// A tiny f16 projector of `ptype` opens; with each of `keys` set to a
/// value (or removed, `None`), with each of `tensors` removed, and cut
/// anywhere, it is refused, the error saying what (`says`); where
/// `bad_image` is given, its tower refuses an image of that size (not a
/// multiple of its merged patch).
fn assert_malformed_refused(
    ptype: ProjectorType,
    keys: Vec<(&str, Option<les::gguf::MetaValue>, &str)>,
    tensors: &[(&str, &str)],
    bad_image: Option<(usize, usize)>,
) {
    let name = ptype.name();
    let (path, _) = projector(ptype, GgmlType::F16, &format!("{name}_ok.gguf"));
    ClipModel::open(&path).unwrap();
    let bad = tmp(&format!("{name}_bad.gguf"));
    let open_err = |p: &PathBuf| match ClipModel::open(p) {
        Ok(_) => panic!("{} opened", p.display()),
        Err(e) => e.to_string(),
    };
    for (key, value, says) in keys {
        let _ = std::fs::remove_file(&bad);
        common::rewrite_gguf(
            &path,
            &bad,
            |k, v| (k != key).then_some(v),
            value.map(|v| (key, v)).into_iter().collect(),
        );
        let e = open_err(&bad);
        assert!(e.contains(says), "{name} {key}: {e}");
    }
    for &(tensor, says) in tensors {
        let _ = std::fs::remove_file(&bad);
        copy_without(&path, &bad, &[tensor]);
        let e = open_err(&bad);
        assert!(e.contains(says), "{name} without {tensor}: {e}");
    }
    let bytes = std::fs::read(&path).unwrap();
    for i in 0..64 {
        let cut = bytes.len() * i / 64 + i % 7;
        std::fs::write(&bad, &bytes[..cut.min(bytes.len() - 1)]).unwrap();
        assert!(ClipModel::open(&bad).is_err(), "{name} cut at {cut}");
    }
    if let Some((w, h)) = bad_image {
        let model = ClipModel::open(&path).unwrap();
        let mut pool = Pool::new(1);
        let mut ctx = Ctx {
            pool: &mut pool,
            isa: Isa::detect(),
        };
        let e = encode(&mut ctx, &model, &test_image(w, h, 1)).unwrap_err();
        assert!(e.to_string().contains("multiple"), "{name}: {e}");
    }
}

#[test]
fn malformed_kimivl_files_are_errors() {
    use les::gguf::MetaValue;
    assert_malformed_refused(
        ProjectorType::KimiVl,
        vec![
            (
                "clip.vision.projector.scale_factor",
                Some(MetaValue::U32(1)),
                "scale_factor 1",
            ),
            (
                "clip.vision.projector.scale_factor",
                Some(MetaValue::U32(5)),
                "scale_factor 5",
            ),
            (
                "clip.vision.projector.scale_factor",
                None,
                "scale_factor is missing",
            ),
            (
                "clip.vision.attention.head_count",
                Some(MetaValue::U32(32)),
                "multiple of 4",
            ),
            (
                "clip.vision.patch_size",
                Some(MetaValue::U32(40)),
                "patch_size 40",
            ),
            (
                "clip.vision.patch_size",
                Some(MetaValue::U32(0)),
                "patch_size",
            ),
            (
                "clip.vision.attention.head_dim",
                Some(MetaValue::U32(8)),
                "head_dim",
            ),
        ],
        &[
            ("mm.input_norm.weight", "mm.input_norm.weight"),
            ("mm.input_norm.bias", "mm.input_norm.bias"),
            ("mm.1.bias", "mm.1.bias"),
            ("mm.2.weight", "mm.2.weight"),
            ("v.blk.1.attn_k.weight", "v.blk.1.attn_k.weight"),
            ("v.position_embd.weight", "v.position_embd.weight"),
        ],
        Some((42, 56)),
    );
}

#[test]
fn malformed_glm4v_files_are_errors() {
    use les::gguf::MetaValue;
    assert_malformed_refused(
        ProjectorType::Glm4v,
        vec![
            (
                "clip.vision.spatial_merge_size",
                Some(MetaValue::U32(3)),
                "spatial_merge_size 3",
            ),
            (
                "clip.vision.attention.head_count",
                Some(MetaValue::U32(32)),
                "multiple of 4",
            ),
            (
                "clip.vision.patch_size",
                Some(MetaValue::U32(40)),
                "patch_size 40",
            ),
            (
                "clip.vision.attention.head_dim",
                Some(MetaValue::U32(8)),
                "head_dim",
            ),
        ],
        &[
            ("v.patch_embd.weight.1", "v.patch_embd.weight.1"),
            ("v.patch_embd.bias", "v.patch_embd.bias"),
            ("v.blk.1.attn_qkv.weight", "v.blk.1.attn_qkv.weight"),
            ("mm.patch_merger.weight", "mm.patch_merger.weight"),
            ("mm.patch_merger.bias", "mm.patch_merger.bias"),
            ("mm.model.fc.weight", "mm.model.fc.weight"),
            ("mm.post_norm.weight", "mm.post_norm.weight"),
            ("mm.gate.weight", "mm.gate.weight"),
            ("mm.down.weight", "mm.down.weight"),
            ("v.position_embd.weight", "v.position_embd.weight"),
        ],
        Some((42, 56)),
    );
}

#[test]
fn malformed_internvl_files_are_errors() {
    use les::gguf::MetaValue;
    assert_malformed_refused(
        ProjectorType::InternVl,
        vec![
            (
                "clip.vision.projector.scale_factor",
                Some(MetaValue::U32(5)),
                "scale_factor 5",
            ),
            (
                "clip.vision.projector.scale_factor",
                None,
                "scale_factor is missing",
            ),
            (
                "clip.vision.preproc_min_tiles",
                Some(MetaValue::U32(0)),
                "tiles",
            ),
            (
                "clip.vision.preproc_max_tiles",
                Some(MetaValue::U32(100)),
                "tiles",
            ),
            (
                "clip.vision.preproc_min_tiles",
                Some(MetaValue::U32(7)),
                "tiles",
            ),
            (
                "clip.vision.image_size",
                Some(MetaValue::U32(100)),
                "image_size 100",
            ),
            (
                "clip.vision.image_size",
                Some(MetaValue::U32(168)),
                "position embeddings",
            ),
        ],
        &[
            ("v.class_embd", "v.class_embd"),
            ("mm.model.mlp.0.weight", "mm.model.mlp.0.weight"),
            ("mm.model.mlp.1.weight", "mm.model.mlp.1.weight"),
            ("mm.model.mlp.3.weight", "mm.model.mlp.3.weight"),
            ("v.blk.1.attn_v.weight", "v.blk.1.attn_v.weight"),
            ("v.position_embd.weight", "v.position_embd.weight"),
        ],
        None,
    );
}

/// Copies the GGUF `src` to `dst` without the tensors `drop` names (metadata
/// and the other tensors unchanged).
fn copy_without(src: &PathBuf, dst: &PathBuf, drop: &[&str]) {
    let g = Gguf::open(src).unwrap();
    let mut w = les::gguf::GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add_kv(k, v.to_meta()).unwrap();
    }
    let keep = |n: &str| !drop.contains(&n);
    for t in g.tensors().filter(|t| keep(t.name())) {
        w.add_tensor(t.name(), t.dims(), t.ggml_type()).unwrap();
    }
    let mut data = w.write_header(std::fs::File::create(dst).unwrap()).unwrap();
    for t in g.tensors().filter(|t| keep(t.name())) {
        data.write_tensor(t.name(), t.data()).unwrap();
    }
    data.finish().unwrap();
}

#[test]
fn malformed_qwen3vl_files_are_errors() {
    use les::gguf::MetaValue;
    let ds = |v: Vec<bool>| MetaValue::from(v);
    assert_malformed_refused(
        ProjectorType::Qwen3Vl,
        vec![
            (
                "clip.vision.spatial_merge_size",
                Some(MetaValue::U32(3)),
                "spatial_merge_size",
            ),
            (
                "clip.vision.spatial_merge_size",
                Some(MetaValue::from("2")),
                "spatial_merge_size",
            ),
            (
                "clip.vision.attention.head_count",
                Some(MetaValue::U32(32)),
                "multiple of 4",
            ),
            (
                "clip.vision.attention.head_count",
                Some(MetaValue::U32(5)),
                "multiple",
            ),
            (
                "clip.vision.patch_size",
                Some(MetaValue::U32(4096)),
                "patch",
            ),
            (
                "clip.vision.patch_size",
                Some(MetaValue::U32(0)),
                "patch_size",
            ),
            (
                "clip.vision.embedding_length",
                Some(MetaValue::U64(1 << 40)),
                "out of range",
            ),
            (
                "clip.vision.block_count",
                Some(MetaValue::U32(9)),
                "v.blk.4",
            ),
            (
                "clip.vision.attention.head_dim",
                Some(MetaValue::U32(8)),
                "head_dim",
            ),
            (
                "clip.vision.is_deepstack_layers",
                Some(ds(vec![true, false, true, false])),
                "block 1",
            ),
            (
                "clip.vision.is_deepstack_layers",
                Some(ds(vec![true])),
                "entries",
            ),
            (
                "clip.vision.is_deepstack_layers",
                Some(MetaValue::from(vec![1u32, 1, 1, 0])),
                "bools",
            ),
            (
                "clip.vision.is_deepstack_layers",
                Some(MetaValue::U32(1)),
                "array",
            ),
            (
                "clip.projector_type",
                Some(MetaValue::from("qwen3vl")),
                "not supported",
            ),
        ],
        &[
            ("v.patch_embd.weight.1", "v.patch_embd.weight.1"),
            ("v.patch_embd.bias", "v.patch_embd.bias"),
            ("v.blk.1.attn_qkv.bias", "v.blk.1.attn_qkv.bias"),
            ("v.blk.3.attn_qkv.weight", "v.blk.3.attn_qkv.weight"),
            ("mm.0.bias", "mm.0.bias"),
            ("mm.2.weight", "mm.2.weight"),
            ("v.deepstack.2.fc2.weight", "v.deepstack.2.fc2.weight"),
            ("v.deepstack.1.fc1.weight", "block 1"),
            ("v.position_embd.weight", "v.position_embd.weight"),
        ],
        Some((48, 64)),
    );
}

/// `scripts/mtmd_llama.py` with `args` (a mode and its arguments), its JSON
/// output; panics with its error output where it fails.
fn mtmd_llama<'a>(args: impl IntoIterator<Item = &'a std::ffi::OsStr>) -> serde_json::Value {
    let args: Vec<&std::ffi::OsStr> = args.into_iter().collect();
    common::python("mtmd_llama.py", &args)
}
