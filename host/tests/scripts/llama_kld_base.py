#!/usr/bin/env python3
"""Writes a KL-divergence base file (llama-perplexity's format) from llama.cpp's
log-probabilities, through llama-cpp-python.

Usage: llama_kld_base.py MODEL.gguf TEXT_FILE OUT N_CTX N_CHUNK

As `llama-perplexity --kl-divergence-base`: the text is tokenized without BOS,
cut into chunks of N_CTX tokens whose first token becomes BOS, each evaluated
from position 0, and the second half of each chunk's positions scored (the
log-probabilities of every token, 16 bits each: see host/src/perplexity.rs).
`les perplexity --kl-divergence-base OUT --kl-divergence` reads it.
"""
import struct
import sys

import numpy as np
from llama_cpp import Llama


def row(logits, n_vocab):
    """One scored position: scale and minimum log-probability, then the
    quantized logits, as llama.cpp's `process_logits` writes them."""
    mx = logits.max()
    mn = max(logits.min(), mx - np.float32(16.0))
    log_sum = np.float32(np.log(np.exp((logits - mx).astype(np.float64)).sum()))
    min_lp = np.float32(mn - mx - log_sum)
    scale = np.float32((mx - mn) / np.float32(65535.0))
    q = np.where(logits > mn, np.rint(np.float32(1.0) / scale * (logits - mn)), 0).astype(np.uint16)
    out = np.zeros(2 * ((n_vocab + 1) // 2) + 4, dtype=np.uint16)
    out[0:2] = np.frombuffer(np.float32(scale).tobytes(), dtype=np.uint16)
    out[2:4] = np.frombuffer(np.float32(min_lp).tobytes(), dtype=np.uint16)
    out[4:4 + n_vocab] = q
    return out


def main():
    path, text, out, n_ctx, n_chunk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=2, logits_all=True, verbose=False)
    toks = llm.tokenize(open(text, "rb").read(), add_bos=False, special=False)
    n_vocab = llm.n_vocab()
    rows, all_toks = [], []
    for c in range(n_chunk):
        t = [llm.token_bos()] + toks[c * n_ctx + 1:(c + 1) * n_ctx]
        all_toks += t
        llm.reset()
        llm.eval(t)
        lg = np.array(llm.scores[:n_ctx], dtype=np.float32)
        rows += [row(lg[j], n_vocab) for j in range(n_ctx // 2, n_ctx - 1)]
    with open(out, "wb") as f:
        f.write(b"_logits_")
        f.write(struct.pack("<iii", n_ctx, n_vocab, n_chunk))
        f.write(np.array(all_toks, dtype="<i4").tobytes())
        for r in rows:
            f.write(r.tobytes())


if __name__ == "__main__":
    main()
