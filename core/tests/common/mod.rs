//! Shared helpers for the integration tests: reference data from the `gguf` package.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Directory with the reference data of `scripts/quant_refs.py`, generated once per
/// test binary. Panics with instructions when Python or `gguf` is missing: these
/// tests must not pass silently without their reference.
pub fn quant_refs() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("quant_refs");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/quant_refs.py");
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let status = Command::new(&python)
            .arg(&script)
            .arg(&dir)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {python} {}: {e}", script.display()));
        assert!(
            status.success(),
            "{} failed ({status}); install the reference with `pip install gguf numpy`",
            script.display()
        );
        dir
    })
}

/// Reads `<type>.<ext>` from the reference directory.
pub fn read_ref(name: &str, ext: &str) -> Vec<u8> {
    let path = quant_refs().join(format!("{name}.{ext}"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Reads `<type>.<ext>` as little-endian f32 values.
pub fn read_ref_f32(name: &str, ext: &str) -> Vec<f32> {
    read_ref(name, ext)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Asserts two f32 slices are bit-identical, naming the first difference.
pub fn assert_bits_eq(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{name}: element {i}: got {g:e}, want {w:e}"
        );
    }
}
