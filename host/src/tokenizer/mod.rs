//! Tokenizers as llama.cpp builds them from a GGUF file's `tokenizer.ggml.*` keys.
//!
//! [`TokenizerData`] mirrors those keys as plain data (so a GGUF adapter, a test or
//! a tool can fill it), and [`Tokenizer::new`] checks it and builds one of:
//!
//! - byte-level BPE (`tokenizer.ggml.model = "gpt2"`): text is cut into words by a
//!   [`PreTokenizer`] chosen by `tokenizer.ggml.pre`, each word's bytes become GPT-2
//!   byte tokens and merges apply by rank;
//! - SentencePiece BPE (`"llama"`): spaces become `▁`, characters merge by token
//!   score, and pieces without a token fall back to `<0xXX>` byte tokens (or the
//!   unknown token where the vocabulary lacks them; llama.cpp would abort).
//!
//! Control and user-defined tokens written in the text are cut out first, longest
//! first, and become single ids (control tokens only when `parse_special` is on).
//! Decoding goes through [`StreamDecoder`] when tokens arrive one at a time: it only
//! ever emits whole UTF-8 characters. [`ChatTemplate`] renders the model's Jinja
//! chat template.
//!
//! ```
//! use les::tokenizer::{Tokenizer, TokenizerData};
//!
//! // A byte-level BPE vocabulary: the 256 byte tokens, then "Ġw" and "Ġwo".
//! let mut tokens: Vec<String> = (0..=255u8).map(les::tokenizer::byte_token_text).collect();
//! tokens.extend(["Ġw".to_string(), "Ġwo".to_string()]);
//! let tok = Tokenizer::new(TokenizerData {
//!     model: "gpt2".into(),
//!     pre: Some("qwen2".into()),
//!     tokens,
//!     merges: vec!["Ġ w".into(), "Ġw o".into()],
//!     ..TokenizerData::default()
//! })
//! .unwrap();
//! let ids = tok.encode("hi wo", false, false);
//! assert_eq!(ids, [u32::from(b'h'), u32::from(b'i'), 257]);
//! assert_eq!(tok.decode(&ids), "hi wo");
//! ```

mod from_gguf;
pub use from_gguf::FromGgufError;
mod bpe;
mod chat;
mod conversation;
mod hash;
mod pretokenize;
mod spm;
mod unicode;

use std::collections::HashMap;
use std::fmt;

pub use chat::{ChatTemplate, ChatTemplateError, MAX_TEMPLATE_LEN};
pub use conversation::{Conversation, Turn};
pub use pretokenize::PreTokenizer;

use hash::FxBuildHasher;

/// Most tokens a vocabulary may have.
pub const MAX_TOKENS: usize = 1 << 22;
/// Longest token text accepted (bytes).
pub const MAX_TOKEN_LEN: usize = 1 << 16;
/// Most merges a BPE vocabulary may have.
pub const MAX_MERGES: usize = 1 << 23;

/// The `tokenizer.ggml.*` metadata of a model, as plain data.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenizerData {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer name (BPE only).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: token texts, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: one [`TokenType`] code per token.
    pub token_type: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"`, highest priority first (BPE only).
    pub merges: Vec<String>,
    /// `tokenizer.ggml.scores`: one score per token (SentencePiece merge priority).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`.
    pub eot_id: Option<u32>,
    /// `tokenizer.ggml.eom_token_id` (end of message: GLM-4.5's
    /// `<|observation|>`, llama-3.1's `<|eom_id|>`); it ends generation.
    pub eom_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`.
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

/// What a token is, from `tokenizer.ggml.token_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0: no type; such tokens decode to nothing.
    Undefined,
    /// 1: ordinary text.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: control (BOS, EOS, chat markers); matched in text only with `parse_special`.
    Control,
    /// 4: added by the model's authors; always matched in text as a whole.
    UserDefined,
    /// 5: reserved; decodes to nothing.
    Unused,
    /// 6: one raw byte, written `<0xXX>`.
    Byte,
}

impl TokenType {
    /// The type of a GGUF code, if it is one.
    pub fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            0 => Self::Undefined,
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }

    /// Whether the token is hidden from decoded text unless specials are asked for.
    fn is_hidden(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }

    /// Whether the token is cut out of text before tokenizing.
    fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown | Self::UserDefined)
    }
}

/// The tokenization algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// Byte-level BPE (`"gpt2"`).
    Bpe,
    /// SentencePiece-style BPE with byte fallback (`"llama"`).
    Spm,
}

/// Why [`TokenizerData`] was refused.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenizerError {
    /// `tokenizer.ggml.model` names an algorithm this crate does not implement.
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not implement.
    UnsupportedPreTokenizer(String),
    /// The vocabulary has no tokens.
    EmptyVocab,
    /// A list is longer than allowed.
    TooLarge {
        /// Which list.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A per-token list does not have one entry per token.
    LengthMismatch {
        /// Which list.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The number of tokens.
        n_tokens: usize,
    },
    /// One token's text is longer than [`MAX_TOKEN_LEN`].
    TokenTooLong {
        /// The token.
        id: usize,
        /// Its length in bytes.
        len: usize,
    },
    /// Two ids have the same text.
    DuplicateToken {
        /// The text (shortened if long).
        text: String,
        /// The first id with it.
        first: usize,
        /// The second.
        second: usize,
    },
    /// A `token_type` entry is not a known code.
    BadTokenType {
        /// The token.
        id: usize,
        /// The code.
        code: i32,
    },
    /// A score is NaN.
    BadScore {
        /// The token.
        id: usize,
    },
    /// A byte-type token is not written `<0xXX>`.
    BadByteToken {
        /// The token.
        id: usize,
        /// Its text (shortened if long).
        text: String,
    },
    /// A merge is malformed or names a text that is not a token.
    BadMerge {
        /// Its rank.
        index: usize,
        /// The merge (shortened if long).
        merge: String,
        /// What is wrong.
        reason: String,
    },
    /// A special token id is not below the vocabulary size.
    SpecialIdOutOfRange {
        /// Which key.
        which: &'static str,
        /// The id.
        id: u32,
        /// The vocabulary size.
        n_tokens: usize,
    },
    /// A flag asks to add a token that is not set.
    MissingSpecial {
        /// The flag.
        flag: &'static str,
        /// The missing id.
        which: &'static str,
    },
}

impl fmt::Display for TokenizerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnsupportedModel(m) => write!(f, "unsupported tokenizer.ggml.model {m:?}"),
            Self::UnsupportedPreTokenizer(p) => write!(f, "unsupported tokenizer.ggml.pre {p:?}"),
            Self::EmptyVocab => write!(f, "tokenizer.ggml.tokens is empty"),
            Self::TooLarge { what, len, max } => {
                write!(f, "{what} has {len} entries, more than the {max} allowed")
            }
            Self::LengthMismatch {
                what,
                len,
                n_tokens,
            } => write!(f, "{what} has {len} entries for {n_tokens} tokens"),
            Self::TokenTooLong { id, len } => write!(
                f,
                "token {id} is {len} bytes, more than the {MAX_TOKEN_LEN} allowed"
            ),
            Self::DuplicateToken {
                text,
                first,
                second,
            } => write!(f, "tokens {first} and {second} are both {text:?}"),
            Self::BadTokenType { id, code } => {
                write!(f, "token {id} has unknown token_type {code}")
            }
            Self::BadScore { id } => write!(f, "token {id} has a NaN score"),
            Self::BadByteToken { id, text } => {
                write!(f, "byte token {id} is {text:?}, not <0xXX>")
            }
            Self::BadMerge {
                index,
                merge,
                reason,
            } => write!(f, "merge {index} ({merge:?}): {reason}"),
            Self::SpecialIdOutOfRange {
                which,
                id,
                n_tokens,
            } => write!(
                f,
                "{which} = {id} is not below the vocabulary size {n_tokens}"
            ),
            Self::MissingSpecial { flag, which } => {
                write!(f, "{flag} is true but {which} is not set")
            }
        }
    }
}

impl std::error::Error for TokenizerError {}

/// `s`, cut to at most 64 bytes (on a character boundary) for error messages.
fn clip(s: &str) -> String {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    if end < s.len() {
        format!("{}...", &s[..end])
    } else {
        s.to_owned()
    }
}

/// The text of byte `b`'s token in a byte-level BPE vocabulary (GPT-2's
/// byte-to-unicode map: `b' '` is `"Ġ"`, `b'\n'` is `"Ċ"`, `b'a'` is `"a"`).
pub fn byte_token_text(b: u8) -> String {
    unicode::BYTE_TO_CHAR[b as usize].to_string()
}

/// Token texts that end generation (llama.cpp's list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Token texts llama.cpp takes as end-of-turn when no id is given.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle marker texts; llama.cpp makes them control tokens, and the
/// pad, repo and file-separator ones end generation.
const FIM_TEXTS: [(&[&str], bool); 6] = [
    (
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        false,
    ),
    (
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        false,
    ),
    (
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        false,
    ),
    (
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        true,
    ),
    (
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        true,
    ),
    (&["<|file_sep|>"], true),
];

/// A checked vocabulary ready to encode and decode.
pub struct Tokenizer {
    kind: ModelKind,
    pre: Option<PreTokenizer>,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    scores: Vec<f32>,
    token_to_id: HashMap<String, u32, FxBuildHasher>,
    max_token_len: usize,
    bpe: Option<bpe::Bpe>,
    spm_byte_tokens: [Option<u32>; 256],
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    /// Sorted ids that end generation.
    eog: Vec<u32>,
    /// Control, user-defined and unknown tokens, longest text first.
    specials: Vec<u32>,
    /// Decoded bytes of every token (specials as their text), concatenated.
    pieces: Vec<u8>,
    /// `pieces[piece_ends[id - 1]..piece_ends[id]]` is token `id`'s piece.
    piece_ends: Vec<usize>,
    chat_template: Option<String>,
    /// Variables every chat template render sees (`--chat-template-kwargs`).
    chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Fill-in-the-middle tokens, found by text as llama.cpp finds them:
    /// prefix, suffix, middle, pad, repository, file separator.
    fim: [Option<u32>; 6],
}

/// A fill-in-the-middle token ([`Tokenizer::fim`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fim {
    /// Before the prefix (`<|fim_prefix|>`).
    Prefix = 0,
    /// Before the suffix (`<|fim_suffix|>`).
    Suffix = 1,
    /// Where the middle goes (`<|fim_middle|>`).
    Middle = 2,
    /// Padding (`<|fim_pad|>`).
    Pad = 3,
    /// Before the repository's name (`<|repo_name|>`).
    Repo = 4,
    /// Before each file of a repository (`<|file_sep|>`).
    FileSep = 5,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("pre", &self.pre)
            .field("n_vocab", &self.tokens.len())
            .field("n_merges", &self.n_merges())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("add_space_prefix", &self.add_space_prefix)
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

/// A run of the input: plain text, or a special token cut out of it.
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

impl Tokenizer {
    /// Checks `data` and builds the tokenizer, with llama.cpp's defaults for
    /// everything the metadata leaves out:
    ///
    /// - SentencePiece: BOS 1, EOS 2, UNK 0 (each when in range), `add_bos` and
    ///   `add_space_prefix` on;
    /// - byte-level BPE: BOS and EOS 11 (sic; when in range), `add_bos` on only for
    ///   the llama-3 pre-tokenizers, no space prefix;
    /// - end-of-turn, fill-in-the-middle and end-of-generation tokens recognised by
    ///   their text, which also makes them control tokens.
    ///
    /// Special ids given in `data` must be in range. Empty token texts become
    /// `[EMPTY_<id>]`, as in llama.cpp.
    pub fn new(data: TokenizerData) -> Result<Self, TokenizerError> {
        let kind = match data.model.as_str() {
            "gpt2" => ModelKind::Bpe,
            "llama" => ModelKind::Spm,
            other => return Err(TokenizerError::UnsupportedModel(clip(other))),
        };
        let pre_name = data.pre.as_deref().filter(|p| !p.is_empty());
        let pre = match kind {
            ModelKind::Spm => None,
            ModelKind::Bpe => Some(match pre_name {
                None => PreTokenizer::Default,
                Some(p) => PreTokenizer::from_name(p)
                    .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(clip(p)))?,
            }),
        };
        // llama.cpp: the llama-3 names skip merges for whole-token words and add BOS.
        let llama3_names = [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ];
        let is_llama3_name =
            kind == ModelKind::Bpe && pre_name.is_some_and(|p| llama3_names.contains(&p));
        let no_default_bos =
            kind == ModelKind::Bpe && matches!(pre_name, Some("glm4" | "glm5" | "chatglm-bpe"));
        // llama.cpp's `ignore_merges`: the llama-3 names, and GLM-4.5's.
        let ignore_merges =
            is_llama3_name || (kind == ModelKind::Bpe && matches!(pre_name, Some("glm4" | "glm5")));

        let n = data.tokens.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        check_len("tokenizer.ggml.tokens", n, MAX_TOKENS)?;
        check_len("tokenizer.ggml.merges", data.merges.len(), MAX_MERGES)?;
        let per_token = |what: &'static str, len: usize| {
            if len == n {
                Ok(())
            } else {
                Err(TokenizerError::LengthMismatch {
                    what,
                    len,
                    n_tokens: n,
                })
            }
        };

        let mut types = match &data.token_type {
            None => vec![TokenType::Normal; n],
            Some(codes) => {
                per_token("tokenizer.ggml.token_type", codes.len())?;
                codes
                    .iter()
                    .enumerate()
                    .map(|(id, &code)| {
                        TokenType::from_code(code).ok_or(TokenizerError::BadTokenType { id, code })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        let scores = match &data.scores {
            None => Vec::new(),
            Some(s) => {
                per_token("tokenizer.ggml.scores", s.len())?;
                if let Some(id) = s.iter().position(|v| v.is_nan()) {
                    return Err(TokenizerError::BadScore { id });
                }
                // `+ 0.0` turns -0.0 into 0.0 so ties compare as in C++.
                s.iter().map(|&v| v + 0.0).collect()
            }
        };

        let mut tokens = data.tokens;
        let mut token_to_id: HashMap<String, u32, FxBuildHasher> =
            HashMap::with_capacity_and_hasher(n, FxBuildHasher);
        let mut max_token_len = 0;
        for (id, text) in tokens.iter_mut().enumerate() {
            if text.len() > MAX_TOKEN_LEN {
                return Err(TokenizerError::TokenTooLong {
                    id,
                    len: text.len(),
                });
            }
            if text.is_empty() {
                *text = format!("[EMPTY_{id}]");
            }
            max_token_len = max_token_len.max(text.len());
            // n <= MAX_TOKENS < u32::MAX
            if let Some(first) = token_to_id.insert(text.clone(), id as u32) {
                return Err(TokenizerError::DuplicateToken {
                    text: clip(text),
                    first: first as usize,
                    second: id,
                });
            }
        }
        let lookup = |text: &str| token_to_id.get(text).copied();

        for (id, ty) in types.iter().enumerate() {
            if *ty == TokenType::Byte && parse_byte_token(&tokens[id]).is_none() {
                return Err(TokenizerError::BadByteToken {
                    id,
                    text: clip(&tokens[id]),
                });
            }
        }

        // Special ids: defaults out of range are dropped, given ids must fit.
        let in_range = |id: u32| (id as usize) < n;
        let given = |which: &'static str, id: Option<u32>| match id {
            Some(id) if !in_range(id) => Err(TokenizerError::SpecialIdOutOfRange {
                which,
                id,
                n_tokens: n,
            }),
            other => Ok(other),
        };
        let (default_bos, default_eos, default_unk) = match kind {
            ModelKind::Spm => (Some(1), Some(2), Some(0)),
            ModelKind::Bpe if no_default_bos => (None, Some(11), None),
            ModelKind::Bpe => (Some(11), Some(11), None),
        };
        let or_default = |g: Option<u32>, d: Option<u32>| g.or(d.filter(|&d| in_range(d)));
        let bos = or_default(
            given("tokenizer.ggml.bos_token_id", data.bos_id)?,
            default_bos,
        );
        let eos = or_default(
            given("tokenizer.ggml.eos_token_id", data.eos_id)?,
            default_eos,
        );
        let unk = or_default(
            given("tokenizer.ggml.unknown_token_id", data.unk_id)?,
            default_unk,
        );
        let pad = given("tokenizer.ggml.padding_token_id", data.pad_id)?;
        let mut eot = given("tokenizer.ggml.eot_token_id", data.eot_id)?;
        let eom = given("tokenizer.ggml.eom_token_id", data.eom_id)?;

        let add_bos = data
            .add_bos
            .unwrap_or(kind == ModelKind::Spm || is_llama3_name);
        let add_eos = data.add_eos.unwrap_or(false);
        let add_space_prefix = data.add_space_prefix.unwrap_or(kind == ModelKind::Spm);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                flag: "tokenizer.ggml.add_bos_token",
                which: "tokenizer.ggml.bos_token_id",
            });
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                flag: "tokenizer.ggml.add_eos_token",
                which: "tokenizer.ggml.eos_token_id",
            });
        }

        // Tokens recognised by text, as llama.cpp does after loading.
        let mut eog = Vec::new();
        let make_control =
            |types: &mut [TokenType], id: u32| types[id as usize] = TokenType::Control;
        if eot.is_none() {
            eot = EOT_TEXTS.iter().filter_map(|t| lookup(t)).min();
            if let Some(id) = eot {
                make_control(&mut types, id);
            }
        }
        // llama.cpp looks the end-of-message token up by text only without the key.
        match eom {
            Some(id) => eog.push(id),
            None => {
                if let Some(id) = lookup("<|eom_id|>") {
                    make_control(&mut types, id);
                    eog.push(id);
                }
            }
        }
        let mut fim = [None; 6];
        for (slot, (texts, ends_generation)) in fim.iter_mut().zip(FIM_TEXTS) {
            if let Some(id) = texts.iter().filter_map(|t| lookup(t)).min() {
                make_control(&mut types, id);
                *slot = Some(id);
                if ends_generation {
                    eog.push(id);
                }
            }
        }
        for text in EOG_TEXTS {
            if let Some(id) = lookup(text) {
                make_control(&mut types, id);
                eog.push(id);
            }
        }
        eog.extend(eos);
        eog.extend(eot);
        eog.sort_unstable();
        eog.dedup();
        // gpt-oss / solar-open: "<|end|>" separates turns there, it does not end them.
        let has = |eog: &[u32], t: &str| lookup(t).is_some_and(|id| eog.binary_search(&id).is_ok());
        if let Some(end) = lookup("<|end|>").filter(|_| has(&eog, "<|end|>")) {
            if (has(&eog, "<|return|>") && has(&eog, "<|call|>"))
                || (has(&eog, "<|calls|>") && has(&eog, "<|flush|>"))
            {
                eog.retain(|&id| id != end);
                types[end as usize] = TokenType::UserDefined;
            }
        }
        // gemma4 / paddleocr: "</s>" is ordinary there.
        if let Some(s) =
            lookup("</s>").filter(|_| has(&eog, "</s>") && has(&eog, "<|tool_response>"))
        {
            eog.retain(|&id| id != s);
            types[s as usize] = TokenType::Normal;
        }

        let bpe = match kind {
            ModelKind::Bpe => Some(bpe::Bpe::new(&data.merges, lookup, ignore_merges)?),
            ModelKind::Spm => None,
        };
        let mut spm_byte_tokens = [None; 256];
        if kind == ModelKind::Spm {
            for (b, slot) in spm_byte_tokens.iter_mut().enumerate() {
                *slot = lookup(&format!("<0x{b:02X}>"))
                    .or_else(|| {
                        let b = u8::try_from(b).ok().filter(u8::is_ascii)?;
                        lookup(&char::from(b).to_string())
                    })
                    .or(unk);
            }
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&id| types[id as usize].is_special())
            .collect();
        specials.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].len()));

        let mut pieces = Vec::new();
        let mut piece_ends = Vec::with_capacity(n);
        for (text, &ty) in tokens.iter().zip(&types) {
            render_piece(kind, ty, text, &mut pieces);
            piece_ends.push(pieces.len());
        }

        let chat_template = match data.chat_template {
            Some(t) if t.len() > MAX_TEMPLATE_LEN => {
                return Err(TokenizerError::TooLarge {
                    what: "tokenizer.chat_template",
                    len: t.len(),
                    max: MAX_TEMPLATE_LEN,
                })
            }
            t => t,
        };

        Ok(Self {
            kind,
            pre,
            tokens,
            types,
            scores,
            token_to_id,
            max_token_len,
            bpe,
            spm_byte_tokens,
            bos,
            eos,
            eot,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            eog,
            specials,
            pieces,
            piece_ends,
            chat_template,
            chat_template_kwargs: serde_json::Map::new(),
            fim,
        })
    }

    /// The tokenization algorithm.
    pub fn kind(&self) -> ModelKind {
        self.kind
    }

    /// The pre-tokenizer (byte-level BPE only).
    pub fn pre_tokenizer(&self) -> Option<PreTokenizer> {
        self.pre
    }

    /// Number of tokens.
    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    /// Number of distinct merges (0 for SentencePiece).
    pub fn n_merges(&self) -> usize {
        self.bpe.as_ref().map_or(0, bpe::Bpe::n_merges)
    }

    /// A token's text as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a token text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// A token's type, after llama.cpp's recognition of control tokens by text.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token (given, or recognised by text).
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// Unknown token.
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    /// Padding token.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// Whether [`Tokenizer::encode`] with `add_special` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether [`Tokenizer::encode`] with `add_special` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether SentencePiece text gets a leading space (and decoding drops one).
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Whether generating `id` ends generation (EOS, EOT and llama.cpp's list).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The fill-in-the-middle token `which`, if the vocabulary has one.
    pub fn fim(&self, which: Fim) -> Option<u32> {
        self.fim[which as usize]
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The chat template's source: the model's, or the one set in its place
    /// ([`set_chat_template`](Self::set_chat_template)).
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Uses `source` as the chat template instead of the model's
    /// (`--chat-template-file`), once it compiles.
    pub fn set_chat_template(&mut self, source: &str) -> Result<(), ChatTemplateError> {
        ChatTemplate::new(source, "", "")?;
        self.chat_template = Some(source.to_string());
        Ok(())
    }

    /// Variables every chat template render sees (`--chat-template-kwargs`,
    /// such as Qwen3's `enable_thinking`).
    pub fn set_chat_template_kwargs(&mut self, kwargs: serde_json::Map<String, serde_json::Value>) {
        self.chat_template_kwargs = kwargs;
    }

    /// Tokenizes `text`. With `add_special`, BOS and EOS are added as the model's
    /// flags say; with `parse_special`, control tokens written in the text become
    /// their ids (user-defined tokens always do).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let fragments = self.partition(text, parse_special);
        match self.kind {
            ModelKind::Bpe => self.encode_bpe(&fragments, &mut out),
            ModelKind::Spm => self.encode_spm(&fragments, &mut out),
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Cuts special tokens out of `text`, longest token first (llama.cpp's
    /// `tokenizer_st_partition`).
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(text));
        let mut next = Vec::new();
        let mut longest = text.len();
        for &id in &self.specials {
            if !parse_special && self.types[id as usize].is_hidden() {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            if pat.len() > longest
                || !frags
                    .iter()
                    .any(|f| matches!(f, Fragment::Text(s) if s.contains(pat)))
            {
                continue;
            }
            next.clear();
            for frag in frags.drain(..) {
                let Fragment::Text(mut s) = frag else {
                    next.push(frag);
                    continue;
                };
                while let Some(at) = s.find(pat) {
                    if at > 0 {
                        next.push(Fragment::Text(&s[..at]));
                    }
                    next.push(Fragment::Token(id));
                    s = &s[at + pat.len()..];
                }
                if !s.is_empty() {
                    next.push(Fragment::Text(s));
                }
            }
            std::mem::swap(&mut frags, &mut next);
            longest = frags
                .iter()
                .map(|f| match f {
                    Fragment::Text(s) => s.len(),
                    Fragment::Token(_) => 0,
                })
                .max()
                .unwrap_or(0);
        }
        frags
    }

    fn encode_bpe(&self, fragments: &[Fragment<'_>], out: &mut Vec<u32>) {
        let (Some(bpe), Some(pre)) = (&self.bpe, self.pre) else {
            return;
        };
        let lookup = |t: &str| self.token_to_id.get(t).copied();
        let mut scratch = bpe::Scratch::default();
        let mut words = Vec::new();
        for frag in fragments {
            match *frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(text) => {
                    pre.split_into(text, &mut words);
                    for word in &words {
                        bpe.encode_word(word, lookup, &mut scratch, out);
                    }
                }
            }
        }
    }

    fn encode_spm(&self, fragments: &[Fragment<'_>], out: &mut Vec<u32>) {
        let vocab = spm::Vocab {
            lookup: |t: &str| self.token_to_id.get(t).copied(),
            scores: &self.scores,
            max_token_len: self.max_token_len,
            byte_tokens: &self.spm_byte_tokens,
        };
        let mut scratch = spm::Scratch::default();
        let mut text = String::new();
        let mut prev_special = true;
        for frag in fragments {
            match *frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    text.clear();
                    if self.add_space_prefix && prev_special {
                        text.push('▁');
                    }
                    for c in t.chars() {
                        text.push(if c == ' ' { '▁' } else { c });
                    }
                    spm::encode(&text, &vocab, &mut scratch, out);
                    prev_special = false;
                }
            }
        }
    }

    /// The bytes token `id` stands for: raw bytes for byte tokens, text with `▁` or
    /// GPT-2 characters undone for normal tokens, the text itself for special
    /// tokens, which are empty unless `special` (control and unknown) — as
    /// llama.cpp's `token_to_piece`. Empty for ids out of range.
    pub fn piece(&self, id: u32, special: bool) -> &[u8] {
        let id = id as usize;
        match self.types.get(id) {
            None => &[],
            Some(ty) if ty.is_hidden() && !special => &[],
            Some(_) => {
                let start = if id == 0 { 0 } else { self.piece_ends[id - 1] };
                &self.pieces[start..self.piece_ends[id]]
            }
        }
    }

    /// Decodes `ids` to text, leaving out control and unknown tokens.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, false)
    }

    /// Decodes `ids` to text, with control and unknown tokens written out when
    /// `special`. Invalid UTF-8 becomes U+FFFD; with `add_space_prefix` one leading
    /// space is dropped (the one encoding added). Unlike llama.cpp's `detokenize`,
    /// no clean-up of spaces before punctuation is done, so decoding equals the
    /// concatenated output of a [`StreamDecoder`] apart from that leading space.
    pub fn decode_with(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.piece(id, special));
        }
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        if self.add_space_prefix && text.starts_with(' ') {
            text.remove(0);
        }
        text
    }

    /// An incremental decoder for tokens arriving one at a time.
    pub fn stream_decoder(&self, special: bool) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            special,
            shown: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// Compiles the model's chat template with its BOS and EOS texts.
    pub fn chat_template(&self) -> Result<ChatTemplate, ChatTemplateError> {
        let source = self
            .chat_template
            .as_deref()
            .ok_or(ChatTemplateError::Missing)?;
        let text = |id: Option<u32>| id.and_then(|id| self.token_text(id)).unwrap_or("");
        Ok(ChatTemplate::new(source, text(self.bos), text(self.eos))?
            .with_kwargs(self.chat_template_kwargs.clone()))
    }

    /// Renders `messages` (role, content) with the model's chat template.
    pub fn apply_chat_template<R: AsRef<str>, C: AsRef<str>>(
        &self,
        messages: &[(R, C)],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.chat_template()?.apply(messages, add_generation_prompt)
    }

    /// The prompt text for `messages`, to [`encode`](Self::encode) with
    /// `add_special`, prepared as llama.cpp prepares it: the rendered template
    /// without a leading BOS text when encoding adds BOS anyway, nor a trailing
    /// EOS text when it adds EOS (templates that start with `{{ bos_token }}`
    /// would otherwise give two BOS).
    pub fn chat_prompt<R: AsRef<str>, C: AsRef<str>>(
        &self,
        messages: &[(R, C)],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.chat_prompt_with(&self.chat_template()?, messages, add_generation_prompt)
    }

    /// [`chat_prompt`](Self::chat_prompt) with `template` already compiled
    /// (this tokenizer's [`chat_template`](Self::chat_template), say, kept
    /// after probing it).
    pub fn chat_prompt_with<R: AsRef<str>, C: AsRef<str>>(
        &self,
        template: &ChatTemplate,
        messages: &[(R, C)],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let text = template.apply(messages, add_generation_prompt)?;
        Ok(self.without_added_specials(&text))
    }

    /// [`chat_prompt_with`](Self::chat_prompt_with) of messages as JSON
    /// objects (tool calls and answers in them), with `tools` where given.
    pub fn chat_prompt_json(
        &self,
        template: &ChatTemplate,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, ChatTemplateError> {
        let text = template.apply_json(messages, tools, add_generation_prompt, kwargs)?;
        Ok(self.without_added_specials(&text))
    }

    /// A rendered template without the BOS text it starts with where
    /// encoding adds BOS, nor the EOS text it ends with where encoding adds EOS.
    fn without_added_specials(&self, text: &str) -> String {
        let special = |on: bool, id: Option<u32>| {
            id.filter(|_| on)
                .and_then(|id| self.token_text(id))
                .filter(|t| !t.is_empty())
        };
        let mut prompt = text;
        if let Some(bos) = special(self.add_bos, self.bos) {
            prompt = prompt.strip_prefix(bos).unwrap_or(prompt);
        }
        if let Some(eos) = special(self.add_eos, self.eos) {
            prompt = prompt.strip_suffix(eos).unwrap_or(prompt);
        }
        prompt.to_string()
    }
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), TokenizerError> {
    if len > max {
        Err(TokenizerError::TooLarge { what, len, max })
    } else {
        Ok(())
    }
}

/// The byte of a `<0xXX>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Appends what a token decodes to (llama.cpp's `token_to_piece` with specials).
fn render_piece(kind: ModelKind, ty: TokenType, text: &str, out: &mut Vec<u8>) {
    match ty {
        TokenType::Control | TokenType::Unknown | TokenType::UserDefined => {
            out.extend_from_slice(text.as_bytes());
        }
        TokenType::Byte => out.extend(parse_byte_token(text)),
        TokenType::Normal => match kind {
            ModelKind::Spm => {
                for c in text.chars() {
                    let c = if c == '▁' { ' ' } else { c };
                    out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                }
            }
            ModelKind::Bpe => {
                for c in text.chars() {
                    match unicode::char_to_byte(c) {
                        Some(b) => out.push(b),
                        None => {
                            // llama.cpp's marker for a character outside the byte map.
                            out.extend_from_slice(b"[UNK_BYTE_0x");
                            for b in c.encode_utf8(&mut [0; 4]).bytes() {
                                out.extend_from_slice(format!("{b:02x}").as_bytes());
                            }
                            out.extend_from_slice(text.as_bytes());
                            out.push(b']');
                        }
                    }
                }
            }
        },
        TokenType::Undefined | TokenType::Unused => {}
    }
}

/// Decodes tokens one at a time, holding back the bytes of a UTF-8 character until
/// it is complete, so no output ever splits a character. Bytes that cannot start or
/// continue a character come out as U+FFFD at once.
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    special: bool,
    /// Tokens written out even where `special` is off ([`show`](Self::show)).
    shown: Vec<u32>,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Writes out the text of `ids` even where they are control tokens (as
    /// llama-server keeps a chat format's "preserved tokens", such as the
    /// markers of its tool calls, in the text its parser reads).
    pub fn show(&mut self, ids: impl IntoIterator<Item = u32>) {
        self.shown.extend(ids);
    }

    /// Adds one token and returns the text that is now complete (may be empty).
    pub fn decode_piece(&mut self, id: u32) -> String {
        let special = self.special || self.shown.contains(&id);
        self.pending
            .extend_from_slice(self.tokenizer.piece(id, special));
        let mut out = String::new();
        let mut rest = self.pending.as_slice();
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, tail) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &tail[bad..];
                        }
                        None => {
                            rest = tail; // an incomplete character: wait for more
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }

    /// Returns whatever is held back (an unfinished character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
