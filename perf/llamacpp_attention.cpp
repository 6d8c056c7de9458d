// llama.cpp's flash attention (ggml's CUDA backend) timed on the shapes of `perf/bench_gpu.py --prefill-attn`:
// a prompt chunk of n_q tokens of one sequence at positions depth .. depth + n_q - 1 over depth + n_q keys, with
// the causal mask llama.cpp builds for such a chunk (key j visible to token i when j <= depth + i), so ggml skips
// the key tiles the mask hides as it does in llama-server. Written against ggml's public C API; nothing of
// llama.cpp is part of this file. Build it against a ggml / llama.cpp tree built with GGML_CUDA=ON:
//
//   g++ -O2 -std=c++17 perf/llamacpp_attention.cpp -I$GGML/include -L$GGML/build/bin \
//       -lggml -lggml-base -lggml-cuda -Wl,-rpath,'$ORIGIN' -o llamacpp-attention
//
// usage: llamacpp-attention HEAD_DIM N_HEADS N_KV_HEADS N_Q DEPTH f16|q8_0 [ITERATIONS]
// prints one line: "llamacpp_attention hd=.. heads=.. kv_heads=.. n_q=.. depth=.. kv=f16 us=.. tflops=.."
// (flops = 4 x head_dim x the (token, head, key) triples the mask leaves, as bench_gpu.py counts them).
// Inputs are random (q standard-normal-ish in [-1, 1), K and V in [-1, 1)); launches are queued back to back and
// timed as one span after a warm-up, so the per-launch figure holds no host round trip.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cuda.h"

static void fill_random(ggml_tensor* t, std::mt19937& gen) {
    std::uniform_real_distribution<float> dis(-1.0f, 1.0f);
    const int64_t n = ggml_nelements(t);
    std::vector<float> f(n);
    for (auto& x : f) x = dis(gen);
    if (t->type == GGML_TYPE_F32) {
        ggml_backend_tensor_set(t, f.data(), 0, n * sizeof(float));
        return;
    }
    std::vector<uint8_t> q(ggml_row_size(t->type, n));   // f16 or q8_0, row by row of ne0 values
    ggml_quantize_chunk(t->type, f.data(), q.data(), 0, n / t->ne[0], t->ne[0], nullptr);
    ggml_backend_tensor_set(t, q.data(), 0, q.size());
}

int main(int argc, char** argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s HEAD_DIM N_HEADS N_KV_HEADS N_Q DEPTH f16|q8_0 [ITERATIONS]\n", argv[0]);
        return 2;
    }
    const int64_t hd = atoll(argv[1]), n_heads = atoll(argv[2]), n_kv_heads = atoll(argv[3]);
    const int64_t n_q = atoll(argv[4]), depth = atoll(argv[5]);
    const bool q8 = strcmp(argv[6], "q8_0") == 0;
    if (!q8 && strcmp(argv[6], "f16") != 0) {
        fprintf(stderr, "KV type must be f16 or q8_0, not %s\n", argv[6]);
        return 2;
    }
    const int iters = argc > 7 ? atoi(argv[7]) : 20;
    const int64_t n_kv = depth + n_q;
    const ggml_type kv_type = q8 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;

    ggml_backend_t backend = ggml_backend_cuda_init(0);
    if (!backend) {
        fprintf(stderr, "no CUDA device\n");
        return 1;
    }
    ggml_init_params params = {ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true};
    ggml_context* ctx = ggml_init(params);
    ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, hd, n_q, n_heads, 1);
    ggml_tensor* k = ggml_new_tensor_4d(ctx, kv_type, hd, n_kv, n_kv_heads, 1);
    ggml_tensor* v = ggml_new_tensor_4d(ctx, kv_type, hd, n_kv, n_kv_heads, 1);
    ggml_tensor* mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, n_q, 1, 1);
    ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / sqrtf((float)hd), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);   // as llama.cpp's graph sets it
    ggml_cgraph* graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!buf) {
        fprintf(stderr, "could not allocate the tensors\n");
        return 1;
    }
    std::mt19937 gen(3);
    fill_random(q, gen);
    fill_random(k, gen);
    fill_random(v, gen);
    std::vector<ggml_fp16_t> m(n_kv * n_q);            // causal: token i sees keys 0 .. depth + i
    for (int64_t i = 0; i < n_q; ++i)
        for (int64_t j = 0; j < n_kv; ++j) m[i * n_kv + j] = ggml_fp32_to_fp16(j <= depth + i ? 0.0f : -INFINITY);
    ggml_backend_tensor_set(mask, m.data(), 0, m.size() * sizeof(ggml_fp16_t));

    for (int i = 0; i < 3; ++i) ggml_backend_graph_compute(backend, graph);   // warm-up (kernel selection, loads)
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {                // the best of 5 spans of `iters` launches
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) ggml_backend_graph_compute_async(backend, graph);
        ggml_backend_synchronize(backend);
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (us / iters < best) best = us / iters;
    }
    double pairs = 0.0;                                 // (token, key) pairs the mask leaves
    for (int64_t i = 0; i < n_q; ++i) pairs += (double)(depth + i + 1);
    const double flops = 4.0 * hd * n_heads * pairs;
    printf("llamacpp_attention hd=%lld heads=%lld kv_heads=%lld n_q=%lld depth=%lld kv=%s us=%.2f tflops=%.2f\n",
           (long long)hd, (long long)n_heads, (long long)n_kv_heads, (long long)n_q, (long long)depth,
           q8 ? "q8_0" : "f16", best, flops / (best * 1e-6) / 1e12);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    ggml_backend_free(backend);
    return 0;
}
