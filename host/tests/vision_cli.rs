//! `les run --mmproj --image` end to end on synthetic models: every schedule
//! gives the same tokens and bit-identical logits, images are spliced where the
//! markers say, and bad inputs fail cleanly.

mod cli;
mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

use cli::{les, stdout_ok, tmp, tokens};
use common::rewrite_gguf;
use les::gguf::MetaValue;
use serde_json::Value;

fn image() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/test-image.png")
}

fn ok(o: Output) -> String {
    stdout_ok(o, "les")
}

/// A tiny qwen3moe model and a matching projector of `projector`, made once.
fn models(projector: &str) -> (PathBuf, PathBuf) {
    static MADE: OnceLock<std::sync::Mutex<Vec<String>>> = OnceLock::new();
    let lm = tmp(&format!("vision_lm_{projector}.gguf"));
    let mm = tmp(&format!("vision_mmproj_{projector}.gguf"));
    let mut made = MADE.get_or_init(Default::default).lock().unwrap();
    if !made.iter().any(|p| p == projector) {
        let out = les()
            .args([
                "synth", "--arch", "qwen3moe", "--seed", "5", "--quiet", "-o",
            ])
            .arg(&lm)
            .arg("--mmproj-out")
            .arg(&mm)
            .args(["--projector", projector])
            .output()
            .unwrap();
        let text = ok(out);
        assert!(text.contains(projector), "{text}");
        made.push(projector.to_string());
    }
    (lm, mm)
}

fn run(lm: &Path, mm: &Path, extra: &[&str]) -> Output {
    les()
        .args(["run", "-m"])
        .arg(lm)
        .arg("--mmproj")
        .arg(mm)
        .args(extra)
        .output()
        .unwrap()
}

fn json(lm: &Path, mm: &Path, extra: &[&str]) -> Value {
    let out = ok(run(lm, mm, &[&["--json", "--temp", "0"], extra].concat()));
    serde_json::from_str(&out).unwrap()
}

#[test]
fn image_prompt_gives_identical_tokens_and_logits_on_every_schedule() {
    let (lm, mm) = models("minicpmv4_6");
    let img = image();
    let img = img.to_str().unwrap();
    let base = [
        "--image",
        img,
        "-p",
        "Describe the image.",
        "--chat",
        "-n",
        "24",
    ];
    let want_logits = tmp("vision_logits_resident.npy");
    let want = json(
        &lm,
        &mm,
        &[
            &base[..],
            &[
                "--schedule",
                "resident",
                "--logits-out",
                want_logits.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(!tokens(&want).is_empty());
    let st = &want["stats"];
    // 320x240 -> a 280x168 overview and two 168x280 slices, 15 embeddings each.
    assert_eq!(st["image_tokens"], 45);
    assert_eq!(st["images"], 1);
    assert!(st["image_encode_ms"].as_f64().unwrap() > 0.0);
    let prompt = want["prompt_tokens"].as_array().unwrap();
    assert_eq!(prompt.iter().filter(|t| t.is_null()).count(), 45);
    assert_eq!(st["prompt_tokens"].as_u64().unwrap() as usize, prompt.len());
    let want_bytes = std::fs::read(&want_logits).unwrap();
    for args in [
        ["--schedule", "on-demand", "--slots", "2"],
        ["--schedule", "les", "--slots", "2"],
        ["--schedule", "les", "--slots", "7"],
        ["--schedule", "les", "--expert-mem", "64KiB"],
    ] {
        let path = tmp(&format!("vision_logits_{}.npy", args.join("_")));
        let got = json(
            &lm,
            &mm,
            &[
                &base[..],
                &args[..],
                &["--logits-out", path.to_str().unwrap()],
            ]
            .concat(),
        );
        assert_eq!(tokens(&got), tokens(&want), "{args:?}");
        assert_eq!(got["prompt_tokens"], want["prompt_tokens"], "{args:?}");
        assert!(
            std::fs::read(&path).unwrap() == want_bytes,
            "{args:?}: logits differ"
        );
    }
    // Thread count does not matter either.
    let t1 = json(&lm, &mm, &[&base[..], &["-t", "1"]].concat());
    let t3 = json(&lm, &mm, &[&base[..], &["-t", "3"]].concat());
    assert_eq!(tokens(&t1), tokens(&want));
    assert_eq!(tokens(&t3), tokens(&want));
}

/// The ids of `texts` in the synthetic vocabulary, from the model file.
fn ids(lm: &Path, texts: &[&str]) -> Vec<u64> {
    let g = les::gguf::Gguf::open(lm).unwrap();
    let toks = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    texts
        .iter()
        .map(|t| toks.iter().position(|x| x == t).unwrap() as u64)
        .collect()
}

#[test]
fn image_markers_and_slice_tokens_follow_minicpmv() {
    let (lm, mm) = models("minicpmv4_6");
    let img = image();
    let img = img.to_str().unwrap();
    let v = json(
        &lm,
        &mm,
        &[
            "--image",
            img,
            "-p",
            "Look: <__media__> and say.",
            "-n",
            "2",
        ],
    );
    let p: Vec<Option<u64>> = v["prompt_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(Value::as_u64)
        .collect();
    let [im, im_end, sl, sl_end] = ids(&lm, &["<image>", "</image>", "<slice>", "</slice>"])[..]
    else {
        unreachable!()
    };
    // text, <image> 15 x emb </image> <slice> 15 x emb </slice> <slice> 15 x emb
    // </slice>, text (one row of slices: no newline token).
    let start = p.iter().position(|t| *t == Some(im)).unwrap();
    assert!(start > 0, "text before the image");
    let mut want = vec![Some(im)];
    want.extend([None; 15]);
    want.push(Some(im_end));
    for _ in 0..2 {
        want.push(Some(sl));
        want.extend([None; 15]);
        want.push(Some(sl_end));
    }
    assert_eq!(p[start..start + want.len()], want[..]);
    assert!(p.len() > start + want.len(), "text after the image");

    // Without a marker the image goes first; two images make two blocks.
    let v = json(
        &lm,
        &mm,
        &["--image", img, "--image", img, "-p", "Compare.", "-n", "2"],
    );
    let p: Vec<Option<u64>> = v["prompt_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(Value::as_u64)
        .collect();
    assert_eq!(p[0], Some(im));
    assert_eq!(p.iter().filter(|t| **t == Some(im)).count(), 2);
    assert_eq!(p.iter().filter(|t| t.is_none()).count(), 90);
    assert_eq!(v["stats"]["images"], 2);
}

#[test]
fn gemma3_projector_runs_end_to_end() {
    let (lm, mm) = models("gemma3");
    let img = image();
    let v = json(
        &lm,
        &mm,
        &[
            "--image",
            img.to_str().unwrap(),
            "-p",
            "What is this?",
            "--chat",
            "-n",
            "8",
        ],
    );
    assert_eq!(v["stats"]["image_tokens"], 16);
    let p = v["prompt_tokens"].as_array().unwrap();
    let [soi, eoi] = ids(&lm, &["<start_of_image>", "<end_of_image>"])[..] else {
        unreachable!()
    };
    let s = p.iter().position(|t| t.as_u64() == Some(soi)).unwrap();
    assert!(p[s + 1..s + 17].iter().all(Value::is_null));
    assert_eq!(p[s + 17].as_u64(), Some(eoi));
    let stream = ok(run(
        &lm,
        &mm,
        &[
            "--image",
            img.to_str().unwrap(),
            "-p",
            "What is this?",
            "--chat",
            "-n",
            "8",
            "--temp",
            "0",
        ],
    ));
    assert_eq!(stream.trim_end_matches('\n'), v["text"].as_str().unwrap());
}

#[test]
fn bad_multimodal_inputs_fail_cleanly() {
    let (lm, mm) = models("minicpmv4_6");
    let img = image();
    let img = img.to_str().unwrap();
    let err = |extra: &[&str]| {
        let o = run(&lm, &mm, extra);
        assert!(!o.status.success(), "{extra:?} should fail");
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(e.starts_with("error: "), "{e}");
        e
    };
    let e = err(&["--image", img, "-p", "<__media__><__media__> two markers"]);
    assert!(e.contains("2 image marker"), "{e}");
    let e = err(&["--image", "/nonexistent/picture.png", "-p", "x"]);
    assert!(e.contains("picture.png"), "{e}");
    let garbage = tmp("vision_garbage.png");
    std::fs::write(&garbage, b"this is not an image at all").unwrap();
    let e = err(&["--image", garbage.to_str().unwrap(), "-p", "x"]);
    assert!(
        e.contains("not a PNG, JPEG, GIF, BMP or PPM/PGM image"),
        "{e}"
    );
    // A projector for a model of another width.
    let other = tmp("vision_lm_wide.gguf");
    ok(les()
        .args([
            "synth", "--arch", "qwen3moe", "--embd", "128", "--quiet", "-o",
        ])
        .arg(&other)
        .output()
        .unwrap());
    let o = run(&other, &mm, &["--image", img, "-p", "x"]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("wide"), "{e}");
    // --image needs --mmproj.
    let o = les()
        .args(["run", "-m"])
        .arg(&lm)
        .args(["--image", img, "-p", "x"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    // The language model is not a projector.
    let o = run(&lm, &lm, &["--image", img, "-p", "x"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("not an mmproj"));
}

#[test]
fn projector_dimensions_can_be_chosen() {
    // A 112-pixel slice size cuts the 320x240 image into 3x2 slices of 112x112
    // plus a 112x112 overview, 4 embeddings each.
    let lm = tmp("vision_lm_dims.gguf");
    let mm = tmp("vision_mmproj_dims.gguf");
    ok(les()
        .args(["synth", "--arch", "qwen3moe", "--quiet", "-o"])
        .arg(&lm)
        .arg("--mmproj-out")
        .arg(&mm)
        .args(["--mmproj-width", "128", "--mmproj-layers", "3"])
        .args(["--mmproj-image-size", "112"])
        .output()
        .unwrap());
    let g = les::gguf::Gguf::open(&mm).unwrap();
    assert_eq!(g.get_u32("clip.vision.embedding_length").unwrap(), 128);
    assert_eq!(g.get_u32("clip.vision.block_count").unwrap(), 3);
    let img = image();
    let v = json(
        &lm,
        &mm,
        &["--image", img.to_str().unwrap(), "-p", "x", "-n", "2"],
    );
    assert_eq!(v["stats"]["image_tokens"], 28);
    let p = v["prompt_tokens"].as_array().unwrap();
    let [nl] = ids(&lm, &["\u{10a}"])[..] else {
        unreachable!()
    };
    // One newline token between the two rows of slices.
    assert_eq!(p.iter().filter(|t| t.as_u64() == Some(nl)).count(), 1);
}

/// An image that is a pipe or a device is refused at once (a FIFO hung, and
/// `/dev/zero` was read into memory without end), and an mmproj whose image
/// size would make a chunk of more than 128 x 128 patches is refused at load.
#[test]
fn bad_image_files_and_oversized_towers_are_refused() {
    let (lm, mm) = models("minicpmv4_6");
    let fifo = cli::fifo("vision_fifo.png");
    for img in [fifo.as_path(), Path::new("/dev/zero")] {
        let o = run(
            &lm,
            &mm,
            &["--image", img.to_str().unwrap(), "-p", "x", "-n", "1"],
        );
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.trim_end().ends_with(": not a regular file"), "{err}");
    }
    std::fs::remove_file(&fifo).unwrap();

    let big = tmp("vision_mmproj_big.gguf");
    rewrite_gguf(
        &mm,
        &big,
        |k, v| {
            Some(if k == "clip.vision.image_size" {
                4480u32.into()
            } else {
                v
            })
        },
        vec![],
    );
    let img = image();
    let o = run(
        &lm,
        &big,
        &["--image", img.to_str().unwrap(), "-p", "x", "-n", "1"],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("clip.vision.image_size 4480 is 320 patches of 14 a side, more than 128"),
        "{err}"
    );
    std::fs::remove_file(&big).unwrap();

    // Optional hyperparameters of the wrong type are errors, not defaults.
    let bad = tmp("vision_mmproj_bad_hparam.gguf");
    for (key, value, want) in [
        (
            "clip.use_gelu",
            MetaValue::from(1u32),
            "clip.use_gelu must be a bool",
        ),
        (
            "clip.vision.projector.scale_factor",
            "4".into(),
            "scale_factor must be a non-negative integer",
        ),
        (
            "clip.vision.wa_layer_indexes",
            "0".into(),
            "wa_layer_indexes must be an array",
        ),
        (
            "clip.vision.wa_layer_indexes",
            vec![-1i32].into(),
            "wa_layer_indexes must hold non-negative integers",
        ),
    ] {
        rewrite_gguf(
            &mm,
            &bad,
            |k, v| (k != key).then_some(v),
            vec![(key, value)],
        );
        let o = run(
            &lm,
            &bad,
            &["--image", img.to_str().unwrap(), "-p", "x", "-n", "1"],
        );
        assert!(!o.status.success(), "{key}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{key}: {err}");
    }
    std::fs::remove_file(&bad).unwrap();
}

/// What an image will cost is known from its size alone: `image_layout` gives
/// the chunks and embeddings `encode_image` makes, and `prompt_positions` the
/// length of the prompt `build_prompt` makes (the context is checked with it
/// before any image is encoded).
#[test]
fn image_layouts_and_prompt_lengths_are_known_before_encoding() {
    use les::vision::{self, RgbImage};
    for projector in ["minicpmv4_6", "gemma3", "lfm2"] {
        let (lm, mm) = models(projector);
        let clip = vision::ClipModel::open(&mm).unwrap();
        let model = les::model::Model::open(&lm).unwrap();
        let tok = les::tokenizer::Tokenizer::from_gguf(model.gguf()).unwrap();
        let mut pool = les::compute::Pool::new(2);
        let mut ctx = vision::Ctx {
            pool: &mut pool,
            isa: les_core::gemv::Isa::detect(),
        };
        let sizes = [(320, 240), (100, 60), (1000, 90), (90, 1000), (1500, 1100)];
        let (mut layouts, mut encoded) = (Vec::new(), Vec::new());
        for (w, h) in sizes {
            let layout = vision::image_layout(&clip, (w, h));
            let img = RgbImage::filled(w, h, [200, 100, 50]);
            let e = vision::encode_image(&mut ctx, &clip, &img).unwrap();
            let made: Vec<usize> = e.chunks.iter().map(|c| c.len() / e.n_embd).collect();
            assert_eq!(layout.chunk_tokens, made, "{projector} {w}x{h}");
            assert_eq!(layout.grid, e.grid, "{projector} {w}x{h}");
            layouts.push(layout);
            encoded.push(e);
        }
        if projector == "minicpmv4_6" {
            assert!(layouts.iter().any(|l| l.grid.1 > 1), "some image is sliced");
        }
        if projector == "lfm2" {
            // Only 1500 x 1100 is over twice 512 x 512: 3 x 2 tiles.
            let grids: Vec<_> = layouts.iter().map(|l| l.grid).collect();
            assert_eq!(grids, [(0, 0), (0, 0), (0, 0), (0, 0), (3, 2)]);
        }
        let text = format!("a {m} b {m}{m} c {m} d {m}", m = vision::MEDIA_MARKER);
        let p = clip.hp.projector;
        let built =
            vision::build_prompt(&tok, p, &text, true, &encoded, clip.hp.n_mmproj_embd).unwrap();
        let n = vision::prompt_positions(&tok, p, &text, true, &layouts).unwrap();
        assert_eq!(n, built.len(), "{projector}");
        assert_eq!(
            built.n_image_tokens(),
            layouts.iter().map(|l| l.n_tokens()).sum::<usize>()
        );
        // The marker count is checked the same way.
        let e = vision::prompt_positions(&tok, p, "no markers", true, &layouts).unwrap_err();
        assert!(e.to_string().contains("image marker"), "{e}");
    }
}

/// `les synth --arch qwen3vlmoe ... --mmproj-out P --projector
/// qwen3vl_merger` makes the pair in one command: the tower's deepstack
/// mergers follow the model's `n_deepstack_layers` (none for a model without
/// them), on the blocks before the last; rows are `n_embd` per merger plus
/// one; each image is one chunk of its merged grid, known before encoding.
#[test]
fn qwen3vl_projector_follows_its_language_model() {
    use les::vision::{self, RgbImage};
    let lm = tmp("vision_lm_q3vl.gguf");
    let mm = tmp("vision_mmproj_q3vl.gguf");
    let text = ok(les()
        .args([
            "synth",
            "--arch",
            "qwen3vlmoe",
            "--preset",
            "tiny",
            "--quiet",
        ])
        .arg("-o")
        .arg(&lm)
        .arg("--mmproj-out")
        .arg(&mm)
        .args(["--projector", "qwen3vl_merger"])
        .output()
        .unwrap());
    assert!(text.contains("qwen3vl_merger"), "{text}");
    let g = les::gguf::Gguf::open(&lm).unwrap();
    let n_embd = g.get_u32("qwen3vlmoe.embedding_length").unwrap() as usize;
    assert_eq!(g.get_u32("qwen3vlmoe.n_deepstack_layers").unwrap(), 3);
    let g = les::gguf::Gguf::open(&mm).unwrap();
    assert_eq!(g.get_u32("clip.vision.block_count").unwrap(), 4);
    let marks: Vec<bool> = g
        .get_array("clip.vision.is_deepstack_layers")
        .unwrap()
        .iter()
        .map(|v| v.as_bool().unwrap())
        .collect();
    assert_eq!(marks, [true, true, true, false]);
    let clip = vision::ClipModel::open(&mm).unwrap();
    assert_eq!(clip.hp.projector, vision::ProjectorType::Qwen3Vl);
    assert_eq!(clip.hp.n_mmproj_embd, n_embd);
    assert_eq!(clip.row_width(), 4 * n_embd);
    let mut pool = les::compute::Pool::new(2);
    let mut ctx = vision::Ctx {
        pool: &mut pool,
        isa: les_core::gemv::Isa::detect(),
    };
    for (w, h) in [(320, 240), (100, 60), (1000, 90), (90, 1000), (10, 10)] {
        let layout = vision::image_layout(&clip, (w, h));
        let grid = vision::merged_grid(&clip, w, h);
        let e =
            vision::encode_image(&mut ctx, &clip, &RgbImage::filled(w, h, [200, 100, 50])).unwrap();
        assert_eq!(e.n_embd, clip.row_width());
        assert_eq!((e.chunks.len(), e.grid), (1, (0, 0)));
        assert_eq!(e.chunks[0].len(), grid.0 * grid.1 * e.n_embd, "{w}x{h}");
        assert_eq!(layout.chunk_tokens, [grid.0 * grid.1], "{w}x{h}");
    }
    // A model without deepstack inputs gets a tower without mergers; a tower
    // too shallow for the model's is refused before anything is written.
    let lm2 = tmp("vision_lm_q3vl_plain.gguf");
    let mm2 = tmp("vision_mmproj_q3vl_plain.gguf");
    ok(les()
        .args(["synth", "--arch", "qwen3moe", "--quiet", "-o"])
        .arg(&lm2)
        .arg("--mmproj-out")
        .arg(&mm2)
        .args(["--projector", "qwen3vl_merger"])
        .output()
        .unwrap());
    let clip = vision::ClipModel::open(&mm2).unwrap();
    assert_eq!(
        (clip.hp.n_deepstack, clip.row_width()),
        (0, clip.hp.n_mmproj_embd)
    );
    let out = les()
        .args([
            "synth",
            "--arch",
            "qwen3vlmoe",
            "--preset",
            "tiny",
            "--quiet",
            "-o",
        ])
        .arg(tmp("vision_lm_q3vl_shallow.gguf"))
        .arg("--mmproj-out")
        .arg(tmp("vision_mmproj_q3vl_shallow.gguf"))
        .args(["--projector", "qwen3vl_merger", "--mmproj-layers", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("deepstack"), "{err}");
}

/// A prompt whose images do not fit the context fails before any image is
/// decoded: here a JPEG cut short after its header, which would fail to decode.
#[test]
fn images_that_overflow_the_context_fail_before_decoding() {
    let (lm, mm) = models("minicpmv4_6");
    let png = les::vision::load_image(&image()).unwrap();
    let mut jpeg = Vec::new();
    image::RgbImage::from_raw(320, 240, png.data)
        .unwrap()
        .write_to(
            &mut std::io::Cursor::new(&mut jpeg),
            image::ImageFormat::Jpeg,
        )
        .unwrap();
    let cut = tmp("vision_cut.jpg");
    std::fs::write(&cut, &jpeg[..jpeg.len() / 2]).unwrap();
    let cut = cut.to_str().unwrap();
    let o = run(
        &lm,
        &mm,
        &["--image", cut, "-p", "x", "-n", "1", "--ctx", "8"],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("does not fit the context of 8"), "{err}");
    // With room, the same file fails at its decoding: a truncated JPEG is an
    // error (the decoder filled it with gray).
    let o = run(&lm, &mm, &["--image", cut, "-p", "x", "-n", "1"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("end-of-image marker"), "{err}");
}

/// An image prompt on a qwen35moe model drafting with its multi-token-
/// prediction block (which takes image positions' embeddings in place of a
/// token's): plain decoding's tokens and logits.
#[test]
fn image_prompt_with_mtp_drafts_gives_plain_decodings_logits() {
    let (lm, mm) = (tmp("vision_lm_q35.gguf"), tmp("vision_mmproj_q35.gguf"));
    ok(les()
        .args(["synth", "--arch", "qwen35moe", "--quiet", "-o"])
        .arg(&lm)
        .arg("--mmproj-out")
        .arg(&mm)
        .output()
        .unwrap());
    let img = image();
    let base = [
        "--image",
        img.to_str().unwrap(),
        "-p",
        "Describe the image.",
        "-n",
        "24",
    ];
    let run_with = |name: &str, extra: &[&str]| {
        let path = tmp(&format!("vision_q35_{name}.npy"));
        let v = json(
            &lm,
            &mm,
            &[&base[..], extra, &["--logits-out", path.to_str().unwrap()]].concat(),
        );
        (v, std::fs::read(&path).unwrap())
    };
    let (want, want_logits) = run_with("plain", &[]);
    let (got, logits) = run_with(
        "mtp",
        &[
            "--speculate",
            "mtp",
            "--draft-fixed",
            "--draft-max",
            "3",
            "--schedule",
            "les",
            "--slots",
            "3",
        ],
    );
    assert_eq!(tokens(&got), tokens(&want));
    assert!(logits == want_logits, "logits differ");
    assert!(
        got["stats"]["drafted"].as_u64().unwrap() > 0,
        "{}",
        got["stats"]
    );
    assert_eq!(got["stats"]["image_tokens"], want["stats"]["image_tokens"]);
}

/// `les run --conversation` with images in later turns: `/image` encodes an
/// image for the next message (a bad one is reported and the chat goes on),
/// `/image` lines before the first message are the first message's images,
/// and after `/clear` a message is answered as by a new run with the same
/// seed.
#[test]
fn conversation_takes_images_in_any_turn() {
    let (lm, mm) = models("minicpmv4_6");
    let img = image();
    let img = img.to_str().unwrap();
    let converse = |extra: &[&str], stdin: &str| {
        let out = cli::with_stdin(
            les()
                .args(["run", "-m"])
                .arg(&lm)
                .arg("--mmproj")
                .arg(&mm)
                .args(["--cnv", "--temp", "0.8", "--seed", "3", "-n", "8"])
                .args(extra),
            stdin.as_bytes(),
        );
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{extra:?}: {err}");
        (String::from_utf8(out.stdout).unwrap(), err)
    };
    let turn_sizes = |err: &str| -> Vec<usize> {
        err.match_indices("les: turn of ")
            .map(|(i, m)| {
                let rest = &err[i + m.len()..];
                rest[..rest.find(' ').unwrap()].parse().unwrap()
            })
            .collect()
    };
    let stdin = format!(
        "/image {img}\nWhat is it?\n/image /nonexistent.png\nWhat now?\n/clear\nHello\n/quit\nNever read\n"
    );
    let (out, err) = converse(&["-p", "Describe"], &stdin);
    assert!(
        err.contains("embeddings in") && err.contains("for the next message"),
        "{err}"
    );
    assert!(err.contains("/nonexistent.png"), "{err}");
    assert!(err.contains("the conversation is cleared"), "{err}");
    let sizes = turn_sizes(&err);
    assert_eq!(sizes.len(), 3, "{err}");
    // The image's positions are in its turn; the next turn is text only.
    let image_tokens = json(&lm, &mm, &["--image", img, "-p", "x", "-n", "1"])["stats"]
        ["image_tokens"]
        .as_u64()
        .unwrap() as usize;
    assert!(
        sizes[0] > image_tokens && sizes[1] < image_tokens,
        "{sizes:?}, {image_tokens}"
    );
    // After /clear: the first reply of a new run.
    let (fresh, _) = converse(&["-p", "Hello"], "");
    assert!(out.ends_with(&fresh), "{out:?} does not end with {fresh:?}");

    // /image before the first message: the same as --image.
    let (a, _) = converse(&["--image", img, "-p", "Describe"], "");
    let (b, err) = converse(&[], &format!("/image {img}\nDescribe\n"));
    assert_eq!(a, b, "{err}");
    assert!(err.contains("320x240, for the next message"), "{err}");
}

/// A multimodal decode against llama.cpp's own (`libmtmd` through
/// llama-cpp-python, `scripts/mtmd_llama.py`: the prompt's chunks through
/// `mtmd_helper_eval_chunks`, then token by token): a MiniCPM-V 4.6 style
/// projector (f16 weights, as converted files have them) before an f32
/// qwen3moe, the demo image, a larger one that is sliced and a progressive
/// JPEG. The same greedy tokens, and logits within 2e-3 (measured 3-5e-4:
/// the image embeddings differ by ggml's f16-table GELU, see
/// `vision_encoder`). Needs llama-cpp-python with its `mtmd` library (the
/// README's "Against llama.cpp").
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn multimodal_decode_equals_llama_cpps() {
    decode_equals_llama_cpps("qwen3moe", 2e-3);
}

/// [`multimodal_decode_equals_llama_cpps`] before MiniCPM-V 4.7's language
/// model (qwen35moe): M-RoPE sections, where llama.cpp places MiniCPM-V's
/// overview and slices in sequence, in every section. Logits within 1e-2
/// (measured 1.3-4e-3: the recurrent layers carry the f16 embeddings'
/// differences further; with the projector's weights in f32, 1e-4).
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn multimodal_decode_on_qwen35moe_equals_llama_cpps() {
    decode_equals_llama_cpps("qwen35moe", 1e-2);
}

fn decode_equals_llama_cpps(arch: &str, tolerance: f32) {
    let name = format!("mtmd_lm_f32_{arch}");
    let (lm, mm) = cli::synth_with_projector(arch, "minicpmv4_6", &name, &cli::F32_WEIGHTS);
    let prompt = "What is in <__media__>? It is";
    for img in cli::decode_images(arch) {
        let worst = cli::image_decode_difference(&lm, &mm, &img, prompt, 12, arch);
        assert!(worst < tolerance, "{arch}, {}: {worst}", img.display());
    }
}
