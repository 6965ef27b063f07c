//! Scaffolding shared by the forward-pass tests (`forward_exact`, `qwen35_forward`,
//! `mla_forward`):
//! a deterministic generator, matrices kept both quantized and as the f32 values
//! they stand for, a packed expert image as an [`ExpertSource`], and the streamed
//! run (scheduler over a simulated device with shuffled completions and transient
//! faults) whose logits must equal the resident run's bit for bit.
#![allow(dead_code)] // Each test binary uses its own subset.

use les_core::blockdev::sim::{CompletionOrder, Fault, SimConfig, SimDevice};
use les_core::blockdev::ReadRequest;
use les_core::gemv::{GemvError, Isa, MatrixView};
use les_core::layout;
use les_core::model::config::{Hparams, HybridParams};
use les_core::model::experts::{ExpertFormat, Resident, Streamed};
use les_core::model::forward::{
    forward_batch_at, forward_hybrid_at, BatchScratch, ExpertMatrices, Experts, Handout, KvCache,
    Lookahead, MatVec, Place, RecurrentState, Residency, Scratch, SerialMatVec, Step, TokenInput,
    Weights,
};
use les_core::model::ops::{self, AttnShape, KvView};
use les_core::quant::blocks::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use les_core::quant::{self, GgmlType};
use les_core::schedule::{
    ExpertSource, Extent, Extents, LayerState, Scheduler, SchedulerConfig, Stats,
};
use les_core::slots::{ExpertKey, IndexEntry, Slot};

/// SplitMix64: deterministic test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Roughly normal (a sum of four uniforms, centred): good enough, deterministic.
    pub fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.uniform()).sum::<f32>() - 2.0
    }

    /// `n` values `offset + scale * normal()`.
    pub fn vec(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|_| offset + scale * self.normal()).collect()
    }
}

/// A matrix both as f32 (for the reference) and in its storage type.
pub struct Mat {
    /// The dequantized values: what the file holds, which the reference uses.
    pub f32: Vec<f32>,
    pub bytes: Vec<u8>,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

impl Mat {
    pub fn new(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize, scale: f32) -> Mat {
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * scale).collect();
        let mut bytes = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
        quant::quantize(ty, &x, &mut bytes).unwrap();
        let mut f = vec![0f32; rows * cols];
        quant::dequantize(ty, &bytes, &mut f).unwrap();
        Mat {
            f32: f,
            bytes,
            ty,
            rows,
            cols,
        }
    }

    pub fn view(&self) -> MatrixView<'_> {
        MatrixView::new(self.ty, self.rows, self.cols, &self.bytes).unwrap()
    }

    /// `self * x` in f64, rounded once.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        (0..self.rows)
            .map(|r| {
                (0..self.cols)
                    .map(|c| self.f32[r * self.cols + c] as f64 * x[c] as f64)
                    .sum::<f64>() as f32
            })
            .collect()
    }
}

/// Experts packed into one image: `offsets[layer][expert]` is where each starts,
/// all of layout `format`.
pub struct PackedExperts<'a> {
    pub image: &'a [u8],
    pub offsets: &'a [Vec<usize>],
    pub format: ExpertFormat,
    /// Extents an expert: 1 (packed), 3 (gate, up, down, as in a plain GGUF) or
    /// 2 (gate and up, then down, checksummed: the scheduler may hand the halves
    /// out apart, see [`SchedulerConfig::split_compute`]).
    pub parts: usize,
}

impl<'a> PackedExperts<'a> {
    /// The bytes of layer `l`'s expert `e`.
    pub fn bytes(&self, l: usize, e: u16) -> &'a [u8] {
        let off = self.offsets[l][e as usize];
        &self.image[off..off + self.format.bytes().unwrap()]
    }
}

impl ExpertSource for PackedExperts<'_> {
    fn extents(&self, key: ExpertKey) -> Extents {
        let off = self.offsets[key.layer as usize][key.expert as usize] as u64;
        let [g, u, d] = self.format.part_bytes().unwrap();
        let lens: &[usize] = match self.parts {
            3 => &[g, u, d],
            2 => &[g + u, d],
            _ => &[g + u + d],
        };
        let mut ext = Extents::new();
        let mut at = 0u32;
        // An ungated expert has no gate bytes: no extent for them.
        for &p in lens.iter().filter(|&&p| p > 0) {
            ext.push(Extent {
                offset: off + at as u64,
                len: p as u32,
                slot_offset: at,
            })
            .unwrap();
            at += p as u32;
        }
        ext
    }

    fn checksum(&self, key: ExpertKey) -> Option<u32> {
        (self.parts == 2).then(|| layout::checksum(self.bytes(key.layer as usize, key.expert)))
    }

    fn gate_up_bytes(&self, key: ExpertKey) -> Option<u32> {
        let _ = key;
        (self.parts == 2).then(|| self.format.gate_up_bytes().unwrap() as u32)
    }
}

/// Counts the [`Step::Pending`] answers of the experts it wraps: the times the
/// forward pass could compute the shared expert while reads were in flight.
pub struct CountPending<X> {
    pub inner: X,
    pub pending: usize,
    /// Experts handed out in halves ([`Step::GateUp`]).
    pub halves: usize,
    /// Calls naming a layer's own picks to `prefetch_known` after its
    /// router's logits but before the layer began (a batch routed before its
    /// attention).
    pub named_before_compute: usize,
    /// The layer of the last router logits seen, and whether it has begun
    /// since ([`Experts::begin_layer`]).
    routed: Option<(usize, bool)>,
}

impl<X> CountPending<X> {
    pub fn new(inner: X) -> Self {
        CountPending {
            inner,
            pending: 0,
            halves: 0,
            named_before_compute: 0,
            routed: None,
        }
    }
}

impl<X: Experts> Experts for CountPending<X> {
    type Error = X::Error;
    fn begin_token(&mut self) {
        self.inner.begin_token()
    }
    fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), X::Error> {
        if let Some((_, begun)) = &mut self.routed {
            *begun = true;
        }
        self.inner.begin_layer(layer, routing)
    }
    fn max_picks(&self, layer: usize) -> usize {
        self.inner.max_picks(layer)
    }
    fn router_logits(&mut self, layer: usize, logits: &[f32]) {
        self.routed = Some((layer, false));
        self.inner.router_logits(layer, logits)
    }
    fn wants_predictions(&self) -> bool {
        self.inner.wants_predictions()
    }
    fn prefetch(&mut self, layer: usize, predicted: &[u16]) -> Result<(), X::Error> {
        self.inner.prefetch(layer, predicted)
    }
    fn prefetch_known(&mut self, layer: usize, experts: &[u16]) -> Result<(), X::Error> {
        if self.routed == Some((layer, false)) {
            self.named_before_compute += 1;
        }
        self.inner.prefetch_known(layer, experts)
    }
    fn residency(&self, layer: usize, expert: u16) -> Residency {
        self.inner.residency(layer, expert)
    }
    fn next(&mut self) -> Result<Option<Handout<'_>>, X::Error> {
        self.inner.next()
    }
    fn try_next(&mut self) -> Result<Step<'_>, X::Error> {
        let step = self.inner.try_next()?;
        self.pending += matches!(step, Step::Pending) as usize;
        Ok(step)
    }
    fn next_part(&mut self, block: bool) -> Result<Step<'_>, X::Error> {
        let step = self.inner.next_part(block)?;
        self.pending += matches!(step, Step::Pending) as usize;
        self.halves += matches!(step, Step::GateUp(_)) as usize;
        Ok(step)
    }
    fn finish(&mut self, index: usize, checksum: Option<u32>) -> Result<(), X::Error> {
        self.inner.finish(index, checksum)
    }
}

/// A decode of a test's token sequence over some experts.
pub trait Decode {
    /// Each position's logits.
    fn decode<X: Experts>(
        &mut self,
        experts: &mut X,
        lookahead: Option<&Lookahead>,
    ) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug;
}

/// How one streamed run is set up.
pub struct StreamedRun<'a> {
    pub experts: &'a PackedExperts<'a>,
    pub n_layers: usize,
    pub n_experts: usize,
    pub slots: usize,
    /// Pass the lookahead's predictions to the scheduler.
    pub predict: bool,
    /// Picks the completion order (timed or shuffled by it), whether the device
    /// honours cancels, and which reads fail transiently (one in ten).
    pub seed: u64,
    pub config: SchedulerConfig,
    pub lookahead: Lookahead,
}

/// What a streamed run produced.
pub struct StreamedOutput {
    pub logits: Vec<Vec<f32>>,
    pub stats: Stats,
    pub layers: Vec<LayerState>,
    /// [`Step::Pending`] answers (see [`CountPending`]).
    pub pending: usize,
    /// Experts handed out in halves.
    pub halves: usize,
    /// See [`CountPending::named_before_compute`].
    pub named_before_compute: usize,
}

impl StreamedRun<'_> {
    /// Decodes with the experts streamed through the scheduler from a simulated
    /// device holding the packed image.
    pub fn run(&self, d: &mut impl Decode) -> StreamedOutput {
        let fmt = self.experts.format;
        let slot_bytes = fmt.bytes().unwrap();
        let mut mem = vec![0u8; self.slots * slot_bytes];
        let seed = self.seed;
        let sim = SimConfig {
            order: if seed.is_multiple_of(3) {
                CompletionOrder::Timed
            } else {
                CompletionOrder::Shuffled { seed }
            },
            honor_cancel: seed.is_multiple_of(2),
            ..SimConfig::default()
        };
        let mut fault_rng = Rng(seed);
        let mut dev: SimDevice<_, 8> = SimDevice::new(
            self.experts.image,
            &mut mem,
            slot_bytes,
            sim,
            |_: &ReadRequest| {
                if fault_rng.next().is_multiple_of(10) {
                    Fault::Transient
                } else {
                    Fault::None
                }
            },
        );
        let scheduler = Scheduler::new(
            SchedulerConfig {
                max_retries: 40,
                ..self.config
            },
            vec![Slot::EMPTY; self.slots],
            vec![IndexEntry::EMPTY; self.n_layers * self.n_experts],
            vec![LayerState::INITIAL; self.n_layers],
            self.n_layers as u16,
            self.n_experts as u16,
            slot_bytes as u32,
        )
        .unwrap();
        let mut ex = CountPending::new(Streamed {
            scheduler,
            device: &mut dev,
            source: self.experts,
            format: |_| fmt,
            predict: self.predict,
        });
        let logits = d.decode(&mut ex, Some(&self.lookahead));
        StreamedOutput {
            logits,
            stats: ex.inner.scheduler.stats(),
            layers: ex.inner.scheduler.layers().to_vec(),
            pending: ex.pending,
            halves: ex.halves,
            named_before_compute: ex.named_before_compute,
        }
    }
}

/// Asserts that two runs' logits are the same bits.
pub fn assert_bits_eq(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (t, (x, y)) in a.iter().zip(b).enumerate() {
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert_eq!(
                p.to_bits(),
                q.to_bits(),
                "{what}: token {t} logit {i}: {p} vs {q}"
            );
        }
    }
}

/// The activation buffers of [`SerialMatVec`] for the tests' widths (at most 256).
pub struct QuantScratch {
    q8_0: Vec<BlockQ8_0>,
    q8_1: Vec<BlockQ8_1>,
    q8k: Vec<BlockQ8K>,
}

impl QuantScratch {
    pub fn new() -> QuantScratch {
        let q8_0 = BlockQ8_0 {
            d: [0; 2],
            qs: [0; 32],
        };
        let q8_1 = BlockQ8_1 {
            d: [0; 2],
            s: [0; 2],
            qs: [0; 32],
        };
        let q8k = BlockQ8K {
            d: [0; 4],
            qs: [0; 256],
            bsums: [[0; 2]; 16],
        };
        QuantScratch {
            q8_0: vec![q8_0; 8],
            q8_1: vec![q8_1; 8],
            q8k: vec![q8k; 1],
        }
    }

    /// The serial kernels over these buffers, with the CPU's best instructions.
    pub fn matvec(&mut self) -> SerialMatVec<'_> {
        SerialMatVec {
            isa: Isa::detect(),
            q8_0: &mut self.q8_0,
            q8_1: &mut self.q8_1,
            q8k: &mut self.q8k,
        }
    }
}

/// A [`MatVec`] whose prompt attention takes the positions in groups of
/// `.1` through [`ops::attention_causal`] (the serial one takes them one at a
/// time) and whose recurrent layers take their heads last to first, so a
/// batch's logits check the grouped attention and the heads' independence
/// too.
pub struct Grouped<M>(pub M, pub usize);

impl<M: MatVec> MatVec for Grouped<M> {
    fn matvec(
        &mut self,
        w: &MatrixView<'_>,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), les_core::gemv::GemvError> {
        self.0.matvec(w, x, y)
    }

    fn attention(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        self.0.attention(shape, q, kv, scores, out);
    }

    fn attention_causal(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        first: usize,
        _: &mut [f32],
        out: &mut [f32],
    ) {
        let span = self.1 * shape.n_head * shape.head_dim;
        for (c, (qc, oc)) in q.chunks(span).zip(out.chunks_mut(span)).enumerate() {
            let from = first + c * self.1;
            let g = qc.len() / (shape.n_head * shape.head_dim);
            let cut = KvView {
                positions: from + g,
                ..kv
            };
            let mut scratch = vec![0f32; ops::attention_causal_scratch(shape, g, from + g)];
            ops::attention_causal(Isa::detect(), shape, qc, cut, from, &mut scratch, oc);
        }
    }
    /// The heads last to first: a head's result must not depend on the
    /// others' (as when threads take them).
    fn for_heads(
        &mut self,
        n: usize,
        state: &mut [f32],
        out: &mut [f32],
        f: &les_core::model::forward::HeadFn<'_>,
    ) {
        let (sl, ol) = (state.len() / n, out.len() / n);
        for h in (0..n).rev() {
            f(h, &mut state[h * sl..][..sl], &mut out[h * ol..][..ol]);
        }
    }
}

/// A test model: weights and the hyperparameters they go with.
pub trait TestModel: Weights {
    fn hp(&self) -> &Hparams;
    fn hy(&self) -> &HybridParams;
}

/// A test model whose routed experts are one packed image.
pub trait PackedModel: TestModel {
    fn packed(&self) -> PackedExperts<'_>;
}

/// How [`resident_experts`] finds an expert's matrices.
pub type Lookup<'m> = dyn Fn(usize, u16) -> Result<ExpertMatrices<'m>, GemvError> + 'm;

/// Every expert of `m` resident, read from its packed image.
pub fn resident_experts<M: PackedModel>(m: &M) -> Resident<'_, Box<Lookup<'_>>> {
    let p = m.packed();
    Resident::new(Box::new(move |l, e| p.format.matrices(p.bytes(l, e))))
}

/// Decodes `.1` from position 0 in fresh buffers of `.0`: a [`Decode`] for
/// [`StreamedRun::run`].
pub struct SeqDecoder<'m, M>(pub &'m M, pub &'m [u32]);

impl<M: TestModel> Decode for SeqDecoder<'_, M> {
    fn decode<X: Experts>(
        &mut self,
        experts: &mut X,
        lookahead: Option<&Lookahead>,
    ) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        SeqBuffers::new(self.0, self.1.len()).run(self.0, experts, lookahead, 0, self.1)
    }
}

/// Every buffer of one sequence of up to `max` positions of a hybrid model:
/// KV cache, recurrent state, scratch, activations (`qwen35_forward`,
/// `mla_forward`).
pub struct SeqBuffers {
    pub kv_k: Vec<f32>,
    pub kv_v: Vec<f32>,
    pub conv: Vec<f32>,
    pub ssm: Vec<f32>,
    pub scratch: Vec<f32>,
    pub quant: QuantScratch,
    pub max: usize,
}

impl SeqBuffers {
    pub fn new(m: &impl TestModel, max: usize) -> SeqBuffers {
        let (hp, hy) = (m.hp(), m.hy());
        let (c, s) = RecurrentState::len(hy);
        SeqBuffers {
            kv_k: vec![0.0; KvCache::len_for(hp, hy, max)],
            kv_v: vec![0.0; KvCache::len_for(hp, hy, max)],
            conv: vec![0.0; c],
            ssm: vec![0.0; s],
            scratch: vec![0.0; Scratch::len_for(hp, hy, max)],
            quant: QuantScratch::new(),
            max,
        }
    }

    /// `tokens` at positions `start..`, one at a time: each position's logits.
    pub fn run<X: Experts>(
        &mut self,
        m: &impl TestModel,
        experts: &mut X,
        lookahead: Option<&Lookahead>,
        start: usize,
        tokens: &[u32],
    ) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        let inputs: Vec<TokenInput<'_>> = tokens.iter().map(|&t| TokenInput::Token(t)).collect();
        let places: Vec<Place> = (start..start + tokens.len()).map(Place::text).collect();
        self.run_placed(m, experts, lookahead, &inputs, &places)
    }

    /// `tokens` at positions `start..` in one `forward_batch`, the attention
    /// grouped by two: the last position's logits, or with `every` each
    /// position's.
    pub fn run_batch<X: Experts>(
        &mut self,
        m: &impl TestModel,
        experts: &mut X,
        start: usize,
        tokens: &[u32],
        every: bool,
    ) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        let inputs: Vec<TokenInput<'_>> = tokens.iter().map(|&t| TokenInput::Token(t)).collect();
        self.run_batch_at(m, experts, start, &inputs, None, every)
    }
}

impl SeqBuffers {
    /// `inputs` at `places`, one at a time ([`forward_hybrid_at`]): each
    /// position's logits.
    pub fn run_at<X: Experts>(
        &mut self,
        m: &impl TestModel,
        experts: &mut X,
        inputs: &[TokenInput<'_>],
        places: &[Place],
    ) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        self.run_placed(m, experts, None, inputs, places)
    }

    /// [`run_at`](Self::run_at) with `lookahead`.
    pub fn run_placed<X: Experts>(
        &mut self,
        m: &impl TestModel,
        experts: &mut X,
        lookahead: Option<&Lookahead>,
        inputs: &[TokenInput<'_>],
        places: &[Place],
    ) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        let (hp, hy) = (m.hp(), m.hy());
        let mut kv = KvCache::new_for(hp, hy, &mut self.kv_k, &mut self.kv_v, self.max).unwrap();
        let mut rs = RecurrentState::new(hy, &mut self.conv, &mut self.ssm).unwrap();
        let mut s = Scratch::new_for(hp, hy, &mut self.scratch, self.max).unwrap();
        let mut mv = self.quant.matvec();
        let mut out = Vec::new();
        for (input, at) in inputs.iter().zip(places) {
            let mut logits = vec![0f32; hp.n_vocab];
            forward_hybrid_at(
                hp,
                hy,
                m,
                &mut mv,
                experts,
                lookahead,
                *input,
                *at,
                &mut kv,
                &mut rs,
                &mut s,
                &mut logits,
            )
            .unwrap();
            out.push(logits);
        }
        out
    }

    /// `inputs` at cache positions `start..` with M-RoPE positions `rope`
    /// (`None`: text positions), in one [`forward_batch_at`] (attention
    /// grouped by two): the last position's logits, or with `every` each
    /// position's.
    pub fn run_batch_at<X: Experts>(
        &mut self,
        m: &impl TestModel,
        experts: &mut X,
        start: usize,
        inputs: &[TokenInput<'_>],
        rope: Option<&[[u32; 4]]>,
        every: bool,
    ) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        let (hp, hy) = (m.hp(), m.hy());
        let n = inputs.len();
        let mut kv = KvCache::new_for(hp, hy, &mut self.kv_k, &mut self.kv_v, self.max).unwrap();
        let mut rs = RecurrentState::new(hy, &mut self.conv, &mut self.ssm).unwrap();
        let mut s = Scratch::new_for(hp, hy, &mut self.scratch, self.max).unwrap();
        let mut floats = vec![0f32; BatchScratch::floats(hp, hy, n)];
        let mut ids = vec![0u16; BatchScratch::ids(hp, hy, n)];
        let mut b = BatchScratch::new(hp, hy, n, &mut floats, &mut ids).unwrap();
        let mut mv = Grouped(self.quant.matvec(), 2);
        let mut logits = vec![0f32; hp.n_vocab * if every { n } else { 1 }];
        forward_batch_at(
            hp,
            hy,
            m,
            &mut mv,
            experts,
            inputs,
            start,
            rope,
            &mut kv,
            &mut rs,
            &mut s,
            &mut b,
            &mut logits,
        )
        .unwrap();
        logits
            .chunks_exact(hp.n_vocab)
            .map(<[f32]>::to_vec)
            .collect()
    }
}

/// Asserts that each position's logits in `got` are within `rel` times the
/// largest magnitude of the reference's (at least 1) of those in `want`.
pub fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (t, (g, w)) in got.iter().zip(want).enumerate() {
        let err = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let scale = w.iter().map(|v| v.abs()).fold(0f32, f32::max);
        assert!(
            err <= rel * scale.max(1.0),
            "{what}: token {t}: max error {err} (scale {scale})"
        );
    }
}
