#!/usr/bin/env python3
"""llama.cpp's multimodal tokenization and image embeddings, through
llama-cpp-python's mtmd bindings (libmtmd).

Usage: mtmd_embed.py MODEL.gguf MMPROJ.gguf IMAGE.png

Tokenizes the media marker alone with the image (decoded to RGB by Pillow:
PNG pixels are exact everywhere) and prints one JSON list of the chunks in
order: {"text": [token ids]} or {"image": [floats, n x n_embd], "n": n}.
Set MTMD_CPP_LIB and LLAMA_CPP_LIB_PATH to a llama.cpp build for this CPU.
"""
import ctypes
import json
import sys

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
from llama_cpp import Llama
from PIL import Image

MARKER = b"<__media__>"


def main():
    model, mmproj, image = sys.argv[1], sys.argv[2], sys.argv[3]
    llm = Llama(model_path=model, n_ctx=4096, n_threads=2, verbose=False)
    p = mtmd.mtmd_context_params_default()
    p.use_gpu = False
    p.n_threads = 2
    p.warmup = False
    p.print_timings = False
    p.media_marker = MARKER
    # Attention in f32 (flash attention rounds keys and values to f16).
    p.flash_attn_type = 0
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), llm._model.model, p)
    assert ctx, "mtmd_init_from_file failed"
    img = Image.open(image).convert("RGB")
    data = img.tobytes()
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    bitmap = mtmd.mtmd_bitmap_init(img.width, img.height, buf)
    text = mtmd.mtmd_input_text()
    text.text = MARKER
    text.text_len = len(MARKER)
    text.add_special = False
    text.parse_special = True
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
    assert rc == 0, f"mtmd_tokenize: {rc}"
    n_embd = llama_cpp.llama_model_n_embd(llm._model.model)
    out = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        if mtmd.mtmd_input_chunk_get_type(chunk) == 0:
            count = ctypes.c_size_t()
            ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
            out.append({"text": [ids[j] for j in range(count.value)]})
        else:
            assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0, "mtmd_encode_chunk failed"
            embd = mtmd.mtmd_get_output_embd(ctx)
            values = np.ctypeslib.as_array(embd, shape=(n * n_embd,))
            out.append({"image": [float(v) for v in values], "n": n})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
