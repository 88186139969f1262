// llama-stepper MODEL THREADS N_CTX: llama.cpp's side of the interleaved decode (tools/llama_compare/interleaved.py).
//
// One process holds the model open and answers requests on standard input, one per line: "DEPTH N_GEN" runs
// llama-bench's generation test (test_gen: N_GEN decode steps of one random token each, every step synchronised)
// after a context of DEPTH random tokens, and prints one line, {"ns": T, "n_gen": N_GEN, "depth": DEPTH}, T the
// steps' wall time. The context is processed (untimed, as llama-bench's -d) the first time a depth is asked for,
// and kept: a later request at the same depth first removes the tokens a burst added after it (llama-bench restores
// a saved state to the same effect). The model and context are set up as llama-bench's defaults set them (mmap,
// F16 cache, flash attention auto, batch 2048 / ubatch 512, a threadpool of THREADS threads polling at 50), so a
// burst here times what `llama-bench -p 0 -n N_GEN -d DEPTH` times. A bad request prints {"error": "..."}; end of
// input ends the process.
#include "ggml-cpu.h"
#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level, const char *, void *) {}

static long long now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

static bool decode(llama_context * ctx, std::vector<llama_token> & tokens) {
    return llama_decode(ctx, llama_batch_get_one(tokens.data(), (int32_t) tokens.size())) == 0;
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL THREADS N_CTX\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[2]);
    const int n_ctx   = atoi(argv[3]);
    llama_log_set(quiet, nullptr);
    ggml_backend_load_all();
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        printf("{\"error\": \"cannot load %s\"}\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = n_ctx;
    cparams.n_batch         = 2048;
    cparams.n_ubatch        = 512;
    cparams.type_k          = GGML_TYPE_F16;
    cparams.type_v          = GGML_TYPE_F16;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
    cparams.n_threads       = threads;
    cparams.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        printf("{\"error\": \"cannot create a context of %d tokens\"}\n", n_ctx);
        return 1;
    }
    ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    tpp.poll = 50;
    ggml_threadpool * pool = ggml_threadpool_new(&tpp);
    llama_attach_threadpool(ctx, pool, nullptr);
    llama_set_n_threads(ctx, threads, threads);

    const llama_vocab * vocab   = llama_model_get_vocab(model);
    const int32_t       n_vocab = llama_vocab_n_tokens(vocab);
    const bool          bos     = llama_vocab_get_add_bos(vocab);
    llama_memory_t      memory  = llama_get_memory(ctx);
    int depth_held = -1;  // the context now in the cache (-1: none)
    printf("{\"ready\": true, \"n_vocab\": %d}\n", n_vocab);
    fflush(stdout);

    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        int depth = 0, n_gen = 0;
        if (sscanf(line, "%d %d", &depth, &n_gen) != 2 || depth < 0 || n_gen < 1 || depth + n_gen > n_ctx) {
            printf("{\"error\": \"bad request (DEPTH N_GEN within %d tokens): %.60s\"}\n", n_ctx, line);
            fflush(stdout);
            continue;
        }
        if (depth != depth_held) {  // llama-bench's depth run: random tokens in batches of n_batch, untimed
            llama_memory_clear(memory, false);
            for (int done = 0; done < depth;) {
                std::vector<llama_token> batch(std::min(depth - done, 2048));
                for (size_t i = 0; i < batch.size(); i++) {
                    batch[i] = done == 0 && i == 0 && bos ? llama_vocab_bos(vocab) : std::rand() % n_vocab;
                }
                if (!decode(ctx, batch)) {
                    printf("{\"error\": \"the context of %d tokens failed to decode\"}\n", depth);
                    return 1;
                }
                done += (int) batch.size();
            }
            llama_synchronize(ctx);
            depth_held = depth;
        } else if (!llama_memory_seq_rm(memory, 0, depth, -1)) {
            printf("{\"error\": \"cannot remove the tokens after %d\"}\n", depth);
            return 1;
        }
        // llama-bench's test_gen
        std::vector<llama_token> token(1, bos ? llama_vocab_bos(vocab) : std::rand() % n_vocab);
        const long long start = now_ns();
        for (int i = 0; i < n_gen; i++) {
            if (!decode(ctx, token)) {
                printf("{\"error\": \"decode step %d failed\"}\n", i);
                return 1;
            }
            llama_synchronize(ctx);
            token[0] = std::rand() % n_vocab;
        }
        printf("{\"ns\": %lld, \"n_gen\": %d, \"depth\": %d}\n", now_ns() - start, n_gen, depth);
        fflush(stdout);
    }
    llama_free(ctx);
    ggml_threadpool_free(pool);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
