//! `Model::populate_resident`: the resident weights (every tensor but the
//! routed experts) are brought into memory at load, so that no token waits
//! on a page fault for them (an embedding row read for the first time), and
//! the experts are not. Its own test binary: it reads the process's resident
//! file pages, which other tests would change meanwhile.

mod cli;

use cli::synth_once;
use les::model::Model;

/// Bytes of `path`'s mappings resident in this process (their `Rss` in
/// `/proc/self/smaps`).
fn mapped_rss(path: &std::path::Path) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let name = path.canonicalize().unwrap();
    let name = name.to_str().unwrap();
    let mut ours = false;
    let mut kb = 0u64;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            ours = line.ends_with(name);
        } else if ours && line.starts_with("Rss:") {
            kb += line
                .split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<u64>()
                .unwrap();
        }
    }
    kb * 1024
}

#[test]
fn resident_weights_are_in_memory_and_experts_are_not() {
    // A vocabulary of 60000 makes the embedding and output matrices the
    // bulk of the file's resident weights (several MiB), as in real models;
    // 64 experts of 2048 the bulk of the file (tens of MiB).
    let plain = synth_once(
        "resident_weights.gguf",
        &[
            "--arch",
            "qwen3moe",
            "--preset",
            "tiny",
            "--vocab",
            "60000",
            "--experts",
            "64",
            "--expert-ff",
            "2048",
            "--quiet",
        ],
    );
    let packed = cli::tmp("resident_weights.p.gguf");
    cli::pack(&plain, &packed);
    for path in [&plain, &packed] {
        // As `les bench` starts each schedule: nothing of the file cached
        // (`les pack` just wrote the packed one through the page cache).
        les::flash::FileDevice::evict_page_cache(path).unwrap();
        let model = Model::open(path).unwrap();
        let g = model.gguf();
        let experts = model.expert_ranges();
        let total: u64 = g.tensors().map(|t| t.size()).sum();
        let expert_bytes: u64 = experts.iter().map(|r| r.end - r.start).sum();
        let resident_tensors: Vec<_> = g
            .tensors()
            .filter(|t| !experts.iter().any(|r| r.contains(&t.offset())))
            .collect();
        assert!(
            resident_tensors.iter().all(|t| !t.name().contains("_exps")),
            "{}",
            path.display()
        );
        assert!(
            expert_bytes >= model.total_expert_bytes(),
            "{}",
            path.display()
        );
        let before = mapped_rss(path);
        let bytes = model.populate_resident();
        let after = mapped_rss(path);
        assert_eq!(bytes, total - expert_bytes, "{}", path.display());
        assert!(bytes > 4 << 20, "{bytes}");
        // Every resident page is mapped now (the header's and the page edges'
        // aside), and hardly any expert page.
        assert!(
            before < bytes / 2,
            "{}: {before} mapped before",
            path.display()
        );
        let len = g.bytes().len() as u64;
        assert!(expert_bytes > 4 * bytes, "{expert_bytes} of experts");
        assert!(
            after >= bytes && after < len - expert_bytes * 9 / 10,
            "{}: {after} bytes mapped for {bytes} resident bytes ({expert_bytes} of experts)",
            path.display()
        );
    }
}
