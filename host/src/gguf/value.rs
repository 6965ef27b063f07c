//! Metadata values: the 13 GGUF value types, zero-copy views for reading
//! ([`Value`], [`ArrayView`]) and owned values for writing ([`MetaValue`]).

use std::fmt;

use super::error::GgufError;
use super::parse::{Cursor, Eof};
use super::MAX_ARRAY_DEPTH;

/// A GGUF metadata value type, with the id the file stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(missing_docs)] // The names say it.
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// Every type, in id order.
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The type with id `id`, if any.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.get(usize::try_from(id).ok()?).copied()
    }

    /// The id GGUF stores.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// Encoded size of a value of this type, if fixed (not string or array).
    pub const fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The fewest bytes one value of this type can take: what bounds array counts.
    pub(crate) const fn min_size(self) -> usize {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            _ => match self.fixed_size() {
                Some(n) => n,
                None => 1,
            },
        }
    }

    /// A short name: `u8`, ..., `f64`, `string`, `array`.
    pub const fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// Whether the type is one of the eight integer types.
    pub const fn is_integer(self) -> bool {
        use ValueType::*;
        matches!(self, U8 | I8 | U16 | I16 | U32 | I32 | U64 | I64)
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value, borrowed from the file's bytes.
///
/// Strings are the raw bytes: GGUF means them to be UTF-8, but real vocabularies
/// contain tokens that are not, so [`Value::as_str`] checks on access.
#[derive(Clone, Copy, Debug, PartialEq)]
#[allow(missing_docs)] // One variant per ValueType.
pub enum Value<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(&'a [u8]),
    Array(ArrayView<'a>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl<'a> Value<'a> {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer type, as `i128` (wide enough for all of them).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer type whose value fits `u64` (writers differ in the width they use).
    pub fn as_u64(&self) -> Option<u64> {
        self.as_integer().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer type whose value fits `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_integer().and_then(|v| i64::try_from(v).ok())
    }

    /// `f32` or `f64` (narrowed).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// `f32` (widened) or `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string that is valid UTF-8.
    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Value::String(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// A string's raw bytes.
    pub fn as_bytes(&self) -> Option<&'a [u8]> {
        match *self {
            Value::String(b) => Some(b),
            _ => None,
        }
    }

    /// An array.
    pub fn as_array(&self) -> Option<ArrayView<'a>> {
        match *self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// An owned copy, e.g. to carry metadata over into a [`super::GgufWriter`].
    pub fn to_meta(&self) -> MetaValue {
        match *self {
            Value::U8(v) => MetaValue::U8(v),
            Value::I8(v) => MetaValue::I8(v),
            Value::U16(v) => MetaValue::U16(v),
            Value::I16(v) => MetaValue::I16(v),
            Value::U32(v) => MetaValue::U32(v),
            Value::I32(v) => MetaValue::I32(v),
            Value::F32(v) => MetaValue::F32(v),
            Value::Bool(v) => MetaValue::Bool(v),
            Value::String(b) => MetaValue::String(b.to_vec()),
            // Nested arrays item by item; others as the file encodes them (a
            // vocabulary's strings, a u8 array: one copy of their bytes, not an
            // owned value per element).
            Value::Array(a) if a.elem == ValueType::Array => MetaValue::Array(MetaArray {
                elem: a.elem,
                items: Items::Values(a.iter().map(|v| v.to_meta()).collect()),
            }),
            Value::Array(a) => MetaValue::Array(MetaArray {
                elem: a.elem,
                items: Items::Encoded {
                    len: a.len,
                    bytes: a.bytes.to_vec(),
                },
            }),
            Value::U64(v) => MetaValue::U64(v),
            Value::I64(v) => MetaValue::I64(v),
            Value::F64(v) => MetaValue::F64(v),
        }
    }
}

/// A metadata array, borrowed from the file: elements are decoded as they are
/// visited, so a 150k-entry vocabulary costs nothing until it is read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArrayView<'a> {
    elem: ValueType,
    len: usize,
    /// Exactly the encoded elements, validated by the parser.
    bytes: &'a [u8],
}

impl<'a> ArrayView<'a> {
    /// The element type.
    pub fn elem_type(&self) -> ValueType {
        self.elem
    }

    /// The element count.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements in order.
    pub fn iter(&self) -> ArrayIter<'a> {
        ArrayIter {
            elem: self.elem,
            left: self.len,
            cursor: Cursor::new(self.bytes, 0),
        }
    }

    /// Element `i`: constant time for fixed-size types, linear for strings and arrays.
    pub fn get(&self, i: usize) -> Option<Value<'a>> {
        if i >= self.len {
            return None;
        }
        match self.elem.fixed_size() {
            Some(size) => {
                let mut c = Cursor::new(self.bytes, i.checked_mul(size)?);
                read_value(&mut c, self.elem)
            }
            None => self.iter().nth(i),
        }
    }

    /// Every element as a UTF-8 string, or `None` if the elements are not
    /// strings or one is not UTF-8.
    pub fn to_strs(&self) -> Option<Vec<&'a str>> {
        if self.elem != ValueType::String {
            return None;
        }
        self.iter().map(|v| v.as_str()).collect()
    }
}

impl<'a> IntoIterator for ArrayView<'a> {
    type Item = Value<'a>;
    type IntoIter = ArrayIter<'a>;
    fn into_iter(self) -> ArrayIter<'a> {
        self.iter()
    }
}

/// Iterator over an [`ArrayView`].
#[derive(Clone, Debug)]
pub struct ArrayIter<'a> {
    elem: ValueType,
    left: usize,
    cursor: Cursor<'a>,
}

impl<'a> Iterator for ArrayIter<'a> {
    type Item = Value<'a>;

    fn next(&mut self) -> Option<Value<'a>> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let v = read_value(&mut self.cursor, self.elem);
        if v.is_none() {
            // Only reachable if the bytes were not validated; stop cleanly.
            self.left = 0;
        }
        v
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for ArrayIter<'_> {}

/// A low-level failure while walking value bytes; the parser adds the context.
#[derive(Debug)]
pub(crate) enum RawError {
    Eof(Eof),
    TooLarge {
        what: &'static str,
        value: u64,
        offset: usize,
        limit: u64,
    },
    BadType {
        id: u32,
        offset: usize,
    },
    TooDeep {
        offset: usize,
    },
}

impl From<Eof> for RawError {
    fn from(e: Eof) -> Self {
        RawError::Eof(e)
    }
}

/// Reads a string length and checks the remaining bytes can hold it.
fn read_len(c: &mut Cursor<'_>, what: &'static str, unit: usize) -> Result<usize, RawError> {
    let offset = c.pos();
    let value = c.u64()?;
    let limit = c.remaining() / unit.max(1);
    match usize::try_from(value) {
        Ok(n) if n <= limit => Ok(n),
        _ => Err(RawError::TooLarge {
            what,
            value,
            offset,
            limit: limit as u64,
        }),
    }
}

/// Reads an array's element type and count, the count bounded by what the
/// remaining bytes can hold at the element type's minimum size.
pub(crate) fn read_array_header(c: &mut Cursor<'_>) -> Result<(ValueType, usize), RawError> {
    let offset = c.pos();
    let id = c.u32()?;
    let elem = ValueType::from_id(id).ok_or(RawError::BadType { id, offset })?;
    let n = read_len(c, "array length", elem.min_size())?;
    Ok((elem, n))
}

/// Advances over one encoded value of type `ty`, checking every length and
/// type id; `depth` is how many arrays enclose it.
pub(crate) fn skip_value(c: &mut Cursor<'_>, ty: ValueType, depth: usize) -> Result<(), RawError> {
    if let Some(n) = ty.fixed_size() {
        c.take(n)?;
        return Ok(());
    }
    if ty == ValueType::String {
        let n = read_len(c, "string length", 1)?;
        c.take(n)?;
        return Ok(());
    }
    if depth >= MAX_ARRAY_DEPTH {
        return Err(RawError::TooDeep { offset: c.pos() });
    }
    let (elem, n) = read_array_header(c)?;
    match elem.fixed_size() {
        // Cannot overflow: read_array_header bounded n by remaining / size.
        Some(size) => {
            c.take(n * size)?;
        }
        None => {
            for _ in 0..n {
                skip_value(c, elem, depth + 1)?;
            }
        }
    }
    Ok(())
}

/// Decodes one value of type `ty` at the cursor; `None` if the bytes are invalid
/// (which validated bytes never are).
pub(crate) fn read_value<'a>(c: &mut Cursor<'a>, ty: ValueType) -> Option<Value<'a>> {
    Some(match ty {
        ValueType::U8 => Value::U8(c.u8().ok()?),
        ValueType::I8 => Value::I8(c.u8().ok()? as i8),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array().ok()?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array().ok()?)),
        ValueType::U32 => Value::U32(c.u32().ok()?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array().ok()?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array().ok()?)),
        // As llama.cpp: any non-zero byte is true.
        ValueType::Bool => Value::Bool(c.u8().ok()? != 0),
        ValueType::String => {
            let n = read_len(c, "string length", 1).ok()?;
            Value::String(c.take(n).ok()?)
        }
        ValueType::Array => {
            let (elem, len) = read_array_header(c).ok()?;
            let start = c.pos();
            match elem.fixed_size() {
                Some(size) => {
                    c.take(len * size).ok()?;
                }
                None => {
                    for _ in 0..len {
                        skip_value(c, elem, 1).ok()?;
                    }
                }
            }
            let bytes = c.bytes_between(start, c.pos())?;
            Value::Array(ArrayView { elem, len, bytes })
        }
        ValueType::U64 => Value::U64(c.u64().ok()?),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array().ok()?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array().ok()?)),
    })
}

/// An owned metadata value, for [`super::GgufWriter`].
///
/// Scalars, strings (`&str`, `String`) and vectors of them convert with `From`:
/// `writer.add_kv("llama.block_count", 32u32)`.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // One variant per ValueType.
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    /// The string's bytes, kept as they are (GGUF means them to be UTF-8).
    String(Vec<u8>),
    Array(MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValue::U8(_) => ValueType::U8,
            MetaValue::I8(_) => ValueType::I8,
            MetaValue::U16(_) => ValueType::U16,
            MetaValue::I16(_) => ValueType::I16,
            MetaValue::U32(_) => ValueType::U32,
            MetaValue::I32(_) => ValueType::I32,
            MetaValue::F32(_) => ValueType::F32,
            MetaValue::Bool(_) => ValueType::Bool,
            MetaValue::String(_) => ValueType::String,
            MetaValue::Array(_) => ValueType::Array,
            MetaValue::U64(_) => ValueType::U64,
            MetaValue::I64(_) => ValueType::I64,
            MetaValue::F64(_) => ValueType::F64,
        }
    }

    /// An array of strings.
    pub fn strings<I, S>(items: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        MetaValue::Array(MetaArray {
            elem: ValueType::String,
            items: Items::Values(
                items
                    .into_iter()
                    .map(|s| MetaValue::String(s.into().into_bytes()))
                    .collect(),
            ),
        })
    }

    /// Nesting depth of arrays (0 for a scalar or string).
    pub(crate) fn depth(&self) -> usize {
        match self {
            MetaValue::Array(a) => match &a.items {
                Items::Values(v) => 1 + v.iter().map(|v| v.depth()).max().unwrap_or(0),
                // Never of arrays (see `Value::to_meta`).
                Items::Encoded { .. } => 1,
            },
            _ => 0,
        }
    }

    /// The length of [`encode`](Self::encode)'s bytes.
    pub(crate) fn encoded_len(&self) -> u64 {
        match self {
            MetaValue::U8(_) | MetaValue::I8(_) | MetaValue::Bool(_) => 1,
            MetaValue::U16(_) | MetaValue::I16(_) => 2,
            MetaValue::U32(_) | MetaValue::I32(_) | MetaValue::F32(_) => 4,
            MetaValue::U64(_) | MetaValue::I64(_) | MetaValue::F64(_) => 8,
            MetaValue::String(s) => 8 + s.len() as u64,
            MetaValue::Array(a) => {
                4 + 8
                    + match &a.items {
                        Items::Values(v) => v.iter().map(MetaValue::encoded_len).sum(),
                        Items::Encoded { bytes, .. } => bytes.len() as u64,
                    }
            }
        }
    }

    /// Appends the encoded value (without its type id) to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        match self {
            MetaValue::U8(v) => out.push(*v),
            MetaValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::Bool(v) => out.push(u8::from(*v)),
            MetaValue::String(s) => encode_str(s, out),
            MetaValue::Array(a) => {
                out.extend_from_slice(&a.elem.id().to_le_bytes());
                out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                match &a.items {
                    Items::Values(v) => v.iter().for_each(|item| item.encode(out)),
                    Items::Encoded { bytes, .. } => out.extend_from_slice(bytes),
                }
            }
            MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
}

/// Appends a GGUF string (u64 length, bytes) to `out`.
pub(crate) fn encode_str(s: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

/// An owned array whose items all have the element type (checked on construction).
#[derive(Clone, Debug)]
pub struct MetaArray {
    elem: ValueType,
    items: Items,
}

/// A [`MetaArray`]'s items.
#[derive(Clone, Debug)]
enum Items {
    Values(Vec<MetaValue>),
    /// `len` items of a type other than array, encoded as in a GGUF file: an
    /// array copied from one ([`Value::to_meta`]), whose parser validated them.
    Encoded {
        len: usize,
        bytes: Vec<u8>,
    },
}

impl MetaArray {
    /// An array of `elem` items; an error if an item has another type. Nested
    /// arrays (`elem` = [`ValueType::Array`]) may each have their own element type.
    pub fn new(elem: ValueType, items: Vec<MetaValue>) -> Result<Self, GgufError> {
        if let Some((i, v)) = items
            .iter()
            .enumerate()
            .find(|(_, v)| v.value_type() != elem)
        {
            return Err(GgufError::invalid_write(format!(
                "array of {elem} has a {} at index {i}",
                v.value_type()
            )));
        }
        Ok(MetaArray {
            elem,
            items: Items::Values(items),
        })
    }

    /// The element type.
    pub fn elem_type(&self) -> ValueType {
        self.elem
    }

    /// The number of items.
    pub fn len(&self) -> usize {
        match &self.items {
            Items::Values(v) => v.len(),
            Items::Encoded { len, .. } => *len,
        }
    }

    /// Whether the array has no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The items, in order (decoded one by one where the array was copied from
    /// a file).
    pub fn items(&self) -> Box<dyn Iterator<Item = MetaValue> + '_> {
        match &self.items {
            Items::Values(v) => Box::new(v.iter().cloned()),
            Items::Encoded { len, bytes } => Box::new(
                ArrayView {
                    elem: self.elem,
                    len: *len,
                    bytes,
                }
                .iter()
                .map(|v| v.to_meta()),
            ),
        }
    }
}

/// Arrays are equal when their types and items are, however they are stored.
impl PartialEq for MetaArray {
    fn eq(&self, other: &Self) -> bool {
        self.elem == other.elem && self.len() == other.len() && self.items().eq(other.items())
    }
}

impl From<MetaArray> for MetaValue {
    fn from(a: MetaArray) -> Self {
        MetaValue::Array(a)
    }
}

impl From<&str> for MetaValue {
    fn from(s: &str) -> Self {
        MetaValue::String(s.as_bytes().to_vec())
    }
}

impl From<String> for MetaValue {
    fn from(s: String) -> Self {
        MetaValue::String(s.into_bytes())
    }
}

impl From<Vec<String>> for MetaValue {
    fn from(v: Vec<String>) -> Self {
        MetaValue::strings(v)
    }
}

impl From<Vec<&str>> for MetaValue {
    fn from(v: Vec<&str>) -> Self {
        MetaValue::strings(v)
    }
}

macro_rules! scalar_meta {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for MetaValue {
            fn from(v: $t) -> Self {
                MetaValue::$variant(v)
            }
        }
        impl From<Vec<$t>> for MetaValue {
            fn from(v: Vec<$t>) -> Self {
                MetaValue::Array(MetaArray {
                    elem: ValueType::$variant,
                    items: Items::Values(v.into_iter().map(MetaValue::$variant).collect()),
                })
            }
        }
    )*};
}

scalar_meta!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, u64 => U64, i64 => I64, f64 => F64,
);
