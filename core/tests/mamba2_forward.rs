//! The Mamba2 hybrids' forward pass on tiny models: granitehybrid (Mamba2
//! layers around an attention layer without RoPE, each followed by routed
//! plus shared experts, Granite's multipliers) and Nemotron-H (layers of one
//! sub-layer each: Mamba2, attention, or ungated ReLU² experts routed by
//! sigmoid with a selection bias). Their math against a plain f64 reference
//! written here (the Mamba2 recurrence over an explicit state, naive
//! attention), offloaded == resident bit for bit for every schedule and
//! read split, batches equal to one position at a time, and the sequence
//! state living entirely in the caller's KV cache and recurrent state.

mod forward_common;

use forward_common::{
    assert_bits_eq, assert_close, resident_experts, Mat, PackedExperts, PackedModel, Rng,
    SeqBuffers, SeqDecoder, StreamedRun, TestModel,
};
use les_core::gemv::MatrixView;
use les_core::model::config::{
    AttnTemperature, ExpertAct, Hparams, HybridParams, LinearShape, Mamba2Shape, MoeParams, Scales,
};
use les_core::model::experts::ExpertFormat;
use les_core::model::forward::{
    AttentionWeights, Block, Ffn, Lookahead, Mixer, SharedExpert, Weights,
};
use les_core::model::mamba2::Mamba2Weights;
use les_core::model::ops::RopeStyle;
use les_core::quant::GgmlType;
use les_core::router::{Gating, LayerMask, PredictorConfig};
use les_core::schedule::SchedulerConfig;

struct Attn {
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
}

struct Ssm {
    in_proj: Mat,
    conv: Vec<f32>,
    conv_bias: Option<Vec<f32>>,
    dt_bias: Vec<f32>,
    a: Vec<f32>,
    d: Vec<f32>,
    norm: Vec<f32>,
    out: Mat,
}

enum Mix {
    Attn(Attn),
    Ssm(Ssm),
}

/// A layer's routed and shared experts.
struct Moe {
    norm: Vec<f32>,
    router: Mat,
    /// Gate (where gated), up, down.
    shared: Vec<Mat>,
    /// Nemotron-H's `exp_probs_b`.
    selection_bias: Option<Vec<f32>>,
}

/// A layer: a mixer, experts, or (granitehybrid) both.
struct Layer {
    attn_norm: Vec<f32>,
    mix: Option<Mix>,
    moe: Option<Moe>,
}

/// Which architecture the tiny model has.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Arch {
    /// Every layer a mixer then experts, Granite's multipliers.
    Granite,
    /// Mamba2, experts, attention, experts, Mamba2, experts: one sub-layer a
    /// layer, ungated ReLU² experts, sigmoid routing with a selection bias.
    Nemotron,
}

/// What mixes positions in a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum MixKind {
    Mamba2,
    Attention,
}

/// A layer's mixer (`None`: none) and whether it has experts.
type Kind = (Option<MixKind>, bool);

/// The kind of each layer of `arch`.
fn layer_kinds(arch: Arch) -> Vec<Kind> {
    match arch {
        Arch::Granite => vec![
            (Some(MixKind::Mamba2), true),
            (Some(MixKind::Mamba2), true),
            (Some(MixKind::Attention), true),
            (Some(MixKind::Mamba2), true),
        ],
        Arch::Nemotron => vec![
            (Some(MixKind::Mamba2), false),
            (None, true),
            (Some(MixKind::Attention), false),
            (None, true),
            (Some(MixKind::Mamba2), false),
            (None, true),
        ],
    }
}

const N_EXP: usize = 8;
const TOP_K: usize = 2;
const FF: usize = 32;

/// Granite 4.0-H's layout in small: two groups, two heads each.
const SHAPE: Mamba2Shape = Mamba2Shape {
    d_inner: 128,
    d_state: 16,
    n_head: 4,
    n_group: 2,
    conv_kernel: 4,
};

/// Multipliers unlike 1, so that each shows (Granite 4.0-H-Tiny's are 12,
/// 0.22, 1/128 and 6).
const SCALES: Scales = Scales {
    embedding: 3.0,
    residual: 0.5,
    attention: Some(0.2),
    logit: 4.0,
};

struct Model {
    arch: Arch,
    hp: Hparams,
    hy: HybridParams,
    embd: Mat,
    out_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
    /// Per layer (empty without experts), per expert: gate (where gated), up, down.
    experts: Vec<Vec<Vec<Mat>>>,
    image: Vec<u8>,
    offsets: Vec<Vec<usize>>,
    expert_ty: [GgmlType; 3],
}

fn build(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3]) -> Model {
    build_with(seed, ty, expert_ty, true, Arch::Granite)
}

fn build_with(
    seed: u64,
    ty: GgmlType,
    expert_ty: [GgmlType; 3],
    conv_bias: bool,
    arch: Arch,
) -> Model {
    let mut rng = Rng(seed);
    let kinds = layer_kinds(arch);
    let nemotron = arch == Arch::Nemotron;
    let hp = Hparams {
        n_layers: kinds.len(),
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        n_rot: 16,
        n_vocab: 40,
        n_ff: 0,
        rope_base: 10000.0,
        rope_style: RopeStyle::Normal,
        norm_eps: 1e-5,
        moe: Some(MoeParams {
            n_experts: N_EXP,
            top_k: TOP_K,
            n_ff_exp: FF,
            gating: if nemotron {
                Gating::Sigmoid
            } else {
                Gating::Softmax
            },
            normalize: true,
            weights_scale: if nemotron { 2.5 } else { 1.0 },
            n_ff_shared: Some(FF),
            act: if nemotron {
                ExpertAct::ReluSqr
            } else {
                ExpertAct::SwiGlu
            },
            groups: None,
            weight_inputs: false,
            route_before_attention: false,
        }),
        rope_yarn: None,
        scales: if nemotron { Scales::NONE } else { SCALES },
    };
    let count = |mix: Option<MixKind>| kinds.iter().filter(|k| k.0 == mix).count();
    let hy = HybridParams {
        n_attn_layers: count(Some(MixKind::Attention)),
        linear: Some((count(Some(MixKind::Mamba2)), LinearShape::Mamba2(SHAPE))),
        n_ffn_only_layers: count(None),
        ..HybridParams::plain(&hp)
    };
    hy.validate(&hp).unwrap();
    let e = hp.n_embd;
    let s = SHAPE;
    let mut layers = Vec::new();
    let mut experts = Vec::new();
    let mut image = Vec::new();
    let mut offsets = Vec::new();
    // Gate (where gated), up, down of an FFN `FF` wide, of types `tys`.
    let ffn_mats = |rng: &mut Rng, tys: [GgmlType; 3], scale: f32| -> Vec<Mat> {
        let gate = (!nemotron).then(|| Mat::new(rng, tys[0], FF, e, scale));
        gate.into_iter()
            .chain([
                Mat::new(rng, tys[1], FF, e, scale),
                Mat::new(rng, tys[2], e, FF, scale),
            ])
            .collect()
    };
    for &(mixer, has_moe) in &kinds {
        let attn_norm = rng.vec(e, 0.1, 1.0);
        let mix = mixer.map(|kind| {
            if kind == MixKind::Mamba2 {
                Mix::Ssm(Ssm {
                    in_proj: Mat::new(&mut rng, ty, s.in_proj_dim(), e, 0.15),
                    conv: rng.vec(s.conv_dim() * s.conv_kernel, 0.5, 0.0),
                    conv_bias: conv_bias.then(|| rng.vec(s.conv_dim(), 0.1, 0.0)),
                    dt_bias: rng.vec(s.n_head, 0.5, -2.0),
                    a: (0..s.n_head).map(|_| -1.0 - 8.0 * rng.uniform()).collect(),
                    d: rng.vec(s.n_head, 0.2, 1.0),
                    norm: rng.vec(s.d_inner, 0.1, 1.0),
                    out: Mat::new(&mut rng, ty, e, s.d_inner, 0.15),
                })
            } else {
                Mix::Attn(Attn {
                    wq: Mat::new(&mut rng, ty, hp.q_dim(), e, 0.15),
                    wk: Mat::new(&mut rng, ty, hp.kv_dim(), e, 0.15),
                    wv: Mat::new(&mut rng, ty, hp.kv_dim(), e, 0.15),
                    wo: Mat::new(&mut rng, ty, e, hp.q_dim(), 0.15),
                })
            }
        });
        let moe = has_moe.then(|| Moe {
            norm: rng.vec(e, 0.1, 1.0),
            router: Mat::new(&mut rng, GgmlType::F32, N_EXP, e, 0.5),
            shared: ffn_mats(&mut rng, [ty; 3], 0.15),
            selection_bias: nemotron.then(|| rng.vec(N_EXP, 0.3, 0.0)),
        });
        layers.push(Layer {
            attn_norm,
            mix,
            moe,
        });
        let mut le = Vec::new();
        let mut lo = Vec::new();
        for _ in 0..N_EXP * usize::from(has_moe) {
            let m = ffn_mats(&mut rng, expert_ty, 0.2);
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
        arch,
        hp,
        hy,
        embd: Mat::new(&mut rng, ty, hp.n_vocab, e, 0.3),
        out_norm: rng.vec(e, 0.1, 1.0),
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
        let mixer = match &ly.mix {
            None => Mixer::None,
            Some(Mix::Attn(a)) => Mixer::Attention(AttentionWeights {
                wq: a.wq.view(),
                wk: a.wk.view(),
                wv: a.wv.view(),
                wo: a.wo.view(),
                bq: None,
                bk: None,
                bv: None,
                q_norm: None,
                k_norm: None,
                bo: None,
                sinks: None,
                window: None,
                rope_freqs: None,
                norm_after_rope: false,
                nope: Some(AttnTemperature::NONE),
            }),
            Some(Mix::Ssm(m)) => Mixer::Mamba2(Mamba2Weights {
                shape: SHAPE,
                in_proj: m.in_proj.view(),
                conv: &m.conv,
                conv_bias: m.conv_bias.as_deref(),
                dt_bias: &m.dt_bias,
                a: &m.a,
                d: &m.d,
                norm: &m.norm,
                out: m.out.view(),
            }),
        };
        let Some(moe) = &ly.moe else {
            return Block {
                attn_norm: &ly.attn_norm,
                mixer,
                ffn_norm: &ly.attn_norm,
                ffn: Ffn::None,
            };
        };
        let (gate, [u, dn]) = gate_and_rest(&moe.shared);
        Block {
            attn_norm: &ly.attn_norm,
            mixer,
            ffn_norm: &moe.norm,
            ffn: Ffn::Moe {
                router: moe.router.view(),
                shared: Some(SharedExpert {
                    gate: gate.map(Mat::view),
                    up: u.view(),
                    down: dn.view(),
                    gate_inp: None,
                }),
                expert_bias: None,
                router_bias: None,
                selection_bias: moe.selection_bias.as_deref(),
            },
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

/// An FFN's matrices split into its gate (`None` when ungated) and up, down.
fn gate_and_rest(m: &[Mat]) -> (Option<&Mat>, [&Mat; 2]) {
    match m {
        [g, u, d] => (Some(g), [u, d]),
        [u, d] => (None, [u, d]),
        _ => panic!("an FFN has 2 or 3 matrices"),
    }
}

impl Model {
    fn is_moe(&self, l: usize) -> bool {
        self.layers[l].moe.is_some()
    }

    fn format(&self) -> ExpertFormat {
        ExpertFormat {
            gate: (self.arch == Arch::Granite).then_some(self.expert_ty[0]),
            up: self.expert_ty[1],
            down: self.expert_ty[2],
            n_embd: self.hp.n_embd,
            n_ff: FF,
        }
    }
}

/// Longer than the convolution's window many times over.
const TOKENS: [u32; 12] = [3, 17, 5, 39, 0, 22, 22, 8, 31, 4, 4, 19];

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
        self.packed_in(1)
    }
}

impl Model {
    /// The experts read in `parts` extents (see [`PackedExperts::parts`]).
    fn packed_in(&self, parts: usize) -> PackedExperts<'_> {
        PackedExperts {
            image: &self.image,
            offsets: &self.offsets,
            format: self.format(),
            parts,
        }
    }
}

type Buffers = SeqBuffers;

fn resident(m: &Model) -> Vec<Vec<f32>> {
    Buffers::new(m, TOKENS.len()).run(m, &mut resident_experts(m), None, 0, &TOKENS)
}

#[test]
fn streamed_equals_resident_bit_for_bit() {
    for (ty, ety, arch) in [
        (
            GgmlType::Q8_0,
            [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0],
            Arch::Granite,
        ),
        (
            GgmlType::F16,
            [GgmlType::Q8_0, GgmlType::Q5_1, GgmlType::Q4_1],
            Arch::Granite,
        ),
        (
            GgmlType::Q8_0,
            [GgmlType::Q4_0, GgmlType::Q5_1, GgmlType::Q8_0],
            Arch::Nemotron,
        ),
    ] {
        let m = build_with(11, ty, ety, true, arch);
        let want = resident(&m);
        let n_moe = (0..m.hp.n_layers).filter(|&l| m.is_moe(l)).count();
        let mut seed = 1;
        let mut halves = 0;
        for slots in [TOP_K, 3, 5, 16] {
            for (predict, parts) in [(false, 1), (true, 1), (true, 2), (false, 3)] {
                let experts = m.packed_in(parts);
                for cfg in [SchedulerConfig::les(), SchedulerConfig::on_demand()] {
                    seed += 1;
                    let out = StreamedRun {
                        experts: &experts,
                        n_layers: m.hp.n_layers,
                        n_experts: N_EXP,
                        slots,
                        predict,
                        seed,
                        config: cfg,
                        lookahead: Lookahead {
                            predictor: PredictorConfig::top_k(TOP_K),
                            layers: LayerMask::first(m.hp.n_layers).unwrap(),
                            depth: 2,
                        },
                    }
                    .run(&mut SeqDecoder(&m, &TOKENS));
                    let st = out.stats;
                    assert_eq!(
                        st.misses + st.hits + st.late_hits,
                        (TOKENS.len() * n_moe * TOP_K) as u64,
                        "{st:?}"
                    );
                    if predict && cfg.prefetch {
                        // Lookahead runs from Mamba2 and attention layers
                        // too, and predicts every MoE layer.
                        let moe_layers =
                            out.layers.iter().enumerate().filter(|(l, _)| m.is_moe(*l));
                        assert!(
                            moe_layers.clone().all(|(_, l)| l.predicted > 0),
                            "{:?}",
                            out.layers
                        );
                    }
                    halves += out.halves;
                    assert_bits_eq(
                        &out.logits,
                        &want,
                        &format!(
                            "{arch:?} {ty} slots={slots} predict={predict} parts={parts} {cfg:?}"
                        ),
                    );
                }
            }
        }
        // Experts were computed in halves (gate and up, or up alone, while
        // the down projection was still loading).
        assert!(halves > 0, "{arch:?}: no expert computed in halves");
    }
}

#[test]
fn sequence_state_lives_in_the_kv_cache_and_recurrent_state() {
    let m = build(7, GgmlType::Q8_0, [GgmlType::Q4_0; 3]);
    let want = resident(&m);
    for split in [1, 5, TOKENS.len() - 1] {
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
    // Each half of the recurrent state matters: without it the logits change.
    for lose_conv in [true, false] {
        let mut a = Buffers::new(&m, TOKENS.len());
        a.run(&m, &mut resident_experts(&m), None, 0, &TOKENS[..6]);
        let mut b = Buffers::new(&m, TOKENS.len());
        b.kv_k.copy_from_slice(&a.kv_k);
        b.kv_v.copy_from_slice(&a.kv_v);
        if lose_conv {
            b.ssm.copy_from_slice(&a.ssm);
        } else {
            b.conv.copy_from_slice(&a.conv);
        }
        let lost = b.run(&m, &mut resident_experts(&m), None, 6, &TOKENS[6..7]);
        assert_ne!(lost[0], want[6], "lost conv state {lose_conv}: no effect");
    }
}

#[test]
fn batched_prefill_equals_one_position_at_a_time() {
    for arch in [Arch::Granite, Arch::Nemotron] {
        batched_prefill_equals_one_position_at_a_time_in(arch);
    }
}

fn batched_prefill_equals_one_position_at_a_time_in(arch: Arch) {
    let m = build_with(5, GgmlType::Q8_0, [GgmlType::Q4_0; 3], true, arch);
    let want = resident(&m);
    for split in [2, 5, TOKENS.len()] {
        for every in [false, true] {
            let mut b = Buffers::new(&m, TOKENS.len());
            let got = b.run_batch(&m, &mut resident_experts(&m), 0, &TOKENS[..split], every);
            let first = if every { 0 } else { split - 1 };
            assert_bits_eq(
                &got,
                &want[first..split],
                &format!("{arch:?}: batch of {split}, every position's logits: {every}"),
            );
            let rest = b.run(&m, &mut resident_experts(&m), None, split, &TOKENS[split..]);
            assert_bits_eq(
                &rest,
                &want[split..],
                &format!("decode after a batch of {split}"),
            );
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

/// The reference's sequence state per layer: past keys and values
/// (attention), past input projections and each channel's state (Mamba2).
#[derive(Default, Clone)]
struct RefLayer {
    keys: Vec<Vec<f32>>,
    vals: Vec<Vec<f32>>,
    hist: Vec<Vec<f32>>,
    state: Vec<Vec<f64>>,
}

/// The logits of a plain f64 granitehybrid or Nemotron-H, written from the
/// architecture descriptions with no shared code, at each position of
/// [`TOKENS`].
fn reference(m: &Model) -> Vec<Vec<f32>> {
    let hp = m.hp;
    let s = SHAPE;
    let (e, hd) = (hp.n_embd, hp.head_dim);
    let eps = hp.norm_eps as f64;
    let silu = |x: f64| x / (1.0 + (-x).exp());
    let mut seq = vec![RefLayer::default(); hp.n_layers];
    for r in &mut seq {
        r.state = vec![vec![0f64; s.d_state]; s.d_inner];
    }
    let scales = hp.scales;
    // SwiGLU with a gate, relu(up)^2 without.
    let ffn = |w: &[Mat], x: &[f32]| -> Vec<f32> {
        let (gate, [up, down]) = gate_and_rest(w);
        let u = up.apply(x);
        let a: Vec<f32> = match gate {
            Some(g) => g
                .apply(x)
                .iter()
                .zip(&u)
                .map(|(g, u)| (silu(*g as f64) * *u as f64) as f32)
                .collect(),
            None => u
                .iter()
                .map(|u| (u.max(0.0) as f64).powi(2) as f32)
                .collect(),
        };
        down.apply(&a)
    };
    let mut out = Vec::new();
    for (pos, &t) in TOKENS.iter().enumerate() {
        let mut h: Vec<f32> = m.embd.f32[t as usize * e..][..e]
            .iter()
            .map(|v| v * scales.embedding)
            .collect();
        for (l, ly) in m.layers.iter().enumerate() {
            let x = ref_rms(&h, &ly.attn_norm, eps);
            let r = &mut seq[l];
            let o = match &ly.mix {
                None => vec![0f32; e],
                Some(Mix::Attn(a)) => {
                    // No RoPE: keys and queries as projected.
                    let q = a.wq.apply(&x);
                    r.keys.push(a.wk.apply(&x));
                    r.vals.push(a.wv.apply(&x));
                    let mut att = vec![0f32; hp.q_dim()];
                    for head in 0..hp.n_head {
                        let kvh = head / (hp.n_head / hp.n_head_kv);
                        let qh = &q[head * hd..][..hd];
                        let scores: Vec<f64> = r
                            .keys
                            .iter()
                            .map(|k| {
                                qh.iter()
                                    .zip(&k[kvh * hd..][..hd])
                                    .map(|(a, b)| *a as f64 * *b as f64)
                                    .sum::<f64>()
                                    * scales.attention.map_or(1.0 / (hd as f64).sqrt(), f64::from)
                            })
                            .collect();
                        let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                        let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
                        for (p, v) in scores.iter().zip(&r.vals) {
                            let w = (p - mx).exp() / z;
                            for i in 0..hd {
                                att[head * hd + i] += (w * v[kvh * hd + i] as f64) as f32;
                            }
                        }
                    }
                    a.wo.apply(&att)
                }
                Some(Mix::Ssm(w)) => {
                    r.hist.push(w.in_proj.apply(&x));
                    let p = &r.hist[pos];
                    let (di, ds, k) = (s.d_inner, s.d_state, s.conv_kernel);
                    // The convolution over the inputs so far, zeros before the first.
                    let xbc: Vec<f64> = (0..s.conv_dim())
                        .map(|c| {
                            let mut acc = 0f64;
                            for j in 0..k {
                                let back = k - 1 - j;
                                if let Some(q) = pos.checked_sub(back) {
                                    acc += w.conv[c * k + j] as f64 * r.hist[q][di + c] as f64;
                                }
                            }
                            silu(acc + w.conv_bias.as_ref().map_or(0.0, |b| b[c] as f64))
                        })
                        .collect();
                    let (xs, bs, cs) = (
                        &xbc[..di],
                        &xbc[di..][..s.n_group * ds],
                        &xbc[di + s.n_group * ds..],
                    );
                    let hdim = di / s.n_head;
                    let mut y = vec![0f64; di];
                    for head in 0..s.n_head {
                        let raw = p[di + s.conv_dim() + head] as f64 + w.dt_bias[head] as f64;
                        let dt = (1.0 + raw.exp()).ln();
                        let decay = (dt * w.a[head] as f64).exp();
                        let g = head * s.n_group / s.n_head;
                        for i in 0..hdim {
                            let c = head * hdim + i;
                            let st = &mut r.state[c];
                            let mut yc = 0f64;
                            for n in 0..ds {
                                st[n] = st[n] * decay + bs[g * ds + n] * xs[c] * dt;
                                yc += st[n] * cs[g * ds + n];
                            }
                            y[c] = yc + xs[c] * w.d[head] as f64;
                        }
                    }
                    let gated: Vec<f32> = y
                        .iter()
                        .zip(&p[..di])
                        .map(|(v, z)| (v * silu(*z as f64)) as f32)
                        .collect();
                    let gw = di / s.n_group;
                    let normed: Vec<f32> = gated
                        .chunks(gw)
                        .zip(w.norm.chunks(gw))
                        .flat_map(|(g, nw)| ref_rms(g, nw, eps))
                        .collect();
                    w.out.apply(&normed)
                }
            };
            if ly.mix.is_some() {
                for (a, b) in h.iter_mut().zip(&o) {
                    *a += b * scales.residual;
                }
            }
            let Some(moe) = &ly.moe else { continue };
            let x = ref_rms(&h, &moe.norm, eps);
            let logits = moe.router.apply(&x);
            // Granite: softmax; Nemotron-H: each expert's sigmoid, picked by
            // it plus the selection bias, weighted by it alone.
            let pr: Vec<f64> = match m.arch {
                Arch::Granite => {
                    let mx = logits.iter().cloned().fold(f32::MIN, f32::max);
                    logits.iter().map(|v| ((v - mx) as f64).exp()).collect()
                }
                Arch::Nemotron => logits
                    .iter()
                    .map(|v| 1.0 / (1.0 + (-*v as f64).exp()))
                    .collect(),
            };
            let bias = |i: usize| moe.selection_bias.as_ref().map_or(0.0, |b| b[i] as f64);
            let mut idx: Vec<usize> = (0..N_EXP).collect();
            idx.sort_by(|a, b| {
                (pr[*b] + bias(*b))
                    .partial_cmp(&(pr[*a] + bias(*a)))
                    .unwrap()
                    .then(a.cmp(b))
            });
            let top = &idx[..TOP_K];
            let sum: f64 = top.iter().map(|i| pr[*i]).sum();
            let w_scale = hp.moe.unwrap().weights_scale as f64;
            let mut y = vec![0f64; e];
            for &i in top {
                for (a, b) in y.iter_mut().zip(ffn(&m.experts[l][i], &x)) {
                    *a += pr[i] / sum * w_scale * b as f64;
                }
            }
            for (a, b) in y.iter_mut().zip(ffn(&moe.shared, &x)) {
                *a += b as f64;
            }
            for (a, b) in h.iter_mut().zip(&y) {
                *a += (*b as f32) * scales.residual;
            }
        }
        let logits = m.output.apply(&ref_rms(&h, &m.out_norm, eps));
        out.push(logits.iter().map(|v| v / scales.logit).collect());
    }
    out
}

#[test]
fn forward_matches_plain_f64_reference() {
    // F32 weights everywhere: the engine's only approximations are float rounding.
    for (conv_bias, arch) in [
        (true, Arch::Granite),
        (false, Arch::Granite),
        (true, Arch::Nemotron),
    ] {
        let m = build_with(5, GgmlType::F32, [GgmlType::F32; 3], conv_bias, arch);
        assert_close(
            &resident(&m),
            &reference(&m),
            2e-4,
            &format!("{arch:?}, conv bias {conv_bias}"),
        );
    }
}
