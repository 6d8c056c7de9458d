// Tensor-core and async-copy helpers of the attention kernels (attention.cu, attention_f16.cu); NVRTC and nvcc,
// no CUDA header (common.cuh).
#pragma once
#include "common.cuh"

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// Tensor-core products: mma.sync m16n8k16, f16 inputs, f32 accumulators (sm_80+). Fragments (PTX ISA,
// g = lane / 4, tq = lane % 4; low half of a register = lower index): a[0] = A[g][2tq, 2tq+1],
// a[1] = A[g+8][2tq, 2tq+1], a[2] = A[g][2tq+8, 2tq+9], a[3] = A[g+8][2tq+8, 2tq+9]; b0 = B[2tq, 2tq+1][g],
// b1 = B[2tq+8, 2tq+9][g]; c = C[g][2tq], C[g][2tq+1], C[g+8][2tq], C[g+8][2tq+1]. Which key or channel
// stands at an index k is the kernel's choice as long as A and B agree on it (each kernel's loads pick the
// orders that keep its shared-memory reads free of bank conflicts).
__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to f16 (nearest, ties to even), packed: a in the low half.
__device__ __forceinline__ u32 pack_f16x2(float a, float b) {
    return (u32)f32_to_f16_rn(a) | (u32)f32_to_f16_rn(b) << 16;
}

// cp.async (sm_80+): global -> shared without a register round trip; waited for with cp_async_wait<N>
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
template <int BYTES>
__device__ __forceinline__ void cp_async_s(u32 dst, const void* src) {   // dst: a shared-window address
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(BYTES) : "memory");
}
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) { cp_async_s<BYTES>(smem_u32(dst), src); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
