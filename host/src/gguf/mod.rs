//! GGUF: a hardened reader over a memory map or any byte buffer, and a streaming
//! writer.
//!
//! # Reading untrusted files
//! A GGUF file is untrusted input. [`Gguf::parse`] walks it once, in safe code over
//! a `&[u8]`, and accepts what llama.cpp's `gguf.cpp` accepts (plus nested arrays,
//! which the format allows and the Python `gguf` package writes):
//! - every count and length is bounded, before anything is allocated or looped
//!   over, by what the bytes left could hold at the smallest encoding of one item
//!   (a string of length `n` needs `n` bytes, an array of `n` strings `8n`, the
//!   tensor and key counts 24 and 14 bytes each), so memory stays a small multiple
//!   of the file size and time linear in it whatever the counts claim;
//! - arrays nest at most [`MAX_ARRAY_DEPTH`] deep, so recursion is bounded;
//! - keys and tensor names are UTF-8 and unique, names at most [`MAX_NAME_LEN`]
//!   bytes; tensors have at most [`MAX_DIMS`] dimensions, each a valid `int64_t`,
//!   whose product and byte size do not overflow; `ne[0]` is a whole number of
//!   blocks of a known [`GgmlType`];
//! - `general.alignment` is a power of two; each tensor starts where the previous
//!   one ends padded to it (as llama.cpp requires), and ends inside the file.
//!
//! The pass records byte ranges, not copies: metadata values are decoded on access
//! ([`Value`], [`ArrayView`]) and tensor data is a slice of the file
//! ([`Tensor::data`]). Every failure is a [`GgufError`] naming the key, tensor or
//! byte offset; nothing panics.
//!
//! ```no_run
//! # use les::gguf::Gguf;
//! let model = Gguf::open("model.gguf")?;
//! let arch = model.architecture()?;
//! let layers = model.get_u32(&format!("{arch}.block_count"))?;
//! let embd = model.tensor("token_embd.weight").expect("no embeddings");
//! println!("{layers} layers, {} bytes of embeddings", embd.data().len());
//! # Ok::<(), les::gguf::GgufError>(())
//! ```

mod error;
mod mmap;
mod parse;
mod value;
mod write;

#[cfg(test)]
mod tests;

use std::path::Path;

use les_core::quant::GgmlType;

pub use error::{GgufError, OptionalKey};
pub use mmap::MappedFile;
pub use value::{ArrayIter, ArrayView, MetaArray, MetaValue, Value, ValueType};
pub use write::{GgufWriter, TensorDataWriter};

use parse::{Cursor, Index, TensorEntry};

/// The most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// The longest tensor name in bytes (ggml's `GGML_MAX_NAME` less the NUL).
pub const MAX_NAME_LEN: usize = 63;
/// The deepest nesting of metadata arrays (a plain array is depth 1).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// The data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

const INVARIANT: &str =
    "range validated by the parser (B::as_ref must return the same bytes each call)";

/// A validated GGUF file over bytes `B`: a [`MappedFile`] (the default), a
/// `Vec<u8>`, a `&[u8]`, anything whose `as_ref` returns the same bytes each call.
pub struct Gguf<B = MappedFile> {
    buf: B,
    index: Index,
}

impl<B> std::fmt::Debug for Gguf<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.index.version)
            .field("kvs", &self.index.kvs.len())
            .field("tensors", &self.index.tensors.len())
            .finish()
    }
}

impl Gguf<MappedFile> {
    /// Maps and validates the file at `path`. The file must not be modified or
    /// truncated while the result lives: see [`MappedFile`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let map = MappedFile::open(path).map_err(|e| GgufError::io(path, e))?;
        Self::parse(map)
    }
}

impl<B: AsRef<[u8]>> Gguf<B> {
    /// Validates `buf` as a GGUF v2 or v3 file.
    pub fn parse(buf: B) -> Result<Self, GgufError> {
        let index = parse::parse(buf.as_ref())?;
        Ok(Gguf { buf, index })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.buf.as_ref()
    }

    /// The buffer.
    pub fn source(&self) -> &B {
        &self.buf
    }

    /// Gives the buffer back.
    pub fn into_inner(self) -> B {
        self.buf
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.index.version
    }

    /// The data alignment (`general.alignment`, or 32).
    pub fn alignment(&self) -> u64 {
        self.index.alignment
    }

    /// Byte offset of the data section, which tensor offsets are relative to.
    pub fn data_offset(&self) -> u64 {
        self.index.data_offset as u64
    }

    fn str_at(&self, range: &std::ops::Range<usize>) -> &str {
        let bytes = self.bytes().get(range.clone()).expect(INVARIANT);
        std::str::from_utf8(bytes).expect(INVARIANT)
    }

    fn value_at(&self, kv: &parse::KvEntry) -> Value<'_> {
        value::read_value(&mut Cursor::new(self.bytes(), kv.value), kv.ty).expect(INVARIANT)
    }

    /// The number of metadata pairs.
    pub fn metadata_len(&self) -> usize {
        self.index.kvs.len()
    }

    /// Every metadata pair in file order.
    pub fn metadata(&self) -> impl ExactSizeIterator<Item = (&str, Value<'_>)> + '_ {
        self.index
            .kvs
            .iter()
            .map(|kv| (self.str_at(&kv.key), self.value_at(kv)))
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<Value<'_>> {
        let kvs = &self.index.kvs;
        let i = self
            .index
            .kv_order
            .binary_search_by(|&i| self.str_at(&kvs[i].key).cmp(key))
            .ok()?;
        Some(self.value_at(&kvs[self.index.kv_order[i]]))
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    fn require(&self, key: &str) -> Result<Value<'_>, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey { key: key.into() })
    }

    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        f: impl FnOnce(&Value<'s>) -> Option<T>,
    ) -> Result<T, GgufError> {
        let v = self.require(key)?;
        f(&v).ok_or_else(|| GgufError::WrongType {
            key: key.into(),
            expected,
            found: v.value_type(),
        })
    }

    fn integer(&self, key: &str) -> Result<i128, GgufError> {
        self.typed(key, "an integer", |v| v.as_integer())
    }

    fn out_of_range(key: &str, value: i128, target: &'static str) -> GgufError {
        GgufError::OutOfRange {
            key: key.into(),
            value: value.to_string(),
            target,
        }
    }

    /// An integer of any width (writers differ) that is non-negative.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.integer(key)?;
        u64::try_from(v).map_err(|_| Self::out_of_range(key, v, "u64"))
    }

    /// An integer of any width that fits `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.integer(key)?;
        u32::try_from(v).map_err(|_| Self::out_of_range(key, v, "u32"))
    }

    /// An integer of any width that fits `i64`.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        let v = self.integer(key)?;
        i64::try_from(v).map_err(|_| Self::out_of_range(key, v, "i64"))
    }

    /// An `f32`, or an `f64` narrowed to `f32`.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.typed(key, "f32 or f64", |v| v.as_f32())
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.typed(key, "bool", |v| v.as_bool())
    }

    /// A UTF-8 string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let bytes = self.typed(key, "string", |v| v.as_bytes())?;
        std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
            what: format!("value of key '{key}'"),
            offset: self.offset_in_file(bytes),
        })
    }

    /// An array, as a lazy view.
    pub fn get_array(&self, key: &str) -> Result<ArrayView<'_>, GgufError> {
        self.typed(key, "array", |v| v.as_array())
    }

    /// An array of UTF-8 strings, e.g. `tokenizer.ggml.tokens` (one pass, no copies).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let array = self.get_array(key)?;
        if array.elem_type() != ValueType::String {
            return Err(GgufError::WrongType {
                key: key.into(),
                expected: "array of string",
                found: array.elem_type(),
            });
        }
        let mut out = Vec::with_capacity(array.len());
        for (i, v) in array.iter().enumerate() {
            let bytes = v.as_bytes().unwrap_or_default();
            let s = std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
                what: format!("element {i} of key '{key}'"),
                offset: self.offset_in_file(bytes),
            })?;
            out.push(s);
        }
        Ok(out)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    fn offset_in_file(&self, part: &[u8]) -> u64 {
        (part.as_ptr() as usize).wrapping_sub(self.bytes().as_ptr() as usize) as u64
    }

    fn tensor_at<'s>(&'s self, t: &'s TensorEntry) -> Tensor<'s> {
        let end = t.start + t.size as usize;
        Tensor {
            name: self.str_at(&t.name),
            dims: &t.dims[..t.n_dims],
            ty: t.ty,
            offset: t.start as u64,
            data: self.bytes().get(t.start..end).expect(INVARIANT),
        }
    }

    /// The number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.index.tensors.len()
    }

    /// Every tensor in file order.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = Tensor<'_>> + '_ {
        self.index.tensors.iter().map(|t| self.tensor_at(t))
    }

    /// The tensor named `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<Tensor<'_>> {
        let ts = &self.index.tensors;
        let i = self
            .index
            .tensor_order
            .binary_search_by(|&i| self.str_at(&ts[i].name).cmp(name))
            .ok()?;
        Some(self.tensor_at(&ts[self.index.tensor_order[i]]))
    }

    /// The tensor named `name`, or [`GgufError::MissingTensor`].
    pub fn require_tensor(&self, name: &str) -> Result<Tensor<'_>, GgufError> {
        self.tensor(name)
            .ok_or_else(|| GgufError::MissingTensor { name: name.into() })
    }
}

/// A tensor of a [`Gguf`] file: its shape, type and bytes.
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a> {
    name: &'a str,
    dims: &'a [u64],
    ty: GgmlType,
    offset: u64,
    data: &'a [u8],
}

impl<'a> Tensor<'a> {
    /// The name, e.g. `blk.0.ffn_up_exps.weight`.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The dimensions `ne`, innermost first: `dims()[0]` is the contiguous row length.
    pub fn dims(&self) -> &'a [u64] {
        self.dims
    }

    /// The element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ty
    }

    /// Absolute byte offset of the data in the file.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Size of the data in bytes.
    pub fn size(&self) -> u64 {
        self.data.len() as u64
    }

    /// The data, borrowed from the file.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// The number of elements (product of the dimensions).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The number of rows (product of all dimensions but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        let ne0 = self.dims.first().copied().unwrap_or(1) as usize;
        // ne[0] was checked to be a whole number of blocks whose size fits.
        self.ty.row_bytes(ne0).expect(INVARIANT)
    }
}
