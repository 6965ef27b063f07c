//! Multi-head latent attention (deepseek2) on a tiny model with DeepSeek-V3's
//! routing (a dense first layer, sigmoid scores with a selection bias, expert
//! groups, scaled weights, an ungated shared expert): the engine's absorbed
//! form against a plain f32 reference written here in the decompressed form
//! (each head's keys and values up-projected from every cached latent), with
//! and without query compression; offloaded == resident bit for bit for every
//! schedule; batches == one position at a time.

mod forward_common;

use forward_common::{
    assert_bits_eq, assert_close, resident_experts, Mat, PackedExperts, PackedModel, Rng,
    SeqBuffers, SeqDecoder, StreamedRun, TestModel,
};
use les_core::gemv::MatrixView;
use les_core::model::config::{ExpertAct, Hparams, HybridParams, MlaShape, MoeParams};
use les_core::model::experts::ExpertFormat;
use les_core::model::forward::{Block, Ffn, Lookahead, Mixer, MlaWeights, SharedExpert, Weights};
use les_core::model::ops::RopeStyle;
use les_core::quant::GgmlType;
use les_core::router::{ExpertGroups, Gating, LayerMask, PredictorConfig};
use les_core::schedule::SchedulerConfig;

const N_EXP: usize = 8;
const TOP_K: usize = 2;
const FF: usize = 32;
const N_HEAD: usize = 4;
const KV_LORA: usize = 32;
const NOPE: usize = 32;
const ROPE: usize = 16;
const V_DIM: usize = 32;
const Q_LORA: usize = 32;
/// YaRN's magnitude correction squared over `sqrt(nope + rope)`, as with a
/// long-context DeepSeek file (any value but the plain one will do).
const KQ_SCALE: f32 = 1.3 * 1.3 / 6.928_203;
const GROUPS: ExpertGroups = ExpertGroups { count: 4, used: 2 };
const TOKENS: [u32; 7] = [3, 17, 5, 39, 0, 22, 8];

struct Mla {
    q_a: Option<(Mat, Vec<f32>)>,
    q: Mat,
    kv_a: Mat,
    kv_norm: Vec<f32>,
    k_b: Mat,
    v_b: Mat,
    wo: Mat,
}

struct Layer {
    attn_norm: Vec<f32>,
    mla: Mla,
    ffn_norm: Vec<f32>,
    dense: Option<[Mat; 3]>,
    router: Option<Mat>,
    bias: Vec<f32>,
    shared: Option<[Mat; 3]>,
}

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

fn build(seed: u64, ty: GgmlType, expert_ty: [GgmlType; 3], q_lora: bool) -> Model {
    let mut rng = Rng(seed);
    let latent = KV_LORA + ROPE;
    let hp = Hparams {
        n_layers: 3,
        n_embd: 64,
        n_head: N_HEAD,
        n_head_kv: 1,
        head_dim: latent,
        n_rot: ROPE,
        n_vocab: 40,
        n_ff: 64,
        rope_base: 10000.0,
        rope_style: RopeStyle::Normal,
        norm_eps: 1e-6,
        moe: Some(MoeParams {
            n_experts: N_EXP,
            top_k: TOP_K,
            n_ff_exp: FF,
            gating: Gating::Sigmoid,
            normalize: true,
            weights_scale: 2.5,
            n_ff_shared: Some(FF),
            act: ExpertAct::SwiGlu,
            groups: Some(GROUPS),
            weight_inputs: false,
            route_before_attention: false,
        }),
        rope_yarn: None,
        scales: les_core::model::config::Scales::NONE,
    };
    let hy = HybridParams {
        mla: Some(MlaShape {
            q_lora: if q_lora { Q_LORA } else { 0 },
            kv_lora: KV_LORA,
            nope: NOPE,
            rope: ROPE,
            v_head_dim: V_DIM,
            kq_scale: KQ_SCALE,
        }),
        ..HybridParams::plain(&hp)
    };
    hy.validate(&hp).unwrap();
    hp.validate().unwrap();
    let e = hp.n_embd;
    let (mut layers, mut experts, mut image, mut offsets) = (vec![], vec![], vec![], vec![]);
    for l in 0..hp.n_layers {
        let dense = l == 0;
        let q_in = if q_lora { Q_LORA } else { e };
        let mla = Mla {
            q_a: q_lora.then(|| {
                (
                    Mat::new(&mut rng, ty, Q_LORA, e, 0.2),
                    rng.vec(Q_LORA, 0.1, 1.0),
                )
            }),
            q: Mat::new(&mut rng, ty, N_HEAD * (NOPE + ROPE), q_in, 0.2),
            kv_a: Mat::new(&mut rng, ty, latent, e, 0.2),
            kv_norm: rng.vec(KV_LORA, 0.1, 1.0),
            k_b: Mat::new(&mut rng, ty, N_HEAD * KV_LORA, NOPE, 0.3),
            v_b: Mat::new(&mut rng, ty, N_HEAD * V_DIM, KV_LORA, 0.3),
            wo: Mat::new(&mut rng, ty, e, N_HEAD * V_DIM, 0.15),
        };
        let ffn = |rng: &mut Rng, f: usize| {
            [
                Mat::new(rng, ty, f, e, 0.15),
                Mat::new(rng, ty, f, e, 0.15),
                Mat::new(rng, ty, e, f, 0.15),
            ]
        };
        layers.push(Layer {
            attn_norm: rng.vec(e, 0.1, 1.0),
            mla,
            ffn_norm: rng.vec(e, 0.1, 1.0),
            dense: dense.then(|| ffn(&mut rng, hp.n_ff)),
            router: (!dense).then(|| Mat::new(&mut rng, GgmlType::F32, N_EXP, e, 0.5)),
            bias: rng.vec(N_EXP, 0.1, 0.0),
            shared: (!dense).then(|| ffn(&mut rng, FF)),
        });
        let (mut le, mut lo) = (vec![], vec![]);
        if !dense {
            for _ in 0..N_EXP {
                let m = [
                    Mat::new(&mut rng, expert_ty[0], FF, e, 0.2),
                    Mat::new(&mut rng, expert_ty[1], FF, e, 0.2),
                    Mat::new(&mut rng, expert_ty[2], e, FF, 0.2),
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

impl Weights for Model {
    fn block(&self, l: usize) -> Block<'_> {
        let ly = &self.layers[l];
        let m = &ly.mla;
        let ffn = match (&ly.dense, &ly.router) {
            (Some([g, u, d]), _) => Ffn::Dense {
                gate: Some(g.view()),
                up: u.view(),
                down: d.view(),
            },
            (None, Some(r)) => Ffn::Moe {
                router: r.view(),
                shared: ly.shared.as_ref().map(|[g, u, d]| SharedExpert {
                    gate: Some(g.view()),
                    up: u.view(),
                    down: d.view(),
                    gate_inp: None,
                }),
                router_bias: None,
                selection_bias: Some(&ly.bias),
                expert_bias: None,
            },
            _ => unreachable!(),
        };
        Block {
            attn_norm: &ly.attn_norm,
            mixer: Mixer::Mla(MlaWeights {
                q_a: m.q_a.as_ref().map(|(w, n)| (w.view(), &n[..])),
                q: m.q.view(),
                kv_a: m.kv_a.view(),
                kv_a_norm: &m.kv_norm,
                k_b: m.k_b.view(),
                v_b: m.v_b.view(),
                wo: m.wo.view(),
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
            format: ExpertFormat {
                gate: Some(self.expert_ty[0]),
                up: self.expert_ty[1],
                down: self.expert_ty[2],
                n_embd: self.hp.n_embd,
                n_ff: FF,
            },
            parts: 1,
        }
    }
}

/// [`SeqBuffers`] for [`TOKENS`]: `Buffers::new(&model, TOKENS.len())`.
type Buffers = SeqBuffers;

fn resident(m: &Model) -> Vec<Vec<f32>> {
    Buffers::new(m, TOKENS.len()).run(m, &mut resident_experts(m), None, 0, &TOKENS)
}

/// The reference's RMSNorm, in f64.
fn rms(x: &[f32], w: &[f32]) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + 1e-6).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| (*v as f64 * s) as f32 * w)
        .collect()
}

/// RoPE over adjacent pairs (llama.cpp's `NORM`), all of `x` rotated.
fn rope(x: &mut [f32], pos: usize) {
    let n = x.len();
    for i in 0..n / 2 {
        let theta = pos as f64 * 10000f64.powf(-2.0 * i as f64 / n as f64);
        let (a, b) = (x[2 * i] as f64, x[2 * i + 1] as f64);
        x[2 * i] = (a * theta.cos() - b * theta.sin()) as f32;
        x[2 * i + 1] = (a * theta.sin() + b * theta.cos()) as f32;
    }
}

/// The plain model: MLA decompressed (every head's keys `W_kb,h^T c` and
/// values `W_vb,h c` from each cached latent `c`), DeepSeek-V3's routing
/// written out.
fn reference(m: &Model) -> Vec<Vec<f32>> {
    let hp = m.hp;
    let mla = m.hy.mla.unwrap();
    let e = hp.n_embd;
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x as f64).exp()) as f32;
    let ffn = |w: &[Mat; 3], x: &[f32]| -> Vec<f32> {
        let (g, u) = (w[0].apply(x), w[1].apply(x));
        let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g * sigmoid(*g) * u).collect();
        w[2].apply(&a)
    };
    // latents[layer][pos] = (c, rotated r)
    let mut latents: Vec<Vec<(Vec<f32>, Vec<f32>)>> = vec![vec![]; hp.n_layers];
    let mut out = Vec::new();
    for (pos, &t) in TOKENS.iter().enumerate() {
        let mut h = m.embd.f32[t as usize * e..][..e].to_vec();
        for (l, ly) in m.layers.iter().enumerate() {
            let w = &ly.mla;
            let x = rms(&h, &ly.attn_norm);
            let q = match &w.q_a {
                Some((qa, n)) => w.q.apply(&rms(&qa.apply(&x), n)),
                None => w.q.apply(&x),
            };
            let kva = w.kv_a.apply(&x);
            let c = rms(&kva[..KV_LORA], &w.kv_norm);
            let mut r = kva[KV_LORA..].to_vec();
            rope(&mut r, pos);
            latents[l].push((c, r));
            let mut att = vec![0f32; N_HEAD * V_DIM];
            for head in 0..N_HEAD {
                let qh = &q[head * (NOPE + ROPE)..][..NOPE + ROPE];
                let qn = &qh[..NOPE];
                let mut qr = qh[NOPE..].to_vec();
                rope(&mut qr, pos);
                let kb = |j: usize, i: usize| w.k_b.f32[(head * KV_LORA + j) * NOPE + i] as f64;
                let vb = |d: usize, j: usize| w.v_b.f32[(head * V_DIM + d) * KV_LORA + j] as f64;
                let scores: Vec<f64> = latents[l]
                    .iter()
                    .map(|(c, r)| {
                        let k_nope: Vec<f64> = (0..NOPE)
                            .map(|i| (0..KV_LORA).map(|j| kb(j, i) * c[j] as f64).sum())
                            .collect();
                        let s: f64 = qn
                            .iter()
                            .zip(&k_nope)
                            .map(|(a, b)| *a as f64 * b)
                            .sum::<f64>()
                            + qr.iter()
                                .zip(r)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>();
                        s * mla.kq_scale as f64
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
                for (s, (c, _)) in scores.iter().zip(&latents[l]) {
                    let p = (s - mx).exp() / z;
                    for d in 0..V_DIM {
                        let v: f64 = (0..KV_LORA).map(|j| vb(d, j) * c[j] as f64).sum();
                        att[head * V_DIM + d] += (p * v) as f32;
                    }
                }
            }
            for (a, b) in h.iter_mut().zip(w.wo.apply(&att)) {
                *a += b;
            }
            let x = rms(&h, &ly.ffn_norm);
            let y = match (&ly.dense, &ly.router) {
                (Some(d), _) => ffn(d, &x),
                (None, Some(router)) => {
                    let probs: Vec<f32> = router.apply(&x).iter().map(|v| sigmoid(*v)).collect();
                    let keys: Vec<f32> = probs.iter().zip(&ly.bias).map(|(p, b)| p + b).collect();
                    // Groups of 2: each scores its two keys' sum; the best 2 stay.
                    let per = N_EXP / GROUPS.count;
                    let mut groups: Vec<(f32, usize)> = (0..GROUPS.count)
                        .map(|g| (keys[g * per] + keys[g * per + 1], g))
                        .collect();
                    groups.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
                    let kept: Vec<usize> = groups[..GROUPS.used].iter().map(|g| g.1).collect();
                    let mut idx: Vec<usize> =
                        (0..N_EXP).filter(|i| kept.contains(&(i / per))).collect();
                    idx.sort_by(|a, b| keys[*b].partial_cmp(&keys[*a]).unwrap().then(a.cmp(b)));
                    let top = &idx[..TOP_K];
                    let sum: f32 = top.iter().map(|&i| probs[i]).sum();
                    let mut y = ffn(ly.shared.as_ref().unwrap(), &x);
                    for &i in top {
                        let o = ffn(&m.experts[l][i], &x);
                        for (a, b) in y.iter_mut().zip(&o) {
                            *a += probs[i] / sum * 2.5 * b;
                        }
                    }
                    y
                }
                _ => unreachable!(),
            };
            for (a, b) in h.iter_mut().zip(&y) {
                *a += b;
            }
        }
        out.push(m.output.apply(&rms(&h, &m.out_norm)));
    }
    out
}

fn check_against_reference(m: &Model) {
    assert_close(&resident(m), &reference(m), 2e-4, "MLA");
}

#[test]
fn absorbed_mla_matches_the_decompressed_reference() {
    for q_lora in [true, false] {
        check_against_reference(&build(5, GgmlType::F32, [GgmlType::F32; 3], q_lora));
    }
    // The attention scale is the file's, not 1 / sqrt(head_dim): another
    // scale moves the logits.
    let m = build(5, GgmlType::F32, [GgmlType::F32; 3], true);
    let mut other = build(5, GgmlType::F32, [GgmlType::F32; 3], true);
    other.hy.mla.as_mut().unwrap().kq_scale = 1.0 / 6.928_203;
    assert!(
        resident(&m) != resident(&other),
        "the scale changed nothing"
    );
}

#[test]
fn streamed_equals_resident_bit_for_bit() {
    let m = build(
        11,
        GgmlType::Q8_0,
        [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0],
        true,
    );
    let want = resident(&m);
    let experts = m.packed();
    let mut seed = 1;
    for slots in [TOP_K, 3, 5, 16] {
        for predict in [false, true] {
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
                        depth: 1,
                    },
                }
                .run(&mut SeqDecoder(&m, &TOKENS));
                let what = format!("slots={slots} predict={predict} {cfg:?}");
                assert_bits_eq(&out.logits, &want, &what);
                let st = out.stats;
                let picks = (TOKENS.len() * (m.hp.n_layers - 1) * TOP_K) as u64;
                assert_eq!(st.misses + st.hits + st.late_hits, picks, "{what}: {st:?}");
            }
        }
    }
}

#[test]
fn batched_prefill_equals_one_position_at_a_time() {
    let m = build(7, GgmlType::Q8_0, [GgmlType::Q4_0; 3], true);
    let want = resident(&m);
    for split in [1, 3, TOKENS.len()] {
        let mut b = Buffers::new(&m, TOKENS.len());
        let mut got = b.run_batch(&m, &mut resident_experts(&m), 0, &TOKENS[..split], true);
        got.extend(b.run(&m, &mut resident_experts(&m), None, split, &TOKENS[split..]));
        assert_bits_eq(
            &got,
            &want,
            &format!("a batch of {split}, then one at a time"),
        );
    }
}
