"""Reads a GGUF written by `les synth` with gguf.GGUFReader and prints, as JSON:
scalar metadata (plain values), the tokenizer arrays, and per tensor its name,
ggml type id, dims (innermost first), byte size, and the mean and standard
deviation of its values dequantized by the gguf package. Used by
host/tests/synth.rs.

usage: python3 synth_check.py IN.gguf
"""

import json
import sys

import numpy as np
import gguf
from gguf import GGUFValueType as T


def scalar(field):
    vtype = T(int(field.types[0]))
    if vtype == T.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    x = field.parts[field.data[0]][0]
    if vtype == T.BOOL:
        return bool(x)
    if vtype in (T.FLOAT32, T.FLOAT64):
        return float(x)
    return int(x)


def array(field):
    elem = T(int(field.types[1]))
    if elem == T.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return [int(field.parts[i][0]) for i in field.data]


def main():
    r = gguf.GGUFReader(sys.argv[1])
    meta = {}
    arrays = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        if T(int(field.types[0])) == T.ARRAY:
            arrays[name] = array(field)
        else:
            meta[name] = scalar(field)
    tensors = []
    for t in r.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        tensors.append({
            "name": t.name,
            "type": int(t.tensor_type),
            "dims": [int(d) for d in t.shape],
            "bytes": int(t.n_bytes),
            "mean": float(values.mean()),
            "std": float(values.std()),
        })
    json.dump({"meta": meta, "arrays": arrays, "tensors": tensors}, sys.stdout)


if __name__ == "__main__":
    main()
