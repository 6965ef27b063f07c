//! Grammar-constrained sampling: llama.cpp's GBNF grammars (`--grammar`,
//! `--grammar-file`).
//!
//! A grammar limits what the model may generate to the strings it derives, a
//! code point at a time. The pieces fit as llama.cpp's `llama-grammar` does:
//!
//! - [`Grammar::parse`] reads GBNF (llama.cpp's `grammars/README.md`): rules
//!   `name ::= alternatives`, string literals, character classes `[a-z]`,
//!   `[^...]`, `.`, groups, `*` `+` `?` `{m}` `{m,}` `{m,n}`, `#` comments. It
//!   rewrites repetitions into helper rules, as llama.cpp does, and refuses
//!   undefined rules, a missing `root`, left recursion and sizes past the
//!   [limits](MAX_REPETITION).
//! - [`Matcher`] is the parse state: the set of pushdown stacks of positions
//!   in the rules that the text so far can continue from, plus an unfinished
//!   UTF-8 sequence a token may have ended in. It answers whether a token's
//!   bytes may come next ([`Matcher::allows`]) and moves on by them
//!   ([`Matcher::accept`]).
//! - [`json_schema_to_gbnf`] writes the grammar of a JSON Schema's documents
//!   (`--json-schema`), a string's `pattern` through `pattern` (ECMA-262
//!   regular expressions over the string's JSON text).
//! - [`TokenGrammar`] binds a matcher to a vocabulary (each token's bytes,
//!   special tokens written out, and which tokens end generation), which is
//!   what [`crate::sampling::Sampler::constrain`] takes.
//!
//! The semantics are llama.cpp's, including its edge cases: a token is allowed
//! when its code points can all be accepted from some stack and, if it ends in
//! an unfinished UTF-8 sequence, some completion of it can match where that
//! stack stands (a negated class refuses a partial sequence that might
//! complete to a code point it excludes); invalid UTF-8, an empty piece and
//! one starting with a NUL byte are never allowed; an end-of-generation token
//! is allowed exactly when the grammar may end there. One deliberate
//! difference: llama.cpp does not check the bytes inside a UTF-8 sequence, so
//! a piece like `F0 41 42 43` passes as one code point there; here it is
//! invalid, and the text a grammar allows is always UTF-8. Unlike llama.cpp, which
//! can abort or run without bound on some grammars, every operation here is
//! bounded ([`MAX_STACKS`], [`MAX_DEPTH`], [`MAX_EXPANSIONS`]) and reports an
//! error instead.

mod json_schema;
mod matcher;
mod parse;
mod pattern;

pub use json_schema::{json_schema_to_gbnf, literal, Json};
pub use matcher::{Matcher, TokenGrammar};

use std::fmt;

/// Most repetitions one `{m,n}` may ask for (llama.cpp's
/// `MAX_REPETITION_THRESHOLD`).
pub const MAX_REPETITION: u32 = 2000;
/// Most symbols a grammar may hold once its repetitions are written out.
pub const MAX_SYMBOLS: usize = 1 << 20;
/// Most rules (named and generated).
pub const MAX_RULES: usize = 1 << 16;
/// Deepest nesting of parentheses.
pub const MAX_NESTING: usize = 256;
/// Most parse stacks a matcher keeps at once (an ambiguous grammar can need
/// more than any text of practical length does).
pub const MAX_STACKS: usize = 4096;
/// Deepest stack (nested, non-tail rule references).
pub const MAX_DEPTH: usize = 8192;
/// Most stack expansions one step of the matcher may make.
pub const MAX_EXPANSIONS: usize = 1 << 16;

/// A grammar that could not be read, or a matcher that cannot go on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrammarError(pub String);

impl fmt::Display for GrammarError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GrammarError {}

/// One symbol of a rule's alternative.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sym {
    /// The end of an alternative.
    End,
    /// A reference to a rule (an index into [`Grammar::alts`]).
    Rule(u32),
    /// One code point of a set (an index into [`Grammar::sets`]).
    Chars(u32),
}

/// A set of code points: inclusive ranges, or everything outside them.
#[derive(Clone, Debug, PartialEq, Eq)]
struct CharSet {
    negated: bool,
    ranges: Vec<(u32, u32)>,
}

impl CharSet {
    /// Whether code point `c` is in the set.
    fn matches(&self, c: u32) -> bool {
        self.ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != self.negated
    }

    /// Whether an unfinished UTF-8 sequence, which may complete to any code
    /// point in `lo..=hi`, may match: for a plain set, some range meets that
    /// span; a negated set only when none does (llama.cpp's rule).
    fn may_match(&self, lo: u32, hi: u32) -> bool {
        self.ranges.iter().any(|&(a, b)| a <= hi && lo <= b) != self.negated
    }
}

/// A parsed grammar: every rule's alternatives, flattened.
#[derive(Clone, Debug)]
pub struct Grammar {
    /// Every alternative's symbols, each alternative followed by [`Sym::End`].
    syms: Vec<Sym>,
    /// For each rule, where each of its alternatives starts in `syms`.
    alts: Vec<Vec<u32>>,
    /// The code point sets [`Sym::Chars`] name.
    sets: Vec<CharSet>,
    /// The start rule.
    root: u32,
}

impl Grammar {
    /// Reads GBNF text whose start rule is `root`.
    pub fn parse(text: &str) -> Result<Grammar, GrammarError> {
        parse::parse(text)
    }
}

#[cfg(test)]
mod tests;
