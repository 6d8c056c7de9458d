// Quantize K/V rows into the paged int8 cache, bit-identical to kernels/cpu/attention.kv_store (launcher
// and layout: kv_store.py). Per group of head_dim / n_groups channels: scale = amax / 127 (IEEE division),
// q = round half away from zero of x / scale (IEEE division), clipped to +-127; an all-zero group gets
// scale 0 and q 0. Denormals are kept as the CPU keeps them: CuPy compiles every kernel with -ftz=true,
// which flushes subnormal inputs and results of float instructions, so the float steps that can see
// subnormals (|x|, its max, the two divisions, truncation, the comparisons with 0) are inline PTX
// without .ftz or integer operations on the bits.
//
// One CTA per (token, kv head, K or V); thread i owns channel i of its group, groups padded to a power of
// two `span` so the amax tree needs no bounds (max is exact: the tree order does not matter).
#include "common.cuh"

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
    const int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    const float* x = blockIdx.z ? v : k;
    i8* pages = blockIdx.z ? v_pages : k_pages;
    float* scales = blockIdx.z ? v_scales : k_scales;
    const int gs = head_dim / n_groups, gi = i / span, li = i - gi * span, c = gi * gs + li;
    const int pos = token_pos[t];
    const size_t page = (size_t)page_tables[(size_t)token_seq[t] * max_pages + pos / page_size];
    const size_t row = (page * page_size + pos % page_size) * n_kv + h;    // (page, slot, head)
    const float xv = li < gs ? x[((size_t)t * n_kv + h) * head_dim + c] : 0.0f;
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
