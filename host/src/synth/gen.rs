//! Generating tensor data chunk by chunk and streaming it into the file.

use std::collections::VecDeque;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use les_core::quant::{quantize, GgmlType};

use super::rng::Rng;
use super::{gguf_writer, vocab_of, Init, SynthConfig, SynthError, TensorPlan};
use crate::interrupt::TempFile;

/// Elements per chunk of a 2-D tensor (rounded to whole rows): 8 MiB of `f32`.
const CHUNK_ELEMS: u64 = 1 << 21;

/// Fraction of each token embedding's variance along the shared direction is
/// `SHARED_DIR^2`.
const SHARED_DIR: f32 = 0.5;

/// Options of [`write_model`].
#[derive(Clone, Debug, Default)]
pub struct WriteOptions {
    /// Generator threads (the output does not depend on it); 0 = all cores.
    pub threads: usize,
    /// Progress on stderr: `None` = only for files of 256 MiB and more.
    pub progress: Option<bool>,
}

/// What [`write_model`] wrote.
#[derive(Clone, Debug)]
pub struct WriteReport {
    /// The file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Tensors written.
    pub tensors: usize,
    /// Time taken.
    pub elapsed: Duration,
}

/// The deterministic source of every tensor's values.
struct Generator<'c> {
    cfg: &'c SynthConfig,
    /// The shared direction `u` scaled to elements of +-1.
    dir: Vec<f32>,
    /// Popularity logit bias per expert.
    bias: Vec<f32>,
    /// The previous layer's raw (pre-popularity) router.
    router: Vec<f32>,
}

impl<'c> Generator<'c> {
    fn new(cfg: &'c SynthConfig) -> Self {
        let s = &cfg.shape;
        let mut rng = Rng::stream(cfg.seed, "shared_direction", 0);
        let dir = (0..s.embd)
            .map(|_| if rng.next_u64() >> 63 == 0 { 1.0 } else { -1.0 })
            .collect();
        // Popularity: a random ranking of the experts, bias -S ln(1 + rank), centred.
        let n = s.experts as usize;
        let mut order: Vec<usize> = (0..n).collect();
        let mut rng = Rng::stream(cfg.seed, "popularity", 0);
        for i in (1..n).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut bias = vec![0f32; n];
        for (rank, &e) in order.iter().enumerate() {
            bias[e] = -cfg.knobs.popularity_skew * ((1 + rank) as f32).ln();
        }
        let mean = bias.iter().sum::<f32>() / n.max(1) as f32;
        bias.iter_mut().for_each(|b| *b -= mean);
        Generator {
            cfg,
            dir,
            bias,
            router: Vec::new(),
        }
    }

    fn chunk_rows(t: &TensorPlan) -> u64 {
        match t.dims.len() {
            3 => t.dims[1],
            2 => (CHUNK_ELEMS / t.dims[0]).clamp(1, t.dims[1]),
            _ => 1,
        }
    }

    /// Number of chunks of `t`.
    fn chunks(t: &TensorPlan) -> u64 {
        let rows: u64 = t.dims.iter().skip(1).product();
        rows.div_ceil(Self::chunk_rows(t))
    }

    /// The quantized bytes of chunk `c` of `t` (not for routers).
    fn chunk(&self, t: &TensorPlan, c: u64) -> Vec<u8> {
        let ne0 = t.dims[0];
        let rows: u64 = t.dims.iter().skip(1).product();
        let per = Self::chunk_rows(t);
        let n_rows = per.min(rows - c * per);
        let mut rng = Rng::stream(self.cfg.seed, &t.name, c);
        if let Init::Normal(std) = t.init {
            if let Some(bytes) = random_blocks(t.ty, (ne0 * n_rows) as usize, std, &mut rng) {
                return bytes;
            }
        }
        let mut x = vec![0f32; (ne0 * n_rows) as usize];
        match t.init {
            Init::Norm => {
                rng.fill_normal(&mut x, 0.02);
                x.iter_mut().for_each(|v| *v += 1.0);
            }
            Init::Normal(std) => rng.fill_normal(&mut x, std),
            Init::Embedding => {
                let own = (1.0 - SHARED_DIR * SHARED_DIR).sqrt();
                rng.fill_normal(&mut x, own);
                // Granite multiplies the embedding: divided here, the stream
                // starts at the others' scale.
                let k = self.cfg.granite_scales().map_or(1.0, |[m, ..]| 1.0 / m);
                for row in x.chunks_exact_mut(ne0 as usize) {
                    for (v, d) in row.iter_mut().zip(&self.dir) {
                        *v = (*v + SHARED_DIR * d) * k;
                    }
                }
            }
            Init::Uniform(lo, hi) => {
                for v in x.iter_mut() {
                    *v = lo + (hi - lo) * (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                }
            }
            Init::DtBias(lo, hi) => {
                let (lo, hi) = (f64::from(lo).ln(), f64::from(hi).ln());
                for v in x.iter_mut() {
                    let dt = (lo + (hi - lo) * (1.0 - rng.uniform_open0())).exp();
                    // softplus^-1(dt) = dt + ln(1 - e^-dt)
                    *v = (dt + (-(-dt).exp_m1()).ln()) as f32;
                }
            }
            Init::RopeFactors => {
                let s = &self.cfg.shape;
                x.copy_from_slice(&super::llama3_rope_factors(
                    s.head_dim as usize,
                    s.rope_base,
                ));
            }
            Init::Router => unreachable!("routers are generated in order by `router`"),
        }
        let mut out = vec![0u8; t.ty.row_bytes(x.len()).expect("planned sizes fit")];
        quantize(t.ty, &x, &mut out).expect("planned types quantize");
        out
    }

    /// Layer `layer`'s router, `f32` bytes; layers must come in order.
    fn router(&mut self, t: &TensorPlan, layer: u64) -> Vec<u8> {
        let (d, n) = (t.dims[0] as usize, t.dims[1] as usize);
        let mut noise = vec![0f32; d * n];
        Rng::stream(self.cfg.seed, "router", layer).fill_normal(&mut noise, 1.0);
        let c = self.cfg.knobs.router_corr;
        if self.router.len() != noise.len() || layer == 0 {
            self.router = noise;
        } else {
            let s = (1.0 - c * c).max(0.0).sqrt();
            for (r, z) in self.router.iter_mut().zip(&noise) {
                *r = c * *r + s * z;
            }
        }
        let g = self.cfg.knobs.router_scale / (d as f32).sqrt();
        // x . u_hat is about SHARED_DIR * sqrt(d) for a normalised hidden state, so a
        // component b / (SHARED_DIR * sqrt(d)) along u_hat adds b to the logit.
        let along = 1.0 / (SHARED_DIR * d as f32);
        let mut out = Vec::with_capacity(d * n * 4);
        for (e, raw) in self.router.chunks_exact(d).enumerate() {
            // Remove the random part's component along u; dir has |dir|^2 = d.
            let proj = raw.iter().zip(&self.dir).map(|(r, u)| r * u).sum::<f32>() / d as f32;
            let b = self.bias.get(e).copied().unwrap_or(0.0);
            for (r, u) in raw.iter().zip(&self.dir) {
                let v = g * (r - proj * u) + b * along * u;
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }
}

/// Random blocks of `ty` whose values are zero-mean with standard deviation about
/// `std`, written directly in the block format: reference quantization of
/// gaussians (the K-quants' search especially) runs at a few MB/s, far too slow
/// for the multi-GB presets, and random weights need no particular rounding.
/// `None` for types without a direct generator (those go through `quantize`).
fn random_blocks(ty: GgmlType, n: usize, std: f32, rng: &mut Rng) -> Option<Vec<u8>> {
    let bytes = ty.row_bytes(n)?;
    let mut out = vec![0u8; bytes];
    for chunk in out.chunks_mut(8) {
        let r = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    let f16 = |x: f32| les_core::quant::f32_to_f16(x).to_le_bytes();
    match ty {
        GgmlType::Q4K => {
            // value = d*sc*q - dmin*m with m = sc and dmin = 7.5*d: d*sc*(q - 7.5),
            // uniform with std d*sc*4.61; sc in 32..64.
            for b in out.chunks_exact_mut(144) {
                let d = std / (4.61 * 48.0);
                b[0..2].copy_from_slice(&f16(d));
                b[2..4].copy_from_slice(&f16(7.5 * d));
                let sc: [u8; 8] = core::array::from_fn(|i| 32 | (b[4 + i] & 31));
                // Pack 6-bit scales and mins (equal) as ggml's get_scale_min_k4 reads them.
                let mut s = [0u8; 12];
                s[..4].copy_from_slice(&sc[..4]);
                s[4..8].copy_from_slice(&sc[..4]);
                for j in 4..8 {
                    s[j + 4] = (sc[j] & 0x0f) | ((sc[j] & 0x0f) << 4);
                    s[j - 4] |= (sc[j] >> 4) << 6;
                    s[j] |= (sc[j] >> 4) << 6;
                }
                b[4..16].copy_from_slice(&s);
            }
        }
        GgmlType::Q6K => {
            // value = d*sc*(q - 32), q uniform in 0..64: std d*sc*18.5; |sc| in
            // 32..64. q - 32 has mean -1/2: alternating the sign of the scales
            // cancels it.
            for b in out.chunks_exact_mut(210) {
                let d = std / (18.5 * 48.0);
                for i in 0..16 {
                    let sc = (32 | (b[192 + i] & 31)) as i8;
                    b[192 + i] = if i % 2 == 0 { sc } else { -sc } as u8;
                }
                b[208..210].copy_from_slice(&f16(d));
            }
        }
        GgmlType::Q8_0 => {
            // value = d*q, q uniform in -128..128: std d*73.9; the mean of -1/2 is
            // cancelled by alternating the sign of d.
            for (i, b) in out.chunks_exact_mut(34).enumerate() {
                let d = if i % 2 == 0 { std } else { -std } / 73.9;
                b[0..2].copy_from_slice(&f16(d));
            }
        }
        GgmlType::Q4_0 => {
            // value = d*(q - 8): std d*4.61; alternating signs of d cancel the mean.
            for (i, b) in out.chunks_exact_mut(18).enumerate() {
                let d = if i % 2 == 0 { std } else { -std } / 4.61;
                b[0..2].copy_from_slice(&f16(d));
            }
        }
        _ => return None,
    }
    Some(out)
}

/// A tensor's bytes as a `Read`, generated a batch of chunks at a time on up to
/// `threads` threads (each chunk has its own random stream, so the bytes do not
/// depend on the thread count).
struct ChunkReader<'g, 'c> {
    gen: &'g Generator<'c>,
    t: &'g TensorPlan,
    next: u64,
    total: u64,
    threads: usize,
    ready: VecDeque<Vec<u8>>,
    cur: Vec<u8>,
    pos: usize,
}

impl ChunkReader<'_, '_> {
    fn refill(&mut self) {
        let end = (self.next + self.threads as u64).min(self.total);
        let (gen, t) = (self.gen, self.t);
        if end - self.next == 1 {
            self.ready.push_back(gen.chunk(t, self.next));
        } else {
            let chunks: Vec<Vec<u8>> = std::thread::scope(|s| {
                let handles: Vec<_> = (self.next..end)
                    .map(|c| s.spawn(move || gen.chunk(t, c)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("generator thread"))
                    .collect()
            });
            self.ready.extend(chunks);
        }
        self.next = end;
    }
}

impl Read for ChunkReader<'_, '_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.cur.len() {
            if let Some(c) = self.ready.pop_front() {
                self.cur = c;
                self.pos = 0;
            } else if self.next < self.total {
                self.refill();
            } else {
                return Ok(0);
            }
        }
        let n = buf.len().min(self.cur.len() - self.pos);
        buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Counts bytes and reports progress on stderr.
struct Progress<W> {
    inner: W,
    written: u64,
    total: u64,
    start: Instant,
    last: Instant,
    enabled: bool,
}

impl<W: Write> Progress<W> {
    fn report(&mut self, done: bool) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if !done && now.duration_since(self.last) < Duration::from_millis(500) {
            return;
        }
        self.last = now;
        let secs = now.duration_since(self.start).as_secs_f64().max(1e-9);
        let rate = self.written as f64 / secs;
        let eta = if rate > 0.0 {
            (self.total.saturating_sub(self.written)) as f64 / rate
        } else {
            0.0
        };
        note_inline!(
            "\rsynth: {:.2} / {:.2} GB ({:.1}%), {:.1} MB/s, eta {:.0}s   ",
            self.written as f64 / 1e9,
            self.total as f64 / 1e9,
            100.0 * self.written as f64 / self.total.max(1) as f64,
            rate / 1e6,
            eta
        );
        if done {
            note!();
        }
    }
}

impl<W: Write> Write for Progress<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        self.report(false);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// The temporary name `path` is written under before the final rename.
pub(super) fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model.gguf".into());
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Writes the model described by `cfg` to `path`: into a temporary file in the
/// same directory, renamed to `path` once complete, so `path` never holds a
/// truncated model.
pub fn write_model(
    cfg: &SynthConfig,
    path: &Path,
    opts: &WriteOptions,
) -> Result<WriteReport, SynthError> {
    let start = Instant::now();
    let vocab = vocab_of(cfg)?;
    let (writer, plan) = gguf_writer(cfg, &vocab)?;
    drop(vocab);
    let total = writer.file_len();
    // Removed unless committed, also on interrupt.
    let (tmp, file) = TempFile::create(&temp_path(path), false)?;
    let progress = Progress {
        inner: BufWriter::with_capacity(1 << 20, file),
        written: 0,
        total,
        start,
        last: start,
        enabled: opts.progress.unwrap_or(total >= 256 << 20),
    };
    let mut data = writer.write_header(progress)?;
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let mut gen = Generator::new(cfg);
    for t in &plan {
        if t.init == Init::Router {
            let bytes = gen.router(t, t.layer.unwrap_or(0));
            data.write_tensor(&t.name, &bytes)?;
        } else {
            let reader = ChunkReader {
                gen: &gen,
                t,
                next: 0,
                total: Generator::chunks(t),
                threads,
                ready: VecDeque::new(),
                cur: Vec::new(),
                pos: 0,
            };
            data.copy_tensor(&t.name, reader)?;
        }
    }
    let mut progress = data.finish()?;
    progress.report(true);
    let file = progress
        .inner
        .into_inner()
        .map_err(|e| SynthError::Io(e.into_error()))?;
    file.sync_all()?;
    drop(file);
    tmp.commit(path)?;
    Ok(WriteReport {
        path: path.to_path_buf(),
        bytes: total,
        tensors: plan.len(),
        elapsed: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mamba2's decay and time step land where the recurrence stays tame.
    #[test]
    fn mamba2_a_and_dt_bias_are_in_range() {
        use super::super::{tensor_plan, Arch, Overrides, Preset};
        let cfg =
            SynthConfig::new(Arch::Granitehybrid, Preset::Small, &Overrides::default(), 0).unwrap();
        let gen = Generator::new(&cfg);
        let plan = tensor_plan(&cfg);
        let values = |name: &str| -> Vec<f32> {
            let t = plan.iter().find(|t| t.name == name).unwrap();
            let bytes = gen.chunk(t, 0);
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let a = values("blk.0.ssm_a");
        assert_eq!(a.len(), 32);
        assert!(a.iter().all(|a| (-16.0..-1.0).contains(a)), "{a:?}");
        let dt = values("blk.0.ssm_dt.bias");
        let softplus = |x: f32| (1.0 + x.exp()).ln();
        assert!(
            dt.iter().all(|&b| (0.00099..0.1001).contains(&softplus(b))),
            "{dt:?}"
        );
        let d = values("blk.0.ssm_d");
        assert!(d.iter().all(|d| (0.9..1.1).contains(d)), "{d:?}");
    }

    #[test]
    fn random_blocks_have_the_requested_spread() {
        for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4_0] {
            let n = 256 * 64;
            let mut rng = Rng::stream(1, "t", 0);
            let bytes = random_blocks(ty, n, 0.05, &mut rng).unwrap();
            let mut x = vec![0f32; n];
            les_core::quant::dequantize(ty, &bytes, &mut x).unwrap();
            let mean = x.iter().sum::<f32>() / n as f32;
            let std = (x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32).sqrt();
            assert!(mean.abs() < 0.001, "{ty}: mean {mean}");
            assert!((std / 0.05 - 1.0).abs() < 0.15, "{ty}: std {std}");
        }
    }
}
