//! Prompt caches (`les run --prompt-cache FILE`, llama-cli's option): the
//! state of a session after a prompt's tokens, saved to a file so that a
//! later run whose prompt starts with the same tokens skips evaluating them.
//!
//! The file: `LESPCACH`, the format version (u32), the model's fingerprint
//! (u64: see [`fingerprint`]), the KV cache's element types (two u8s: 0 f32,
//! 1 f16), whether the sliding-window layers hold only their last window (a
//! u8: 1 where the session kept them in rings, see
//! [`Session::saves_windows`]; else 0), a zero byte, the token count `n` (u32)
//! and the tokens (u32 each), then [`Session::write_state`] of those `n`
//! positions; all little-endian. A file of another model or KV type is ignored (and
//! rewritten); a file that is not a prompt cache is never overwritten.
//!
//! Restoring is exact: the logits after a restored prefix are those of
//! evaluating it (`host/tests/prompt_cache.rs`). A model with linear
//! attention (qwen35moe) restores only a cache whose tokens all start the
//! prompt, since its recurrent state cannot be cut back; nor can a cache of
//! sliding-window layers kept in rings (gpt-oss without `--swa-full`) by more
//! than a position.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use les_core::model::forward::KvType;

use crate::engine::{KvTypes, Session};
use crate::interrupt::TempFile;
use crate::model::Model;

/// The magic bytes a prompt cache starts with.
pub const MAGIC: &[u8; 8] = b"LESPCACH";

/// The format version this build reads and writes.
pub const VERSION: u32 = 1;

const HEADER_LEN: u64 = 8 + 4 + 8 + 4 + 4;

/// What identifies the model a cache was made with: a hash (FNV-1a, 64
/// bits) of the GGUF's header, i.e. its metadata and tensor table (names,
/// shapes, types and offsets), and of the file's length.
pub fn fingerprint(model: &Model) -> u64 {
    let g = model.gguf();
    let bytes = g.bytes();
    let header = &bytes[..(g.data_offset() as usize).min(bytes.len())];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in header.iter().chain(&(bytes.len() as u64).to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn type_code(t: KvType) -> u8 {
    match t {
        KvType::F32 => 0,
        KvType::F16 => 1,
    }
}

/// Why a prompt cache could not be used.
#[derive(Debug)]
pub enum CacheMiss {
    /// There is no file yet.
    Absent,
    /// The file is a prompt cache of another model, KV type or version, or
    /// damaged: it is ignored, and may be overwritten.
    Stale(String),
}

/// What [`restore`] restored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restored {
    /// Positions restored: the prompt's first tokens, now evaluated.
    pub positions: usize,
    /// Tokens the file holds.
    pub cached: usize,
}

/// Restores into `session` (a new one, at position 0) as many of `prompt`'s
/// tokens as the cache at `path` holds: the longest common prefix of the
/// cached tokens and `prompt` (all the cached tokens for a model with linear
/// attention). A file that exists but is not a prompt cache is an error (it
/// is never overwritten); any other reason not to use it is a [`CacheMiss`].
pub fn restore(
    path: &Path,
    model: &Model,
    session: &mut Session<'_>,
    kv_types: KvTypes,
    prompt: &[u32],
) -> Result<Result<Restored, CacheMiss>, String> {
    let name = path.display().to_string();
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Err(CacheMiss::Absent)),
        Err(e) => return Err(format!("{name}: {e}")),
    };
    let len = file.metadata().map_err(|e| format!("{name}: {e}"))?.len();
    let input = BufReader::new(file);
    restore_from(input, len, &name, model, session, kv_types, prompt)
}

/// [`restore`] from a file of `len` bytes read from `input` (named `name` in
/// errors). Nothing is allocated for counts the file's length does not hold.
pub fn restore_from(
    mut input: impl Read,
    len: u64,
    name: &str,
    model: &Model,
    session: &mut Session<'_>,
    kv_types: KvTypes,
    prompt: &[u32],
) -> Result<Result<Restored, CacheMiss>, String> {
    let mut head = [0u8; HEADER_LEN as usize];
    if input.read_exact(&mut head).is_err() || &head[..8] != MAGIC {
        return Err(format!(
            "{name} exists and is not a prompt cache; it is left alone (give another path)"
        ));
    }
    let stale = |why: String| Ok(Err(CacheMiss::Stale(why)));
    let u32_at = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    let version = u32_at(8);
    if version != VERSION {
        return stale(format!(
            "format version {version}, this build reads {VERSION}"
        ));
    }
    let print = u64::from_le_bytes(head[12..20].try_into().expect("8 bytes"));
    if print != fingerprint(model) {
        return stale("made with another model".into());
    }
    let types = (type_code(kv_types.k), type_code(kv_types.v));
    if (head[20], head[21]) != types {
        return stale("made with another KV cache type".into());
    }
    let windows = match head[22] {
        0 => false,
        1 => true,
        x => return stale(format!("an unknown sliding-window flag {x}")),
    };
    let n = u32_at(24) as usize;
    if n > crate::engine::MAX_POSITIONS
        || u128::from(len)
            != u128::from(HEADER_LEN) + 4 * n as u128 + u128::from(session.state_bytes(n, windows))
    {
        return stale(format!(
            "its size ({len} bytes) does not match its {n} tokens"
        ));
    }
    let mut bytes = vec![0u8; 4 * n];
    input
        .read_exact(&mut bytes)
        .map_err(|e| format!("{name}: {e}"))?;
    let tokens: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let common = tokens
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    let keep = if model.hybrid.linear.is_some() {
        if common < n {
            return stale(format!(
                "its {n} tokens are not all the prompt's first (a recurrent state cannot be cut back)"
            ));
        }
        n
    } else {
        common
    };
    if keep > session.max_positions() {
        return stale(format!("{keep} positions do not fit the context"));
    }
    if let Err(why) = session.can_restore(n, keep, windows) {
        return stale(why);
    }
    session
        .read_state(&mut input, n, keep, windows)
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(Ok(Restored {
        positions: keep,
        cached: n,
    }))
}

/// Writes the state `session` holds after `tokens` (all of its positions) to
/// `path`, under a temporary name renamed when complete.
pub fn save(
    path: &Path,
    model: &Model,
    session: &Session<'_>,
    kv_types: KvTypes,
    tokens: &[u32],
) -> Result<(), String> {
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    if tokens.len() != session.position() {
        return Err(format!(
            "{} tokens for a session at position {}",
            tokens.len(),
            session.position()
        ));
    }
    let n = u32::try_from(tokens.len()).map_err(|_| "too many tokens to cache".to_string())?;
    let (tmp, file) = TempFile::beside(path, "cache").map_err(err)?;
    let mut out = BufWriter::new(file);
    let mut head = Vec::with_capacity(HEADER_LEN as usize);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&fingerprint(model).to_le_bytes());
    let windows = u8::from(session.saves_windows());
    head.extend_from_slice(&[type_code(kv_types.k), type_code(kv_types.v), windows, 0]);
    head.extend_from_slice(&n.to_le_bytes());
    out.write_all(&head).map_err(err)?;
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    out.write_all(&bytes).map_err(err)?;
    session.write_state(&mut out).map_err(err)?;
    let file = out.into_inner().map_err(|e| err(e.into_error()))?;
    file.sync_all().map_err(err)?;
    tmp.commit(path).map_err(err)
}
