//! Measuring what a model's routing looks like to LES: lookahead precision, how
//! often consecutive layers reuse expert ids, and how skewed expert popularity is.
//!
//! The probe runs the forward pass for single tokens at position 0, where
//! attention reduces to `W_o (W_v x + b_v)` (one key, softmax weight 1), so it needs
//! no KV cache; it dequantizes only the rows and experts it uses. It is an estimate
//! for tuning [`super::Knobs`], not the engine: longer contexts mix in other
//! positions' values, which changes the residual stream a little more per layer.

use les_core::quant::{dequantize, GgmlType};

use super::rng::Rng;
use crate::gguf::{Gguf, OptionalKey, Tensor};

/// What [`probe`] measured.
#[derive(Clone, Debug)]
pub struct ProbeReport {
    /// Tokens run.
    pub tokens: usize,
    /// Experts used per token and layer.
    pub top_k: usize,
    /// Per layer `l >= 1`: the fraction of layer `l`'s experts that layer `l`'s
    /// router picks from layer `l-1`'s FFN input (top-k lookahead precision).
    pub lookahead: Vec<f64>,
    /// Per layer `l >= 1`: the fraction of layer `l`'s experts that layer `l-1` used.
    pub reuse: Vec<f64>,
    /// Share of all picks that went to each layer's most-picked 10% of experts,
    /// averaged over layers (0.1 when perfectly balanced).
    pub top_decile_share: f64,
}

impl ProbeReport {
    /// Mean of [`lookahead`](Self::lookahead).
    pub fn mean_lookahead(&self) -> f64 {
        mean(&self.lookahead)
    }

    /// Mean of [`reuse`](Self::reuse).
    pub fn mean_reuse(&self) -> f64 {
        mean(&self.reuse)
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

type Res<T> = Result<T, String>;

fn e<T>(r: Result<T, crate::gguf::GgufError>) -> Res<T> {
    r.map_err(|e| e.to_string())
}

/// Rows `rows` of the matrix in `data` (rows of `ne0` elements of `ty`) times `x`.
fn matvec(data: &[u8], ty: GgmlType, ne0: usize, x: &[f32], y: &mut [f32]) -> Res<()> {
    let rb = ty.row_bytes(ne0).ok_or("row size")?;
    let mut row = vec![0f32; ne0];
    for (i, out) in y.iter_mut().enumerate() {
        let bytes = data.get(i * rb..(i + 1) * rb).ok_or("matrix too short")?;
        dequantize(ty, bytes, &mut row).map_err(|e| e.to_string())?;
        *out = row.iter().zip(x).map(|(a, b)| a * b).sum();
    }
    Ok(())
}

fn vector(t: &Tensor) -> Res<Vec<f32>> {
    let mut v = vec![0f32; t.n_elements() as usize];
    dequantize(t.ggml_type(), t.data(), &mut v).map_err(|e| e.to_string())?;
    Ok(v)
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(a, b)| a * s * b).collect()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Indices of the `k` largest values, largest first, ties to the lower index.
fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

fn overlap(a: &[usize], b: &[usize]) -> usize {
    a.iter().filter(|e| b.contains(e)).count()
}

struct Model<'g, B: AsRef<[u8]>> {
    g: &'g Gguf<B>,
    eps: f32,
    embd: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    experts: usize,
    top_k: usize,
    normalize: bool,
}

impl<'g, B: AsRef<[u8]>> Model<'g, B> {
    fn t(&self, name: &str) -> Res<Tensor<'g>> {
        self.g
            .tensor(name)
            .ok_or_else(|| format!("no tensor {name}"))
    }

    fn mat(&self, name: &str, x: &[f32]) -> Res<Vec<f32>> {
        let t = self.t(name)?;
        let mut y = vec![0f32; t.n_rows() as usize];
        matvec(t.data(), t.ggml_type(), t.dims()[0] as usize, x, &mut y)?;
        Ok(y)
    }

    fn norm(&self, name: &str, x: &[f32]) -> Res<Vec<f32>> {
        Ok(rms_norm(x, &vector(&self.t(name)?)?, self.eps))
    }

    /// Router logits of layer `l` for residual `h`.
    fn logits(&self, l: usize, h: &[f32]) -> Res<Vec<f32>> {
        let x = self.norm(&format!("blk.{l}.ffn_norm.weight"), h)?;
        self.mat(&format!("blk.{l}.ffn_gate_inp.weight"), &x)
    }

    /// `down(silu(gate x) * up x)` for expert `e` of stacked tensors (or the plain
    /// matrices when `e` is `None`).
    fn ffn(&self, l: usize, suffix: &str, e: Option<usize>, x: &[f32]) -> Res<Vec<f32>> {
        let part = |which: &str| -> Res<(Tensor<'g>, &'g [u8])> {
            let t = self.t(&format!("blk.{l}.ffn_{which}{suffix}.weight"))?;
            let data = match e {
                None => t.data(),
                Some(e) => {
                    let per = t.data().len() / t.dims()[2] as usize;
                    &t.data()[e * per..(e + 1) * per]
                }
            };
            Ok((t, data))
        };
        let (gt, gd) = part("gate")?;
        let (ut, ud) = part("up")?;
        let (dt, dd) = part("down")?;
        let ff = gt.dims()[1] as usize;
        let (mut g, mut u) = (vec![0f32; ff], vec![0f32; ff]);
        matvec(gd, gt.ggml_type(), self.embd, x, &mut g)?;
        matvec(ud, ut.ggml_type(), self.embd, x, &mut u)?;
        let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        let mut y = vec![0f32; self.embd];
        matvec(dd, dt.ggml_type(), ff, &a, &mut y)?;
        Ok(y)
    }
}

/// Runs `tokens` random tokens (seeded by `seed`) through `g` one position each and
/// measures routing statistics. The model must have routed experts.
pub fn probe<B: AsRef<[u8]>>(g: &Gguf<B>, tokens: usize, seed: u64) -> Res<ProbeReport> {
    let arch = e(g.architecture())?.to_string();
    if matches!(
        arch.as_str(),
        "qwen35moe" | "granitehybrid" | "nemotron_h_moe" | "nemotron_h" | "lfm2moe" | "lfm2"
    ) {
        // Their DeltaNet / Mamba2 / short-convolution layers (and
        // Nemotron-H's ungated experts)
        // are not modelled here; `les bench` reports the engine's own
        // per-layer prediction quality.
        return Err(format!("the probe does not model {arch}; use `les bench`"));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let layers = e(g.get_u32(&key("block_count")))? as usize;
    let embd = e(g.get_u32(&key("embedding_length")))? as usize;
    let heads = e(g.get_u32(&key("attention.head_count")))? as usize;
    let kv_heads = e(g.get_u32(&key("attention.head_count_kv")))? as usize;
    let head_dim = e(g.get_u32(&key("attention.key_length")).optional())?
        .map_or(embd / heads.max(1), |v| v as usize);
    let experts = e(g.get_u32(&key("expert_count")).optional())?.unwrap_or(0) as usize;
    if experts == 0 {
        return Err("the probe needs a model with routed experts".into());
    }
    let m = Model {
        g,
        eps: e(g.get_f32(&key("attention.layer_norm_rms_epsilon")))?,
        embd,
        heads,
        kv_heads,
        head_dim,
        experts,
        top_k: e(g.get_u32(&key("expert_used_count")))? as usize,
        normalize: e(g.get_bool(&key("expert_weights_norm")).optional())?.unwrap_or(false),
    };
    let embd_t = m.t("token_embd.weight")?;
    let vocab = embd_t.dims()[1];
    let row_bytes = embd_t.row_bytes();

    let mut look = vec![0usize; layers];
    let mut reuse = vec![0usize; layers];
    let mut counts = vec![vec![0u64; m.experts]; layers];
    let mut rng = Rng::stream(seed, "probe", 0);
    for _ in 0..tokens {
        let tok = rng.below(vocab) as usize;
        let mut h = vec![0f32; embd];
        dequantize(
            embd_t.ggml_type(),
            &embd_t.data()[tok * row_bytes..(tok + 1) * row_bytes],
            &mut h,
        )
        .map_err(|e| e.to_string())?;
        let mut predicted: Option<Vec<usize>> = None;
        let mut previous: Option<Vec<usize>> = None;
        for l in 0..layers {
            // Attention at position 0: every query head reads its KV head's value.
            let x = m.norm(&format!("blk.{l}.attn_norm.weight"), &h)?;
            let mut v = m.mat(&format!("blk.{l}.attn_v.weight"), &x)?;
            if let Some(b) = g.tensor(&format!("blk.{l}.attn_v.bias")) {
                v.iter_mut().zip(vector(&b)?).for_each(|(a, b)| *a += b);
            }
            let group = m.heads / m.kv_heads;
            let mut att = Vec::with_capacity(m.heads * m.head_dim);
            for i in 0..m.heads {
                let kv = i / group;
                att.extend_from_slice(&v[kv * m.head_dim..(kv + 1) * m.head_dim]);
            }
            let o = m.mat(&format!("blk.{l}.attn_output.weight"), &att)?;
            h.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            // MoE FFN.
            let logits = m.logits(l, &h)?;
            let picked = top_k(&logits, m.top_k);
            if let Some(p) = &predicted {
                look[l] += overlap(p, &picked);
            }
            if let Some(p) = &previous {
                reuse[l] += overlap(p, &picked);
            }
            for &x in &picked {
                counts[l][x] += 1;
            }
            predicted = if l + 1 < layers {
                Some(top_k(&m.logits(l + 1, &h)?, m.top_k))
            } else {
                None
            };
            let x = m.norm(&format!("blk.{l}.ffn_norm.weight"), &h)?;
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = logits.iter().map(|v| (v - max).exp()).sum();
            let mut w: Vec<f32> = picked
                .iter()
                .map(|&i| (logits[i] - max).exp() / z)
                .collect();
            if m.normalize {
                let s: f32 = w.iter().sum();
                w.iter_mut().for_each(|v| *v /= s);
            }
            let mut out = vec![0f32; embd];
            for (&ex, &wt) in picked.iter().zip(&w) {
                let y = m.ffn(l, "_exps", Some(ex), &x)?;
                out.iter_mut().zip(&y).for_each(|(a, b)| *a += wt * b);
            }
            if let Some(gi) = g.tensor(&format!("blk.{l}.ffn_gate_inp_shexp.weight")) {
                let gate: f32 = vector(&gi)?.iter().zip(&x).map(|(a, b)| a * b).sum();
                let s = 1.0 / (1.0 + (-gate).exp());
                let y = m.ffn(l, "_shexp", None, &x)?;
                out.iter_mut().zip(&y).for_each(|(a, b)| *a += s * b);
            }
            h.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
            previous = Some(picked);
        }
    }
    let per = (tokens * m.top_k).max(1) as f64;
    let frac = |v: &[usize]| {
        v.iter()
            .skip(1)
            .map(|&n| n as f64 / per)
            .collect::<Vec<_>>()
    };
    let decile = m.experts.div_ceil(10);
    let top_decile_share = mean(
        &counts
            .iter()
            .map(|c| {
                let mut c = c.clone();
                c.sort_unstable_by(|a, b| b.cmp(a));
                c.iter().take(decile).sum::<u64>() as f64 / per
            })
            .collect::<Vec<_>>(),
    );
    Ok(ProbeReport {
        tokens,
        top_k: m.top_k,
        lookahead: frac(&look),
        reuse: frac(&reuse),
        top_decile_share,
    })
}
