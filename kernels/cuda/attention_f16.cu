// Prompt attention over an f16 copy of one sequence's keys (flash attention; `--prompt-attention f16`,
// attention_f16.py).
//
// Pass 1 (kv_to_f16_d<D>): keys 0 .. n_keys - 1 of sequence `seq` from the paged int8 cache, each value times its
// 32-channel scale rounded once to f16, into kf (n_kv, n_pad, D) and, transposed, vt (n_kv, D, n_pad); keys
// n_keys .. n_pad - 1 are zeros (their scores are masked, and a zero V keeps 0 x V finite).
// Pass 2 (fa_f16_d<D>): rows are (token, query head) pairs of one kv head, pair p = token * G + h; a CTA of 4 warps
// takes 64 pairs (16 a warp), walks the keys in tiles of 64 (K and V^T tiles double-buffered in shared memory by
// cp.async) and keeps per row the running max m, sum l and output acc: per tile S = q' K^T on the tensor cores
// (q' = q x qscale in f16, qscale folding log2(e)), causal mask where the tile reaches past the CTA's smallest
// position, m' = max(m, rowmax S), p = 2^(S - m'), acc = acc 2^(m - m') + p V (p in f16 as the A operand), l
// likewise in float; out = acc / l. Each row's arithmetic depends on its own q and keys only (the tile order is
// fixed; a tile wholly past a row's position scales its sums by 2^0 and adds zeros), so a token's output is the
// same whatever else shares the launch; it is not
// the bits of attention.cu's kernels (q', K, V and p are rounded to f16: reference.f16_flash_bound).
#include "tensor_f16.cuh"

#define FA_KT 64               // keys per tile
#define FA_ROWS 64             // (token, head) pairs per CTA: 4 warps x 16
#define FA_THREADS 128

// Pass 1: grid (n_pad / FA_KT, n_kv), block 256.
template <int D>
__device__ __forceinline__ void kv_to_f16_body(const i8* __restrict__ kp, const float* __restrict__ ks,
                                               const i8* __restrict__ vp, const float* __restrict__ vs,
                                               const int* __restrict__ pt, int seq, int max_pages, int page_size,
                                               int n_kv, int n_keys, int n_pad, u16* __restrict__ kf,
                                               u16* __restrict__ vt) {
    __shared__ u16 sv[FA_KT][D + 2];            // +2: the transposed reads fall on 32 banks
    constexpr int NG = D / 32;
    const int kvh = blockIdx.y, k0 = blockIdx.x * FA_KT;
    for (int i = threadIdx.x; i < FA_KT * D; i += blockDim.x) {
        const int kk = i / D, c = i % D, key = k0 + kk;
        float kv = 0.0f, vv = 0.0f;
        if (key < n_keys) {
            const int page = pt[(size_t)seq * max_pages + key / page_size];
            const size_t row = ((size_t)page * page_size + key % page_size) * n_kv + kvh;
            kv = __fmul_rn((float)kp[row * D + c], ks[row * NG + c / 32]);
            vv = __fmul_rn((float)vp[row * D + c], vs[row * NG + c / 32]);
        }
        kf[((size_t)kvh * n_pad + key) * D + c] = f32_to_f16_rn(kv);
        sv[kk][c] = f32_to_f16_rn(vv);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < FA_KT * D; i += blockDim.x) {
        const int c = i / FA_KT, kk = i % FA_KT;
        vt[((size_t)kvh * D + c) * n_pad + k0 + kk] = sv[kk][c];
    }
}

// Shared memory of pass 2: two stages of a K tile (FA_KT keys x D channels) and a V^T tile (D channels x FA_KT
// keys), rows padded by 8 halves so that a fragment's 4-byte reads of 8 rows fall on 32 banks.
template <int D>
struct FaSmem {
    static constexpr int KS = D + 8, VS = FA_KT + 8;   // row strides in halves
    u16 k[2][FA_KT][KS];
    u16 v[2][D][VS];
    int pos_min, pos_max;
};

template <int D>
__device__ __forceinline__ void fa_stage(FaSmem<D>& sh, int st, const u16* __restrict__ kf,
                                         const u16* __restrict__ vt, int kvh, int n_pad, int kb) {
    constexpr int KC = FA_KT * D / 8, VC = D * FA_KT / 8;   // 16-byte chunks of each tile
    for (int i = threadIdx.x; i < KC; i += FA_THREADS) {
        const int key = i / (D / 8), c = (i % (D / 8)) * 8;
        cp_async<16>(&sh.k[st][key][c], kf + ((size_t)kvh * n_pad + kb + key) * D + c);
    }
    for (int i = threadIdx.x; i < VC; i += FA_THREADS) {
        const int c = i / (FA_KT / 8), kk = (i % (FA_KT / 8)) * 8;
        cp_async<16>(&sh.v[st][c][kk], vt + ((size_t)kvh * D + c) * n_pad + kb + kk);
    }
    cp_async_commit();
}

__device__ __forceinline__ float ex2(float x) {   // 2^x, ex2.approx (2^-inf = 0)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Pass 2: grid (cdiv(n_tok * G, FA_ROWS), n_kv), block FA_THREADS, dynamic shared memory sizeof(FaSmem<D>).
template <int D>
__device__ __forceinline__ void fa_f16_body(const float* __restrict__ q, const int* __restrict__ pos,
                                            const u16* __restrict__ kf, const u16* __restrict__ vt,
                                            float* __restrict__ out, float qscale, int n_tok, int n_heads, int G,
                                            int n_pad) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    FaSmem<D>& sh = *reinterpret_cast<FaSmem<D>*>(fa_smem);
    constexpr int KSTEPS = D / 16, NT = FA_KT / 8, ON = D / 8;
    const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, g = lane / 4, tq = lane % 4;
    const int kvh = blockIdx.y, n_pairs = n_tok * G, p0 = blockIdx.x * FA_ROWS;
    // this thread's two rows: pair p0 + 16 w + g (r = 0) and + 8 (r = 1)
    int tok[2], head[2], rpos[2];
    bool valid[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int p = p0 + 16 * w + g + 8 * r;
        valid[r] = p < n_pairs;
        const int pc = min(p, n_pairs - 1);
        tok[r] = pc / G;
        head[r] = kvh * G + pc % G;
        rpos[r] = pos[tok[r]];
    }
    if (threadIdx.x == 0) {
        sh.pos_min = 0x7fffffff;
        sh.pos_max = 0;
    }
    __syncthreads();
    atomicMin(&sh.pos_min, min(rpos[0], rpos[1]));
    atomicMax(&sh.pos_max, max(rpos[0], rpos[1]));
    // q' fragments (A operand: rows g, g + 8; channels 16 kk + 2 tq, +1, +8, +9)
    u32 qa[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = i & 1, c = 16 * kk + 2 * tq + 8 * (i >> 1);
            const float* src = q + ((size_t)tok[r] * n_heads + head[r]) * D + c;
            qa[kk][i] = pack_f16x2(__fmul_rn(src[0], qscale), __fmul_rn(src[1], qscale));
        }
    __syncthreads();
    const int pmin = sh.pos_min, n_tiles = (sh.pos_max + FA_KT) / FA_KT;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};
    float acc[ON][4];
#pragma unroll
    for (int n = 0; n < ON; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
    fa_stage<D>(sh, 0, kf, vt, kvh, n_pad, 0);
    for (int t = 0; t < n_tiles; ++t) {
        const int st = t & 1, kb = t * FA_KT;
        if (t + 1 < n_tiles) {
            fa_stage<D>(sh, st ^ 1, kf, vt, kvh, n_pad, kb + FA_KT);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
            const u16* krow = &sh.k[st][8 * j + g][2 * tq];
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk)
                mma_f16(s[j], qa[kk], *(const u32*)(krow + 16 * kk), *(const u32*)(krow + 16 * kk + 8));
        }
        if (kb + FA_KT - 1 > pmin)                  // the tile reaches past some row's position: mask
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (kb + 8 * j + 2 * tq + (i & 1) > rpos[i >> 1]) s[j][i] = neg_inf();
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            alpha[r] = ex2(m[r] - mx);
            m[r] = mx;
        }
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[j][i] = ex2(s[j][i] - m[i >> 1]);
                ps[i >> 1] += s[j][i];
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = __fmaf_rn(l[r], alpha[r], ps[r]);
#pragma unroll
        for (int n = 0; n < ON; ++n) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < FA_KT / 16; ++kk) {
            const u32 pa[4] = {pack_f16x2(s[2 * kk][0], s[2 * kk][1]), pack_f16x2(s[2 * kk][2], s[2 * kk][3]),
                               pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < ON; ++n) {
                const u16* vrow = &sh.v[st][8 * n + g][16 * kk + 2 * tq];
                mma_f16(acc[n], pa, *(const u32*)vrow, *(const u32*)(vrow + 8));
            }
        }
        __syncthreads();                            // the stage is refilled two tiles on
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (!valid[r]) continue;
        const float inv = 1.0f / l[r];
        float* dst = out + ((size_t)tok[r] * n_heads + head[r]) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < ON; ++n) {
            dst[8 * n] = acc[n][2 * r] * inv;
            dst[8 * n + 1] = acc[n][2 * r + 1] * inv;
        }
    }
}

#define FA_KERNELS(D)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) kv_to_f16_d##D(                                          \
        const i8* kp, const float* ks, const i8* vp, const float* vs, const int* pt, int seq, int max_pages,   \
        int page_size, int n_kv, int n_keys, int n_pad, u16* kf, u16* vt) {                                    \
        kv_to_f16_body<D>(kp, ks, vp, vs, pt, seq, max_pages, page_size, n_kv, n_keys, n_pad, kf, vt);          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) fa_f16_d##D(                                      \
        const float* q, const int* pos, const u16* kf, const u16* vt, float* out, float qscale, int n_tok,     \
        int n_heads, int G, int n_pad) {                                                                       \
        fa_f16_body<D>(q, pos, kf, vt, out, qscale, n_tok, n_heads, G, n_pad);                                 \
    }
FA_KERNELS(64)
FA_KERNELS(128)

