//! `les` on MoE vision-language models beyond Qwen's, each a synthetic
//! language model and projector from one `les synth`:
//!
//! - Kimi-VL: `deepseek2` (DeepSeek-V3's architecture: MLA, a shared
//!   expert, sigmoid routing) and `kimivl` (MoonViT): images of any size
//!   resized to a token budget, between `<|media_start|>` and `<|media_end|>`;
//!   Kimi K2.5's `kimik25` the same way, between `<|media_begin|>` and
//!   `<|media_end|>`;
//! - Llama 4: `llama4` and `llama4`: tiles of a grid plus an overview, between
//!   `<|image_start|>` and `<|image_end|>`;
//! - GLM-4.5V: `glm4moe` rotated by plain M-RoPE sections and `glm4v`: an
//!   image of any size as one grid of merged patches at its M-RoPE
//!   positions, between `<|begin_of_image|>` and `<|end_of_image|>`;
//! - InternVL3.5-30B-A3B: `qwen3moe` and `internvl`: tiles of a grid plus an
//!   overview, between `<img>` and `</img>`;
//! - LFM2-VL: `lfm2` (dense; `lfm2moe` here, so that experts stream) and
//!   `lfm2`: an image of any size within a token budget, a large one also
//!   as 512-pixel tiles each after `<|img_row_R_col_C|>`, then
//!   `<|img_thumbnail|>` and the overview, between `<|image_start|>` and
//!   `<|image_end|>`.
//!
//! Kimi's, Llama 4's, InternVL's and LFM2's language models place image
//! embeddings in sequence (no M-RoPE sections).
//!
//! The prompts are laid out as llama.cpp's `mtmd` lays them out; the experts
//! stream exactly; with llama-cpp-python at hand, les decodes as llama.cpp
//! does.

mod cli;
mod common;

use std::path::{Path, PathBuf};

use cli::{tmp, tokens, F32_WEIGHTS};
use les::gguf::{Gguf, MetaValue};
use les::synth::{write_mmproj, MmprojConfig};
use les::vision::ProjectorType;
use les_core::quant::GgmlType;

/// The language model's architecture of each projector here.
fn arch_of(projector: ProjectorType) -> &'static str {
    match projector {
        ProjectorType::KimiVl | ProjectorType::KimiK25 => "deepseek2",
        ProjectorType::Llama4 => "llama4",
        ProjectorType::Glm4v => "glm4moe",
        ProjectorType::InternVl => "qwen3moe",
        ProjectorType::Lfm2 => "lfm2moe",
        p => panic!("{p:?}"),
    }
}

/// A model and a `projector` for it from one `les synth`.
fn models(projector: ProjectorType, tag: &str, extra: &[&str]) -> (PathBuf, PathBuf) {
    let name = projector.name();
    cli::synth_with_projector(
        arch_of(projector),
        name,
        &format!("vlm_{name}_{tag}"),
        extra,
    )
}

/// The id of the token `text` in the model at `lm`.
fn token_id(lm: &Path, text: &str) -> u64 {
    let g = Gguf::open(lm).unwrap();
    let tokens = g.get_array("tokenizer.ggml.tokens").unwrap();
    tokens
        .iter()
        .position(|t| t.as_str() == Some(text))
        .unwrap_or_else(|| panic!("{text} is not in the vocabulary")) as u64
}

/// `les run --image` with `projector`'s image (`n` embeddings between
/// `begin` and `end`) gives the same tokens and logits, bit for bit, on
/// every schedule, slot count, prefill batch and thread count; returns one
/// more run's JSON, with `extra` arguments.
fn streams_exactly(
    projector: ProjectorType,
    (n, begin, end): (usize, &str, &str),
    extra: &[&str],
) -> serde_json::Value {
    let (lm, mm) = models(projector, "e2e", &[]);
    let name = projector.name();
    let run = |tag: &str, args: &[&str]| {
        cli::run_with_image(&lm, &mm, &format!("{name}_e2e_{tag}"), args)
    };
    let (want, want_logits) = run("resident", &["--schedule", "resident"]);
    assert!(!tokens(&want).is_empty());
    assert_eq!(want["stats"]["image_tokens"], n);
    let prompt = want["prompt_tokens"].as_array().unwrap();
    let first = prompt.iter().position(|t| t.is_null()).unwrap();
    assert!(prompt[first..first + n].iter().all(|t| t.is_null()));
    assert_eq!(prompt[first - 1], token_id(&lm, begin));
    assert_eq!(prompt[first + n], token_id(&lm, end));
    cli::assert_image_runs_agree(&run, &want, &want_logits, name);
    run("extra", extra).0
}

/// Kimi-VL: the image's merged patches between `<|media_start|>` and
/// `<|media_end|>`; `--image-max-tokens` shrinks the image to its budget.
#[test]
fn kimivl_image_prompt_streams_exactly_on_every_schedule() {
    // 320 x 240 -> 308 x 252 (the nearest multiples of 28, two 14-pixel
    // patches): 11 x 9 merged patches. At most 20 tokens (15 680 pixels):
    // 320 x 240 divided by sqrt(76 800 / 15 680) = 2.21 a side, rounded down
    // to 140 x 84, 5 x 3 merged patches.
    let markers = (99, "<|media_start|>", "<|media_end|>");
    let small = streams_exactly(
        ProjectorType::KimiVl,
        markers,
        &["--image-max-tokens", "20"],
    );
    assert_eq!(small["stats"]["image_tokens"], 15);
}

/// Kimi K2.5: as Kimi-VL, between `<|media_begin|>` and `<|media_end|>`;
/// its file's pixel budget (8 to 16384 patches, the converter's) leaves the
/// demo image as Kimi-VL's does, and `--image-max-tokens` leaves the budget,
/// as in llama.cpp.
#[test]
fn kimik25_image_prompt_streams_exactly_on_every_schedule() {
    let markers = (99, "<|media_begin|>", "<|media_end|>");
    let same = streams_exactly(
        ProjectorType::KimiK25,
        markers,
        &["--image-max-tokens", "20"],
    );
    assert_eq!(same["stats"]["image_tokens"], 99);
}

/// GLM-5.2-V reuses Kimi K2.5's projector with its own markers: a
/// vocabulary holding `<|begin_of_image|>` gets the image between it and
/// `<|end_of_image|>` (llama.cpp's choice), here a Kimi model's vocabulary
/// with two markers renamed.
#[test]
fn kimik25_takes_glm_markers_where_the_vocabulary_has_them() {
    let (lm, mm) = models(ProjectorType::KimiK25, "glm", &[]);
    let glm = tmp("vlm_kimik25_glm_markers.gguf");
    let rename = |t: String| match t.as_str() {
        "<|media_start|>" => "<|begin_of_image|>".to_string(),
        "<|media_begin|>" => "<|end_of_image|>".to_string(),
        _ => t,
    };
    let tokens: Vec<String> = Gguf::open(&lm)
        .unwrap()
        .get_array("tokenizer.ggml.tokens")
        .unwrap()
        .iter()
        .map(|t| rename(t.as_str().unwrap().to_string()))
        .collect();
    common::rewrite_gguf(
        &lm,
        &glm,
        |k, v| (k != "tokenizer.ggml.tokens").then_some(v),
        vec![("tokenizer.ggml.tokens", MetaValue::strings(tokens))],
    );
    let (run, _) = cli::run_with_image(&glm, &mm, "glm", &[]);
    let prompt = run["prompt_tokens"].as_array().unwrap();
    let first = prompt.iter().position(|t| t.is_null()).unwrap();
    assert_eq!(prompt[first - 1], token_id(&glm, "<|begin_of_image|>"));
    assert_eq!(prompt[first + 99], token_id(&glm, "<|end_of_image|>"));
}

/// Llama 4: a 320 x 240 image is 3 x 3 tiles of 112 pixels (the 336 x 336
/// candidate keeps all its pixels) plus the overview, 16 embeddings each,
/// between `<|image_start|>` and `<|image_end|>`; token budgets do not
/// apply to its fixed-size tiles.
#[test]
fn llama4_image_prompt_streams_exactly_on_every_schedule() {
    let markers = (160, "<|image_start|>", "<|image_end|>");
    let other = streams_exactly(
        ProjectorType::Llama4,
        markers,
        &["--image-max-tokens", "20"],
    );
    assert_eq!(other["stats"]["image_tokens"], 160);
}

/// GLM-4.5V: `les synth --projector glm4v` gives its glm4moe GLM-4.5V's
/// M-RoPE sections (a quarter of the rotated pairs by time, the rest
/// split between height and width, one section after the other), and the
/// image's merged patches (320 x 240 -> 308 x 252, 11 x 9) go between
/// `<|begin_of_image|>` and `<|end_of_image|>` at their grid positions:
/// the same tokens and logits, bit for bit, on every schedule; the token
/// budget shrinks the image.
#[test]
fn glm4v_image_prompt_streams_exactly_on_every_schedule() {
    let (lm, _) = models(ProjectorType::Glm4v, "sections", &[]);
    let model = les::model::Model::open(&lm).unwrap();
    let m = model.hybrid.rope_sections.expect("M-RoPE sections");
    assert_eq!((m.sections, m.interleaved), ([1, 1, 2, 0], false));
    assert_eq!(model.hp.n_rot, 8);
    let markers = (99, "<|begin_of_image|>", "<|end_of_image|>");
    let small = streams_exactly(ProjectorType::Glm4v, markers, &["--image-max-tokens", "20"]);
    assert_eq!(small["stats"]["image_tokens"], 15);
}

/// InternVL (InternVL3.5-30B-A3B's pair: `qwen3moe` and `internvl`): a
/// 320 x 240 image is 3 x 2 tiles of 112 pixels (of the candidates up to
/// the file's 6 tiles, the one that keeps the most pixels) plus the
/// overview, 16 embeddings each, between `<img>` and `</img>`; token
/// budgets do not apply to its fixed-size tiles.
#[test]
fn internvl_image_prompt_streams_exactly_on_every_schedule() {
    let markers = (112, "<img>", "</img>");
    let other = streams_exactly(
        ProjectorType::InternVl,
        markers,
        &["--image-max-tokens", "20"],
    );
    assert_eq!(other["stats"]["image_tokens"], 112);
}

/// LFM2-VL's projector before an `lfm2moe`: the 320 x 240 demo image
/// becomes 320 x 256 (each side the nearest multiple of a 32-pixel merged
/// patch, within 64 to 256 tokens), 10 x 8 embeddings, untiled between
/// `<|image_start|>` and `<|image_end|>`. `--image-max-tokens 64` (the
/// default fewest) shrinks it: 320 x 240 divided by sqrt(76 800 / 65 536)
/// a side and rounded down to 288 x 192, 9 x 6 embeddings.
#[test]
fn lfm2_image_prompt_streams_exactly_on_every_schedule() {
    let markers = (80, "<|image_start|>", "<|image_end|>");
    let small = streams_exactly(ProjectorType::Lfm2, markers, &["--image-max-tokens", "64"]);
    assert_eq!(small["stats"]["image_tokens"], 54);
}

/// A large image through LFM2-VL's projector is laid out as llama.cpp's
/// `mtmd` lays it out: 1024 x 768 is over twice 512 x 512 pixels, so it is
/// cut into the 3 x 2 grid of 512-pixel tiles (256 embeddings each, after
/// their `<|img_row_R_col_C|>`), then `<|img_thumbnail|>` and the overview
/// (576 x 416 within 256 tokens: 18 x 13), and the same on an expert
/// schedule.
#[test]
fn lfm2_large_image_is_tiled_then_thumbnailed() {
    let (lm, mm) = models(ProjectorType::Lfm2, "tiles", &[]);
    let img = tmp("vlm_lfm2_1024x768.png");
    image::RgbImage::from_fn(1024, 768, |x, y| {
        image::Rgb([(x % 256) as u8, (y % 256) as u8, ((x + y) % 256) as u8])
    })
    .save(&img)
    .unwrap();
    let run = |args: &[&str]| {
        let out = cli::les()
            .args(["run", "-m"])
            .arg(&lm)
            .arg("--mmproj")
            .arg(&mm)
            .arg("--image")
            .arg(&img)
            .args(["-p", "See <__media__>.", "-n", "4", "--temp", "0", "--json"])
            .args(args)
            .output()
            .unwrap();
        cli::json_ok(out, "les run")
    };
    let want = run(&["--schedule", "resident"]);
    assert_eq!(want["stats"]["image_tokens"], 6 * 256 + 18 * 13);
    let prompt = want["prompt_tokens"].as_array().unwrap();
    let mut at = prompt.iter().position(|t| t.is_null()).unwrap() - 1;
    assert_eq!(prompt[at - 1], token_id(&lm, "<|image_start|>"));
    let mut expect_run = |marker: &str, n: usize| {
        assert_eq!(prompt[at], token_id(&lm, marker), "{marker}");
        assert!(prompt[at + 1..at + 1 + n].iter().all(|t| t.is_null()));
        at += 1 + n;
    };
    for row in 1..=2 {
        for col in 1..=3 {
            expect_run(&format!("<|img_row_{row}_col_{col}|>"), 256);
        }
    }
    expect_run("<|img_thumbnail|>", 18 * 13);
    assert_eq!(prompt[at], token_id(&lm, "<|image_end|>"));
    let streamed = run(&["--schedule", "les", "--slots", "3"]);
    assert_eq!(tokens(&streamed), tokens(&want));
}

/// LFM2-VL decodes against llama.cpp's own (`libmtmd`): f32 language
/// models (the dense `lfm2` of LFM2-VL, and `lfm2moe`) and the f16 `lfm2`
/// projector `les synth` writes, three images: the same greedy tokens,
/// logits within 2e-3 (measured 2026-12-06: 2.2e-4 to 3.3e-4 dense,
/// 2.0e-4 to 3.3e-4 MoE).
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn lfm2_image_decode_equals_llama_cpps() {
    let prompt = "What is in <__media__>? It is";
    for arch in ["lfm2", "lfm2moe"] {
        let (lm, mm) =
            cli::synth_with_projector(arch, "lfm2", &format!("vlm_lfm2_{arch}_mtmd"), &F32_WEIGHTS);
        for img in cli::decode_images("lfm2") {
            let tag = format!("lfm2_{arch}");
            let worst = cli::image_decode_difference(&lm, &mm, &img, prompt, 12, &tag);
            assert!(worst < 2e-3, "{arch} {}: {worst}", img.display());
        }
    }
}

/// An InternVL decode against llama.cpp's own (`libmtmd`): an f32 qwen3moe
/// and the f16 `internvl` projector `les synth` writes, three images: the
/// same greedy tokens, logits within 2e-3 (measured 3.3e-4 to 5.5e-4).
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn internvl_image_decode_equals_llama_cpps() {
    let (lm, mm) = models(ProjectorType::InternVl, "mtmd", &F32_WEIGHTS);
    let prompt = "What is in <__media__>? It is";
    for img in cli::decode_images("internvl") {
        let worst = cli::image_decode_difference(&lm, &mm, &img, prompt, 12, "internvl");
        assert!(worst < 2e-3, "{}: {worst}", img.display());
    }
}

/// A GLM-4.5V decode against llama.cpp's own (`libmtmd`): an f32 glm4moe
/// with M-RoPE sections and the f16 `glm4v` projector `les synth` writes,
/// three images: the same greedy tokens, logits within 2e-3 (measured
/// 6.5e-4, 7.1e-4 and 1.4e-3; the JPEG's decode ends at `<|endoftext|>`
/// after one token in both).
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn glm4v_image_decode_equals_llama_cpps() {
    let (lm, mm) = models(ProjectorType::Glm4v, "mtmd", &F32_WEIGHTS);
    let prompt = "What is in <__media__>? It is";
    for img in cli::decode_images("glm4v") {
        let worst = cli::image_decode_difference(&lm, &mm, &img, prompt, 12, "glm4v");
        assert!(worst < 2e-3, "{}: {worst}", img.display());
    }
}

/// A Kimi-VL decode against llama.cpp's own (`libmtmd`,
/// `scripts/mtmd_llama.py greedy`) on three images, through an f32 deepseek2
/// with the f16 `kimivl` projector `les synth` writes and with its weights in
/// f32: the same greedy tokens. The logits are printed, not bounded: the
/// tiny deepseek2 routes each token to 2 of 8 experts in groups, and now and
/// then two candidates score within rounding of each other, so either
/// side's last-bit differences tip a choice. Between such events the logits
/// agree within 2-9e-4 (also with the f16 projector); a tipped choice moves
/// one step by 0.5-1.5 and the steps after it by 1e-2 (its keys and values
/// differ), or, at an image token during prefill, every step by 2e-3 to
/// 1.8e-2. Measured (2026-12-05): with the f32 projector, one decode step
/// tipped on the demo image (0.99) while the other two images agreed
/// within 4e-4; llama.cpp's own f16 and f32 runs differ at such a step by
/// as much, where les's do not, and the other way round. The embeddings are
/// bounded value by value in `vision_encoder::kimivl_embeddings_equal_llama_cpps`.
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn kimivl_image_decode_equals_llama_cpps() {
    kimi_decodes_equal_llama_cpps(ProjectorType::KimiVl);
}

/// [`kimivl_image_decode_equals_llama_cpps`] for Kimi K2.5 (`kimik25`): the
/// same tokens with both projectors (measured: logits within 3.5-8.1e-4,
/// but for a prefill choice tipped in les's f16 run on the 640 x 400 image,
/// 4e-3 to 1.8e-2 and 1.51 at one step, with its embeddings within 4.9e-4 of
/// the largest value of llama.cpp's).
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn kimik25_image_decode_equals_llama_cpps() {
    kimi_decodes_equal_llama_cpps(ProjectorType::KimiK25);
}

/// An f32 deepseek2 with `projector` in f16 (`les synth`'s) and in f32:
/// libmtmd's greedy tokens with both (asserted by
/// [`cli::image_decode_difference`]; the logits' differences printed).
fn kimi_decodes_equal_llama_cpps(projector: ProjectorType) {
    let (lm, mm_f16) = models(projector, "mtmd", &F32_WEIGHTS);
    let n_embd = Gguf::open(&lm)
        .unwrap()
        .get_u64("deepseek2.embedding_length")
        .unwrap();
    let name = projector.name();
    let mm_f32 = tmp(&format!("{name}_mtmd_mmproj_f32.gguf"));
    let mut cfg = MmprojConfig::tiny(projector, n_embd, 5);
    cfg.ty = GgmlType::F32;
    write_mmproj(&cfg, &mm_f32).unwrap();
    let prompt = "What is in <__media__>? It is";
    for img in cli::decode_images(name) {
        for (mm, ty) in [(&mm_f16, "f16"), (&mm_f32, "f32")] {
            let tag = format!("{name} {ty}");
            cli::image_decode_difference(&lm, mm, &img, prompt, 12, &tag);
        }
    }
}

/// A Llama 4 decode against llama.cpp's own (`libmtmd`): an f32 llama4 and
/// the f16 `llama4` projector `les synth` writes, three images (the demo
/// image in 3 x 3 tiles, the 640 x 400 one in 3 x 3, the JPEG in 3 x 2):
/// the same greedy tokens, logits within 2e-3 (measured 3.6e-4 to 7.1e-4).
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn llama4_image_decode_equals_llama_cpps() {
    let (lm, mm) = models(ProjectorType::Llama4, "mtmd", &F32_WEIGHTS);
    let prompt = "What is in <__media__>? It is";
    for img in cli::decode_images("llama4") {
        let worst = cli::image_decode_difference(&lm, &mm, &img, prompt, 12, "llama4");
        assert!(worst < 2e-3, "{}: {worst}", img.display());
    }
}
