//! The GGUF reader on arbitrary bytes: no panic, no read out of range (every
//! slice is bounds-checked, and the sanitizer watches the rest), and allocation
//! bounded by the input size whatever counts the header claims.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use les::gguf::{Gguf, Value};
use libfuzzer_sys::fuzz_target;

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged, only counting bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = CURRENT.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(now, Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// What the reader may allocate for `len` input bytes (host/tests/alloc_bound.rs).
fn bound(len: usize) -> usize {
    8 * len + 64 * 1024
}

fn walk(v: &Value<'_>, depth: usize) {
    let _ = (
        v.value_type(),
        v.as_integer(),
        v.as_f64(),
        v.as_bool(),
        v.as_str(),
    );
    if let Some(a) = v.as_array() {
        let _ = a.get(a.len().saturating_sub(1));
        for (i, x) in a.iter().enumerate() {
            if i > 64 || depth > 8 {
                break;
            }
            walk(&x, depth + 1);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let base = CURRENT.load(Relaxed);
    PEAK.store(base, Relaxed);
    let parsed = Gguf::parse(data);
    let peak = PEAK.load(Relaxed) - base;
    assert!(
        peak <= bound(data.len()),
        "parsing {} bytes allocated {peak} bytes",
        data.len()
    );
    let Ok(g) = parsed else { return };
    let _ = (
        g.version(),
        g.alignment(),
        g.data_offset(),
        g.architecture(),
    );
    for (key, v) in g.metadata() {
        let _ = g.get(key);
        walk(&v, 0);
    }
    for t in g.tensors() {
        // The reader checked each tensor's data lies in the file.
        let d = t.data();
        assert_eq!(d.len() as u64, t.size());
        assert!(t.offset() + t.size() <= data.len() as u64);
        let _ = (
            t.name(),
            t.dims(),
            t.ggml_type(),
            t.n_elements(),
            t.n_rows(),
        );
        assert!(g.tensor(t.name()).is_some());
    }
});
