//! Writing GGUF v3: metadata and tensor infos first, then tensor data streamed
//! one tensor at a time, so a multi-gigabyte file is written in bounded memory.

use std::collections::HashSet;
use std::io::{self, Read, Write};

use les_core::quant::GgmlType;

use super::error::GgufError;
use super::value::{encode_str, MetaValue};
use super::{DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_NAME_LEN};

/// The key that sets the data alignment.
const ALIGNMENT_KEY: &str = "general.alignment";

#[derive(Clone, Debug)]
struct TensorSpec {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    size: u64,
}

/// Collects metadata and tensor infos, then writes the header with every tensor's
/// offset precomputed; the data follows through [`TensorDataWriter`].
///
/// Only [`Write`] is needed (no `Seek`): tensor sizes follow from their shapes.
///
/// ```
/// # use les::gguf::{GgufWriter, Gguf};
/// # use les_core::quant::GgmlType;
/// let mut w = GgufWriter::new();
/// w.add_kv("general.architecture", "llama")?;
/// w.add_kv("llama.block_count", 1u32)?;
/// w.add_tensor("output_norm.weight", &[4], GgmlType::F32)?;
/// let mut data = w.write_header(Vec::new())?;
/// data.write_tensor("output_norm.weight", &[0u8; 16])?;
/// let bytes = data.finish()?;
/// let g = Gguf::parse(bytes)?;
/// assert_eq!(g.get_u32("llama.block_count")?, 1);
/// # Ok::<(), les::gguf::GgufError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    kvs: Vec<(String, MetaValue)>,
    keys: HashSet<String>,
    tensors: Vec<TensorSpec>,
    names: HashSet<String>,
    alignment: Option<u64>,
}

impl GgufWriter {
    /// An empty file: no metadata, no tensors, alignment 32.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata pair. Keys must be non-empty and unique; arrays may nest
    /// at most [`MAX_ARRAY_DEPTH`] deep; `general.alignment` must be a `u32` power
    /// of two (it sets the data alignment).
    pub fn add_kv(
        &mut self,
        key: impl Into<String>,
        value: impl Into<MetaValue>,
    ) -> Result<&mut Self, GgufError> {
        let key = key.into();
        let value = value.into();
        if key.is_empty() {
            return Err(GgufError::invalid_write("empty metadata key"));
        }
        if self.keys.contains(&key) {
            return Err(GgufError::invalid_write(format!(
                "duplicate metadata key '{key}'"
            )));
        }
        if value.depth() > MAX_ARRAY_DEPTH {
            return Err(GgufError::invalid_write(format!(
                "key '{key}': arrays nested deeper than {MAX_ARRAY_DEPTH}"
            )));
        }
        if key == ALIGNMENT_KEY {
            match value {
                MetaValue::U32(a) if a.is_power_of_two() => self.alignment = Some(a.into()),
                _ => {
                    return Err(GgufError::invalid_write(format!(
                        "{ALIGNMENT_KEY} must be a u32 power of two, got {value:?}"
                    )))
                }
            }
        }
        self.keys.insert(key.clone());
        self.kvs.push((key, value));
        Ok(self)
    }

    /// Adds a tensor info; its data must later be written in the same order.
    /// Returns the tensor's size in bytes.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<u64, GgufError> {
        let name = name.into();
        let bad = |what: String| Err(GgufError::invalid_write(format!("tensor '{name}': {what}")));
        if name.len() > MAX_NAME_LEN {
            return bad(format!("name longer than {MAX_NAME_LEN} bytes"));
        }
        if self.names.contains(&name) {
            return bad("duplicate name".into());
        }
        if dims.len() > MAX_DIMS {
            return bad(format!("{} dimensions, at most {MAX_DIMS}", dims.len()));
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64);
        let Some(n_elements) = n_elements else {
            return bad(format!("element count of {dims:?} overflows"));
        };
        let ne0 = dims.first().copied().unwrap_or(1);
        if ne0 % ty.block_elems() as u64 != 0 {
            return bad(format!(
                "row length {ne0} is not a multiple of the {ty} block size {}",
                ty.block_elems()
            ));
        }
        let Some(size) =
            (n_elements / ty.block_elems() as u64).checked_mul(ty.block_bytes() as u64)
        else {
            return bad("byte size overflows".into());
        };
        self.names.insert(name.clone());
        self.tensors.push(TensorSpec {
            name,
            dims: dims.to_vec(),
            ty,
            size,
        });
        Ok(size)
    }

    /// The data alignment the file will use.
    pub fn alignment(&self) -> u64 {
        self.alignment.unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The header (metadata and tensor infos) as it will be written, without the
    /// padding before the data section.
    fn header(&self) -> Vec<u8> {
        let alignment = self.alignment();
        // Sized once, with room for the padding `write_header` adds: no copies
        // of a large header while it grows.
        let len = self.header_len();
        let mut out = Vec::with_capacity(pad_to(len, alignment).try_into().unwrap_or(0));
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (key, value) in &self.kvs {
            encode_str(key.as_bytes(), &mut out);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            value.encode(&mut out);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            encode_str(t.name.as_bytes(), &mut out);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = offset.saturating_add(pad_to(t.size, alignment));
        }
        out
    }

    /// The length of [`header`](Self::header)'s bytes, without building them.
    fn header_len(&self) -> u64 {
        let kvs: u64 = self
            .kvs
            .iter()
            .map(|(k, v)| 8 + k.len() as u64 + 4 + v.encoded_len())
            .sum();
        let tensors: u64 = self
            .tensors
            .iter()
            .map(|t| 8 + t.name.len() as u64 + 4 + 8 * t.dims.len() as u64 + 4 + 8)
            .sum();
        4 + 4 + 8 + 8 + kvs + tensors
    }

    /// The length of the finished file in bytes.
    pub fn file_len(&self) -> u64 {
        let alignment = self.alignment();
        let header = self.header_len();
        let start = if self.tensors.is_empty() {
            header
        } else {
            pad_to(header, alignment)
        };
        self.tensors.iter().fold(start, |acc, t| {
            acc.saturating_add(pad_to(t.size, alignment))
        })
    }

    /// Writes the header and the padding up to the data section, and returns the
    /// writer that takes the tensor data in order.
    pub fn write_header<W: Write>(self, mut out: W) -> Result<TensorDataWriter<W>, GgufError> {
        let alignment = self.alignment();
        let mut header = self.header();
        debug_assert_eq!(
            header.len() as u64,
            self.header_len(),
            "file_len's arithmetic"
        );
        if !self.tensors.is_empty() {
            let padded = pad_to(header.len() as u64, alignment) as usize;
            header.resize(padded, 0);
        }
        out.write_all(&header)?;
        Ok(TensorDataWriter {
            out,
            tensors: self.tensors,
            next: 0,
            alignment,
        })
    }
}

fn pad_to(n: u64, alignment: u64) -> u64 {
    n.saturating_add(alignment - 1) & !(alignment - 1)
}

/// Takes each tensor's bytes, in the order the infos were added, and pads each
/// to the alignment. Created by [`GgufWriter::write_header`].
#[derive(Debug)]
pub struct TensorDataWriter<W: Write> {
    out: W,
    tensors: Vec<TensorSpec>,
    next: usize,
    alignment: u64,
}

impl<W: Write> TensorDataWriter<W> {
    /// The name and byte size of the tensor whose data comes next.
    pub fn next_tensor(&self) -> Option<(&str, u64)> {
        self.tensors
            .get(self.next)
            .map(|t| (t.name.as_str(), t.size))
    }

    fn expect_next(&self, name: &str) -> Result<u64, GgufError> {
        match self.tensors.get(self.next) {
            Some(t) if t.name == name => Ok(t.size),
            Some(t) => Err(GgufError::invalid_write(format!(
                "data for tensor '{name}' given, but '{}' comes next",
                t.name
            ))),
            None => Err(GgufError::invalid_write(format!(
                "data for tensor '{name}' given, but all tensors are written"
            ))),
        }
    }

    fn pad(&mut self, size: u64) -> Result<(), GgufError> {
        let pad = (pad_to(size, self.alignment) - size) as usize;
        self.out.write_all(&vec![0u8; pad])?;
        self.next += 1;
        Ok(())
    }

    /// Writes the next tensor's data, which must be named `name` and be exactly
    /// its size.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<(), GgufError> {
        let size = self.expect_next(name)?;
        if data.len() as u64 != size {
            return Err(GgufError::invalid_write(format!(
                "tensor '{name}' is {size} bytes, {} given",
                data.len()
            )));
        }
        self.out.write_all(data)?;
        self.pad(size)
    }

    /// Streams the next tensor's data from `src`, which must yield at least its
    /// size in bytes (only that many are read).
    pub fn copy_tensor<R: Read>(&mut self, name: &str, src: R) -> Result<(), GgufError> {
        let size = self.expect_next(name)?;
        let copied = io::copy(&mut src.take(size), &mut self.out)?;
        if copied != size {
            return Err(GgufError::invalid_write(format!(
                "tensor '{name}' is {size} bytes, the source ended after {copied}"
            )));
        }
        self.pad(size)
    }

    /// Checks every tensor was written, flushes, and returns the output.
    pub fn finish(mut self) -> Result<W, GgufError> {
        if let Some((name, _)) = self.next_tensor() {
            return Err(GgufError::invalid_write(format!(
                "finished before the data of tensor '{name}'"
            )));
        }
        self.out.flush()?;
        Ok(self.out)
    }
}
