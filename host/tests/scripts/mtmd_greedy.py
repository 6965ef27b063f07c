#!/usr/bin/env python3
"""llama.cpp's greedy decode of a prompt with an image, through
llama-cpp-python's mtmd bindings (libmtmd): the prompt's chunks evaluated
by mtmd_helper_eval_chunks, then one token at a time.

Usage: mtmd_greedy.py MODEL.gguf MMPROJ.gguf IMAGE.png PROMPT N

PROMPT holds the media marker <__media__> where the image goes; it is
tokenized with the model's BOS as the model asks and special tokens parsed.
Prints one JSON object: {"tokens": [ids], "logits": [[n_vocab floats] per
generated token]} (the end of generation included, then stopping). Set
MTMD_CPP_LIB and LLAMA_CPP_LIB_PATH to a llama.cpp build for this CPU.
"""
import ctypes
import json
import sys

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
from llama_cpp import Llama
from PIL import Image


def main():
    model, mmproj, image, prompt, n = sys.argv[1:6]
    llm = Llama(model_path=model, n_ctx=4096, n_batch=512, n_threads=2, verbose=False)
    p = mtmd.mtmd_context_params_default()
    p.use_gpu = False
    p.n_threads = 2
    p.warmup = False
    p.print_timings = False
    p.media_marker = b"<__media__>"
    p.flash_attn_type = 0
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), llm._model.model, p)
    assert ctx, "mtmd_init_from_file failed"
    img = Image.open(image).convert("RGB")
    data = img.tobytes()
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    bitmap = mtmd.mtmd_bitmap_init(img.width, img.height, buf)
    text = mtmd.mtmd_input_text()
    raw = prompt.encode()
    text.text = raw
    text.text_len = len(raw)
    text.add_special = True
    text.parse_special = True
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
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
    print(json.dumps({"tokens": tokens, "logits": rows}))


if __name__ == "__main__":
    main()
