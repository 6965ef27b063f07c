//! Helpers shared by the end-to-end tests of the `les` binary: running it,
//! synthetic models written once per test binary, its JSON and `.npy` outputs.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

use serde_json::Value;

/// The `les` binary under test.
pub fn les() -> Command {
    Command::new(env!("CARGO_BIN_EXE_les"))
}

/// Runs `cmd` with `stdin` written to its standard input (then closed),
/// its standard output and error captured.
pub fn with_stdin(cmd: &mut Command, stdin: &[u8]) -> std::process::Output {
    use std::io::Write as _;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

/// A per-layer key as the converters write it: one i32 a layer
/// (`attention.head_count_kv`, `feed_forward_length`).
pub fn i32_array(values: &[i32]) -> les::gguf::MetaValue {
    use les::gguf::{MetaArray, MetaValue, ValueType};
    let items = values.iter().map(|c| MetaValue::I32(*c)).collect();
    MetaArray::new(ValueType::I32, items).unwrap().into()
}

/// A path in the test scratch directory.
pub fn tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// A fresh FIFO `tmp(name)` (removed first if there), made with `mkfifo`.
pub fn fifo(name: &str) -> PathBuf {
    let path = tmp(name);
    let _ = std::fs::remove_file(&path);
    assert!(Command::new("mkfifo")
        .arg(&path)
        .status()
        .unwrap()
        .success());
    path
}

/// `les synth <args> -o <tmp(file)>`, run once per test binary and file name
/// (concurrent tests wait for the first to finish); the model's path.
pub fn synth_once(file: &str, args: &[&str]) -> PathBuf {
    static MADE: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let path = tmp(file);
    let mut made = MADE.lock().unwrap_or_else(|p| p.into_inner());
    if !made.iter().any(|f| f == file) {
        stdout_ok(
            les()
                .arg("synth")
                .args(args)
                .arg("-o")
                .arg(&path)
                .output()
                .expect("les runs"),
            &format!("synth {args:?}"),
        );
        made.push(file.to_string());
    }
    path
}

/// A synthetic `tiny` of `arch` with seed 5 and `extra` args, written once
/// per test binary as `{arch}_{name}.gguf`.
pub fn tiny(arch: &str, name: &str, extra: &[&str]) -> PathBuf {
    let args = ["--arch", arch, "--preset", "tiny", "--seed", "5"];
    synth_once(&format!("{arch}_{name}.gguf"), &[&args[..], extra].concat())
}

/// A copy of `src` as `tmp(name)` whose metadata `edit` changed (keys
/// removed, added or replaced), the tensors as they are.
pub fn with_metadata(
    src: &Path,
    name: &str,
    edit: impl Fn(&mut Vec<(String, les::gguf::MetaValue)>),
) -> PathBuf {
    use std::io::BufWriter;
    let dst = tmp(name);
    let g = les::gguf::Gguf::open(src).unwrap();
    let mut meta: Vec<_> = g
        .metadata()
        .map(|(k, v)| (k.to_string(), v.to_meta()))
        .collect();
    edit(&mut meta);
    let mut w = les::gguf::GgufWriter::new();
    for (k, v) in meta {
        w.add_kv(&k, v).unwrap();
    }
    for t in g.tensors() {
        w.add_tensor(t.name().to_string(), t.dims(), t.ggml_type())
            .unwrap();
    }
    let mut data = w
        .write_header(BufWriter::new(std::fs::File::create(&dst).unwrap()))
        .unwrap();
    for t in g.tensors() {
        data.write_tensor(t.name(), t.data()).unwrap();
    }
    data.finish().unwrap();
    dst
}

/// Packs `plain` and checks that the packed copy gives `plain`'s greedy
/// tokens and logits, bit for bit, resident and streamed (les with 3 and 2
/// slots, the latter one position a batch; on-demand with 5), and the plain
/// file streamed; returns the packed file and the tokens.
pub fn streams_exactly(plain: &Path, tag: &str) -> (PathBuf, Vec<u64>) {
    let packed = tmp(&format!("{tag}.p.gguf"));
    pack(plain, &packed);
    let (want_tokens, want) = greedy_logits(plain, &format!("{tag}_plain"), &[]);
    assert!(!want_tokens.is_empty());
    for (name, file, extra) in [
        ("packed", &packed, &[][..]),
        ("les3", &packed, &["--schedule", "les", "--slots", "3"][..]),
        ("od5", &packed, &["--schedule", "on-demand", "--slots", "5"]),
        (
            "les2_b1",
            &packed,
            &["--schedule", "les", "--slots", "2", "-b", "1"],
        ),
        (
            "plain_les",
            &plain.to_path_buf(),
            &["--schedule", "les", "--slots", "4"],
        ),
    ] {
        let (t, got) = greedy_logits(file, &format!("{tag}_{name}"), extra);
        assert_eq!(t, want_tokens, "{tag} {name}");
        assert!(got == want, "{tag} {name}: logits differ");
    }
    (packed, want_tokens)
}

/// `les run --speculate mtp` (fixed drafts of 2) on `model`: its tokens, with
/// at least one token drafted.
pub fn mtp_tokens(model: &Path, extra: &[&str]) -> Vec<u64> {
    let args = ["--speculate", "mtp", "--draft-fixed", "--draft-max", "2"];
    let v = greedy_json(model, &[&args[..], extra].concat());
    assert!(
        v["stats"]["drafted"].as_u64().unwrap() > 0,
        "{}",
        v["stats"]
    );
    tokens(&v)
}

/// `model`'s greedy tokens and llama.cpp's (llama-cpp-python) are the same,
/// and les's log-probabilities are within a KL divergence of `max_kld` of
/// llama.cpp's everywhere, with the same top token at a share of the
/// positions of at least `same_top`.
pub fn assert_equals_llama_cpp(model: &Path, tag: &str, max_kld: f64, same_top: f64) {
    let theirs = llama_greedy(model);
    let v = greedy_json(model, &[]);
    assert_eq!(v["prompt_tokens"], theirs["prompt"], "{tag}: prompt");
    assert_eq!(
        serde_json::json!(tokens(&v)),
        theirs["tokens"],
        "{tag}: greedy continuations differ"
    );
    let base = tmp(&format!("{tag}.kld"));
    llama_kld_base(model, &base);
    let d = kld(model, &base);
    assert!(d["max"].as_f64().unwrap() < max_kld, "{tag}: {d}");
    assert!(d["same_top"].as_f64().unwrap() >= same_top, "{tag}: {d}");
}

/// With llama.cpp's log-probabilities over `src/synth/sample.txt` as the
/// base (`llama_kld_base`), `model` (quantized weights) stays close: a mean
/// KL divergence under 2e-3 and the same top token at over 90% of the
/// positions; `tag` names the base file and the failure.
pub fn assert_close_to_llama_cpp(model: &Path, tag: &str) {
    let base = tmp(&format!("{tag}.kld"));
    llama_kld_base(model, &base);
    let close = kld(model, &base);
    assert!(close["mean"].as_f64().unwrap() < 2e-3, "{tag}: {close}");
    assert!(close["same_top"].as_f64().unwrap() > 0.9, "{tag}: {close}");
}

/// The standard output of a successful run; panics with its stderr otherwise.
pub fn stdout_ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The one JSON object a successful `--json` run prints.
pub fn json_ok(out: Output, what: &str) -> Value {
    serde_json::from_str(&stdout_ok(out, what)).expect("one JSON object on stdout")
}

/// The `tokens` array of a run's JSON.
pub fn tokens(v: &Value) -> Vec<u64> {
    v["tokens"]
        .as_array()
        .expect("a tokens array")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// A 2-D little-endian f32 `.npy` file as written by `--logits-out`: rows,
/// columns and the raw data bytes (checked against the header's shape).
pub fn npy(path: &Path) -> (usize, usize, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    let shape = &header[header.find("'shape': (").unwrap() + 10..];
    let shape: Vec<usize> = shape[..shape.find(')').unwrap()]
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().unwrap())
        .collect();
    assert_eq!((10 + hlen) % 64, 0, "header padded to 64 bytes");
    let data = bytes[10 + hlen..].to_vec();
    assert_eq!(data.len(), shape[0] * shape[1] * 4);
    (shape[0], shape[1], data)
}

/// Expert slots for `model`: `slots` of them split across its expert sizes
/// by their expert counts (as `--slots N`), or none (`None`: resident).
pub fn slot_budget(model: &les::model::Model, slots: Option<usize>) -> les::supply::SlotBudget {
    let top_k = model.hp.moe.map_or(1, |m| m.top_k) as u32;
    les::supply::SlotBudget {
        classes: match slots {
            Some(n) => {
                les_core::slot_classes::plan_by_count(model.expert_size_groups(), n as u32, top_k)
                    .unwrap()
                    .to_vec()
            }
            None => Vec::new(),
        },
        io: les::flash::FileDeviceConfig::default(),
    }
}

/// `les pack input -o output`, which must succeed.
pub fn pack(input: &Path, output: &Path) {
    let out = les()
        .arg("pack")
        .arg(input)
        .arg("-o")
        .arg(output)
        .output()
        .unwrap();
    stdout_ok(out, "les pack");
}

/// `les synth` options for `f32` weights everywhere (where les and llama.cpp
/// differ only by rounding).
pub const F32_WEIGHTS: [&str; 8] = [
    "--expert-type",
    "f32",
    "--dense-type",
    "f32",
    "--embd-type",
    "f32",
    "--output-type",
    "f32",
];

/// `les run -m model -p "The quick brown fox" -n 24 --temp 0 <extra>`.
pub fn greedy(model: &Path, extra: &[&str]) -> Output {
    les()
        .args(["run", "-m"])
        .arg(model)
        .args(["-p", "The quick brown fox", "-n", "24", "--temp", "0"])
        .args(extra)
        .output()
        .unwrap()
}

/// [`greedy`] with `--json`, which must succeed: its JSON.
pub fn greedy_json(model: &Path, extra: &[&str]) -> Value {
    let out = greedy(model, &[&["--json"], extra].concat());
    json_ok(out, &format!("run {extra:?}"))
}

/// [`greedy_json`]'s tokens and its logits (`--logits-out`, raw bytes), the
/// file named after the model and `name`.
pub fn greedy_logits(model: &Path, name: &str, extra: &[&str]) -> (Vec<u64>, Vec<u8>) {
    let stem = model.file_stem().unwrap().to_str().unwrap();
    let path = tmp(&format!("logits_{stem}_{name}.npy"));
    let v = greedy_json(
        model,
        &[extra, &["--logits-out", path.to_str().unwrap()]].concat(),
    );
    (tokens(&v), npy(&path).2)
}

/// `host/tests/scripts/<script> <args>` under python3 (llama.cpp through
/// llama-cpp-python), which must succeed: its standard output.
fn llama_script(script: &str, args: &[&std::ffi::OsStr]) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/scripts")
        .join(script);
    let out = Command::new("python3")
        .arg(path)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// llama.cpp's greedy continuation of "The quick brown fox" (24 tokens at
/// most, `llama_greedy.py`): `{"prompt": [...], "tokens": [...]}`.
pub fn llama_greedy(model: &Path) -> Value {
    let out = llama_script(
        "llama_greedy.py",
        &[
            model.as_os_str(),
            "The quick brown fox".as_ref(),
            "24".as_ref(),
        ],
    );
    serde_json::from_slice(&out).unwrap()
}

/// llama.cpp's log probabilities along its greedy continuation of `prompt`
/// (`n` tokens at most, the `top` most likely at each; `llama_logprobs.py`):
/// `[{"id", "logprob", "top": [[id, logprob], ...]}, ...]`.
pub fn llama_logprobs(model: &Path, prompt: &str, n: usize, top: usize) -> Value {
    let (n, top) = (n.to_string(), top.to_string());
    let args = [model.as_os_str(), prompt.as_ref(), n.as_ref(), top.as_ref()];
    serde_json::from_slice(&llama_script("llama_logprobs.py", &args)).unwrap()
}

/// llama.cpp's log-probabilities over `src/synth/sample.txt`, 2 chunks of
/// 128 positions, written to `base` as llama-perplexity's base file
/// (`llama_kld_base.py`).
pub fn llama_kld_base(model: &Path, base: &Path) {
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/synth/sample.txt");
    llama_kld_base_of(model, &text, base, 128, 2);
}

/// [`llama_kld_base`] over `text` in `chunks` chunks of `ctx` tokens.
pub fn llama_kld_base_of(model: &Path, text: &Path, base: &Path, ctx: usize, chunks: usize) {
    let (ctx, chunks) = (ctx.to_string(), chunks.to_string());
    llama_script(
        "llama_kld_base.py",
        &[
            model.as_os_str(),
            text.as_os_str(),
            base.as_os_str(),
            ctx.as_ref(),
            chunks.as_ref(),
        ],
    );
}

/// `les perplexity --kl-divergence` of `model` against `base`: its `kld` object.
pub fn kld(model: &Path, base: &Path) -> Value {
    kld_with(model, base, &[])
}

/// [`kld`] with `extra` arguments to `les perplexity`.
pub fn kld_with(model: &Path, base: &Path, extra: &[&str]) -> Value {
    let out = les()
        .args(["perplexity", "-m"])
        .arg(model)
        .arg("--kl-divergence-base")
        .arg(base)
        .args(["--kl-divergence", "--json"])
        .args(extra)
        .output()
        .unwrap();
    json_ok(out, "perplexity")["kld"].clone()
}

/// A copy of `src` (named after `tag`) with every `exp_probs_b.bias` zeroed
/// (the tensors are f32: zero bytes are zeros), which must be `n` tensors.
pub fn without_selection_bias(src: &Path, tag: &str, n: usize) -> PathBuf {
    let dst = tmp(&format!("{tag}_nobias.gguf"));
    let mut bytes = std::fs::read(src).unwrap();
    let g = les::gguf::Gguf::open(src).unwrap();
    let biases: Vec<_> = g
        .tensors()
        .filter(|t| t.name().ends_with("exp_probs_b.bias"))
        .map(|t| (t.offset() as usize, t.size() as usize))
        .collect();
    assert_eq!(biases.len(), n, "{tag}: selection biases");
    for (at, len) in biases {
        bytes[at..at + len].fill(0);
    }
    std::fs::write(&dst, bytes).unwrap();
    dst
}

/// Zeroing `model`'s `n` selection biases changes its logits (the biases
/// decide picks).
pub fn assert_selection_bias_matters(model: &Path, tag: &str, n: usize) {
    let (_, with) = greedy_logits(model, &format!("{tag}_bias"), &[]);
    let plain = without_selection_bias(model, tag, n);
    let (_, without) = greedy_logits(&plain, &format!("{tag}_nobias"), &[]);
    assert!(with != without, "{tag}: the selection bias changed nothing");
}

/// Against llama.cpp (llama-cpp-python), a model routed with `n` selection
/// biases: with f32 weights (`f32`) the same prompt and greedy tokens and
/// log-probabilities within rounding, and apart by far more once the
/// biases are zeroed (so the comparison sees them); with quantized weights
/// (`q`) close log-probabilities.
pub fn assert_biased_routing_equals_llama_cpp(f32: &Path, q: &Path, tag: &str, n: usize) {
    assert_equals_llama_cpp(f32, &format!("{tag}_f32"), 1e-4, 1.0);
    let plain = without_selection_bias(f32, &format!("{tag}_f32"), n);
    let apart = kld(&plain, &tmp(&format!("{tag}_f32.kld")));
    assert!(apart["max"].as_f64().unwrap() > 1e-3, "{tag}: {apart}");
    let base = tmp(&format!("{tag}_q.kld"));
    llama_kld_base(q, &base);
    let close = kld(q, &base);
    assert!(close["mean"].as_f64().unwrap() < 2e-3, "{tag}: {close}");
    assert!(close["same_top"].as_f64().unwrap() > 0.9, "{tag}: {close}");
}

/// The images multimodal decodes are compared on: the demo image, a
/// 640x400 pattern (MiniCPM-V slices it) written as `tag`'s, and a
/// progressive JPEG.
pub fn decode_images(tag: &str) -> [PathBuf; 3] {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let large = tmp(&format!("mtmd_large_{tag}.png"));
    image::RgbImage::from_fn(640, 400, |x, y| {
        image::Rgb([
            (x * 3 % 256) as u8,
            (y * 5 % 256) as u8,
            ((x ^ y) % 256) as u8,
        ])
    })
    .save(&large)
    .unwrap();
    [
        dir.join("../assets/test-image.png"),
        large,
        dir.join("tests/data/jpeg/progressive.jpg"),
    ]
}

/// `les run -m lm --mmproj mm --image image -p prompt` and llama.cpp's
/// libmtmd (`scripts/mtmd_llama.py greedy`: the prompt's chunks through
/// `mtmd_helper_eval_chunks`, then token by token) decode `n` tokens
/// greedily; asserts they give the same tokens and returns the largest
/// difference between their logits (printed with `tag`). Needs
/// llama-cpp-python with its `mtmd` library.
pub fn image_decode_difference(
    lm: &Path,
    mm: &Path,
    image: &Path,
    prompt: &str,
    n: usize,
    tag: &str,
) -> f32 {
    let logits = tmp(&format!("mtmd_les_logits_{tag}.npy"));
    let n = n.to_string();
    let ours = les()
        .args(["run", "-m"])
        .arg(lm)
        .arg("--mmproj")
        .arg(mm)
        .arg("--image")
        .arg(image)
        .args(["-p", prompt, "-n", &n, "--temp", "0", "--json"])
        .arg("--logits-out")
        .arg(&logits)
        .output()
        .unwrap();
    let ours = json_ok(ours, "les run");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/mtmd_llama.py");
    let theirs = Command::new("python3")
        .arg(script)
        .arg("greedy")
        .args([lm.as_os_str(), mm.as_os_str(), image.as_os_str()])
        .args([prompt, n.as_str()])
        .output()
        .unwrap();
    let theirs: Value = serde_json::from_str(&stdout_ok(theirs, "mtmd_llama.py greedy")).unwrap();
    let want: Vec<u64> = theirs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    // les lists the tokens before an end of generation, the script the
    // end too: that one is the argmax of les's last logits.
    let eog = ours["stats"]["stop"] == "eog";
    let (rows, cols, bytes) = npy(&logits);
    let logits_of: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let mut ours_tokens = tokens(&ours);
    if eog {
        let last = &logits_of[(rows - 1) * cols..rows * cols];
        let argmax = (0..cols).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        ours_tokens.push(argmax as u64);
    }
    assert_eq!(
        ours_tokens,
        want,
        "{tag}, {}: greedy tokens",
        image.display()
    );
    let ours = logits_of;
    let mut worst = 0f32;
    for (r, row) in theirs["logits"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .take(rows)
    {
        for (c, v) in row.as_array().unwrap().iter().enumerate().take(cols) {
            worst = worst.max((ours[r * cols + c] - v.as_f64().unwrap() as f32).abs());
        }
    }
    eprintln!(
        "{tag}, {}: largest logit difference {worst:.2e}",
        image.display()
    );
    worst
}

/// `les run` of the demo image and a short chat prompt through `lm` and
/// `mm`, 16 greedy tokens, with `extra` arguments: its JSON and its logits'
/// bytes (written beside `lm`'s name and `tag`).
pub fn run_with_image(lm: &Path, mm: &Path, tag: &str, extra: &[&str]) -> (Value, Vec<u8>) {
    let img = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/test-image.png");
    let stem = lm.file_stem().unwrap().to_string_lossy();
    let logits = tmp(&format!("{stem}_image_run_{tag}.npy"));
    let out = les()
        .args(["run", "-m"])
        .arg(lm)
        .arg("--mmproj")
        .arg(mm)
        .args(["--image", img, "-p", "What is in <__media__>?", "--chat"])
        .args(["-n", "16", "--temp", "0", "--json", "--logits-out"])
        .arg(&logits)
        .args(extra)
        .output()
        .unwrap();
    (json_ok(out, "les run"), std::fs::read(&logits).unwrap())
}

/// A `les run --image` by tag and arguments: its JSON and logits' bytes.
pub type ImageRun<'a> = dyn Fn(&str, &[&str]) -> (Value, Vec<u8>) + 'a;

/// `run(tag, args)` (a `les run --image`: its JSON and logits' bytes) on
/// on-demand and les schedules with few slots, one-token and seven-token
/// prefill batches and three threads gives `want`'s tokens and exactly
/// `want_logits` (`what` names the model in a failure).
pub fn assert_image_runs_agree(run: &ImageRun<'_>, want: &Value, want_logits: &[u8], what: &str) {
    for (tag, args) in [
        (
            "on_demand",
            &["--schedule", "on-demand", "--slots", "2"][..],
        ),
        ("les", &["--schedule", "les", "--slots", "3"][..]),
        (
            "b1",
            &["--schedule", "les", "--expert-mem", "64KiB", "-b", "1"][..],
        ),
        ("b7_t3", &["-b", "7", "-t", "3"][..]),
    ] {
        let (got, logits) = run(tag, args);
        assert_eq!(tokens(&got), tokens(want), "{what} {tag}");
        assert!(logits == want_logits, "{what} {tag}: logits differ");
    }
}

/// A tiny model of `arch` and a `projector` for it from one `les synth`,
/// with `extra` arguments: `{name}.gguf` and `{name}_mmproj.gguf`.
pub fn synth_with_projector(
    arch: &str,
    projector: &str,
    name: &str,
    extra: &[&str],
) -> (PathBuf, PathBuf) {
    let (lm, mm) = (
        tmp(&format!("{name}.gguf")),
        tmp(&format!("{name}_mmproj.gguf")),
    );
    let out = les()
        .args(["synth", "--arch", arch, "--preset", "tiny", "--quiet", "-o"])
        .arg(&lm)
        .arg("--mmproj-out")
        .arg(&mm)
        .args(["--projector", projector])
        .args(extra)
        .output()
        .unwrap();
    stdout_ok(out, "les synth");
    (lm, mm)
}
