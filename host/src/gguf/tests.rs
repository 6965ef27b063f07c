//! Unit tests of the parser and writer. Files are built byte by byte with [`Raw`],
//! independently of [`GgufWriter`], so each can check the other.

use super::*;
use proptest::prelude::*;

/// A hand-assembled GGUF file.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    /// A key and value type id; the value follows.
    fn key(&mut self, key: &str, ty: ValueType) -> &mut Self {
        self.str(key).u32(ty.id())
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad(&mut self, alignment: usize) -> &mut Self {
        while !self.0.len().is_multiple_of(alignment) {
            self.0.push(0);
        }
        self
    }
    fn parse(&self) -> Result<Gguf<&[u8]>, GgufError> {
        Gguf::parse(&self.0[..])
    }
}

/// A small valid file: three kvs, two tensors, no trailing padding.
fn small_file() -> Raw {
    let mut r = Raw::new(3, 2, 3);
    r.key("general.architecture", ValueType::String)
        .str("llama");
    r.key("llama.block_count", ValueType::U32).u32(2);
    r.key("tokenizer.ggml.tokens", ValueType::Array)
        .u32(ValueType::String.id())
        .u64(3)
        .str("a")
        .str("bc")
        .str("");
    r.tensor("norm.weight", &[4], 0, 0);
    r.tensor("blk.0.w", &[32, 2], GgmlType::Q4_0.id(), 32);
    r.pad(32);
    r.bytes(&[1; 16]).pad(32).bytes(&[2; 36]);
    r
}

fn err(r: &Raw) -> GgufError {
    r.parse().expect_err("the file should be rejected")
}

#[test]
fn small_file_parses() {
    let r = small_file();
    let g = r.parse().unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.metadata_len(), 3);
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "bc", ""]
    );
    let keys: Vec<&str> = g.metadata().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        [
            "general.architecture",
            "llama.block_count",
            "tokenizer.ggml.tokens"
        ]
    );

    assert_eq!(g.tensor_count(), 2);
    let t = g.tensor("blk.0.w").unwrap();
    assert_eq!(t.name(), "blk.0.w");
    assert_eq!(t.dims(), [32, 2]);
    assert_eq!(t.ggml_type(), GgmlType::Q4_0);
    assert_eq!(t.size(), 36);
    assert_eq!(t.offset(), g.data_offset() + 32);
    assert_eq!(t.data(), [2; 36]);
    assert_eq!(t.n_elements(), 64);
    assert_eq!(t.n_rows(), 2);
    assert_eq!(t.row_bytes(), 18);
    let n = g.tensor("norm.weight").unwrap();
    assert_eq!(n.data(), [1; 16]);
    assert_eq!(n.offset(), g.data_offset());
    assert_eq!(g.data_offset() % 32, 0);
    assert!(g.tensor("missing").is_none());
    assert!(matches!(
        g.require_tensor("missing"),
        Err(GgufError::MissingTensor { .. })
    ));
    let names: Vec<&str> = g.tensors().map(|t| t.name()).collect();
    assert_eq!(names, ["norm.weight", "blk.0.w"]);
}

#[test]
fn version_2_is_read() {
    let mut r = small_file();
    r.0[4] = 2;
    assert_eq!(r.parse().unwrap().version(), 2);
}

#[test]
fn every_value_type() {
    let mut r = Raw::new(3, 0, 13);
    r.key("u8", ValueType::U8).u8(250);
    r.key("i8", ValueType::I8).u8(-5i8 as u8);
    r.key("u16", ValueType::U16).bytes(&60000u16.to_le_bytes());
    r.key("i16", ValueType::I16)
        .bytes(&(-30000i16).to_le_bytes());
    r.key("u32", ValueType::U32).u32(4_000_000_000);
    r.key("i32", ValueType::I32).bytes(&(-7i32).to_le_bytes());
    r.key("f32", ValueType::F32).bytes(&1.5f32.to_le_bytes());
    r.key("bool", ValueType::Bool).u8(1);
    r.key("string", ValueType::String).str("héllo");
    r.key("array", ValueType::Array)
        .u32(ValueType::I16.id())
        .u64(3)
        .bytes(&1i16.to_le_bytes())
        .bytes(&(-2i16).to_le_bytes())
        .bytes(&3i16.to_le_bytes());
    r.key("u64", ValueType::U64).u64(u64::MAX);
    r.key("i64", ValueType::I64).bytes(&i64::MIN.to_le_bytes());
    r.key("f64", ValueType::F64)
        .bytes(&(-0.25f64).to_le_bytes());
    let g = r.parse().unwrap();

    assert_eq!(g.get("u8"), Some(Value::U8(250)));
    assert_eq!(g.get("i8"), Some(Value::I8(-5)));
    assert_eq!(g.get("u16"), Some(Value::U16(60000)));
    assert_eq!(g.get("i16"), Some(Value::I16(-30000)));
    assert_eq!(g.get("u32"), Some(Value::U32(4_000_000_000)));
    assert_eq!(g.get("i32"), Some(Value::I32(-7)));
    assert_eq!(g.get("f32"), Some(Value::F32(1.5)));
    assert_eq!(g.get("bool"), Some(Value::Bool(true)));
    assert_eq!(g.get("string"), Some(Value::String("héllo".as_bytes())));
    assert_eq!(g.get("u64"), Some(Value::U64(u64::MAX)));
    assert_eq!(g.get("i64"), Some(Value::I64(i64::MIN)));
    assert_eq!(g.get("f64"), Some(Value::F64(-0.25)));
    let a = g.get_array("array").unwrap();
    assert_eq!(a.elem_type(), ValueType::I16);
    assert_eq!(a.len(), 3);
    let items: Vec<Value> = a.iter().collect();
    assert_eq!(items, [Value::I16(1), Value::I16(-2), Value::I16(3)]);
    assert_eq!(a.get(1), Some(Value::I16(-2)));
    assert_eq!(a.get(3), None);

    // Typed accessors: any integer width for counts.
    assert_eq!(g.get_u64("u8").unwrap(), 250);
    assert_eq!(g.get_u64("u16").unwrap(), 60000);
    assert_eq!(g.get_u64("u32").unwrap(), 4_000_000_000);
    assert_eq!(g.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(g.get_u32("u8").unwrap(), 250);
    assert_eq!(g.get_i64("i8").unwrap(), -5);
    assert_eq!(g.get_i64("i64").unwrap(), i64::MIN);
    assert_eq!(g.get_f32("f32").unwrap(), 1.5);
    assert_eq!(g.get_f32("f64").unwrap(), -0.25);
    assert!(g.get_bool("bool").unwrap());
    assert_eq!(g.get_str("string").unwrap(), "héllo");

    // Range and type errors name the key.
    let e = g.get_u32("u64").unwrap_err();
    assert!(matches!(e, GgufError::OutOfRange { .. }), "{e}");
    assert!(e.to_string().contains("'u64'"), "{e}");
    assert!(matches!(g.get_u64("i8"), Err(GgufError::OutOfRange { .. })));
    assert!(matches!(
        g.get_u64("u64").map(|_| g.get_i64("u64")),
        Ok(Err(GgufError::OutOfRange { .. }))
    ));
    let e = g.get_f32("string").unwrap_err();
    assert!(matches!(e, GgufError::WrongType { .. }));
    assert!(
        e.to_string().contains("'string'") && e.to_string().contains("f32"),
        "{e}"
    );
    assert!(matches!(g.get_str("u8"), Err(GgufError::WrongType { .. })));
    assert!(matches!(
        g.get_bool("nope"),
        Err(GgufError::MissingKey { .. })
    ));
    assert_eq!(g.get_bool("nope").optional().unwrap(), None);
    assert_eq!(g.get_u32("u8").optional().unwrap(), Some(250));
    assert!(g.get_f32("u8").optional().is_err());
    assert!(matches!(
        g.get_str_array("array"),
        Err(GgufError::WrongType { .. })
    ));
}

#[test]
fn arrays_of_every_element_type() {
    let mut r = Raw::new(3, 0, ValueType::ALL.len() as u64);
    for ty in ValueType::ALL {
        r.key(&format!("a.{ty}"), ValueType::Array)
            .u32(ty.id())
            .u64(2);
        match ty {
            ValueType::String => {
                r.str("x").str("yz");
            }
            ValueType::Array => {
                r.u32(ValueType::U8.id()).u64(1).u8(9);
                r.u32(ValueType::Bool.id()).u64(0);
            }
            _ => {
                let n = ty.fixed_size().unwrap();
                r.bytes(&vec![1; 2 * n]);
            }
        }
    }
    let g = r.parse().unwrap();
    for ty in ValueType::ALL {
        let a = g.get_array(&format!("a.{ty}")).unwrap();
        assert_eq!(a.elem_type(), ty);
        assert_eq!(a.iter().count(), 2);
        assert!(a.iter().all(|v| v.value_type() == ty));
    }
    let nested = g.get_array("a.array").unwrap();
    let inner: Vec<ArrayView> = nested.iter().map(|v| v.as_array().unwrap()).collect();
    assert_eq!(inner[0].iter().collect::<Vec<_>>(), [Value::U8(9)]);
    assert!(inner[1].is_empty());
    assert_eq!(inner[1].elem_type(), ValueType::Bool);
    assert_eq!(
        g.get_array("a.string").unwrap().to_strs().unwrap(),
        ["x", "yz"]
    );
}

/// A value nested `depth` arrays deep: [[...[7u8]...]].
fn nested(r: &mut Raw, depth: usize) {
    for _ in 1..depth {
        r.u32(ValueType::Array.id()).u64(1);
    }
    r.u32(ValueType::U8.id()).u64(1).u8(7);
}

#[test]
fn nested_arrays_and_depth_limit() {
    let mut r = Raw::new(3, 0, 2);
    r.key("strs", ValueType::Array)
        .u32(ValueType::Array.id())
        .u64(2);
    r.u32(ValueType::String.id()).u64(2).str("a").str("b");
    r.u32(ValueType::String.id()).u64(1).str("c");
    r.key("deep", ValueType::Array);
    nested(&mut r, MAX_ARRAY_DEPTH);
    let g = r.parse().unwrap();
    let strs: Vec<Vec<&str>> = g
        .get_array("strs")
        .unwrap()
        .iter()
        .map(|v| v.as_array().unwrap().to_strs().unwrap())
        .collect();
    assert_eq!(strs, [vec!["a", "b"], vec!["c"]]);

    let mut v = g.get("deep").unwrap();
    for _ in 1..MAX_ARRAY_DEPTH {
        v = v.as_array().unwrap().get(0).unwrap();
    }
    assert_eq!(v.as_array().unwrap().get(0), Some(Value::U8(7)));

    let mut r = Raw::new(3, 0, 1);
    r.key("deep", ValueType::Array);
    nested(&mut r, MAX_ARRAY_DEPTH + 1);
    let e = err(&r);
    assert!(matches!(e, GgufError::TooDeep { .. }), "{e}");
    assert!(e.to_string().contains("'deep'"), "{e}");
}

/// A vocabulary-sized string array parses and reads back (what it costs to
/// parse is bounded in `tests/alloc_bound.rs`, with a counting allocator).
#[test]
fn large_string_array_reads_back() {
    let n = 150_000;
    let mut r = Raw::new(3, 0, 1);
    r.key("tokenizer.ggml.tokens", ValueType::Array)
        .u32(ValueType::String.id())
        .u64(n);
    for i in 0..n {
        r.str(&format!("t{i}"));
    }
    let g = r.parse().unwrap();
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), n as usize);
    assert_eq!(tokens[149_999], "t149999");
}

#[test]
fn invalid_utf8_string_values_are_kept() {
    let mut r = Raw::new(3, 0, 2);
    r.key("s", ValueType::String).u64(2).bytes(&[0xff, 0xfe]);
    r.key("a", ValueType::Array)
        .u32(ValueType::String.id())
        .u64(2)
        .str("ok")
        .u64(1)
        .u8(0x80);
    let g = r.parse().unwrap();
    assert_eq!(g.get("s").unwrap().as_bytes(), Some(&[0xff, 0xfe][..]));
    let e = g.get_str("s").unwrap_err();
    assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
    let e = g.get_str_array("a").unwrap_err();
    assert!(e.to_string().contains("element 1 of key 'a'"), "{e}");
}

#[test]
fn every_truncation_is_an_error() {
    let r = small_file();
    assert!(r.parse().is_ok());
    for len in 0..r.0.len() {
        let result = Gguf::parse(&r.0[..len]);
        assert!(result.is_err(), "prefix of {len} bytes parsed");
    }
}

#[test]
fn bad_magic_and_versions() {
    let mut r = small_file();
    r.0[..4].copy_from_slice(b"GGML");
    let e = err(&r);
    assert!(matches!(e, GgufError::BadMagic { .. }));
    assert!(e.to_string().contains("GGML"), "{e}");
    for version in [0, 1, 4, 3 << 24] {
        let mut r = small_file();
        r.0[4..8].copy_from_slice(&u32::to_le_bytes(version));
        let e = err(&r);
        assert!(matches!(e, GgufError::UnsupportedVersion { .. }), "{e}");
    }
    let mut r = small_file();
    r.0[4..8].copy_from_slice(&u32::to_le_bytes(3 << 24));
    assert!(err(&r).to_string().contains("byte-swapped"));
}

#[test]
fn huge_counts_are_rejected_before_allocating() {
    for (n_tensors, n_kv) in [
        (u64::MAX, 0),
        (0, u64::MAX),
        (1 << 40, 1 << 40),
        (2, 0),
        (1, 2),
        (1, 0),
    ] {
        let mut r = Raw::new(3, n_tensors, n_kv);
        r.bytes(&[0; 40]);
        let e = err(&r);
        if (n_tensors, n_kv) == (1, 0) {
            // Plausible counts over too few bytes: an ordinary truncation.
            assert!(!matches!(e, GgufError::TooLarge { .. }), "{e}");
        } else {
            assert!(matches!(e, GgufError::TooLarge { .. }), "{e}");
        }
    }

    // A key length, a string value length and an array count past the end.
    let mut r = Raw::new(3, 0, 1);
    r.u64(u64::MAX).bytes(&[b'k'; 20]);
    let e = err(&r);
    assert!(e.to_string().contains("length of metadata key #0"), "{e}");
    let mut r = Raw::new(3, 0, 1);
    r.key("k", ValueType::String).u64(1 << 60).bytes(b"abc");
    let e = err(&r);
    assert!(matches!(e, GgufError::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("'k'"), "{e}");
    for ty in ValueType::ALL {
        let mut r = Raw::new(3, 0, 1);
        r.key("k", ValueType::Array).u32(ty.id()).u64(u64::MAX / 2);
        r.bytes(&[0; 64]);
        let e = err(&r);
        assert!(matches!(e, GgufError::TooLarge { .. }), "{ty}: {e}");
    }
    // 100 strings need at least 800 bytes.
    let mut r = Raw::new(3, 0, 1);
    r.key("k", ValueType::Array)
        .u32(ValueType::String.id())
        .u64(100);
    r.bytes(&[0; 200]);
    assert!(err(&r).to_string().contains("'k'"));
}

#[test]
fn key_rejections() {
    let mut r = Raw::new(3, 0, 2);
    r.key("a", ValueType::U8).u8(1);
    r.key("a", ValueType::U8).u8(2);
    let e = err(&r);
    assert!(matches!(e, GgufError::DuplicateKey { .. }), "{e}");
    assert!(e.to_string().contains("'a'"), "{e}");

    let mut r = Raw::new(3, 0, 1);
    r.key("", ValueType::U8).u8(1).bytes(&[0; 8]);
    assert!(matches!(err(&r), GgufError::EmptyKey { .. }));

    let mut r = Raw::new(3, 0, 1);
    r.u64(2).bytes(&[0xc3, 0x28]).u32(0).u8(1);
    assert!(matches!(err(&r), GgufError::InvalidUtf8 { .. }));

    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(13).u8(1);
    let e = err(&r);
    assert!(matches!(e, GgufError::BadValueType { id: 13, .. }), "{e}");
    let mut r = Raw::new(3, 0, 1);
    r.key("k", ValueType::Array).u32(99).u64(0);
    assert!(matches!(err(&r), GgufError::BadValueType { id: 99, .. }));
}

/// One F32 tensor `name` of `dims` and type `ty` at relative `offset`, with
/// `data_len` bytes of data and `general.alignment` if given.
fn one_tensor(
    dims: &[u64],
    ty: u32,
    offset: u64,
    data_len: usize,
    alignment: Option<Value>,
) -> Raw {
    let mut r = Raw::new(3, 1, u64::from(alignment.is_some()));
    match alignment {
        Some(Value::U32(a)) => {
            r.key("general.alignment", ValueType::U32).u32(a);
        }
        Some(Value::U64(a)) => {
            r.key("general.alignment", ValueType::U64).u64(a);
        }
        Some(Value::F32(a)) => {
            r.key("general.alignment", ValueType::F32)
                .bytes(&a.to_le_bytes());
        }
        _ => {}
    }
    r.tensor("t", dims, ty, offset);
    let align = match alignment {
        Some(Value::U32(a)) if a.is_power_of_two() => a as usize,
        _ => 32,
    };
    r.pad(align).bytes(&vec![0; data_len]);
    r
}

#[test]
fn tensor_rejections() {
    assert!(one_tensor(&[8], 0, 0, 32, None).parse().is_ok());

    let e = err(&one_tensor(&[1, 1, 1, 1, 1], 0, 0, 4, None));
    assert!(matches!(e, GgufError::TooManyDims { n_dims: 5, .. }), "{e}");
    assert!(e.to_string().contains("'t'"), "{e}");

    let e = err(&one_tensor(&[33], GgmlType::Q4_0.id(), 0, 64, None));
    assert!(
        matches!(e, GgufError::NotBlockMultiple { ne0: 33, .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains("'t'") && e.to_string().contains("q4_0"),
        "{e}"
    );

    let e = err(&one_tensor(&[8], 4, 0, 32, None));
    assert!(matches!(e, GgufError::UnknownType { id: 4, .. }), "{e}");
    assert!(e.to_string().contains("'t'"), "{e}");

    let e = err(&one_tensor(&[u64::MAX], 0, 0, 32, None));
    assert!(matches!(e, GgufError::BadDim { .. }), "{e}");
    let e = err(&one_tensor(&[1 << 32, 1 << 32], 0, 0, 32, None));
    assert!(matches!(e, GgufError::SizeOverflow { .. }), "{e}");
    let e = err(&one_tensor(&[0, 1 << 40, 1 << 40], 0, 0, 32, None));
    assert!(matches!(e, GgufError::SizeOverflow { .. }), "{e}");
    // Element count fits int64 but the F32 byte size does not fit u64.
    let e = err(&one_tensor(&[1 << 62], 0, 0, 32, None));
    assert!(matches!(e, GgufError::SizeOverflow { .. }), "{e}");

    let e = err(&one_tensor(&[8], 0, 8, 64, None));
    assert!(
        matches!(e, GgufError::MisalignedTensor { offset: 8, .. }),
        "{e}"
    );
    let e = err(&one_tensor(&[8], 0, 32, 64, None));
    assert!(
        matches!(e, GgufError::UnexpectedOffset { offset: 32, .. }),
        "{e}"
    );
    let e = err(&one_tensor(&[8], 0, 0, 31, None));
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");
    assert!(e.to_string().contains("'t'"), "{e}");
    let e = err(&one_tensor(&[8], 0, 1 << 62, 32, None));
    assert!(
        matches!(
            e,
            GgufError::UnexpectedOffset { .. } | GgufError::TensorOutOfBounds { .. }
        ),
        "{e}"
    );

    // The data section itself must start inside the file.
    let mut r = Raw::new(3, 1, 0);
    r.tensor("t", &[0], 0, 0);
    let e = err(&r);
    assert!(matches!(e, GgufError::DataSectionOutOfBounds { .. }), "{e}");

    let long = "x".repeat(MAX_NAME_LEN + 1);
    let mut r = Raw::new(3, 1, 0);
    r.tensor(&long, &[0], 0, 0).pad(32);
    assert!(matches!(err(&r), GgufError::NameTooLong { .. }));
    let mut r = Raw::new(3, 1, 0);
    r.tensor(&long[1..], &[0], 0, 0).pad(32);
    assert!(r.parse().is_ok());

    let mut r = Raw::new(3, 2, 0);
    r.tensor("t", &[8], 0, 0).tensor("t", &[8], 0, 32);
    r.pad(32).bytes(&[0; 64]);
    let e = err(&r);
    assert!(matches!(e, GgufError::DuplicateTensor { .. }), "{e}");
    assert!(e.to_string().contains("'t'"), "{e}");
}

#[test]
fn zero_sized_tensors_and_no_tensors() {
    let mut r = Raw::new(3, 2, 0);
    r.tensor("empty", &[0, 5], GgmlType::Q4K.id(), 0);
    r.tensor("one", &[1], 0, 0).pad(32).bytes(&[9; 4]);
    let g = r.parse().unwrap();
    assert_eq!(g.tensor("empty").unwrap().size(), 0);
    assert_eq!(g.tensor("one").unwrap().data(), [9; 4]);

    // Without tensors the data section is not padded (as llama.cpp).
    let mut r = Raw::new(3, 0, 1);
    r.key("k", ValueType::U8).u8(1);
    let g = r.parse().unwrap();
    assert_eq!(g.data_offset(), r.0.len() as u64);
}

#[test]
fn alignment_key() {
    let r = one_tensor(&[8], 0, 0, 32, Some(Value::U32(64)));
    let g = r.parse().unwrap();
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.data_offset() % 64, 0);
    for bad in [
        Value::U32(0),
        Value::U32(48),
        Value::U64(1 << 40),
        Value::F32(32.0),
    ] {
        let e = err(&one_tensor(&[8], 0, 0, 32, Some(bad)));
        assert!(matches!(e, GgufError::BadAlignment { .. }), "{bad:?}: {e}");
    }
    // Any integer width is accepted.
    let mut r = Raw::new(3, 0, 1);
    r.key("general.alignment", ValueType::U64).u64(16);
    assert_eq!(r.parse().unwrap().alignment(), 16);
}

#[test]
fn truncation_errors_name_the_place() {
    let r = small_file();
    let cut = r.0.len() - 10;
    let e = Gguf::parse(&r.0[..cut]).unwrap_err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");
    assert!(e.to_string().contains("'blk.0.w'"), "{e}");
    // Cut inside the token array.
    let pos = r.0.windows(2).position(|w| w == b"bc").unwrap();
    let e = Gguf::parse(&r.0[..pos + 1]).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("tokenizer.ggml.tokens") && msg.contains("byte"),
        "{msg}"
    );
    assert!(!msg.contains('\n'));
}

// ---- writer ----

fn all_values() -> Vec<(&'static str, MetaValue)> {
    vec![
        ("general.architecture", "qwen3moe".into()),
        ("u8", 7u8.into()),
        ("i8", (-7i8).into()),
        ("u16", 700u16.into()),
        ("i16", (-700i16).into()),
        ("u32", 70_000u32.into()),
        ("i32", (-70_000i32).into()),
        ("f32", 0.1f32.into()),
        ("bool", true.into()),
        ("string", "ünïcödé".into()),
        ("u64", u64::MAX.into()),
        ("i64", i64::MIN.into()),
        ("f64", std::f64::consts::PI.into()),
        ("arr.u8", vec![1u8, 2, 3].into()),
        ("arr.f32", vec![0.5f32, -1.0].into()),
        ("arr.bool", vec![true, false].into()),
        ("arr.i64", vec![-1i64, 1].into()),
        ("arr.str", vec!["a", "", "ç"].into()),
        (
            "arr.empty",
            MetaArray::new(ValueType::F64, vec![]).unwrap().into(),
        ),
        (
            "arr.nested",
            MetaArray::new(
                ValueType::Array,
                vec![vec![1u32, 2].into(), vec!["x"].into(), vec![true].into()],
            )
            .unwrap()
            .into(),
        ),
        ("bytes", MetaValue::String(vec![0xff, 0x00, 0x41])),
    ]
}

fn tensors() -> Vec<(&'static str, Vec<u64>, GgmlType)> {
    vec![
        ("token_embd.weight", vec![64, 3], GgmlType::F16),
        ("odd", vec![3, 5], GgmlType::F32),
        ("blk.0.ffn_up_exps.weight", vec![256, 2, 4], GgmlType::Q4K),
        ("blk.0.attn_q.weight", vec![32, 3], GgmlType::Q8_0),
        ("scalar", vec![], GgmlType::F32),
        ("empty", vec![0, 4], GgmlType::IQ4XS),
    ]
}

fn tensor_bytes(i: usize, size: u64) -> Vec<u8> {
    (0..size).map(|j| (j as usize * 31 + i * 7) as u8).collect()
}

fn written(alignment: Option<u32>) -> (GgufWriter, Vec<u8>) {
    let mut w = GgufWriter::new();
    for (k, v) in all_values() {
        w.add_kv(k, v).unwrap();
    }
    if let Some(a) = alignment {
        w.add_kv("general.alignment", a).unwrap();
    }
    for (name, dims, ty) in tensors() {
        w.add_tensor(name, &dims, ty).unwrap();
    }
    let plan = w.clone();
    let mut data = w.write_header(Vec::new()).unwrap();
    let mut i = 0;
    while let Some((name, size)) = data.next_tensor() {
        let name = name.to_owned();
        let bytes = tensor_bytes(i, size);
        if i % 2 == 0 {
            data.write_tensor(&name, &bytes).unwrap();
        } else {
            data.copy_tensor(&name, &bytes[..]).unwrap();
        }
        i += 1;
    }
    (plan, data.finish().unwrap())
}

#[test]
fn writer_round_trip() {
    for alignment in [None, Some(64), Some(1)] {
        let (plan, bytes) = written(alignment);
        assert_eq!(plan.file_len(), bytes.len() as u64);
        let g = Gguf::parse(&bytes[..]).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), u64::from(alignment.unwrap_or(32)));
        let mut expected = all_values();
        if let Some(a) = alignment {
            expected.push(("general.alignment", a.into()));
        }
        assert_eq!(g.metadata_len(), expected.len());
        for ((key, want), (got_key, got)) in expected.iter().zip(g.metadata()) {
            assert_eq!(*key, got_key);
            assert_eq!(want, &got.to_meta(), "{key}");
        }
        assert_eq!(g.tensor_count(), tensors().len());
        for (i, ((name, dims, ty), t)) in tensors().into_iter().zip(g.tensors()).enumerate() {
            assert_eq!(t.name(), name);
            assert_eq!(t.dims(), dims);
            assert_eq!(t.ggml_type(), ty);
            assert_eq!(t.data(), tensor_bytes(i, t.size()), "{name}");
            assert_eq!(t.offset() % g.alignment(), 0);
        }
    }
}

#[test]
fn reader_to_writer_copy_is_identical() {
    let (_, bytes) = written(Some(64));
    let g = Gguf::parse(&bytes[..]).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add_kv(k, v.to_meta()).unwrap();
    }
    for t in g.tensors() {
        w.add_tensor(t.name(), t.dims(), t.ggml_type()).unwrap();
    }
    assert_eq!(w.file_len(), bytes.len() as u64);
    let mut data = w.write_header(Vec::new()).unwrap();
    for t in g.tensors() {
        data.write_tensor(t.name(), t.data()).unwrap();
    }
    assert_eq!(data.finish().unwrap(), bytes);
}

#[test]
fn arrays_copied_from_a_file_decode_to_their_items() {
    let (_, bytes) = written(None);
    let g = Gguf::parse(&bytes[..]).unwrap();
    for (key, want) in all_values() {
        let MetaValue::Array(want) = want else {
            continue;
        };
        let Some(MetaValue::Array(got)) = g.get(key).map(|v| v.to_meta()) else {
            panic!("{key}");
        };
        assert_eq!(
            (got.len(), got.elem_type()),
            (want.len(), want.elem_type()),
            "{key}"
        );
        assert!(got.items().eq(want.items()), "{key}");
    }
}

#[test]
fn writer_rejections() {
    let mut w = GgufWriter::new();
    w.add_kv("a", 1u8).unwrap();
    assert!(w.add_kv("a", 2u8).is_err());
    assert!(w.add_kv("", 2u8).is_err());
    assert!(w.add_kv("general.alignment", 48u32).is_err());
    assert!(w.add_kv("general.alignment", 64u64).is_err());
    assert!(MetaArray::new(ValueType::U8, vec![MetaValue::U16(1)]).is_err());
    let mut deep: MetaValue = vec![1u8].into();
    for _ in 0..MAX_ARRAY_DEPTH {
        deep = MetaArray::new(ValueType::Array, vec![deep]).unwrap().into();
    }
    assert!(w.add_kv("deep", deep).is_err());

    assert!(w.add_tensor("q", &[33], GgmlType::Q4_0).is_err());
    assert!(w.add_tensor("d", &[1, 1, 1, 1, 1], GgmlType::F32).is_err());
    assert!(w
        .add_tensor("o", &[1 << 40, 1 << 40], GgmlType::F32)
        .is_err());
    assert!(w.add_tensor("x".repeat(64), &[1], GgmlType::F32).is_err());
    assert_eq!(w.add_tensor("t1", &[4], GgmlType::F32).unwrap(), 16);
    assert!(w.add_tensor("t1", &[4], GgmlType::F32).is_err());
    w.add_tensor("t2", &[2], GgmlType::F32).unwrap();

    let mut data = w.write_header(Vec::new()).unwrap();
    assert!(data.write_tensor("t2", &[0; 8]).is_err(), "out of order");
    assert!(data.write_tensor("t1", &[0; 15]).is_err(), "wrong size");
    assert!(
        data.copy_tensor("t1", &[0u8; 3][..]).is_err(),
        "short source"
    );
}

#[test]
fn writer_finish_checks_all_tensors_written() {
    let mut w = GgufWriter::new();
    w.add_tensor("t1", &[4], GgmlType::F32).unwrap();
    let data = w.write_header(Vec::new()).unwrap();
    assert!(data.finish().is_err());
}

// ---- robustness ----

/// Reads everything a parsed file offers, so a bad index would show up here.
fn touch_all<B: AsRef<[u8]>>(g: &Gguf<B>) {
    fn walk(v: Value, depth: usize) {
        assert!(depth <= MAX_ARRAY_DEPTH);
        let _ = (v.as_u64(), v.as_f32(), v.as_str());
        if let Some(a) = v.as_array() {
            let n = a.iter().count();
            assert_eq!(n, a.len());
            let _ = a.get(n / 2);
            let _ = a.to_strs();
            for item in a.iter() {
                walk(item, depth + 1);
            }
        }
    }
    for (k, v) in g.metadata() {
        assert_eq!(g.get(k).map(|u| u.value_type()), Some(v.value_type()));
        walk(v, 0);
        let _ = (g.get_u64(k), g.get_f32(k), g.get_str(k), g.get_str_array(k));
    }
    for t in g.tensors() {
        assert_eq!(t.data().len() as u64, t.size());
        assert!(t.offset() + t.size() <= g.bytes().len() as u64);
        assert_eq!(g.tensor(t.name()).map(|u| u.offset()), Some(t.offset()));
        let _ = (t.n_elements(), t.n_rows(), t.row_bytes());
    }
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    /// Overwrites 8 bytes with a "interesting" u64 (count-like fields).
    Word(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(i, m)| Mutation::Flip(i, m)),
        any::<usize>().prop_map(Mutation::Truncate),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1..16usize).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (
            any::<usize>(),
            prop_oneof![
                Just(0u64),
                Just(1),
                Just(u64::MAX),
                Just(1 << 32),
                Just(1 << 63),
                0..300u64
            ]
        )
            .prop_map(|(i, v)| Mutation::Word(i, v)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let len = bytes.len().max(1);
    match m {
        Mutation::Flip(i, mask) => {
            if let Some(b) = bytes.get_mut(i % len) {
                *b ^= mask;
            }
        }
        Mutation::Truncate(n) => bytes.truncate(n % len),
        Mutation::Insert(i, b) => {
            let at = (i % len).min(bytes.len());
            bytes.splice(at..at, b.iter().copied());
        }
        Mutation::Remove(i, n) => {
            let at = (i % len).min(bytes.len());
            let end = (at + n).min(bytes.len());
            bytes.drain(at..end);
        }
        Mutation::Word(i, v) => {
            let at = i % len;
            if at + 8 <= bytes.len() {
                bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn mutated_files_never_panic(
        base in prop_oneof![Just(0), Just(1)],
        ms in proptest::collection::vec(mutation(), 1..5),
    ) {
        let mut bytes = if base == 0 { small_file().0 } else { written(None).1 };
        for m in &ms {
            apply(&mut bytes, m);
        }
        if let Ok(g) = Gguf::parse(&bytes[..]) {
            touch_all(&g);
        }
    }

    #[test]
    fn random_bytes_after_header_never_panic(
        n_tensors in 0..4u64,
        n_kv in 0..4u64,
        tail in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut r = Raw::new(3, n_tensors, n_kv);
        r.bytes(&tail);
        if let Ok(g) = r.parse() {
            touch_all(&g);
        }
    }
}
