//! Perplexity and KL divergence over a text (`les perplexity`), computed as
//! llama.cpp's `llama-perplexity` computes them, with its file of base
//! log-probabilities, so the numbers and the files of the two tools compare.
//!
//! The text is cut into chunks of `n_ctx` tokens, each evaluated from position
//! 0 (its first token replaced by BOS where the model adds one); the second
//! half of each chunk is scored: position `j` (from `n_ctx / 2` to
//! `n_ctx - 2`) predicts token `j + 1`. The perplexity is `exp` of the mean
//! negative log-likelihood.
//!
//! A base file ([`BaseWriter`], [`BaseReader`]) holds the tokens and, for
//! every scored position, the base model's log-probabilities of every token,
//! 16 bits each: `"_logits_"`, then `n_ctx`, `n_vocab`, `n_chunk` (i32 LE),
//! the `n_chunk * n_ctx` tokens (i32 LE), then for each scored position
//! `2 * ((n_vocab + 1) / 2) + 4` u16s: the scale and the smallest
//! log-probability kept (two f32), then `round((logit - min_logit) / scale)`
//! per token, where `min_logit` is at least the largest logit less 16.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::interrupt::TempFile;

/// The magic bytes a base file starts with.
pub const BASE_MAGIC: &[u8; 8] = b"_logits_";

/// Most positions of a chunk a base file may declare (a bound before any
/// allocation; llama.cpp's contexts are far shorter).
pub const MAX_BASE_CTX: usize = 1 << 20;

/// `-log p(tok)` under `logits`, rounded as llama.cpp rounds it: the maximum
/// and the differences in f32, the sum of the exponentials in f64.
pub fn nll(logits: &[f32], tok: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    -(f64::from(logits[tok as usize] - max) - sum.ln())
}

/// The mean of `sum / count` and its standard error from `sum2`
/// (llama.cpp's `mean_and_uncertainty`: zero below 11 values).
pub fn mean_and_uncertainty(sum: f64, sum2: f64, count: usize) -> (f64, f64) {
    if count == 0 {
        return (0.0, 0.0);
    }
    let n = count as f64;
    let f = sum / n;
    let df = sum2 / n - f * f;
    let df = if df > 0.0 && count > 10 {
        (df / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    (f, df)
}

/// The negative log-likelihoods scored so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Perplexity {
    /// Their sum.
    pub nll: f64,
    /// The sum of their squares.
    pub nll2: f64,
    /// How many.
    pub count: usize,
}

impl Perplexity {
    /// Adds one position's negative log-likelihood.
    pub fn add(&mut self, nll: f64) {
        self.nll += nll;
        self.nll2 += nll * nll;
        self.count += 1;
    }

    /// `exp` of the mean (NaN before any position).
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// The perplexity's standard error (llama.cpp's "+/-"), if the spread is
    /// positive.
    pub fn uncertainty(&self) -> Option<f64> {
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        (var > 0.0 && self.count > 1).then(|| (var / (n - 1.0)).sqrt() * self.ppl())
    }
}

/// The u16s of one scored position in a base file.
pub fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// Encodes `logits` as a base-file row into `row` ([`row_len`] long) and
/// returns `-log p(tok)` (llama.cpp's rounding).
pub fn encode_row(logits: &[f32], tok: u32, row: &mut [u16]) -> f64 {
    let mut max = logits[0];
    let mut min = logits[0];
    for &l in &logits[1..] {
        max = max.max(l);
        min = min.min(l);
    }
    let min = min.max(max - 16.0);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    let log_sum = sum.ln() as f32;
    let min_log_prob = min - max - log_sum;
    let scale = (max - min) / 65535.0;
    row[..2].copy_from_slice(&u16_pair(scale));
    row[2..4].copy_from_slice(&u16_pair(min_log_prob));
    let out = &mut row[4..4 + logits.len()];
    if scale != 0.0 {
        let inv = 1.0 / scale;
        for (o, &l) in out.iter_mut().zip(logits) {
            // Rounded half to even, as the float trick llama.cpp uses.
            *o = if l > min {
                (inv * (l - min)).round_ties_even() as u16
            } else {
                0
            };
        }
    } else {
        out.fill(0);
    }
    row[4 + logits.len()..].fill(0);
    f64::from(max + log_sum - logits[tok as usize])
}

fn u16_pair(v: f32) -> [u16; 2] {
    let b = v.to_le_bytes();
    [
        u16::from_le_bytes([b[0], b[1]]),
        u16::from_le_bytes([b[2], b[3]]),
    ]
}

fn f32_of(pair: &[u16]) -> f32 {
    let (a, b) = (pair[0].to_le_bytes(), pair[1].to_le_bytes());
    f32::from_le_bytes([a[0], a[1], b[0], b[1]])
}

/// Writes a base file as the chunks are scored, under a temporary name next
/// to it that becomes its name at [`finish`](BaseWriter::finish) (removed if
/// the run fails or is interrupted: no partial file is left).
pub struct BaseWriter {
    out: BufWriter<File>,
    tmp: TempFile,
    path: PathBuf,
    row: Vec<u16>,
    bytes: Vec<u8>,
}

impl BaseWriter {
    /// Starts `path` with the header and the `tokens` of the chunks
    /// (`n_chunk * n_ctx` of them).
    pub fn create(
        path: &Path,
        n_ctx: usize,
        n_vocab: usize,
        tokens: &[u32],
    ) -> Result<BaseWriter, String> {
        let err = |e: std::io::Error| format!("{}: {e}", path.display());
        let n_chunk = tokens.len() / n_ctx.max(1);
        let (Ok(c), Ok(v), Ok(k)) = (
            i32::try_from(n_ctx),
            i32::try_from(n_vocab),
            i32::try_from(n_chunk),
        ) else {
            return Err(format!("{}: too large for the format", path.display()));
        };
        let (tmp, file) = TempFile::beside(path, "base").map_err(err)?;
        let mut out = BufWriter::new(file);
        out.write_all(BASE_MAGIC).map_err(err)?;
        for v in [c, v, k] {
            out.write_all(&v.to_le_bytes()).map_err(err)?;
        }
        for &t in tokens {
            out.write_all(&(t as i32).to_le_bytes()).map_err(err)?;
        }
        Ok(BaseWriter {
            out,
            tmp,
            path: path.to_path_buf(),
            row: vec![0; row_len(n_vocab)],
            bytes: Vec::with_capacity(2 * row_len(n_vocab)),
        })
    }

    /// Writes one scored position; returns `-log p(tok)`.
    pub fn push(&mut self, logits: &[f32], tok: u32) -> Result<f64, String> {
        let nll = encode_row(logits, tok, &mut self.row);
        self.bytes.clear();
        self.bytes
            .extend(self.row.iter().flat_map(|v| v.to_le_bytes()));
        self.out
            .write_all(&self.bytes)
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        Ok(nll)
    }

    /// Flushes the file and gives it its name.
    pub fn finish(self) -> Result<(), String> {
        let err = |e: std::io::Error| format!("{}: {e}", self.path.display());
        let file = self.out.into_inner().map_err(|e| err(e.into_error()))?;
        file.sync_all().map_err(err)?;
        self.tmp.commit(&self.path).map_err(err)
    }
}

/// A base file opened for comparison: its header and tokens read and checked,
/// its rows read chunk by chunk.
pub struct BaseReader<R = BufReader<File>> {
    input: R,
    name: String,
    /// Positions of a chunk.
    pub n_ctx: usize,
    /// Chunks.
    pub n_chunk: usize,
    /// The chunks' tokens, `n_chunk * n_ctx`.
    pub tokens: Vec<u32>,
    n_vocab: usize,
    bytes: Vec<u8>,
}

impl BaseReader {
    /// Opens `path`, made for a model of `n_vocab` tokens (see
    /// [`from_reader`](BaseReader::from_reader)).
    pub fn open(path: &Path, n_vocab: usize) -> Result<BaseReader, String> {
        let name = path.display().to_string();
        let file = File::open(path).map_err(|e| format!("{name}: {e}"))?;
        let len = file.metadata().map_err(|e| format!("{name}: {e}"))?.len();
        BaseReader::from_reader(BufReader::new(file), len, &name, n_vocab)
    }
}

impl<R: Read> BaseReader<R> {
    /// Reads the header and tokens of a base file of `len` bytes from `input`
    /// (named `name` in errors), made for a model of `n_vocab` tokens. Its
    /// size must be exactly what its header declares, so nothing is
    /// allocated for counts the file does not hold.
    pub fn from_reader(
        mut input: R,
        len: u64,
        name: &str,
        n_vocab: usize,
    ) -> Result<BaseReader<R>, String> {
        let mut head = [0u8; 20];
        if input.read_exact(&mut head).is_err() || &head[..8] != BASE_MAGIC {
            return Err(format!(
                "{name} is not a file of base log-probabilities (llama-perplexity's \
                 --kl-divergence-base or les perplexity's)"
            ));
        }
        let field = |i: usize| {
            let b = [
                head[8 + 4 * i],
                head[9 + 4 * i],
                head[10 + 4 * i],
                head[11 + 4 * i],
            ];
            i32::from_le_bytes(b)
        };
        let (n_ctx, file_vocab, n_chunk) = (field(0), field(1), field(2));
        if !(2..=MAX_BASE_CTX as i32).contains(&n_ctx) || n_chunk < 1 || file_vocab < 1 {
            return Err(format!(
                "{name}: a context of {n_ctx} positions in {n_chunk} chunks of a vocabulary of \
                 {file_vocab} tokens is not a valid base file"
            ));
        }
        if file_vocab as usize != n_vocab {
            return Err(format!(
                "{name} was made with a vocabulary of {file_vocab} tokens, the model has {n_vocab}"
            ));
        }
        let (n_ctx, n_chunk) = (n_ctx as usize, n_chunk as usize);
        let rows = n_ctx - 1 - n_ctx / 2;
        let want = (n_chunk as u128) * (n_ctx as u128) * 4
            + (n_chunk as u128) * (rows as u128) * (row_len(n_vocab) as u128) * 2
            + 20;
        if u128::from(len) != want {
            return Err(format!(
                "{name} is {len} bytes; its header ({n_chunk} chunks of {n_ctx} positions, \
                 {n_vocab} tokens) needs {want}: truncated or not a base file"
            ));
        }
        let mut raw = vec![0u8; n_chunk * n_ctx * 4];
        input
            .read_exact(&mut raw)
            .map_err(|e| format!("{name}: {e}"))?;
        let tokens = raw
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .map(|t| u32::try_from(t).ok().filter(|&t| (t as usize) < n_vocab))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| format!("{name} holds a token outside the vocabulary"))?;
        Ok(BaseReader {
            input,
            name: name.to_string(),
            n_ctx,
            n_chunk,
            tokens,
            n_vocab,
            bytes: Vec::new(),
        })
    }

    /// Reads the next chunk's rows into `rows` (`n_ctx - 1 - n_ctx / 2` rows
    /// of [`row_len`] u16s).
    pub fn next_chunk(&mut self, rows: &mut Vec<u16>) -> Result<(), String> {
        let n = (self.n_ctx - 1 - self.n_ctx / 2) * row_len(self.n_vocab);
        self.bytes.resize(2 * n, 0);
        self.input
            .read_exact(&mut self.bytes)
            .map_err(|e| format!("{}: {e}", self.name))?;
        rows.clear();
        rows.extend(
            self.bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]])),
        );
        Ok(())
    }
}

/// The comparison of a model's distributions with a base file's, position by
/// position (llama.cpp's `kl_divergence_result`).
#[derive(Clone, Debug, Default)]
pub struct KlDivergence {
    sum_nll: f64,
    sum_nll2: f64,
    sum_nll_base: f64,
    sum_nll_base2: f64,
    sum_nll_nll_base: f64,
    sum_kld: f64,
    sum_kld2: f64,
    sum_p_diff: f64,
    sum_p_diff2: f64,
    sum_p_diff4: f64,
    max_p_diff: f32,
    n_same_top: usize,
    count: usize,
    /// Each position's divergence, for the percentiles.
    pub klds: Vec<f32>,
    /// Each position's change of the right token's probability.
    pub p_diffs: Vec<f32>,
}

impl KlDivergence {
    /// Compares `logits` with the base `row` at a position whose next token
    /// is `tok`.
    pub fn add(&mut self, logits: &[f32], row: &[u16], tok: u32) {
        let (mut max, mut imax) = (logits[0], 0);
        for (i, &l) in logits.iter().enumerate().skip(1) {
            if l > max {
                (max, imax) = (l, i);
            }
        }
        let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let log_sum = sum.ln() as f32;
        let (scale, min_log_prob) = (f32_of(&row[..2]), f32_of(&row[2..4]));
        let base = &row[4..4 + logits.len()];
        let nll = max + log_sum - logits[tok as usize];
        let nll_base = -(scale * f32::from(base[tok as usize]) + min_log_prob);
        let (nll, nll_base64) = (f64::from(nll), f64::from(nll_base));
        self.sum_nll += nll;
        self.sum_nll2 += nll * nll;
        self.sum_nll_base += nll_base64;
        self.sum_nll_base2 += nll_base64 * nll_base64;
        self.sum_nll_nll_base += nll * nll_base64;
        let log_norm = max + log_sum;
        let (mut kld, mut imax_base, mut best) = (0f64, 0, f32::NEG_INFINITY);
        for (i, (&b, &l)) in base.iter().zip(logits).enumerate() {
            let p_log_base = scale * f32::from(b) + min_log_prob;
            if i == 0 || p_log_base > best {
                (best, imax_base) = (p_log_base, i);
            }
            if p_log_base > -16.0 {
                kld += f64::from(p_log_base.exp() * (p_log_base - l + log_norm));
            }
        }
        self.sum_kld += kld;
        self.sum_kld2 += kld * kld;
        self.count += 1;
        self.n_same_top += usize::from(imax == imax_base);
        let p_diff = (-nll as f32).exp() - (-nll_base).exp();
        let d2 = f64::from(p_diff) * f64::from(p_diff);
        self.sum_p_diff += f64::from(p_diff);
        self.sum_p_diff2 += d2;
        self.sum_p_diff4 += d2 * d2;
        self.max_p_diff = self.max_p_diff.max(p_diff.abs());
        self.klds.push(kld as f32);
        self.p_diffs.push(p_diff);
    }

    /// Positions compared.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The largest change of the right token's probability.
    pub fn max_p_diff(&self) -> f32 {
        self.max_p_diff
    }

    /// `ln` of the model's perplexity and its uncertainty.
    pub fn log_ppl(&self) -> (f64, f64) {
        mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)
    }

    /// `ln` of the base's perplexity and its uncertainty.
    pub fn log_ppl_base(&self) -> (f64, f64) {
        mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)
    }

    /// The covariance of the two mean log-likelihoods (0 below 10 positions).
    pub fn log_ppl_cov(&self) -> f64 {
        if self.count < 10 {
            return 0.0;
        }
        let n = self.count as f64;
        (self.sum_nll_nll_base / n - (self.sum_nll / n) * (self.sum_nll_base / n)) / (n - 1.0)
    }

    /// `ln(PPL / PPL(base))` and its uncertainty (the two correlated).
    pub fn log_ppl_ratio(&self) -> (f64, f64) {
        let (a, da) = self.log_ppl();
        let (b, db) = self.log_ppl_base();
        let cov = self.log_ppl_cov();
        (a - b, (da * da + db * db - 2.0 * cov).max(0.0).sqrt())
    }

    /// The mean change of the right token's probability and its uncertainty.
    pub fn p_diff(&self) -> (f64, f64) {
        mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count)
    }

    /// The mean divergence and its uncertainty.
    pub fn kld(&self) -> (f64, f64) {
        mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count)
    }

    /// The root mean square of the right token's probability change, and
    /// its uncertainty.
    pub fn p_diff_rms(&self) -> (f64, f64) {
        let (mse, dmse) = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count);
        let rms = mse.sqrt();
        (rms, if rms > 0.0 { 0.5 / rms * dmse } else { 0.0 })
    }

    /// The share of positions whose most likely token is the base's, and
    /// its uncertainty.
    pub fn same_top(&self) -> (f64, f64) {
        let p = self.n_same_top as f64 / self.count as f64;
        let n = self.count as f64;
        (p, (p * (1.0 - p) / (n - 1.0)).max(0.0).sqrt())
    }
}

/// The value at `fraction` of the sorted `values`, interpolated (llama.cpp's
/// percentile); 0 for none.
pub fn percentile(sorted: &[f32], fraction: f32) -> f32 {
    match sorted {
        [] => 0.0,
        _ if fraction <= 0.0 => sorted[0],
        _ if fraction >= 1.0 => sorted[sorted.len() - 1],
        _ => {
            let p = fraction * (sorted.len() - 1) as f32;
            let i = p as usize;
            let f = p - i as f32;
            (1.0 - f) * sorted[i] + f * sorted[(i + 1).min(sorted.len() - 1)]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 100.0 - 5.0)
            .collect()
    }

    #[test]
    fn nll_is_minus_log_softmax() {
        let l = logits(1000, 7);
        let z: f64 = l.iter().map(|&x| f64::from(x).exp()).sum();
        for tok in [0u32, 17, 999] {
            let want = -(f64::from(l[tok as usize]) - z.ln());
            assert!((nll(&l, tok) - want).abs() < 1e-5, "{tok}");
        }
    }

    #[test]
    fn a_row_keeps_log_probabilities_to_16_bits() {
        for n in [5, 1000, 1001] {
            let l = logits(n, 3);
            let mut row = vec![7u16; row_len(n)];
            let v = encode_row(&l, 4, &mut row);
            assert!((v - nll(&l, 4)).abs() < 1e-5);
            let (scale, min_lp) = (f32_of(&row[..2]), f32_of(&row[2..4]));
            let lse = l.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln() as f32;
            for (i, &x) in l.iter().enumerate() {
                let got = scale * f32::from(row[4 + i]) + min_lp;
                // Within half a step (10 / 65535 here), or clamped at 16 below the top.
                assert!(
                    (got - (x - lse)).abs() <= scale,
                    "{n} {i}: {got} vs {}",
                    x - lse
                );
            }
            assert!(row[4 + n..].iter().all(|&v| v == 0), "padding");
            // Against itself: no divergence, the same top token.
            let mut k = KlDivergence::default();
            k.add(&l, &row, 4);
            assert!(k.sum_kld.abs() < 1e-4, "{}", k.sum_kld);
            assert_eq!(k.n_same_top, 1);
            // Against another distribution: positive.
            let mut k2 = KlDivergence::default();
            k2.add(&logits(n, 99), &row, 4);
            assert!(k2.sum_kld > 0.1, "{}", k2.sum_kld);
        }
    }

    #[test]
    fn uniform_logits_give_the_vocabulary_size() {
        let l = vec![0.5f32; 64];
        let mut p = Perplexity::default();
        for t in 0..40 {
            p.add(nll(&l, t));
        }
        assert!((p.ppl() - 64.0).abs() < 1e-9);
        assert_eq!(p.uncertainty(), None, "no spread");
        let mut row = vec![0u16; row_len(64)];
        encode_row(&l, 0, &mut row);
        assert_eq!(f32_of(&row[..2]), 0.0, "flat logits: scale 0");
    }

    #[test]
    fn percentiles_interpolate() {
        let v = [1.0, 2.0, 3.0, 5.0];
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 5.0);
        assert_eq!(percentile(&v, 0.5), 2.5);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
