//! Sessions evaluated side by side (`Session::eval_together`: one pass for
//! all their next inputs, each layer's experts asked for once) give every
//! session the logits, cache and state it gets evaluated alone, bit for bit:
//! prompts of different lengths at once, decoding side by side, a session
//! sitting a pass out or taking two positions, for every kind of mixer
//! (attention, sliding-window rings, latent attention, DeltaNet, Mamba2,
//! short convolutions), with the experts resident or streamed from the file
//! through a few slots.

mod cli;

use std::path::{Path, PathBuf};

use les::compute::ThreadedMatVec;
use les::engine::{InputPlace, Session, SessionInputs};
use les::flash::FileDeviceConfig;
use les::model::Model;
use les::supply::{Schedule, SlotBudget, Supply};
use les_core::gemv::Isa;
use les_core::model::forward::TokenInput;

/// A packed tiny model of `arch`.
fn packed(arch: &str) -> PathBuf {
    let plain = cli::tiny(arch, "seq", &["--quiet"]);
    let packed = plain.with_extension("p.gguf");
    cli::pack(&plain, &packed);
    packed
}

/// The passes: for each session, the tokens it evaluates in the pass (none:
/// it sits the pass out). The first pass is the prompts.
fn passes(n_vocab: u32) -> Vec<[Vec<u32>; 3]> {
    let t = |i: u32| (i * 7919 + 13) % n_vocab;
    vec![
        [
            vec![t(1), t(2), t(3), t(4), t(5)],
            vec![t(6), t(7), t(8)],
            (9..16).map(t).collect(),
        ],
        [vec![t(20)], vec![t(21)], vec![t(22)]],
        [vec![t(23)], vec![t(24)], vec![t(25)]],
        [vec![t(26)], vec![], vec![t(27)]],
        [vec![t(28)], vec![t(29), t(30)], vec![t(31)]],
        [vec![], vec![t(32)], vec![]],
        [vec![t(33)], vec![t(34)], vec![t(35)]],
    ]
}

/// Whether session `q` asks for every one of its positions' logits in pass
/// `i` (as verifying a draft does), else its last's.
fn every(i: usize, q: usize) -> bool {
    matches!((i, q), (0, 2) | (4, 1))
}

/// The bits of the logits of each session's passes (its last position's, or
/// every one's where [`every`] says), evaluated
/// `together` or each session alone, the experts resident (`slots: None`) or
/// streamed through `slots` slots by `schedule`.
fn run(path: &Path, slots: Option<usize>, schedule: Schedule, together: bool) -> Vec<Vec<u32>> {
    let model = Model::open(path).unwrap();
    let budget = cli::slot_budget(&model, slots);
    let mut supply = Supply::new(&model, path, schedule, budget).unwrap();
    let mut mv = ThreadedMatVec::new(2, Isa::detect());
    let n_vocab = model.hp.n_vocab;
    let mut sessions: Vec<Session<'_>> = (0..3)
        .map(|_| {
            let mut s = Session::new(&model, 32).unwrap();
            s.set_prefill_batch(16).unwrap();
            s
        })
        .collect();
    let mut out = Vec::new();
    let rows = |i: usize, q: usize, ins: &[TokenInput<'_>]| {
        if every(i, q) {
            ins.len()
        } else {
            1
        }
    };
    for (i, pass) in passes(n_vocab as u32).iter().enumerate() {
        let inputs: Vec<Vec<TokenInput<'_>>> = pass
            .iter()
            .map(|ts| ts.iter().map(|&t| TokenInput::Token(t)).collect())
            .collect();
        if together {
            let (mut taking, parts): (Vec<&mut Session<'_>>, Vec<SessionInputs<'_, '_>>) = sessions
                .iter_mut()
                .zip(&inputs)
                .enumerate()
                .filter(|(_, (_, ins))| !ins.is_empty())
                .map(|(q, (s, ins))| {
                    let every = every(i, q);
                    let part = SessionInputs {
                        inputs: ins,
                        places: &[],
                        every,
                    };
                    (s, part)
                })
                .unzip();
            let n_rows: usize = (0..3)
                .map(|q| rows(i, q, &inputs[q]).min(inputs[q].len()))
                .sum();
            let mut logits = vec![0f32; n_rows * n_vocab];
            Session::eval_together_placed(&mut taking, &mut mv, &mut supply, &parts, &mut logits)
                .unwrap();
            out.extend(
                logits
                    .chunks_exact(n_vocab)
                    .map(|l| l.iter().map(|v| v.to_bits()).collect()),
            );
        } else {
            for (q, (s, ins)) in sessions.iter_mut().zip(&inputs).enumerate() {
                if ins.is_empty() {
                    continue;
                }
                let mut logits = vec![0f32; rows(i, q, ins) * n_vocab];
                s.eval_batch(&mut mv, &mut supply, ins, &mut logits)
                    .unwrap();
                out.extend(
                    logits
                        .chunks_exact(n_vocab)
                        .map(|l| l.iter().map(|v| v.to_bits()).collect()),
                );
            }
        }
    }
    let positions: Vec<usize> = sessions.iter().map(Session::position).collect();
    assert_eq!(positions, [5 + 5, 3 + 6, 7 + 5]);
    out
}

#[test]
fn sessions_together_equal_each_alone() {
    for arch in [
        "qwen3moe",
        "gpt-oss",
        "deepseek2",
        "qwen35moe",
        "granitehybrid",
        "nemotron_h_moe",
        "lfm2moe",
    ] {
        let path = packed(arch);
        let want = run(&path, None, Schedule::Resident, false);
        assert_eq!(want.len(), 3 + 3 + 3 + 2 + 3 + 1 + 3 + (7 - 1) + (2 - 1));
        assert_eq!(
            run(&path, None, Schedule::Resident, true),
            want,
            "{arch} resident"
        );
        for schedule in [Schedule::Les, Schedule::OnDemand] {
            assert_eq!(
                run(&path, Some(5), schedule, true),
                want,
                "{arch} {schedule:?} in 5 slots"
            );
        }
    }
}

/// What the sessions cannot do together is an error that leaves them where
/// they were: no sessions, inputs that do not match them, more positions
/// than the first one's batch buffers, logits of another length.
#[test]
fn eval_together_refuses_and_leaves_the_sessions() {
    let path = packed("qwen3moe");
    let model = Model::open(&path).unwrap();
    let budget = SlotBudget::none(FileDeviceConfig::default());
    let mut supply = Supply::new(&model, &path, Schedule::Resident, budget).unwrap();
    let mut mv = ThreadedMatVec::new(1, Isa::detect());
    let n_vocab = model.hp.n_vocab;
    let mut a = Session::new(&model, 8).unwrap();
    a.set_prefill_batch(4).unwrap();
    let mut b = Session::new(&model, 8).unwrap();
    b.set_prefill_batch(4).unwrap();
    let t = TokenInput::Token(1);
    let three = [t, t, t];
    let cases: [(&[&[TokenInput<'_>]], usize); 5] = [
        (&[&[t]], 2),
        (&[&[t], &[]], 2),
        (&[&three, &[t, t]], 2),
        (&[&[t], &[t]], 1),
        (&[&[t], &[t]], 3),
    ];
    for (inputs, rows) in cases {
        let r = Session::eval_together(
            &mut [&mut a, &mut b],
            &mut mv,
            &mut supply,
            inputs,
            &mut vec![0f32; rows * n_vocab],
        );
        assert!(r.is_err(), "{} inputs, {rows} rows", inputs.len());
        assert_eq!((a.position(), b.position()), (0, 0));
    }
    assert!(Session::eval_together(&mut [], &mut mv, &mut supply, &[], &mut []).is_err());
    // One session's every position and the other's last: three rows, not two.
    let parts = [
        SessionInputs {
            inputs: &[t, t],
            places: &[],
            every: true,
        },
        SessionInputs {
            inputs: &[t],
            places: &[],
            every: false,
        },
    ];
    let r = Session::eval_together_placed(
        &mut [&mut a, &mut b],
        &mut mv,
        &mut supply,
        &parts,
        &mut vec![0f32; 2 * n_vocab],
    );
    assert!(r.is_err());
    assert_eq!((a.position(), b.position()), (0, 0));
    // Past one session's context: neither moves.
    let mut full = vec![0f32; n_vocab];
    a.eval_batch(&mut mv, &mut supply, &[t; 4], &mut full)
        .unwrap();
    a.eval_batch(&mut mv, &mut supply, &[t; 3], &mut full)
        .unwrap();
    let r = Session::eval_together(
        &mut [&mut b, &mut a],
        &mut mv,
        &mut supply,
        &[&[t], &[t, t]],
        &mut vec![0f32; 2 * n_vocab],
    );
    assert!(r.is_err());
    assert_eq!((a.position(), b.position()), (7, 0));
    // The same pass within the context goes.
    Session::eval_together(
        &mut [&mut b, &mut a],
        &mut mv,
        &mut supply,
        &[&[t], &[t]],
        &mut vec![0f32; 2 * n_vocab],
    )
    .unwrap();
    assert_eq!((a.position(), b.position()), (8, 1));
}

/// Image embeddings at their M-RoPE places (a 2 x 2 grid in a qwen35moe
/// prompt, split across two passes) evaluated beside another session's text
/// give each session what it gets alone.
#[test]
fn placed_embeddings_together_equal_each_alone() {
    let path = packed("qwen35moe");
    let model = Model::open(&path).unwrap();
    let e = model.n_embd_inp();
    let n_vocab = model.hp.n_vocab;
    let image: Vec<Vec<f32>> = (0..4)
        .map(|k| {
            (0..e)
                .map(|i| ((i * 7 + k * 13) % 17) as f32 / 17.0 - 0.5)
                .collect()
        })
        .collect();
    let t = |i: u32| TokenInput::Token(i % n_vocab as u32);
    let grid = |k: u32| InputPlace::Image { k, nx: 2, ny: 2 };
    let a: Vec<TokenInput<'_>> = [t(3), t(9)]
        .into_iter()
        .chain(image.iter().map(|v| TokenInput::Embedding(v)))
        .chain([t(11)])
        .collect();
    let a_at: Vec<InputPlace> = [InputPlace::Text; 2]
        .into_iter()
        .chain((0..4).map(grid))
        .chain([InputPlace::Text])
        .collect();
    let b = [t(5), t(6), t(7), t(8)];
    // (A's inputs, B's inputs) of each pass.
    let passes = [(0..4, 0..3), (4..7, 3..4)];
    let budget = SlotBudget::none(FileDeviceConfig::default());
    let mut supply = Supply::new(&model, &path, Schedule::Resident, budget).unwrap();
    let mut mv = ThreadedMatVec::new(2, Isa::detect());
    let session = || {
        let mut s = Session::new(&model, 16).unwrap();
        s.set_prefill_batch(8).unwrap();
        s
    };
    let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let (mut sa, mut sb) = (session(), session());
    let mut alone = Vec::new();
    for (ra, rb) in passes.clone() {
        let mut logits = vec![0f32; n_vocab];
        sa.eval_batch_placed(&mut mv, &mut supply, &a[ra.clone()], &a_at[ra], &mut logits)
            .unwrap();
        alone.push(bits(&logits));
        sb.eval_batch(&mut mv, &mut supply, &b[rb], &mut logits)
            .unwrap();
        alone.push(bits(&logits));
    }
    let (mut sa, mut sb) = (session(), session());
    let mut together = Vec::new();
    for (ra, rb) in passes {
        let mut logits = vec![0f32; 2 * n_vocab];
        let parts = [
            SessionInputs {
                inputs: &a[ra.clone()],
                places: &a_at[ra],
                every: false,
            },
            SessionInputs {
                inputs: &b[rb],
                places: &[],
                every: false,
            },
        ];
        Session::eval_together_placed(
            &mut [&mut sa, &mut sb],
            &mut mv,
            &mut supply,
            &parts,
            &mut logits,
        )
        .unwrap();
        together.extend(logits.chunks_exact(n_vocab).map(bits));
    }
    assert_eq!(together, alone);
    // A place list for each session, one place an input, or none at all.
    let parts = [
        SessionInputs {
            inputs: &b[..1],
            places: &a_at[..2],
            every: false,
        },
        SessionInputs {
            inputs: &b[..1],
            places: &[],
            every: false,
        },
    ];
    let r = Session::eval_together_placed(
        &mut [&mut sa, &mut sb],
        &mut mv,
        &mut supply,
        &parts,
        &mut vec![0f32; 2 * n_vocab],
    );
    assert!(r.is_err());
    assert_eq!((sa.position(), sb.position()), (7, 4));
}
