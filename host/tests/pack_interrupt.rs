//! Ctrl-C during `les pack` and `les synth`: nothing is left under the target
//! name, and the temporary file is removed too (exit status 130).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn les() -> Command {
    Command::new(env!("CARGO_BIN_EXE_les"))
}

fn dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A model whose requantization takes seconds (32 experts of 512 x 512, 2 layers).
fn model(d: &Path) -> PathBuf {
    let path = d.join("mid.gguf");
    let out = les()
        .args([
            "synth",
            "--arch",
            "qwen3moe",
            "--preset",
            "tiny",
            "--layers",
            "2",
            "--embd",
            "512",
            "--heads",
            "8",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--experts",
            "32",
            "--expert-ff",
            "512",
            "-o",
        ])
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

fn temp_files(d: &Path) -> Vec<String> {
    std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

/// Starts `les` with `args` (writing `target` in `d`) and waits until it is
/// writing its temporary file.
fn start(d: &Path, args: &[&str], target: &Path) -> Child {
    let child = les()
        .args(args)
        .arg("-o")
        .arg(target)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while temp_files(d).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{args:?} never created its temporary file"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // Let it write some of the file.
    std::thread::sleep(Duration::from_millis(100));
    child
}

/// Interrupts `les ARGS -o TARGET` with SIGINT, then SIGTERM, while it writes,
/// and checks that it exits with 130 and leaves no file behind.
fn interrupt_leaves_nothing(d: &Path, args: &[&str], target: &Path) {
    for sig in ["-INT", "-TERM"] {
        let child = start(d, args, target);
        signal(&child, sig);
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(130),
            "{sig}: exit status (stderr: {})",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !target.exists(),
            "{sig}: a file exists under the target name"
        );
        assert_eq!(
            temp_files(d),
            Vec::<String>::new(),
            "{sig}: temporary files remain"
        );
    }
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

#[test]
fn interrupted_pack_leaves_no_output_and_no_temporary_file() {
    let d = dir("pack-interrupt");
    let input = model(&d);
    let input = input.to_str().unwrap();
    let args = [
        "pack",
        "--quiet",
        "--threads",
        "1",
        "--expert-types",
        "0-:q4_k",
        input,
    ];
    interrupt_leaves_nothing(&d, &args, &d.join("packed.gguf"));
}

#[test]
fn interrupted_synth_leaves_no_output_and_no_temporary_file() {
    let d = dir("synth-interrupt");
    // The `small` preset writes ~560 MB: seconds, long enough to interrupt.
    let args = [
        "synth",
        "--arch",
        "qwen3moe",
        "--preset",
        "small",
        "--threads",
        "1",
    ];
    interrupt_leaves_nothing(&d, &args, &d.join("small.gguf"));
}
