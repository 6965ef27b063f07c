//! Interoperability with the Python `gguf` package (llama.cpp's own reader and
//! writer in Python): files it writes, we read; files we write, it reads.

mod common;

use std::fs::File;
use std::io::BufWriter;

use common::*;
use les::gguf::{Gguf, GgufWriter, MetaArray, MetaValue, ValueType};
use les_core::quant::{f32_to_f16, GgmlType};
use serde_json::json;

#[test]
fn we_read_what_python_writes() {
    let path = tmp("interop_python_written.gguf");
    let expected = python_model(&path);
    let g = Gguf::open(&path).unwrap();
    assert_same_file(&expected, &gguf_json(&g));

    // Python's reader agrees on where the data lies.
    let dump = python("dump_gguf.py", &[path.as_os_str()]);
    assert_eq!(dump["data_offset"], json!(g.data_offset()));
    for (t, d) in g.tensors().zip(dump["tensors"].as_array().unwrap()) {
        assert_eq!(d["offset"], json!(t.offset()), "{}", t.name());
    }

    // Typed accessors on what a model loader reads.
    assert_eq!(g.architecture().unwrap(), "qwen3moe");
    assert_eq!(g.get_u32("qwen3moe.expert_count").unwrap(), 4);
    assert_eq!(g.get_f32("qwen3moe.rope.freq_base").unwrap(), 1e6);
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 3005);
    assert_eq!(tokens[3003], "\u{4e2d}\u{6587}");
    let exps = g.tensor("blk.1.ffn_down_exps.weight").unwrap();
    assert_eq!(exps.dims(), [32, 64, 4]);
    assert_eq!(exps.ggml_type(), GgmlType::Q8_0);
}

/// A tensor to write: name, dims, type, data.
type TensorData = (String, Vec<u64>, GgmlType, Vec<u8>);

/// Everything our writer can express, for Python to read back.
fn our_model() -> (Vec<(String, MetaValue)>, Vec<TensorData>) {
    let mut kv: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), "qwen3moe".into()),
        ("general.alignment".into(), 64u32.into()),
        ("general.name".into(), "written by les".into()),
        ("qwen3moe.block_count".into(), 1u32.into()),
        ("qwen3moe.expert_count".into(), 2u64.into()),
        ("test.u8".into(), 255u8.into()),
        ("test.i8".into(), (-128i8).into()),
        ("test.u16".into(), 65535u16.into()),
        ("test.i16".into(), (-32768i16).into()),
        ("test.u32".into(), u32::MAX.into()),
        ("test.i32".into(), i32::MIN.into()),
        ("test.f32".into(), (-0.1f32).into()),
        ("test.bool".into(), false.into()),
        (
            "test.string".into(),
            "\u{e9}\u{2713}\u{1F600} and \"quotes\"\n".into(),
        ),
        ("test.u64".into(), u64::MAX.into()),
        ("test.i64".into(), i64::MIN.into()),
        ("test.f64".into(), 1e-300f64.into()),
        ("test.arr_u8".into(), vec![0u8, 128, 255].into()),
        ("test.arr_i8".into(), vec![-1i8, 1].into()),
        ("test.arr_u16".into(), vec![1u16, 65535].into()),
        ("test.arr_i16".into(), vec![-1i16, 300].into()),
        ("test.arr_u32".into(), vec![7u32].into()),
        ("test.arr_i32".into(), vec![-7i32, 0, 7].into()),
        ("test.arr_f32".into(), vec![1.5f32, -2.25, 1e-30].into()),
        ("test.arr_bool".into(), vec![false, true].into()),
        ("test.arr_u64".into(), vec![u64::MAX, 0].into()),
        ("test.arr_i64".into(), vec![i64::MAX, -1].into()),
        ("test.arr_f64".into(), vec![0.1f64, -1e100].into()),
        (
            "test.arr_empty".into(),
            MetaArray::new(ValueType::U32, vec![]).unwrap().into(),
        ),
    ];
    let nested = MetaArray::new(
        ValueType::Array,
        vec![
            vec![1i32, 2].into(),
            vec!["mixed", "types"].into(),
            MetaArray::new(ValueType::Array, vec![vec![0.5f64].into()])
                .unwrap()
                .into(),
        ],
    )
    .unwrap();
    kv.push(("test.arr_nested".into(), nested.into()));
    let tokens: Vec<String> = (0..5000).map(|i| format!("\u{120}tok{i}")).collect();
    kv.push(("tokenizer.ggml.model".into(), "gpt2".into()));
    kv.push(("tokenizer.ggml.tokens".into(), tokens.into()));
    kv.push((
        "tokenizer.ggml.scores".into(),
        (0..5000)
            .map(|i| i as f32 / 3.0)
            .collect::<Vec<f32>>()
            .into(),
    ));

    let mut tensors = Vec::new();
    let mut add = |name: &str, dims: Vec<u64>, ty: GgmlType, data: Vec<u8>| {
        tensors.push((name.to_owned(), dims, ty, data));
    };
    let f32s = |n: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| (0.1 + 2.0 * (i as f32).cos()).to_le_bytes())
            .collect()
    };
    add("output_norm.weight", vec![64], GgmlType::F32, f32s(64));
    add("odd.weight", vec![7], GgmlType::F32, f32s(7));
    let f16s: Vec<u8> = (0..64 * 3)
        .flat_map(|i| f32_to_f16(i as f32 / 8.0).to_le_bytes())
        .collect();
    add("token_embd.weight", vec![64, 3], GgmlType::F16, f16s);
    // Q8_0 blocks: f16 scale then 32 signed quants.
    let q8: Vec<u8> = (0..2 * 2 * 2)
        .flat_map(|b| {
            let mut block = f32_to_f16(0.01 * (b + 1) as f32).to_le_bytes().to_vec();
            block.extend((0..32).map(|j| (j as i8 - 16).wrapping_mul(b as i8 + 1) as u8));
            block
        })
        .collect();
    add(
        "blk.0.ffn_gate_exps.weight",
        vec![64, 2, 2],
        GgmlType::Q8_0,
        q8,
    );
    let k: Vec<u8> = (0..144 * 2).map(|i| (i * 37 % 251) as u8).collect();
    add(
        "blk.0.ffn_up_exps.weight",
        vec![256, 1, 2],
        GgmlType::Q4K,
        k,
    );
    let bf: Vec<u8> = (0..64).map(|i| i as u8).collect();
    add("blk.0.attn_q.weight", vec![32], GgmlType::BF16, bf);
    (kv, tensors)
}

#[test]
fn python_reads_what_we_write() {
    let (kv, tensors) = our_model();
    let mut w = GgufWriter::new();
    for (k, v) in &kv {
        w.add_kv(k.as_str(), v.clone()).unwrap();
    }
    for (name, dims, ty, _) in &tensors {
        w.add_tensor(name.as_str(), dims, *ty).unwrap();
    }
    let path = tmp("interop_les_written.gguf");
    let mut data = w
        .write_header(BufWriter::new(File::create(&path).unwrap()))
        .unwrap();
    for (name, _, _, bytes) in &tensors {
        data.write_tensor(name, bytes).unwrap();
    }
    data.finish().unwrap();

    let expected = json!({
        "alignment": 64,
        "kv": kv.iter().map(|(k, v)| kv_json(k, meta_tagged(v))).collect::<Vec<_>>(),
        "tensors": tensors
            .iter()
            .map(|(n, d, t, b)| tensor_json(n, t.id(), d, b))
            .collect::<Vec<_>>(),
    });
    let dump = python("dump_gguf.py", &[path.as_os_str()]);
    assert_same_file(&expected, &dump);

    // Our reader agrees with both, down to the offsets.
    let g = Gguf::open(&path).unwrap();
    assert_same_file(&expected, &gguf_json(&g));
    assert_eq!(dump["data_offset"], json!(g.data_offset()));
    for (t, d) in g.tensors().zip(dump["tensors"].as_array().unwrap()) {
        assert_eq!(d["offset"], json!(t.offset()), "{}", t.name());
        assert_eq!(t.offset() % 64, 0);
    }
}
