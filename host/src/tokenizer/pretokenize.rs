//! Pre-tokenizers: how byte-level BPE cuts text into words before merging.
//!
//! llama.cpp picks a list of regexes by `tokenizer.ggml.pre` and applies them one
//! after the other: each regex cuts every piece made so far into its matches and
//! the unmatched stretches between them. The regexes used here are hand-written
//! scanners with the same leftmost-first semantics as llama.cpp (its own custom
//! scanners for the GPT-2 and llama-3 patterns, `std::regex` over category-collapsed
//! text for the rest).

use super::unicode::{flags, LETTER, MARK, NUMBER, PUNCT, SPACE, SYMBOL};

/// A pre-tokenizer as llama.cpp selects it from `tokenizer.ggml.pre`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PreTokenizer {
    /// llama.cpp's fallback when `tokenizer.ggml.pre` is absent or `default`:
    /// punctuation runs, then the GPT-2 pattern, then `\p{N}+`, then `[0-9][0-9][0-9]`.
    Default,
    /// The GPT-2 pattern
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    /// (`gpt-2`, `phi-2`, `mpt`, `olmo`, `jais`, ...).
    Gpt2,
    /// Every `\p{N}` alone, then the GPT-2 pattern (`smollm`, `starcoder`, `refact`,
    /// `command-r`, ...).
    Smollm,
    /// The llama-3 pattern
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// (`llama-bpe`, `llama3`, `dbrx`, `smaug-bpe`, `glm4`, ...).
    Llama3,
    /// As [`PreTokenizer::Llama3`] but with single digits (`\p{N}` for `\p{N}{1,3}`)
    /// (`qwen2`, `deepseek-r1-qwen`, `stablelm2`, `megrez`, `hunyuan`,
    /// `bailingmoe2`, ...).
    Qwen2,
    /// As [`PreTokenizer::Qwen2`] with marks joining letters: `[\p{L}\p{M}]+` for
    /// `\p{L}+`, and `\p{M}` kept out of the punctuation class (`qwen35`).
    Qwen35,
    /// The o200k pattern of GPT-4o and gpt-oss (`gpt-4o`, `minimax-m2`,
    /// `llama4`, `kanana2`, `talkie`), as
    /// llama.cpp rewrites it for `std::regex`: words are an optional
    /// `[^\r\n\p{L}\p{N}]`, then "upper" letters (any but `a-z`) and "lower"
    /// ones (any but `A-Z`) as `U*L+` or else `U+L*`, then an optional
    /// case-insensitive contraction; `\p{N}{1,3}`;
    /// ` ?[^\s\p{L}\p{N}]+[\r\n/]*`; then whitespace as llama-3's. (The
    /// original's `\p{Lu}`/`\p{Ll}` classes and marks are llama.cpp's to
    /// approximate; this follows llama.cpp.)
    Gpt4o,
    /// DeepSeek-V3's (`deepseek-v3`), three regexes in turn: `\p{N}{1,3}`;
    /// runs of CJK ideographs, hiragana and katakana (`[一-龥぀-ゟ゠-ヿ]+`);
    /// then an ASCII punctuation mark with the ASCII letters after it,
    /// `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`, ` ?[\p{P}\p{S}]+[\r\n]*`,
    /// then whitespace as llama-3's.
    Deepseek3,
    /// DeepSeek-V2's (`deepseek-llm`), six regexes in turn: each `[\r\n]`;
    /// `\s?` then a run of the letters of its list (Latin, Greek, Cyrillic,
    /// Armenian, Georgian, ...); `\s?` then a run of ASCII and full-width
    /// punctuation and quotes; trailing whitespace; runs of CJK and Hangul;
    /// `\p{N}+`. Its ranges are literal characters, which llama.cpp matches
    /// after turning non-ASCII whitespace into `\v` (so that `\s` sees it).
    DeepseekLlm,
    /// Kimi K2's (`kimi-k2`), as llama.cpp's own scanner for it runs (its
    /// `tokenization_kimi.py` pattern with Han excluded from words): runs of
    /// Han; an optional `[^\r\n\p{L}\p{N}]` then non-Han letters and an
    /// optional case-insensitive contraction; `\p{N}{1,3}`;
    /// ` ?[^\s\p{L}\p{N}]+[\r\n]*`; then whitespace as llama-3's.
    KimiK2,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` value, if it is
    /// one this crate supports.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "default" => Self::Default,
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais"
            | "trillion" | "granite-docling" | "exaone4" => Self::Gpt2,
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone"
            | "minerva-7b" | "mellum2" => Self::Smollm,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" | "glm4" | "glm5"
            | "chatglm-bpe" => Self::Llama3,
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2"
            | "hunyuan" | "solar-open" => Self::Qwen2,
            // llama.cpp's BAILINGMOE pattern is qwen2's with its contractions
            // spelled per letter and `\s*[\r\n]` for `\s*[\r\n]+`: the same
            // splits (greedy `\s*` backs off to the last newline either way).
            "bailingmoe" | "bailingmoe2" | "llada-moe" => Self::Qwen2,
            "qwen35" => Self::Qwen35,
            // llama.cpp maps these names to its GPT4O pattern.
            "gpt-4o" | "minimax-m2" | "llama4" | "kanana2" | "talkie" => Self::Gpt4o,
            "deepseek-v3" => Self::Deepseek3,
            "deepseek-llm" => Self::DeepseekLlm,
            "kimi-k2" => Self::KimiK2,
            _ => return None,
        })
    }

    fn stages(self) -> &'static [Stage] {
        const LLAMA3: Stage = Stage::Llama {
            max_digits: 3,
            word: LETTER,
        };
        const QWEN2: Stage = Stage::Llama {
            max_digits: 1,
            word: LETTER,
        };
        const QWEN35: Stage = Stage::Llama {
            max_digits: 1,
            word: LETTER | MARK,
        };
        match self {
            Self::Default => &[
                Stage::PunctRuns,
                Stage::Gpt2,
                Stage::NumberRuns,
                Stage::AsciiDigitTriples,
            ],
            Self::Gpt2 => &[Stage::Gpt2],
            Self::Smollm => &[Stage::EachNumber, Stage::Gpt2],
            Self::Llama3 => &[LLAMA3],
            Self::Qwen2 => &[QWEN2],
            Self::Qwen35 => &[QWEN35],
            Self::Gpt4o => &[Stage::O200k],
            Self::Deepseek3 => &[Stage::NumberTriples, Stage::CjkKana, Stage::Deepseek3],
            Self::KimiK2 => &[Stage::KimiK2],
            Self::DeepseekLlm => &[
                Stage::EachNewline,
                Stage::DsLetters,
                Stage::DsPunct,
                Stage::TrailingSpace,
                Stage::CjkHangul,
                Stage::NumberRuns,
            ],
        }
    }

    /// Cuts `text` into the words BPE merges within; the pieces cover `text` in order.
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        self.split_into(text, &mut out);
        out
    }

    pub(crate) fn split_into<'t>(&self, text: &'t str, out: &mut Vec<&'t str>) {
        out.clear();
        if text.is_empty() {
            return;
        }
        let cps: Vec<Cp> = text
            .char_indices()
            .map(|(off, c)| Cp {
                c,
                f: flags(c),
                off,
            })
            .collect();
        let mut ranges = vec![(0, cps.len())];
        let mut next = Vec::new();
        for stage in self.stages() {
            next.clear();
            for &(s, e) in &ranges {
                stage.run(&cps[s..e], s, &mut next);
            }
            std::mem::swap(&mut ranges, &mut next);
        }
        let byte_at = |i: usize| cps.get(i).map_or(text.len(), |cp| cp.off);
        out.extend(ranges.iter().map(|&(s, e)| &text[byte_at(s)..byte_at(e)]));
    }
}

/// One character with its class bits and byte offset.
#[derive(Clone, Copy)]
struct Cp {
    c: char,
    f: u8,
    off: usize,
}

/// One regex of a pre-tokenizer's list.
#[derive(Clone, Copy)]
enum Stage {
    /// `[\p{P}\$\+<=>\^~\|]+`
    PunctRuns,
    /// `\p{N}+`
    NumberRuns,
    /// `\p{N}`
    EachNumber,
    /// `[0-9][0-9][0-9]`
    AsciiDigitTriples,
    /// The GPT-2 pattern.
    Gpt2,
    /// The llama-3 family: digits per group and the letter class vary.
    Llama { max_digits: usize, word: u8 },
    /// The o200k pattern ([`PreTokenizer::Gpt4o`]).
    O200k,
    /// `\p{N}{1,3}`
    NumberTriples,
    /// `[一-龥぀-ゟ゠-ヿ]+`
    CjkKana,
    /// DeepSeek-V3's last regex ([`PreTokenizer::Deepseek3`]).
    Deepseek3,
    /// `[\r\n]`
    EachNewline,
    /// `\s?[<DEEPSEEK_LLM_LETTERS>]+`
    DsLetters,
    /// `\s?[!-/:-~！-／：-～‘-‟　-。]+`
    DsPunct,
    /// `\s+$`
    TrailingSpace,
    /// `[一-龥ࠀ-一가-퟿]+`
    CjkHangul,
    /// Kimi K2's scanner ([`PreTokenizer::KimiK2`]).
    KimiK2,
}

impl Stage {
    /// Cuts `cps` (which starts at index `base` of the whole text) and appends the
    /// pieces as index ranges.
    fn run(self, cps: &[Cp], base: usize, out: &mut Vec<(usize, usize)>) {
        match self {
            Self::PunctRuns => match_split(cps, base, out, |cps, i| {
                run_len(&cps[i..], |cp| {
                    if cp.c.is_ascii() {
                        cp.f & PUNCT != 0
                            || matches!(cp.c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|')
                    } else {
                        cp.f & (PUNCT | SPACE) == PUNCT
                    }
                })
            }),
            Self::NumberRuns => match_split(cps, base, out, |cps, i| {
                run_len(&cps[i..], |cp| cp.f & NUMBER != 0)
            }),
            Self::EachNumber => {
                match_split(cps, base, out, |cps, i| usize::from(cps[i].f & NUMBER != 0))
            }
            Self::AsciiDigitTriples => match_split(cps, base, out, |cps, i| {
                let three = cps.get(i..i + 3);
                if three.is_some_and(|t| t.iter().all(|cp| cp.c.is_ascii_digit())) {
                    3
                } else {
                    0
                }
            }),
            Self::Gpt2 => gpt2(cps, base, out),
            Self::Llama { max_digits, word } => llama(cps, base, out, max_digits, word),
            Self::O200k => o200k(cps, base, out),
            Self::KimiK2 => kimi_k2(cps, base, out),
            Self::NumberTriples => match_split(cps, base, out, |cps, i| {
                run_len(&cps[i..], |cp| cp.f & NUMBER != 0).min(3)
            }),
            Self::CjkKana => match_split(cps, base, out, |cps, i| {
                run_len(
                    &cps[i..],
                    |cp| matches!(cp.c, '\u{4e00}'..='\u{9fa5}' | '\u{3040}'..='\u{309f}' | '\u{30a0}'..='\u{30ff}'),
                )
            }),
            Self::Deepseek3 => match_split(cps, base, out, deepseek3_match),
            Self::EachNewline => match_split(cps, base, out, |cps, i| {
                usize::from(matches!(cps[i].c, '\r' | '\n'))
            }),
            Self::DsLetters => match_split(cps, base, out, |cps, i| {
                space_then_run(cps, i, |c| in_ranges(c, DEEPSEEK_LLM_LETTERS))
            }),
            Self::DsPunct => match_split(cps, base, out, |cps, i| {
                space_then_run(cps, i, |c| {
                    matches!(c, '!'..='/' | ':'..='~' | '\u{ff01}'..='\u{ff0f}'
                        | '\u{ff1a}'..='\u{ff5e}' | '\u{2018}'..='\u{201f}' | '\u{3000}'..='\u{3002}')
                })
            }),
            Self::TrailingSpace => match_split(cps, base, out, |cps, i| {
                let rest = &cps[i..];
                if rest.iter().all(|cp| cp.f & SPACE != 0) {
                    rest.len()
                } else {
                    0
                }
            }),
            Self::CjkHangul => match_split(cps, base, out, |cps, i| {
                run_len(&cps[i..], |cp| {
                    literal(cp) && matches!(cp.c, '\u{800}'..='\u{9fa5}' | '\u{ac00}'..='\u{d7ff}')
                })
            }),
        }
    }
}

/// Length of the run at the start of `cps` whose characters satisfy `pred`.
fn run_len(cps: &[Cp], pred: impl Fn(&Cp) -> bool) -> usize {
    cps.iter().take_while(|cp| pred(cp)).count()
}

/// Regex-iterator semantics: find leftmost matches (`matcher` gives the match length
/// at a position, 0 for none) and keep the unmatched stretches as pieces too.
fn match_split(
    cps: &[Cp],
    base: usize,
    out: &mut Vec<(usize, usize)>,
    matcher: impl Fn(&[Cp], usize) -> usize,
) {
    let mut gap = 0;
    let mut i = 0;
    while i < cps.len() {
        let m = matcher(cps, i);
        if m == 0 {
            i += 1;
            continue;
        }
        if gap < i {
            out.push((base + gap, base + i));
        }
        out.push((base + i, base + i + m));
        i += m;
        gap = i;
    }
    if gap < cps.len() {
        out.push((base + gap, base + cps.len()));
    }
}

/// Length of the contraction `'s 't 'm 'd` (2) or `'re 've 'll` (3) at `pos`, or 0.
fn contraction(cps: &[Cp], pos: usize, fold_case: bool) -> usize {
    let at = |i: usize| {
        cps.get(i).map(|cp| {
            if fold_case {
                cp.c.to_ascii_lowercase()
            } else {
                cp.c
            }
        })
    };
    if cps[pos].c != '\'' {
        return 0;
    }
    match (at(pos + 1), at(pos + 2)) {
        (Some('s' | 't' | 'm' | 'd'), _) => 2,
        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => 3,
        _ => 0,
    }
}

/// Whitespace handling shared by both families: `\s+(?!\S)` then `\s+`; the llama
/// family first tries `\s*[\r\n]+`. Returns the end of the piece at `pos`.
fn whitespace_end(cps: &[Cp], pos: usize, newline_first: bool) -> usize {
    let n = cps.len();
    let mut k = 0;
    let mut last_newline = None;
    while pos + k < n && cps[pos + k].f & SPACE != 0 {
        if matches!(cps[pos + k].c, '\r' | '\n') {
            last_newline = Some(pos + k + 1);
        }
        k += 1;
    }
    match last_newline {
        Some(end) if newline_first => end,
        _ if k > 1 && pos + k < n => pos + k - 1,
        _ if k > 0 => pos + k,
        _ => pos + 1,
    }
}

/// DeepSeek-V2's letters (`deepseek-llm`'s second regex), as llama.cpp lists them.
const DEEPSEEK_LLM_LETTERS: &[(char, char)] = &[
    ('\u{41}', '\u{5a}'),
    ('\u{61}', '\u{7a}'),
    ('\u{b5}', '\u{b5}'),
    ('\u{c0}', '\u{d6}'),
    ('\u{d8}', '\u{f6}'),
    ('\u{f8}', '\u{1ba}'),
    ('\u{1bc}', '\u{1bf}'),
    ('\u{1c4}', '\u{293}'),
    ('\u{295}', '\u{2af}'),
    ('\u{370}', '\u{373}'),
    ('\u{376}', '\u{376}'),
    ('\u{377}', '\u{377}'),
    ('\u{37b}', '\u{37d}'),
    ('\u{37f}', '\u{37f}'),
    ('\u{386}', '\u{386}'),
    ('\u{388}', '\u{38a}'),
    ('\u{38c}', '\u{38c}'),
    ('\u{38e}', '\u{3a1}'),
    ('\u{3a3}', '\u{3f5}'),
    ('\u{3f7}', '\u{481}'),
    ('\u{48a}', '\u{52f}'),
    ('\u{531}', '\u{556}'),
    ('\u{10a0}', '\u{10c5}'),
    ('\u{13a0}', '\u{13f5}'),
    ('\u{13f8}', '\u{13fd}'),
    ('\u{1c90}', '\u{1cba}'),
    ('\u{1cbd}', '\u{1cbf}'),
    ('\u{1d00}', '\u{1d2b}'),
    ('\u{1d6b}', '\u{1d77}'),
    ('\u{1d79}', '\u{1d9a}'),
    ('\u{1e00}', '\u{1f15}'),
    ('\u{1f18}', '\u{1f1d}'),
    ('\u{1f20}', '\u{1f45}'),
    ('\u{1f48}', '\u{1f4d}'),
    ('\u{1f50}', '\u{1f57}'),
    ('\u{1f59}', '\u{1f59}'),
    ('\u{1f5b}', '\u{1f5b}'),
    ('\u{1f5d}', '\u{1f5d}'),
    ('\u{1f5f}', '\u{1f7d}'),
    ('\u{1f80}', '\u{1fb4}'),
    ('\u{1fb6}', '\u{1fbc}'),
    ('\u{1fbe}', '\u{1fbe}'),
    ('\u{1fc2}', '\u{1fc4}'),
    ('\u{1fc6}', '\u{1fcc}'),
    ('\u{1fd0}', '\u{1fd3}'),
    ('\u{1fd6}', '\u{1fdb}'),
    ('\u{1fe0}', '\u{1fec}'),
    ('\u{1ff2}', '\u{1ff4}'),
    ('\u{1ff6}', '\u{1ffc}'),
    ('\u{2102}', '\u{2102}'),
    ('\u{2107}', '\u{2107}'),
    ('\u{210a}', '\u{2113}'),
    ('\u{2115}', '\u{2115}'),
    ('\u{2119}', '\u{211d}'),
    ('\u{2124}', '\u{2124}'),
    ('\u{2126}', '\u{2126}'),
    ('\u{2128}', '\u{2128}'),
    ('\u{212a}', '\u{212d}'),
    ('\u{212f}', '\u{2134}'),
    ('\u{2139}', '\u{2139}'),
    ('\u{213c}', '\u{213f}'),
    ('\u{2145}', '\u{2149}'),
    ('\u{214e}', '\u{214e}'),
    ('\u{2183}', '\u{2183}'),
    ('\u{2184}', '\u{2184}'),
    ('\u{2c00}', '\u{2c7b}'),
    ('\u{2c7e}', '\u{2ce4}'),
    ('\u{2ceb}', '\u{2cee}'),
    ('\u{2cf2}', '\u{2cf2}'),
    ('\u{2cf3}', '\u{2cf3}'),
    ('\u{a640}', '\u{a66d}'),
    ('\u{a680}', '\u{a69b}'),
    ('\u{a722}', '\u{a76f}'),
    ('\u{a771}', '\u{a787}'),
    ('\u{a78b}', '\u{a78e}'),
    ('\u{ab70}', '\u{abbf}'),
    ('\u{fb00}', '\u{fb06}'),
    ('\u{fb13}', '\u{fb17}'),
    ('\u{ff21}', '\u{ff3a}'),
    ('\u{ff41}', '\u{ff5a}'),
    ('\u{10400}', '\u{1044f}'),
    ('\u{104b0}', '\u{104d3}'),
    ('\u{104d8}', '\u{104fb}'),
    ('\u{10c80}', '\u{10cb2}'),
    ('\u{10cc0}', '\u{10cf2}'),
    ('\u{118a0}', '\u{118df}'),
    ('\u{1e900}', '\u{1e943}'),
];

fn in_ranges(c: char, ranges: &[(char, char)]) -> bool {
    ranges.iter().any(|&(a, b)| (a..=b).contains(&c))
}

/// Whether a literal character class of llama.cpp's can match `cp`: it turns
/// non-ASCII whitespace into `\v` before matching literal ranges.
fn literal(cp: &Cp) -> bool {
    cp.c.is_ascii() || cp.f & SPACE == 0
}

/// `\s?[class]+` at `i`: an optional whitespace character, then a run of the
/// class (matched as llama.cpp does, [`literal`]).
fn space_then_run(cps: &[Cp], i: usize, class: impl Fn(char) -> bool) -> usize {
    let in_class = |cp: &Cp| literal(cp) && class(cp.c);
    if cps[i].f & SPACE != 0 {
        let n = run_len(&cps[i + 1..], in_class);
        if n > 0 {
            return 1 + n;
        }
    }
    run_len(&cps[i..], in_class)
}

/// The length of DeepSeek-V3's last regex's match at `i` (0 for none):
/// `[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+`, then
/// `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`, then ` ?[\p{P}\p{S}]+[\r\n]*`,
/// then `\s*[\r\n]+|\s+(?!\S)|\s+`, the first alternative that matches.
fn deepseek3_match(cps: &[Cp], i: usize) -> usize {
    let cp = cps[i];
    let ascii_letters = |from: usize| run_len(&cps[from..], |cp| cp.c.is_ascii_alphabetic());
    if cp.c.is_ascii_punctuation() {
        let n = ascii_letters(i + 1);
        if n > 0 {
            return 1 + n;
        }
    }
    let word = |from: usize| run_len(&cps[from..], |cp| cp.f & (LETTER | MARK) != 0);
    let lead = !matches!(cp.c, '\r' | '\n') && cp.f & (LETTER | PUNCT | SYMBOL) == 0;
    if lead && i + 1 < cps.len() {
        let n = word(i + 1);
        if n > 0 {
            return 1 + n;
        }
    }
    let n = word(i);
    if n > 0 {
        return n;
    }
    let space = usize::from(cp.c == ' ');
    let n = run_len(&cps[i + space..], |cp| cp.f & (PUNCT | SYMBOL) != 0);
    if n > 0 {
        let from = i + space + n;
        return space + n + run_len(&cps[from..], |cp| matches!(cp.c, '\r' | '\n'));
    }
    if cp.f & SPACE != 0 {
        return whitespace_end(cps, i, true) - i;
    }
    0
}

/// The GPT-2 pattern, as llama.cpp's `unicode_regex_split_custom_gpt2`.
fn gpt2(cps: &[Cp], base: usize, out: &mut Vec<(usize, usize)>) {
    let n = cps.len();
    let mut pos = 0;
    while pos < n {
        let start = pos;
        let c = cps[pos].c;
        let contr = contraction(cps, pos, false);
        if contr > 0 {
            pos += contr;
        } else {
            let lead = usize::from(c == ' ');
            // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
            let class = cps.get(pos + lead).and_then(|cp| {
                if cp.f & LETTER != 0 {
                    Some(LETTER)
                } else if cp.f & NUMBER != 0 {
                    Some(NUMBER)
                } else if cp.f & SPACE == 0 {
                    Some(0)
                } else {
                    None
                }
            });
            pos = match class {
                Some(0) => {
                    let from = pos + lead;
                    from + run_len(&cps[from..], |cp| cp.f & (SPACE | LETTER | NUMBER) == 0)
                }
                Some(class) => {
                    let from = pos + lead;
                    from + run_len(&cps[from..], |cp| cp.f & class != 0)
                }
                None => whitespace_end(cps, pos, false),
            };
        }
        out.push((base + start, base + pos));
    }
}

/// The llama-3 pattern family, as llama.cpp's `unicode_regex_split_custom_llama3`;
/// `max_digits` is the `\p{N}` group size and `word` the letter class.
fn llama(cps: &[Cp], base: usize, out: &mut Vec<(usize, usize)>, max_digits: usize, word: u8) {
    let n = cps.len();
    let is_word = |i: usize| cps.get(i).is_some_and(|cp| cp.f & word != 0);
    // `[^\s<word>\p{N}]`
    let is_other = |i: usize| {
        cps.get(i)
            .is_some_and(|cp| cp.f & (SPACE | word | NUMBER) == 0)
    };
    let mut pos = 0;
    while pos < n {
        let start = pos;
        let Cp { c, f, .. } = cps[pos];
        let contr = contraction(cps, pos, true);
        if contr > 0 {
            // `(?i:'s|'t|'re|'ve|'m|'ll|'d)`
            pos += contr;
        } else if f & word != 0
            || (c != '\r' && c != '\n' && f & (LETTER | NUMBER) == 0 && is_word(pos + 1))
        {
            // `[^\r\n\p{L}\p{N}]?<word>+`
            pos += 1;
            while is_word(pos) {
                pos += 1;
            }
        } else if f & NUMBER != 0 {
            // `\p{N}{1,max_digits}`
            pos = digits_end(cps, pos, max_digits);
        } else if is_other(pos + usize::from(c == ' ')) {
            // ` ?[^\s<word>\p{N}]+[\r\n]*`
            pos = symbols_end(cps, pos, SPACE | word | NUMBER);
        } else {
            pos = whitespace_end(cps, pos, true);
        }
        out.push((base + start, base + pos));
    }
}

/// Where `\p{N}{1,max}` that starts at `pos` ends.
fn digits_end(cps: &[Cp], pos: usize, max: usize) -> usize {
    pos + run_len(&cps[pos..], |cp| cp.f & NUMBER != 0).min(max)
}

/// Where ` ?[^...]+[\r\n]*` that starts at `pos` ends, the run's class being
/// the code points with none of the `not` flags (the caller checked that
/// one follows the optional space).
fn symbols_end(cps: &[Cp], pos: usize, not: u8) -> usize {
    let from = pos + usize::from(cps[pos].c == ' ');
    let end = from + run_len(&cps[from..], |cp| cp.f & not == 0);
    end + run_len(&cps[end..], |cp| matches!(cp.c, '\r' | '\n'))
}

/// Whether `c` is Han, by llama.cpp's ranges (`unicode_cpt_is_han`): the
/// CJK Unified Ideographs, extensions A to F and the compatibility ones.
fn is_han(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF
        | 0x3400..=0x4DBF
        | 0x20000..=0x2A6DF
        | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F
        | 0x2B820..=0x2CEAF
        | 0x2CEB0..=0x2EBEF
        | 0xF900..=0xFAFF
        | 0x2F800..=0x2FA1F)
}

/// Kimi K2's pattern as llama.cpp's scanner for it runs it
/// ([`PreTokenizer::KimiK2`]), step for step.
fn kimi_k2(cps: &[Cp], base: usize, out: &mut Vec<(usize, usize)>) {
    let n = cps.len();
    let word = |i: usize| {
        cps.get(i)
            .is_some_and(|cp| cp.f & LETTER != 0 && !is_han(cp.c))
    };
    let lower = |i: usize| {
        cps.get(i).map(|cp| {
            let mut l = cp.c.to_lowercase();
            match (l.next(), l.next()) {
                (Some(x), None) => x,
                _ => cp.c,
            }
        })
    };
    let mut pos = 0;
    while pos < n {
        let start = pos;
        let Cp { c, f, .. } = cps[pos];
        let lead = c != '\r' && c != '\n' && f & (LETTER | NUMBER) == 0;
        if is_han(c) {
            // `[\p{Han}]+`
            while pos < n && is_han(cps[pos].c) {
                pos += 1;
            }
        } else if word(pos) || (lead && word(pos + 1)) {
            // `[^\r\n\p{L}\p{N}]?` non-Han letters, then `(?i:'s|'t|'re|'ve|'m|'ll|'d)?`
            pos += usize::from(lead);
            while word(pos) {
                pos += 1;
            }
            if cps[pos..].first().is_some_and(|cp| cp.c == '\'') && pos + 1 < n {
                match (lower(pos + 1), lower(pos + 2)) {
                    (Some('s' | 't' | 'm' | 'd'), _) => pos += 2,
                    (Some('r' | 'v'), Some('e')) | (Some('l'), Some('l')) => pos += 3,
                    _ => {}
                }
            }
        } else if f & NUMBER != 0 {
            // `\p{N}{1,3}`
            pos = digits_end(cps, pos, 3);
        } else if cps
            .get(pos + usize::from(c == ' '))
            .is_some_and(|cp| cp.f & (SPACE | LETTER | NUMBER) == 0)
        {
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
            pos = symbols_end(cps, pos, SPACE | LETTER | NUMBER);
        } else {
            pos = whitespace_end(cps, pos, true);
        }
        out.push((base + start, base + pos));
    }
}

/// The o200k pattern as llama.cpp runs it ([`PreTokenizer::Gpt4o`]), with
/// `std::regex`'s ordered alternation and backtracking worked out: at each
/// position the first alternative that matches, each quantifier greedy.
fn o200k(cps: &[Cp], base: usize, out: &mut Vec<(usize, usize)>) {
    let n = cps.len();
    let letter = |i: usize| cps.get(i).is_some_and(|cp| cp.f & LETTER != 0);
    // "Upper": a letter but `a-z`; "lower": a letter but `A-Z`.
    let upper = |i: usize| letter(i) && !cps[i].c.is_ascii_lowercase();
    let lower = |i: usize| letter(i) && !cps[i].c.is_ascii_uppercase();
    // `[^\r\n\p{L}\p{N}]`
    let lead = |i: usize| {
        cps.get(i)
            .is_some_and(|cp| cp.c != '\r' && cp.c != '\n' && cp.f & (LETTER | NUMBER) == 0)
    };
    let run = |from: usize, pred: &dyn Fn(usize) -> bool| {
        let mut i = from;
        while i < n && pred(i) {
            i += 1;
        }
        i
    };
    // `U*L+` then `U+L*` from `s`, each with its optional contraction: the end.
    let word_at = |s: usize| -> Option<usize> {
        let ups = run(s, &upper);
        // `U*` gives back letters until `L+` can start.
        let first = (s..=ups).rev().find(|&i| lower(i));
        let end = match first {
            Some(i) => run(i, &lower),
            None if ups > s => run(ups, &lower),
            None => return None,
        };
        Some(end + contraction_at(cps, end))
    };
    let mut pos = 0;
    while pos < n {
        let start = pos;
        // `P? word`: with the lead character if that matches, else without.
        let word = if lead(pos) {
            word_at(pos + 1).or_else(|| word_at(pos))
        } else {
            word_at(pos)
        };
        let other = |i: usize| cps[i].f & (SPACE | LETTER | NUMBER) == 0;
        let after_space = pos + usize::from(cps[pos].c == ' ');
        pos = if let Some(end) = word {
            end
        } else if cps[pos].f & NUMBER != 0 {
            // `\p{N}{1,3}`
            run(pos, &|i| i < start + 3 && cps[i].f & NUMBER != 0)
        } else if after_space < n && other(after_space) {
            // ` ?[^\s\p{L}\p{N}]+[\r\n/]*`
            let e = run(after_space, &other);
            run(e, &|i| matches!(cps[i].c, '\r' | '\n' | '/'))
        } else {
            whitespace_end(cps, pos, true)
        };
        out.push((base + start, base + pos));
    }
}

/// The length of `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])` at
/// `pos` (0 where none matches or `pos` is past the end).
fn contraction_at(cps: &[Cp], pos: usize) -> usize {
    if pos < cps.len() {
        contraction(cps, pos, true)
    } else {
        0
    }
}
