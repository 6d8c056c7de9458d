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

// Unaligned-safe loads: GGUF blocks are 2-byte aligned at best (Q6_K 210 B, IQ3_XXS 98 B, Q8_0 34 B)
__device__ __forceinline__ u16 load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ u32 load_u32_a2(const u8* p) {   // p 2-byte aligned
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}
__device__ __forceinline__ u32 load_u32_a4(const u8* p) { return *(const u32*)p; }

// (float)i, exactly, for |i| < 2^22, in two full-rate instructions (an integer add into the mantissa of
// 1.5 * 2^23, then a float subtraction) instead of I2F, which issues at a quarter of the FMA rate: the
// tensor-core mat-mul converts one integer sum per output and 32 weights.
__device__ __forceinline__ float small_i2f(i32 i) { return __fsub_rn(__int_as_float(0x4B400000 + i), 12582912.0f); }

// Sum over a warp by a fixed xor-shuffle tree: the same order whatever else is in flight, so a
// result never depends on how many tokens or rows share a launch (batch invariance).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
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
