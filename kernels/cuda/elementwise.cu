// Elementwise / per-row kernels of the CUDA backend: rmsnorm, rope (+ K-smoothing channel scales),
// silu_mul, add (same shape or bias), and a row/column copy (take_rows, split_cols). Launchers:
// elementwise.py. All data float32 C-contiguous; sizes are ints passed from the host.
//
// These are memory-bound: the *_x4 variants move 16 bytes per access (F4) and are chosen by the
// launcher when widths and addresses are multiples of 4 floats. No reduction here depends on how many
// rows share a launch (batch invariance): rmsnorm reduces one row per CTA in a fixed order.
#include "common.cuh"
#include "act_quant.cuh"
#include "rope.cuh"

struct alignas(16) F4 { float x, y, z, w; };

#define NORM_MAX_WARPS 32

// ----------------------------------------------------------------------------- rmsnorm
// out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, one CTA per row r (grid n, block a multiple of
// 32 that depends only on d). Sum of squares in float32: each thread sums its strided elements in
// ascending order, then a fixed xor-shuffle tree per warp, then the warp sums in warp order.
// out may alias x: each element is read and written by the same thread, after the reduction.
__device__ __forceinline__ float block_sum_fixed(float v) {
    __shared__ float part[NORM_MAX_WARPS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < n_warps; ++i) s += part[i];   // every thread, same order
    return s;
}

__device__ __forceinline__ float row_scale(float ss, int d, double eps) {
    return (float)(1.0 / sqrt((double)ss / d + eps));  // one double op per row, as the CPU kernel
}

extern "C" __global__ void rmsnorm_f32(const float* x, const float* w, double eps, float* out, int d) {
    grid_dependency_sync();
    const i64 base = (i64)blockIdx.x * d;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) { float v = x[base + j]; ss += v * v; }
    const float sc = row_scale(block_sum_fixed(ss), d, eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) out[base + j] = x[base + j] * sc * w[j];
}

// One row of rmsnorm in float4s (d % 4 == 0, 16-byte aligned); the row's output also goes to copy when
// given (shared memory of the fused rounding kernel). Squares summed by explicit fma, so every caller
// gives the same bits.
__device__ __forceinline__ void rmsnorm_row4(const float* x, const float* w, double eps, float* out, int d,
                                             F4* copy) {
    const F4* x4 = (const F4*)(x + (i64)blockIdx.x * d);
    const F4* w4 = (const F4*)w;
    F4* o4 = (F4*)(out + (i64)blockIdx.x * d);
    const int d4 = d / 4;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d4; j += blockDim.x) {
        const F4 v = x4[j];
        ss = __fmaf_rn(v.x, v.x, ss); ss = __fmaf_rn(v.y, v.y, ss);
        ss = __fmaf_rn(v.z, v.z, ss); ss = __fmaf_rn(v.w, v.w, ss);
    }
    const float sc = row_scale(block_sum_fixed(ss), d, eps);
    for (int j = threadIdx.x; j < d4; j += blockDim.x) {
        const F4 v = x4[j], g = w4[j];
        const F4 h = F4{__fmul_rn(__fmul_rn(v.x, sc), g.x), __fmul_rn(__fmul_rn(v.y, sc), g.y),
                        __fmul_rn(__fmul_rn(v.z, sc), g.z), __fmul_rn(__fmul_rn(v.w, sc), g.w)};
        o4[j] = h;
        if (copy) copy[j] = h;
    }
}

extern "C" __global__ void rmsnorm_f32_x4(const float* x, const float* w, double eps, float* out, int d) {
    grid_dependency_sync();
    rmsnorm_row4(x, w, eps, out, d, nullptr);
}

// rmsnorm_f32_x4's output, also rounded for a quantized mat-mul in the same launch: xq (n, d) int8,
// xd (n, d / XB) f32 as quant_q8_0 (XB 32) / quant_q8_k (XB 256) of qmatmul.cu would round out (the same
// act_quant.cuh functions over the same floats, kept in shared memory: d * 4 bytes of dynamic shared).
template <int XB>
__device__ __forceinline__ void rmsnorm_round(const float* x, const float* w, double eps, float* out, i8* xq,
                                              float* xd, int d) {
    extern __shared__ float hs[];
    rmsnorm_row4(x, w, eps, out, d, (F4*)hs);
    __syncthreads();
    const int lane = threadIdx.x % WARP, n_warps = blockDim.x / WARP;
    i8* q = xq + (i64)blockIdx.x * d;
    float* s = xd + (i64)blockIdx.x * (d / XB);
    for (int b = threadIdx.x / WARP; b < d / XB; b += n_warps) {
        if constexpr (XB == 32) {
            round_q8_0(hs[b * 32 + lane], q + b * 32, s + b);
        } else {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = hs[b * 256 + 32 * i + lane];
            round_q8_k(v, q + b * 256, s + b);
        }
    }
}
extern "C" __global__ void rmsnorm_q8_0(const float* x, const float* w, double eps, float* out, i8* xq, float* xd,
                                        int d) {
    grid_dependency_sync();
    rmsnorm_round<32>(x, w, eps, out, xq, xd, d);
}
extern "C" __global__ void rmsnorm_q8_k(const float* x, const float* w, double eps, float* out, i8* xq, float* xd,
                                        int d) {
    grid_dependency_sync();
    rmsnorm_round<256>(x, w, eps, out, xq, xd, d);
}

// ----------------------------------------------------------------------------- rope
// Kernels over rope.cuh (the rotation itself and where its cos / sin come from).
// tab (n_pos, n_rot / 2): the cos / sin of every position < n_pos. grid n_pos, any block.
extern "C" __global__ void rope_table_f32(CS* tab, double freq_base, int n_rot, int n_pos) {
    grid_dependency_sync();
    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        tab[(i64)blockIdx.x * half + i] = rope_angle(blockIdx.x, i, freq_base, n_rot);
}

extern "C" __global__ void rope_f32(float* x, const i32* positions, double freq_base, int n_heads,
                                    int head_dim, int n_rot, int neox, const float* channel_scale,
                                    const CS* tab, int tab_rows) {
    grid_dependency_sync();
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    rope_angles(cs, sn, positions[blockIdx.x], freq_base, n_rot, tab, tab_rows);
    rope_heads(x + (i64)blockIdx.x * n_heads * head_dim, n_heads, head_dim, n_rot, neox, channel_scale, cs, sn);
}

// q (n_tok, n_q, head_dim) and k (n_tok, n_k, head_dim) of the same tokens in one launch (rope_f32 twice).
extern "C" __global__ void rope_qk_f32(float* q, float* k, const i32* positions, double freq_base, int n_q,
                                       int n_k, int head_dim, int n_rot, int neox, const float* q_scale,
                                       const float* k_scale, const CS* tab, int tab_rows) {
    grid_dependency_sync();
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    rope_angles(cs, sn, positions[blockIdx.x], freq_base, n_rot, tab, tab_rows);
    rope_heads(q + (i64)blockIdx.x * n_q * head_dim, n_q, head_dim, n_rot, neox, q_scale, cs, sn);
    rope_heads(k + (i64)blockIdx.x * n_k * head_dim, n_k, head_dim, n_rot, neox, k_scale, cs, sn);
}

// ----------------------------------------------------------------------------- silu_mul, add
// Flat over n elements (n4 = n / 4 vectors for the _x4 variants); grid = ceil(n / block).
// silu_mul1: common.cuh. out may alias either input: every element is read before it is written, by one thread.

extern "C" __global__ void silu_mul_f32(const float* gate, const float* up, float* out, i64 n) {
    grid_dependency_sync();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu_mul1(gate[i], up[i]);
}

extern "C" __global__ void silu_mul_f32_x4(const F4* gate, const F4* up, F4* out, i64 n4) {
    grid_dependency_sync();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const F4 g = gate[i], u = up[i];
    out[i] = F4{silu_mul1(g.x, u.x), silu_mul1(g.y, u.y), silu_mul1(g.z, u.z), silu_mul1(g.w, u.w)};
}

// out = a + b where b has nb elements repeated over a's n (nb == n: same shape; nb == n_cols: bias).
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, i64 n, i64 nb) {
    grid_dependency_sync();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i % nb];
}

extern "C" __global__ void add_f32_x4(const F4* a, const F4* b, F4* out, i64 n4, i64 nb4) {
    grid_dependency_sync();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const F4 u = a[i], v = b[i % nb4];
    out[i] = F4{u.x + v.x, u.y + v.y, u.z + v.z, u.w + v.w};
}

// ----------------------------------------------------------------------------- row / column copy
// out[r, j] = x[src, start + j] for j < width, src = rows[r] (take_rows) or r when rows is null
// (split_cols); x has x_cols columns. One CTA per output row (grid m). The _x4 variant needs x_cols,
// start and width multiples of 4 (passed in floats, used in F4 units).
extern "C" __global__ void copy_rows_f32(const float* x, const i32* rows, i64 x_cols, i64 start,
                                         float* out, int width) {
    grid_dependency_sync();
    const i64 src = rows ? (i64)rows[blockIdx.x] : (i64)blockIdx.x;
    const float* xr = x + src * x_cols + start;
    float* o = out + (i64)blockIdx.x * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) o[j] = xr[j];
}

extern "C" __global__ void copy_rows_f32_x4(const float* x, const i32* rows, i64 x_cols, i64 start,
                                            float* out, int width) {
    grid_dependency_sync();
    const i64 src = rows ? (i64)rows[blockIdx.x] : (i64)blockIdx.x;
    const F4* xr = (const F4*)(x + src * x_cols + start);
    F4* o = (F4*)(out + (i64)blockIdx.x * width);
    for (int j = threadIdx.x; j < width / 4; j += blockDim.x) o[j] = xr[j];
}
