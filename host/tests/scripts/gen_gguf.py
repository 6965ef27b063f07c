"""Writes a small MoE-shaped GGUF with gguf.GGUFWriter and prints, as JSON, what
it wrote: every metadata pair (typed) and every tensor (name, ggml type id,
dims innermost first, data as hex). Used by host/tests/python_interop.rs.

usage: python3 gen_gguf.py OUT.gguf
"""

import json
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T

TYPE_NAMES = {
    T.UINT8: "u8", T.INT8: "i8", T.UINT16: "u16", T.INT16: "i16",
    T.UINT32: "u32", T.INT32: "i32", T.FLOAT32: "f32", T.BOOL: "bool",
    T.STRING: "string", T.ARRAY: "array", T.UINT64: "u64", T.INT64: "i64",
    T.FLOAT64: "f64",
}


def plain(v, vtype):
    """A scalar or string as JSON; f32 values as the float32 the file holds."""
    if vtype == T.FLOAT32:
        return float(np.float32(v))
    if vtype == T.STRING:
        return v if isinstance(v, str) else v.decode("utf-8")
    if vtype == T.BOOL:
        return bool(v)
    if vtype == T.FLOAT64:
        return float(v)
    return int(v)


def tagged_array(items, elem):
    out = {"type": "array", "elem": TYPE_NAMES[elem], "value": []}
    for it in items:
        if elem == T.ARRAY:
            out["value"].append(tagged_array(it, T.get_type(it[0])))
        else:
            out["value"].append(plain(it, elem))
    return out


def tagged(gv):
    if gv.type == T.ARRAY:
        elem = gv.sub_type if gv.sub_type is not None else T.get_type(gv.value[0])
        return tagged_array(gv.value, elem)
    return {"type": TYPE_NAMES[gv.type], "value": plain(gv.value, gv.type)}


def main():
    out_path = sys.argv[1]
    arch = "qwen3moe"
    w = gguf.GGUFWriter(out_path, arch)

    # Hyperparameters of a tiny MoE model.
    w.add_uint32(f"{arch}.block_count", 2)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.expert_count", 4)
    w.add_uint32(f"{arch}.expert_used_count", 2)
    w.add_uint32(f"{arch}.expert_feed_forward_length", 32)
    w.add_uint32(f"{arch}.attention.head_count", 4)
    w.add_uint32(f"{arch}.attention.head_count_kv", 2)
    w.add_float32(f"{arch}.rope.freq_base", 1000000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("general.name", "tiny interop model")

    # One pair of every scalar type, at the edges of their ranges.
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.1)
    w.add_bool("test.bool", True)
    w.add_bool("test.bool_false", False)
    w.add_string("test.string", "h\u00e9llo w\u00f6rld \u2713 \U0001F600")
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", 3.141592653589793)

    # Arrays of every element type, and nested arrays.
    for vt, vals in [
        (T.UINT8, [0, 1, 255]),
        (T.INT8, [-128, 0, 127]),
        (T.UINT16, [0, 65535]),
        (T.INT16, [-32768, 32767]),
        (T.UINT32, [0, 4294967295]),
        (T.INT32, [-5, 7, 2147483647]),
        (T.FLOAT32, [0.5, -1.25, 3.0e-8]),
        (T.BOOL, [True, False, True]),
        (T.UINT64, [0, 2**64 - 1]),
        (T.INT64, [-(2**63), 2**63 - 1]),
        (T.FLOAT64, [1e300, -2.5]),
        (T.STRING, ["a", "", "\u00fcber"]),
    ]:
        w.add_key_value(f"test.arr_{TYPE_NAMES[vt]}", vals, T.ARRAY, sub_type=vt)
    w.add_array("test.arr_nested", [[1, 2], [3], [4, 5, 6]])
    w.add_array("test.arr_nested_str", [["x", "yy"], ["zzz"]])
    w.add_array("test.arr_nested2", [[[1], [2, 3]], [[4]]])

    # A tokenizer-sized string array and its companions.
    tokens = [f"tok{i}" for i in range(3000)] + ["", " ", "\u0120the", "\u4e2d\u6587", "<0x0A>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_scores([float(-i) / 7.0 for i in range(len(tokens))])
    w.add_token_types([1 + (i % 6) for i in range(len(tokens))])

    # Tensors of several types, quantized ones through gguf.quants.
    rng = np.random.default_rng(1234)

    def f32(*shape):
        n = int(np.prod(shape))
        return (0.1 + 2 * np.cos(np.arange(n) + rng.integers(0, 1000))).astype(np.float32).reshape(shape)

    tensors = []  # (name, array, raw_dtype, dims innermost first)

    def add(name, x, qtype):
        dims = list(reversed(x.shape))
        if qtype in (Q.F32,):
            data = x.astype(np.float32)
            raw = None
        elif qtype == Q.F16:
            data = x.astype(np.float16)
            raw = None
        else:
            data = gguf.quants.quantize(x, qtype)
            raw = qtype
        w.add_tensor(name, data, raw_dtype=raw)
        tensors.append({"name": name, "type": int(qtype), "dims": dims, "data": data.tobytes().hex()})

    add("token_embd.weight", f32(10, 64), Q.F16)
    add("output_norm.weight", f32(64), Q.F32)
    add("odd.weight", f32(5, 3), Q.F32)  # 60 bytes: exercises padding
    for layer in range(2):
        add(f"blk.{layer}.attn_q.weight", f32(64, 64), Q.Q4_0)
        add(f"blk.{layer}.attn_k.weight", f32(16, 64), Q.BF16)
        add(f"blk.{layer}.ffn_gate_inp.weight", f32(4, 64), Q.F32)
        add(f"blk.{layer}.ffn_gate_exps.weight", f32(4, 32, 64), Q.Q8_0)
        add(f"blk.{layer}.ffn_up_exps.weight", f32(4, 32, 64), Q.Q8_0)
        add(f"blk.{layer}.ffn_down_exps.weight", f32(4, 64, 32), Q.Q8_0)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    kv = [{"key": k, **tagged(gv)} for k, gv in w.kv_data[0].items()]
    json.dump({"alignment": w.data_alignment, "kv": kv, "tensors": tensors}, sys.stdout)


if __name__ == "__main__":
    main()
