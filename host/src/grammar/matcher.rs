//! The parse state of a grammar over generated text, and its binding to a
//! vocabulary.

use std::collections::HashSet;

use super::{Grammar, GrammarError, Sym, MAX_DEPTH, MAX_EXPANSIONS, MAX_STACKS};
use crate::tokenizer::Tokenizer;

/// An unfinished UTF-8 sequence a piece ended in: the bits read so far, how
/// many bytes are missing (`-1`: the bytes were not UTF-8) and the sequence's
/// length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Partial {
    value: u32,
    remain: i8,
    len: u8,
}

const INVALID: Partial = Partial {
    value: 0,
    remain: -1,
    len: 0,
};

impl Partial {
    /// Whether some completion of the sequence can match `set`
    /// (llama.cpp's `llama_grammar_match_partial_char`).
    fn may_match(self, set: &super::CharSet) -> bool {
        // Invalid, or a 7-bit code point split over two bytes (overlong).
        if self.remain < 0 || (self.remain == 1 && self.value < 2) {
            return false;
        }
        let (mut lo, hi) = self.span();
        if lo == 0 {
            // The shortest encodings of three- and four-byte sequences.
            lo = match self.remain {
                2 => 1 << 11,
                3 => 1 << 16,
                _ => lo,
            };
        }
        set.may_match(lo, hi)
    }

    /// The code points the sequence may still complete to, as bits go.
    fn span(self) -> (u32, u32) {
        let shift = 6 * self.remain.max(0) as u32;
        let lo = self.value << shift;
        (lo, lo | ((1u32 << shift) - 1))
    }

    /// Whether some completion is a valid code point: not overlong, not a
    /// surrogate, at most U+10FFFF.
    fn can_be_valid(self) -> bool {
        let (lo, hi) = self.span();
        hi >= shortest(self.len) && lo <= 0x10ffff && !(lo >= 0xd800 && hi <= 0xdfff)
    }
}

/// The smallest code point a sequence of `len` bytes may encode.
fn shortest(len: u8) -> u32 {
    match len {
        2 => 0x80,
        3 => 0x800,
        4 => 0x1_0000,
        _ => 0,
    }
}

/// Whether a finished sequence of `len` bytes encodes a valid code point.
fn valid(value: u32, len: u8) -> bool {
    value >= shortest(len) && value <= 0x10ffff && !(0xd800..=0xdfff).contains(&value)
}

/// Decodes `bytes` after `start` into `out` (cleared first), returning the
/// sequence left unfinished. As llama.cpp's `decode_utf8`, the byte count is
/// read from each leading byte's high bits, and a continuation byte where a
/// sequence should start, or a non-continuation byte where `start` needs one,
/// makes the whole piece invalid (`out` empty, `remain == -1`). Stricter than
/// llama.cpp, which takes the bytes after a leading byte as they come and
/// keeps any value they give: a non-continuation byte inside a sequence, an
/// overlong encoding, a surrogate or a code point past U+10FFFF (or a
/// sequence that can only become one) make it invalid too, so that text a
/// grammar allows is UTF-8. Pieces of real vocabularies are cut from UTF-8
/// text and never hold such bytes; random synthetic ones do.
fn decode(bytes: &[u8], start: Partial, out: &mut Vec<u32>) -> Partial {
    out.clear();
    let mut cur = Partial {
        remain: start.remain.max(0),
        ..start
    };
    let mut i = 0;
    loop {
        // Continuation bytes of the sequence in `cur`.
        while i < bytes.len() && cur.remain > 0 {
            if bytes[i] >> 6 != 2 {
                out.clear();
                return INVALID;
            }
            cur.value = (cur.value << 6) + u32::from(bytes[i] & 0x3f);
            cur.remain -= 1;
            i += 1;
        }
        if cur.remain > 0 {
            // Ends inside a sequence.
            if !cur.can_be_valid() {
                out.clear();
                return INVALID;
            }
            return cur;
        }
        if cur.len > 0 {
            if !valid(cur.value, cur.len) {
                out.clear();
                return INVALID;
            }
            out.push(cur.value);
        }
        let Some(&first) = bytes.get(i) else {
            return Partial::default();
        };
        i += 1;
        let len: u8 = match first >> 4 {
            0..=7 => 1,
            12 | 13 => 2,
            14 => 3,
            15 if first < 0xf8 => 4,
            _ => {
                out.clear();
                return INVALID;
            }
        };
        if len == 1 {
            out.push(u32::from(first));
            cur = Partial::default();
        } else {
            cur = Partial {
                value: u32::from(first) & ((1u32 << (7 - len)) - 1),
                remain: len as i8 - 1,
                len,
            };
        }
    }
}

/// A set of pushdown stacks, flattened: stack `i` is
/// `pos[ends[i - 1]..ends[i]]`, its top last.
#[derive(Clone, Debug, Default)]
struct Stacks {
    pos: Vec<u32>,
    ends: Vec<u32>,
}

impl Stacks {
    fn len(&self) -> usize {
        self.ends.len()
    }

    fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn get(&self, i: usize) -> &[u32] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.pos[start..self.ends[i] as usize]
    }

    fn iter(&self) -> impl Iterator<Item = &[u32]> {
        (0..self.len()).map(|i| self.get(i))
    }

    fn clear(&mut self) {
        self.pos.clear();
        self.ends.clear();
    }

    /// Adds `stack` unless it is there already.
    fn insert(&mut self, stack: &[u32]) -> Result<(), GrammarError> {
        if self.iter().any(|s| s == stack) {
            return Ok(());
        }
        if self.len() >= MAX_STACKS {
            return Err(GrammarError(format!(
                "grammar: more than {MAX_STACKS} parse stacks at once (the grammar is too ambiguous)"
            )));
        }
        self.pos.extend_from_slice(stack);
        self.ends.push(self.pos.len() as u32);
        Ok(())
    }

    /// Whether some stack is empty: the text so far is a whole derivation.
    fn has_empty(&self) -> bool {
        self.iter().any(<[u32]>::is_empty)
    }
}

impl Grammar {
    /// Expands `stack` until every stack it becomes has a code point set on
    /// top (or is empty), adding those to `out` (llama.cpp's
    /// `llama_grammar_advance_stack`).
    fn advance(&self, stack: Vec<u32>, out: &mut Stacks) -> Result<(), GrammarError> {
        let mut todo = vec![stack];
        // Stacks already expanded: nested optional items reach the same
        // stack along many paths, which would otherwise take exponential time.
        let mut seen: HashSet<Vec<u32>> = HashSet::new();
        let mut expansions = 0usize;
        while let Some(stack) = todo.pop() {
            if !seen.insert(stack.clone()) {
                continue;
            }
            let Some(&top) = stack.last() else {
                out.insert(&stack)?;
                continue;
            };
            match self.syms[top as usize] {
                Sym::Chars(_) => out.insert(&stack)?,
                Sym::Rule(rule) => {
                    let below = &stack[..stack.len() - 1];
                    let after = top + 1;
                    // Alternatives pushed last first: they come out in order.
                    for &start in self.alts[rule as usize].iter().rev() {
                        expansions += 1;
                        if expansions > MAX_EXPANSIONS {
                            return Err(GrammarError(format!(
                                "grammar: one step needs more than {MAX_EXPANSIONS} expansions"
                            )));
                        }
                        let mut next = Vec::with_capacity(below.len() + 2);
                        next.extend_from_slice(below);
                        if self.syms[after as usize] != Sym::End {
                            next.push(after);
                        }
                        if self.syms[start as usize] != Sym::End {
                            next.push(start);
                        }
                        if next.len() > MAX_DEPTH {
                            return Err(GrammarError(format!(
                                "grammar: rules nested deeper than {MAX_DEPTH}"
                            )));
                        }
                        todo.push(next);
                    }
                }
                // Never on a stack: stacks hold sets and rule references.
                Sym::End => {}
            }
        }
        Ok(())
    }

    /// The stacks the text can continue from after code point `c`, from
    /// `from` (llama.cpp's `llama_grammar_accept`): the stacks whose top set
    /// holds `c`, moved past it and expanded. Finished (empty) stacks drop out.
    fn step(&self, from: &Stacks, c: u32, out: &mut Stacks) -> Result<(), GrammarError> {
        out.clear();
        for stack in from.iter() {
            let Some(&top) = stack.last() else { continue };
            let Sym::Chars(set) = self.syms[top as usize] else {
                continue;
            };
            if !self.sets[set as usize].matches(c) {
                continue;
            }
            let mut next = Vec::with_capacity(stack.len());
            next.extend_from_slice(&stack[..stack.len() - 1]);
            if self.syms[top as usize + 1] != Sym::End {
                next.push(top + 1);
            }
            self.advance(next, out)?;
        }
        Ok(())
    }

    /// Whether some stack's top set can match `c` (a cheap first test).
    fn any_top_matches(&self, stacks: &Stacks, c: u32) -> bool {
        stacks.iter().any(|s| match s.last() {
            Some(&top) => match self.syms[top as usize] {
                Sym::Chars(set) => self.sets[set as usize].matches(c),
                _ => false,
            },
            None => false,
        })
    }

    /// Whether an unfinished sequence can still match where some stack
    /// stands (a finished stack takes no more bytes).
    fn partial_fits(&self, stacks: &Stacks, partial: Partial) -> bool {
        stacks.iter().any(|s| match s.last() {
            Some(&top) => match self.syms[top as usize] {
                Sym::Chars(set) => partial.may_match(&self.sets[set as usize]),
                _ => false,
            },
            None => false,
        })
    }

    /// The stacks after `code_points` from `from`, into `cur` (`next` a
    /// buffer); `false` where they run out (the text does not continue the
    /// grammar).
    fn walk(
        &self,
        from: &Stacks,
        code_points: &[u32],
        cur: &mut Stacks,
        next: &mut Stacks,
    ) -> Result<bool, GrammarError> {
        let Some((&first, rest)) = code_points.split_first() else {
            cur.clone_from(from);
            return Ok(true);
        };
        self.step(from, first, cur)?;
        for &c in rest {
            if cur.is_empty() {
                break;
            }
            self.step(cur, c, next)?;
            std::mem::swap(cur, next);
        }
        Ok(!cur.is_empty())
    }

    /// The stacks the grammar starts with: one per alternative of `root`,
    /// expanded.
    fn start(&self) -> Result<Stacks, GrammarError> {
        let mut stacks = Stacks::default();
        for &start in &self.alts[self.root as usize] {
            let stack = if self.syms[start as usize] == Sym::End {
                Vec::new()
            } else {
                vec![start]
            };
            self.advance(stack, &mut stacks)?;
        }
        Ok(stacks)
    }
}

/// Where generated text stands in a grammar; see the [module docs](super).
#[derive(Clone, Debug)]
pub struct Matcher {
    grammar: Grammar,
    /// The stacks at the grammar's start.
    start: Stacks,
    stacks: Stacks,
    partial: Partial,
    /// Buffers of [`allows`](Self::allows).
    code_points: Vec<u32>,
    cur: Stacks,
    next: Stacks,
}

impl Matcher {
    /// A matcher at the start of `grammar`.
    pub fn new(grammar: Grammar) -> Result<Matcher, GrammarError> {
        let start = grammar.start()?;
        Ok(Matcher {
            grammar,
            stacks: start.clone(),
            start,
            partial: Partial::default(),
            code_points: Vec::new(),
            cur: Stacks::default(),
            next: Stacks::default(),
        })
    }

    /// Back to the start of the grammar.
    pub fn reset(&mut self) {
        self.stacks.clone_from(&self.start);
        self.partial = Partial::default();
    }

    /// Whether the text so far is a whole derivation of the grammar (an
    /// end-of-generation token may come now).
    pub fn can_end(&self) -> bool {
        self.stacks.has_empty()
    }

    /// Whether `bytes` may come next (see the [module docs](super) for the
    /// rules on unfinished UTF-8). Never changes the state; a step past a
    /// bound counts as not allowed.
    pub fn allows(&mut self, bytes: &[u8]) -> bool {
        let bytes = until_nul(bytes);
        if bytes.is_empty() {
            return false;
        }
        let partial = decode(bytes, self.partial, &mut self.code_points);
        if partial.remain < 0 {
            return false;
        }
        let g = &self.grammar;
        // Most tokens fail on their first code point: test that before
        // building any stack.
        if let Some(&c) = self.code_points.first() {
            if !g.any_top_matches(&self.stacks, c) {
                return false;
            }
        }
        matches!(
            g.walk(
                &self.stacks,
                &self.code_points,
                &mut self.cur,
                &mut self.next
            ),
            Ok(true)
        ) && (partial.remain == 0 || g.partial_fits(&self.cur, partial))
    }

    /// Moves past `bytes`: an error (the state unchanged) where the grammar
    /// does not allow them.
    pub fn accept(&mut self, bytes: &[u8]) -> Result<(), GrammarError> {
        let refused = || {
            GrammarError(format!(
                "grammar: the text {:?} does not continue it",
                String::from_utf8_lossy(bytes)
            ))
        };
        let trimmed = until_nul(bytes);
        let mut code_points = Vec::new();
        let partial = decode(trimmed, self.partial, &mut code_points);
        if trimmed.is_empty() || partial.remain < 0 {
            return Err(refused());
        }
        let mut stacks = Stacks::default();
        let continues = self.grammar.walk(
            &self.stacks,
            &code_points,
            &mut stacks,
            &mut Stacks::default(),
        )?;
        if !continues || (partial.remain > 0 && !self.grammar.partial_fits(&stacks, partial)) {
            return Err(refused());
        }
        self.stacks = stacks;
        self.partial = partial;
        Ok(())
    }

    /// Whether the grammar derives `text` as a whole, from the start (for
    /// tests and checks; the state is left at the start).
    pub fn derives(&mut self, text: &str) -> bool {
        self.reset();
        let ok = text.is_empty() || self.accept(text.as_bytes()).is_ok();
        let ok = ok && self.can_end();
        self.reset();
        ok
    }
}

/// `bytes` up to its first NUL: llama.cpp reads pieces as C strings.
fn until_nul(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    &bytes[..end]
}

/// A [`Matcher`] over a vocabulary: which tokens may come next, and moving
/// past the one sampled.
#[derive(Clone, Debug)]
pub struct TokenGrammar {
    matcher: Matcher,
    /// Every token's bytes (special tokens written out, as llama.cpp's
    /// `token_to_piece` with `special`), concatenated.
    bytes: Vec<u8>,
    ends: Vec<u32>,
    /// End-of-generation tokens.
    eog: Vec<bool>,
}

impl TokenGrammar {
    /// `grammar` over `tokenizer`'s vocabulary.
    pub fn new(grammar: Grammar, tokenizer: &Tokenizer) -> Result<TokenGrammar, GrammarError> {
        let n = tokenizer.n_vocab() as u32;
        Self::from_pieces(
            grammar,
            (0..n).map(|t| (tokenizer.piece(t, true), tokenizer.is_eog(t))),
        )
    }

    /// `grammar` over a vocabulary given as each token's bytes and whether it
    /// ends generation, in id order.
    pub fn from_pieces<'p>(
        grammar: Grammar,
        pieces: impl IntoIterator<Item = (&'p [u8], bool)>,
    ) -> Result<TokenGrammar, GrammarError> {
        let (mut bytes, mut ends, mut eog) = (Vec::new(), Vec::new(), Vec::new());
        for (piece, end) in pieces {
            bytes.extend_from_slice(piece);
            ends.push(bytes.len() as u32);
            eog.push(end);
        }
        Ok(TokenGrammar {
            matcher: Matcher::new(grammar)?,
            bytes,
            ends,
            eog,
        })
    }

    /// Whether `token` may come next.
    pub fn allows(&mut self, token: u32) -> bool {
        if self.eog.get(token as usize) == Some(&true) {
            return self.matcher.can_end();
        }
        let t = token as usize;
        let Some(&end) = self.ends.get(t) else {
            return false;
        };
        let start = if t == 0 { 0 } else { self.ends[t - 1] as usize };
        self.matcher.allows(&self.bytes[start..end as usize])
    }

    /// Moves past `token`: an error where the grammar does not allow it (an
    /// end-of-generation token before the grammar may end, say).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.eog.get(token as usize) == Some(&true) {
            return if self.matcher.can_end() {
                Ok(())
            } else {
                Err(GrammarError(
                    "grammar: generation ended before the grammar was complete".into(),
                ))
            };
        }
        let t = token as usize;
        let Some(&end) = self.ends.get(t) else {
            return Err(GrammarError(format!(
                "grammar: token {token} is outside the vocabulary"
            )));
        };
        let start = if t == 0 { 0 } else { self.ends[t - 1] as usize };
        self.matcher.accept(&self.bytes[start..end as usize])
    }

    /// Back to the start of the grammar.
    pub fn reset(&mut self) {
        self.matcher.reset();
    }

    /// `token`'s bytes (special tokens written out; empty outside the
    /// vocabulary).
    pub fn piece(&self, token: u32) -> &[u8] {
        let t = token as usize;
        match self.ends.get(t) {
            Some(&end) => {
                let start = if t == 0 { 0 } else { self.ends[t - 1] as usize };
                &self.bytes[start..end as usize]
            }
            None => &[],
        }
    }

    /// Whether `token` ends generation.
    pub fn ends_generation(&self, token: u32) -> bool {
        self.eog.get(token as usize) == Some(&true)
    }

    /// Moves past `bytes` (text that came otherwise than token by token: a
    /// lazy grammar's start); an error where the grammar does not allow them.
    pub fn accept_bytes(&mut self, bytes: &[u8]) -> Result<(), GrammarError> {
        self.matcher.accept(bytes)
    }
}
