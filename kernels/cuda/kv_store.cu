// Quantize K/V rows into the paged int8 cache, bit-identical to kernels/cpu/attention.kv_store (launcher
// and layout: kv_store.py). Per group of head_dim / n_groups channels: scale = amax / 127 (IEEE division),
// q = round half away from zero of x / scale (IEEE division), clipped to +-127; an all-zero group gets
// scale 0 and q 0. Denormals are kept as the CPU keeps them: CuPy compiles every kernel with -ftz=true,
// which flushes subnormal inputs and results of float instructions, so the float steps that can see
// subnormals (|x|, its max, the two divisions, truncation, the comparisons with 0) are inline PTX
// without .ftz or integer operations on the bits.
//
// One CTA per (token, kv head, K or V); thread i owns channel i of its group, groups padded to a power of
// two `span` so the amax tree needs no bounds (max is exact: the tree order does not matter). rope_kv_store
// also rotates this step's q and k first (decoder blocks: one launch instead of two).
#include "common.cuh"
#include "rope.cuh"

#define KV_MAX_THREADS 1024

__device__ __forceinline__ float div_rn_keep_denormals(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float trunc_keep_denormals(float a) {
    float r;
    asm("cvt.rzi.f32.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ u32 abs_bits(float a) { return __float_as_uint(a) & 0x7fffffffu; }   // |a|: ordered as u32

// Quantize one head's row x (head_dim floats) into cache row `row` ((page * page_size + slot) * n_kv + head)
// of pages / scales. Thread i owns channel i - gi * span of group gi = i / span; amax: shared, blockDim.x.
// x is not __restrict__: rope_kv_store writes it earlier in the same kernel (no read-only cache loads).
__device__ __forceinline__ void store_row(const float* x, i8* __restrict__ pages,
                                          float* __restrict__ scales, size_t row, int head_dim, int n_groups,
                                          int span, u32* amax) {
    const int i = threadIdx.x;
    const int gs = head_dim / n_groups, gi = i / span, li = i - gi * span, c = gi * gs + li;
    const float xv = li < gs ? x[c] : 0.0f;
    amax[i] = abs_bits(xv);
    for (int stride = span / 2; stride > 0; stride >>= 1) {
        __syncthreads();
        if (li < stride) amax[i] = max(amax[i], amax[i + stride]);
    }
    __syncthreads();
    const float sc = div_rn_keep_denormals(__uint_as_float(amax[gi * span]), 127.0f);
    if (li == 0) scales[row * n_groups + gi] = sc;
    if (li < gs) {
        float r = 0.0f;
        if (abs_bits(sc) != 0u) {
            // |y| <= ~127 and y - trunc(y) is exact: past the division nothing is subnormal but y itself,
            // whose sign and size the integer tests read
            const float y = div_rn_keep_denormals(xv, sc);
            r = trunc_keep_denormals(y);
            if (fabsf(__fsub_rn(y, r)) >= 0.5f) r = __fadd_rn(r, (__float_as_uint(y) >> 31) ? -1.0f : 1.0f);
            r = fminf(fmaxf(r, -127.0f), 127.0f);
        }
        pages[row * head_dim + c] = (i8)(int)r;
    }
}

// The cache row of token t, kv head h: (page * page_size + slot) * n_kv + h
__device__ __forceinline__ size_t cache_row(const i32* token_seq, const i32* token_pos, const i32* page_tables,
                                            int max_pages, int page_size, int n_kv, int t, int h) {
    const int pos = token_pos[t];
    const size_t page = (size_t)page_tables[(size_t)token_seq[t] * max_pages + pos / page_size];
    return (page * page_size + pos % page_size) * n_kv + h;
}

// k, v (n_tok, n_kv, head_dim) f32; token_seq, token_pos (n_tok) i32; page_tables (n_seqs, max_pages) i32;
// pages (n_pages, page_size, n_kv, head_dim) i8; scales (n_pages, page_size, n_kv, n_groups) f32.
// grid (n_tok, n_kv, 2), block n_groups * span.
extern "C" __global__ void __launch_bounds__(KV_MAX_THREADS) kv_store(
    const float* __restrict__ k, const float* __restrict__ v, const i32* __restrict__ token_seq,
    const i32* __restrict__ token_pos, const i32* __restrict__ page_tables, int max_pages,
    i8* __restrict__ k_pages, float* __restrict__ k_scales, i8* __restrict__ v_pages, float* __restrict__ v_scales,
    int n_kv, int head_dim, int n_groups, int page_size, int span) {
    grid_dependency_sync();
    __shared__ u32 amax[KV_MAX_THREADS];             // bits of |x|: non-negative floats order as integers
    const int t = blockIdx.x, h = blockIdx.y;
    const size_t row = cache_row(token_seq, token_pos, page_tables, max_pages, page_size, n_kv, t, h);
    store_row((blockIdx.z ? v : k) + ((size_t)t * n_kv + h) * head_dim, blockIdx.z ? v_pages : k_pages,
              blockIdx.z ? v_scales : k_scales, row, head_dim, n_groups, span, amax);
}

// rope_qk_f32 (elementwise.cu) and kv_store in one launch, the same bits: grid (n_tok, n_kv, 3), block
// n_groups * span. z = 0: rope of k head h (in place, rope.cuh), then its row stored; z = 1: v head h stored;
// z = 2: rope of the G = n_q / n_kv query heads of group h. q (n_tok, n_q, head_dim); q_scale (n_q, head_dim)
// and k_scale (n_kv, head_dim) or null; positions = token_pos; tab, tab_rows as rope_f32's.
extern "C" __global__ void __launch_bounds__(KV_MAX_THREADS) rope_kv_store(
    float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v, const i32* __restrict__ token_seq,
    const i32* __restrict__ token_pos, const i32* __restrict__ page_tables, int max_pages,
    i8* __restrict__ k_pages, float* __restrict__ k_scales, i8* __restrict__ v_pages, float* __restrict__ v_scales,
    int n_q, int n_kv, int head_dim, int n_groups, int page_size, int span, double freq_base, int n_rot, int neox,
    const float* __restrict__ q_scale, const float* __restrict__ k_scale, const CS* __restrict__ tab, int tab_rows) {
    grid_dependency_sync();
    __shared__ u32 amax[KV_MAX_THREADS];
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    const int t = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
    if (z != 1) rope_angles(cs, sn, token_pos[t], freq_base, n_rot, tab, tab_rows);   // uniform per CTA
    if (z == 2) {
        const int G = n_q / n_kv;
        rope_heads(q + ((size_t)t * n_q + (size_t)h * G) * head_dim, G, head_dim, n_rot, neox,
                   q_scale ? q_scale + (size_t)h * G * head_dim : nullptr, cs, sn);
        return;
    }
    const size_t off = ((size_t)t * n_kv + h) * head_dim;
    if (z == 0) {
        rope_heads(k + off, 1, head_dim, n_rot, neox, k_scale ? k_scale + (size_t)h * head_dim : nullptr, cs, sn);
        __syncthreads();                             // the rotated row, written by other threads, is visible
    }
    const size_t row = cache_row(token_seq, token_pos, page_tables, max_pages, page_size, n_kv, t, h);
    store_row(z ? v + off : k + off, z ? v_pages : k_pages, z ? v_scales : k_scales, row, head_dim, n_groups,
              span, amax);
}
