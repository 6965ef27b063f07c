#!/usr/bin/env python3
"""llama.cpp's log probabilities along its greedy continuation of a prompt,
through llama-cpp-python.

Usage: llama_logprobs.py MODEL.gguf PROMPT N TOP

Prints one JSON list, an entry for each of the N tokens generated greedily
(end of generation included, then stopping): {"id", "logprob", "top": [[id,
logprob], ...]} with the TOP most likely tokens, from the softmax of
llama.cpp's logits (float64). The prompt is tokenized by llama.cpp with BOS
as the model asks and special tokens not parsed, as `les serve`'s
/v1/completions does.
"""
import json
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama


def main():
    path, prompt, n, top = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    llm = Llama(model_path=path, n_ctx=256, n_threads=2, n_batch=1, logits_all=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True, special=False))
    out = []
    for _ in range(n):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        lp = logits - logits.max()
        lp -= np.log(np.exp(lp).sum())
        order = sorted(range(len(lp)), key=lambda i: (-logits[i], i))
        t = order[0]
        out.append({"id": t, "logprob": lp[t], "top": [[i, lp[i]] for i in order[:top]]})
        if llama_cpp.llama_vocab_is_eog(vocab, t):
            break
        llm.eval([t])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
