#!/usr/bin/env python3
"""Draws assets/test-image.png, the small picture the demo and the vision tests
use: a house under a sun, in flat colours (320x240 RGB, a few KB).

Deterministic and dependency-free (a PNG written with zlib), so the committed
file can be regenerated bit for bit: python3 scripts/make_test_image.py
"""
import os
import struct
import zlib

W, H = 320, 240
SKY, GRASS, SUN = (110, 170, 235), (70, 160, 60), (250, 210, 40)
WALL, ROOF, DOOR, WINDOW = (200, 60, 50), (120, 50, 30), (90, 55, 25), (180, 220, 250)


def pixel(x, y):
    # sun
    if (x - 255) ** 2 + (y - 50) ** 2 <= 28 ** 2:
        return SUN
    # roof: a triangle over the wall
    if 70 <= y < 120 and abs(x - 130) <= (y - 70) * 80 // 50:
        return ROOF
    # wall, door, window
    if 120 <= y < 200 and 50 <= x < 210:
        if 150 <= y and 115 <= x < 145:
            return DOOR
        if 135 <= y < 165 and 70 <= x < 100:
            return WINDOW
        return WALL
    return SKY if y < 170 else GRASS


def chunk(kind, data):
    c = struct.pack(">I", len(data)) + kind + data
    return c + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def main():
    raw = bytearray()
    for y in range(H):
        raw.append(0)  # filter: none
        for x in range(W):
            raw.extend(pixel(x, y))
    png = b"\x89PNG\r\n\x1a\n"
    png += chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(bytes(raw), 9))
    png += chunk(b"IEND", b"")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "assets", "test-image.png")
    with open(out, "wb") as f:
        f.write(png)
    print(f"wrote {os.path.normpath(out)}: {len(png)} bytes")


if __name__ == "__main__":
    main()
