#!/usr/bin/env python3
"""Writes the JPEG fixtures of tests/jpeg_decode.rs (Pillow 11.3's libjpeg):
one layout or coding feature each, on synthetic pictures (gradients, edges,
noise), small enough to keep in the repository.

Usage: jpeg_fixtures.py OUT_DIR
"""
import sys

import numpy as np
from PIL import Image


def picture(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack(
        [
            (x * 255 // max(w - 1, 1)),
            (y * 255 // max(h - 1, 1)),
            np.where((x // 6 + y // 5) % 2 == 0, 40, 220),
        ],
        -1,
    ).astype(np.float64)
    a += rng.normal(0, 18, a.shape)
    return Image.fromarray(a.clip(0, 255).astype(np.uint8))


def main(out):
    p = picture(45, 31, 1)
    p.save(f"{out}/b444.jpg", quality=85, subsampling=0)
    p.save(f"{out}/b422.jpg", quality=85, subsampling=1)
    p.save(f"{out}/b420.jpg", quality=85, subsampling=2)
    picture(1, 1, 2).save(f"{out}/tiny_1x1.jpg", quality=90, subsampling=2)
    picture(1, 17, 3).save(f"{out}/tiny_1x17.jpg", quality=90, subsampling=2)
    picture(17, 1, 4).save(f"{out}/tiny_17x1.jpg", quality=90, subsampling=1)
    q = picture(40, 40, 5)
    q.save(f"{out}/q5.jpg", quality=5, subsampling=2)
    q.save(f"{out}/q100.jpg", quality=100, subsampling=0)
    g = picture(61, 47, 6)
    g.save(f"{out}/progressive.jpg", quality=80, progressive=True)
    g.save(f"{out}/progressive_restarts.jpg", quality=80, progressive=True,
           subsampling=1, restart_marker_blocks=5)
    g.save(f"{out}/restarts.jpg", quality=80, restart_marker_blocks=3)
    g.save(f"{out}/optimized.jpg", quality=70, optimize=True)
    g.convert("CMYK").save(f"{out}/cmyk.jpg", quality=85)
    g.convert("L").save(f"{out}/gray_progressive.jpg", quality=85, progressive=True)
    # 16-bit quantization tables (values past 255).
    g.convert("L").save(f"{out}/quant16.jpg",
                        qtables=[[min(300 + 7 * i, 1000) for i in range(64)]])


if __name__ == "__main__":
    main(sys.argv[1])
