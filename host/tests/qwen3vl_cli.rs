//! `les` on synthetic qwen3vlmoe and qwen3vl models (Qwen3-VL's language
//! models, text only: Qwen3's layers rotated by IMRoPE sections): the file
//! carries llama.cpp's keys and tensors, the loader reads them as llama.cpp
//! does, a packed copy streams with the resident logits, and, with
//! llama-cpp-python at hand, les's tokens and log-probabilities are
//! llama.cpp's.

mod cli;

use std::path::{Path, PathBuf};

use cli::{
    assert_close_to_llama_cpp, assert_equals_llama_cpp, json_ok, les, stdout_ok, streams_exactly,
    tiny, tmp, tokens, F32_WEIGHTS,
};
use les::compute::ThreadedMatVec;
use les::draft::{Drafter, Speculation};
use les::engine::{generate_from, prefill_observed, Control, InputPlace, Session};
use les::flash::FileDeviceConfig;
use les::gguf::Gguf;
use les::model::Model;
use les::supply::{Schedule, SlotBudget, Supply};
use les::vision::prompt::{ChunkGrid, MultimodalPrompt, PromptItem};
use les_core::gemv::Isa;
use les_core::model::forward::{Mixer, Weights};
use les_core::model::forward::{Place, TokenInput};
use les_core::router::Gating;

fn model(arch: &str, name: &str, extra: &[&str]) -> PathBuf {
    tiny(arch, name, extra)
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    for arch in ["qwen3vlmoe", "qwen3vl"] {
        let m = model(arch, "q", &[]);
        let g = Gguf::open(&m).unwrap();
        assert_eq!(g.get_str("general.architecture").unwrap(), arch);
        let sections: Vec<u64> = g
            .get_array(&format!("{arch}.rope.dimension_sections"))
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        // A head of 16: 8 pairs, as Qwen3-VL's 24 / 20 / 20 of 64.
        assert_eq!(sections, [3, 2, 3, 0]);
        assert_eq!(g.get_u32(&format!("{arch}.n_deepstack_layers")).unwrap(), 3);
        assert!(g.tensor("blk.0.attn_q_norm.weight").is_some());
        assert_eq!(
            g.tensor("blk.0.ffn_gate_inp.weight").is_some(),
            arch == "qwen3vlmoe"
        );
        drop(g);
        let model = Model::open(&m).unwrap();
        assert_eq!(
            model
                .hybrid
                .rope_sections
                .map(|m| (m.sections, m.interleaved)),
            Some(([3, 2, 3, 0], true)),
            "{arch}"
        );
        let Mixer::Attention(a) = model.block(0).mixer else {
            panic!("attention")
        };
        assert!(a.q_norm.is_some() && a.k_norm.is_some());
        match model.hp.moe {
            Some(moe) => {
                assert_eq!(arch, "qwen3vlmoe");
                assert_eq!((moe.gating, moe.normalize), (Gating::Softmax, true));
            }
            None => assert_eq!(arch, "qwen3vl"),
        }
        let err = les::mcu::write_index(&model).unwrap_err().to_string();
        assert!(err.contains("M-RoPE"), "{err}");
    }
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&model("qwen3vlmoe", "q", &[]), "qwen3vlmoe_q");
    assert_eq!(want_tokens.len(), 24);
}

/// Against llama.cpp through llama-cpp-python: with f32 weights the same
/// prompt and greedy tokens and log-probabilities within rounding (largest
/// divergence measured 5.9e-6 for qwen3vlmoe, 4.9e-6 for qwen3vl); with the
/// preset's quantized weights, close log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    for arch in ["qwen3vlmoe", "qwen3vl"] {
        let tag = format!("{arch}_f32");
        assert_equals_llama_cpp(&model(arch, "f32", &F32_WEIGHTS), &tag, 1e-4, 1.0);
        assert_close_to_llama_cpp(&model(arch, "q", &[]), &format!("{arch}_q"));
    }
}

/// The session places a prompt's inputs as llama.cpp's `mtmd` does for an
/// M-RoPE model: tokens at `[t, t, t, 0]`, a grid's embeddings at the
/// temporal position before them with their row and column added, text
/// after a grid from `t0 + max(nx, ny)`, embeddings in sequence at
/// `[t; 4]`; the same places (and logits, bit for bit) whatever the prefill
/// batch, and after going back into an image.
#[test]
fn session_places_image_grids_as_mtmd_does() {
    let path = model("qwen3vlmoe", "places", &[]);
    let m = Model::open(&path).unwrap();
    let (e, nds) = (m.hp.n_embd, m.hybrid.n_deepstack);
    assert_eq!(nds, 3);
    let width = e * (1 + nds);
    // Tokens, a 3 x 2 grid, a token, a 2 x 3 grid right after a 1 x 1
    // grid, two embeddings in sequence, two tokens.
    let mut p = MultimodalPrompt::from_tokens(vec![1, 2], width);
    let grid = |p: &mut MultimodalPrompt, nx: usize, ny: usize| {
        let first = p.embeddings.len() / width;
        p.grids.push(ChunkGrid { first, nx, ny });
        for r in 0..nx * ny {
            p.embeddings
                .extend((0..width).map(|i| ((first + r) * 7 + i) as f32 % 13.0 * 0.01 - 0.06));
            p.items.push(PromptItem::Embedding(first + r));
        }
    };
    grid(&mut p, 3, 2);
    p.items.push(PromptItem::Token(3));
    grid(&mut p, 1, 1);
    grid(&mut p, 2, 3);
    for _ in 0..2 {
        let r = p.embeddings.len() / width;
        p.embeddings.extend(std::iter::repeat_n(0.02, width));
        p.items.push(PromptItem::Embedding(r));
    }
    p.items.extend([PromptItem::Token(4), PromptItem::Token(5)]);
    let (inputs, places) = (p.inputs(), p.places());
    // The places by hand: index and [t, h, w, e].
    let mut want: Vec<[u32; 4]> = vec![[0, 0, 0, 0], [1, 1, 1, 0]];
    want.extend((0..6).map(|k| [2, 2 + k / 3, 2 + k % 3, 0]));
    want.push([5, 5, 5, 0]); // 2 + max(3, 2)
    want.push([6, 6, 6, 0]); // the 1 x 1 grid
    want.extend((0..6).map(|k| [7, 7 + k / 2, 7 + k % 2, 0]));
    want.extend([[10; 4], [11; 4]]); // 7 + max(2, 3), then in sequence
    want.extend([[12, 12, 12, 0], [13, 13, 13, 0]]);
    assert_eq!(want.len(), inputs.len());

    let supply = || resident(&m, &path);
    let run = |batch: usize, rewind_to: Option<usize>| {
        let mut s = Session::new(&m, 64).unwrap();
        s.set_prefill_batch(batch).unwrap();
        let mut mv = ThreadedMatVec::new(1, Isa::detect());
        let mut sup = supply();
        let mut logits = vec![0f32; m.hp.n_vocab];
        let mut seen = Vec::new();
        if batch == 1 {
            for (i, (input, place)) in inputs.iter().zip(&places).enumerate() {
                let at = s.next_place(*place).unwrap();
                assert_eq!((at.index, at.rope), (i, want[i]), "input {i}");
                s.eval_placed(&mut mv, &mut sup, None, *input, *place, &mut logits)
                    .unwrap();
                seen.push(logits.clone());
            }
        } else {
            prefill_observed(
                &mut s,
                &mut mv,
                &mut sup,
                None,
                &inputs,
                &places,
                &mut logits,
                None,
            )
            .unwrap();
            seen.push(logits.clone());
        }
        if let Some(back) = rewind_to {
            // Back into the first grid, then its rest and everything after again.
            s.rewind(back).unwrap();
            let at = s.next_place(places[back]).unwrap();
            assert_eq!(at.rope, want[back]);
            prefill_observed(
                &mut s,
                &mut mv,
                &mut sup,
                None,
                &inputs[back..],
                &places[back..],
                &mut logits,
                None,
            )
            .unwrap();
            seen.push(logits.clone());
        }
        // Generated text goes on from the last place.
        assert_eq!(
            s.next_place(InputPlace::Text).unwrap().rope,
            [14, 14, 14, 0]
        );
        s.eval(&mut mv, &mut sup, None, TokenInput::Token(6), &mut logits)
            .unwrap();
        seen.push(logits);
        seen
    };
    let one = run(1, None);
    let last = one[inputs.len() - 1].clone();
    for batch in [4, 64] {
        let got = run(batch, Some(4));
        assert!(got[0] == last && got[1] == last, "batch {batch}");
        assert!(
            got[2] == one[inputs.len()],
            "batch {batch}: the token after"
        );
    }
    // An image place outside its grid is refused.
    let s = Session::new(&m, 64).unwrap();
    let bad = InputPlace::Image { k: 6, nx: 3, ny: 2 };
    assert!(s.next_place(bad).is_err());
}

/// A qwen3vlmoe model and its Qwen3-VL projector from one `les synth`.
fn vl_models(tag: &str, extra: &[&str]) -> (PathBuf, PathBuf) {
    models_of("qwen3vlmoe", tag, extra)
}

/// A model of `arch` and a Qwen3-VL projector for it from one `les synth`.
fn models_of(arch: &str, tag: &str, extra: &[&str]) -> (PathBuf, PathBuf) {
    cli::synth_with_projector(arch, "qwen3vl_merger", &format!("{arch}_{tag}"), extra)
}

/// `les run --image` on Qwen3-VL: the image between `<|vision_start|>` and
/// `<|vision_end|>` as one grid of merged patches, and the same tokens and
/// logits, bit for bit, on every schedule, prefill batch and thread count.
#[test]
fn image_prompt_streams_exactly_on_every_schedule() {
    let (lm, mm) = vl_models("e2e", &[]);
    let img = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/test-image.png");
    let run =
        |tag: &str, extra: &[&str]| cli::run_with_image(&lm, &mm, &format!("e2e_{tag}"), extra);
    let (want, want_logits) = run("resident", &["--schedule", "resident"]);
    assert!(!tokens(&want).is_empty());
    // 320 x 240 -> 320 x 256 (a multiple of 32 within the pixel budget):
    // 10 x 8 merged patches.
    assert_eq!(want["stats"]["image_tokens"], 80);
    let prompt = want["prompt_tokens"].as_array().unwrap();
    let first = prompt.iter().position(|t| t.is_null()).unwrap();
    assert!(prompt[first..first + 80].iter().all(|t| t.is_null()));
    let id = |text: &str| {
        let g = Gguf::open(&lm).unwrap();
        let tokens = g.get_array("tokenizer.ggml.tokens").unwrap();
        tokens
            .iter()
            .position(|t| t.as_str() == Some(text))
            .unwrap() as u64
    };
    assert_eq!(prompt[first - 1], id("<|vision_start|>"));
    assert_eq!(prompt[first + 80], id("<|vision_end|>"));
    cli::assert_image_runs_agree(&run, &want, &want_logits, "qwen3vl");
    // A projector whose deepstack features do not fit the model is refused.
    let (_, other) = vl_models("ds0", &["--layers", "2"]);
    let out = les()
        .args(["run", "-m"])
        .arg(&lm)
        .arg("--mmproj")
        .arg(&other)
        .args(["--image", img, "-p", "x", "-n", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("deepstack"), "{err}");
}

/// A Qwen3-VL decode against llama.cpp's own (`libmtmd`,
/// `scripts/mtmd_llama.py greedy`): an f32 qwen3vlmoe and an f16
/// `qwen3vl_merger` projector, three images. The same greedy tokens, and
/// logits within 5e-3: measured 3.1e-4 to 3.3e-3, where the embeddings'
/// last-bit differences (the attention's and products' orders, ggml's
/// f16-table GELU) round some activations to the other f16 neighbour (with
/// the projector's weights in f32, 3.5-6.5e-4 for the same images; the
/// attention's scores in `scaled_dots`' order gave 5.7-9.4e-4 with f16).
/// Placing the image tokens as text instead moves them by 0.25 to 3.7.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn image_decode_equals_llama_cpps() {
    image_decode_of("qwen3vlmoe");
}

/// [`image_decode_equals_llama_cpps`] for Qwen3.5 (qwen35moe, whose Hugging
/// Face checkpoints llama.cpp converts to a `qwen3vl_merger` projector
/// without deepstack mergers): the same tokens, logits within 5e-3
/// (measured 4.1e-4 to 1.9e-3 with the f16 projector).
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn qwen35moe_image_decode_equals_llama_cpps() {
    image_decode_of("qwen35moe");
}

fn image_decode_of(arch: &str) {
    let (lm, mm) = models_of(arch, "mtmd", &F32_WEIGHTS);
    let prompt = "What is in <__media__>? It is";
    for img in cli::decode_images(arch) {
        let worst = cli::image_decode_difference(&lm, &mm, &img, prompt, 12, arch);
        assert!(worst < 5e-3, "{}: {worst}", img.display());
    }
}

/// `--image-min-tokens` / `--image-max-tokens` bound the merged tokens of a
/// Qwen3-VL image (the layout, the encoder and the prompt agree), are
/// refused out of range, and leave MiniCPM-V's fixed-size slices alone, as
/// in llama.cpp.
#[test]
fn image_token_bounds_size_qwen3vl_images() {
    let (lm, mm) = vl_models("bounds", &[]);
    let img = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/test-image.png");
    let run = |lm: &Path, mm: &Path, extra: &[&str]| {
        les()
            .args(["run", "-m"])
            .arg(lm)
            .arg("--mmproj")
            .arg(mm)
            .args(["--image", img, "-p", "x", "-n", "1", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    let tokens_of = |extra: &[&str]| {
        let v = json_ok(run(&lm, &mm, extra), "les run");
        let n = v["stats"]["image_tokens"].as_u64().unwrap();
        let nulls = v["prompt_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t.is_null())
            .count() as u64;
        assert_eq!(n, nulls, "{extra:?}");
        n
    };
    // 320 x 240: 10 x 8 merged patches by default.
    assert_eq!(tokens_of(&[]), 80);
    // At most 16: scaled down by sqrt(320 * 240 / (16 * 32^2)) = 2.165 and
    // rounded down to 128 x 96 (4 x 3).
    assert_eq!(tokens_of(&["--image-max-tokens", "16"]), 12);
    // At least 200: scaled up by sqrt(200 * 32^2 / (320 * 240)) = 1.633 and
    // rounded up to 544 x 416 (17 x 13).
    assert_eq!(tokens_of(&["--image-min-tokens", "200"]), 221);
    for (args, says) in [
        (&["--image-max-tokens", "0"][..], "--image-max-tokens 0"),
        (&["--image-min-tokens", "20000"][..], "1 to 16384"),
        (
            &["--image-min-tokens", "300", "--image-max-tokens", "200"][..],
            "more than --image-max-tokens 200",
        ),
    ] {
        let out = run(&lm, &mm, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
    // MiniCPM-V cuts fixed-size slices: the bounds change nothing.
    let (mlm, mmm) = (
        tmp("bounds_minicpm.gguf"),
        tmp("bounds_minicpm_mmproj.gguf"),
    );
    let out = les()
        .args([
            "synth", "--arch", "qwen3moe", "--preset", "tiny", "--quiet", "-o",
        ])
        .arg(&mlm)
        .arg("--mmproj-out")
        .arg(&mmm)
        .output()
        .unwrap();
    stdout_ok(out, "les synth");
    let n = |extra: &[&str]| {
        json_ok(run(&mlm, &mmm, extra), "les run")["stats"]["image_tokens"].clone()
    };
    assert_eq!(n(&["--image-max-tokens", "4"]), n(&[]));
}

/// The bounds as llama.cpp applies them (`mtmd_context_params`'
/// `image_min_tokens` / `image_max_tokens`): the same merged grid for
/// images of many shapes.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn image_token_bounds_equal_llama_cpps() {
    use les::vision::ClipModel;
    let (lm, mm) = vl_models("bounds_mtmd", &[]);
    let sizes = [(320, 240), (97, 411), (2000, 1500), (40, 30), (6000, 100)];
    for (min, max) in [(Some(1024), None), (None, Some(64)), (Some(100), Some(300))] {
        let mut clip = ClipModel::open(&mm).unwrap();
        clip.set_image_tokens(min, max).unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/mtmd_llama.py");
        let mut cmd = std::process::Command::new("python3");
        cmd.arg(script).arg("grid").arg(&lm).arg(&mm);
        cmd.args(sizes.iter().map(|(w, h)| format!("{w}x{h}")));
        if let Some(v) = min {
            cmd.env("MTMD_IMAGE_MIN_TOKENS", v.to_string());
        }
        if let Some(v) = max {
            cmd.env("MTMD_IMAGE_MAX_TOKENS", v.to_string());
        }
        let grids: serde_json::Value =
            serde_json::from_str(&stdout_ok(cmd.output().unwrap(), "mtmd_llama.py grid")).unwrap();
        for (g, &(w, h)) in grids.as_array().unwrap().iter().zip(&sizes) {
            let want = (
                g["nx"].as_u64().unwrap() as usize,
                g["ny"].as_u64().unwrap() as usize,
            );
            assert_eq!(
                les::vision::merged_grid(&clip, w, h),
                want,
                "{w}x{h}, min {min:?}, max {max:?}"
            );
        }
    }
}

/// A drafter that guesses its last token again and records where each
/// observed position sat.
struct PlaceRecorder {
    seen: Vec<Place>,
}

impl Drafter for PlaceRecorder {
    fn draft(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        if let Some(&t) = history.last().filter(|_| max > 0) {
            out.extend(std::iter::repeat_n(t, max.min(2)));
        }
    }
    fn wants_hidden(&self) -> bool {
        true
    }
    fn observe(&mut self, places: &[Place], inputs: &[TokenInput<'_>], _: &[f32]) {
        assert_eq!(places.len(), inputs.len());
        self.seen.extend_from_slice(places);
    }
}

/// A drafter that follows the model's positions (`--speculate mtp`) sees
/// each kept position once, at the place the model evaluated it: the
/// image's grid places, then text going on from `t0 + max(nx, ny)`, through
/// prefill batches, verifying passes and their kept prefixes. With the
/// model's own MTP block drafting (qwen35moe with Qwen3-VL's projector), the
/// output is plain decoding's.
#[test]
fn drafters_see_the_places_the_model_used() {
    let path = model("qwen3vlmoe", "places", &[]);
    let m = Model::open(&path).unwrap();
    let width = m.n_embd_inp();
    let mut p = MultimodalPrompt::from_tokens(vec![1, 2], width);
    let first = p.embeddings.len() / width;
    p.grids.push(ChunkGrid {
        first,
        nx: 2,
        ny: 3,
    });
    for r in 0..6 {
        p.embeddings
            .extend((0..width).map(|i| ((r * 5 + i) % 11) as f32 * 0.01 - 0.05));
        p.items.push(PromptItem::Embedding(first + r));
    }
    p.items.extend([PromptItem::Token(3), PromptItem::Token(4)]);
    let (inputs, places) = (p.inputs(), p.places());
    let mut s = Session::new(&m, 64).unwrap();
    s.set_prefill_batch(3).unwrap();
    s.set_max_draft(2).unwrap();
    let mut mv = ThreadedMatVec::new(1, Isa::detect());
    let mut sup = resident(&m, &path);
    let mut rec = PlaceRecorder { seen: Vec::new() };
    let stats = generate_from(
        &mut s,
        &mut mv,
        &mut sup,
        None,
        &inputs,
        &places,
        Some(Speculation {
            drafter: &mut rec,
            max_draft: 2,
            adaptive: false,
            context: &[],
        }),
        8,
        |l| {
            l.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32
        },
        |_, _| Control::Continue,
    )
    .unwrap();
    assert!(stats.drafted > 0, "{stats:?}");
    // Two tokens, the 2 x 3 grid at t0 = 2, then text from 2 + 3 = 5 on.
    let mut want: Vec<[u32; 4]> = vec![[0, 0, 0, 0], [1, 1, 1, 0]];
    want.extend((0..6).map(|k| [2, 2 + k / 2, 2 + k % 2, 0]));
    let seen = &rec.seen;
    assert!(seen.len() > want.len() + 2, "{}", seen.len());
    for (i, at) in seen.iter().enumerate() {
        assert_eq!(at.index, i, "kept positions in order, once each");
        let rope = match want.get(i) {
            Some(&r) => r,
            None => {
                let t = (i - 8 + 5) as u32;
                [t, t, t, 0]
            }
        };
        assert_eq!(at.rope, rope, "position {i}");
    }
    // The model's own MTP block drafting after a Qwen3-VL image: plain
    // decoding's tokens and logits.
    let (lm, mm) = models_of("qwen35moe", "mtp", &[]);
    let run =
        |tag: &str, extra: &[&str]| cli::run_with_image(&lm, &mm, &format!("mtp_{tag}"), extra);
    let (want, want_logits) = run("plain", &[]);
    let (got, logits) = run(
        "mtp",
        &["--speculate", "mtp", "--draft-max", "3", "--draft-fixed"],
    );
    assert_eq!(tokens(&got), tokens(&want));
    assert!(logits == want_logits, "logits differ");
    assert!(
        got["stats"]["drafted"].as_u64().unwrap() > 0,
        "{}",
        got["stats"]
    );
}

/// `m`'s experts resident (mapped from `path`, its file).
fn resident<'m>(m: &'m Model, path: &Path) -> Supply<'m> {
    Supply::new(
        m,
        path,
        Schedule::Resident,
        SlotBudget::none(FileDeviceConfig::default()),
    )
    .unwrap()
}
