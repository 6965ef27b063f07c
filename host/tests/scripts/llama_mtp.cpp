// llama.cpp's multi-token-prediction drafting, driven as its `draft-mtp`
// speculative implementation (common/speculative.cpp) drives it, for
// `qwen35_cli::mtp_drafts_equal_llama_cpp`. Not built by the test command:
// build llama.cpp (targets `llama` and `llama-common`), then
//
//   g++ -O2 -std=c++17 llama_mtp.cpp -I$LLAMA/include -I$LLAMA/common \
//       -I$LLAMA/ggml/include -L$BUILD/bin -lllama -lllama-common -o llama-mtp
//
// Usage: llama-mtp MODEL.gguf N_DRAFT TOKEN...
// Evaluates the prompt TOKEN... in the target context (hidden states after the
// output norm kept for every position), pairs each prompt token with the
// hidden state before it (zeros first) in the MTP context, samples the
// target's greedy next token, then drafts N_DRAFT tokens greedily, each from
// the MTP block's own hidden state. Prints the next token, the target's logits
// after the prompt, then per draft step the step's logits (space-separated,
// one line each).

#include "common.h"
#include "llama.h"
#include "../src/llama-ext.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

static int argmax(const float * x, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i) {
        if (x[i] > x[best]) {
            best = i;
        }
    }
    return best;
}

static void print_row(const float * x, int n) {
    for (int v = 0; v < n; ++v) {
        printf(v ? " %.9g" : "%.9g", x[v]);
    }
    printf("\n");
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N_DRAFT TOKEN...\n", argv[0]);
        return 2;
    }
    const int n_draft = atoi(argv[2]);
    std::vector<llama_token> prompt;
    for (int i = 3; i < argc; ++i) {
        prompt.push_back(atoi(argv[i]));
    }
    const int n = (int) prompt.size();

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.load_mtp = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_embd = llama_model_n_embd_out(model);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 256;
    cp.n_ubatch = 256;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    llama_context * tgt = llama_init_from_model(model, cp);
    llama_set_embeddings_nextn(tgt, true, /*masked*/ false);

    llama_context_params dp = cp;
    dp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    dp.n_rs_seq = 0;
    dp.ctx_other = tgt;
    llama_context * dft = llama_init_from_model(model, dp);
    if (!tgt || !dft) {
        fprintf(stderr, "cannot create the contexts\n");
        return 1;
    }
    llama_set_embeddings_nextn(dft, true, /*masked*/ true);

    // The target over the prompt.
    common_batch bt(tgt);
    for (int i = 0; i < n; ++i) {
        bt.add(prompt[i], i, 0, i == n - 1);
    }
    if (llama_process(tgt, LLAMA_PROCESS_TYPE_DECODE, bt.get()) != 0) {
        fprintf(stderr, "target decode failed\n");
        return 1;
    }
    std::vector<float> h((size_t) n * n_embd);
    for (int i = 0; i < n; ++i) {
        const float * row = llama_get_embeddings_nextn_ith(tgt, i);
        std::copy(row, row + n_embd, h.begin() + (size_t) i * n_embd);
    }
    const llama_token next = argmax(llama_get_logits_ith(tgt, n - 1), n_vocab);

    // The MTP block over the prompt: token k with the hidden state at k - 1.
    std::vector<float> zeros(n_embd, 0.0f);
    common_batch bd(dft);
    for (int i = 0; i < n; ++i) {
        const int idx = bd.add(prompt[i], i, 0, false);
        bd.set_embd(idx, { i == 0 ? zeros.data() : h.data() + (size_t) (i - 1) * n_embd, 1, (size_t) n_embd });
    }
    if (llama_process(dft, LLAMA_PROCESS_TYPE_DECODE, bd.get()) != 0) {
        fprintf(stderr, "MTP catch-up failed\n");
        return 1;
    }

    // Drafting from the sampled token.
    printf("%d\n", next);
    print_row(llama_get_logits_ith(tgt, n - 1), n_vocab);
    std::vector<float> h_row(h.end() - n_embd, h.end());
    llama_token tok = next;
    for (int s = 0; s < n_draft; ++s) {
        common_batch b1(dft);
        const int idx = b1.add(tok, n + s, 0, true);
        b1.set_embd(idx, { h_row.data(), 1, (size_t) n_embd });
        if (llama_process(dft, LLAMA_PROCESS_TYPE_DECODE, b1.get()) != 0) {
            fprintf(stderr, "MTP draft failed\n");
            return 1;
        }
        const float * lg = llama_get_logits_ith(dft, idx);
        print_row(lg, n_vocab);
        const float * hr = llama_get_embeddings_nextn_ith(dft, idx);
        std::copy(hr, hr + n_embd, h_row.begin());
        tok = argmax(lg, n_vocab);
    }
    llama_free(dft);
    llama_free(tgt);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
