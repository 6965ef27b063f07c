//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`), as llama.cpp's
//! `llm_tokenizer_spm`: start from UTF-8 characters, repeatedly merge the adjacent
//! pair whose concatenation is the highest-scoring token (ties to the leftmost),
//! then spell any piece that is not a token with byte tokens `<0xXX>`.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Reusable buffers for [`encode`].
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<Sym>,
    heap: BinaryHeap<Bigram>,
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Bigram {
    fn key(&self) -> (ScoreKey, Reverse<usize>) {
        (ScoreKey(self.score), Reverse(self.left))
    }
}

/// Scores are checked to be numbers (and `-0.0` made `0.0`) when the vocabulary is
/// built, so the total order agrees with `<`.
struct ScoreKey(f32);

impl PartialEq for ScoreKey {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for ScoreKey {}

impl PartialOrd for ScoreKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ScoreKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Bigram {}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

/// What [`encode`] needs from the vocabulary.
pub(crate) struct Vocab<'v, F: Fn(&str) -> Option<u32>> {
    pub lookup: F,
    pub scores: &'v [f32],
    pub max_token_len: usize,
    /// Token for each byte when a piece has no token of its own.
    pub byte_tokens: &'v [Option<u32>; 256],
}

/// Appends the tokens of `text` (spaces already escaped to U+2581).
pub(crate) fn encode<F: Fn(&str) -> Option<u32>>(
    text: &str,
    vocab: &Vocab<'_, F>,
    scratch: &mut Scratch,
    out: &mut Vec<u32>,
) {
    if text.is_empty() {
        return;
    }
    let syms = &mut scratch.syms;
    let heap = &mut scratch.heap;
    syms.clear();
    heap.clear();
    let n = text.chars().count();
    syms.extend(text.char_indices().enumerate().map(|(i, (start, c))| Sym {
        start,
        len: c.len_utf8(),
        prev: if i == 0 { NONE } else { i - 1 },
        next: if i + 1 == n { NONE } else { i + 1 },
    }));
    for i in 1..n {
        try_add(text, vocab, syms, heap, i - 1, i);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (syms[b.left], syms[b.right]);
        // Symbols only grow, so an unchanged total size means both are as queued.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        syms[b.left].len += r.len;
        syms[b.left].next = r.next;
        syms[b.right].len = 0;
        if r.next != NONE {
            syms[r.next].prev = b.left;
        }
        try_add(text, vocab, syms, heap, l.prev, b.left);
        try_add(text, vocab, syms, heap, b.left, r.next);
    }
    let mut i = 0;
    while i != NONE {
        let s = syms[i];
        let piece = &text[s.start..s.start + s.len];
        match (vocab.lookup)(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.bytes().filter_map(|b| vocab.byte_tokens[b as usize])),
        }
        i = s.next;
    }
}

fn try_add<F: Fn(&str) -> Option<u32>>(
    text: &str,
    vocab: &Vocab<'_, F>,
    syms: &[Sym],
    heap: &mut BinaryHeap<Bigram>,
    left: usize,
    right: usize,
) {
    if left == NONE || right == NONE {
        return;
    }
    let (l, r) = (syms[left], syms[right]);
    let size = l.len + r.len;
    if size > vocab.max_token_len {
        return;
    }
    if let Some(id) = (vocab.lookup)(&text[l.start..l.start + size]) {
        heap.push(Bigram {
            score: vocab.scores.get(id as usize).copied().unwrap_or(0.0),
            left,
            right,
            size,
        });
    }
}
