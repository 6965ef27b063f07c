#!/usr/bin/env python3
"""Writes reference data for les-core's quantization tests, from the `gguf` package.

Usage: quant_refs.py OUT_DIR [--seed N]

For every weight type, OUT_DIR/<type>.blocks holds random blocks (with finite,
moderate f16/f32 scales) and OUT_DIR/<type>.dequant the little-endian f32 values
`gguf.quants.dequantize` gives for them. For every type `gguf.quants.quantize`
supports, OUT_DIR/<type>.qin holds f32 input and OUT_DIR/<type>.qout its blocks,
and <type>.qin_edge / <type>.qout_edge the same for inputs of extreme magnitude.
The Rust tests compare bit for bit.
"""
import argparse
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

# Byte offsets of the f16 scale fields inside each block (see ggml-common.h).
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.MXFP4: [],  # an E8M0 exponent byte: every value is valid
    T.IQ2_XXS: [0],
    T.IQ2_XS: [0],
    T.IQ2_S: [0],
    T.IQ3_XXS: [0],
    T.IQ3_S: [0],
    T.IQ1_S: [0],
    T.IQ1_M: [],  # its f16 scale is spread over the scale words: see random_blocks
}
QUANTIZE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.F16, T.MXFP4]
# MXFP4's exponent of a block under 2^-125 is a negative float cast to uint8, which
# C leaves undefined (and numpy's result varies), so it has no edge data.
QUANTIZE_EDGE = [t for t in QUANTIZE if t != T.MXFP4]
N_BLOCKS = 64


def random_blocks(rng, qtype):
    block_elems, block_bytes = quants.GGML_QUANT_SIZES[qtype]
    if qtype == T.F32:
        return rng.standard_normal(N_BLOCKS, dtype=np.float32).view(np.uint8)
    if qtype == T.F16:
        x = (rng.standard_normal(N_BLOCKS) * 10).astype(np.float16)
        return x.view(np.uint8)
    if qtype == T.BF16:
        x = rng.standard_normal(N_BLOCKS, dtype=np.float32) * 10
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(N_BLOCKS, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        # Scales of either sign, spanning several binades, always finite.
        d = (rng.standard_normal(N_BLOCKS) * 0.05).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(N_BLOCKS, 2)
    if qtype == T.IQ1_M:
        # The f16 scale's four nibbles are the top nibbles of the four u16
        # scale words at bytes 48..56 (lowest nibble in the first word).
        d = (rng.standard_normal(N_BLOCKS) * 0.05).astype(np.float16).view(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    return raw.reshape(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    weight_types = [T.F32, T.F16, T.BF16] + list(F16_FIELDS)
    for qtype in weight_types:
        name = qtype.name.lower()
        blocks = random_blocks(rng, qtype)
        block_elems, block_bytes = quants.GGML_QUANT_SIZES[qtype]
        n = blocks.size // block_bytes * block_elems
        deq = quants.dequantize(blocks.reshape(1, -1), qtype).astype(np.float32).reshape(-1)
        assert deq.size == n, (name, deq.size, n)
        blocks.tofile(os.path.join(args.out_dir, f"{name}.blocks"))
        deq.astype("<f4").tofile(os.path.join(args.out_dir, f"{name}.dequant"))
    for qtype in QUANTIZE:
        name = qtype.name.lower()
        block_elems, _ = quants.GGML_QUANT_SIZES[qtype]
        n = N_BLOCKS * max(block_elems, 32)
        # Mixed magnitudes, exact zeros and a constant block exercise the edge cases.
        x = rng.standard_normal(n).astype(np.float32) * rng.choice([0.01, 1.0, 30.0], size=n).astype(np.float32)
        x[:32] = 0.0
        x[32:64] = 0.75
        q = quants.quantize(x.reshape(1, -1), qtype).reshape(-1)
        x.astype("<f4").tofile(os.path.join(args.out_dir, f"{name}.qin"))
        q.tofile(os.path.join(args.out_dir, f"{name}.qout"))
    # Extreme magnitudes (from subnormal to near f32 max): scales that underflow or
    # overflow f16, and `1/d` overflowing to infinity. The quants of such blocks
    # depend on how numpy casts non-finite floats to integers, which differs between
    # CPUs, so they live in separate files (<type>.qin_edge / <type>.qout_edge).
    with np.errstate(all="ignore"):
        for qtype in QUANTIZE_EDGE:
            name = qtype.name.lower()
            n = N_BLOCKS * 32
            x = rng.standard_normal(n).astype(np.float32)
            x[rng.random(n) < 0.2] = 0.0
            scale = np.power(10.0, rng.uniform(-45, 38, size=N_BLOCKS)).astype(np.float32)
            scale[:8] = [1e38, 2e37, 1e6, 1e-6, 1e-36, 3e-38, 1e-40, 1e-44]
            x = (x.reshape(N_BLOCKS, 32) * scale[:, None]).reshape(-1)
            x = np.clip(x, np.float32(-3e38), np.float32(3e38))  # finite; max - min may not be
            x[x == 0] = 0.0  # no negative zeros: reductions order them unpredictably
            q = quants.quantize(x.reshape(1, -1), qtype).reshape(-1)
            x.astype("<f4").tofile(os.path.join(args.out_dir, f"{name}.qin_edge"))
            q.tofile(os.path.join(args.out_dir, f"{name}.qout_edge"))
    # MXFP4 over every magnitude whose exponent C defines (block maxima from 2^-125 up).
    n = N_BLOCKS * 32
    x = rng.standard_normal(n).astype(np.float32)
    scale = np.power(10.0, rng.uniform(-35, 37, size=N_BLOCKS)).astype(np.float32)
    scale[:4] = [3e38, 1e-36, 2.0, 0.0]
    with np.errstate(over="ignore"):
        x = (x.reshape(N_BLOCKS, 32) * scale[:, None]).reshape(-1)
    x = np.clip(x, np.float32(-3e38), np.float32(3e38))
    q = quants.quantize(x.reshape(1, -1), T.MXFP4).reshape(-1)
    x.astype("<f4").tofile(os.path.join(args.out_dir, "mxfp4.qin_wide"))
    q.tofile(os.path.join(args.out_dir, "mxfp4.qout_wide"))
    print(f"wrote reference data for {len(weight_types)} types to {args.out_dir}")


if __name__ == "__main__":
    main()
