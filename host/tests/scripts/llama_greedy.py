#!/usr/bin/env python3
"""Greedy continuation of a prompt by llama.cpp, through llama-cpp-python.

Usage: llama_greedy.py MODEL.gguf PROMPT N

Prints the generated token ids (at most N, stopping at end of generation) as
one JSON list. The prompt is tokenized by llama.cpp with BOS as the model
asks and special tokens not parsed, as `les run` does; each token is evaluated
on its own (n_batch 1).
"""
import json
import sys

import llama_cpp
from llama_cpp import Llama


def main():
    path, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = Llama(model_path=path, n_ctx=256, n_threads=2, n_batch=1, verbose=False)
    toks = llm.tokenize(prompt.encode(), add_bos=True, special=False)
    out = []
    # llama.cpp's own end-of-generation set (EOS, EOT and the tokens it knows
    # by text, such as <|endoftext|>), as llama-cli stops on.
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    for t in llm.generate(toks, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if llama_cpp.llama_vocab_is_eog(vocab, t):
            break
        out.append(t)
        if len(out) == n:
            break
    print(json.dumps({"prompt": toks, "tokens": out}))


if __name__ == "__main__":
    main()
