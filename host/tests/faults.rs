//! Faults injected under the real file device (`FaultyDevice` around `FileDevice`)
//! while a packed synthetic model decodes: transient faults (delays, short reads,
//! transient EIO) are retried and the logits stay bit-identical to the resident
//! run; a persistent EIO or corrupted data ends the run with an error naming the
//! layer and expert, and no logits computed from a bad slot are produced. Once
//! the device reads well again, the same experts (slots, scheduler, device)
//! decode exactly: the pass that failed left nothing behind.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use les::compute::ThreadedMatVec;
use les::engine::Session;
use les::flash::faults::{seeded, Fault, FaultCounts, FaultRates, FaultyDevice};
use les::flash::{FileDevice, FileDeviceConfig, IoEngine};
use les::model::Model;
use les::supply::{ModelSource, Schedule, SlotBudget, Supply};
use les_core::blockdev::ReadRequest;
use les_core::gemv::Isa;
use les_core::model::experts::Streamed;
use les_core::model::forward::{Experts, Lookahead, TokenInput};
use les_core::router::{LayerMask, PredictorConfig};
use les_core::schedule::{LayerState, Scheduler, SchedulerConfig};
use les_core::slots::{ExpertKey, IndexEntry, Slot};

const PROMPT: [u32; 6] = [46, 77, 66, 68, 220, 84];
const GENERATE: usize = 6;

/// A packed tiny qwen3moe (4 layers of 8 experts), made once.
fn packed_model() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let plain = dir.join("faults-tiny.gguf");
        let packed = dir.join("faults-tiny.packed.gguf");
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
        les(&["synth", "--arch", "qwen3moe", "--preset", "tiny", "-o", p]);
        les(&["pack", "--quiet", p, "-o", packed.to_str().unwrap()]);
        packed
    })
}

fn lookahead(model: &Model) -> Lookahead {
    Lookahead {
        predictor: PredictorConfig::top_k(model.hp.moe.unwrap().top_k),
        layers: LayerMask::first(model.hp.n_layers).unwrap(),
        depth: 2,
    }
}

/// Greedy decoding; the logits of every evaluated position, until an error.
fn decode<X: Experts>(model: &Model, experts: &mut X) -> (Vec<Vec<f32>>, Option<String>)
where
    X::Error: std::fmt::Display,
{
    let mut mv = ThreadedMatVec::new(1, Isa::detect());
    let la = lookahead(model);
    let mut session = Session::new(model, PROMPT.len() + GENERATE).unwrap();
    let mut logits = vec![0f32; model.hp.n_vocab];
    let mut all = Vec::new();
    let mut input: Vec<u32> = PROMPT.to_vec();
    for step in 0..PROMPT.len() + GENERATE - 1 {
        let t = input[step];
        if let Err(e) = session.eval(
            &mut mv,
            experts,
            Some(&la),
            TokenInput::Token(t),
            &mut logits,
        ) {
            return (all, Some(e.to_string()));
        }
        all.push(logits.clone());
        if step + 1 >= PROMPT.len() {
            let next = logits
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &l)| if l > b.1 { (i, l) } else { b },
                )
                .0;
            input.push(next as u32);
        }
    }
    (all, None)
}

fn resident() -> &'static Vec<Vec<f32>> {
    static LOGITS: OnceLock<Vec<Vec<f32>>> = OnceLock::new();
    LOGITS.get_or_init(|| {
        let path = packed_model();
        let model = Model::open(path).unwrap();
        let budget = SlotBudget::none(FileDeviceConfig::default());
        let mut supply = Supply::new(&model, path, Schedule::Resident, budget).unwrap();
        let (logits, err) = decode(&model, &mut supply);
        assert!(err.is_none());
        logits
    })
}

/// Decodes with experts streamed through `slots` slots of a faulty file device.
fn faulty_run<F: FnMut(&ReadRequest) -> Fault>(
    les: bool,
    slots: usize,
    script: F,
) -> (Vec<Vec<f32>>, Option<String>, FaultCounts) {
    faulty_run_checked(les, slots, true, IoEngine::Threads, script)
}

/// [`faulty_run`], with checksums verified where each expert is first computed
/// (`verify_on_compute`, the default) or as each read arrives, reads issued by
/// `engine`. A run that ends in an error is decoded again from its start
/// through the same experts with the faults off, which must give every
/// logit of the resident run.
fn faulty_run_checked<F: FnMut(&ReadRequest) -> Fault>(
    les: bool,
    slots: usize,
    verify_on_compute: bool,
    engine: IoEngine,
    script: F,
) -> (Vec<Vec<f32>>, Option<String>, FaultCounts) {
    let path = packed_model();
    let model = Model::open(path).unwrap();
    let moe = model.hp.moe.unwrap();
    let slot_bytes = model.max_expert_bytes();
    let io = FileDeviceConfig {
        engine,
        threads: 3,
        queue_depth: 8,
        direct: true,
        chunk_bytes: 4096,
    };
    let healed = Arc::new(AtomicBool::new(false));
    let off = Arc::clone(&healed);
    let mut script = script;
    let device = FaultyDevice::new(
        FileDevice::open(path, slots, slot_bytes, io).unwrap(),
        move |r: &ReadRequest| {
            if off.load(Ordering::Relaxed) {
                Fault::None
            } else {
                script(r)
            }
        },
    );
    let config = SchedulerConfig {
        verify_on_compute,
        ..if les {
            SchedulerConfig::les()
        } else {
            SchedulerConfig::on_demand()
        }
    };
    let n_layers = model.hp.n_layers;
    let scheduler = Scheduler::new(
        config,
        vec![Slot::EMPTY; slots],
        vec![IndexEntry::EMPTY; n_layers * moe.n_experts],
        vec![LayerState::INITIAL; n_layers],
        n_layers as u16,
        moe.n_experts as u16,
        slot_bytes as u32,
    )
    .unwrap();
    let m = &model;
    let mut experts = Streamed {
        scheduler,
        device,
        source: ModelSource::new(m),
        format: move |l| m.expert_format(l).unwrap(),
        predict: les,
    };
    let (logits, err) = decode(&model, &mut experts);
    if let Some(e) = &err {
        healed.store(true, Ordering::Relaxed);
        let (again, err) = decode(&model, &mut experts);
        assert_eq!(err, None, "after {e}, the healed device's run failed");
        assert_eq!(again.len(), resident().len());
        assert_prefix_exact(&again, &format!("after {e}, the healed device's run"));
    }
    experts.scheduler.drain(&mut experts.device);
    let counts = experts.device.counts();
    (logits, err, counts)
}

fn assert_prefix_exact(got: &[Vec<f32>], what: &str) {
    let want = resident();
    assert!(got.len() <= want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{what}: logits of position {i} differ from the resident run"
        );
    }
}

#[test]
fn transient_faults_are_retried_and_logits_stay_bit_identical() {
    let rates = FaultRates {
        delay: 150,
        short_read: 80,
        transient_eio: 80,
        max_transient_per_offset: 2, // below the scheduler's 3 retries
        ..FaultRates::default()
    };
    for (seed, les, slots, engine) in [
        (1, true, 4, IoEngine::Threads),
        (2, false, 2, IoEngine::Threads),
        (3, true, 3, IoEngine::Uring),
        (4, true, 16, IoEngine::Threads),
        (5, false, 3, IoEngine::Uring),
    ] {
        let (logits, err, counts) =
            faulty_run_checked(les, slots, true, engine, seeded(seed, rates));
        assert_eq!(
            err, None,
            "seed {seed}: transient faults must not end the run"
        );
        assert_eq!(logits.len(), resident().len());
        assert_prefix_exact(&logits, &format!("seed {seed}"));
        assert!(
            counts.delays > 0 && counts.short_reads + counts.transient > 0,
            "seed {seed}: the script injected faults: {counts:?}"
        );
    }
}

/// The packed extent of expert `key` (its file offset), to aim faults at.
fn offset_of(key: ExpertKey) -> u64 {
    let model = Model::open(packed_model()).unwrap();
    model.expert_extents(key)[0].offset
}

#[test]
fn persistent_eio_names_the_layer_and_expert() {
    // Expert 3 of layer 2 cannot be read, ever (demand or prefetch).
    let key = ExpertKey {
        layer: 2,
        expert: 3,
    };
    let bad = offset_of(key);
    for les in [true, false] {
        let script = |r: &ReadRequest| {
            if r.offset == bad {
                Fault::PermanentEio
            } else {
                Fault::None
            }
        };
        let (logits, err, counts) = faulty_run(les, 4, script);
        let err = err.expect("a persistent fault ends the run, if the expert is ever picked");
        assert!(counts.permanent > 0);
        assert!(
            err.contains("layer 2 expert 3") && err.contains("Input/output error"),
            "the error names layer, expert and cause: {err}"
        );
        assert_prefix_exact(&logits, "before the persistent fault");
    }
}

#[test]
fn corrupted_data_is_caught_by_the_checksum_naming_the_expert() {
    // Every read of one expert flips a bit: a checksum mismatch, never output.
    let key = ExpertKey {
        layer: 1,
        expert: 5,
    };
    let bad = offset_of(key);
    let script = |r: &ReadRequest| {
        if r.offset == bad {
            Fault::BitFlip(12345)
        } else {
            Fault::None
        }
    };
    // Checked where first computed (the default) or as each read arrives.
    for (les, on_compute) in [(true, true), (false, true), (true, false), (false, false)] {
        let what = format!("les {les}, verify on compute {on_compute}");
        let (logits, err, counts) =
            faulty_run_checked(les, 4, on_compute, IoEngine::Threads, script);
        let err = err.unwrap_or_else(|| panic!("{what}: corruption ends the run ({counts:?})"));
        assert!(counts.flips > 0, "{what}");
        assert!(
            err.contains("layer 1 expert 5") && err.contains("checksum"),
            "{what}: the error names the expert and the checksum: {err}"
        );
        assert_prefix_exact(&logits, &format!("{what}: before the corrupted expert"));
    }
}

#[test]
fn a_bit_flipped_once_is_read_again_and_logits_stay_bit_identical() {
    // The first read of one expert flips a bit, the next ones do not: the
    // expert is read again (where it arrives, or where it is first computed,
    // then computed again) and the run goes on, exact.
    let bad = offset_of(ExpertKey {
        layer: 1,
        expert: 5,
    });
    for (les, on_compute) in [(true, true), (false, true), (true, false), (false, false)] {
        let what = format!("les {les}, verify on compute {on_compute}");
        let mut flipped = false;
        let script = move |r: &ReadRequest| {
            if r.offset == bad && !flipped {
                flipped = true;
                Fault::BitFlip(12345)
            } else {
                Fault::None
            }
        };
        let (logits, err, counts) =
            faulty_run_checked(les, 4, on_compute, IoEngine::Threads, script);
        assert_eq!(err, None, "{what}: a flip read again ends nothing");
        assert_eq!(counts.flips, 1, "{what}");
        assert_eq!(logits.len(), resident().len());
        assert_prefix_exact(&logits, &what);
    }
}

#[test]
fn random_faults_end_in_an_error_or_in_exact_logits() {
    let rates = FaultRates {
        delay: 100,
        short_read: 40,
        transient_eio: 40,
        permanent_eio: 1,
        bit_flip: 4,
        max_transient_per_offset: 2,
    };
    let mut errors = 0;
    for seed in 10..16 {
        let (logits, err, _) = faulty_run(seed % 2 == 0, 3, seeded(seed, rates));
        // Whatever happened, every logit produced equals the resident run's.
        assert_prefix_exact(&logits, &format!("seed {seed}"));
        match err {
            None => assert_eq!(logits.len(), resident().len()),
            Some(e) => {
                errors += 1;
                assert!(
                    e.contains(" expert ") && (e.contains("checksum") || e.contains("error")),
                    "seed {seed}: {e}"
                );
            }
        }
    }
    eprintln!("{errors} of 6 runs ended in an error");
}
