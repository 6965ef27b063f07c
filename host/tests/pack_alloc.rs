//! `les pack` copies the source's metadata compactly: a large array costs about
//! its bytes, not an owned value per element (a 60 MB array once took 2 GB).
//! Measured with a counting global allocator, so this binary holds one test.

mod common;
mod counting_alloc;

use std::path::Path;
use std::process::Command;

use common::*;
use les::gguf::MetaValue;
use les::pack::{pack, ExpertTypes, PackOptions};

#[global_allocator]
static ALLOC: counting_alloc::Counting = counting_alloc::Counting;

/// Peak bytes allocated while packing `input`.
fn pack_peak(input: &Path, output: &Path) -> usize {
    let opts = PackOptions {
        types: ExpertTypes::Keep,
        threads: 1,
        ..PackOptions::default()
    };
    let base = counting_alloc::start();
    pack(input, output, &opts, |_, _| {}).unwrap();
    counting_alloc::peak_since(base)
}

#[test]
fn pack_memory_grows_with_metadata_bytes_not_elements() {
    let plain = tmp("pack_alloc_tiny.gguf");
    let o = Command::new(env!("CARGO_BIN_EXE_les"))
        .args([
            "synth", "--arch", "qwen3moe", "--preset", "tiny", "--quiet", "-o",
        ])
        .arg(&plain)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    const BIG: usize = 8 << 20;
    let big = tmp("pack_alloc_big.gguf");
    rewrite_gguf(
        &plain,
        &big,
        |_, v| Some(v),
        vec![("x.big", MetaValue::from(vec![7u8; BIG]))],
    );
    let out = tmp("pack_alloc_out.gguf");
    let base = pack_peak(&plain, &out);
    let with_big = pack_peak(&big, &out);
    // The copy of the array, and the header that holds it while it is written.
    assert!(
        with_big <= base + 5 * BIG / 2,
        "{with_big} bytes at peak with an array of {BIG} u8, {base} without"
    );
    for p in [plain, big, out] {
        std::fs::remove_file(p).unwrap();
    }
}
