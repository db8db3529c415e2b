// The few libllama calls that ctypes cannot make directly, as plain C functions:
//   - those taking structs by value (model and context parameters), so that Python never mirrors
//     llama.h's struct layouts, which change between llama.cpp versions;
//   - the layer-input extraction of llama-ext.h (C++ linkage in libllama), which EAGLE features use.
// Built beside libllama by scripts/setup_libllama.sh; docs/llamacpp-backend.md.
#include <cstddef>
#include "llama.h"
#include "llama-ext.h"

extern "C" {

static void quiet(ggml_log_level level, const char * text, void * user) {
    (void) level; (void) text; (void) user;
}

void dh_init(bool verbose) {
    if (!verbose) {
        llama_log_set(quiet, NULL);
    }
    llama_backend_init();
}

struct llama_model * dh_load_model(const char * path) {
    struct llama_model_params p = llama_model_default_params();
    p.n_gpu_layers = 0;
    return llama_model_load_from_file(path, p);
}

// What lib.py checks before it declares the calls: a shim built from another drafthead refuses
// to load rather than be called with arguments it does not take.
int dh_abi_version(void) {
    return 2;
}

// One context for the whole generation. unified: every row and every tree leaf is a sequence of
// one KV cache, so the cells of a shared prefix serve all of them; not unified: each of the
// n_seq_max sequences is a stream of n_ctx / n_seq_max cells, which only its own tokens attend to.
struct llama_context * dh_new_context(struct llama_model * model, unsigned n_ctx, unsigned n_batch,
                                      unsigned n_seq_max, int n_threads, bool embeddings, int flash_attn, bool unified) {
    struct llama_context_params p = llama_context_default_params();
    p.n_ctx = n_ctx;
    p.n_batch = n_batch;
    p.n_ubatch = n_batch;
    p.n_seq_max = n_seq_max;
    p.n_threads = n_threads;
    p.n_threads_batch = n_threads;
    p.embeddings = embeddings;
    p.kv_unified = unified;
    p.no_perf = true;
    p.flash_attn_type = (enum llama_flash_attn_type) flash_attn;  // -1 auto, 0 off, 1 on
    return llama_init_from_model(model, p);
}

// llama_batch by pointer instead of by value
int dh_decode(struct llama_context * ctx, const struct llama_batch * batch) {
    return llama_decode(ctx, *batch);
}

// Greedy decoding in one call, for stretches of plain rounds with nothing else to do between
// tokens: decode `token` at `pos` on sequence `seq`, take the first index of the largest logit as
// the next token (what torch's argmax gives), and so on, at most `n` times; stop after a token in
// `stop`. The chosen tokens go to `out`; returns how many, or -1 - llama_decode's code on an error.
// The cache then holds `token` and every chosen token but the last, as n plain rounds leave it.
int dh_greedy(struct llama_context * ctx, int token, int pos, int seq, int n, const int * stop, int n_stop, int * out) {
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    llama_batch batch = llama_batch_init(1, 0, 1);
    int done = 0;
    while (done < n) {
        batch.n_tokens = 1;
        batch.token[0] = token;
        batch.pos[0] = pos + done;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = seq;
        batch.logits[0] = 1;
        const int rc = llama_decode(ctx, batch);
        if (rc != 0) {
            llama_batch_free(batch);
            return -1 - rc;
        }
        const float * logits = llama_get_logits_ith(ctx, 0);
        int best = 0;
        for (int v = 1; v < n_vocab; ++v) {
            if (logits[v] > logits[best]) {
                best = v;
            }
        }
        out[done++] = best;
        token = best;
        bool stopped = false;
        for (int k = 0; k < n_stop; ++k) {
            stopped = stopped || stop[k] == best;
        }
        if (stopped) {
            break;
        }
    }
    llama_batch_free(batch);
    return done;
}

// llama.cpp's own quantizer: a GGUF's weights to `ftype` (llama.h enum llama_ftype); 0 on success
unsigned dh_quantize(const char * src, const char * dst, int ftype, int n_threads) {
    llama_model_quantize_params p = llama_model_quantize_default_params();
    p.ftype = (enum llama_ftype) ftype;
    p.nthread = n_threads;
    return llama_model_quantize(src, dst, &p);
}

// the input of layer `lid` (the residual stream before it) for every token of the next decodes
void dh_set_layer_inp(struct llama_context * ctx, unsigned lid, bool value) {
    llama_set_embeddings_layer_inp(ctx, lid, value);
}

// [n_tokens of the last decode, n_embd] floats
float * dh_get_layer_inp(struct llama_context * ctx, unsigned lid) {
    return llama_get_embeddings_layer_inp(ctx, lid);
}

}  // extern "C"
