"""Reads a file written by `les pack` with gguf.GGUFReader and prints, as JSON,
the alignment, every tensor (name, ggml type id, numpy dtype, dims, absolute
offset, byte length) and, per packed layer, whether the CRC-32 of every expert
(zlib.crc32 over its unpadded bytes) matches les.pack.blk.N.checksums and its
padding is zero. Used by host/tests/pack.rs.

usage: python3 check_packed.py PACKED.gguf
"""

import json
import sys
import zlib

import numpy as np
import gguf

# Bytes per block and elements per block, for the unpadded expert size.
SIZES = gguf.GGML_QUANT_SIZES


def scalar(r, key):
    f = r.fields[key]
    return f.parts[f.data[0]][0].item()


def array(r, key):
    f = r.fields[key]
    return [f.parts[i][0].item() for i in f.data]


def main():
    r = gguf.GGUFReader(sys.argv[1])
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    n_experts = scalar(r, f"{arch}.expert_count")
    n_embd = scalar(r, f"{arch}.embedding_length")
    n_ff = scalar(r, f"{arch}.expert_feed_forward_length")
    tensors = []
    layers = []
    for t in r.tensors:
        data = np.ascontiguousarray(t.data)
        tensors.append({
            "name": t.name,
            "type": int(t.tensor_type),
            "dtype": str(data.dtype),
            "dims": [int(d) for d in t.shape],
            "offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        })
        if not t.name.endswith(".ffn_exps_packed.weight"):
            continue
        layer = int(t.name.split(".")[1])
        stride = scalar(r, f"les.pack.blk.{layer}.stride")
        types = array(r, f"les.pack.blk.{layer}.types")
        sums = array(r, f"les.pack.blk.{layer}.checksums")
        shapes = [(n_embd, n_ff), (n_embd, n_ff), (n_ff, n_embd)]  # (cols, rows)
        expert_bytes = 0
        for ty, (cols, rows) in zip(types, shapes):
            block, size = SIZES[gguf.GGMLQuantizationType(ty)]
            expert_bytes += cols // block * size * rows
        raw = data.view(np.uint8)
        crc_ok = len(sums) == n_experts and raw.size == n_experts * stride
        pad_ok = True
        for e in range(n_experts):
            ext = raw[e * stride:(e + 1) * stride]
            crc_ok = crc_ok and zlib.crc32(ext[:expert_bytes].tobytes()) == sums[e]
            pad_ok = pad_ok and not ext[expert_bytes:].any()
        layers.append({
            "layer": layer,
            "stride": stride,
            "types": types,
            "expert_bytes": expert_bytes,
            "crc_ok": bool(crc_ok),
            "pad_ok": bool(pad_ok),
        })
    json.dump(
        {
            "alignment": int(r.alignment),
            "version": scalar(r, "les.pack.version"),
            "pack_alignment": scalar(r, "les.pack.alignment"),
            "plan": bytes(r.fields["les.pack.plan"].parts[-1]).decode(),
            "tensors": tensors,
            "layers": layers,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
