//! Building a [`Tokenizer`] from a GGUF's `tokenizer.ggml.*` metadata.

use std::fmt;

use super::{Tokenizer, TokenizerData, TokenizerError};
use crate::gguf::{Gguf, GgufError, OptionalKey, Value};

/// Why the tokenizer metadata could not be used.
#[derive(Debug)]
pub enum FromGgufError {
    /// A key is missing or has the wrong type.
    Gguf(GgufError),
    /// The data is inconsistent.
    Tokenizer(TokenizerError),
}

impl fmt::Display for FromGgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FromGgufError::Gguf(e) => write!(f, "tokenizer metadata: {e}"),
            FromGgufError::Tokenizer(e) => write!(f, "tokenizer: {e}"),
        }
    }
}

impl std::error::Error for FromGgufError {}

impl From<GgufError> for FromGgufError {
    fn from(e: GgufError) -> Self {
        FromGgufError::Gguf(e)
    }
}

fn strings<B: AsRef<[u8]>>(g: &Gguf<B>, key: &str) -> Result<Option<Vec<String>>, GgufError> {
    let Some(arr) = g.get_array(key).optional()? else {
        return Ok(None);
    };
    // Token texts are bytes; a few real vocabularies hold invalid UTF-8, which
    // becomes U+FFFD here (such a token can still be produced, never matched).
    Ok(Some(
        arr.iter()
            .map(|v| {
                v.as_bytes()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default()
            })
            .collect(),
    ))
}

fn numbers<B: AsRef<[u8]>, T>(
    g: &Gguf<B>,
    key: &str,
    f: impl Fn(&Value<'_>) -> Option<T>,
) -> Result<Option<Vec<T>>, GgufError> {
    let Some(arr) = g.get_array(key).optional()? else {
        return Ok(None);
    };
    Ok(Some(arr.iter().filter_map(|v| f(&v)).collect()))
}

impl Tokenizer {
    /// The tokenizer described by the GGUF's metadata.
    pub fn from_gguf<B: AsRef<[u8]>>(g: &Gguf<B>) -> Result<Tokenizer, FromGgufError> {
        let p = "tokenizer.ggml.";
        let k = |s: &str| format!("{p}{s}");
        let id = |s: &str| -> Result<Option<u32>, GgufError> { g.get_u32(&k(s)).optional() };
        let data = TokenizerData {
            model: g.get_str(&k("model"))?.to_string(),
            pre: g.get_str(&k("pre")).optional()?.map(str::to_string),
            tokens: strings(g, &k("tokens"))?.unwrap_or_default(),
            token_type: numbers(g, &k("token_type"), |v| v.as_i64().map(|x| x as i32))?,
            merges: strings(g, &k("merges"))?.unwrap_or_default(),
            // Scores may be stored as integers by some converters.
            scores: numbers(g, &k("scores"), |v| {
                v.as_f32().or_else(|| v.as_i64().map(|x| x as f32))
            })?,
            bos_id: id("bos_token_id")?,
            eos_id: id("eos_token_id")?,
            unk_id: id("unknown_token_id")?,
            pad_id: id("padding_token_id")?,
            eot_id: id("eot_token_id")?,
            eom_id: id("eom_token_id")?,
            add_bos: g.get_bool(&k("add_bos_token")).optional()?,
            add_eos: g.get_bool(&k("add_eos_token")).optional()?,
            add_space_prefix: g.get_bool(&k("add_space_prefix")).optional()?,
            chat_template: g
                .get_str("tokenizer.chat_template")
                .optional()?
                .map(str::to_string),
        };
        Tokenizer::new(data).map_err(FromGgufError::Tokenizer)
    }
}
