"""Reads a GGUF with gguf.GGUFReader and prints, as JSON, every metadata pair
(typed, nested arrays rebuilt) and every tensor (name, ggml type id, dims
innermost first, absolute data offset, data as hex). Used by
host/tests/python_interop.rs.

usage: python3 dump_gguf.py IN.gguf
"""

import json
import sys

import numpy as np
import gguf
from gguf import GGUFValueType as T

TYPE_NAMES = {
    T.UINT8: "u8", T.INT8: "i8", T.UINT16: "u16", T.INT16: "i16",
    T.UINT32: "u32", T.INT32: "i32", T.FLOAT32: "f32", T.BOOL: "bool",
    T.STRING: "string", T.ARRAY: "array", T.UINT64: "u64", T.INT64: "i64",
    T.FLOAT64: "f64",
}


def walk(parts, i, vtype):
    """Decodes the value of type vtype whose parts start at parts[i]: returns
    (plain value, or a tagged array, next index)."""
    if vtype == T.STRING:
        return bytes(parts[i + 1]).decode("utf-8"), i + 2
    if vtype == T.ARRAY:
        elem = T(int(parts[i][0]))
        n = int(parts[i + 1][0])
        i += 2
        items = []
        for _ in range(n):
            v, i = walk(parts, i, elem)
            items.append(v)
        return {"type": "array", "elem": TYPE_NAMES[elem], "value": items}, i
    x = parts[i][0]
    if vtype == T.BOOL:
        return bool(x), i + 1
    if vtype in (T.FLOAT32, T.FLOAT64):
        return float(x), i + 1
    return int(x), i + 1


def main():
    r = gguf.GGUFReader(sys.argv[1])
    kv = []
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = T(int(field.parts[2][0]))
        value, end = walk(field.parts, 3, vtype)
        assert end == len(field.parts), name
        if vtype == T.ARRAY:
            kv.append({"key": name, **value})
        else:
            kv.append({"key": name, "type": TYPE_NAMES[vtype], "value": value})
    tensors = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "dims": [int(d) for d in t.shape],
            "offset": int(t.data_offset),
            "data": np.ascontiguousarray(t.data).tobytes().hex(),
        }
        for t in r.tensors
    ]
    json.dump(
        {"alignment": int(r.alignment), "data_offset": int(r.data_offset), "kv": kv, "tensors": tensors},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
