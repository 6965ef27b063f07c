#!/usr/bin/env python3
"""llama.cpp's multimodal path (libmtmd, through llama-cpp-python's mtmd
bindings) on one image file, read as llama.cpp's tools read it
(mtmd_helper_bitmap_init_from_file: stb_image). Set MTMD_CPP_LIB and
LLAMA_CPP_LIB_PATH to a llama.cpp build for this CPU.

Usage:
  mtmd_llama.py embed MODEL.gguf MMPROJ.gguf IMAGE.png
      Tokenizes the media marker alone with the image and prints one JSON
      list of the chunks in order: {"text": [token ids]} or
      {"image": [floats, n x n_embd], "n": n, "nx": nx, "ny": ny}. n_embd is
      the model's input width (llama_model_n_embd_inp: Qwen3-VL's rows carry
      the deepstack features after the embedding); nx x ny is the image
      chunk's token grid (mtmd_image_tokens_get_nx / _ny).
  mtmd_llama.py grid MODEL.gguf MMPROJ.gguf WxH...
      Tokenizes the media marker with a blank image of each size (no file,
      nothing encoded) and prints one JSON list of the image chunks' token
      grids {"nx", "ny", "n"}, one per size.
  mtmd_llama.py greedy MODEL.gguf MMPROJ.gguf IMAGE.png PROMPT N
      Decodes PROMPT (the marker <__media__> where the image goes, BOS as
      the model asks, special tokens parsed): its chunks through
      mtmd_helper_eval_chunks, then N tokens greedily, one at a time
      (stopping after an end of generation). Prints {"tokens": [ids],
      "logits": [[n_vocab floats] per generated token]}.
  mtmd_llama.py decode MODEL.gguf MMPROJ.gguf IMAGE...
      Reads each image file as llama.cpp's tools do (stb_image, through
      mtmd_helper_bitmap_init_from_file) and prints one JSON list of
      {"width", "height", "rgb": hex of the RGB bytes} (null where it
      fails).

Attention runs in f32 (flash attention would round keys and values to f16).
MTMD_IMAGE_MIN_TOKENS / MTMD_IMAGE_MAX_TOKENS set llama.cpp's
--image-min-tokens / --image-max-tokens.
"""
import ctypes
import json
import os
import sys

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
from llama_cpp import Llama

MARKER = b"<__media__>"


def context(model, mmproj):
    """The model and its mtmd context."""
    llm = Llama(model_path=model, n_ctx=4096, n_batch=512, n_threads=2, verbose=False)
    p = mtmd.mtmd_context_params_default()
    p.use_gpu = False
    p.n_threads = 2
    p.warmup = False
    p.print_timings = False
    p.media_marker = MARKER
    p.flash_attn_type = 0
    # llama.cpp's --image-min-tokens / --image-max-tokens, where set.
    p.image_min_tokens = int(os.environ.get("MTMD_IMAGE_MIN_TOKENS", "-1"))
    p.image_max_tokens = int(os.environ.get("MTMD_IMAGE_MAX_TOKENS", "-1"))
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), llm._model.model, p)
    assert ctx, "mtmd_init_from_file failed"
    return llm, ctx


def tokenize(model, mmproj, image, prompt, add_special):
    """The model, the mtmd context and the chunks of `prompt` with the image."""
    llm, ctx = context(model, mmproj)
    # The file read as llama.cpp's tools read it (stb_image).
    bitmap = mtmd.mtmd_helper_bitmap_init_from_file(ctx, image.encode(), False)
    assert bitmap, f"llama.cpp cannot read {image}"
    return llm, ctx, chunks_of(ctx, bitmap, prompt, add_special)


def chunks_of(ctx, bitmap, prompt, add_special):
    """The chunks of `prompt` with the image `bitmap`."""
    text = mtmd.mtmd_input_text()
    text.text = prompt
    text.text_len = len(prompt)
    text.add_special = add_special
    text.parse_special = True
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
    assert rc == 0, f"mtmd_tokenize: {rc}"
    return chunks


def grid(model, mmproj, *sizes):
    _, ctx = context(model, mmproj)
    out = []
    for size in sizes:
        w, h = (int(v) for v in size.split("x"))
        pixels = (ctypes.c_uint8 * (w * h * 3))()
        bitmap = mtmd.mtmd_bitmap_init(w, h, pixels)
        assert bitmap, f"mtmd_bitmap_init {size}"
        chunks = chunks_of(ctx, bitmap, MARKER, False)
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != 0:
                image = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
                out.append({
                    "nx": mtmd.mtmd_image_tokens_get_nx(image),
                    "ny": mtmd.mtmd_image_tokens_get_ny(image),
                    "n": mtmd.mtmd_input_chunk_get_n_tokens(chunk),
                })
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
    return out


def embed(model, mmproj, image):
    llm, ctx, chunks = tokenize(model, mmproj, image, MARKER, False)
    # The width of an image embedding row: the model's input width, wider
    # than n_embd where the projector adds deepstack features (Qwen3-VL).
    n_embd_inp = getattr(llama_cpp, "llama_model_n_embd_inp", llama_cpp.llama_model_n_embd)
    n_embd = n_embd_inp(llm._model.model)
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
            values = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * n_embd,))
            image = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
            out.append({
                "image": [float(v) for v in values],
                "n": n,
                "nx": mtmd.mtmd_image_tokens_get_nx(image),
                "ny": mtmd.mtmd_image_tokens_get_ny(image),
            })
    return out


def greedy(model, mmproj, image, prompt, n):
    llm, ctx, chunks = tokenize(model, mmproj, image, prompt.encode(), True)
    n_past = llama_cpp.llama_pos(0)
    rc = mtmd.mtmd_helper_eval_chunks(ctx, llm._ctx.ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past))
    assert rc == 0, f"mtmd_helper_eval_chunks: {rc}"
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def last_logits():
        out = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(out, shape=(n_vocab,)).copy()

    logits = last_logits()
    llm.n_tokens = n_past.value
    tokens, rows = [], []
    for _ in range(int(n)):
        t = int(np.argmax(logits))
        tokens.append(t)
        rows.append([float(v) for v in logits])
        if llama_cpp.llama_vocab_is_eog(vocab, t):
            break
        llm.eval([t])
        logits = last_logits()
    return {"tokens": tokens, "logits": rows}


def decode(model, mmproj, *images):
    llm = Llama(model_path=model, n_ctx=256, n_threads=2, verbose=False)
    p = mtmd.mtmd_context_params_default()
    p.use_gpu = False
    p.warmup = False
    p.print_timings = False
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), llm._model.model, p)
    assert ctx, "mtmd_init_from_file failed"
    out = []
    for image in images:
        bitmap = mtmd.mtmd_helper_bitmap_init_from_file(ctx, image.encode(), False)
        if not bitmap:
            out.append(None)
            continue
        n = mtmd.mtmd_bitmap_get_n_bytes(bitmap)
        rgb = ctypes.string_at(mtmd.mtmd_bitmap_get_data(bitmap), n)
        out.append({
            "width": mtmd.mtmd_bitmap_get_nx(bitmap),
            "height": mtmd.mtmd_bitmap_get_ny(bitmap),
            "rgb": rgb.hex(),
        })
        mtmd.mtmd_bitmap_free(bitmap)
    return out


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    out = {"embed": embed, "grid": grid, "greedy": greedy, "decode": decode}[mode](*args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
