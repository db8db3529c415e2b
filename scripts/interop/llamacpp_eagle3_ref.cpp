// One EAGLE-3 draft step computed by llama.cpp's own eagle3 graphs (src/models/eagle3.cpp), for the
// interop fixture (scripts/interop/fixtures_llamacpp.py builds and runs this against the
// llama.cpp tree that scripts/interop/setup_llamacpp.sh unpacks and builds).
//
// It drives the draft context the way common/speculative.cpp's draft-eagle3 implementation does:
//   encoder pass (LLAMA_PROCESS_TYPE_ENCODE): one embedding row per column = cat of the 3 aux
//     features -> g = fc(features), read with llama_get_embeddings_nextn;
//   decoder pass (LLAMA_PROCESS_TYPE_DECODE): column t = token ids[t] with g[t] attached as its
//     embedding, position t, plain causal attention over the batch -> pre-norm hidden
//     (llama_get_embeddings_nextn_ith) and logits (llama_get_logits_ith: full target vocab, -inf
//     outside the draft vocab, draft logit j at target id d2t[j]).
//
// usage: llamacpp_eagle3_ref TARGET.gguf DRAFT.gguf FEATURES.f32 IDS.i32 T OUT_PREFIX
//   FEATURES.f32: T x n_enc float32 row-major, IDS.i32: T int32.
//   writes OUT_PREFIX.g.f32 (T x n_embd), OUT_PREFIX.hidden.f32 (T x n_embd),
//          OUT_PREFIX.logits.f32 (T x n_vocab), and prints "n_embd n_vocab n_enc".
#include "common.h"
#include "llama.h"
#include "llama-ext.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

template <typename T>
static std::vector<T> read_all(const char * path, size_t n) {
    std::vector<T> v(n);
    std::ifstream f(path, std::ios::binary);
    f.read(reinterpret_cast<char *>(v.data()), (std::streamsize) (n * sizeof(T)));
    if (!f) {
        fprintf(stderr, "cannot read %zu items from %s\n", n, path);
        exit(1);
    }
    return v;
}

static void write_all(const std::string & path, const float * data, size_t n) {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char *>(data), (std::streamsize) (n * sizeof(float)));
}

int main(int argc, char ** argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s TARGET.gguf DRAFT.gguf FEATURES.f32 IDS.i32 T OUT_PREFIX\n", argv[0]);
        return 2;
    }
    const int T = atoi(argv[5]);
    const std::string out = argv[6];

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * tgt = llama_model_load_from_file(argv[1], mp);
    llama_model * dft = llama_model_load_from_file(argv[2], mp);
    if (!tgt || !dft) {
        fprintf(stderr, "model load failed\n");
        return 1;
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 256;
    cp.n_ubatch = 256;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    // Exact f32 attention: F32 KV cache (default F16) and no flash attention (default AUTO, which
    // is on for the CPU backend; with it the outputs move by ~1e-4 relative, without ~1e-7).
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx_tgt = llama_init_from_model(tgt, cp);
    cp.ctx_other = ctx_tgt;  // the draft borrows the target's tok_embd (and lm_head if it has none)
    llama_context * ctx_dft = llama_init_from_model(dft, cp);
    if (!ctx_tgt || !ctx_dft) {
        fprintf(stderr, "context init failed\n");
        return 1;
    }
    llama_set_embeddings_nextn(ctx_dft, true, /*masked*/ true);

    const int n_embd = llama_model_n_embd(dft);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(dft));
    const int n_enc = (int) llama_model_target_layer_ids_n(dft) * llama_model_n_embd(tgt);

    std::vector<float> feats = read_all<float>(argv[3], (size_t) T * n_enc);
    std::vector<int32_t> ids = read_all<int32_t>(argv[4], (size_t) T);

    // encoder: g = fc(features)
    common_batch benc(ctx_dft);
    for (int t = 0; t < T; ++t) {
        llama_pos pos = t;
        benc.add_embd({feats.data() + (size_t) t * n_enc, 1, (size_t) n_enc}, &pos, 0, true);
    }
    if (llama_process(ctx_dft, LLAMA_PROCESS_TYPE_ENCODE, benc.get()) != 0) {
        fprintf(stderr, "encode failed\n");
        return 1;
    }
    std::vector<float> g((size_t) T * n_embd);
    const float * g_src = llama_get_embeddings_nextn(ctx_dft);
    std::copy(g_src, g_src + g.size(), g.begin());

    // decoder: (ids[t], g[t]) at position t
    common_batch bdec(ctx_dft);
    for (int t = 0; t < T; ++t) {
        const int idx = bdec.add(ids[t], t, 0, true);
        bdec.set_embd(idx, {g.data() + (size_t) t * n_embd, 1, (size_t) n_embd});
    }
    if (llama_process(ctx_dft, LLAMA_PROCESS_TYPE_DECODE, bdec.get()) != 0) {
        fprintf(stderr, "decode failed\n");
        return 1;
    }
    std::vector<float> hidden((size_t) T * n_embd), logits((size_t) T * n_vocab);
    for (int t = 0; t < T; ++t) {
        const float * h = llama_get_embeddings_nextn_ith(ctx_dft, t);
        const float * l = llama_get_logits_ith(ctx_dft, t);
        std::copy(h, h + n_embd, hidden.begin() + (size_t) t * n_embd);
        std::copy(l, l + n_vocab, logits.begin() + (size_t) t * n_vocab);
    }
    write_all(out + ".g.f32", g.data(), g.size());
    write_all(out + ".hidden.f32", hidden.data(), hidden.size());
    write_all(out + ".logits.f32", logits.data(), logits.size());
    printf("%d %d %d\n", n_embd, n_vocab, n_enc);

    llama_free(ctx_dft);
    llama_free(ctx_tgt);
    llama_model_free(dft);
    llama_model_free(tgt);
    llama_backend_free();
    return 0;
}
