//! The qwen35moe forward pass (gated DeltaNet layers interleaved with gated
//! attention, routed plus gated shared experts) on a tiny model: its math against a
//! plain f32 reference written here (per-token DeltaNet recurrence over an explicit
//! state matrix, naive attention), offloaded == resident bit for bit for every
//! schedule, and the sequence state living entirely in the caller's KV cache and
//! recurrent state (a run interrupted and resumed from copies of them equals an
//! uninterrupted one, and position 0 starts afresh over dirty buffers).

mod forward_common;

use forward_common::{
    assert_bits_eq, assert_close, resident_experts, Decode, Lookup, Mat, PackedExperts,
    PackedModel, QuantScratch, Rng, SeqBuffers, SeqDecoder, StreamedRun, TestModel,
};
use les_core::gemv::MatrixView;
use les_core::model::config::{DeltaNetShape, Hparams, HybridParams, LinearShape, MoeParams};
use les_core::model::deltanet::DeltaNetWeights;
use les_core::model::experts::{ExpertFormat, Resident};
use les_core::model::forward::nextn::{cache_params, forward_nextn, NextnBlock};
use les_core::model::forward::{
    forward_hybrid, AttentionWeights, Block, Experts, Ffn, KvCache, Lookahead, Mixer, Place,
    RecurrentState, Scratch, SharedExpert, TokenInput, Weights,
};
use les_core::model::ops::{rms_norm, RopeStyle};
use les_core::quant::GgmlType;
use les_core::router::{Gating, LayerMask, PredictorConfig};
use les_core::schedule::SchedulerConfig;

struct Attn {
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

struct Delta {
    qkv: Mat,
    gate: Mat,
    beta: Mat,
    alpha: Mat,
    dt_bias: Vec<f32>,
    a: Vec<f32>,
    conv: Vec<f32>,
    norm: Vec<f32>,
    out: Mat,
}

enum Mix {
    Attn(Attn),
    Delta(Delta),
}

struct Layer {
    attn_norm: Vec<f32>,
    mix: Mix,
    post_norm: Vec<f32>,
    router: Mat,
    shared: [Mat; 3],
    shared_gate: Mat,
}

const N_EXP: usize = 8;
const TOP_K: usize = 2;
const FF: usize = 32;

struct Model {
    hp: Hparams,
    hy: HybridParams,
    embd: Mat,
    out_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
    experts: Vec<Vec<[Mat; 3]>>,
    image: Vec<u8>,
    offsets: Vec<Vec<usize>>,
    expert_ty: [GgmlType; 3],
}

const DELTA: DeltaNetShape = DeltaNetShape {
    n_k_heads: 2,
    n_v_heads: 4,
    head_dim: 16,
    conv_kernel: 4,
    grouped_values: false,
};

/// Layers 0 and 2 are DeltaNet, 1 and 3 gated attention.
fn is_linear(l: usize) -> bool {
    l.is_multiple_of(2)
}

fn build(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3], sections: [u32; 4]) -> Model {
    build_with(seed, ty, expert_ty, Some(sections), false)
}

/// The qwen3next variant of [`build`]: plain (NeoX) partial RoPE, and value
/// heads grouped by key head. Its reference is [`reference`] with sections
/// `[2, 1, 1, 0]`, which rotate every pair by the position as plain RoPE does.
fn build_next(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3]) -> Model {
    build_with(seed, ty, expert_ty, None, true)
}

/// Every pair rotated by the text position: plain RoPE in the reference.
const PLAIN_ROPE: [u32; 4] = [2, 1, 1, 0];

fn build_with(
    seed: u64,
    ty: GgmlType,
    expert_ty: [GgmlType; 3],
    sections: Option<[u32; 4]>,
    grouped_values: bool,
) -> Model {
    let mut rng = Rng(seed);
    let hp = Hparams {
        n_layers: 4,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        n_rot: 8,
        n_vocab: 40,
        n_ff: 0,
        rope_base: 10000.0,
        rope_style: RopeStyle::Neox,
        norm_eps: 1e-6,
        moe: Some(MoeParams {
            n_experts: N_EXP,
            top_k: TOP_K,
            n_ff_exp: FF,
            gating: Gating::Softmax,
            normalize: true,
            weights_scale: 1.0,
            n_ff_shared: Some(FF),
            act: les_core::model::config::ExpertAct::SwiGlu,
            groups: None,
            weight_inputs: false,
            route_before_attention: false,
        }),
        rope_yarn: None,
        scales: les_core::model::config::Scales::NONE,
    };
    let d = DeltaNetShape {
        grouped_values,
        ..DELTA
    };
    let hy = HybridParams {
        n_attn_layers: 2,
        linear: Some((2, LinearShape::DeltaNet(d))),
        n_ffn_only_layers: 0,
        attn_output_gate: true,
        rope_sections: sections.map(|sections| les_core::model::config::Mrope {
            sections,
            interleaved: true,
        }),
        n_deepstack: 0,
        mla: None,
    };
    hy.validate(&hp).unwrap();
    let e = hp.n_embd;
    let mut layers = Vec::new();
    let mut experts = Vec::new();
    let mut image = Vec::new();
    let mut offsets = Vec::new();
    for l in 0..hp.n_layers {
        let attn_norm = rng.vec(e, 0.1, 1.0);
        let mix = if is_linear(l) {
            Mix::Delta(Delta {
                qkv: Mat::new(&mut rng, ty, d.conv_dim(), e, 0.15),
                gate: Mat::new(&mut rng, ty, d.value_dim(), e, 0.15),
                beta: Mat::new(&mut rng, ty, d.n_v_heads, e, 0.15),
                alpha: Mat::new(&mut rng, ty, d.n_v_heads, e, 0.15),
                dt_bias: rng.vec(d.n_v_heads, 0.1, 1.0),
                a: (0..d.n_v_heads).map(|_| -0.05 - rng.uniform()).collect(),
                conv: rng.vec(d.conv_dim() * d.conv_kernel, 0.5, 0.0),
                norm: rng.vec(d.head_dim, 0.1, 1.0),
                out: Mat::new(&mut rng, ty, e, d.value_dim(), 0.15),
            })
        } else {
            Mix::Attn(gated_attention(&mut rng, ty, &hp))
        };
        layers.push(moe_layer(&mut rng, ty, e, attn_norm, mix));
        let mut le = Vec::new();
        let mut lo = Vec::new();
        for _ in 0..N_EXP {
            let m = expert(&mut rng, expert_ty, e);
            lo.push(image.len());
            for p in &m {
                image.extend_from_slice(&p.bytes);
            }
            le.push(m);
        }
        experts.push(le);
        offsets.push(lo);
    }
    Model {
        hp,
        hy,
        embd: Mat::new(&mut rng, ty, hp.n_vocab, e, 1.0),
        out_norm: rng.vec(e, 0.1, 1.0),
        output: Mat::new(&mut rng, ty, hp.n_vocab, e, 0.2),
        layers,
        experts,
        image,
        offsets,
        expert_ty,
    }
}

fn gated_attention(rng: &mut Rng, ty: GgmlType, hp: &Hparams) -> Attn {
    let e = hp.n_embd;
    Attn {
        wq: Mat::new(rng, ty, 2 * hp.q_dim(), e, 0.15),
        wk: Mat::new(rng, ty, hp.kv_dim(), e, 0.15),
        wv: Mat::new(rng, ty, hp.kv_dim(), e, 0.15),
        wo: Mat::new(rng, ty, e, hp.q_dim(), 0.15),
        q_norm: rng.vec(hp.head_dim, 0.1, 1.0),
        k_norm: rng.vec(hp.head_dim, 0.1, 1.0),
    }
}

/// A layer of `mix` with a router, a gated shared expert and norms.
fn moe_layer(rng: &mut Rng, ty: GgmlType, e: usize, attn_norm: Vec<f32>, mix: Mix) -> Layer {
    Layer {
        attn_norm,
        mix,
        post_norm: rng.vec(e, 0.1, 1.0),
        router: Mat::new(rng, GgmlType::F32, N_EXP, e, 0.5),
        shared: [
            Mat::new(rng, ty, FF, e, 0.15),
            Mat::new(rng, ty, FF, e, 0.15),
            Mat::new(rng, ty, e, FF, 0.15),
        ],
        shared_gate: Mat::new(rng, GgmlType::F32, 1, e, 0.3),
    }
}

/// One routed expert's gate, up and down.
fn expert(rng: &mut Rng, ty: [GgmlType; 3], e: usize) -> [Mat; 3] {
    [
        Mat::new(rng, ty[0], FF, e, 0.2),
        Mat::new(rng, ty[1], FF, e, 0.2),
        Mat::new(rng, ty[2], e, FF, 0.2),
    ]
}

impl Weights for Model {
    fn block(&self, l: usize) -> Block<'_> {
        layer_block(&self.layers[l], self.delta())
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

/// The engine's view of a layer's resident weights.
fn layer_block(ly: &Layer, shape: DeltaNetShape) -> Block<'_> {
    {
        let mixer = match &ly.mix {
            Mix::Attn(a) => Mixer::Attention(AttentionWeights {
                wq: a.wq.view(),
                wk: a.wk.view(),
                wv: a.wv.view(),
                wo: a.wo.view(),
                bq: None,
                bk: None,
                bv: None,
                q_norm: Some(&a.q_norm),
                k_norm: Some(&a.k_norm),
                bo: None,
                sinks: None,
                window: None,
                rope_freqs: None,
                norm_after_rope: false,
                nope: None,
            }),
            Mix::Delta(d) => Mixer::DeltaNet(DeltaNetWeights {
                shape,
                qkv: d.qkv.view(),
                gate: d.gate.view(),
                beta: d.beta.view(),
                alpha: d.alpha.view(),
                dt_bias: &d.dt_bias,
                a: &d.a,
                conv: &d.conv,
                norm: &d.norm,
                out: d.out.view(),
            }),
        };
        let [g, u, dn] = &ly.shared;
        Block {
            attn_norm: &ly.attn_norm,
            mixer,
            ffn_norm: &ly.post_norm,
            ffn: Ffn::Moe {
                router: ly.router.view(),
                shared: Some(SharedExpert {
                    gate: Some(g.view()),
                    up: u.view(),
                    down: dn.view(),
                    gate_inp: Some(ly.shared_gate.view()),
                }),
                expert_bias: None,
                router_bias: None,
                selection_bias: None,
            },
        }
    }
}

impl Model {
    /// The DeltaNet layers' shape.
    fn delta(&self) -> DeltaNetShape {
        self.hy.linear.and_then(|(_, s)| s.delta_net()).unwrap()
    }

    fn format(&self) -> ExpertFormat {
        ExpertFormat {
            gate: Some(self.expert_ty[0]),
            up: self.expert_ty[1],
            down: self.expert_ty[2],
            n_embd: self.hp.n_embd,
            n_ff: FF,
        }
    }
}

const TOKENS: [u32; 9] = [3, 17, 5, 39, 0, 22, 22, 8, 31];

impl TestModel for Model {
    fn hp(&self) -> &Hparams {
        &self.hp
    }
    fn hy(&self) -> &HybridParams {
        &self.hy
    }
}

impl PackedModel for Model {
    fn packed(&self) -> PackedExperts<'_> {
        PackedExperts {
            image: &self.image,
            offsets: &self.offsets,
            format: self.format(),
            parts: 1,
        }
    }
}

/// [`SeqBuffers`] for [`TOKENS`]: `Buffers::new(&model, TOKENS.len())`.
type Buffers = SeqBuffers;

fn resident(m: &Model) -> Vec<Vec<f32>> {
    Buffers::new(m, TOKENS.len()).run(m, &mut resident_experts(m), None, 0, &TOKENS)
}

/// The les schedule streaming `experts` through `slots` (predictions on,
/// a top-`TOP_K` lookahead one layer ahead on every layer of `n_layers`),
/// its completion order and faults picked by `seed`.
fn les_run<'a>(
    experts: &'a PackedExperts<'a>,
    n_layers: usize,
    slots: usize,
    seed: u64,
) -> StreamedRun<'a> {
    StreamedRun {
        experts,
        n_layers,
        n_experts: N_EXP,
        slots,
        predict: true,
        seed,
        config: SchedulerConfig::les(),
        lookahead: Lookahead {
            predictor: PredictorConfig::top_k(TOP_K),
            layers: LayerMask::first(n_layers).unwrap(),
            depth: 1,
        },
    }
}

fn streamed(
    m: &Model,
    slots: usize,
    predict: bool,
    seed: u64,
    cfg: SchedulerConfig,
) -> Vec<Vec<f32>> {
    let experts = m.packed();
    let n_layers = m.hp.n_layers;
    let out = StreamedRun {
        experts: &experts,
        n_layers,
        n_experts: N_EXP,
        slots,
        predict,
        seed,
        config: cfg,
        lookahead: Lookahead {
            predictor: PredictorConfig::top_k(TOP_K),
            layers: LayerMask::first(n_layers).unwrap(),
            depth: 2,
        },
    }
    .run(&mut SeqDecoder(m, &TOKENS));
    let st = out.stats;
    assert_eq!(
        st.misses + st.hits + st.late_hits,
        (TOKENS.len() * n_layers * TOP_K) as u64,
        "{st:?}"
    );
    if predict && cfg.prefetch {
        // Lookahead runs from every layer, DeltaNet ones included, and from the
        // token's embedding for the first layers: every layer gets predicted.
        assert!(st.prefetches > 0, "{st:?}");
        assert!(
            out.layers.iter().all(|l| l.predicted > 0),
            "{:?}",
            out.layers
        );
    }
    out.logits
}

#[test]
fn streamed_equals_resident_bit_for_bit() {
    for (ty, ety) in [
        (
            GgmlType::Q8_0,
            [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0],
        ),
        (
            GgmlType::F16,
            [GgmlType::Q8_0, GgmlType::Q5_1, GgmlType::Q4_1],
        ),
    ] {
        for m in [build(11, ty, ety, [2, 1, 1, 0]), build_next(11, ty, ety)] {
            let want = resident(&m);
            let mut seed = 1;
            for slots in [TOP_K, 3, 5, 16] {
                for predict in [false, true] {
                    for cfg in [SchedulerConfig::les(), SchedulerConfig::on_demand()] {
                        seed += 1;
                        let got = streamed(&m, slots, predict, seed, cfg);
                        assert_bits_eq(
                            &got,
                            &want,
                            &format!("{ty} slots={slots} predict={predict} {cfg:?}"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn sequence_state_lives_in_the_kv_cache_and_recurrent_state() {
    let m = build(7, GgmlType::Q8_0, [GgmlType::Q4_0; 3], [2, 1, 1, 0]);
    let want = resident(&m);
    for split in [1, 4, TOKENS.len() - 1] {
        // Prefill the first `split` tokens, then carry only the KV cache and the
        // recurrent state (copied) into fresh buffers, and decode the rest.
        let mut a = Buffers::new(&m, TOKENS.len());
        let mut got = a.run(&m, &mut resident_experts(&m), None, 0, &TOKENS[..split]);
        let mut b = Buffers::new(&m, TOKENS.len());
        b.kv_k.copy_from_slice(&a.kv_k);
        b.kv_v.copy_from_slice(&a.kv_v);
        b.conv.copy_from_slice(&a.conv);
        b.ssm.copy_from_slice(&a.ssm);
        got.extend(b.run(&m, &mut resident_experts(&m), None, split, &TOKENS[split..]));
        assert_bits_eq(&got, &want, &format!("prefill {split} then decode"));
    }
    // Position 0 starts a new sequence, whatever the buffers held.
    let mut dirty = Buffers::new(&m, TOKENS.len());
    dirty.run(&m, &mut resident_experts(&m), None, 0, &[9, 9, 1, 2, 3]);
    let again = dirty.run(&m, &mut resident_experts(&m), None, 0, &TOKENS);
    assert_bits_eq(&again, &want, "reused buffers");
    // And the recurrent state matters: without it the logits change.
    let mut b = Buffers::new(&m, TOKENS.len());
    let mut a = Buffers::new(&m, TOKENS.len());
    a.run(&m, &mut resident_experts(&m), None, 0, &TOKENS[..4]);
    b.kv_k.copy_from_slice(&a.kv_k);
    b.kv_v.copy_from_slice(&a.kv_v);
    let lost = b.run(&m, &mut resident_experts(&m), None, 4, &TOKENS[4..5]);
    assert_ne!(lost[0], want[4], "DeltaNet state had no effect");
}

/// Batches through DeltaNet and gated attention layers, with the sigmoid-gated
/// shared expert, resident and streamed: the last position's logits (or every
/// position's) and the state the next positions see are those of one position
/// at a time, bit for bit.
#[test]
fn batched_prefill_equals_one_position_at_a_time() {
    let m = build(5, GgmlType::Q8_0, [GgmlType::Q4_0; 3], [2, 1, 1, 0]);
    let want = resident(&m);
    for split in [2, 4, TOKENS.len()] {
        for every in [false, true] {
            let mut b = Buffers::new(&m, TOKENS.len());
            let got = b.run_batch(&m, &mut resident_experts(&m), 0, &TOKENS[..split], every);
            let first = if every { 0 } else { split - 1 };
            assert_bits_eq(
                &got,
                &want[first..split],
                &format!("batch of {split}, every position's logits: {every}"),
            );
            let rest = b.run(&m, &mut resident_experts(&m), None, split, &TOKENS[split..]);
            assert_bits_eq(
                &rest,
                &want[split..],
                &format!("decode after a batch of {split}"),
            );
        }
    }
    // Streamed, with as few slots as a token's picks: groups of TOP_K.
    struct Batched<'m>(&'m Model);
    impl Decode for Batched<'_> {
        fn decode<X: Experts>(&mut self, experts: &mut X, _: Option<&Lookahead>) -> Vec<Vec<f32>>
        where
            X::Error: std::fmt::Debug,
        {
            let mut b = Buffers::new(self.0, TOKENS.len());
            let mut out = b.run_batch(self.0, experts, 0, &TOKENS[..4], true);
            out.extend(b.run(self.0, experts, None, 4, &TOKENS[4..]));
            out
        }
    }
    let experts = m.packed();
    for (seed, slots) in [(3, TOP_K), (4, 5), (5, 16)] {
        let got = les_run(&experts, m.hp.n_layers, slots, seed)
            .run(&mut Batched(&m))
            .logits;
        assert_bits_eq(
            &got[..4],
            &want[..4],
            &format!("streamed batch, {slots} slots"),
        );
        assert_bits_eq(
            &got[4..],
            &want[4..],
            &format!("streamed decode, {slots} slots"),
        );
    }
}

/// The reference's sequence state, per layer slot: past keys and values
/// (attention), past projections and `S[h][i][j]` (DeltaNet).
struct RefSeq {
    keys: Vec<Vec<Vec<f32>>>,
    vals: Vec<Vec<Vec<f32>>>,
    hist: Vec<Vec<Vec<f32>>>,
    state: Vec<Vec<Vec<Vec<f64>>>>,
}

impl RefSeq {
    fn new(slots: usize) -> RefSeq {
        RefSeq {
            keys: vec![Vec::new(); slots],
            vals: vec![Vec::new(); slots],
            hist: vec![Vec::new(); slots],
            state: vec![
                vec![vec![vec![0f64; DELTA.head_dim]; DELTA.head_dim]; DELTA.n_v_heads];
                slots
            ],
        }
    }
}

fn ref_rms(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| (*v as f64 * s) as f32 * w)
        .collect()
}

/// One layer of a plain f32 qwen35moe, written from the architecture description
/// with no shared code: DeltaNet as an explicit per-token recurrence over
/// `S[i][j]`, attention over explicit past keys and values. Adds the layer's
/// mixer and FFN outputs to `h` at `pos`, with its sequence state in slot `l` of
/// `seq` and its routed experts `experts`.
#[allow(clippy::too_many_arguments)]
fn ref_layer(
    m: &Model,
    sections: [u32; 4],
    ly: &Layer,
    experts: &[[Mat; 3]],
    l: usize,
    pos: usize,
    rope_pos: [u32; 4],
    h: &mut [f32],
    seq: &mut RefSeq,
) {
    let hp = m.hp;
    let d = m.delta();
    let eps = hp.norm_eps as f64;
    let rms = |x: &[f32], w: &[f32]| ref_rms(x, w, eps);
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x as f64).exp()) as f32;
    let silu = |x: f32| x * sigmoid(x);
    let softplus = |x: f32| (1.0 + (x as f64).exp()).ln() as f32;
    let l2 = |x: &[f32]| -> Vec<f32> {
        let n = (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() + eps).sqrt();
        x.iter().map(|v| (*v as f64 / n) as f32).collect()
    };
    // IMRoPE over the first n_rot dims, NeoX pairs: pair i takes the
    // temporal, row, column or extra position by its sector.
    let rope = |x: &mut [f32], pos: [u32; 4]| {
        let total: usize = sections.iter().map(|s| *s as usize).sum();
        let s = sections.map(|v| v as usize);
        let half = hp.n_rot / 2;
        for h in x.chunks_mut(hp.head_dim) {
            for i in 0..half {
                let sector = i % total;
                let which = if sector % 3 == 1 && sector < 3 * s[1] {
                    1
                } else if sector % 3 == 2 && sector < 3 * s[2] {
                    2
                } else if sector.is_multiple_of(3) && sector < 3 * s[0] {
                    0
                } else {
                    3
                };
                let p = pos[which] as f64;
                let theta = p * (hp.rope_base as f64).powf(-2.0 * i as f64 / hp.n_rot as f64);
                let (a, b) = (h[i] as f64, h[i + half] as f64);
                h[i] = (a * theta.cos() - b * theta.sin()) as f32;
                h[i + half] = (a * theta.sin() + b * theta.cos()) as f32;
            }
        }
    };
    let ffn = |w: &[Mat; 3], x: &[f32]| -> Vec<f32> {
        let g = w[0].apply(x);
        let u = w[1].apply(x);
        let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        w[2].apply(&a)
    };
    let hd = hp.head_dim;
    let x = rms(h, &ly.attn_norm);
    let o = match &ly.mix {
        Mix::Attn(a) => {
            let qg = a.wq.apply(&x);
            let mut q = Vec::new();
            let mut gate = Vec::new();
            for head in 0..hp.n_head {
                q.extend(rms(&qg[2 * head * hd..][..hd], &a.q_norm));
                gate.extend_from_slice(&qg[(2 * head + 1) * hd..][..hd]);
            }
            let mut k = Vec::new();
            for kh in a.wk.apply(&x).chunks(hd) {
                k.extend(rms(kh, &a.k_norm));
            }
            rope(&mut q, rope_pos);
            rope(&mut k, rope_pos);
            seq.keys[l].push(k);
            seq.vals[l].push(a.wv.apply(&x));
            let mut att = vec![0f32; hp.q_dim()];
            for head in 0..hp.n_head {
                let kvh = head / (hp.n_head / hp.n_head_kv);
                let qh = &q[head * hd..][..hd];
                let scores: Vec<f64> = seq.keys[l]
                    .iter()
                    .map(|k| {
                        qh.iter()
                            .zip(&k[kvh * hd..][..hd])
                            .map(|(a, b)| (*a * *b) as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
                for (p, v) in scores.iter().zip(&seq.vals[l]) {
                    let w = (p - mx).exp() / z;
                    for i in 0..hd {
                        att[head * hd + i] += (w * v[kvh * hd + i] as f64) as f32;
                    }
                }
                for i in 0..hd {
                    att[head * hd + i] *= sigmoid(gate[head * hd + i]);
                }
            }
            a.wo.apply(&att)
        }
        Mix::Delta(w) => {
            seq.hist[l].push(w.qkv.apply(&x));
            let z = w.gate.apply(&x);
            let beta: Vec<f32> = w.beta.apply(&x).into_iter().map(sigmoid).collect();
            let alpha = w.alpha.apply(&x);
            let kk = d.conv_kernel;
            let conv: Vec<f32> = (0..d.conv_dim())
                .map(|c| {
                    let mut acc = 0f64;
                    for j in 0..kk {
                        // Tap j sees the input j - (K-1) tokens from now.
                        let back = kk - 1 - j;
                        if let Some(p) = pos.checked_sub(back) {
                            acc += w.conv[c * kk + j] as f64 * seq.hist[l][p][c] as f64;
                        }
                    }
                    silu(acc as f32)
                })
                .collect();
            let (kd, hdv) = (d.key_dim(), d.head_dim);
            let mut o = Vec::new();
            for vh in 0..d.n_v_heads {
                // qwen3next's value heads are grouped by key head, qwen35's tiled.
                let kh = if d.grouped_values {
                    vh / (d.n_v_heads / d.n_k_heads)
                } else {
                    vh % d.n_k_heads
                };
                let q = l2(&conv[kh * hdv..][..hdv]);
                let k = l2(&conv[kd + kh * hdv..][..hdv]);
                let v = &conv[2 * kd + vh * hdv..][..hdv];
                let g = softplus(alpha[vh] + w.dt_bias[vh]) * w.a[vh];
                let s = &mut seq.state[l][vh];
                let decay = (g as f64).exp();
                for row in s.iter_mut() {
                    for x in row.iter_mut() {
                        *x *= decay;
                    }
                }
                // d_j = (v_j - sum_i S_ij k_i) * beta; S_ij += k_i d_j.
                let dj: Vec<f64> = (0..hdv)
                    .map(|j| {
                        let mem: f64 = (0..hdv).map(|i| s[i][j] * k[i] as f64).sum();
                        (v[j] as f64 - mem) * beta[vh] as f64
                    })
                    .collect();
                for i in 0..hdv {
                    for j in 0..hdv {
                        s[i][j] += k[i] as f64 * dj[j];
                    }
                }
                let oh: Vec<f32> = (0..hdv)
                    .map(|j| {
                        ((0..hdv).map(|i| s[i][j] * q[i] as f64).sum::<f64>() / (hdv as f64).sqrt())
                            as f32
                    })
                    .collect();
                let normed = rms(&oh, &w.norm);
                o.extend(
                    normed
                        .iter()
                        .zip(&z[vh * hdv..][..hdv])
                        .map(|(a, zz)| a * silu(*zz)),
                );
            }
            w.out.apply(&o)
        }
    };
    for (a, b) in h.iter_mut().zip(&o) {
        *a += b;
    }
    let x = rms(h, &ly.post_norm);
    let logits = ly.router.apply(&x);
    let mx = logits.iter().cloned().fold(f32::MIN, f32::max);
    let p: Vec<f32> = logits.iter().map(|v| (v - mx).exp()).collect();
    let mut idx: Vec<usize> = (0..N_EXP).collect();
    idx.sort_by(|a, b| p[*b].partial_cmp(&p[*a]).unwrap().then(a.cmp(b)));
    let top = &idx[..TOP_K];
    let sum: f32 = top.iter().map(|i| p[*i]).sum();
    let mut y = vec![0f32; hp.n_embd];
    for &i in top {
        for (a, b) in y.iter_mut().zip(ffn(&experts[i], &x)) {
            *a += p[i] / sum * b;
        }
    }
    let g = sigmoid(ly.shared_gate.apply(&x)[0]);
    for (a, b) in y.iter_mut().zip(ffn(&ly.shared, &x)) {
        *a += g * b;
    }
    for (a, b) in h.iter_mut().zip(&y) {
        *a += b;
    }
}

/// The reference's final hidden state (before the output norm) at each position
/// of [`TOKENS`].
fn reference_hidden(m: &Model, sections: [u32; 4]) -> Vec<Vec<f32>> {
    let mut seq = RefSeq::new(m.hp.n_layers);
    let mut out = Vec::new();
    for (pos, &t) in TOKENS.iter().enumerate() {
        let mut h: Vec<f32> = m.embd.f32[t as usize * m.hp.n_embd..][..m.hp.n_embd].to_vec();
        for (l, ly) in m.layers.iter().enumerate() {
            let p = pos as u32;
            ref_layer(
                m,
                sections,
                ly,
                &m.experts[l],
                l,
                pos,
                [p, p, p, 0],
                &mut h,
                &mut seq,
            );
        }
        out.push(h);
    }
    out
}

/// The reference's logits at each position of [`TOKENS`].
fn reference(m: &Model, sections: [u32; 4]) -> Vec<Vec<f32>> {
    let eps = m.hp.norm_eps as f64;
    reference_hidden(m, sections)
        .iter()
        .map(|h| m.output.apply(&ref_rms(h, &m.out_norm, eps)))
        .collect()
}

/// A prompt with an image, as llama.cpp's `mtmd` lays it out for an M-RoPE
/// model: two tokens, a 3 x 2 grid of image embeddings (each with two
/// deepstack features after it) at temporal position 2 with their rows and
/// columns added in the other sections, then two tokens from position
/// 2 + max(3, 2) = 5 on. Inputs, their places, and the reference's view.
struct ImagePrompt {
    embeddings: Vec<Vec<f32>>,
    places: Vec<Place>,
}

const DEEPSTACK: usize = 2;

impl ImagePrompt {
    fn new(e: usize) -> ImagePrompt {
        let mut rng = Rng(99);
        let (nx, ny) = (3usize, 2usize);
        let mut places = vec![Place::text(0), Place::text(1)];
        let mut embeddings = Vec::new();
        for k in 0..nx * ny {
            embeddings.push(rng.vec(e * (1 + DEEPSTACK), 0.5, 0.0));
            let (y, x) = ((k / nx) as u32, (k % nx) as u32);
            places.push(Place {
                index: 2 + k,
                rope: [2, 2 + y, 2 + x, 0],
            });
        }
        let next = 2 + nx.max(ny) as u32;
        places.push(Place::text_at(8, next));
        places.push(Place::text_at(9, next + 1));
        ImagePrompt { embeddings, places }
    }

    fn inputs(&self) -> Vec<TokenInput<'_>> {
        let mut v = vec![TokenInput::Token(3), TokenInput::Token(17)];
        v.extend(self.embeddings.iter().map(|x| TokenInput::Embedding(x)));
        v.extend([TokenInput::Token(5), TokenInput::Token(39)]);
        v
    }

    /// The plain reference: each input's embedding, rotated by its place,
    /// its deepstack features added after the first layers.
    fn reference(&self, m: &Model, sections: [u32; 4]) -> Vec<Vec<f32>> {
        let e = m.hp.n_embd;
        let eps = m.hp.norm_eps as f64;
        let mut seq = RefSeq::new(m.hp.n_layers);
        let mut out = Vec::new();
        for (input, at) in self.inputs().into_iter().zip(&self.places) {
            let (mut h, features) = match input {
                TokenInput::Token(t) => (m.embd.f32[t as usize * e..][..e].to_vec(), None),
                TokenInput::Embedding(x) => (x[..e].to_vec(), Some(x)),
            };
            for (l, ly) in m.layers.iter().enumerate() {
                ref_layer(
                    m,
                    sections,
                    ly,
                    &m.experts[l],
                    l,
                    at.index,
                    at.rope,
                    &mut h,
                    &mut seq,
                );
                if let Some(f) = features.filter(|_| l < DEEPSTACK) {
                    for (a, b) in h.iter_mut().zip(&f[(l + 1) * e..][..e]) {
                        *a += b;
                    }
                }
            }
            out.push(m.output.apply(&ref_rms(&h, &m.out_norm, eps)));
        }
        out
    }
}

/// Image embeddings at their M-RoPE places with deepstack features
/// (Qwen3-VL's inputs, through qwen35's layers): one position at a time and
/// in batches, resident and streamed, the same bits, and the plain
/// reference's logits within rounding. Places and features both change the
/// logits.
#[test]
fn image_places_and_deepstack_features_match_the_reference() {
    let sections = [2, 1, 1, 0];
    let mut m = build(5, GgmlType::F32, [GgmlType::F32; 3], sections);
    m.hy.n_deepstack = DEEPSTACK;
    let prompt = ImagePrompt::new(m.hp.n_embd);
    let inputs = prompt.inputs();
    let n = inputs.len();
    let want =
        SeqBuffers::new(&m, n).run_at(&m, &mut resident_experts(&m), &inputs, &prompt.places);
    assert_close(&want, &prompt.reference(&m, sections), 2e-4, "image prompt");
    let rope: Vec<[u32; 4]> = prompt.places.iter().map(|p| p.rope).collect();
    for split in [n, 4, 1] {
        let mut b = SeqBuffers::new(&m, n);
        let mut got = b.run_batch_at(
            &m,
            &mut resident_experts(&m),
            0,
            &inputs[..split],
            Some(&rope[..split]),
            true,
        );
        if split < n {
            got.extend(b.run_batch_at(
                &m,
                &mut resident_experts(&m),
                split,
                &inputs[split..],
                Some(&rope[split..]),
                true,
            ));
        }
        assert_bits_eq(&got, &want, &format!("batches from {split}"));
    }
    // Streamed through few slots, one position at a time and batched.
    struct Image<'m>(&'m Model, &'m ImagePrompt, bool);
    impl Decode for Image<'_> {
        fn decode<X: Experts>(&mut self, experts: &mut X, _: Option<&Lookahead>) -> Vec<Vec<f32>>
        where
            X::Error: std::fmt::Debug,
        {
            let (m, p) = (self.0, self.1);
            let inputs = p.inputs();
            let mut b = SeqBuffers::new(m, inputs.len());
            if self.2 {
                let rope: Vec<[u32; 4]> = p.places.iter().map(|p| p.rope).collect();
                b.run_batch_at(m, experts, 0, &inputs, Some(&rope), true)
            } else {
                b.run_at(m, experts, &inputs, &p.places)
            }
        }
    }
    let experts = m.packed();
    for (seed, slots, batched) in [(3, TOP_K, false), (4, 5, true), (5, 3, true)] {
        let got = les_run(&experts, m.hp.n_layers, slots, seed)
            .run(&mut Image(&m, &prompt, batched))
            .logits;
        assert_bits_eq(
            &got,
            &want,
            &format!("streamed, {slots} slots, batched {batched}"),
        );
    }
    // The places matter: as text positions the image's and the later
    // tokens' logits change.
    let text: Vec<Place> = (0..n).map(Place::text).collect();
    let as_text = SeqBuffers::new(&m, n).run_at(&m, &mut resident_experts(&m), &inputs, &text);
    assert_eq!(as_text[..3], want[..3]);
    assert!(as_text[3..].iter().zip(&want[3..]).all(|(a, b)| a != b));
    // So do the features: without them (plain embeddings) every position
    // from the image on changes.
    let plain: Vec<TokenInput<'_>> = inputs
        .iter()
        .map(|i| match *i {
            TokenInput::Embedding(x) => TokenInput::Embedding(&x[..m.hp.n_embd]),
            t => t,
        })
        .collect();
    let without =
        SeqBuffers::new(&m, n).run_at(&m, &mut resident_experts(&m), &plain, &prompt.places);
    assert_eq!(without[..2], want[..2]);
    assert!(without[2..].iter().zip(&want[2..]).all(|(a, b)| a != b));
    // An embedding of another width is refused.
    let odd = vec![0f32; m.hp.n_embd * 2];
    let mut b = SeqBuffers::new(&m, n);
    let (hp, hy) = (&m.hp, &m.hy);
    let mut kv = KvCache::new_for(hp, hy, &mut b.kv_k, &mut b.kv_v, b.max).unwrap();
    let mut rs = RecurrentState::new(hy, &mut b.conv, &mut b.ssm).unwrap();
    let mut s = Scratch::new_for(hp, hy, &mut b.scratch, b.max).unwrap();
    let mut logits = vec![0f32; hp.n_vocab];
    let err = les_core::model::forward::forward_hybrid_at(
        hp,
        hy,
        &m,
        &mut b.quant.matvec(),
        &mut resident_experts(&m),
        None,
        TokenInput::Embedding(&odd),
        Place::text(0),
        &mut kv,
        &mut rs,
        &mut s,
        &mut logits,
    )
    .unwrap_err();
    assert!(
        format!("{err:?}").contains("input embedding length"),
        "{err:?}"
    );
}

#[test]
fn forward_matches_plain_f32_reference() {
    // F32 weights everywhere: the engine's only approximations are float rounding.
    // [2, 1, 1, 0] rotates every pair by the position; [1, 1, 1, 1] leaves the
    // last pair on the extra (zero) position.
    for sections in [[2, 1, 1, 0], [1, 1, 1, 1]] {
        let m = build(5, GgmlType::F32, [GgmlType::F32; 3], sections);
        check_against_reference(&m, sections);
    }
    check_against_reference(
        &build_next(5, GgmlType::F32, [GgmlType::F32; 3]),
        PLAIN_ROPE,
    );
}

/// The qwen3next variant's parts matter: its grouped value heads and plain
/// RoPE give other logits than qwen35's tiled heads and sections would.
#[test]
fn qwen3next_variant_differs_from_qwen35() {
    let next = build_next(5, GgmlType::F32, [GgmlType::F32; 3]);
    let tiled = build_with(5, GgmlType::F32, [GgmlType::F32; 3], None, false);
    assert!(
        resident(&next) != resident(&tiled),
        "grouped heads changed nothing"
    );
    let sectioned = build_with(
        5,
        GgmlType::F32,
        [GgmlType::F32; 3],
        Some([1, 1, 1, 1]),
        true,
    );
    assert!(
        resident(&next) != resident(&sectioned),
        "plain RoPE changed nothing"
    );
}

/// The engine's logits are the plain reference's (with `sections`) within rounding.
fn check_against_reference(m: &Model, sections: [u32; 4]) {
    let what = format!("sections {sections:?}");
    assert_close(&resident(m), &reference(m, sections), 2e-4, &what);
}

/// A multi-token-prediction block for a model [`build`] made: a gated-attention
/// layer with routed and shared experts, its input projection and norms (the
/// head is the model's).
struct Nextn {
    layer: Layer,
    experts: Vec<[Mat; 3]>,
    image: Vec<u8>,
    eh_proj: Mat,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    head_norm: Vec<f32>,
}

fn build_nextn(m: &Model, seed: u64) -> Nextn {
    let mut rng = Rng(seed);
    let (hp, e, ty) = (&m.hp, m.hp.n_embd, GgmlType::F32);
    let attn_norm = rng.vec(e, 0.1, 1.0);
    let mix = Mix::Attn(gated_attention(&mut rng, ty, hp));
    let layer = moe_layer(&mut rng, ty, e, attn_norm, mix);
    let mut experts = Vec::new();
    let mut image = Vec::new();
    for _ in 0..N_EXP {
        let x = expert(&mut rng, m.expert_ty, e);
        for p in &x {
            image.extend_from_slice(&p.bytes);
        }
        experts.push(x);
    }
    Nextn {
        layer,
        experts,
        image,
        eh_proj: Mat::new(&mut rng, ty, e, 2 * e, 0.15),
        enorm: rng.vec(e, 0.1, 1.0),
        hnorm: rng.vec(e, 0.1, 1.0),
        head_norm: rng.vec(e, 0.1, 1.0),
    }
}

/// The engine's nextn block over every position of [`TOKENS`] (pairing each
/// token with the main model's normed hidden state before it), then two
/// drafting steps from the last one (each on the block's own hidden state and
/// the previous step's greedy token): every step's logits.
fn nextn_engine(m: &Model, nx: &Nextn) -> Vec<Vec<f32>> {
    let (hp, hy, e) = (&m.hp, &m.hy, m.hp.n_embd);
    let n = TOKENS.len() + 2;
    // The main model's final hidden states.
    let mut buffers = Buffers::new(m, TOKENS.len());
    let b = &mut buffers;
    let mut hidden = Vec::new();
    {
        let mut kv = KvCache::new_for(hp, hy, &mut b.kv_k, &mut b.kv_v, TOKENS.len()).unwrap();
        let mut rs = RecurrentState::new(hy, &mut b.conv, &mut b.ssm).unwrap();
        let mut s = Scratch::new_for(hp, hy, &mut b.scratch, TOKENS.len()).unwrap();
        let mut mv = b.quant.matvec();
        let mut experts = resident_experts(m);
        for (pos, &t) in TOKENS.iter().enumerate() {
            let mut logits = vec![0f32; hp.n_vocab];
            forward_hybrid(
                hp,
                hy,
                m,
                &mut mv,
                &mut experts,
                None,
                TokenInput::Token(t),
                pos,
                &mut kv,
                &mut rs,
                &mut s,
                &mut logits,
            )
            .unwrap();
            hidden.push(s.hidden().to_vec());
        }
    }
    let block = NextnBlock {
        block: layer_block(&nx.layer, DELTA),
        eh_proj: nx.eh_proj.view(),
        enorm: &nx.enorm,
        hnorm: &nx.hnorm,
        embedding: m.embd.view(),
        head_norm: &nx.head_norm,
        head: m.output.view(),
    };
    let fmt = m.format();
    let stride = nx.image.len() / N_EXP;
    let lookup: Box<Lookup<'_>> = Box::new(move |l, x| {
        assert_eq!(l, hp.n_layers, "the block's experts are layer n_layers");
        fmt.matrices(&nx.image[x as usize * stride..][..stride])
    });
    let mut experts = Resident::new(lookup);
    let hy1 = cache_params(hy);
    let (mut k, mut v) = (
        vec![0f32; KvCache::len_for(hp, &hy1, n)],
        vec![0f32; KvCache::len_for(hp, &hy1, n)],
    );
    let mut kv = KvCache::new_for(hp, &hy1, &mut k, &mut v, n).unwrap();
    let mut sbuf = vec![0f32; Scratch::len_for(hp, hy, n)];
    let mut s = Scratch::new_for(hp, hy, &mut sbuf, n).unwrap();
    let mut quant = QuantScratch::new();
    let mut mv = quant.matvec();
    let (mut cat, mut h_prev, mut h_out) = (vec![0f32; 2 * e], vec![0f32; e], vec![0f32; e]);
    let mut out = Vec::new();
    let mut input = 0;
    for pos in 0..n {
        if let Some(&t) = TOKENS.get(pos) {
            input = t;
            match pos.checked_sub(1) {
                Some(p) => rms_norm(&hidden[p], &m.out_norm, hp.norm_eps, &mut h_prev),
                None => h_prev.fill(0.0),
            }
        } else {
            h_prev.copy_from_slice(&h_out);
        }
        let mut logits = vec![0f32; hp.n_vocab];
        forward_nextn(
            hp,
            hy,
            &block,
            hp.n_layers,
            &mut mv,
            &mut experts,
            TokenInput::Token(input),
            &h_prev,
            pos,
            &mut kv,
            &mut s,
            &mut cat,
            &mut h_out,
            Some(&mut logits),
        )
        .unwrap();
        input = argmax(&logits);
        out.push(logits);
    }
    out
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// [`nextn_engine`] in the plain reference.
fn nextn_reference(m: &Model, nx: &Nextn, sections: [u32; 4]) -> Vec<Vec<f32>> {
    let (e, eps) = (m.hp.n_embd, m.hp.norm_eps as f64);
    let hidden = reference_hidden(m, sections);
    let mut seq = RefSeq::new(1);
    let mut out = Vec::new();
    let mut h_prev = vec![0f32; e];
    let mut input = 0;
    for pos in 0..TOKENS.len() + 2 {
        if let Some(&t) = TOKENS.get(pos) {
            input = t;
            h_prev = match pos.checked_sub(1) {
                Some(p) => ref_rms(&hidden[p], &m.out_norm, eps),
                None => vec![0f32; e],
            };
        }
        let x = &m.embd.f32[input as usize * e..][..e];
        let mut cat = ref_rms(x, &nx.enorm, eps);
        cat.extend(ref_rms(&h_prev, &nx.hnorm, eps));
        let mut h = nx.eh_proj.apply(&cat);
        ref_layer(
            m,
            sections,
            &nx.layer,
            &nx.experts,
            0,
            pos,
            [pos as u32, pos as u32, pos as u32, 0],
            &mut h,
            &mut seq,
        );
        h_prev = ref_rms(&h, &nx.head_norm, eps);
        let logits = m.output.apply(&h_prev);
        input = argmax(&logits);
        out.push(logits);
    }
    out
}

#[test]
fn nextn_block_matches_plain_f32_reference() {
    let sections = [2, 1, 1, 0];
    let m = build(5, GgmlType::F32, [GgmlType::F32; 3], sections);
    let nx = build_nextn(&m, 17);
    let got = nextn_engine(&m, &nx);
    let want = nextn_reference(&m, &nx, sections);
    assert_eq!(got.len(), want.len());
    for (p, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            argmax(g),
            argmax(w),
            "position {p}: the greedy guesses differ"
        );
        let err = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let scale = w.iter().map(|v| v.abs()).fold(0f32, f32::max);
        assert!(
            err <= 2e-4 * scale.max(1.0),
            "position {p}: max error {err} (scale {scale})"
        );
    }
}
