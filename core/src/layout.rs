//! The packed expert layout written by `les pack`.
//!
//! A packed model stores all experts of MoE layer `N` in one byte tensor
//! `blk.N.ffn_exps_packed.weight` (type `I8`): expert `e` occupies bytes
//! `e * stride .. e * stride + bytes` of it, gate (where the experts have
//! one) then up then down back to back (the slot layout of [`crate::model::experts::ExpertFormat`]), padded to
//! `stride`, a multiple of the file alignment (4 KiB by default), so that each
//! expert is one aligned read that O_DIRECT can serve straight into a slot.
//! A CRC-32 of each expert's `bytes` lets the reader detect corruption.
//!
//! Metadata keys (`les.pack.*`, see [`keys`]) describe each packed layer.
//! Shapes are not repeated there: `n_embd` is `{arch}.embedding_length`, `n_ff`
//! is `{arch}.expert_feed_forward_length` (else `{arch}.feed_forward_length`),
//! the expert count `{arch}.expert_count`. The packer also sets
//! `general.alignment` to the pack alignment, so the packed tensor, and with it
//! every expert, starts on an aligned file offset; the padding is zero.

/// Metadata key names of the packed layout.
pub mod keys {
    use super::Key;

    /// Format version (u32), currently [`super::VERSION`].
    pub const VERSION: &str = "les.pack.version";
    /// Alignment of every expert extent (u32).
    pub const ALIGNMENT: &str = "les.pack.alignment";
    /// The plan that chose the per-layer types (string, informational).
    pub const PLAN: &str = "les.pack.plan";

    /// The ggml type ids of gate, up and down of layer `layer` (array of 3
    /// u32; 2, up and down, for experts without a gate).
    pub fn types(layer: usize) -> Key {
        Key::format(format_args!("les.pack.blk.{layer}.types"))
    }
    /// Bytes between consecutive experts of layer `layer` (u64).
    pub fn stride(layer: usize) -> Key {
        Key::format(format_args!("les.pack.blk.{layer}.stride"))
    }
    /// CRC-32 of each expert's bytes in layer `layer` (array of u32).
    pub fn checksums(layer: usize) -> Key {
        Key::format(format_args!("les.pack.blk.{layer}.checksums"))
    }
    /// Name of the packed tensor of layer `layer`.
    pub fn tensor(layer: usize) -> Key {
        Key::format(format_args!("blk.{layer}.ffn_exps_packed.weight"))
    }
}

/// A metadata key or tensor name built without an allocator (at most 64 bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key(heapless::String<64>);

impl Key {
    fn format(args: core::fmt::Arguments<'_>) -> Key {
        use core::fmt::Write;
        let mut s = heapless::String::new();
        // 64 bytes hold "les.pack.blk.<usize>.checksums", the longest key built.
        let _ = s.write_fmt(args);
        Key(s)
    }

    /// The key text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl core::ops::Deref for Key {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// The packed format version this crate reads and writes.
pub const VERSION: u32 = 1;

/// CRC-32 (IEEE) of `bytes`: the checksum stored per packed expert.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// The [`checksum`] of `a ++ b`, from the checksum of `a` and the checksum and
/// length of `b` (so parts hashed separately, e.g. on several threads, combine).
pub fn checksum_concat(a: u32, b: u32, b_len: u64) -> u32 {
    let mut h = crc32fast::Hasher::new_with_initial_len(a, 0);
    h.combine(&crc32fast::Hasher::new_with_initial_len(b, b_len));
    h.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_of_parts_concatenate() {
        let bytes: [u8; 300] = core::array::from_fn(|i| (i * 37 + 11) as u8);
        for cut in [0, 1, 4, 150, 299, 300] {
            let (a, b) = bytes.split_at(cut);
            let joined = checksum_concat(checksum(a), checksum(b), b.len() as u64);
            assert_eq!(joined, checksum(&bytes), "cut at {cut}");
        }
        let (a, rest) = bytes.split_at(100);
        let (b, c) = rest.split_at(7);
        let ab = checksum_concat(checksum(a), checksum(b), b.len() as u64);
        assert_eq!(
            checksum_concat(ab, checksum(c), c.len() as u64),
            checksum(&bytes)
        );
    }

    #[test]
    fn keys_and_checksum() {
        assert_eq!(keys::types(3).as_str(), "les.pack.blk.3.types");
        assert_eq!(keys::stride(47).as_str(), "les.pack.blk.47.stride");
        assert_eq!(keys::checksums(0).as_str(), "les.pack.blk.0.checksums");
        assert_eq!(keys::tensor(12).as_str(), "blk.12.ffn_exps_packed.weight");
        // The standard CRC-32 check value.
        assert_eq!(checksum(b"123456789"), 0xcbf4_3926);
    }
}
