// Shared device helpers for strata_lite's CUDA kernels. Compiled by NVRTC at run time (CuPy) and by
// nvcc in CI, so nothing here includes a CUDA header: NVRTC builds see no system include path.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#define WARP 32

// IEEE half / bfloat16 bits -> float (inline PTX: cuda_fp16.h is not needed)
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16_rn(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Sum over a warp by a fixed xor-shuffle tree: the same order whatever else is in flight, so a
// result never depends on how many tokens or rows share a launch (batch invariance).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The quantized mat-muls' lane order (qmatmul.cu, qmatmul_mma.cu): lane l's partial sums added left to right,
// ((0 + v_0) + v_1) + ... + v_{n-1} over the first n_lanes lanes, for each of the warp's NV values; res[o]
// receives value o's sum (every lane may read res after the call). A tensor-core thread, which owns whole
// outputs, adds its lane classes in this order with one running sum per output (no stack of partials).
// buf: fold_words(NV) floats, res: NV floats, both this warp's own shared memory, buf 16-byte aligned. Passes
// of up to FOLD_ROWS values: lanes store a row each, then lane o < FOLD_ROWS reads row o as float4 (the stride
// of 36 words puts the 8 rows' float4 at distinct banks) and adds it up.
constexpr int FOLD_ROWS = 8, FOLD_STRIDE = 36;
__host__ __device__ constexpr int fold_words(int nv) { return (nv < FOLD_ROWS ? nv : FOLD_ROWS) * FOLD_STRIDE; }
template <int NV>
__device__ __forceinline__ void lane_fold(const float* v, int n_lanes, float* buf, float* res) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c0 = 0; c0 < NV; c0 += FOLD_ROWS) {
        __syncwarp();                              // the previous pass's reads are done
#pragma unroll
        for (int o = 0; o < FOLD_ROWS && o < NV; ++o)
            if (c0 + o < NV) buf[o * FOLD_STRIDE + lane] = v[c0 + o];
        __syncwarp();
        if (lane < FOLD_ROWS && c0 + lane < NV) {
            const float4* row = (const float4*)(buf + lane * FOLD_STRIDE);
            float s = 0.0f;
            if (n_lanes == 32) {                   // every lane had units (rows of >= 32 units): no predicates
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float4 q = row[j];
                    s = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(s, q.x), q.y), q.z), q.w);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float4 q = row[j];
                    if (4 * j < n_lanes) s = __fadd_rn(s, q.x);
                    if (4 * j + 1 < n_lanes) s = __fadd_rn(s, q.y);
                    if (4 * j + 2 < n_lanes) s = __fadd_rn(s, q.z);
                    if (4 * j + 3 < n_lanes) s = __fadd_rn(s, q.w);
                }
            }
            res[c0 + lane] = s;
        }
    }
    __syncwarp();
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// silu(g) * u = g / (1 + exp(-g)) * u with IEEE expf (no fast math): exp(-g) = inf gives -0. One definition
// for the element-wise kernel and the mat-mul epilogue that fuses it, so both give the same bits.
__device__ __forceinline__ float silu_mul1(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// Programmatic dependent launch (kernels/cuda/pdl.py). Every kernel calls this before its first global
// memory access (read or write): wait until the kernel before it in the stream has finished and its writes
// are visible, then let the next kernel be scheduled. Both are no-ops for an ordinary launch, and the PTX
// exists from sm_90 only (older GPUs launch without PDL).
__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
