//! Byte-level BPE: each word's bytes start as GPT-2 byte tokens and the adjacent
//! pair with the lowest merge rank is merged until no listed pair is left
//! (ties go to the leftmost pair), as llama.cpp's `llm_tokenizer_bpe_session`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::hash::FxBuildHasher;
use super::unicode::BYTE_TO_CHAR;
use super::TokenizerError;

/// Marks an absent link or a byte with no token.
const NONE: u32 = u32::MAX;

/// Merge table of a byte-level BPE vocabulary.
#[derive(Debug)]
pub(crate) struct Bpe {
    /// (left, right) -> (rank, merged token).
    merges: HashMap<(u32, u32), (u32, u32), FxBuildHasher>,
    /// Token of each raw byte (its GPT-2 character), if the vocabulary has it.
    byte_tokens: [u32; 256],
    /// llama-3 style: a word that is itself a token is emitted without merging.
    ignore_merges: bool,
}

/// Reusable buffers for [`Bpe::encode_word`].
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<Sym>,
    heap: BinaryHeap<Reverse<Pair>>,
    encoded: String,
}

#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

/// A candidate merge: ordered by rank, then by left position.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Pair {
    rank: u32,
    left: u32,
    right: u32,
    left_id: u32,
    right_id: u32,
    merged: u32,
}

impl Bpe {
    /// Builds the merge table. Each merge is `"left right"` (split at the first space
    /// after the first byte, as llama.cpp does); both halves and their concatenation
    /// must be tokens. A repeated pair keeps its first (lowest) rank.
    pub(crate) fn new(
        merges: &[String],
        lookup: impl Fn(&str) -> Option<u32>,
        ignore_merges: bool,
    ) -> Result<Self, TokenizerError> {
        let mut table = HashMap::with_capacity_and_hasher(merges.len(), FxBuildHasher);
        let mut joined = String::new();
        for (rank, merge) in merges.iter().enumerate() {
            let bad = |reason: String| TokenizerError::BadMerge {
                index: rank,
                merge: super::clip(merge),
                reason,
            };
            let split = merge
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .map(|p| p + 1)
                .ok_or_else(|| bad("no space separates the two halves".into()))?;
            // A space byte is never inside a multi-byte character: both are boundaries.
            let (left, right) = (&merge[..split], &merge[split + 1..]);
            let token = |text: &str| {
                lookup(text).ok_or_else(|| bad(format!("{:?} is not a token", super::clip(text))))
            };
            let (l, r) = (token(left)?, token(right)?);
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let m = token(&joined)?;
            let rank = u32::try_from(rank).map_err(|_| bad("too many merges".into()))?;
            table.entry((l, r)).or_insert((rank, m));
        }
        let mut byte_tokens = [NONE; 256];
        let mut buf = [0u8; 4];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = lookup(BYTE_TO_CHAR[b].encode_utf8(&mut buf)).unwrap_or(NONE);
        }
        Ok(Self {
            merges: table,
            byte_tokens,
            ignore_merges,
        })
    }

    /// Appends the tokens of one pre-tokenized word. Bytes whose GPT-2 character is
    /// not in the vocabulary are dropped, as llama.cpp does.
    pub(crate) fn encode_word(
        &self,
        word: &str,
        lookup: impl Fn(&str) -> Option<u32>,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        let bytes = word.as_bytes();
        if bytes.is_empty() {
            return;
        }
        if self.ignore_merges {
            let enc = &mut scratch.encoded;
            enc.clear();
            enc.extend(bytes.iter().map(|&b| BYTE_TO_CHAR[b as usize]));
            if let Some(id) = lookup(enc) {
                out.push(id);
                return;
            }
        }
        if bytes.len() == 1 {
            let id = self.byte_tokens[bytes[0] as usize];
            if id != NONE {
                out.push(id);
            }
            return;
        }
        let syms = &mut scratch.syms;
        let heap = &mut scratch.heap;
        syms.clear();
        heap.clear();
        let n = bytes.len() as u32;
        syms.extend(bytes.iter().enumerate().map(|(i, &b)| {
            let i = i as u32;
            Sym {
                id: self.byte_tokens[b as usize],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                alive: true,
            }
        }));
        for i in 1..n {
            self.push_pair(syms, heap, i - 1, i);
        }
        while let Some(Reverse(p)) = heap.pop() {
            let (l, r) = (syms[p.left as usize], syms[p.right as usize]);
            if !l.alive || !r.alive || l.next != p.right || l.id != p.left_id || r.id != p.right_id
            {
                continue; // stale: one side changed since this pair was queued
            }
            let left = &mut syms[p.left as usize];
            left.id = p.merged;
            left.next = r.next;
            syms[p.right as usize].alive = false;
            if r.next != NONE {
                syms[r.next as usize].prev = p.left;
            }
            self.push_pair(syms, heap, l.prev, p.left);
            self.push_pair(syms, heap, p.left, r.next);
        }
        let mut i = 0;
        while i != NONE {
            let s = syms[i as usize];
            if s.id != NONE {
                out.push(s.id);
            }
            i = s.next;
        }
    }

    fn push_pair(&self, syms: &[Sym], heap: &mut BinaryHeap<Reverse<Pair>>, left: u32, right: u32) {
        if left == NONE || right == NONE {
            return;
        }
        let (left_id, right_id) = (syms[left as usize].id, syms[right as usize].id);
        if left_id == NONE || right_id == NONE {
            return;
        }
        if let Some(&(rank, merged)) = self.merges.get(&(left_id, right_id)) {
            heap.push(Reverse(Pair {
                rank,
                left,
                right,
                left_id,
                right_id,
                merged,
            }));
        }
    }

    /// Number of distinct merge pairs.
    pub(crate) fn n_merges(&self) -> usize {
        self.merges.len()
    }
}
