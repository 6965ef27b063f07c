//! Helpers shared by the integration tests: running the Python `gguf` scripts
//! and describing a GGUF file as JSON in the scripts' schema.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;

use les::gguf::{Gguf, GgufWriter, MetaValue, Value};
use serde_json::{json, Value as Json};

/// A path in the test scratch directory.
pub fn tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// Copies the GGUF `src` to `dst` with metadata edited: `edit(key, value)`
/// returns the new value or `None` to drop the key; `extra` pairs are appended.
/// Tensors are copied unchanged.
pub fn rewrite_gguf(
    src: &Path,
    dst: &Path,
    edit: impl Fn(&str, MetaValue) -> Option<MetaValue>,
    extra: Vec<(&str, MetaValue)>,
) {
    let g = Gguf::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        if let Some(v) = edit(k, v.to_meta()) {
            w.add_kv(k, v).unwrap();
        }
    }
    for (k, v) in extra {
        w.add_kv(k, v).unwrap();
    }
    for t in g.tensors() {
        w.add_tensor(t.name(), t.dims(), t.ggml_type()).unwrap();
    }
    let _ = fs::remove_file(dst);
    let mut data = w
        .write_header(BufWriter::new(File::create(dst).unwrap()))
        .unwrap();
    for t in g.tensors() {
        data.write_tensor(t.name(), t.data()).unwrap();
    }
    data.finish().unwrap();
}

/// Copies the GGUF `src` to `dst` with only the tensors whose names `keep`
/// accepts; metadata and the kept tensors unchanged.
pub fn rewrite_gguf_tensors(src: &Path, dst: &Path, keep: impl Fn(&str) -> bool) {
    let g = Gguf::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add_kv(k, v.to_meta()).unwrap();
    }
    let kept: Vec<_> = g.tensors().filter(|t| keep(t.name())).collect();
    for t in &kept {
        w.add_tensor(t.name(), t.dims(), t.ggml_type()).unwrap();
    }
    let _ = fs::remove_file(dst);
    let mut data = w
        .write_header(BufWriter::new(File::create(dst).unwrap()))
        .unwrap();
    for t in &kept {
        data.write_tensor(t.name(), t.data()).unwrap();
    }
    data.finish().unwrap();
}

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts")
}

/// Panics with an instruction unless `python3` can import `gguf` and `numpy`.
pub fn require_python_gguf() {
    static CHECK: Once = Once::new();
    CHECK.call_once(|| {
        let out = Command::new("python3")
            .args(["-c", "import gguf, numpy"])
            .output();
        let ok = matches!(&out, Ok(o) if o.status.success());
        if !ok {
            let why = match out {
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            panic!(
                "this test needs python3 with the `gguf` and `numpy` packages \
                 (install them with `pip install gguf numpy`): {why}"
            );
        }
    });
}

/// Runs `tests/scripts/<script>` with `args` and parses its stdout as JSON.
pub fn python(script: &str, args: &[&OsStr]) -> Json {
    require_python_gguf();
    let out = Command::new("python3")
        .arg(scripts().join(script))
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints JSON")
}

/// Writes the Python reference model to `path` and returns what it wrote.
pub fn python_model(path: &Path) -> Json {
    python("gen_gguf.py", &[path.as_os_str()])
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn plain(v: Value) -> Json {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F32(x) => json!(f64::from(x)),
        Value::F64(x) => json!(x),
        Value::Bool(x) => json!(x),
        Value::String(b) => json!(String::from_utf8_lossy(b)),
        Value::Array(_) => tagged(v),
    }
}

/// `{"type": ..., "value": ...}`; arrays add `"elem"` and hold plain items
/// (nested arrays tagged).
pub fn tagged(v: Value) -> Json {
    match v {
        Value::Array(a) => json!({
            "type": "array",
            "elem": a.elem_type().name(),
            "value": a.iter().map(plain).collect::<Vec<_>>(),
        }),
        _ => json!({"type": v.value_type().name(), "value": plain(v)}),
    }
}

fn meta_plain(v: &MetaValue) -> Json {
    match v {
        MetaValue::U8(x) => json!(x),
        MetaValue::I8(x) => json!(x),
        MetaValue::U16(x) => json!(x),
        MetaValue::I16(x) => json!(x),
        MetaValue::U32(x) => json!(x),
        MetaValue::I32(x) => json!(x),
        MetaValue::U64(x) => json!(x),
        MetaValue::I64(x) => json!(x),
        MetaValue::F32(x) => json!(f64::from(*x)),
        MetaValue::F64(x) => json!(x),
        MetaValue::Bool(x) => json!(x),
        MetaValue::String(b) => json!(String::from_utf8_lossy(b)),
        MetaValue::Array(_) => meta_tagged(v),
    }
}

/// [`tagged`] for an owned value.
pub fn meta_tagged(v: &MetaValue) -> Json {
    match v {
        MetaValue::Array(a) => json!({
            "type": "array",
            "elem": a.elem_type().name(),
            "value": a.items().map(|v| meta_plain(&v)).collect::<Vec<_>>(),
        }),
        _ => json!({"type": v.value_type().name(), "value": meta_plain(v)}),
    }
}

/// One metadata pair in the scripts' schema.
pub fn kv_json(key: &str, tagged: Json) -> Json {
    let mut m = tagged
        .as_object()
        .expect("tagged values are objects")
        .clone();
    m.insert("key".into(), json!(key));
    Json::Object(m)
}

/// One tensor in the scripts' schema (without its offset).
pub fn tensor_json(name: &str, ggml_type: u32, dims: &[u64], data: &[u8]) -> Json {
    json!({"name": name, "type": ggml_type, "dims": dims, "data": hex(data)})
}

/// What our reader sees, in the scripts' schema.
pub fn gguf_json<B: AsRef<[u8]>>(g: &Gguf<B>) -> Json {
    json!({
        "alignment": g.alignment(),
        "kv": g.metadata().map(|(k, v)| kv_json(k, tagged(v))).collect::<Vec<_>>(),
        "tensors": g
            .tensors()
            .map(|t| tensor_json(t.name(), t.ggml_type().id(), t.dims(), t.data()))
            .collect::<Vec<_>>(),
    })
}

fn short(j: &Json) -> String {
    let s = j.to_string();
    if s.chars().count() > 120 {
        format!("{}...", s.chars().take(120).collect::<String>())
    } else {
        s
    }
}

/// The first place where `a` and `b` differ, as a JSON path with both values.
pub fn first_difference(path: &str, a: &Json, b: &Json) -> Option<String> {
    match (a, b) {
        (Json::Array(x), Json::Array(y)) => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                if let Some(d) = first_difference(&format!("{path}[{i}]"), u, v) {
                    return Some(d);
                }
            }
            (x.len() != y.len()).then(|| format!("{path}: lengths {} vs {}", x.len(), y.len()))
        }
        (Json::Object(x), Json::Object(y)) => {
            for (k, u) in x {
                let Some(v) = y.get(k) else {
                    return Some(format!("{path}.{k}: missing on the right"));
                };
                if let Some(d) = first_difference(&format!("{path}.{k}"), u, v) {
                    return Some(d);
                }
            }
            y.keys()
                .find(|k| !x.contains_key(*k))
                .map(|k| format!("{path}.{k}: missing on the left"))
        }
        _ => (a != b).then(|| format!("{path}: {} vs {}", short(a), short(b))),
    }
}

/// Compares two descriptions (tensor offsets ignored), naming the first
/// key, tensor or element that differs.
pub fn assert_same_file(expected: &Json, actual: &Json) {
    let strip = |j: &Json| {
        let mut j = j.clone();
        if let Some(ts) = j["tensors"].as_array_mut() {
            for t in ts {
                t.as_object_mut().map(|m| m.remove("offset"));
            }
        }
        j.as_object_mut().map(|m| m.remove("data_offset"));
        j
    };
    if let Some(d) = first_difference("", &strip(expected), &strip(actual)) {
        panic!("files differ at {d}");
    }
}
