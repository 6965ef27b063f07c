//! The one error type of the GGUF reader, accessors and writer.

use std::fmt;
use std::io;
use std::path::PathBuf;

use les_core::quant::GgmlType;

use super::ValueType;

/// What went wrong reading, querying or writing a GGUF file, and where.
///
/// Every variant's `Display` is one line that names the offending key, tensor or
/// byte offset, so a CLI can print it as is.
#[derive(Debug)]
#[non_exhaustive]
pub enum GgufError {
    /// Opening, mapping, reading or writing a file failed.
    Io {
        /// The file, when known.
        path: Option<PathBuf>,
        /// The underlying error.
        source: io::Error,
    },
    /// The file does not start with `GGUF`.
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A version other than 2 or 3.
    UnsupportedVersion {
        /// The version field as read (little-endian).
        version: u32,
    },
    /// The data ends inside a fixed-size field.
    Truncated {
        /// The field being read.
        what: String,
        /// Byte offset of the field.
        offset: u64,
        /// Bytes the field needs.
        needed: u64,
        /// Bytes left in the file at `offset`.
        available: u64,
    },
    /// A count or length is larger than the remaining bytes could possibly hold.
    TooLarge {
        /// The count or length being read.
        what: String,
        /// The value read.
        value: u64,
        /// Byte offset of the count.
        offset: u64,
        /// The largest value the rest of the file allows.
        limit: u64,
    },
    /// A metadata key of length zero.
    EmptyKey {
        /// Byte offset of the key.
        offset: u64,
    },
    /// A key, tensor name or string value that is not UTF-8.
    InvalidUtf8 {
        /// The string being read.
        what: String,
        /// Byte offset of its first byte.
        offset: u64,
    },
    /// The same metadata key twice.
    DuplicateKey {
        /// The key.
        key: String,
        /// Byte offset of the second occurrence.
        offset: u64,
    },
    /// A value type id outside 0..=12.
    BadValueType {
        /// The key whose value has it.
        key: String,
        /// The id read.
        id: u32,
        /// Byte offset of the id.
        offset: u64,
    },
    /// Arrays nested deeper than [`super::MAX_ARRAY_DEPTH`].
    TooDeep {
        /// The key whose value it is.
        key: String,
        /// Byte offset of the innermost array.
        offset: u64,
    },
    /// `general.alignment` is not a power of two that fits `u32`.
    BadAlignment {
        /// What is wrong with it.
        detail: String,
    },
    /// A tensor name longer than ggml's limit ([`super::MAX_NAME_LEN`] bytes).
    NameTooLong {
        /// The name.
        tensor: String,
        /// Byte offset of the name.
        offset: u64,
    },
    /// The same tensor name twice.
    DuplicateTensor {
        /// The name.
        tensor: String,
        /// Byte offset of the second tensor info.
        offset: u64,
    },
    /// More than [`super::MAX_DIMS`] dimensions.
    TooManyDims {
        /// The tensor.
        tensor: String,
        /// The dimension count read.
        n_dims: u32,
        /// Byte offset of the count.
        offset: u64,
    },
    /// A dimension that is negative as ggml's `int64_t`.
    BadDim {
        /// The tensor.
        tensor: String,
        /// Which dimension.
        dim: usize,
        /// The value read.
        value: u64,
    },
    /// A ggml type id that LES does not know.
    UnknownType {
        /// The tensor.
        tensor: String,
        /// The id read.
        id: u32,
    },
    /// `ne[0]` is not a whole number of blocks of the tensor's type.
    NotBlockMultiple {
        /// The tensor.
        tensor: String,
        /// Its row length.
        ne0: u64,
        /// Its type.
        ty: GgmlType,
    },
    /// The element count or byte size of a tensor overflows.
    SizeOverflow {
        /// The tensor.
        tensor: String,
        /// Its dimensions.
        dims: Vec<u64>,
    },
    /// A tensor offset that is not a multiple of the alignment.
    MisalignedTensor {
        /// The tensor.
        tensor: String,
        /// Its offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// A tensor that does not start right after the previous one (as llama.cpp requires).
    UnexpectedOffset {
        /// The tensor.
        tensor: String,
        /// Its offset relative to the data section.
        offset: u64,
        /// The offset the previous tensors imply.
        expected: u64,
    },
    /// A tensor whose bytes extend past the end of the file.
    TensorOutOfBounds {
        /// The tensor.
        tensor: String,
        /// First byte, absolute.
        start: u64,
        /// One past the last byte, absolute.
        end: u64,
        /// The file length.
        file_len: u64,
    },
    /// The aligned data section would start past the end of the file.
    DataSectionOutOfBounds {
        /// Where it would start.
        offset: u64,
        /// The file length.
        file_len: u64,
    },
    /// A metadata key that is not present.
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value of another type than the accessor wants.
    WrongType {
        /// The key.
        key: String,
        /// What the accessor accepts.
        expected: &'static str,
        /// What the file holds.
        found: ValueType,
    },
    /// An integer metadata value that does not fit the accessor's type.
    OutOfRange {
        /// The key.
        key: String,
        /// The value, printed.
        value: String,
        /// The accessor's type.
        target: &'static str,
    },
    /// No tensor of that name.
    MissingTensor {
        /// The name.
        name: String,
    },
    /// The writer was used in a way that cannot produce a valid file.
    InvalidWrite {
        /// What is wrong.
        detail: String,
    },
}

impl GgufError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        GgufError::Io {
            path: Some(path.into()),
            source,
        }
    }

    pub(crate) fn invalid_write(detail: impl Into<String>) -> Self {
        GgufError::InvalidWrite {
            detail: detail.into(),
        }
    }
}

impl From<io::Error> for GgufError {
    fn from(source: io::Error) -> Self {
        GgufError::Io { path: None, source }
    }
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use GgufError::*;
        match self {
            Io {
                path: Some(p),
                source,
            } => write!(f, "{}: {source}", p.display()),
            Io { path: None, source } => write!(f, "{source}"),
            BadMagic { found } => write!(
                f,
                "not a GGUF file: magic is {:?}, expected \"GGUF\"",
                String::from_utf8_lossy(found)
            ),
            UnsupportedVersion { version } if *version != 0 && version & 0xffff == 0 => write!(
                f,
                "GGUF version {version:#x} looks byte-swapped: big-endian files are not supported"
            ),
            UnsupportedVersion { version } => write!(
                f,
                "unsupported GGUF version {version} (only 2 and 3 are read)"
            ),
            Truncated {
                what,
                offset,
                needed,
                available,
            } => write!(
                f,
                "file truncated: {what} at byte {offset} needs {needed} bytes, {available} left"
            ),
            TooLarge {
                what,
                value,
                offset,
                limit,
            } => write!(
                f,
                "{what} at byte {offset} is {value}, more than the remaining bytes can hold (at most {limit})"
            ),
            EmptyKey { offset } => write!(f, "empty metadata key at byte {offset}"),
            InvalidUtf8 { what, offset } => write!(f, "{what} at byte {offset} is not UTF-8"),
            DuplicateKey { key, offset } => {
                write!(f, "duplicate metadata key '{key}' at byte {offset}")
            }
            BadValueType { key, id, offset } => {
                write!(f, "key '{key}': invalid value type {id} at byte {offset}")
            }
            TooDeep { key, offset } => write!(
                f,
                "key '{key}': arrays nested deeper than {} at byte {offset}",
                super::MAX_ARRAY_DEPTH
            ),
            BadAlignment { detail } => write!(f, "general.alignment: {detail}"),
            NameTooLong { tensor, offset } => write!(
                f,
                "tensor name '{tensor}' at byte {offset} is {} bytes, longer than {}",
                tensor.len(),
                super::MAX_NAME_LEN
            ),
            DuplicateTensor { tensor, offset } => {
                write!(f, "duplicate tensor name '{tensor}' at byte {offset}")
            }
            TooManyDims {
                tensor,
                n_dims,
                offset,
            } => write!(
                f,
                "tensor '{tensor}': {n_dims} dimensions at byte {offset}, at most {} allowed",
                super::MAX_DIMS
            ),
            BadDim { tensor, dim, value } => write!(
                f,
                "tensor '{tensor}': dimension {dim} is {value}, negative as a signed 64-bit count"
            ),
            UnknownType { tensor, id } => {
                write!(f, "tensor '{tensor}': unsupported ggml type id {id}")
            }
            NotBlockMultiple { tensor, ne0, ty } => write!(
                f,
                "tensor '{tensor}': row length {ne0} is not a multiple of the {ty} block size {}",
                ty.block_elems()
            ),
            SizeOverflow { tensor, dims } => {
                write!(f, "tensor '{tensor}': size of dimensions {dims:?} overflows")
            }
            MisalignedTensor {
                tensor,
                offset,
                alignment,
            } => write!(
                f,
                "tensor '{tensor}': offset {offset} is not a multiple of the alignment {alignment}"
            ),
            UnexpectedOffset {
                tensor,
                offset,
                expected,
            } => write!(
                f,
                "tensor '{tensor}': offset {offset}, expected {expected} (tensors must be stored in order, each padded to the alignment)"
            ),
            TensorOutOfBounds {
                tensor,
                start,
                end,
                file_len,
            } => write!(
                f,
                "tensor '{tensor}': bytes {start}..{end} lie outside the file ({file_len} bytes)"
            ),
            DataSectionOutOfBounds { offset, file_len } => write!(
                f,
                "data section would start at byte {offset}, past the end of the file ({file_len} bytes)"
            ),
            MissingKey { key } => write!(f, "metadata key '{key}' not found"),
            WrongType {
                key,
                expected,
                found,
            } => write!(f, "metadata key '{key}' is {found}, expected {expected}"),
            OutOfRange { key, value, target } => {
                write!(f, "metadata key '{key}': value {value} does not fit {target}")
            }
            MissingTensor { name } => write!(f, "tensor '{name}' not found"),
            InvalidWrite { detail } => write!(f, "cannot write GGUF: {detail}"),
        }
    }
}

impl std::error::Error for GgufError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            GgufError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Turns a missing key into `None`, for optional metadata:
/// `gguf.get_u32("llama.expert_count").optional()?`.
pub trait OptionalKey<T> {
    /// `Ok(None)` for [`GgufError::MissingKey`], any other error unchanged.
    fn optional(self) -> Result<Option<T>, GgufError>;
}

impl<T> OptionalKey<T> for Result<T, GgufError> {
    fn optional(self) -> Result<Option<T>, GgufError> {
        match self {
            Ok(v) => Ok(Some(v)),
            Err(GgufError::MissingKey { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}
