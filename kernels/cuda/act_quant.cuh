// ggml's activation rounding for the quantized mat-mul, bit-exact with kernels/cpu/act_quant.py: one warp
// per block, used by qmatmul.cu's quant kernels and elementwise.cu's fused rmsnorm + rounding, so both
// give the same bits.
#pragma once
#include "common.cuh"

// Q8_0, lane = weight v of a 32-block -> xq[lane], *xd. s = amax/127, q = rint(x / s) (as x * (1/s)),
// xd = s rounded to f16 (kernels/cpu/act_quant._q8_0_rows).
__device__ __forceinline__ void round_q8_0(float v, i8* xq, float* xd) {
    const int lane = threadIdx.x % WARP;
    const float amax = warp_max(fabsf(v));
    const float s = __fdiv_rn(amax, 127.0f);
    const float inv = s != 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
    xq[lane] = (i8)__float2int_rn(__fmul_rn(v, inv));
    if (lane == 0) *xd = f16_to_f32(f32_to_f16_rn(s));
}

// Q8_K, lane l holds v[i] = weight l + 32i of a 256-block -> xq[l + 32i], *xd. mx = the signed value of
// largest |x| (the first on ties), iscale = -127/mx, q = min(127, rint(iscale * x)), xd = 1/iscale; an
// all-zero block gives 0 and 0 (act_quant._q8_k_rows).
__device__ __forceinline__ void round_q8_k(const float (&v)[8], i8* xq, float* xd) {
    const int lane = threadIdx.x % WARP;
    float best = 0.0f, mx = 0.0f;
    int idx = 256;                                 // index of mx in the block (256: none yet)
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (fabsf(v[i]) > best) { best = fabsf(v[i]); mx = v[i]; idx = 32 * i + lane; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float b2 = __shfl_xor_sync(0xffffffffu, best, o), m2 = __shfl_xor_sync(0xffffffffu, mx, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        if (b2 > best || (b2 == best && i2 < idx)) { best = b2; mx = m2; idx = i2; }
    }
    const float iscale = best != 0.0f ? __fdiv_rn(-127.0f, mx) : 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) xq[32 * i + lane] = (i8)min(127, __float2int_rn(__fmul_rn(iscale, v[i])));
    if (lane == 0) *xd = best != 0.0f ? __fdiv_rn(1.0f, iscale) : 0.0f;
}
