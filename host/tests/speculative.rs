//! Speculative decoding changes nothing but speed: with any drafter (right,
//! wrong, partly right, out of the vocabulary), any draft length, sampler and
//! expert schedule, `generate_from` hands out the tokens and logits of plain
//! decoding, bit for bit, and leaves the session where plain decoding leaves
//! it, for qwen3moe and for qwen35moe, granitehybrid, nemotron_h_moe and
//! lfm2moe (whose DeltaNet, Mamba2 and short-convolution states are rolled
//! back when a draft is rejected; Nemotron-H's layers are one sub-layer
//! each, its experts ungated).

mod cli;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use cli::F32_WEIGHTS;

use les::compute::ThreadedMatVec;
use les::draft::{
    check_compatible, Drafter, ModelDrafter, NextnDrafter, NgramDrafter, Speculation,
};
use les::engine::{generate_from, Control, GenStats, Session};
use les::flash::FileDeviceConfig;
use les::model::Model;
use les::sampling::{Penalties, Sampler, SamplerConfig};
use les::supply::{Schedule, SlotBudget, Supply};
use les::tokenizer::Tokenizer;
use les_core::gemv::Isa;
use les_core::model::forward::{Lookahead, Place, TokenInput};
use les_core::router::{LayerMask, PredictorConfig};

/// Tokens generated per run.
const GENERATE: usize = 24;

/// A packed tiny model of `arch`, made once per test binary.
fn packed(arch: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let plain = dir.join(format!("spec-{arch}.gguf"));
    let packed = dir.join(format!("spec-{arch}.packed.gguf"));
    let les = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_les"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let p = plain.to_str().unwrap();
    les(&["synth", "--arch", arch, "--preset", "tiny", "-o", p]);
    les(&["pack", "--quiet", p, "-o", packed.to_str().unwrap()]);
    packed
}

/// A plain synthetic model of `arch` with `extra` arguments, made once per name.
fn synth(name: &str, args: &[&str]) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("spec-{name}.gguf"));
    let out = Command::new(env!("CARGO_BIN_EXE_les"))
        .arg("synth")
        .args(args)
        .arg("-o")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

fn qwen3moe() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| packed("qwen3moe"))
}

fn qwen35moe() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| packed("qwen35moe"))
}

fn granitehybrid() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| packed("granitehybrid"))
}

fn nemotron_h_moe() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| packed("nemotron_h_moe"))
}

fn lfm2moe() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| packed("lfm2moe"))
}

/// The plain (unpacked) tiny qwen35moe [`qwen35moe`] packed, for llama.cpp.
fn qwen35moe_plain() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        qwen35moe();
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("spec-qwen35moe.gguf")
    })
}

/// What a generation handed out, and what the session gives next.
#[derive(Debug, PartialEq)]
struct Run {
    tokens: Vec<u32>,
    /// The bits of the logits each token was sampled from.
    logits: Vec<Vec<u32>>,
    /// The session's position after it.
    position: usize,
    /// The bits of the logits of one more token evaluated after it (the state
    /// left behind).
    after: Vec<u32>,
}

fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|v| v.to_bits()).collect()
}

/// Guesses from a fixed continuation: right for its first `right` tokens of
/// each draft, then wrong (`wrong(true token)`).
struct Scripted {
    prompt_len: usize,
    truth: Vec<u32>,
    right: usize,
    wrong: fn(u32) -> u32,
}

impl Drafter for Scripted {
    fn draft(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        let done = history.len() - self.prompt_len;
        for (i, &t) in self.truth.iter().skip(done).take(max).enumerate() {
            out.push(if i < self.right { t } else { (self.wrong)(t) });
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn generate(
    path: &Path,
    schedule: Schedule,
    slots: Option<usize>,
    sampler: SamplerConfig,
    prompt: &[u32],
    drafter: Option<&mut dyn Drafter>,
    max_draft: usize,
    batch: usize,
) -> (Run, GenStats) {
    let model = Model::open(path).unwrap();
    let budget = cli::slot_budget(&model, slots);
    let mut supply = Supply::new(&model, path, schedule, budget).unwrap();
    let mut mv = ThreadedMatVec::new(2, Isa::detect());
    let la = Lookahead {
        predictor: PredictorConfig::top_k(model.hp.moe.unwrap().top_k),
        layers: LayerMask::first(model.hp.n_layers).unwrap(),
        depth: 1,
    };
    let mut session = Session::new(&model, prompt.len() + GENERATE + 1).unwrap();
    session.set_prefill_batch(batch).unwrap();
    assert_eq!(session.set_max_draft(max_draft).unwrap(), max_draft);
    let inputs: Vec<TokenInput<'_>> = prompt.iter().map(|&t| TokenInput::Token(t)).collect();
    let mut s = Sampler::new(sampler);
    let (mut tokens, mut logits) = (Vec::new(), Vec::new());
    let stats = generate_from(
        &mut session,
        &mut mv,
        &mut supply,
        Some(&la),
        &inputs,
        &[],
        drafter.map(|d| Speculation {
            drafter: d,
            max_draft,
            adaptive: false,
            context: &[],
        }),
        GENERATE,
        |l| s.sample(l),
        |t, l| {
            tokens.push(t);
            logits.push(bits(l));
            Control::Continue
        },
    )
    .unwrap();
    let position = session.position();
    let mut after = vec![0f32; model.hp.n_vocab];
    let last = *tokens.last().unwrap();
    session
        .eval(
            &mut mv,
            &mut supply,
            Some(&la),
            TokenInput::Token(last),
            &mut after,
        )
        .unwrap();
    let run = Run {
        tokens,
        logits,
        position,
        after: bits(&after),
    };
    (run, stats)
}

const PROMPT: [u32; 7] = [46, 77, 66, 68, 220, 84, 77];

fn samplers() -> [SamplerConfig; 4] {
    [
        SamplerConfig::greedy(),
        SamplerConfig {
            temperature: 1.5,
            seed: 7,
            ..SamplerConfig::default()
        },
        // The penalty makes each pick depend on the tokens accepted before it:
        // verification must sample each position once, in order.
        SamplerConfig {
            penalties: Some(Penalties::repeat(1.5, 8)),
            ..SamplerConfig::greedy()
        },
        // Mirostat's mu moves with each pick: the same order matters.
        SamplerConfig {
            temperature: 1.0,
            mirostat: les::sampling::Mirostat::of(2, 3.0, 0.1),
            seed: 11,
            ..SamplerConfig::default()
        },
    ]
}

/// Every drafter and draft length gives plain decoding's run, for `path`.
fn check(path: &Path) {
    let vocab = Model::open(path).unwrap().hp.n_vocab as u32;
    for sampler in samplers() {
        let (want, _) = generate(path, Schedule::Resident, None, sampler, &PROMPT, None, 0, 1);
        assert_eq!(want.tokens.len(), GENERATE);
        let wrong_ones: [fn(u32) -> u32; 2] = [|t| t ^ 1, |_| u32::MAX];
        for (schedule, slots) in [
            (Schedule::Resident, None),
            (Schedule::Les, Some(5)),
            (Schedule::OnDemand, Some(4)),
        ] {
            for max_draft in [1, 3, 8] {
                for right in [0, 1, 2, GENERATE] {
                    for wrong in wrong_ones {
                        let mut d = Scripted {
                            prompt_len: PROMPT.len(),
                            truth: want.tokens.clone(),
                            right,
                            wrong,
                        };
                        let (got, stats) = generate(
                            path,
                            schedule,
                            slots,
                            sampler,
                            &PROMPT,
                            Some(&mut d),
                            max_draft,
                            4,
                        );
                        let what = format!(
                            "{} {schedule:?} draft {max_draft}, {right} right, t={}",
                            path.display(),
                            sampler.temperature
                        );
                        assert_eq!(got, want, "{what}");
                        if right >= max_draft && wrong(1) < vocab {
                            assert!(stats.accepted > 0, "{what}: {stats:?}");
                        }
                        if right == 0 && wrong(1) < vocab {
                            assert!(stats.drafted > 0 && stats.accepted == 0, "{what}");
                        }
                    }
                }
            }
        }
        // Prompt lookup, as `les run --speculate ngram` uses it.
        let mut d = NgramDrafter::new(1, 3);
        let (got, _) = generate(
            path,
            Schedule::Les,
            Some(6),
            sampler,
            &PROMPT,
            Some(&mut d),
            4,
            64,
        );
        assert_eq!(got, want, "{} ngram", path.display());
    }
}

#[test]
fn qwen3moe_drafts_change_nothing_but_speed() {
    check(qwen3moe());
}

#[test]
fn qwen35moe_drafts_change_nothing_but_speed() {
    check(qwen35moe());
}

#[test]
fn granitehybrid_drafts_change_nothing_but_speed() {
    check(granitehybrid());
}

#[test]
fn nemotron_h_moe_drafts_change_nothing_but_speed() {
    check(nemotron_h_moe());
}

#[test]
fn lfm2moe_drafts_change_nothing_but_speed() {
    check(lfm2moe());
}

/// A draft that agrees in full is accepted in full: `max_draft` + 1 tokens a
/// pass.
#[test]
fn a_right_draft_is_accepted_whole() {
    let path = qwen3moe();
    let (want, _) = generate(
        path,
        Schedule::Resident,
        None,
        SamplerConfig::greedy(),
        &PROMPT,
        None,
        0,
        1,
    );
    let mut d = Scripted {
        prompt_len: PROMPT.len(),
        truth: want.tokens.clone(),
        right: GENERATE,
        wrong: |t| t,
    };
    let (got, stats) = generate(
        path,
        Schedule::Resident,
        None,
        SamplerConfig::greedy(),
        &PROMPT,
        Some(&mut d),
        3,
        1,
    );
    assert_eq!(got, want);
    // After the first token, passes of 1 + 3 positions yield 4 tokens each.
    assert_eq!(stats.drafted, stats.accepted);
    assert_eq!(stats.verify_passes, (GENERATE - 1).div_ceil(4));
}

/// Calls a session cannot serve are errors, not panics: a draft longer than
/// `set_max_draft`, keeping more positions than were verified; `set_max_draft`
/// clamps to what the session holds.
#[test]
fn verify_and_keep_reject_what_they_cannot_do() {
    let path = qwen35moe();
    let model = Model::open(path).unwrap();
    let mut supply = Supply::new(
        &model,
        path,
        Schedule::Resident,
        SlotBudget::none(FileDeviceConfig::default()),
    )
    .unwrap();
    let mut mv = ThreadedMatVec::new(1, Isa::detect());
    let mut session = Session::new(&model, 6).unwrap();
    assert_eq!(session.set_max_draft(100).unwrap(), 5);
    assert_eq!(session.set_max_draft(2).unwrap(), 2);
    let n = model.hp.n_vocab;
    let tokens: Vec<TokenInput<'_>> = PROMPT[..4].iter().map(|&t| TokenInput::Token(t)).collect();
    let mut logits = vec![0f32; 4 * n];
    assert!(session
        .verify(&mut mv, &mut supply, &tokens, &mut logits)
        .is_err());
    assert_eq!(session.position(), 0);
    session
        .verify(&mut mv, &mut supply, &tokens[..3], &mut logits[..3 * n])
        .unwrap();
    assert_eq!(session.position(), 3);
    assert!(session.keep(&mut mv, &mut supply, &tokens[..3], 4).is_err());
    assert!(session.keep(&mut mv, &mut supply, &tokens, 1).is_err());
    session.keep(&mut mv, &mut supply, &tokens[..3], 1).unwrap();
    assert_eq!(session.position(), 1);
}

/// A draft model (`--model-draft`): the target itself guesses every token
/// (all accepted), another model of the same vocabulary guesses some; either
/// way the run is plain decoding's, bit for bit, streamed or resident, and a
/// qwen35moe target takes a qwen3moe draft. Draft models with recurrent
/// layers (qwen35moe's DeltaNet, lfm2moe's short convolutions) go back to
/// their checkpoint on a rejected draft: drafting for themselves, every
/// greedy draft is accepted.
#[test]
fn a_draft_model_changes_nothing_but_speed() {
    let other = synth(
        "draft-other",
        &["--arch", "qwen3moe", "--preset", "tiny", "--seed", "9"],
    );
    let targets = [
        (qwen3moe(), [qwen3moe(), other.as_path()]),
        (qwen35moe(), [qwen35moe(), qwen3moe()]),
        (lfm2moe(), [lfm2moe(), other.as_path()]),
    ];
    for (path, drafts) in targets {
        for sampler in samplers() {
            let (want, _) = generate(path, Schedule::Resident, None, sampler, &PROMPT, None, 0, 1);
            for draft in drafts {
                let dm = Model::open(draft).unwrap();
                let mut d = ModelDrafter::new(&dm, draft, PROMPT.len() + GENERATE + 8, 1).unwrap();
                let (got, stats) = generate(
                    path,
                    Schedule::Les,
                    Some(5),
                    sampler,
                    &PROMPT,
                    Some(&mut d),
                    4,
                    4,
                );
                let what = format!("{} drafted by {}", path.display(), draft.display());
                assert_eq!(got, want, "{what}");
                assert!(stats.drafted > 0, "{what}: {stats:?}");
                // A self-draft is the target's own greedy continuation.
                let plain_greedy = sampler == SamplerConfig::greedy();
                if path == draft && plain_greedy {
                    assert_eq!(stats.accepted, stats.drafted, "{what}: {stats:?}");
                }
            }
        }
    }
}

/// A recurrent draft model's drafts depend only on the history it is shown:
/// after drafting for one history, for a longer one (part of its draft
/// accepted), a shorter one, an unrelated one and the same one again, each
/// draft is a fresh drafter's for that history (it goes back to its
/// checkpoint, or to the start).
#[test]
fn a_recurrent_draft_model_follows_any_history() {
    for path in [lfm2moe(), qwen35moe()] {
        let dm = Model::open(path).unwrap();
        let ctx = 64;
        let mut d = ModelDrafter::new(&dm, path, ctx, 1).unwrap();
        let base: Vec<u32> = PROMPT.to_vec();
        let mut first = Vec::new();
        d.draft(&base, 4, &mut first);
        assert_eq!(first.len(), 4);
        let longer: Vec<u32> = base.iter().chain(&first[..2]).copied().chain([7]).collect();
        let shorter = base[..base.len() - 3].to_vec();
        let other: Vec<u32> = base.iter().map(|t| (t + 5) % 200).collect();
        for history in [&longer, &shorter, &other, &other, &base] {
            let mut got = Vec::new();
            d.draft(history, 4, &mut got);
            let mut fresh = ModelDrafter::new(&dm, path, ctx, 1).unwrap();
            let mut want = Vec::new();
            fresh.draft(history, 4, &mut want);
            assert_eq!(
                got,
                want,
                "{}: history of {}",
                path.display(),
                history.len()
            );
        }
    }
}

/// A draft model's fork (a drafter a sequence, for completions side by
/// side) drafts on its own: interleaved with its parent, each drafts what a
/// fresh drafter drafts for its own history, for an attention model and
/// recurrent ones.
#[test]
fn a_forked_draft_model_drafts_on_its_own() {
    for path in [qwen3moe(), lfm2moe(), qwen35moe()] {
        let dm = Model::open(path).unwrap();
        let ctx = 64;
        let mut parent = ModelDrafter::new(&dm, path, ctx, 1).unwrap();
        let a: Vec<u32> = PROMPT.to_vec();
        let b: Vec<u32> = PROMPT.iter().map(|t| (t + 11) % 200).collect();
        let mut out = Vec::new();
        parent.draft(&a, 4, &mut out);
        let mut fork = parent.fork().expect("a draft model forks");
        let fresh = |history: &[u32]| {
            let mut want = Vec::new();
            ModelDrafter::new(&dm, path, ctx, 1)
                .unwrap()
                .draft(history, 4, &mut want);
            want
        };
        let mut got = Vec::new();
        fork.draft(&b, 4, &mut got);
        assert_eq!(got, fresh(&b), "{}: the fork", path.display());
        let a_longer: Vec<u32> = a.iter().chain(&out[..2]).copied().collect();
        parent.draft(&a_longer, 4, &mut got);
        assert_eq!(got, fresh(&a_longer), "{}: the parent", path.display());
        let b_longer: Vec<u32> = b.iter().copied().chain([9]).collect();
        fork.draft(&b_longer, 4, &mut got);
        assert_eq!(got, fresh(&b_longer), "{}: the fork again", path.display());
    }
}

/// Draft models that cannot draft are clear errors: another vocabulary.
#[test]
fn unusable_draft_models_are_refused() {
    let target = Tokenizer::from_gguf(Model::open(qwen3moe()).unwrap().gguf()).unwrap();
    let big = synth(
        "draft-vocab",
        &["--arch", "qwen3moe", "--preset", "tiny", "--vocab", "400"],
    );
    let big = Tokenizer::from_gguf(Model::open(&big).unwrap().gguf()).unwrap();
    assert!(check_compatible(&target, &target).is_ok());
    // Its special tokens sit at other ids, and it has more tokens.
    let err = check_compatible(&target, &big).unwrap_err();
    assert!(err.contains("BOS or EOS"), "{err}");
}

/// Records what a drafter was asked and drafted.
struct Recorded<'d> {
    inner: &'d mut dyn Drafter,
    log: Vec<(usize, Vec<u32>)>,
}

impl Drafter for Recorded<'_> {
    fn draft(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        self.inner.draft(history, max, out);
        self.log.push((history.len(), out.clone()));
    }
    fn wants_hidden(&self) -> bool {
        self.inner.wants_hidden()
    }
    fn observe(&mut self, places: &[Place], inputs: &[TokenInput<'_>], hidden: &[f32]) {
        self.inner.observe(places, inputs, hidden);
    }
}

/// The model's own multi-token-prediction block drafts (`--speculate mtp`):
/// the run is plain decoding's bit for bit under every schedule, sampler and
/// draft length, and its drafts are the same whether the prompt was evaluated
/// one position or four at a time (the block sees the same hidden states).
#[test]
fn the_mtp_block_changes_nothing_but_speed() {
    let path = qwen35moe();
    let model = Model::open(path).unwrap();
    assert!(
        model.nextn_block().is_some(),
        "the tiny preset has an MTP block"
    );
    for sampler in samplers() {
        let (want, _) = generate(path, Schedule::Resident, None, sampler, &PROMPT, None, 0, 1);
        let mut logs = Vec::new();
        for (schedule, slots) in [
            (Schedule::Resident, None),
            (Schedule::Les, Some(5)),
            (Schedule::OnDemand, Some(4)),
        ] {
            for max_draft in [1, 3] {
                for batch in [1, 4] {
                    let mut d =
                        NextnDrafter::new(&model, path, PROMPT.len() + GENERATE + 8, 1).unwrap();
                    let mut rec = Recorded {
                        inner: &mut d,
                        log: Vec::new(),
                    };
                    let (got, stats) = generate(
                        path,
                        schedule,
                        slots,
                        sampler,
                        &PROMPT,
                        Some(&mut rec),
                        max_draft,
                        batch,
                    );
                    let what = format!("{schedule:?} draft {max_draft} batch {batch}");
                    assert_eq!(got, want, "{what}");
                    assert!(stats.drafted > 0, "{what}: {stats:?}");
                    logs.push((max_draft, rec.log));
                }
            }
        }
        for (m, log) in &logs {
            let first = &logs.iter().find(|(n, _)| n == m).unwrap().1;
            assert_eq!(log, first, "draft {m}: drafts differ between runs");
        }
    }
}

/// The model's greedy token after `prompt` and its logits, and the logits of `steps` drafting
/// steps of its nextn block from it, computed here from the session's hidden
/// states directly: each prompt token paired with the normed hidden state
/// before it (zeros first), then each guess with the block's own state.
fn mtp_by_hand(path: &Path, prompt: &[u32], steps: usize) -> (u32, Vec<f32>, Vec<Vec<f32>>) {
    use les_core::model::forward::nextn::{cache_params, forward_nextn};
    use les_core::model::forward::{KvCache, Scratch, Weights};
    use les_core::model::ops::rms_norm;
    let model = Model::open(path).unwrap();
    let (hp, hy, e) = (&model.hp, &model.hybrid, model.hp.n_embd);
    let n = prompt.len() + steps;
    let mut supply = Supply::new(
        &model,
        path,
        Schedule::Resident,
        SlotBudget::none(FileDeviceConfig::default()),
    )
    .unwrap();
    let mut mv = ThreadedMatVec::new(1, Isa::detect());
    let mut session = Session::new(&model, n).unwrap();
    session.set_keep_hidden(true);
    let mut logits = vec![0f32; hp.n_vocab];
    let mut hidden = Vec::new();
    for &t in prompt {
        session
            .eval(
                &mut mv,
                &mut supply,
                None,
                TokenInput::Token(t),
                &mut logits,
            )
            .unwrap();
        hidden.push(session.hidden().to_vec());
    }
    let next = Sampler::new(SamplerConfig::greedy()).sample(&logits);
    let block = model.nextn_block().unwrap();
    let hy1 = cache_params(hy);
    let (mut k, mut v) = (
        vec![0f32; KvCache::len_for(hp, &hy1, n)],
        vec![0f32; KvCache::len_for(hp, &hy1, n)],
    );
    let mut kv = KvCache::new_for(hp, &hy1, &mut k, &mut v, n).unwrap();
    let mut sbuf = vec![0f32; Scratch::len_for(hp, hy, n)];
    let mut s = Scratch::new_for(hp, hy, &mut sbuf, n).unwrap();
    let (mut cat, mut h_prev, mut h_out) = (vec![0f32; 2 * e], vec![0f32; e], vec![0f32; e]);
    let mut out = Vec::new();
    let mut input = next;
    for pos in 0..n {
        let drafting = pos >= prompt.len();
        if drafting && pos > prompt.len() {
            h_prev.copy_from_slice(&h_out);
        } else if pos > 0 {
            rms_norm(
                &hidden[pos - 1],
                model.output_norm(),
                hp.norm_eps,
                &mut h_prev,
            );
        }
        let token = if drafting { input } else { prompt[pos] };
        let mut lg = vec![0f32; hp.n_vocab];
        forward_nextn(
            hp,
            hy,
            &block,
            hp.n_layers,
            &mut mv,
            &mut supply,
            TokenInput::Token(token),
            &h_prev,
            pos,
            &mut kv,
            &mut s,
            &mut cat,
            &mut h_out,
            drafting.then_some(&mut lg[..]),
        )
        .unwrap();
        if drafting {
            input = Sampler::new(SamplerConfig::greedy()).sample(&lg);
            out.push(lg);
        }
    }
    (next, logits, out)
}

/// The drafter's first draft after a prompt (three tokens) is the block's
/// greedy chain at the prompt's end, computed by hand ([`mtp_by_hand`]).
#[test]
fn the_mtp_drafter_pairs_each_token_with_the_state_before_it() {
    let path = qwen35moe();
    let model = Model::open(path).unwrap();
    let (_, _, steps) = mtp_by_hand(path, &PROMPT, 3);
    let want: Vec<u32> = steps
        .iter()
        .map(|l| Sampler::new(SamplerConfig::greedy()).sample(l))
        .collect();
    // The drafter, fed by generate_from.
    let mut d = NextnDrafter::new(&model, path, PROMPT.len() + GENERATE + 8, 1).unwrap();
    let mut rec = Recorded {
        inner: &mut d,
        log: Vec::new(),
    };
    generate(
        path,
        Schedule::Resident,
        None,
        SamplerConfig::greedy(),
        &PROMPT,
        Some(&mut rec),
        3,
        4,
    );
    let (len, first) = &rec.log[0];
    assert_eq!(
        *len,
        PROMPT.len() + 1,
        "the first draft follows the prompt and a token"
    );
    assert_eq!(first, &want);
}

/// A fork of the MTP drafter (one a sequence side by side) has a cache of
/// its own: after its parent drafted for one run, the fork drafts for
/// another prompt what a fresh drafter drafts, and so does the parent after
/// it.
#[test]
fn a_forked_mtp_drafter_drafts_on_its_own() {
    let path = qwen35moe();
    let model = Model::open(path).unwrap();
    let ctx = PROMPT.len() + GENERATE + 8;
    let drafts = |d: &mut dyn Drafter, prompt: &[u32]| {
        let mut rec = Recorded {
            inner: d,
            log: Vec::new(),
        };
        let sampler = SamplerConfig::greedy();
        generate(
            path,
            Schedule::Resident,
            None,
            sampler,
            prompt,
            Some(&mut rec),
            3,
            4,
        );
        rec.log
    };
    let other: Vec<u32> = PROMPT.iter().map(|t| (t + 11) % 200).collect();
    let mut parent = NextnDrafter::new(&model, path, ctx, 1).unwrap();
    let first = drafts(&mut parent, &PROMPT);
    let mut fork = parent.fork().expect("the MTP drafter forks");
    let fresh = |prompt: &[u32]| {
        drafts(
            &mut NextnDrafter::new(&model, path, ctx, 1).unwrap(),
            prompt,
        )
    };
    assert_eq!(first, fresh(&PROMPT));
    assert_eq!(drafts(fork.as_mut(), &other), fresh(&other), "the fork");
    assert_eq!(
        drafts(&mut parent, &PROMPT),
        first,
        "the parent after its fork"
    );
}

/// The nextn block's drafts against llama.cpp's `draft-mtp`, driven by
/// `tests/scripts/llama_mtp.cpp` (how to build it is at its top), on the tiny
/// qwen35moe with f32 weights (only float rounding apart) and with its
/// quantized ones (also the two kernels' quantized activations), and on tiny
/// qwen3next, glm4moe and deepseek2 with f32 weights: the same
/// greedy token after the prompt, and for each of four drafting steps the same
/// greedy guess, with logits within four times the difference the model's own
/// logits show (the drafts start from its hidden states, so theirs carries
/// on). A wrong pairing, norm or order is off by the logits' own size.
#[test]
#[ignore = "needs a llama.cpp build: LLAMA_MTP=/path/to/llama-mtp"]
fn mtp_drafts_equal_llama_cpp() {
    let bin = std::env::var("LLAMA_MTP").expect("LLAMA_MTP");
    // f32 weights for every architecture with a nextn block (deepseek2's
    // with latent attention in it).
    let f32_models: Vec<PathBuf> = ["qwen35moe", "qwen3next", "glm4moe", "deepseek2"]
        .iter()
        .map(|arch| {
            let args = [&["--arch", arch, "--preset", "tiny"][..], &F32_WEIGHTS].concat();
            synth(
                &format!("mtp-f32-{arch}"),
                &[&args[..], &["--mtp-layers", "1"]].concat(),
            )
        })
        .collect();
    let steps = 4;
    let mut models: Vec<(&Path, bool)> = f32_models.iter().map(|p| (p.as_path(), true)).collect();
    models.insert(1, (qwen35moe_plain(), false));
    for (path, exact) in models {
        let out = Command::new(&bin)
            .arg(path)
            .arg(steps.to_string())
            .args(PROMPT.iter().map(u32::to_string))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "llama-mtp: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines = text.lines();
        let their_next: u32 = lines.next().unwrap().parse().unwrap();
        let rows: Vec<Vec<f32>> = lines
            .map(|l| l.split(' ').map(|v| v.parse().unwrap()).collect())
            .collect();
        let (their_main, theirs) = rows.split_first().unwrap();
        let (next, our_main, ours) = mtp_by_hand(path, &PROMPT, steps);
        let what = path.display();
        assert_eq!(next, their_next, "{what}: the model's greedy token");
        assert_eq!(ours.len(), theirs.len());
        // Relative to the largest logit.
        let error = |a: &[f32], b: &[f32]| {
            let err = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            err / b.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1.0)
        };
        let main = error(&our_main, their_main);
        eprintln!("{what}: the model's logits, relative error {main:.2e}");
        // f32 weights are apart by rounding alone; quantized ones also by the
        // kernels' activation quantization.
        assert!(main <= if exact { 1e-3 } else { 3e-2 }, "{what}: {main}");
        let bound = 4.0 * main;
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            let greedy = |x: &[f32]| Sampler::new(SamplerConfig::greedy()).sample(x);
            let err = error(a, b);
            eprintln!("{what}: draft step {i}, relative error {err:.2e}");
            assert_eq!(greedy(a), greedy(b), "{what} step {i}: the guesses differ");
            assert!(err <= bound, "{what} step {i}: error {err} above {bound}");
        }
    }
}

/// `--speculate mtp` on a model without a multi-token-prediction block is a
/// clear error.
#[test]
fn a_model_without_an_mtp_block_cannot_draft_with_one() {
    let model = Model::open(qwen3moe()).unwrap();
    let err = NextnDrafter::new(&model, qwen3moe(), 64, 1).err().unwrap();
    assert!(err.contains("no multi-token-prediction block"), "{err}");
    let no_mtp = synth(
        "no-mtp",
        &[
            "--arch",
            "qwen35moe",
            "--preset",
            "tiny",
            "--mtp-layers",
            "0",
        ],
    );
    let model = Model::open(&no_mtp).unwrap();
    assert!(model.nextn_block().is_none());
    let err = NextnDrafter::new(&model, &no_mtp, 64, 1).err().unwrap();
    assert!(err.contains("no multi-token-prediction block"), "{err}");
}

/// A malformed multi-token-prediction block (here its `enorm` missing) does
/// not stop the model from running, as llama.cpp skips the block unasked;
/// `--speculate mtp` says what is wrong with it.
#[test]
fn a_malformed_mtp_block_only_stops_mtp_drafting() {
    use les::gguf::{Gguf, GgufWriter};
    use std::io::BufWriter;
    qwen35moe();
    let src = qwen35moe_plain();
    let dst = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("spec-mtp-no-enorm.gguf");
    let g = Gguf::open(src).unwrap();
    let n_layers = Model::open(src).unwrap().hp.n_layers;
    let dropped = format!("blk.{n_layers}.nextn.enorm.weight");
    assert!(g.tensor(&dropped).is_some());
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add_kv(k, v.to_meta()).unwrap();
    }
    let kept: Vec<_> = g.tensors().filter(|t| t.name() != dropped).collect();
    for t in &kept {
        w.add_tensor(t.name(), t.dims(), t.ggml_type()).unwrap();
    }
    let mut data = w
        .write_header(BufWriter::new(std::fs::File::create(&dst).unwrap()))
        .unwrap();
    for t in &kept {
        data.write_tensor(t.name(), t.data()).unwrap();
    }
    data.finish().unwrap();

    let model = Model::open(&dst).unwrap();
    assert!(model.nextn_block().is_none());
    let why = model.nextn_error().unwrap();
    assert!(why.contains("enorm"), "{why}");
    let err = NextnDrafter::new(&model, &dst, 64, 1).err().unwrap();
    assert!(
        err.contains("cannot draft") && err.contains("enorm"),
        "{err}"
    );
    // The model itself decodes as the intact file does.
    let sampler = SamplerConfig::greedy();
    let (want, _) = generate(src, Schedule::Resident, None, sampler, &PROMPT, None, 0, 1);
    let (got, _) = generate(&dst, Schedule::Resident, None, sampler, &PROMPT, None, 0, 1);
    assert_eq!(got, want);
}
