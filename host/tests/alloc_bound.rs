//! The parser allocates a small multiple of the file size at most, whatever the
//! counts in the file claim. Measured with a counting global allocator, so this
//! binary holds a single test (tests in one binary share the allocator).

mod counting_alloc;

use les::gguf::Gguf;

#[global_allocator]
static ALLOC: counting_alloc::Counting = counting_alloc::Counting;

/// Peak bytes allocated while parsing `bytes`, above what was live before.
fn parse_peak(bytes: &[u8]) -> usize {
    let base = counting_alloc::start();
    let result = Gguf::parse(bytes).map(|g| g.tensor_count());
    let peak = counting_alloc::peak_since(base);
    drop(result);
    peak
}

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend_from_slice(&3u32.to_le_bytes());
    v.extend_from_slice(&n_tensors.to_le_bytes());
    v.extend_from_slice(&n_kv.to_le_bytes());
    v
}

fn kv(v: &mut Vec<u8>, key: &str) {
    v.extend_from_slice(&(key.len() as u64).to_le_bytes());
    v.extend_from_slice(key.as_bytes());
    v.extend_from_slice(&0u32.to_le_bytes()); // u8
    v.push(1);
}

fn tensor(v: &mut Vec<u8>, name: &str) {
    v.extend_from_slice(&(name.len() as u64).to_le_bytes());
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&1u32.to_le_bytes());
    v.extend_from_slice(&0u64.to_le_bytes()); // ne[0] = 0: no data
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&0u64.to_le_bytes());
}

#[test]
fn parser_allocation_is_bounded_by_file_size() {
    const MB: usize = 1 << 20;
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();

    // Counts as large as the bytes allow, over zeros (fails at the first item).
    let rest = (MB - 24) as u64;
    for (n_tensors, n_kv) in [(rest / 24, 0), (0, rest / 14), (u64::MAX, u64::MAX)] {
        let mut v = header(n_tensors, n_kv);
        v.resize(MB, 0);
        cases.push(("claimed counts", v));
    }
    // Many tiny valid metadata pairs and tensors: the densest real index.
    let (mut v, n) = (Vec::new(), 40_000u64);
    v.extend(header(n, n));
    for i in 0..n {
        kv(&mut v, &format!("{i:x}"));
    }
    for i in 0..n {
        tensor(&mut v, &format!("{i:x}"));
    }
    v.resize(v.len().next_multiple_of(32), 0);
    cases.push(("dense valid file", v));
    // A huge string array and a deep pile of empty nested arrays.
    let mut v = header(0, 2);
    v.extend_from_slice(&1u64.to_le_bytes());
    v.push(b's');
    v.extend_from_slice(&9u32.to_le_bytes());
    v.extend_from_slice(&8u32.to_le_bytes());
    v.extend_from_slice(&100_000u64.to_le_bytes());
    for _ in 0..100_000 {
        v.extend_from_slice(&0u64.to_le_bytes());
    }
    v.extend_from_slice(&1u64.to_le_bytes());
    v.push(b'n');
    v.extend_from_slice(&9u32.to_le_bytes());
    v.extend_from_slice(&9u32.to_le_bytes());
    v.extend_from_slice(&50_000u64.to_le_bytes());
    for _ in 0..50_000 {
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&0u64.to_le_bytes());
    }
    cases.push(("big arrays", v));

    for (what, bytes) in &cases {
        let peak = parse_peak(bytes);
        let limit = 8 * bytes.len() + 64 * 1024;
        assert!(
            peak <= limit,
            "{what}: parsing {} bytes allocated {peak} bytes (limit {limit})",
            bytes.len()
        );
        eprintln!(
            "{what}: {} bytes, peak {peak} ({:.2}x)",
            bytes.len(),
            peak as f64 / bytes.len() as f64
        );
    }
    // The dense file must have parsed, or the bound proves little.
    assert_eq!(Gguf::parse(&cases[3].1[..]).unwrap().tensor_count(), 40_000);
}
