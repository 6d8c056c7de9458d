// Greedy token choice without penalties: best[r] = the lowest id of the largest logit of row r (NaN never
// wins; a row of NaN / -inf only gives 0), the same ids as sampling_kernels.penalize_argmax gives for rows
// with no penalties. One CTA of ARGMAX_THREADS per row; a thread visits its ids in ascending order and keeps
// the first maximum (strict >), and the CTA keeps the lower id of equal values, so the result does not
// depend on the reduction order. Loads are 16 bytes (4 logits) when the row width is a multiple of 4.
#include "common.cuh"

#define ARGMAX_THREADS 1024

__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The CTA's best (value, id) of one row (every thread gets it): threads visit their ids in ascending order
// keeping the first maximum, then the CTA keeps the lower id of equal values. bi = V when no value was taken.
__device__ __forceinline__ void row_best(const float* __restrict__ row, int V, int vec4, float& bv, int& bi) {
    __shared__ float sv[ARGMAX_THREADS / WARP];
    __shared__ int si[ARGMAX_THREADS / WARP];
    const int t = threadIdx.x;
    bv = __int_as_float(0xff800000u);         // -inf: only a larger value is ever taken
    bi = V;                                   // sentinel: no value taken
    if (vec4) {
        const float4* row4 = (const float4*)row;
        const int n4 = V / 4;
        int j = t;
        for (; j + 3 * ARGMAX_THREADS < n4; j += 4 * ARGMAX_THREADS) {   // 4 loads in flight, ids ascending
            float4 x[4];
#pragma unroll
            for (int u = 0; u < 4; u++) x[u] = __ldg(row4 + j + u * ARGMAX_THREADS);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int i = 4 * (j + u * ARGMAX_THREADS);
                if (x[u].x > bv) { bv = x[u].x; bi = i; }
                if (x[u].y > bv) { bv = x[u].y; bi = i + 1; }
                if (x[u].z > bv) { bv = x[u].z; bi = i + 2; }
                if (x[u].w > bv) { bv = x[u].w; bi = i + 3; }
            }
        }
        for (; j < n4; j += ARGMAX_THREADS) {
            const float4 x = __ldg(row4 + j);
            if (x.x > bv) { bv = x.x; bi = 4 * j; }
            if (x.y > bv) { bv = x.y; bi = 4 * j + 1; }
            if (x.z > bv) { bv = x.z; bi = 4 * j + 2; }
            if (x.w > bv) { bv = x.w; bi = 4 * j + 3; }
        }
    } else {
        for (int j = t; j < V; j += ARGMAX_THREADS) {
            const float x = __ldg(row + j);
            if (x > bv) { bv = x; bi = j; }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (t % WARP == 0) {
        sv[t / WARP] = bv;
        si[t / WARP] = bi;
    }
    __syncthreads();
    bv = sv[t % WARP];
    bi = si[t % WARP];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
}

// logits (m, V) float32, 16-byte aligned rows when vec4; row r's id at best[stride * r] (int32; stride > 1: a
// column of a wider row-results buffer). grid m, block ARGMAX_THREADS.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows(const float* __restrict__ logits,
                                                                        int* __restrict__ best, int V, int vec4,
                                                                        int stride) {
    grid_dependency_sync();
    float bv;
    int bi;
    row_best(logits + (size_t)blockIdx.x * V, V, vec4, bv, bi);
    if (threadIdx.x == 0) best[(size_t)stride * blockIdx.x] = bi < V ? bi : 0;
}

// argmax_rows's id and its softmax probability, 1 / sum_j exp(x_j - x_best) (the sum in a fixed order: each
// thread's ids ascending, then xor trees), as a pair of float32: [id bits as int32, probability]. A row
// without a finite best value gives id 0 and probability 0. An MTP drafter's greedy draft and confidence.
// Row r's pair at out[stride * r], out[stride * r + 1] (stride 2: an (m, 2) array; more: two columns of a
// wider row-results buffer).
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_prob_rows(const float* __restrict__ logits,
                                                                             float* __restrict__ out, int V, int vec4,
                                                                             int stride) {
    grid_dependency_sync();
    __shared__ float ss[ARGMAX_THREADS / WARP];
    const float* row = logits + (size_t)blockIdx.x * V;
    const int t = threadIdx.x;
    float bv;
    int bi;
    row_best(row, V, vec4, bv, bi);
    float sum = 0.f;
    for (int j = t; j < V; j += ARGMAX_THREADS) sum += expf(__ldg(row + j) - bv);
    sum = warp_sum(sum);
    if (t % WARP == 0) ss[t / WARP] = sum;
    __syncthreads();
    if (t < WARP) {
        sum = warp_sum(ss[t]);
        if (t == 0) {
            const bool ok = bi < V && isfinite(bv);
            float* o = out + (size_t)stride * blockIdx.x;
            o[0] = __int_as_float(ok ? bi : 0);
            o[1] = ok ? 1.f / sum : 0.f;
        }
    }
}
