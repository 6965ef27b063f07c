//! The validating pass over a GGUF file's bytes: safe code over a `&[u8]`.
//!
//! It walks the header, metadata and tensor infos once, bounds every count and
//! length by the bytes left before it allocates or loops, and records byte ranges
//! (not copies) in an [`Index`]. Accessors later decode from those ranges.

use std::collections::HashSet;
use std::ops::Range;

use les_core::quant::GgmlType;

use super::error::GgufError;
use super::value::{skip_value, RawError, ValueType};
use super::{DEFAULT_ALIGNMENT, MAX_DIMS, MAX_NAME_LEN};

/// The smallest encoded metadata pair: key length, a one-byte key, type, a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1;
/// The smallest encoded tensor info: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// A read past the end of the bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Eof {
    pub offset: usize,
    pub needed: usize,
    pub available: usize,
}

/// A position in a byte slice with bounds-checked little-endian reads.
#[derive(Clone, Debug)]
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8], pos: usize) -> Self {
        Cursor { buf, pos }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Eof> {
        let rest = self.buf.get(self.pos..).unwrap_or(&[]);
        match rest.get(..n) {
            Some(head) => {
                self.pos += n;
                Ok(head)
            }
            None => Err(Eof {
                offset: self.pos,
                needed: n,
                available: rest.len(),
            }),
        }
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Eof> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8, Eof> {
        Ok(self.array::<1>()?[0])
    }

    pub fn u32(&mut self) -> Result<u32, Eof> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, Eof> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub fn bytes_between(&self, start: usize, end: usize) -> Option<&'a [u8]> {
        self.buf.get(start..end)
    }
}

/// One metadata pair: where its key and value bytes are.
#[derive(Clone, Debug)]
pub(crate) struct KvEntry {
    pub key: Range<usize>,
    pub ty: ValueType,
    /// Offset of the value's encoding, just after the type id.
    pub value: usize,
}

/// One validated tensor info.
#[derive(Clone, Debug)]
pub(crate) struct TensorEntry {
    pub name: Range<usize>,
    pub n_dims: usize,
    pub dims: [u64; MAX_DIMS],
    pub ty: GgmlType,
    /// Offset relative to the data section, as stored.
    pub offset: u64,
    /// Absolute byte offset of the data in the file (set once checked).
    pub start: usize,
    pub size: u64,
}

/// Everything the validating pass learned, as ranges into the bytes.
#[derive(Clone, Debug)]
pub(crate) struct Index {
    pub version: u32,
    pub alignment: u64,
    pub data_offset: usize,
    pub kvs: Vec<KvEntry>,
    /// Indices into `kvs`, sorted by key bytes, for binary search.
    pub kv_order: Vec<usize>,
    pub tensors: Vec<TensorEntry>,
    /// Indices into `tensors`, sorted by name bytes.
    pub tensor_order: Vec<usize>,
}

fn truncated(what: impl Into<String>) -> impl FnOnce(Eof) -> GgufError {
    move |e| GgufError::Truncated {
        what: what.into(),
        offset: e.offset as u64,
        needed: e.needed as u64,
        available: e.available as u64,
    }
}

/// Gives a value-walking failure the key it happened in.
fn in_key(e: RawError, key: &str) -> GgufError {
    match e {
        RawError::Eof(e) => truncated(format!("value of key '{key}'"))(e),
        RawError::TooLarge {
            what,
            value,
            offset,
            limit,
        } => GgufError::TooLarge {
            what: format!("{what} in key '{key}'"),
            value,
            offset: offset as u64,
            limit,
        },
        RawError::BadType { id, offset } => GgufError::BadValueType {
            key: key.to_owned(),
            id,
            offset: offset as u64,
        },
        RawError::TooDeep { offset } => GgufError::TooDeep {
            key: key.to_owned(),
            offset: offset as u64,
        },
    }
}

/// Reads a GGUF string (u64 length, bytes), the length bounded by the bytes left.
fn read_string<'a>(
    c: &mut Cursor<'a>,
    what: &dyn Fn() -> String,
) -> Result<(Range<usize>, &'a [u8]), GgufError> {
    let offset = c.pos();
    let len = c
        .u64()
        .map_err(truncated(format!("length of {}", what())))?;
    let limit = c.remaining();
    let n = usize::try_from(len)
        .ok()
        .filter(|&n| n <= limit)
        .ok_or_else(|| GgufError::TooLarge {
            what: format!("length of {}", what()),
            value: len,
            offset: offset as u64,
            limit: limit as u64,
        })?;
    let start = c.pos();
    let bytes = c.take(n).map_err(truncated(what()))?;
    Ok((start..start + n, bytes))
}

fn utf8<'a>(
    bytes: &'a [u8],
    what: &dyn Fn() -> String,
    offset: usize,
) -> Result<&'a str, GgufError> {
    std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
        what: what(),
        offset: offset as u64,
    })
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    Some(x.checked_add(alignment - 1)? & !(alignment - 1))
}

/// Validates `buf` as a GGUF v2/v3 file and indexes it.
pub(crate) fn parse(buf: &[u8]) -> Result<Index, GgufError> {
    let file_len = buf.len() as u64;
    let mut c = Cursor::new(buf, 0);

    let magic: [u8; 4] = c.array().map_err(truncated("magic"))?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32().map_err(truncated("version"))?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion { version });
    }

    let tensor_count_at = c.pos();
    let n_tensors = c.u64().map_err(truncated("tensor count"))?;
    let kv_count_at = c.pos();
    let n_kv = c.u64().map_err(truncated("metadata key count"))?;

    // Both counts together must fit the bytes left at their minimum encoded sizes.
    let rest = c.remaining() as u64;
    let tensor_limit = rest / MIN_TENSOR_INFO_BYTES;
    if n_tensors > tensor_limit {
        return Err(GgufError::TooLarge {
            what: "tensor count".into(),
            value: n_tensors,
            offset: tensor_count_at as u64,
            limit: tensor_limit,
        });
    }
    let kv_limit = (rest - n_tensors * MIN_TENSOR_INFO_BYTES) / MIN_KV_BYTES;
    if n_kv > kv_limit {
        return Err(GgufError::TooLarge {
            what: "metadata key count".into(),
            value: n_kv,
            offset: kv_count_at as u64,
            limit: kv_limit,
        });
    }
    // Both are now at most buf.len(), so they fit usize.
    let (n_tensors, n_kv) = (n_tensors as usize, n_kv as usize);

    let kvs = parse_kvs(&mut c, n_kv)?;
    let alignment = alignment(buf, &kvs)?;
    let mut tensors = parse_tensor_infos(&mut c, n_tensors)?;

    // As llama.cpp: the data section is aligned only when there are tensors.
    let data_offset = if n_tensors > 0 {
        let at = align_up(c.pos() as u64, alignment).unwrap_or(u64::MAX);
        if at > file_len {
            return Err(GgufError::DataSectionOutOfBounds {
                offset: at,
                file_len,
            });
        }
        at
    } else {
        c.pos() as u64
    };

    place_tensors(buf, &mut tensors, data_offset, alignment)?;

    let mut kv_order: Vec<usize> = (0..kvs.len()).collect();
    kv_order.sort_unstable_by_key(|&i| buf.get(kvs[i].key.clone()));
    let mut tensor_order: Vec<usize> = (0..tensors.len()).collect();
    tensor_order.sort_unstable_by_key(|&i| buf.get(tensors[i].name.clone()));

    Ok(Index {
        version,
        alignment,
        // At most file_len, checked above.
        data_offset: data_offset as usize,
        kvs,
        kv_order,
        tensors,
        tensor_order,
    })
}

fn parse_kvs(c: &mut Cursor<'_>, n_kv: usize) -> Result<Vec<KvEntry>, GgufError> {
    let mut kvs = Vec::with_capacity(n_kv);
    let mut seen: HashSet<&[u8]> = HashSet::with_capacity(n_kv);
    for i in 0..n_kv {
        let key_at = c.pos();
        let what = || format!("metadata key #{i}");
        let (range, bytes) = read_string(c, &what)?;
        if bytes.is_empty() {
            return Err(GgufError::EmptyKey {
                offset: key_at as u64,
            });
        }
        let key = utf8(bytes, &what, range.start)?;
        if !seen.insert(bytes) {
            return Err(GgufError::DuplicateKey {
                key: key.to_owned(),
                offset: key_at as u64,
            });
        }
        let type_at = c.pos();
        let id = c
            .u32()
            .map_err(truncated(format!("value type of key '{key}'")))?;
        let ty = ValueType::from_id(id).ok_or_else(|| GgufError::BadValueType {
            key: key.to_owned(),
            id,
            offset: type_at as u64,
        })?;
        let value = c.pos();
        skip_value(c, ty, 0).map_err(|e| in_key(e, key))?;
        kvs.push(KvEntry {
            key: range,
            ty,
            value,
        });
    }
    Ok(kvs)
}

/// `general.alignment`: any integer width, a power of two that fits `u32`.
fn alignment(buf: &[u8], kvs: &[KvEntry]) -> Result<u64, GgufError> {
    const KEY: &[u8] = b"general.alignment";
    let Some(kv) = kvs.iter().find(|kv| buf.get(kv.key.clone()) == Some(KEY)) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let value = super::value::read_value(&mut Cursor::new(buf, kv.value), kv.ty);
    let Some(value) = value else {
        return Err(GgufError::BadAlignment {
            detail: "unreadable".into(),
        });
    };
    match value.as_integer() {
        Some(a) if a > 0 && a <= i128::from(u32::MAX) && (a & (a - 1)) == 0 => Ok(a as u64),
        Some(a) => Err(GgufError::BadAlignment {
            detail: format!("{a} is not a power of two that fits u32"),
        }),
        None => Err(GgufError::BadAlignment {
            detail: format!("is a {}, expected an integer", value.value_type()),
        }),
    }
}

fn parse_tensor_infos(c: &mut Cursor<'_>, n_tensors: usize) -> Result<Vec<TensorEntry>, GgufError> {
    let mut tensors = Vec::with_capacity(n_tensors);
    let mut seen: HashSet<&[u8]> = HashSet::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let info_at = c.pos();
        let what = || format!("name of tensor #{i}");
        let (range, bytes) = read_string(c, &what)?;
        let name = utf8(bytes, &what, range.start)?;
        if name.len() > MAX_NAME_LEN {
            return Err(GgufError::NameTooLong {
                tensor: name.to_owned(),
                offset: info_at as u64,
            });
        }
        if !seen.insert(bytes) {
            return Err(GgufError::DuplicateTensor {
                tensor: name.to_owned(),
                offset: info_at as u64,
            });
        }

        let dims_at = c.pos();
        let n_dims = c
            .u32()
            .map_err(truncated(format!("dimension count of tensor '{name}'")))?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name.to_owned(),
                n_dims,
                offset: dims_at as u64,
            });
        }
        let n_dims = n_dims as usize;
        let mut dims = [1u64; MAX_DIMS];
        for (j, d) in dims.iter_mut().enumerate().take(n_dims) {
            *d = c
                .u64()
                .map_err(truncated(format!("dimension {j} of tensor '{name}'")))?;
            // ggml stores dimensions as int64_t.
            if *d > i64::MAX as u64 {
                return Err(GgufError::BadDim {
                    tensor: name.to_owned(),
                    dim: j,
                    value: *d,
                });
            }
        }
        let overflow = || GgufError::SizeOverflow {
            tensor: name.to_owned(),
            dims: dims[..n_dims].to_vec(),
        };
        // The element count, and the row count on its own (a zero-length row does
        // not excuse an overflowing row count), must fit int64_t.
        let product = |ds: &[u64]| {
            ds.iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64)
        };
        let n_elements = product(&dims).ok_or_else(overflow)?;
        product(&dims[1..]).ok_or_else(overflow)?;

        let id = c
            .u32()
            .map_err(truncated(format!("type of tensor '{name}'")))?;
        let ty = GgmlType::from_id(id).map_err(|_| GgufError::UnknownType {
            tensor: name.to_owned(),
            id,
        })?;
        if dims[0] % ty.block_elems() as u64 != 0 {
            return Err(GgufError::NotBlockMultiple {
                tensor: name.to_owned(),
                ne0: dims[0],
                ty,
            });
        }
        usize::try_from(dims[0])
            .ok()
            .and_then(|ne0| ty.row_bytes(ne0))
            .ok_or_else(overflow)?;
        let size = (n_elements / ty.block_elems() as u64)
            .checked_mul(ty.block_bytes() as u64)
            .ok_or_else(overflow)?;
        let offset = c
            .u64()
            .map_err(truncated(format!("data offset of tensor '{name}'")))?;

        tensors.push(TensorEntry {
            name: range,
            n_dims,
            dims,
            ty,
            offset,
            start: 0,
            size,
        });
    }
    Ok(tensors)
}

/// Checks each tensor starts where the previous padded one ends (as llama.cpp
/// requires, which implies alignment and no overlap) and ends inside the file,
/// then records its absolute start.
fn place_tensors(
    buf: &[u8],
    tensors: &mut [TensorEntry],
    data_offset: u64,
    alignment: u64,
) -> Result<(), GgufError> {
    let file_len = buf.len() as u64;
    let name = |t: &TensorEntry| {
        String::from_utf8_lossy(buf.get(t.name.clone()).unwrap_or_default()).into_owned()
    };
    let mut expected = 0u64;
    for t in tensors.iter_mut() {
        let (offset, size) = (t.offset, t.size);
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                tensor: name(t),
                offset,
                alignment,
            });
        }
        if offset != expected {
            return Err(GgufError::UnexpectedOffset {
                tensor: name(t),
                offset,
                expected,
            });
        }
        let start = data_offset.saturating_add(offset);
        let end = start.saturating_add(size);
        if end > file_len {
            return Err(GgufError::TensorOutOfBounds {
                tensor: name(t),
                start,
                end,
                file_len,
            });
        }
        // Both now lie inside the file, so they fit usize and cannot overflow below.
        t.start = start as usize;
        expected = offset.saturating_add(align_up(size, alignment).unwrap_or(u64::MAX));
    }
    Ok(())
}
