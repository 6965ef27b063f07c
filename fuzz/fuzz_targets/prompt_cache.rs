//! Prompt caches (`les run --prompt-cache`) on arbitrary bytes, restored into a
//! session of a tiny qwen35moe model, or of a tiny gpt-oss model whose
//! sliding-window layers are kept in rings: reading one never panics; with a
//! header of the model (the first byte chooses, and whether the file says
//! its windowed layers hold their last window only), a file of any token
//! count and state bytes is restored only where its tokens all start the
//! prompt (qwen35moe's recurrent state) or what it holds reaches back far
//! enough (gpt-oss), the session is then at the restored position, and
//! evaluating a token after whatever state it held (NaNs included) never
//! panics.
#![no_main]

use std::sync::OnceLock;

use les::compute::ThreadedMatVec;
use les::engine::{KvTypes, Session};
use les::flash::FileDeviceConfig;
use les::model::Model;
use les::prompt_cache::{fingerprint, restore_from, MAGIC, VERSION};
use les::supply::{Schedule, SlotBudget, Supply};
use les::synth::{write_model, Arch, Overrides, Preset, SynthConfig, WriteOptions};
use les_core::gemv::Isa;
use les_core::model::forward::TokenInput;
use libfuzzer_sys::fuzz_target;

fn tiny(arch: Arch) -> Model {
    let path = std::env::temp_dir().join(format!(
        "les-fuzz-pcache-{arch:?}-{}.gguf",
        std::process::id()
    ));
    let cfg = SynthConfig::new(arch, Preset::Tiny, &Overrides::default(), 1).unwrap();
    write_model(&cfg, &path, &WriteOptions::default()).unwrap();
    let model = Model::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    model
}

/// The tiny qwen35moe and gpt-oss models.
fn models() -> &'static [Model; 2] {
    static MODELS: OnceLock<[Model; 2]> = OnceLock::new();
    MODELS.get_or_init(|| [tiny(Arch::Qwen35moe), tiny(Arch::GptOss)])
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, data)) = data.split_first() else {
        return;
    };
    let oss = mode & 2 != 0;
    let model = &models()[usize::from(oss)];
    // gpt-oss's windowed layers (16 positions) in rings of 16.
    let mut session = Session::new(model, if oss { 48 } else { 16 }).unwrap();
    assert_eq!(session.saves_windows(), oss);
    let prompt: Vec<u32> = data.iter().take(30).map(|&b| u32::from(b) % 300).collect();
    let file: Vec<u8> = if mode % 2 == 0 {
        data.to_vec()
    } else {
        // A header of this model, then a token count that fits the rest
        // (tokens, then state bytes from the input, repeated).
        let n = usize::from(mode / 8) % 32;
        let windows = mode & 4 != 0;
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&VERSION.to_le_bytes());
        f.extend_from_slice(&fingerprint(model).to_le_bytes());
        f.extend_from_slice(&[1, 1, u8::from(windows), 0]);
        f.extend_from_slice(&(n as u32).to_le_bytes());
        for i in 0..n {
            let t = prompt
                .get(i)
                .copied()
                .unwrap_or(u32::from(data.get(i).copied().unwrap_or(0)));
            f.extend_from_slice(&t.to_le_bytes());
        }
        let state = session.state_bytes(n, windows) as usize;
        f.extend((0..state).map(|i| data.get(i % data.len().max(1)).copied().unwrap_or(0)));
        f
    };
    let cursor = std::io::Cursor::new(&file);
    let types = KvTypes::default();
    let Ok(Ok(restored)) = restore_from(
        cursor,
        file.len() as u64,
        "fuzz",
        model,
        &mut session,
        types,
        &prompt,
    ) else {
        return;
    };
    assert_eq!(session.position(), restored.positions);
    assert!(restored.positions <= prompt.len() && restored.positions <= restored.cached);
    if !oss {
        assert_eq!(restored.positions, restored.cached);
    }
    if session.position() < session.max_positions() {
        let mut supply = Supply::new(
            model,
            std::path::Path::new("unused"),
            Schedule::Resident,
            SlotBudget::none(FileDeviceConfig::default()),
        )
        .unwrap();
        let mut mv = ThreadedMatVec::new(1, Isa::detect());
        let mut logits = vec![0f32; model.hp.n_vocab];
        session
            .eval(
                &mut mv,
                &mut supply,
                None,
                TokenInput::Token(1),
                &mut logits,
            )
            .unwrap();
    }
});
