//! The forward pass on a tiny MoE model: its math against a plain f32 reference
//! written here, and offloaded (streamed through the scheduler from a simulated
//! device, any slot count, predictions on or off, any completion order) against
//! all-resident, bit for bit.

mod forward_common;

use forward_common::{
    assert_bits_eq, assert_close, Decode, Grouped, Mat, PackedExperts, QuantScratch, Rng,
    StreamedOutput, StreamedRun,
};
use les_core::gemv::MatrixView;
use les_core::model::config::ExpertAct;
use les_core::model::config::HybridParams;
use les_core::model::config::{
    AttnTemperature, AttnWindow, Hparams, MoeParams, Scales, SlidingWindow,
};
use les_core::model::experts::{ExpertFormat, Resident};
use les_core::model::forward::ExpertBiases;
use les_core::model::forward::{
    forward, forward_batch, forward_sequences, AttentionWeights, BatchScratch, Block, Experts, Ffn,
    KvBuf, KvCache, KvLayout, KvRing, Lookahead, Mixer, RecurrentState, Scratch, Sequence,
    SharedExpert, TokenInput, Weights,
};
use les_core::model::ops::{RopeStyle, Yarn};
use les_core::quant::GgmlType;
use les_core::router::{Gating, LayerMask, PredictorConfig};
use les_core::schedule::SchedulerConfig;

struct Layer {
    attn_norm: Vec<f32>,
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    dense: Option<[Mat; 3]>,
    router: Option<Mat>,
    /// The shared expert and its gate's row (none in the GLM variant).
    shared: Option<([Mat; 3], Option<Mat>)>,
    /// gpt-oss's extras, in the gpt-oss variant ([`build_oss`]).
    oss: Option<OssLayer>,
    /// The experts' selection bias, in the GLM variant ([`build_glm`]).
    selection_bias: Option<Vec<f32>>,
    /// Llama 4's attention, in the Llama 4 variant ([`build_llama4`]).
    llama4: Option<Llama4Layer>,
}

/// A Llama 4 layer's attention: chunked, or without RoPE (then with the
/// query's temperature, and without the Q/K norms the others have after RoPE).
struct Llama4Layer {
    chunk: Option<usize>,
    nope: Option<AttnTemperature>,
}

/// The Llama 4 variant's chunk: [`TOKENS`] cross a chunk's end.
const LLAMA4_CHUNK: usize = 4;
/// The Llama 4 variant's temperature, stepping every other position so that
/// [`TOKENS`] see it (Llama 4's steps every 8192).
const LLAMA4_TEMPERATURE: AttnTemperature = AttnTemperature {
    floor_scale: 2,
    scale: 0.1,
    offset: 1.0,
};

/// Which model family's parts a test model has.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Flavor {
    /// Softmax gating, renormalised; a sigmoid-gated shared expert.
    Plain,
    /// gpt-oss ([`build_oss`]).
    Oss,
    /// GLM-4.5 ([`build_glm`]).
    Glm,
    /// Llama 4 ([`build_llama4`]).
    Llama4,
    /// Granite ([`build_granite`]).
    Granite,
    /// SmallThinker ([`build_smallthinker`]).
    SmallThinker,
}

/// The Granite variant's multipliers (Granite 3's are 12, 0.22, 1/128 and
/// 8 or so; these move every part visibly at this size).
const GRANITE_SCALES: Scales = Scales {
    embedding: 3.0,
    residual: 0.5,
    attention: Some(0.2),
    logit: 4.0,
};

/// The GLM variant's expert weights scale (GLM-4.5's `routed_scaling_factor`).
const GLM_SCALE: f32 = 2.5;

/// What a gpt-oss layer adds: output bias, sinks, sliding window, router bias
/// and the experts' biases (`[gate, up, down]`, every expert's back to back).
struct OssLayer {
    bo: Vec<f32>,
    sinks: Vec<f32>,
    window: Option<usize>,
    router_bias: Vec<f32>,
    expert_bias: [Vec<f32>; 3],
}

/// The gpt-oss variant's YaRN (a large factor, so that the ramp and the
/// magnitude scale both matter at these positions).
const OSS_YARN: Yarn = Yarn {
    freq_scale: 1.0 / 32.0,
    ext_factor: 1.0,
    attn_factor: 1.0,
    beta_fast: 32.0,
    beta_slow: 1.0,
    n_ctx_orig: 4096,
};
/// The gpt-oss variant's window on its even layers: shorter than [`TOKENS`].
const OSS_WINDOW: usize = 3;

struct Model {
    hp: Hparams,
    embd: Mat,
    out_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
    /// experts[layer][expert] = [gate, up, down]
    experts: Vec<Vec<[Mat; 3]>>,
    /// Packed expert image and each expert's offset in it.
    image: Vec<u8>,
    offsets: Vec<Vec<usize>>,
    expert_ty: [GgmlType; 3],
}

fn norm_w(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect()
}

fn build(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3]) -> Model {
    build_with(seed, ty, expert_ty, Flavor::Plain)
}

/// The gpt-oss variant of [`build`]: biases, sinks, windows on even layers,
/// YaRN, a softmax over the picks' logits and the clamped SwiGLU.
fn build_oss(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3]) -> Model {
    build_with(seed, ty, expert_ty, Flavor::Oss)
}

/// The GLM-4.5 variant of [`build`]: sigmoid gating with a selection bias,
/// renormalised and scaled, an ungated shared expert.
fn build_glm(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3]) -> Model {
    build_with(seed, ty, expert_ty, Flavor::Glm)
}

/// The Llama 4 variant of [`build`]: sigmoid gating ranked by logit, the
/// weights scaling the experts' inputs, chunked layers with Q/K norms after
/// RoPE around a NoPE layer with a temperature, an ungated shared expert.
fn build_llama4(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3]) -> Model {
    build_with(seed, ty, expert_ty, Flavor::Llama4)
}

/// The Granite variant of [`build`]: the embedding, the blocks' outputs and
/// the logits scaled, the attention scores by a scale of their own.
fn build_granite(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3]) -> Model {
    build_with(seed, ty, expert_ty, Flavor::Granite)
}

/// The SmallThinker variant of [`build`]: the routers read each layer's
/// input (before its attention, without a norm), sigmoid scores
/// renormalised, `relu(gate) * up` experts.
fn build_smallthinker(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3]) -> Model {
    build_with(seed, ty, expert_ty, Flavor::SmallThinker)
}

fn build_with(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3], flavor: Flavor) -> Model {
    let oss = flavor == Flavor::Oss;
    let glm = flavor == Flavor::Glm;
    let llama4 = flavor == Flavor::Llama4;
    let mut rng = Rng(seed);
    let hp = Hparams {
        n_layers: 3,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        n_rot: 16,
        n_vocab: 40,
        n_ff: 64,
        rope_base: 10000.0,
        rope_style: RopeStyle::Neox,
        norm_eps: 1e-6,
        moe: Some(MoeParams {
            n_experts: 8,
            top_k: 3,
            n_ff_exp: 32,
            gating: Gating::Softmax,
            normalize: true,
            weights_scale: 1.0,
            n_ff_shared: Some(32),
            act: les_core::model::config::ExpertAct::SwiGlu,
            groups: None,
            weight_inputs: false,
            route_before_attention: false,
        }),
        rope_yarn: None,
        scales: match flavor {
            Flavor::Granite => GRANITE_SCALES,
            _ => Scales::NONE,
        },
    };
    let mut hp = hp;
    if oss {
        let moe = hp.moe.as_mut().unwrap();
        moe.gating = Gating::SoftmaxWeight;
        moe.normalize = false;
        moe.act = ExpertAct::SwiGluOai {
            alpha: 1.702,
            limit: 7.0,
        };
        hp.rope_yarn = Some(OSS_YARN);
    }
    if glm {
        let moe = hp.moe.as_mut().unwrap();
        moe.gating = Gating::Sigmoid;
        moe.weights_scale = GLM_SCALE;
    }
    if flavor == Flavor::SmallThinker {
        let moe = hp.moe.as_mut().unwrap();
        moe.gating = Gating::Sigmoid;
        moe.act = ExpertAct::ReGlu;
        moe.route_before_attention = true;
    }
    if llama4 {
        let moe = hp.moe.as_mut().unwrap();
        moe.gating = Gating::SigmoidOfLogits;
        moe.normalize = false;
        moe.weight_inputs = true;
    }
    let e = hp.n_embd;
    let mut layers = Vec::new();
    let mut experts = Vec::new();
    let mut image = Vec::new();
    let mut offsets = Vec::new();
    for l in 0..hp.n_layers {
        let dense = l == 0;
        layers.push(Layer {
            attn_norm: norm_w(&mut rng, e),
            wq: Mat::new(&mut rng, ty, hp.q_dim(), e, 0.15),
            wk: Mat::new(&mut rng, ty, hp.kv_dim(), e, 0.15),
            wv: Mat::new(&mut rng, ty, hp.kv_dim(), e, 0.15),
            wo: Mat::new(&mut rng, ty, e, hp.q_dim(), 0.15),
            // Llama 4's norms have no weights (ones, bit for bit the same).
            q_norm: match llama4 {
                true => vec![1.0; hp.head_dim],
                false => norm_w(&mut rng, hp.head_dim),
            },
            k_norm: match llama4 {
                true => vec![1.0; hp.head_dim],
                false => norm_w(&mut rng, hp.head_dim),
            },
            ffn_norm: norm_w(&mut rng, e),
            dense: dense.then(|| {
                [
                    Mat::new(&mut rng, ty, hp.n_ff, e, 0.15),
                    Mat::new(&mut rng, ty, hp.n_ff, e, 0.15),
                    Mat::new(&mut rng, ty, e, hp.n_ff, 0.15),
                ]
            }),
            router: (!dense).then(|| Mat::new(&mut rng, GgmlType::F32, 8, e, 0.5)),
            shared: (l == 2).then(|| {
                (
                    [
                        Mat::new(&mut rng, ty, 32, e, 0.15),
                        Mat::new(&mut rng, ty, 32, e, 0.15),
                        Mat::new(&mut rng, ty, e, 32, 0.15),
                    ],
                    (!glm && !llama4).then(|| Mat::new(&mut rng, GgmlType::F32, 1, e, 0.3)),
                )
            }),
            // Sigmoid scores lie in (0, 1): this reorders the close ones.
            selection_bias: (glm && !dense).then(|| (0..8).map(|_| 0.1 * rng.normal()).collect()),
            oss: oss.then(|| {
                let mut v = |n: usize, std: f32| -> Vec<f32> {
                    (0..n).map(|_| std * rng.normal()).collect()
                };
                OssLayer {
                    bo: v(e, 0.1),
                    sinks: v(hp.n_head, 1.0),
                    window: (l % 2 == 0).then_some(OSS_WINDOW),
                    router_bias: v(8, 0.5),
                    // Large enough that the clamp at 7 bites now and then.
                    expert_bias: [v(8 * 32, 3.0), v(8 * 32, 3.0), v(8 * e, 0.1)],
                }
            }),
            llama4: llama4.then(|| Llama4Layer {
                chunk: (l != 1).then_some(LLAMA4_CHUNK),
                nope: (l == 1).then_some(LLAMA4_TEMPERATURE),
            }),
        });
        let mut le = Vec::new();
        let mut lo = Vec::new();
        if !dense {
            for _ in 0..8 {
                let m = [
                    Mat::new(&mut rng, expert_ty[0], 32, e, 0.2),
                    Mat::new(&mut rng, expert_ty[1], 32, e, 0.2),
                    Mat::new(&mut rng, expert_ty[2], e, 32, 0.2),
                ];
                lo.push(image.len());
                for p in &m {
                    image.extend_from_slice(&p.bytes);
                }
                le.push(m);
            }
        }
        experts.push(le);
        offsets.push(lo);
    }
    Model {
        hp,
        embd: Mat::new(&mut rng, ty, hp.n_vocab, e, 1.0),
        out_norm: norm_w(&mut rng, e),
        output: Mat::new(&mut rng, ty, hp.n_vocab, e, 0.2),
        layers,
        experts,
        image,
        offsets,
        expert_ty,
    }
}

impl Weights for Model {
    fn block(&self, l: usize) -> Block<'_> {
        let ly = &self.layers[l];
        let ffn = match (&ly.dense, &ly.router) {
            (Some([g, u, d]), _) => Ffn::Dense {
                gate: Some(g.view()),
                up: u.view(),
                down: d.view(),
            },
            (None, Some(r)) => Ffn::Moe {
                router: r.view(),
                shared: ly.shared.as_ref().map(|([g, u, d], gi)| SharedExpert {
                    gate: Some(g.view()),
                    up: u.view(),
                    down: d.view(),
                    gate_inp: gi.as_ref().map(|g| g.view()),
                }),
                selection_bias: ly.selection_bias.as_deref(),
                expert_bias: ly.oss.as_ref().map(|o| ExpertBiases {
                    gate: &o.expert_bias[0],
                    up: &o.expert_bias[1],
                    down: &o.expert_bias[2],
                }),
                router_bias: ly.oss.as_ref().map(|o| &o.router_bias[..]),
            },
            _ => unreachable!(),
        };
        let nope = ly.llama4.as_ref().and_then(|l4| l4.nope);
        Block {
            attn_norm: &ly.attn_norm,
            mixer: Mixer::Attention(AttentionWeights {
                wq: ly.wq.view(),
                wk: ly.wk.view(),
                wv: ly.wv.view(),
                wo: ly.wo.view(),
                bq: None,
                bk: None,
                bv: None,
                q_norm: nope.is_none().then_some(&ly.q_norm[..]),
                k_norm: nope.is_none().then_some(&ly.k_norm[..]),
                bo: ly.oss.as_ref().map(|o| &o.bo[..]),
                sinks: ly.oss.as_ref().map(|o| &o.sinks[..]),
                window: match (&ly.oss, &ly.llama4) {
                    (Some(o), _) => o.window.map(AttnWindow::Sliding),
                    (_, Some(l4)) => l4.chunk.map(AttnWindow::Chunked),
                    _ => None,
                },
                rope_freqs: None,
                norm_after_rope: ly.llama4.is_some(),
                nope,
            }),
            ffn_norm: &ly.ffn_norm,
            ffn,
        }
    }
    fn embedding(&self) -> MatrixView<'_> {
        self.embd.view()
    }
    fn output_norm(&self) -> &[f32] {
        &self.out_norm
    }
    fn output(&self) -> MatrixView<'_> {
        self.output.view()
    }
}

impl Model {
    fn format(&self) -> ExpertFormat {
        ExpertFormat {
            gate: Some(self.expert_ty[0]),
            up: self.expert_ty[1],
            down: self.expert_ty[2],
            n_embd: self.hp.n_embd,
            n_ff: 32,
        }
    }

    /// The packed expert image as a source of `parts` extents an expert (see
    /// [`PackedExperts::parts`]).
    fn packed(&self, parts: usize) -> PackedExperts<'_> {
        PackedExperts {
            image: &self.image,
            offsets: &self.offsets,
            format: self.format(),
            parts,
        }
    }
}

const TOKENS: [u32; 6] = [3, 17, 5, 39, 0, 22];

/// The models the exactness tests run: weight and expert types, and the
/// model family.
const VARIANTS: [(GgmlType, [GgmlType; 3], Flavor); 7] = [
    (
        GgmlType::Q8_0,
        [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0],
        Flavor::Plain,
    ),
    (
        GgmlType::F16,
        [GgmlType::Q8_0, GgmlType::Q5_1, GgmlType::Q4_1],
        Flavor::Plain,
    ),
    (
        GgmlType::Q8_0,
        [GgmlType::MXFP4, GgmlType::MXFP4, GgmlType::Q8_0],
        Flavor::Oss,
    ),
    (
        GgmlType::BF16,
        [GgmlType::Q5_0, GgmlType::Q4_1, GgmlType::Q8_0],
        Flavor::Glm,
    ),
    (
        GgmlType::F16,
        [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_1],
        Flavor::Llama4,
    ),
    (
        GgmlType::Q8_0,
        [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0],
        Flavor::Granite,
    ),
    (
        GgmlType::Q8_0,
        [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0],
        Flavor::SmallThinker,
    ),
];

struct Buffers {
    kv_k: Vec<f32>,
    kv_v: Vec<f32>,
    scratch: Vec<f32>,
    quant: QuantScratch,
}

impl Buffers {
    fn new(hp: &Hparams) -> Buffers {
        Buffers {
            kv_k: vec![0.0; KvCache::len(hp, TOKENS.len())],
            kv_v: vec![0.0; KvCache::len(hp, TOKENS.len())],
            scratch: vec![0.0; Scratch::len(hp, TOKENS.len())],
            quant: QuantScratch::new(),
        }
    }
}

fn decode<X: Experts>(m: &Model, experts: &mut X, lookahead: Option<&Lookahead>) -> Vec<Vec<f32>>
where
    X::Error: std::fmt::Debug,
{
    decode_tokens(m, experts, lookahead, &TOKENS)
}

/// `tokens` (at most as many as [`TOKENS`]) evaluated one position at a
/// time: each position's logits.
fn decode_tokens<X: Experts>(
    m: &Model,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    tokens: &[u32],
) -> Vec<Vec<f32>>
where
    X::Error: std::fmt::Debug,
{
    let hp = m.hp;
    let mut b = Buffers::new(&hp);
    let kv = KvCache::new(&hp, &mut b.kv_k, &mut b.kv_v, TOKENS.len()).unwrap();
    decode_over(
        m,
        experts,
        lookahead,
        kv,
        (&mut b.scratch, &mut b.quant),
        tokens,
    )
}

/// [`decode`] with an `f16` KV cache.
fn decode_f16<X: Experts>(m: &Model, experts: &mut X) -> Vec<Vec<f32>>
where
    X::Error: std::fmt::Debug,
{
    let hp = m.hp;
    let hy = HybridParams::plain(&hp);
    let mut b = Buffers::new(&hp);
    let n = KvCache::len(&hp, TOKENS.len());
    let (mut k, mut v) = (vec![0u16; n], vec![0u16; n]);
    let kv = KvCache::new_typed(
        &hp,
        &hy,
        KvBuf::F16(&mut k),
        KvBuf::F16(&mut v),
        TOKENS.len(),
    )
    .unwrap();
    decode_over(
        m,
        experts,
        None,
        kv,
        (&mut b.scratch, &mut b.quant),
        &TOKENS,
    )
}

fn decode_over<X: Experts>(
    m: &Model,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    mut kv: KvCache<'_>,
    (scratch, quant): (&mut [f32], &mut QuantScratch),
    tokens: &[u32],
) -> Vec<Vec<f32>>
where
    X::Error: std::fmt::Debug,
{
    let hp = m.hp;
    let mut s = Scratch::new(&hp, scratch, TOKENS.len()).unwrap();
    let mut mv = quant.matvec();
    tokens
        .iter()
        .enumerate()
        .map(|(pos, &t)| {
            let mut logits = vec![0f32; hp.n_vocab];
            forward(
                &hp,
                m,
                &mut mv,
                experts,
                lookahead,
                TokenInput::Token(t),
                pos,
                &mut kv,
                &mut s,
                &mut logits,
            )
            .unwrap();
            logits
        })
        .collect()
}

/// [`decode`] of a model, for [`StreamedRun::run`].
struct Decoder<'m>(&'m Model);

impl Decode for Decoder<'_> {
    fn decode<X: Experts>(
        &mut self,
        experts: &mut X,
        lookahead: Option<&Lookahead>,
    ) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        decode(self.0, experts, lookahead)
    }
}

fn resident(m: &Model) -> Vec<Vec<f32>> {
    alone(m, &TOKENS)
}

/// The logits, how often the supplier answered `Step::Pending`, and how many
/// experts it handed out in halves.
fn streamed(
    m: &Model,
    slots: usize,
    predict: bool,
    parts: usize,
    seed: u64,
    cfg: SchedulerConfig,
) -> (Vec<Vec<f32>>, usize, usize) {
    let experts = m.packed(parts);
    let n_layers = m.hp.n_layers;
    let out = StreamedRun {
        experts: &experts,
        n_layers,
        n_experts: 8,
        slots,
        predict,
        seed,
        config: cfg,
        lookahead: Lookahead {
            predictor: PredictorConfig::top_k(3),
            layers: LayerMask::first(n_layers).unwrap(),
            depth: 1 + (seed % 2) as usize,
        },
    }
    .run(&mut Decoder(m));
    let st = out.stats;
    assert!(
        st.misses + st.hits + st.late_hits == (TOKENS.len() * 2 * 3) as u64,
        "{st:?}"
    );
    if predict && cfg.prefetch {
        assert!(st.prefetches > 0, "{st:?}");
        // Every MoE layer is predicted, the first (after the dense layer 0)
        // from the token's embedding, whatever the depth.
        for l in out.layers.iter().skip(1) {
            assert!(l.predicted > 0, "{:?}", out.layers);
        }
    }
    assert_eq!(st.split_computes, out.halves as u64, "{st:?}");
    (out.logits, out.pending, out.halves)
}

#[test]
fn streamed_equals_resident_bit_for_bit() {
    for (ty, ety, flavor) in VARIANTS {
        let m = build_with(11, ty, ety, flavor);
        let want = resident(&m);
        let mut seed = 1;
        let (mut les_pending, mut les_halves) = (0, 0);
        for slots in [3, 4, 7, 16] {
            for predict in [false, true] {
                for parts in [1, 3, 2] {
                    for cfg in [SchedulerConfig::les(), SchedulerConfig::on_demand()] {
                        seed += 1;
                        let (got, pending, halves) = streamed(&m, slots, predict, parts, seed, cfg);
                        assert_bits_eq(
                            &got,
                            &want,
                            &format!("{ty} slots={slots} predict={predict} parts={parts}"),
                        );
                        if cfg.ready_first {
                            les_pending += pending;
                            les_halves += halves;
                        } else {
                            assert_eq!(pending, 0, "on-demand overlaps nothing");
                        }
                        if parts != 2 || !cfg.ready_first {
                            assert_eq!(halves, 0, "halves only of two-part experts, in les");
                        }
                    }
                }
            }
        }
        // The shared expert was computed while reads were in flight, experts were
        // computed in halves while their down projections loaded, and the logits
        // still matched.
        assert!(les_pending > 0, "{ty}: no read was ever pending");
        assert!(les_halves > 0, "{ty}: no expert was computed in halves");
    }
}

/// How [`decode_in_batches`] evaluates the next positions.
#[derive(Clone, Copy, Debug)]
enum Eval {
    /// This many positions with `forward_batch`, the last one's logits.
    Batch(usize),
    /// This many positions with `forward_batch`, every one's logits (a
    /// speculative decode's verification).
    Every(usize),
    /// One position with `forward`.
    One,
}

impl Eval {
    fn len(self) -> usize {
        match self {
            Eval::Batch(n) | Eval::Every(n) => n,
            Eval::One => 1,
        }
    }
}

/// The positions whose logits [`decode_in_batches`] reports for `plan`, in order.
fn reported_positions(plan: &[Eval]) -> Vec<usize> {
    let mut pos = 0;
    let mut out = Vec::new();
    for step in plan {
        match *step {
            Eval::Every(n) => out.extend(pos..pos + n),
            _ => out.push(pos + step.len() - 1),
        }
        pos += step.len();
    }
    out
}

/// [`TOKENS`] evaluated as `plan` says (covering them all); the logits of the
/// positions [`reported_positions`] names, with those positions.
fn decode_in_batches<X: Experts>(
    m: &Model,
    experts: &mut X,
    plan: &[Eval],
) -> Vec<(usize, Vec<f32>)>
where
    X::Error: std::fmt::Debug,
{
    let hp = m.hp;
    let hy = HybridParams::plain(&hp);
    let mut b = Buffers::new(&hp);
    let mut kv = KvCache::new(&hp, &mut b.kv_k, &mut b.kv_v, TOKENS.len()).unwrap();
    let mut s = Scratch::new(&hp, &mut b.scratch, TOKENS.len()).unwrap();
    let n = TOKENS.len();
    let mut floats = vec![0f32; BatchScratch::floats(&hp, &hy, n)];
    let mut ids = vec![0u16; BatchScratch::ids(&hp, &hy, n)];
    let mut bs = BatchScratch::new(&hp, &hy, n, &mut floats, &mut ids).unwrap();
    let mut mv = Grouped(b.quant.matvec(), 3);
    let mut pos = 0;
    let mut out = Vec::new();
    for step in plan {
        let every = matches!(step, Eval::Every(_));
        let mut logits = vec![0f32; hp.n_vocab * if every { step.len() } else { 1 }];
        let len = match *step {
            Eval::Batch(len) | Eval::Every(len) => {
                let inputs: Vec<TokenInput<'_>> = TOKENS[pos..pos + len]
                    .iter()
                    .map(|&t| TokenInput::Token(t))
                    .collect();
                forward_batch(
                    &hp,
                    &hy,
                    m,
                    &mut mv,
                    experts,
                    &inputs,
                    pos,
                    &mut kv,
                    &mut RecurrentState::empty(),
                    &mut s,
                    &mut bs,
                    &mut logits,
                )
                .unwrap();
                len
            }
            Eval::One => {
                let input = TokenInput::Token(TOKENS[pos]);
                forward(
                    &hp,
                    m,
                    &mut mv,
                    experts,
                    None,
                    input,
                    pos,
                    &mut kv,
                    &mut s,
                    &mut logits,
                )
                .unwrap();
                1
            }
        };
        if every {
            out.extend(
                logits
                    .chunks_exact(hp.n_vocab)
                    .enumerate()
                    .map(|(j, l)| (pos + j, l.to_vec())),
            );
        } else {
            out.push((pos + len - 1, logits));
        }
        pos += len;
    }
    assert_eq!(pos, TOKENS.len(), "the plan covers the tokens");
    out
}

/// [`decode_in_batches`] for [`StreamedRun::run`] (its logits, in plan order).
struct BatchDecoder<'m>(&'m Model, &'m [Eval]);

impl Decode for BatchDecoder<'_> {
    fn decode<X: Experts>(&mut self, experts: &mut X, _: Option<&Lookahead>) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        decode_in_batches(self.0, experts, self.1)
            .into_iter()
            .map(|(_, l)| l)
            .collect()
    }
}

/// [`TOKENS`] evaluated as `plan` says with the experts (in `parts` reads
/// each) streamed through `slots` slots of a scheduler with `cfg`.
fn streamed_batches(
    m: &Model,
    plan: &[Eval],
    slots: usize,
    parts: usize,
    predict: bool,
    seed: u64,
    cfg: SchedulerConfig,
) -> StreamedOutput {
    let experts = m.packed(parts);
    StreamedRun {
        experts: &experts,
        n_layers: m.hp.n_layers,
        n_experts: 8,
        slots,
        predict,
        seed,
        config: cfg,
        lookahead: Lookahead {
            predictor: PredictorConfig::top_k(3),
            layers: LayerMask::first(m.hp.n_layers).unwrap(),
            depth: 1,
        },
    }
    .run(&mut BatchDecoder(m, plan))
}

const PLANS: [&[Eval]; 7] = [
    &[Eval::Batch(6)],
    &[Eval::Batch(1), Eval::Batch(5)],
    &[Eval::Batch(2), Eval::Batch(3), Eval::One],
    &[Eval::One, Eval::Batch(4), Eval::One],
    &[Eval::Batch(4), Eval::One, Eval::One],
    &[Eval::Every(6)],
    &[Eval::One, Eval::Every(2), Eval::Batch(2), Eval::Every(1)],
];

/// A prompt evaluated in batches gives, at each batch's last position, the
/// logits of evaluating it one position at a time, bit for bit, with the
/// experts resident or streamed (any slot count: with 3 slots, a layer's union
/// of picks is asked for in groups of 3), and leaves the KV cache as those would
/// (the later steps see it).
#[test]
fn batched_prefill_equals_one_position_at_a_time() {
    for (ty, ety, flavor) in VARIANTS {
        let m = build_with(11, ty, ety, flavor);
        let want = resident(&m);
        let packed = m.packed(1);
        let fmt = packed.format;
        let mut seed = 100;
        for plan in PLANS {
            let mut ex = Resident::new(|l, e| fmt.matrices(packed.bytes(l, e)));
            for (pos, got) in decode_in_batches(&m, &mut ex, plan) {
                assert_bits_eq(
                    std::slice::from_ref(&got),
                    std::slice::from_ref(&want[pos]),
                    &format!("{ty} resident {plan:?} position {pos}"),
                );
            }
            for slots in [3, 4, 7, 16] {
                for parts in [1, 3, 2] {
                    for cfg in [SchedulerConfig::les(), SchedulerConfig::on_demand()] {
                        seed += 1;
                        let out = streamed_batches(&m, plan, slots, parts, true, seed, cfg);
                        let positions = reported_positions(plan);
                        assert_eq!(positions.len(), out.logits.len());
                        for (pos, got) in positions.into_iter().zip(&out.logits) {
                            assert_bits_eq(
                                std::slice::from_ref(got),
                                std::slice::from_ref(&want[pos]),
                                &format!(
                                    "{ty} slots={slots} parts={parts} {plan:?} position {pos}"
                                ),
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A batch streamed with LES reads the next layer's likeliest experts ahead
/// (its router on the batch's residual streams; the first layer's from the
/// embeddings) even where each layer's picks are asked for at once, and they
/// are picked; the on-demand baseline reads only what is asked for. Exact
/// either way.
#[test]
fn batches_read_the_next_layer_ahead() {
    let m = build(
        11,
        GgmlType::Q8_0,
        [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0],
    );
    let want = resident(&m);
    let plan: &[Eval] = &[Eval::Batch(TOKENS.len())];
    for (seed, cfg) in [SchedulerConfig::les(), SchedulerConfig::on_demand()]
        .into_iter()
        .enumerate()
    {
        // More slots than a layer's experts: one group a layer.
        let out = streamed_batches(&m, plan, 16, 1, cfg.prefetch, seed as u64, cfg);
        assert_bits_eq(&out.logits, &want[TOKENS.len() - 1..], "last position");
        let st = out.stats;
        if cfg.prefetch {
            assert!(st.prefetches > 0 && st.useful_prefetches > 0, "{st:?}");
        } else {
            assert_eq!(st.prefetches, 0, "{st:?}");
        }
    }
}

/// A SmallThinker batch streamed with LES names each layer's first group of
/// missing picks before the layer's attention (its routers read the layer's
/// input), so their reads overlap the attention; a batch of routers on the
/// FFN's input cannot, and names a layer's picks only once its first group
/// computes. Exact either way.
#[test]
fn batches_routed_before_attention_read_before_it() {
    let plan: &[Eval] = &[Eval::Batch(TOKENS.len())];
    for (flavor, early) in [(Flavor::SmallThinker, true), (Flavor::Plain, false)] {
        let m = build_with(
            11,
            GgmlType::Q8_0,
            [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0],
            flavor,
        );
        let want = resident(&m);
        let les = SchedulerConfig::les();
        let out = streamed_batches(&m, plan, 4, 1, true, 3, les);
        assert_bits_eq(&out.logits, &want[TOKENS.len() - 1..], "last position");
        assert_eq!(out.named_before_compute > 0, early, "{flavor:?}");
        let od = SchedulerConfig::on_demand();
        let out = streamed_batches(&m, plan, 4, 1, false, 3, od);
        assert_bits_eq(&out.logits, &want[TOKENS.len() - 1..], "on-demand");
        assert_eq!(out.named_before_compute, 0, "on-demand reads what is asked");
    }
}

/// The tokens of the sequences [`together`] evaluates.
const SEQ_TOKENS: [&[u32]; 3] = [&TOKENS, &[9, 4, 31, 2, 17, 8], &[22, 22, 0, 13, 5, 39]];

/// One pass of [`together`]: the sequences' next positions, `(sequence,
/// count, every)` in the pass's order, `every` asking for each of the
/// sequence's positions' logits (else its last's).
type SeqStep<'a> = &'a [(usize, usize, bool)];

/// A position of each sequence.
const SIDE_BY_SIDE: SeqStep<'static> = &[(0, 1, false), (1, 1, false), (2, 1, false)];

/// Ways to evaluate [`SEQ_TOKENS`] together, each covering them all.
const SEQ_PLANS: [&[SeqStep<'static>]; 3] = [
    // Decoding side by side, one position of each a pass.
    &[SIDE_BY_SIDE; 6],
    // Prompts of different lengths, then out of order, then every position
    // of both, then one sequence's every position beside another's last.
    &[
        &[(0, 3, false), (1, 2, false), (2, 3, false)],
        &[(1, 1, false), (0, 1, false), (2, 1, false)],
        &[(0, 1, true), (1, 2, true)],
        &[(2, 2, true), (0, 1, false), (1, 1, false)],
    ],
    // One sequence alone, then the others joining and leaving, verifying
    // beside others' prompts.
    &[
        &[(1, 6, false)],
        &[(2, 1, false), (0, 2, true)],
        &[(2, 5, false), (0, 4, true)],
    ],
];

/// `tokens` evaluated one position at a time with the experts resident.
fn alone(m: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let packed = m.packed(1);
    let fmt = packed.format;
    let mut ex = Resident::new(|l, e| fmt.matrices(packed.bytes(l, e)));
    decode_tokens(m, &mut ex, None, tokens)
}

/// [`SEQ_TOKENS`] evaluated together as `plan` says, each sequence over its
/// own KV cache: the logits of each pass, with their sequence and position.
fn together<X: Experts>(
    m: &Model,
    experts: &mut X,
    plan: &[SeqStep<'_>],
) -> Vec<((usize, usize), Vec<f32>)>
where
    X::Error: std::fmt::Debug,
{
    let hp = m.hp;
    let hy = HybridParams::plain(&hp);
    let n = TOKENS.len();
    let mut bufs: Vec<Buffers> = (0..3).map(|_| Buffers::new(&hp)).collect();
    let mut kvs: Vec<KvCache<'_>> = bufs
        .iter_mut()
        .map(|b| KvCache::new(&hp, &mut b.kv_k, &mut b.kv_v, n).unwrap())
        .collect();
    let mut rss: Vec<RecurrentState<'_>> = (0..3).map(|_| RecurrentState::empty()).collect();
    let mut shared = Buffers::new(&hp);
    let mut s = Scratch::new(&hp, &mut shared.scratch, n).unwrap();
    let cap = 3 * n;
    let mut floats = vec![0f32; BatchScratch::floats(&hp, &hy, cap)];
    let mut ids = vec![0u16; BatchScratch::ids(&hp, &hy, cap)];
    let mut bs = BatchScratch::new(&hp, &hy, cap, &mut floats, &mut ids).unwrap();
    let mut mv = Grouped(shared.quant.matvec(), 3);
    let mut pos = [0usize; 3];
    let mut out = Vec::new();
    for &step in plan {
        let inputs: Vec<TokenInput<'_>> = step
            .iter()
            .flat_map(|&(q, c, _)| SEQ_TOKENS[q][pos[q]..pos[q] + c].iter())
            .map(|&t| TokenInput::Token(t))
            .collect();
        let mut by_seq: Vec<Option<Sequence<'_, '_, '_>>> = kvs
            .iter_mut()
            .zip(rss.iter_mut())
            .enumerate()
            .map(|(q, (kv, rs))| {
                let &(_, len, every) = step.iter().find(|e| e.0 == q)?;
                Some(Sequence {
                    len,
                    pos: pos[q],
                    rope: None,
                    kv,
                    rs,
                    every,
                })
            })
            .collect();
        let mut seqs: Vec<Sequence<'_, '_, '_>> = step
            .iter()
            .map(|&(q, _, _)| by_seq[q].take().unwrap())
            .collect();
        let rows: usize = step
            .iter()
            .map(|&(_, c, every)| if every { c } else { 1 })
            .sum();
        let mut logits = vec![0f32; rows * hp.n_vocab];
        forward_sequences(
            &hp,
            &hy,
            m,
            &mut mv,
            experts,
            &inputs,
            &mut seqs,
            &mut s,
            &mut bs,
            &mut logits,
        )
        .unwrap();
        let mut rows = logits.chunks_exact(hp.n_vocab);
        for &(q, c, every) in step {
            let reported = if every {
                pos[q]..pos[q] + c
            } else {
                pos[q] + c - 1..pos[q] + c
            };
            for p in reported {
                out.push(((q, p), rows.next().unwrap().to_vec()));
            }
            pos[q] += c;
        }
    }
    assert!(
        (0..3).all(|q| pos[q] == SEQ_TOKENS[q].len()),
        "the plan covers the tokens"
    );
    out
}

/// [`together`] for [`StreamedRun::run`] (its logits, in order).
struct TogetherDecoder<'m>(&'m Model, &'m [SeqStep<'m>]);

impl Decode for TogetherDecoder<'_> {
    fn decode<X: Experts>(&mut self, experts: &mut X, _: Option<&Lookahead>) -> Vec<Vec<f32>>
    where
        X::Error: std::fmt::Debug,
    {
        together(self.0, experts, self.1)
            .into_iter()
            .map(|(_, l)| l)
            .collect()
    }
}

/// Sequences evaluated together in one pass (each over its own KV cache,
/// decoding side by side, prompts of different lengths, joining and leaving,
/// in any order) give each sequence the logits of evaluating it alone one
/// position at a time, bit for bit, with the experts resident or streamed
/// through a few slots by either schedule.
#[test]
fn sequences_together_equal_each_alone() {
    for (ty, ety, flavor) in VARIANTS {
        let m = build_with(11, ty, ety, flavor);
        let want: Vec<Vec<Vec<f32>>> = SEQ_TOKENS.iter().map(|t| alone(&m, t)).collect();
        let packed = m.packed(1);
        let fmt = packed.format;
        let mut seed = 300;
        for plan in SEQ_PLANS {
            let mut ex = Resident::new(|l, e| fmt.matrices(packed.bytes(l, e)));
            let got = together(&m, &mut ex, plan);
            for ((q, p), logits) in &got {
                assert_bits_eq(
                    std::slice::from_ref(logits),
                    std::slice::from_ref(&want[*q][*p]),
                    &format!("{ty} {flavor:?} resident {plan:?} sequence {q} position {p}"),
                );
            }
            let expected: Vec<Vec<f32>> =
                got.iter().map(|((q, p), _)| want[*q][*p].clone()).collect();
            for slots in [3, 7] {
                for cfg in [SchedulerConfig::les(), SchedulerConfig::on_demand()] {
                    seed += 1;
                    let experts = m.packed(2);
                    let out = StreamedRun {
                        experts: &experts,
                        n_layers: m.hp.n_layers,
                        n_experts: 8,
                        slots,
                        predict: true,
                        seed,
                        config: cfg,
                        lookahead: Lookahead {
                            predictor: PredictorConfig::top_k(3),
                            layers: LayerMask::first(m.hp.n_layers).unwrap(),
                            depth: 1,
                        },
                    }
                    .run(&mut TogetherDecoder(&m, plan));
                    assert_bits_eq(
                        &out.logits,
                        &expected,
                        &format!("{ty} {flavor:?} slots={slots} {plan:?}"),
                    );
                }
            }
        }
    }
}

/// A random way to evaluate [`SEQ_TOKENS`] together: passes of a random
/// subset of the sequences (at least one), each taking a random count of its
/// next positions, in a random order, each asking for every one of its
/// positions' logits or its last's.
fn random_plan(seed: u64) -> Vec<Vec<(usize, usize, bool)>> {
    let mut rng = Rng(seed);
    let mut left: Vec<usize> = SEQ_TOKENS.iter().map(|t| t.len()).collect();
    let mut plan = Vec::new();
    while left.iter().any(|&n| n > 0) {
        let mut step = Vec::new();
        for (q, &n) in left.iter().enumerate() {
            if n > 0 && !rng.next().is_multiple_of(3) {
                step.push((
                    q,
                    1 + (rng.next() as usize) % n,
                    rng.next().is_multiple_of(2),
                ));
            }
        }
        if step.is_empty() {
            let q = left.iter().position(|&n| n > 0).unwrap();
            step.push((q, left[q], rng.next().is_multiple_of(2)));
        }
        let turn = (rng.next() as usize) % step.len();
        step.rotate_left(turn);
        for &(q, c, _) in &step {
            left[q] -= c;
        }
        plan.push(step);
    }
    plan
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// [`sequences_together_equal_each_alone`] for random plans, on every
    /// variant, resident.
    #[test]
    fn random_plans_of_sequences_equal_each_alone(seed in proptest::prelude::any::<u64>()) {
        let plan = random_plan(seed);
        let steps: Vec<SeqStep<'_>> = plan.iter().map(|s| &s[..]).collect();
        let (ty, ety, flavor) = VARIANTS[(seed % VARIANTS.len() as u64) as usize];
        let m = build_with(11, ty, ety, flavor);
        let packed = m.packed(1);
        let fmt = packed.format;
        let mut ex = Resident::new(|l, e| fmt.matrices(packed.bytes(l, e)));
        let alone: Vec<Vec<Vec<f32>>> = SEQ_TOKENS.iter().map(|t| alone(&m, t)).collect();
        for ((q, p), logits) in together(&m, &mut ex, &steps) {
            let want = &alone[q][p];
            proptest::prop_assert_eq!(
                logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{:?} {:?} sequence {} position {}", flavor, plan, q, p
            );
        }
    }
}

/// Sequences `forward_sequences` cannot serve are errors, not panics: none,
/// one of no inputs, counts that do not add up to the inputs, one past its
/// context, logits of another count of rows than the sequences ask for.
#[test]
fn forward_sequences_rejects_what_it_cannot_do() {
    let m = build(
        11,
        GgmlType::Q8_0,
        [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0],
    );
    let hp = m.hp;
    let hy = HybridParams::plain(&hp);
    let packed = m.packed(1);
    let fmt = packed.format;
    let mut ex = Resident::new(|l, e| fmt.matrices(packed.bytes(l, e)));
    let n = TOKENS.len();
    let (mut b0, mut b1) = (Buffers::new(&hp), Buffers::new(&hp));
    let mut kv0 = KvCache::new(&hp, &mut b0.kv_k, &mut b0.kv_v, n).unwrap();
    let mut kv1 = KvCache::new(&hp, &mut b1.kv_k, &mut b1.kv_v, n).unwrap();
    let (mut rs0, mut rs1) = (RecurrentState::empty(), RecurrentState::empty());
    let mut s = Scratch::new(&hp, &mut b0.scratch, n).unwrap();
    let mut mv = b0.quant.matvec();
    let mut floats = vec![0f32; BatchScratch::floats(&hp, &hy, 4)];
    let mut ids = vec![0u16; BatchScratch::ids(&hp, &hy, 4)];
    let mut bs = BatchScratch::new(&hp, &hy, 4, &mut floats, &mut ids).unwrap();
    let inputs: Vec<TokenInput<'_>> = TOKENS.iter().map(|&t| TokenInput::Token(t)).collect();
    // (inputs, first's count, position and every, second's count, logits
    // rows)
    let cases: [(usize, usize, usize, bool, Option<usize>, usize); 8] = [
        (0, 0, 0, false, None, 0),
        (2, 0, 0, false, Some(2), 2),
        (3, 1, 0, false, Some(1), 2),
        (3, 2, n - 1, false, Some(1), 2),
        (3, 2, 0, false, Some(1), 1),
        (3, 2, 0, false, Some(1), 3),
        (3, 2, 0, true, Some(1), 2),
        (3, 2, 0, true, Some(1), 4),
    ];
    for (count, len0, pos0, every, len1, rows) in cases {
        let mut seqs = vec![Sequence {
            len: len0,
            pos: pos0,
            rope: None,
            kv: &mut kv0,
            rs: &mut rs0,
            every,
        }];
        if let Some(len) = len1 {
            seqs.push(Sequence {
                len,
                pos: 0,
                rope: None,
                kv: &mut kv1,
                rs: &mut rs1,
                every: false,
            });
        }
        let r = forward_sequences(
            &hp,
            &hy,
            &m,
            &mut mv,
            &mut ex,
            &inputs[..count],
            &mut seqs,
            &mut s,
            &mut bs,
            &mut vec![0f32; rows * hp.n_vocab],
        );
        assert!(
            r.is_err(),
            "{count} inputs as {len0} at {pos0} (every: {every}) and {len1:?}, {rows} rows"
        );
    }
    let r = forward_sequences(
        &hp,
        &hy,
        &m,
        &mut mv,
        &mut ex,
        &inputs[..2],
        &mut [],
        &mut s,
        &mut bs,
        &mut vec![0f32; hp.n_vocab],
    );
    assert!(r.is_err(), "no sequences");
}

/// Calls `forward_batch` cannot serve are errors, not panics: no inputs, more
/// than the scratch holds, past the context, scratch made for another shape,
/// logits of another length.
#[test]
fn forward_batch_rejects_what_it_cannot_do() {
    let m = build(
        11,
        GgmlType::Q8_0,
        [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0],
    );
    let hp = m.hp;
    let hy = HybridParams::plain(&hp);
    let packed = m.packed(1);
    let fmt = packed.format;
    let mut ex = Resident::new(|l, e| fmt.matrices(packed.bytes(l, e)));
    let mut b = Buffers::new(&hp);
    let n = TOKENS.len();
    let mut kv = KvCache::new(&hp, &mut b.kv_k, &mut b.kv_v, n).unwrap();
    let mut s = Scratch::new(&hp, &mut b.scratch, n).unwrap();
    let mut mv = b.quant.matvec();
    let mut logits = vec![0f32; hp.n_vocab];
    let inputs: Vec<TokenInput<'_>> = TOKENS.iter().map(|&t| TokenInput::Token(t)).collect();
    let mut other = hp;
    other.n_embd /= 2;
    for (shape, count, pos) in [(hp, 0, 0), (hp, 3, 0), (hp, 2, n - 1), (other, 2, 0)] {
        let mut floats = vec![0f32; BatchScratch::floats(&shape, &hy, 2)];
        let mut ids = vec![0u16; BatchScratch::ids(&shape, &hy, 2)];
        let mut bs = BatchScratch::new(&shape, &hy, 2, &mut floats, &mut ids).unwrap();
        let r = forward_batch(
            &hp,
            &hy,
            &m,
            &mut mv,
            &mut ex,
            &inputs[..count],
            pos,
            &mut kv,
            &mut RecurrentState::empty(),
            &mut s,
            &mut bs,
            &mut logits,
        );
        assert!(r.is_err(), "{count} inputs at {pos}");
    }
    // Logits for neither the last position nor every one.
    let mut floats = vec![0f32; BatchScratch::floats(&hp, &hy, 3)];
    let mut ids = vec![0u16; BatchScratch::ids(&hp, &hy, 3)];
    let mut bs = BatchScratch::new(&hp, &hy, 3, &mut floats, &mut ids).unwrap();
    for len in [0, 1, 2 * hp.n_vocab, 4 * hp.n_vocab] {
        let r = forward_batch(
            &hp,
            &hy,
            &m,
            &mut mv,
            &mut ex,
            &inputs[..3],
            0,
            &mut kv,
            &mut RecurrentState::empty(),
            &mut s,
            &mut bs,
            &mut vec![0f32; len],
        );
        assert!(r.is_err(), "{len} logits for 3 positions");
    }
    assert!(BatchScratch::new(&hp, &hy, 2, &mut [0.0; 3], &mut [0; 3]).is_none());
}

/// A plain f32 transformer, written from the architecture description, with no
/// shared code: per-token attention over explicit past keys and values.
fn reference(m: &Model) -> Vec<Vec<f32>> {
    reference_with(m, false)
}

/// [`reference`], the cached keys and values rounded to `f16` if `f16_cache`.
fn reference_with(m: &Model, f16_cache: bool) -> Vec<Vec<f32>> {
    let round = |x: Vec<f32>| -> Vec<f32> {
        if !f16_cache {
            return x;
        }
        x.into_iter()
            .map(|v| les_core::quant::f16_to_f32(les_core::quant::f32_to_f16(v)))
            .collect()
    };
    let hp = m.hp;
    let rms = |x: &[f32], w: &[f32]| -> Vec<f32> {
        let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + hp.norm_eps as f64).sqrt();
        x.iter()
            .zip(w)
            .map(|(v, w)| (*v as f64 * s) as f32 * w)
            .collect()
    };
    let rope = |x: &mut [f32], pos: usize| {
        for h in x.chunks_mut(hp.head_dim) {
            let half = hp.n_rot / 2;
            for i in 0..half {
                let base = hp.rope_base as f64;
                let theta = pos as f64 * base.powf(-2.0 * i as f64 / hp.n_rot as f64);
                // YaRN (the YaRN paper's ramp between the dimensions that turn
                // beta_fast and beta_slow times in the original context).
                let (theta, mscale) = match hp.rope_yarn {
                    None => (theta, 1.0),
                    Some(y) => {
                        let dim = |rot: f64| {
                            hp.n_rot as f64
                                * (y.n_ctx_orig as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                                / (2.0 * base.ln())
                        };
                        let low = dim(y.beta_fast as f64).floor().max(0.0);
                        let high = dim(y.beta_slow as f64).ceil().min(hp.n_rot as f64 - 1.0);
                        let r = ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
                        let mix = (1.0 - r) * y.ext_factor as f64;
                        let fs = y.freq_scale as f64;
                        let t = fs * theta * (1.0 - mix) + theta * mix;
                        (t, y.attn_factor as f64 * (1.0 + 0.1 * (1.0 / fs).ln()))
                    }
                };
                let (a, b) = (h[i] as f64, h[i + half] as f64);
                let (c, s) = (theta.cos() * mscale, theta.sin() * mscale);
                h[i] = (a * c - b * s) as f32;
                h[i + half] = (a * s + b * c) as f32;
            }
        }
    };
    let silu = |x: f32| x / (1.0 + (-x).exp());
    let act = |g: f32, u: f32| match hp.moe.unwrap().act {
        ExpertAct::SwiGlu => silu(g) * u,
        ExpertAct::SwiGluOai { alpha, limit } => {
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            g / (1.0 + (-alpha * g).exp()) * (u + 1.0)
        }
        ExpertAct::ReGlu => g.max(0.0) * u,
        ExpertAct::ReluSqr => unreachable!("this test's models have gated experts"),
    };
    let ffn = |w: &[Mat; 3], x: &[f32]| -> Vec<f32> {
        let g = w[0].apply(x);
        let u = w[1].apply(x);
        let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        w[2].apply(&a)
    };
    // A routed expert `i` of layer `ly`, with its biases where it has them.
    let expert = |w: &[Mat; 3], ly: &Layer, i: usize, x: &[f32]| -> Vec<f32> {
        let (mut g, mut u) = (w[0].apply(x), w[1].apply(x));
        if let Some(o) = &ly.oss {
            for (j, (g, u)) in g.iter_mut().zip(u.iter_mut()).enumerate() {
                *g += o.expert_bias[0][i * 32 + j];
                *u += o.expert_bias[1][i * 32 + j];
            }
        }
        let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| act(*g, *u)).collect();
        let mut y = w[2].apply(&a);
        if let Some(o) = &ly.oss {
            for (j, y) in y.iter_mut().enumerate() {
                *y += o.expert_bias[2][i * hp.n_embd + j];
            }
        }
        y
    };
    let mut keys: Vec<Vec<Vec<f32>>> = vec![Vec::new(); hp.n_layers];
    let mut vals: Vec<Vec<Vec<f32>>> = vec![Vec::new(); hp.n_layers];
    let mut out = Vec::new();
    for (pos, &t) in TOKENS.iter().enumerate() {
        let sc = hp.scales;
        let mut h: Vec<f32> = m.embd.f32[t as usize * hp.n_embd..][..hp.n_embd]
            .iter()
            .map(|v| v * sc.embedding)
            .collect();
        for (l, ly) in m.layers.iter().enumerate() {
            // SmallThinker: the router reads the layer's input.
            let early_logits = match (hp.moe.unwrap().route_before_attention, &ly.router) {
                (true, Some(r)) => Some(r.apply(&h)),
                _ => None,
            };
            let x = rms(&h, &ly.attn_norm);
            let mut q = ly.wq.apply(&x);
            let mut k = ly.wk.apply(&x);
            let v = ly.wv.apply(&x);
            let norm = |x: &mut [f32], w: &[f32]| {
                for hd in x.chunks_mut(hp.head_dim) {
                    hd.copy_from_slice(&rms(hd, w));
                }
            };
            match &ly.llama4 {
                None => {
                    norm(&mut q, &ly.q_norm);
                    norm(&mut k, &ly.k_norm);
                    rope(&mut q, pos);
                    rope(&mut k, pos);
                }
                // Llama 4: no RoPE and no norms, the query scaled by
                // ln(floor((pos + offset) / floor_scale) + 1) * scale + 1.
                Some(Llama4Layer { nope: Some(t), .. }) => {
                    let steps = ((pos as f64 + t.offset as f64) / t.floor_scale as f64).floor();
                    let f = ((steps + 1.0).ln() * t.scale as f64 + 1.0) as f32;
                    q.iter_mut().for_each(|v| *v *= f);
                }
                // Else RoPE, then norms without weights.
                Some(_) => {
                    rope(&mut q, pos);
                    rope(&mut k, pos);
                    norm(&mut q, &ly.q_norm);
                    norm(&mut k, &ly.k_norm);
                }
            }
            keys[l].push(round(k));
            vals[l].push(round(v));
            let mut att = vec![0f32; hp.q_dim()];
            for head in 0..hp.n_head {
                let kvh = head / (hp.n_head / hp.n_head_kv);
                let qh = &q[head * hp.head_dim..][..hp.head_dim];
                // A windowed layer sees its last `window` positions only.
                // A chunked one, the positions of its chunk.
                let chunk = ly.llama4.as_ref().and_then(|l4| l4.chunk);
                let first = match (ly.oss.as_ref().and_then(|o| o.window), chunk) {
                    (Some(w), _) => (pos + 1).saturating_sub(w),
                    (_, Some(c)) => pos / c * c,
                    _ => 0,
                };
                let scores: Vec<f64> = keys[l][first..]
                    .iter()
                    .map(|k| {
                        let kh = &k[kvh * hp.head_dim..][..hp.head_dim];
                        qh.iter()
                            .zip(kh)
                            .map(|(a, b)| (*a * *b) as f64)
                            .sum::<f64>()
                            * sc.attention
                                .map_or(1.0 / (hp.head_dim as f64).sqrt(), f64::from)
                    })
                    .collect();
                // A sink is one more logit in the softmax, with no value.
                let sink = ly.oss.as_ref().map(|o| o.sinks[head] as f64);
                let mx = scores.iter().cloned().chain(sink).fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().chain(&sink).map(|s| (s - mx).exp()).sum();
                for (p, v) in scores.iter().zip(&vals[l][first..]) {
                    let w = (p - mx).exp() / z;
                    for d in 0..hp.head_dim {
                        att[head * hp.head_dim + d] += (w * v[kvh * hp.head_dim + d] as f64) as f32;
                    }
                }
            }
            let mut o = ly.wo.apply(&att);
            if let Some(x) = &ly.oss {
                for (a, b) in o.iter_mut().zip(&x.bo) {
                    *a += b;
                }
            }
            for (a, b) in h.iter_mut().zip(&o) {
                *a += b * sc.residual;
            }
            let x = rms(&h, &ly.ffn_norm);
            let y = if let Some(d) = &ly.dense {
                ffn(d, &x)
            } else {
                let mut logits =
                    early_logits.unwrap_or_else(|| ly.router.as_ref().unwrap().apply(&x));
                if let Some(o) = &ly.oss {
                    for (a, b) in logits.iter_mut().zip(&o.router_bias) {
                        *a += b;
                    }
                }
                // GLM: sigmoid scores, chosen by score plus selection bias;
                // SmallThinker: sigmoid scores; else a softmax (unnormalised:
                // only ratios matter below). Llama 4: sigmoid weights, the
                // experts ranked by logit.
                let glm = ly.selection_bias.as_ref();
                let llama4 = ly.llama4.is_some();
                let sigmoid = glm.is_some() || llama4 || hp.moe.unwrap().route_before_attention;
                let mx = logits.iter().cloned().fold(f32::MIN, f32::max);
                let p: Vec<f32> = match sigmoid {
                    true => logits.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
                    false => logits.iter().map(|v| (v - mx).exp()).collect(),
                };
                let key: Vec<f32> = match glm {
                    Some(b) => p.iter().zip(b).map(|(p, b)| p + b).collect(),
                    None if llama4 => logits.clone(),
                    None => p.clone(),
                };
                let mut idx: Vec<usize> = (0..8).collect();
                idx.sort_by(|a, b| key[*b].partial_cmp(&key[*a]).unwrap().then(a.cmp(b)));
                let top = &idx[..3];
                // gpt-oss: a softmax over the picks' logits; else the picks'
                // probabilities renormalised (and GLM's scaled).
                let weight = |i: usize| -> f32 {
                    if ly.oss.is_some() {
                        let tm = top.iter().map(|&j| logits[j]).fold(f32::MIN, f32::max);
                        let z: f32 = top.iter().map(|&j| (logits[j] - tm).exp()).sum();
                        (logits[i] - tm).exp() / z
                    } else if llama4 {
                        p[i]
                    } else {
                        let scale = if glm.is_some() { GLM_SCALE } else { 1.0 };
                        p[i] / top.iter().map(|j| p[*j]).sum::<f32>() * scale
                    }
                };
                let mut y = vec![0f32; hp.n_embd];
                for &i in top {
                    // Llama 4 weighs the expert's input, not its output.
                    let o = match llama4 {
                        true => {
                            let xw: Vec<f32> = x.iter().map(|v| v * weight(i)).collect();
                            expert(&m.experts[l][i], ly, i, &xw)
                        }
                        false => expert(&m.experts[l][i], ly, i, &x),
                    };
                    let w = if llama4 { 1.0 } else { weight(i) };
                    for (a, b) in y.iter_mut().zip(&o) {
                        *a += w * b;
                    }
                }
                if let Some((sw, gi)) = &ly.shared {
                    let g = gi
                        .as_ref()
                        .map_or(1.0, |gi| 1.0 / (1.0 + (-gi.apply(&x)[0]).exp()));
                    for (a, b) in y.iter_mut().zip(ffn(sw, &x)) {
                        *a += g * b;
                    }
                }
                y
            };
            for (a, b) in h.iter_mut().zip(&y) {
                *a += b * sc.residual;
            }
        }
        let logits = m.output.apply(&rms(&h, &m.out_norm));
        out.push(logits.iter().map(|v| v / sc.logit).collect());
    }
    out
}

/// The maximum absolute difference of two logit vectors, and the largest
/// magnitude of the second.
fn max_error(g: &[f32], w: &[f32]) -> (f32, f32) {
    let err = g
        .iter()
        .zip(w)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    (err, w.iter().map(|v| v.abs()).fold(0f32, f32::max))
}

/// An `f16` KV cache computes what the reference does with its cached keys and
/// values rounded to `f16` (and so not what the `f32` cache computes).
#[test]
fn f16_cache_forward_matches_the_reference_with_rounded_keys_and_values() {
    let m = build(5, GgmlType::F32, [GgmlType::F32; 3]);
    let packed = m.packed(1);
    let fmt = packed.format;
    let mut ex = Resident::new(|l, e| fmt.matrices(packed.bytes(l, e)));
    let got = decode_f16(&m, &mut ex);
    let want = reference_with(&m, true);
    let f32_cache = resident(&m);
    let mut differs = false;
    for (t, ((g, w), f)) in got.iter().zip(&want).zip(&f32_cache).enumerate() {
        let (err, scale) = max_error(g, w);
        assert!(
            err <= 1e-4 * scale.max(1.0),
            "token {t}: max error {err} (scale {scale})"
        );
        differs |= g != f;
    }
    assert!(differs, "the f16 cache's logits equal the f32 cache's");
}

#[test]
fn forward_matches_plain_f32_reference() {
    // F32 weights everywhere: the engine's only approximations are float rounding.
    for m in [
        build(5, GgmlType::F32, [GgmlType::F32; 3]),
        build_oss(5, GgmlType::F32, [GgmlType::F32; 3]),
        build_glm(5, GgmlType::F32, [GgmlType::F32; 3]),
        build_llama4(5, GgmlType::F32, [GgmlType::F32; 3]),
        build_granite(5, GgmlType::F32, [GgmlType::F32; 3]),
        build_smallthinker(5, GgmlType::F32, [GgmlType::F32; 3]),
    ] {
        check_against_reference(&m);
    }
}

/// The SmallThinker variant's parts each matter: routing on the FFN's normed
/// input instead of the layer's, or SwiGLU experts, move the engine's logits;
/// with them, they are the reference's.
#[test]
fn smallthinker_variant_exercises_its_parts() {
    let m = build_smallthinker(5, GgmlType::F32, [GgmlType::F32; 3]);
    let want = resident(&m);
    let moved = |f: &dyn Fn(&mut MoeParams)| {
        let mut m2 = build_smallthinker(5, GgmlType::F32, [GgmlType::F32; 3]);
        f(m2.hp.moe.as_mut().unwrap());
        resident(&m2) != want
    };
    assert!(moved(&|m| m.route_before_attention = false));
    assert!(moved(&|m| m.act = ExpertAct::SwiGlu));
    check_against_reference(&m);
}

/// Each of the Granite variant's multipliers moves the logits; with them,
/// they are the reference's.
#[test]
fn granite_variant_exercises_its_scales() {
    let m = build_granite(5, GgmlType::F32, [GgmlType::F32; 3]);
    let want = resident(&m);
    let moved = |f: &dyn Fn(&mut Scales)| {
        let mut m2 = build_granite(5, GgmlType::F32, [GgmlType::F32; 3]);
        f(&mut m2.hp.scales);
        resident(&m2) != want
    };
    assert!(moved(&|s| s.embedding = 1.0));
    assert!(moved(&|s| s.residual = 1.0));
    assert!(moved(&|s| s.attention = None));
    assert!(moved(&|s| s.logit = 1.0));
    check_against_reference(&m);
}

/// The Llama 4 variant's parts each matter: without its chunks, its NoPE
/// layer or that layer's temperature, its norms or its weighted inputs the
/// engine's logits move; with them, they are the reference's. (Ranking by
/// logit: the router's tests; norms of unit weight before or after RoPE differ
/// by roundings only, a rotation keeping a head's length.)
#[test]
fn llama4_variant_exercises_its_parts() {
    let m = build_llama4(5, GgmlType::F32, [GgmlType::F32; 3]);
    let want = resident(&m);
    let moved = |f: &dyn Fn(&mut Model)| {
        let mut m2 = build_llama4(5, GgmlType::F32, [GgmlType::F32; 3]);
        f(&mut m2);
        resident(&m2) != want
    };
    let each = |m: &mut Model, f: &dyn Fn(&mut Llama4Layer)| {
        m.layers
            .iter_mut()
            .for_each(|l| f(l.llama4.as_mut().unwrap()))
    };
    assert!(moved(&|m| each(m, &|l| l.chunk = None)));
    assert!(moved(&|m| each(m, &|l| l.nope = None)));
    let flat = AttnTemperature {
        scale: 0.0,
        ..LLAMA4_TEMPERATURE
    };
    assert!(moved(&|m| each(m, &|l| l.nope = l.nope.map(|_| flat))));
    assert!(moved(&|m| m
        .layers
        .iter_mut()
        .for_each(|l| l.q_norm.fill(2.0))));
    assert!(moved(&|m| m.hp.moe.as_mut().unwrap().weight_inputs = false));
    check_against_reference(&m);
}

/// The gpt-oss variant's parts each matter: without its sinks, windows or
/// biases the reference's logits move.
#[test]
fn gpt_oss_variant_exercises_its_parts() {
    let m = build_oss(5, GgmlType::F32, [GgmlType::F32; 3]);
    let want = reference(&m);
    let moved = |mut f: Box<dyn FnMut(&mut Model)>| {
        let mut m2 = build_oss(5, GgmlType::F32, [GgmlType::F32; 3]);
        f(&mut m2);
        reference(&m2) != want
    };
    assert!(moved(Box::new(|m| m.layers.iter_mut().for_each(|l| l
        .oss
        .as_mut()
        .unwrap()
        .sinks
        .fill(-1e9)))));
    assert!(moved(Box::new(|m| m.layers.iter_mut().for_each(|l| l
        .oss
        .as_mut()
        .unwrap()
        .window =
        None))));
    assert!(moved(Box::new(|m| m.layers.iter_mut().for_each(|l| l
        .oss
        .as_mut()
        .unwrap()
        .expert_bias[0]
        .fill(0.0)))));
    assert!(moved(Box::new(|m| m.hp.rope_yarn = None)));
}

fn check_against_reference(m: &Model) {
    assert_close(&resident(m), &reference(m), 1e-4, "forward");
}

/// The GLM variant's selection bias and scale each matter: without them the
/// reference's logits move (the bias changes picks, not just weights).
#[test]
fn glm_variant_exercises_its_parts() {
    let m = build_glm(5, GgmlType::F32, [GgmlType::F32; 3]);
    let want = reference(&m);
    let mut m2 = build_glm(5, GgmlType::F32, [GgmlType::F32; 3]);
    for l in &mut m2.layers {
        if let Some(b) = &mut l.selection_bias {
            b.fill(0.0);
        }
    }
    assert!(reference(&m2) != want, "the selection bias changes nothing");
    // A bias shared by every expert reorders nothing: the logits stay.
    let mut m3 = build_glm(5, GgmlType::F32, [GgmlType::F32; 3]);
    for l in &mut m3.layers {
        if let Some(b) = &mut l.selection_bias {
            b.fill(0.3);
        }
    }
    let mut m4 = build_glm(5, GgmlType::F32, [GgmlType::F32; 3]);
    for l in &mut m4.layers {
        if let Some(b) = &mut l.selection_bias {
            b.fill(-0.2);
        }
    }
    assert!(reference(&m3) == reference(&m4));
    check_against_reference(&m3);
}

/// One pass of [`ring_run`]: `tokens` at positions `pos..` (one with
/// [`forward`], more with [`forward_batch`] and every position's logits).
struct Pass {
    pos: usize,
    tokens: Vec<u32>,
}

/// Positions [`ring_run`]'s caches hold.
const RING_POSITIONS: usize = 40;

/// The gpt-oss variant through `passes` over a cache of [`RING_POSITIONS`]
/// with its windowed layers in `ring` (or none), `f16` or `f32`: each pass's
/// logits, or its error.
fn ring_run(
    m: &Model,
    passes: &[Pass],
    ring: Option<KvRing>,
    f16: bool,
) -> Vec<Result<Vec<f32>, String>> {
    let (hp, n) = (m.hp, RING_POSITIONS);
    let hy = HybridParams::plain(&hp);
    let layout = KvLayout::new(&hp, &hy, n, ring).unwrap();
    let len = layout.len();
    let (mut k32, mut v32, mut k16, mut v16) = (
        vec![0f32; len],
        vec![0f32; len],
        vec![0u16; len],
        vec![0u16; len],
    );
    let (k, v) = if f16 {
        (KvBuf::F16(&mut k16), KvBuf::F16(&mut v16))
    } else {
        (KvBuf::F32(&mut k32), KvBuf::F32(&mut v32))
    };
    let mut kv = KvCache::with_layout(&hp, layout, k, v).expect("sized");
    let mut scratch = vec![0f32; Scratch::len(&hp, n)];
    let mut s = Scratch::new(&hp, &mut scratch, n).unwrap();
    let mut floats = vec![0f32; BatchScratch::floats(&hp, &hy, 8)];
    let mut ids = vec![0u16; BatchScratch::ids(&hp, &hy, 8)];
    let mut bs = BatchScratch::new(&hp, &hy, 8, &mut floats, &mut ids).unwrap();
    let mut quant = QuantScratch::new();
    let mut mv = quant.matvec();
    let packed = m.packed(1);
    let fmt = packed.format;
    let mut ex = Resident::new(|l, e| fmt.matrices(packed.bytes(l, e)));
    passes
        .iter()
        .map(|p| {
            let mut logits = vec![0f32; hp.n_vocab * p.tokens.len()];
            let inputs: Vec<TokenInput<'_>> =
                p.tokens.iter().map(|&t| TokenInput::Token(t)).collect();
            let r = match inputs[..] {
                [one] => forward(
                    &hp,
                    m,
                    &mut mv,
                    &mut ex,
                    None,
                    one,
                    p.pos,
                    &mut kv,
                    &mut s,
                    &mut logits,
                ),
                _ => forward_batch(
                    &hp,
                    &hy,
                    m,
                    &mut mv,
                    &mut ex,
                    &inputs,
                    p.pos,
                    &mut kv,
                    &mut RecurrentState::empty(),
                    &mut s,
                    &mut bs,
                    &mut logits,
                ),
            };
            r.map(|()| logits).map_err(|e| format!("{e:?}"))
        })
        .collect()
}

/// A speculative decode's passes over `positions`: a prompt batch of `first`,
/// then drafts of `draft` checked at once, of which a varying number stand
/// (the rest are overwritten by the next pass, as after a rejected draft).
fn speculative_passes(m: &Model, first: usize, draft: usize, positions: usize) -> Vec<Pass> {
    let mut rng = Rng(77);
    let mut token = || (rng.next() % m.hp.n_vocab as u64) as u32;
    let mut passes = vec![Pass {
        pos: 0,
        tokens: (0..first).map(|_| token()).collect(),
    }];
    let (mut pos, mut i) = (first, 0);
    while pos + draft <= positions {
        passes.push(Pass {
            pos,
            tokens: (0..draft).map(|_| token()).collect(),
        });
        pos += 1 + i % draft;
        i += 1;
    }
    passes
}

/// Sliding-window layers kept in rings (llama.cpp's SWA cache) give the
/// logits of a full cache bit for bit, `f32` and `f16`, one position at a
/// time and in batches with drafts rejected and overwritten, over many turns
/// of the rings; a pass longer than a ring holds, or a layer without a
/// window over a ring, is an error, never a wrong answer.
#[test]
fn sliding_window_rings_equal_a_full_cache() {
    let oss = build_oss(
        21,
        GgmlType::Q8_0,
        [GgmlType::MXFP4, GgmlType::MXFP4, GgmlType::Q8_0],
    );
    let window = SlidingWindow {
        window: OSS_WINDOW,
        pattern: 2,
    };
    // Llama 4's chunked layers (0 and 2 here) in rings of a chunk: a query
    // sees at most a chunk back.
    let llama4 = build_llama4(
        21,
        GgmlType::Q8_0,
        [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4_1],
    );
    let chunks = SlidingWindow {
        window: LLAMA4_CHUNK,
        pattern: 2,
    };
    for (m, window) in [(&oss, window), (&llama4, chunks)] {
        let one_at_a_time: Vec<Pass> = speculative_passes(m, 1, 1, RING_POSITIONS);
        for (passes, largest) in [
            (one_at_a_time, 1),
            (speculative_passes(m, 4, 4, RING_POSITIONS), 4),
            (speculative_passes(m, 2, 3, RING_POSITIONS), 3),
        ] {
            let ring = KvRing::for_passes(window, largest);
            assert!(3 * ring.span < RING_POSITIONS, "the rings turn over");
            for f16 in [false, true] {
                let want = ring_run(m, &passes, None, f16);
                let got = ring_run(m, &passes, Some(ring), f16);
                for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                    let (w, g) = (w.clone().unwrap(), g.clone().unwrap());
                    assert_bits_eq(
                        &[w],
                        &[g],
                        &format!("pass {i} at {} (f16 {f16})", passes[i].pos),
                    );
                }
            }
            // A ring for shorter passes refuses the longest.
            if largest > 1 {
                let short = KvRing::for_passes(window, largest - 1);
                let got = ring_run(m, &passes, Some(short), false);
                let first = passes
                    .iter()
                    .position(|p| p.tokens.len() == largest)
                    .unwrap();
                assert!(got[..first].iter().all(|r| r.is_ok()));
                let err = got[first].as_ref().unwrap_err();
                assert!(err.contains("ring"), "{err}");
            }
        }
    }
    let m = oss;
    // Rings on the even layers, which here attend to all positions: once the
    // positions outgrow the window, an error.
    let mut full = build_oss(
        21,
        GgmlType::Q8_0,
        [GgmlType::MXFP4, GgmlType::MXFP4, GgmlType::Q8_0],
    );
    for l in &mut full.layers {
        l.oss.as_mut().unwrap().window = None;
    }
    let got = ring_run(
        &full,
        &speculative_passes(&m, 1, 1, 8),
        Some(KvRing::for_passes(window, 1)),
        false,
    );
    assert!(got[..OSS_WINDOW].iter().all(|r| r.is_ok()));
    assert!(got[OSS_WINDOW].as_ref().unwrap_err().contains("ring"));
}
