// Quantized mat-mul y = x @ W.T over raw GGUF blocks, the activation quantizers that feed it (ggml's
// Q8_0 / Q8_K rounding, bit-exact with kernels/cpu/act_quant.py) and the row dequantizer (embedding
// lookup, bit-exact with gguf.quants.dequantize).
//
// Work split of the mat-mul: one warp per output row, blockDim.y rows per CTA, TILE tokens per CTA along
// grid.y. A row is cut into "units" (32 weights; 64 for Q4_K/Q5_K, 8 for float weights); lane l takes
// units l, l+32, ... and decodes each unit once for the whole token tile. Per token, the unit's int8
// weights are dotted with the int8 activations by __dp4a, the integer sums are scaled in float with
// explicit __fmul_rn/__fmaf_rn (no contraction choices left to the compiler), and the 32 lane sums are
// added by warp_sum's fixed tree. So every output's arithmetic depends only on its row and its token,
// never on TILE, the token's slot in the tile, or what else shares the launch (batch invariance).
#include "qmatmul_types.cuh"

// --------------------------------------------------------------------------------------- mat-mul
// W (n_out, row_bytes) u8 rows of blocks; xq (n_tok, k) int8 with 16-byte aligned rows; xd (n_tok, k / XB)
// f32; y (n_tok, n_out) f32. grid (cdiv(n_out, blockDim.y), cdiv(n_tok, TILE)), block (32, rows per CTA).
template <class T, int TILE>
__device__ __forceinline__ void mm_q(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                     const i8* __restrict__ xq, const float* __restrict__ xd,
                                     float* __restrict__ y, int n_tok, const u32* tab) {
    const int lane = threadIdx.x, row = blockIdx.x * blockDim.y + threadIdx.y;
    const int t0 = blockIdx.y * TILE, nt = min(TILE, n_tok - t0);
    if (row >= n_out) return;                      // whole warps: the warp_sum below sees full warps
    const u8* wr = W + (size_t)row * row_bytes;
    const int n_units = k / T::UNIT, n_xd = k / T::XB, upx = T::XB / T::UNIT;
    float acc[TILE];
#pragma unroll
    for (int t = 0; t < TILE; ++t) acc[t] = 0.0f;
    for (int u = lane; u < n_units; u += WARP) {
        typename T::U v;
        T::decode(wr, u, tab, v);                  // once for the whole token tile
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            if (t < nt) {
                i32 x[T::NW];
                T::xload(xq + (size_t)(t0 + t) * k, u, x);
                acc[t] = T::dot(v, x, __ldg(xd + (size_t)(t0 + t) * n_xd + u / upx), acc[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TILE; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < nt) y[(size_t)(t0 + t) * n_out + row] = s;
    }
}

#define MM_Q_KERNEL(NAME, T, TILE)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) mm_##NAME##_t##TILE(                               \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xq,             \
        const float* __restrict__ xd, float* __restrict__ y, int n_tok) {                                 \
        __shared__ u32 grid[T::GRID ? 256 : 1];                                                           \
        load_grid<T>(grid);                                                                               \
        mm_q<T, TILE>(W, row_bytes, n_out, k, xq, xd, y, n_tok, grid);                                    \
    }
#define MM_Q_KERNELS(NAME, T) \
    MM_Q_KERNEL(NAME, T, 1) MM_Q_KERNEL(NAME, T, 2) MM_Q_KERNEL(NAME, T, 4) MM_Q_KERNEL(NAME, T, 8)

MM_Q_KERNELS(q8_0, TQ8_0)
MM_Q_KERNELS(q4_0, TQ4_0)
MM_Q_KERNELS(q5_0, TQ5_0)
MM_Q_KERNELS(iq4_nl, TIQ4_NL)
MM_Q_KERNELS(q4_k, TQ4_K)
MM_Q_KERNELS(q5_k, TQ5_K)
MM_Q_KERNELS(q6_k, TQ6_K)
MM_Q_KERNELS(iq3_xxs, TIQ3_XXS)

// Float weights with float activations: unit = 8 weights (one 16-byte load of f16/bf16, two of f32).
__device__ __forceinline__ void w8_f32(const u8* r, int u, float* w) {
    const float4* p = (const float4*)(r + 32 * (size_t)u);
    const float4 a = p[0], b = p[1];
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}
__device__ __forceinline__ void w8_f16(const u8* r, int u, float* w) {
    const uint4 a = *(const uint4*)(r + 16 * (size_t)u);
    const u32 h[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[2 * i] = f16_to_f32((u16)(h[i] & 0xffffu));
        w[2 * i + 1] = f16_to_f32((u16)(h[i] >> 16));
    }
}
__device__ __forceinline__ void w8_bf16(const u8* r, int u, float* w) {
    const uint4 a = *(const uint4*)(r + 16 * (size_t)u);
    const u32 h[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[2 * i] = __uint_as_float(h[i] << 16);
        w[2 * i + 1] = __uint_as_float(h[i] & 0xffff0000u);
    }
}

// x (n_tok, k) f32 with 16-byte aligned rows, k % 8 == 0; otherwise as mm_q.
template <int TILE, void (*LOADW)(const u8*, int, float*)>
__device__ __forceinline__ void mm_f(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                     const float* __restrict__ x, float* __restrict__ y, int n_tok) {
    const int lane = threadIdx.x, row = blockIdx.x * blockDim.y + threadIdx.y;
    const int t0 = blockIdx.y * TILE, nt = min(TILE, n_tok - t0);
    if (row >= n_out) return;
    const u8* wr = W + (size_t)row * row_bytes;
    float acc[TILE];
#pragma unroll
    for (int t = 0; t < TILE; ++t) acc[t] = 0.0f;
    for (int u = lane; u < k / 8; u += WARP) {
        float w[8];
        LOADW(wr, u, w);
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            if (t < nt) {
                const float4* p = (const float4*)(x + (size_t)(t0 + t) * k + 8 * u);
                const float4 a = p[0], b = p[1];
                float s = acc[t];
                s = __fmaf_rn(w[0], a.x, s); s = __fmaf_rn(w[1], a.y, s);
                s = __fmaf_rn(w[2], a.z, s); s = __fmaf_rn(w[3], a.w, s);
                s = __fmaf_rn(w[4], b.x, s); s = __fmaf_rn(w[5], b.y, s);
                s = __fmaf_rn(w[6], b.z, s); s = __fmaf_rn(w[7], b.w, s);
                acc[t] = s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TILE; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < nt) y[(size_t)(t0 + t) * n_out + row] = s;
    }
}

#define MM_F_KERNEL(NAME, LOADW, TILE)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) mm_##NAME##_t##TILE(                               \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const float* __restrict__ x,           \
        float* __restrict__ y, int n_tok) {                                                               \
        mm_f<TILE, LOADW>(W, row_bytes, n_out, k, x, y, n_tok);                                           \
    }
#define MM_F_KERNELS(NAME, LOADW) \
    MM_F_KERNEL(NAME, LOADW, 1) MM_F_KERNEL(NAME, LOADW, 2) MM_F_KERNEL(NAME, LOADW, 4) MM_F_KERNEL(NAME, LOADW, 8)

MM_F_KERNELS(f32, w8_f32)
MM_F_KERNELS(f16, w8_f16)
MM_F_KERNELS(bf16, w8_bf16)

// ---------------------------------------------------------------------------- activation rounding
// x (n_blocks * 32) f32 -> xq int8, xd (n_blocks) f32: one warp per 32-block, lane = weight.
// s = amax/127, q = rint(x / s) (as x * (1/s)), xd = s rounded to f16 (kernels/cpu/act_quant._q8_0_rows).
extern "C" __global__ void __launch_bounds__(256) quant_q8_0(const float* __restrict__ x, i8* __restrict__ xq,
                                                             float* __restrict__ xd, int n_blocks) {
    const int blk = blockIdx.x * blockDim.y + threadIdx.y, lane = threadIdx.x;
    if (blk >= n_blocks) return;
    const float v = x[(size_t)blk * 32 + lane];
    const float amax = warp_max(fabsf(v));
    const float s = __fdiv_rn(amax, 127.0f);
    const float inv = s != 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
    xq[(size_t)blk * 32 + lane] = (i8)__float2int_rn(__fmul_rn(v, inv));
    if (lane == 0) xd[blk] = f16_to_f32(f32_to_f16_rn(s));
}

// x (n_blocks * 256) f32 -> xq int8, xd (n_blocks) f32: one warp per 256-block, lane l holds weights
// l + 32i. mx = the signed value of largest |x| (the first on ties), iscale = -127/mx,
// q = min(127, rint(iscale * x)), xd = 1/iscale; an all-zero block gives 0 and 0 (act_quant._q8_k_rows).
extern "C" __global__ void __launch_bounds__(256) quant_q8_k(const float* __restrict__ x, i8* __restrict__ xq,
                                                             float* __restrict__ xd, int n_blocks) {
    const int blk = blockIdx.x * blockDim.y + threadIdx.y, lane = threadIdx.x;
    if (blk >= n_blocks) return;
    const float* xb = x + (size_t)blk * 256;
    float v[8], best = 0.0f, mx = 0.0f;
    int idx = 256;                                 // index of mx in the block (256: none yet)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = xb[32 * i + lane];
        if (fabsf(v[i]) > best) { best = fabsf(v[i]); mx = v[i]; idx = 32 * i + lane; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float b2 = __shfl_xor_sync(0xffffffffu, best, o), m2 = __shfl_xor_sync(0xffffffffu, mx, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        if (b2 > best || (b2 == best && i2 < idx)) { best = b2; mx = m2; idx = i2; }
    }
    const float iscale = best != 0.0f ? __fdiv_rn(-127.0f, mx) : 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i)
        xq[(size_t)blk * 256 + 32 * i + lane] = (i8)min(127, __float2int_rn(__fmul_rn(iscale, v[i])));
    if (lane == 0) xd[blk] = best != 0.0f ? __fdiv_rn(1.0f, iscale) : 0.0f;
}

// ------------------------------------------------------------------------------------- dequant
// out (m, k) f32 = rows ids (m) of W, bit-exact with gguf.quants.dequantize; an id outside [0, n_out)
// gives a NaN row. grid (m, cdiv(k / UNIT, blockDim.x)), 1-D blocks; thread = unit.
template <class T>
__device__ __forceinline__ void dq_rows(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                        const i32* __restrict__ ids, float* __restrict__ out, const u32* tab) {
    const int u = blockIdx.y * blockDim.x + threadIdx.x;
    if (u >= k / T::UNIT) return;
    const int id = ids[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * k;
    if (id < 0 || id >= n_out) {                   // units cover the row: unit u fills [u * UNIT, (u+1) * UNIT)
        for (int i = 0; i < T::UNIT; ++i) o[u * T::UNIT + i] = __int_as_float(0x7fc00000);
        return;
    }
    typename T::U v;
    T::decode(W + (size_t)id * row_bytes, u, tab, v);
    T::deq(v, o + T::offset(u));
}

#define DQ_KERNEL(NAME, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) dq_##NAME(const u8* __restrict__ W, int row_bytes, \
        int n_out, int k, const i32* __restrict__ ids, float* __restrict__ out) {                         \
        __shared__ u32 grid[T::GRID ? 256 : 1];                                                           \
        load_grid<T>(grid);                                                                               \
        dq_rows<T>(W, row_bytes, n_out, k, ids, out, grid);                                               \
    }
DQ_KERNEL(q8_0, TQ8_0)
DQ_KERNEL(q4_0, TQ4_0)
DQ_KERNEL(q5_0, TQ5_0)
DQ_KERNEL(iq4_nl, TIQ4_NL)
DQ_KERNEL(q4_k, TQ4_K)
DQ_KERNEL(q5_k, TQ5_K)
DQ_KERNEL(q6_k, TQ6_K)
DQ_KERNEL(iq3_xxs, TIQ3_XXS)

// Float weights: one thread per 8 values (the same loads as the mat-mul; conversions are exact).
template <void (*LOADW)(const u8*, int, float*)>
__device__ __forceinline__ void dq_rows_f(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                          const i32* __restrict__ ids, float* __restrict__ out) {
    const int u = blockIdx.y * blockDim.x + threadIdx.x;
    if (u >= k / 8) return;
    const int id = ids[blockIdx.x];
    float w[8];
    if (id < 0 || id >= n_out) {
        for (int i = 0; i < 8; ++i) w[i] = __int_as_float(0x7fc00000);
    } else {
        LOADW(W + (size_t)id * row_bytes, u, w);
    }
    float4 a, b;
    a.x = w[0]; a.y = w[1]; a.z = w[2]; a.w = w[3];
    b.x = w[4]; b.y = w[5]; b.z = w[6]; b.w = w[7];
    float4* o = (float4*)(out + (size_t)blockIdx.x * k + 8 * u);
    o[0] = a;
    o[1] = b;
}
#define DQ_F_KERNEL(NAME, LOADW)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) dq_##NAME(const u8* __restrict__ W, int row_bytes, \
        int n_out, int k, const i32* __restrict__ ids, float* __restrict__ out) {                         \
        dq_rows_f<LOADW>(W, row_bytes, n_out, k, ids, out);                                               \
    }
DQ_F_KERNEL(f32, w8_f32)
DQ_F_KERNEL(f16, w8_f16)
DQ_F_KERNEL(bf16, w8_bf16)
