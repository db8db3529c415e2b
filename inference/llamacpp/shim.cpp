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

// One context for the whole generation: every row and every tree leaf is a sequence of one
// unified KV cache (kv_unified), so the cells of a shared prefix serve all of them.
struct llama_context * dh_new_context(struct llama_model * model, unsigned n_ctx, unsigned n_batch,
                                      unsigned n_seq_max, int n_threads, bool embeddings, int flash_attn) {
    struct llama_context_params p = llama_context_default_params();
    p.n_ctx = n_ctx;
    p.n_batch = n_batch;
    p.n_ubatch = n_batch;
    p.n_seq_max = n_seq_max;
    p.n_threads = n_threads;
    p.n_threads_batch = n_threads;
    p.embeddings = embeddings;
    p.kv_unified = true;
    p.no_perf = true;
    p.flash_attn_type = (enum llama_flash_attn_type) flash_attn;  // -1 auto, 0 off, 1 on
    return llama_init_from_model(model, p);
}

// llama_batch by pointer instead of by value
int dh_decode(struct llama_context * ctx, const struct llama_batch * batch) {
    return llama_decode(ctx, *batch);
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
