//! Model files on arbitrary bytes (seeded with micro models of several
//! architectures: MoE, DeltaNet, Mamba2 and short-convolution hybrids,
//! Nemotron-H's ungated experts and layers of one sub-layer, MLA, sinks and
//! windows, lattice i-quant experts):
//! loading one never panics, and a model the loader accepts evaluates two
//! tokens, then a pass of two sequences side by side, one verifying (every
//! position's logits; resident, one thread;
//! NaNs allowed) without a panic either. Every
//! shape the forward pass relies on is checked at load, and refused there
//! with an error.
#![no_main]

use les::compute::ThreadedMatVec;
use les::engine::{Session, SessionInputs};
use les::flash::FileDeviceConfig;
use les::model::Model;
use les::supply::{Schedule, SlotBudget, Supply};
use les_core::gemv::Isa;
use les_core::model::forward::TokenInput;
use libfuzzer_sys::fuzz_target;

#[path = "input_file.rs"]
mod input_file;

/// Most multiply-adds a token may cost: larger models are loaded but not
/// run, so that each input stays fast.
const MAX_WORK: usize = 1 << 24;

fuzz_target!(|data: &[u8]| {
    let Some(path) = input_file::gguf("model", data) else {
        return;
    };
    let Ok(model) = Model::open(path) else {
        return;
    };
    let hp = &model.hp;
    let moe = hp.moe.map_or(0, |m| m.n_experts * m.n_ff_exp);
    let work = hp.n_layers * hp.n_embd * (4 * hp.q_dim() + hp.n_ff + moe) + hp.n_vocab * hp.n_embd;
    if work > MAX_WORK {
        return;
    }
    let Ok(mut session) = Session::new(&model, 3) else {
        return;
    };
    let Ok(mut other) = Session::new(&model, 3) else {
        return;
    };
    if session.set_prefill_batch(3).is_err() || other.set_prefill_batch(3).is_err() {
        return;
    }
    let budget = SlotBudget::none(FileDeviceConfig::default());
    let Ok(mut supply) = Supply::new(&model, path, Schedule::Resident, budget) else {
        return;
    };
    let mut mv = ThreadedMatVec::new(1, Isa::detect());
    let mut logits = vec![0f32; hp.n_vocab];
    for token in [0, hp.n_vocab as u32 - 1] {
        let input = TokenInput::Token(token);
        if session
            .eval(&mut mv, &mut supply, None, input, &mut logits)
            .is_err()
        {
            return;
        }
    }
    // The next token of the first beside the second's two, in one pass,
    // the second verifying (every position's logits).
    let (one, two) = (TokenInput::Token(1), TokenInput::Token(0));
    let parts = [
        SessionInputs {
            inputs: &[one],
            places: &[],
            every: false,
        },
        SessionInputs {
            inputs: &[two, one],
            places: &[],
            every: true,
        },
    ];
    let mut rows = vec![0f32; 3 * hp.n_vocab];
    let _ = Session::eval_together_placed(
        &mut [&mut session, &mut other],
        &mut mv,
        &mut supply,
        &parts,
        &mut rows,
    );
});
