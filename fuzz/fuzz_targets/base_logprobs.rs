//! llama-perplexity's base log-probability files (`les perplexity
//! --kl-divergence`) on arbitrary bytes: reading one never panics, a file it
//! accepts holds every chunk its header declares, and comparing logits with
//! its rows never panics. The first two bytes choose the model's vocabulary.
#![no_main]

use les::perplexity::{row_len, BaseReader, KlDivergence};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((vocab, file)) = data.split_first_chunk::<2>() else {
        return;
    };
    let n_vocab = usize::from(u16::from_le_bytes(*vocab) % 1024) + 1;
    let cursor = std::io::Cursor::new(file);
    let Ok(mut base) = BaseReader::from_reader(cursor, file.len() as u64, "fuzz", n_vocab) else {
        return;
    };
    assert_eq!(base.tokens.len(), base.n_ctx * base.n_chunk);
    assert!(base.tokens.iter().all(|&t| (t as usize) < n_vocab));
    let logits: Vec<f32> = (0..n_vocab).map(|i| (i % 7) as f32 - 3.0).collect();
    let (row, first) = (row_len(n_vocab), base.n_ctx / 2);
    let mut rows = Vec::new();
    let mut kld = KlDivergence::default();
    for c in 0..base.n_chunk {
        base.next_chunk(&mut rows).expect("the size was checked");
        assert_eq!(rows.len(), (base.n_ctx - 1 - first) * row);
        for (j, r) in rows.chunks_exact(row).enumerate() {
            kld.add(&logits, r, base.tokens[c * base.n_ctx + first + j + 1]);
        }
    }
    let _ = (
        kld.kld(),
        kld.log_ppl_ratio(),
        kld.same_top(),
        kld.p_diff_rms(),
    );
});
