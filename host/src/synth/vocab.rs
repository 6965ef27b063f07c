//! A small, real-looking byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`,
//! `tokenizer.ggml.pre = qwen2`), trained deterministically on an embedded English
//! sample so that every merge is valid: both halves and the result are tokens.
//!
//! Layout: the 256 byte tokens in GPT-2's byte-to-unicode order (`!` is 0, as in
//! Qwen's vocabulary), then the merged tokens in merge order, then the control tokens
//! `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (type 3), then the image markers of
//! [`MEDIA_TOKENS`] (type 4, when the vocabulary has room for them besides the
//! bytes and control tokens), then `<|extra_N|>` user-defined tokens (type 4) up to
//! the requested size.

use std::collections::{BTreeMap, HashMap};

use crate::gguf::MetaValue;

/// The English sample the merges are learnt from (also `les bench
/// --prefill-batches`'s prompt).
pub const SAMPLE: &str = include_str!("sample.txt");

/// The ChatML template Qwen models use.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The control tokens, in id order.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The tokens multimodal prompts wrap image embeddings in: MiniCPM-V's
/// `<image>` / `<slice>` pairs and Gemma 3's `<start_of_image>` / `<end_of_image>`
/// (user-defined tokens, as in those models' vocabularies).
pub const MEDIA_TOKENS: [&str; 6] = [
    "<image>",
    "</image>",
    "<slice>",
    "</slice>",
    "<start_of_image>",
    "<end_of_image>",
];

/// The tokens Qwen-VL models (Qwen3-VL) wrap an image's embeddings in,
/// added after [`MEDIA_TOKENS`] to those models' vocabularies only (the
/// others' tokens stay as they were).
pub const QWEN_VL_TOKENS: [&str; 2] = ["<|vision_start|>", "<|vision_end|>"];

/// The tokens Kimi-VL (`<|media_start|>`) and Kimi K2.5 (`<|media_begin|>`)
/// wrap an image's embeddings in, added after [`MEDIA_TOKENS`] to the
/// vocabularies of their language models' architecture (`deepseek2`) only.
pub const KIMI_VL_TOKENS: [&str; 3] = ["<|media_start|>", "<|media_begin|>", "<|media_end|>"];

/// The tokens Llama 4 wraps an image's tiles and overview in, added after
/// [`MEDIA_TOKENS`] to `llama4` vocabularies only.
pub const LLAMA4_TOKENS: [&str; 2] = ["<|image_start|>", "<|image_end|>"];

/// The tokens GLM-4.xV wraps an image's embeddings in, added after
/// [`MEDIA_TOKENS`] to `glm4moe` vocabularies only.
pub const GLM_V_TOKENS: [&str; 2] = ["<|begin_of_image|>", "<|end_of_image|>"];

/// The tokens InternVL wraps an image's tiles and overview in, added after
/// [`MEDIA_TOKENS`] where a synthetic model is written with an `internvl`
/// projector.
pub const INTERNVL_TOKENS: [&str; 2] = ["<img>", "</img>"];

/// The tokens LFM2-VL lays an image out with, added after [`MEDIA_TOKENS`]
/// where a synthetic model is written with an `lfm2` projector: the start
/// and end, the thumbnail's marker and each tile's `<|img_row_R_col_C|>` (of
/// grids up to 10 tiles).
pub const LFM2_VL_TOKENS: [&str; 30] = [
    "<|image_start|>",
    "<|image_end|>",
    "<|img_thumbnail|>",
    "<|img_row_1_col_1|>",
    "<|img_row_1_col_2|>",
    "<|img_row_1_col_3|>",
    "<|img_row_1_col_4|>",
    "<|img_row_1_col_5|>",
    "<|img_row_1_col_6|>",
    "<|img_row_1_col_7|>",
    "<|img_row_1_col_8|>",
    "<|img_row_1_col_9|>",
    "<|img_row_1_col_10|>",
    "<|img_row_2_col_1|>",
    "<|img_row_2_col_2|>",
    "<|img_row_2_col_3|>",
    "<|img_row_2_col_4|>",
    "<|img_row_2_col_5|>",
    "<|img_row_3_col_1|>",
    "<|img_row_3_col_2|>",
    "<|img_row_3_col_3|>",
    "<|img_row_4_col_1|>",
    "<|img_row_4_col_2|>",
    "<|img_row_5_col_1|>",
    "<|img_row_5_col_2|>",
    "<|img_row_6_col_1|>",
    "<|img_row_7_col_1|>",
    "<|img_row_8_col_1|>",
    "<|img_row_9_col_1|>",
    "<|img_row_10_col_1|>",
];

/// `tokenizer.ggml.token_type` of ordinary tokens.
pub const TYPE_NORMAL: i32 = 1;
/// `tokenizer.ggml.token_type` of control tokens.
pub const TYPE_CONTROL: i32 = 3;
/// `tokenizer.ggml.token_type` of user-defined tokens.
pub const TYPE_USER_DEFINED: i32 = 4;

/// The smallest vocabulary: the byte tokens and the control tokens.
pub const MIN_VOCAB: usize = 256 + SPECIAL_TOKENS.len();

/// A generated vocabulary.
#[derive(Clone, Debug)]
pub struct Vocab {
    /// Token texts, by id.
    pub tokens: Vec<String>,
    /// Token types, by id.
    pub token_types: Vec<i32>,
    /// Merges in rank order, each `"left right"`.
    pub merges: Vec<String>,
    /// Id of `<|endoftext|>` (also BOS and padding).
    pub endoftext: u32,
    /// Id of `<|im_start|>`.
    pub im_start: u32,
    /// Id of `<|im_end|>` (EOS).
    pub im_end: u32,
}

/// GPT-2's byte-to-unicode table: printable bytes map to themselves, the others to
/// U+0100 upwards. Index by byte; token ids put the printable bytes first.
pub fn byte_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        table[b as usize] = if is_printable_byte(b) {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).expect("below U+0200");
            n += 1;
            c
        };
    }
    table
}

fn is_printable_byte(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff)
}

/// Bytes in token-id order: the printable ones first, then the rest.
fn byte_order() -> impl Iterator<Item = u8> {
    (0..=255u8)
        .filter(|&b| is_printable_byte(b))
        .chain((0..=255u8).filter(|&b| !is_printable_byte(b)))
}

/// Splits text roughly as llama.cpp's `qwen2` pre-tokenizer regex does:
/// contractions, words with one optional leading non-letter, single digits,
/// punctuation runs with an optional leading space, and whitespace.
fn pretokenize(text: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let n = chars.len();
    let at = |i: usize| chars.get(i).map(|&(_, c)| c);
    let byte = |i: usize| chars.get(i).map_or(text.len(), |&(b, _)| b);
    let is_punct = |c: char| !c.is_whitespace() && !c.is_alphanumeric();
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let c = chars[i].1;
        let next = at(i + 1);
        let mut j = i + 1;
        if c == '\'' {
            let rest = &text[byte(i + 1)..];
            let lower: String = rest.chars().take(2).flat_map(char::to_lowercase).collect();
            if let Some(len) = ["re", "ve", "ll"]
                .iter()
                .find(|p| lower.starts_with(*p))
                .map(|_| 2)
                .or_else(|| {
                    ["s", "t", "m", "d"]
                        .iter()
                        .find(|p| lower.starts_with(*p))
                        .map(|_| 1)
                })
            {
                j = i + 1 + len;
                out.push(&text[byte(i)..byte(j)]);
                i = j;
                continue;
            }
        }
        if c.is_alphabetic()
            || (!c.is_alphanumeric()
                && c != '\r'
                && c != '\n'
                && next.is_some_and(char::is_alphabetic))
        {
            while at(j).is_some_and(char::is_alphabetic) {
                j += 1;
            }
        } else if c.is_numeric() {
            // One digit per token.
        } else if is_punct(c) || (c == ' ' && next.is_some_and(is_punct)) {
            while at(j).is_some_and(is_punct) {
                j += 1;
            }
            while at(j).is_some_and(|c| c == '\r' || c == '\n') {
                j += 1;
            }
        } else {
            while at(j).is_some_and(char::is_whitespace) {
                j += 1;
            }
            let last_newline = (i..j).rev().find(|&k| matches!(chars[k].1, '\r' | '\n'));
            if let Some(k) = last_newline {
                j = k + 1;
            } else if j < n && j - i > 1 {
                // Leave one space to lead the next word.
                j -= 1;
            }
        }
        out.push(&text[byte(i)..byte(j)]);
        i = j;
    }
    out
}

impl Vocab {
    /// Builds a vocabulary of exactly `n_vocab` tokens (at least [`MIN_VOCAB`]).
    pub fn build(n_vocab: usize) -> Result<Self, String> {
        Self::build_with(n_vocab, &[])
    }

    /// [`build`](Self::build) with `more` image-marker tokens after
    /// [`MEDIA_TOKENS`] (where the vocabulary has room for them all).
    pub fn build_with(n_vocab: usize, more: &[&str]) -> Result<Self, String> {
        if n_vocab < MIN_VOCAB {
            return Err(format!(
                "vocabulary of {n_vocab} tokens: at least {MIN_VOCAB} needed"
            ));
        }
        let all: Vec<&str> = MEDIA_TOKENS.iter().chain(more).copied().collect();
        let media: &[&str] = if n_vocab >= MIN_VOCAB + all.len() {
            &all
        } else {
            &[]
        };
        let n_regular = n_vocab - SPECIAL_TOKENS.len() - media.len();
        let table = byte_to_unicode();
        let mut tokens: Vec<String> = byte_order()
            .map(|b| table[b as usize].to_string())
            .collect();
        let mut ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();

        // Words (byte-level symbol sequences) with their counts, in a fixed order.
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for w in pretokenize(SAMPLE) {
            *counts.entry(w.to_string()).or_default() += 1;
        }
        // Once the sample's own merges run out, more come from variants of its
        // words (case, leading space, common suffixes), each counted once so they
        // rank after every pair the sample itself repeats.
        let stems: Vec<String> = counts
            .keys()
            .map(|w| w.trim_start_matches(' ').to_lowercase())
            .filter(|w| w.len() > 1 && w.chars().all(|c| c.is_ascii_alphabetic()))
            .collect();
        for stem in stems {
            let cap: String = stem[..1].to_uppercase() + &stem[1..];
            let mut forms = vec![stem.to_uppercase(), cap.clone(), stem.clone()];
            for suffix in ["s", "ed", "ing", "er", "ly", "ness"] {
                forms.push(format!("{stem}{suffix}"));
            }
            for f in forms {
                for w in [f.clone(), format!(" {f}")] {
                    counts.entry(w).or_insert(1);
                }
            }
        }
        let mut words: Vec<(Vec<u32>, u64)> = counts
            .into_iter()
            .map(|(w, n)| {
                let syms = w
                    .bytes()
                    .map(|b| ids[&table[b as usize].to_string()])
                    .collect();
                (syms, n)
            })
            .collect();

        let mut merges = Vec::new();
        let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
        while tokens.len() < n_regular {
            pairs.clear();
            for (syms, n) in &words {
                for p in syms.windows(2) {
                    *pairs.entry((p[0], p[1])).or_default() += n;
                }
            }
            // Most frequent pair; ties go to the lexicographically smallest texts.
            let Some((&(a, b), _)) = pairs.iter().max_by(|(pa, ca), (pb, cb)| {
                ca.cmp(cb).then_with(|| {
                    let ta = (&tokens[pa.0 as usize], &tokens[pa.1 as usize]);
                    let tb = (&tokens[pb.0 as usize], &tokens[pb.1 as usize]);
                    tb.cmp(&ta)
                })
            }) else {
                break;
            };
            let merged = format!("{}{}", tokens[a as usize], tokens[b as usize]);
            merges.push(format!("{} {}", tokens[a as usize], tokens[b as usize]));
            let id = match ids.get(&merged) {
                Some(&id) => id,
                None => {
                    let id = tokens.len() as u32;
                    ids.insert(merged.clone(), id);
                    tokens.push(merged);
                    id
                }
            };
            for (syms, _) in &mut words {
                let mut k = 0;
                while k + 1 < syms.len() {
                    if syms[k] == a && syms[k + 1] == b {
                        syms[k] = id;
                        syms.remove(k + 1);
                    }
                    k += 1;
                }
            }
        }

        let mut token_types = vec![TYPE_NORMAL; tokens.len()];
        let first_special = tokens.len() as u32;
        for s in SPECIAL_TOKENS {
            tokens.push(s.to_string());
            token_types.push(TYPE_CONTROL);
        }
        for m in media {
            tokens.push(m.to_string());
            token_types.push(TYPE_USER_DEFINED);
        }
        let mut extra = 0;
        while tokens.len() < n_vocab {
            tokens.push(format!("<|extra_{extra}|>"));
            token_types.push(TYPE_USER_DEFINED);
            extra += 1;
        }
        Ok(Vocab {
            tokens,
            token_types,
            merges,
            endoftext: first_special,
            im_start: first_special + 1,
            im_end: first_special + 2,
        })
    }

    /// The `tokenizer.*` metadata pairs.
    pub fn metadata(&self) -> Vec<(&'static str, MetaValue)> {
        vec![
            ("tokenizer.ggml.model", "gpt2".into()),
            ("tokenizer.ggml.pre", "qwen2".into()),
            (
                "tokenizer.ggml.tokens",
                MetaValue::strings(self.tokens.iter().cloned()),
            ),
            ("tokenizer.ggml.token_type", self.token_types.clone().into()),
            (
                "tokenizer.ggml.merges",
                MetaValue::strings(self.merges.iter().cloned()),
            ),
            ("tokenizer.ggml.bos_token_id", self.endoftext.into()),
            ("tokenizer.ggml.eos_token_id", self.im_end.into()),
            ("tokenizer.ggml.padding_token_id", self.endoftext.into()),
            ("tokenizer.ggml.add_bos_token", false.into()),
            ("tokenizer.chat_template", CHAT_TEMPLATE.into()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn byte_tokens_follow_gpt2() {
        let t = byte_to_unicode();
        assert_eq!(t[b'!' as usize], '!');
        assert_eq!(t[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(t[b'\n' as usize], '\u{10a}'); // Ċ
        assert_eq!(t[0], '\u{100}');
        let v = Vocab::build(MIN_VOCAB).unwrap();
        assert_eq!(v.tokens[0], "!");
        assert_eq!(v.tokens[188], "\u{100}");
        assert!(v.merges.is_empty());
        assert_eq!(v.tokens[256], "<|endoftext|>");
    }

    #[test]
    fn merges_are_valid_and_vocab_exact() {
        for n in [MIN_VOCAB, 300, 1000, 5000] {
            let v = Vocab::build(n).unwrap();
            assert_eq!(v.tokens.len(), n);
            assert_eq!(v.token_types.len(), n);
            let set: HashSet<&str> = v.tokens.iter().map(String::as_str).collect();
            assert_eq!(set.len(), n, "duplicate tokens");
            for m in &v.merges {
                let (a, b) = m.split_once(' ').unwrap();
                assert!(!b.contains(' '), "{m}");
                assert!(set.contains(a) && set.contains(b), "{m}");
                assert!(set.contains(format!("{a}{b}").as_str()), "{m}");
            }
            assert_eq!(v.token_types[v.im_end as usize], TYPE_CONTROL);
        }
        assert!(Vocab::build(5000).unwrap().merges.len() > 500);
    }

    #[test]
    fn pretokenizer_splits_like_qwen2() {
        assert_eq!(
            pretokenize("Hello world, it's 42!\n\nOK  then"),
            ["Hello", " world", ",", " it", "'s", " ", "4", "2", "!\n\n", "OK", " ", " then"]
        );
    }
}
