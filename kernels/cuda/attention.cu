// Causal GQA attention over the paged int8 KV cache (flash-decoding split along the keys).
//
// Cache, per layer (kernels/kv_layout.py): k_pages/v_pages int8 (n_pages, page_size, n_kv, D),
// k_scales/v_scales float32 (n_pages, page_size, n_kv, D / 32). Token t (sequence token_seq[t]) attends
// to positions 0..token_pos[t]; position p lives at page page_tables[seq, p / page_size], slot p % page_size.
//
// Work item (one CTA of 4 warps) = (token, kv head, head tile of HT query heads, split of KPS keys), so each
// dequantized K/V element serves HT query heads. Per split:
//   0  the split's K and V rows and scales are copied into shared memory with cp.async (every row in
//      flight at once: one memory round trip per split instead of one per step), V behind K;
//   A  scores: a row group of LPR lanes reads a K row (CPL int8 channels per lane, 4-16 bytes), each lane
//      dots its channels with its HT query slices for KB keys at once, and the HT*KB = LPR partial sums
//      are reduce-scattered over the row group (LPR-1 shuffles for LPR scores);
//   B  softmax over the split's scores, one warp per head: m = max, p = exp2(s - m) (log2(e) is folded
//      into q), l = sum p; all KPS scores sit in shared memory, so nothing is rescaled inside a split;
//   C  acc[h][c] += p[h][k] * v[k][c] per row group over its keys, then the row groups are summed in order.
// The split's partial (m, l, acc) is either written to the workspace and folded by attn_merge (splits in
// parallel: decode), or folded in the same CTA (`looped`: one CTA walks all its splits; many tokens).
// Both modes fold the splits left to right with attn_fold, and every float operation on the value path is
// an explicitly rounded intrinsic (no contraction choices left to the compiler), so a token's output is the
// same bits in either mode and whatever else shares the launch (batch invariance).
#include "common.cuh"

#define KPS 128              // keys per split (attention.py: keys_per_split)
#define NW 4                 // warps per CTA
#define NT (NW * WARP)

struct alignas(8) u32x2 { u32 a, b; };
struct alignas(16) u32x4 { u32 a, b, c, d; };
struct alignas(16) f32x4 { float x, y, z, w; };

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// The 4 signed bytes of w -> f[0..3] (exact) without the quarter-rate I2F: bias each byte to unsigned,
// place it in the mantissa of 2^23 (byte_perm builds 0x4B0000uu), then subtract 2^23 + 128.
__device__ __forceinline__ void i8x4_to_f32(u32 w, float* f) {
    const u32 x = w ^ 0x80808080u;
#pragma unroll
    for (int b = 0; b < 4; b++) f[b] = __fsub_rn(__int_as_float(__byte_perm(x, 0x4B000000u, 0x7440 + b)), 8388736.f);
}

// cp.async (sm_80+): global -> shared without a register round trip; waited for with cp_async_wait<N>
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_u32(dst)), "l"(src), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Fold of split partials, left to right: (M, L, A) <- (max(M, m), L*ca + l*cb, A*ca + a*cb) with
// ca = 2^(M - max), cb = 2^(m - max). attn_body (looped) and attn_merge both use these two helpers, so their
// bits agree.
__device__ __forceinline__ void fold_weights(float M, float m, float& mn, float& ca, float& cb) {
    mn = fmaxf(M, m);
    ca = exp2f(__fsub_rn(M, mn));
    cb = exp2f(__fsub_rn(m, mn));
}
__device__ __forceinline__ float fold_apply(float X, float ca, float x, float cb) {
    return __fmaf_rn(X, ca, __fmul_rn(x, cb));
}
__device__ __forceinline__ void attn_fold(float& M, float& L, float& A, float m, float l, float a) {
    float mn, ca, cb;
    fold_weights(M, m, mn, ca, cb);
    L = fold_apply(L, ca, l, cb);
    A = fold_apply(A, ca, a, cb);
    M = mn;
}

template <int D, int HT>
struct Cfg {
    // channels per lane (4, 8 or 16-byte reads): as many as HT * CPL <= 32 query registers allow, since
    // fewer lanes per row means fewer shuffles in the score reduction
    static constexpr int CPL0 = HT <= 2 ? 16 : HT == 4 ? 8 : 4;
    static constexpr int CPL = CPL0 > D / 32 ? CPL0 : D / 32;
    static constexpr int NWORD = CPL / 4;                 // u32 words per lane per row
    static constexpr int LPR = D / CPL;                   // lanes per K/V row (row group)
    static constexpr int RPW = WARP / LPR;                // row groups per warp
    static constexpr int NRG = NW * RPW;                  // row groups per CTA
    static constexpr int KB = LPR / HT;                   // keys per row group per phase-A step
    static constexpr int STEP = NRG * KB;                 // keys per CTA per phase-A step
    static constexpr int NG = D / 32;                     // scales per row
    static constexpr int RS = D + 16;                     // shared row stride in bytes (spreads the banks)
    static constexpr bool ONE_BUF = 2 * KPS * RS > 40960; // head_dim 256: K and V take turns in one buffer
    static constexpr int KV_BYTES = (ONE_BUF ? 1 : 2) * KPS * RS;
    static constexpr int SC_CHUNK = NG * 4 < 16 ? NG * 4 : 16;   // cp.async size for a row's scales
    static constexpr int SSTR = KPS + KB;                 // score row stride (spreads the banks)
    static constexpr int EPT = (HT * D + NT - 1) / NT;    // output elements per thread
    static_assert(LPR == 4 || LPR == 8 || LPR == 16 || LPR == 32, "head_dim must be 64, 128 or 256");
    static_assert(KB >= 1 && KPS % STEP == 0, "head tile too large for head_dim");
    static_assert(NRG * HT * D * 4 <= KV_BYTES, "row-group sums must fit in the K/V buffer");
};

// Shared memory of one CTA (static, < 48 KB for every instantiation).
template <int D, int HT>
struct Smem {
    using C = Cfg<D, HT>;
    alignas(16) u8 kv[C::KV_BYTES];          // K rows [KPS][RS], then V rows (or V over K: ONE_BUF); then the
                                             // row groups' acc as float [NRG][HT][D]
    alignas(16) float scl[2][KPS * C::NG];   // K, V scales of the split's keys
    float S[HT * C::SSTR];                   // scores, then p, per head
    int rowoff[KPS];                         // cache row (page * page_size + slot) per key
    float sm[HT], sl[HT];                    // split max (log2 units) and sum per head
};

// This lane's CPL int8 channels of a shared K/V row as u32 words.
template <int CPL>
__device__ __forceinline__ void row_words(const u8* p, u32 (&w)[CPL / 4]) {
    if constexpr (CPL == 4) {
        w[0] = *(const u32*)p;
    } else if constexpr (CPL == 8) {
        const u32x2 x = *(const u32x2*)p;
        w[0] = x.a;
        w[1] = x.b;
    } else {
        const u32x4 x = *(const u32x4*)p;
        w[0] = x.a;
        w[1] = x.b;
        w[2] = x.c;
        w[3] = x.d;
    }
}

// Issue cp.async copies of the nk keys' rows of one kv head (and their scales) into shared memory.
template <int D, int HT>
__device__ __forceinline__ void stage_rows(u8* rows, float* scl, const i8* __restrict__ pages,
                                           const float* __restrict__ scales, const int* rowoff, int nk,
                                           int kvh, int n_kv) {
    using C = Cfg<D, HT>;
    constexpr int CPR = D / 16;                              // 16-byte chunks per row
    for (int i = threadIdx.x; i < nk * CPR; i += NT) {
        const int k = i / CPR, c = i % CPR;
        cp_async<16>(rows + k * C::RS + c * 16, pages + ((i64)rowoff[k] * n_kv + kvh) * D + c * 16);
    }
    constexpr int SPR = C::NG * 4 / C::SC_CHUNK;
    for (int i = threadIdx.x; i < nk * SPR; i += NT) {
        const int k = i / SPR, c = i % SPR;
        cp_async<C::SC_CHUNK>((u8*)scl + k * C::NG * 4 + c * C::SC_CHUNK,
                              (const u8*)(scales + ((i64)rowoff[k] * n_kv + kvh) * C::NG) + c * C::SC_CHUNK);
    }
    cp_async_commit();
}

// Sum val[0 .. 2*HS) over the lanes of a row group (xor partners HS, HS/2, .., 1), scattering the results:
// at each stage a lane keeps the half of its values selected by its lane bit and adds its partner's copy
// of that half, so after log2(2*HS) stages lane l holds the full sum of index l in val[0].
template <int HS>
__device__ __forceinline__ void reduce_scatter(float* val, int l) {
    const bool up = (l & HS) != 0;
#pragma unroll
    for (int i = 0; i < HS; i++) {
        const float send = up ? val[i] : val[i + HS];
        const float keep = up ? val[i + HS] : val[i];
        val[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, HS));
    }
    if constexpr (HS > 1) reduce_scatter<HS / 2>(val, l);
}

// One split's partial for (token t, kv head kvh, heads h0..h0+HT): leaves acc[h][d] (summed over row groups)
// as float [HT][D] at the start of sh.kv, and m, l per head in sh.sm, sh.sl. Ends with a __syncthreads().
template <int D, int HT>
__device__ __forceinline__ void split_partial(
    const float* __restrict__ q, const i32* __restrict__ page_tables,
    const i8* __restrict__ k_pages, const float* __restrict__ k_scales,
    const i8* __restrict__ v_pages, const float* __restrict__ v_scales,
    float qscale, int t, int seq, int kvh, int h0, int hcount, int s, int nk,
    int n_heads, int n_kv, int page_size, int max_pages, Smem<D, HT>& sh) {
    using C = Cfg<D, HT>;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int l = lane % C::LPR;                 // lane within the row group
    const int rg = warp * C::RPW + lane / C::LPR;
    const int c0 = l * C::CPL;                   // this lane's first channel
    u8* krows = sh.kv;
    u8* vrows = C::ONE_BUF ? sh.kv : sh.kv + KPS * C::RS;

    __syncthreads();                             // the previous split's readers are done with shared memory
    for (int i = tid; i < nk; i += NT) {
        const int p = s * KPS + i;
        sh.rowoff[i] = page_tables[(i64)seq * max_pages + p / page_size] * page_size + p % page_size;
    }
    __syncthreads();
    stage_rows<D, HT>(krows, sh.scl[0], k_pages, k_scales, sh.rowoff, nk, kvh, n_kv);
    if constexpr (!C::ONE_BUF) stage_rows<D, HT>(vrows, sh.scl[1], v_pages, v_scales, sh.rowoff, nk, kvh, n_kv);
    float qr[HT][C::CPL];                        // pre-scaled query slices (heads past hcount: 0)
#pragma unroll
    for (int h = 0; h < HT; h++) {
#pragma unroll
        for (int c = 0; c < C::CPL; c += 4) {
            f32x4 x = {0.f, 0.f, 0.f, 0.f};
            if (h < hcount) x = *(const f32x4*)(q + ((i64)t * n_heads + h0 + h) * D + c0 + c);
            qr[h][c] = __fmul_rn(x.x, qscale);
            qr[h][c + 1] = __fmul_rn(x.y, qscale);
            qr[h][c + 2] = __fmul_rn(x.z, qscale);
            qr[h][c + 3] = __fmul_rn(x.w, qscale);
        }
    }
    if constexpr (C::ONE_BUF) cp_async_wait<0>(); else cp_async_wait<1>();   // K is here (V may still fly)
    __syncthreads();

    // ---- A: scores -> S[h * SSTR + key]; rows past nk hold stale bytes whose sums are never stored
    const float* ksc = sh.scl[0] + c0 / 32;
    for (int base = 0; base < nk; base += C::STEP) {
        const int kk0 = base + rg * C::KB;
        float val[C::LPR];                       // val[h * KB + j]: this lane's part of score (key j, head h)
#pragma unroll
        for (int j = 0; j < C::KB; j++) {
            u32 w[C::NWORD];
            row_words<C::CPL>(krows + (kk0 + j) * C::RS + c0, w);
            const float sc = ksc[(kk0 + j) * C::NG];
            float kf[C::CPL];
#pragma unroll
            for (int i = 0; i < C::NWORD; i++) i8x4_to_f32(w[i], kf + 4 * i);
#pragma unroll
            for (int c = 0; c < C::CPL; c++) kf[c] = __fmul_rn(kf[c], sc);
#pragma unroll
            for (int h = 0; h < HT; h++) {
                float a = __fmul_rn(qr[h][0], kf[0]);
#pragma unroll
                for (int c = 1; c < C::CPL; c++) a = __fmaf_rn(qr[h][c], kf[c], a);
                val[h * C::KB + j] = a;
            }
        }
        reduce_scatter<C::LPR / 2>(val, l);      // lane l now holds the full sum of val index l
        if (kk0 + l % C::KB < nk) sh.S[(l / C::KB) * C::SSTR + kk0 + l % C::KB] = val[0];
    }
    __syncthreads();
    if constexpr (C::ONE_BUF) stage_rows<D, HT>(vrows, sh.scl[1], v_pages, v_scales, sh.rowoff, nk, kvh, n_kv);
    // ---- B: softmax statistics per head, p in place of the scores
    for (int h = warp; h < HT; h += NW) {
        float* S = sh.S + h * C::SSTR;
        float m = neg_inf();
        for (int k = lane; k < nk; k += WARP) m = fmaxf(m, S[k]);
        m = warp_max(m);
        float sum = 0.f;
        for (int k = lane; k < nk; k += WARP) {
            const float p = exp2f(__fsub_rn(S[k], m));
            S[k] = p;
            sum = __fadd_rn(sum, p);
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            sh.sm[h] = m;
            sh.sl[h] = sum;
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    // ---- C: acc[h][c] = sum over this row group's keys (k = rg, rg + NRG, ...) of p[h][k] * v[k][c]
    float acc[HT][C::CPL];
#pragma unroll
    for (int h = 0; h < HT; h++)
#pragma unroll
        for (int c = 0; c < C::CPL; c++) acc[h][c] = 0.f;
    const float* vsc = sh.scl[1] + c0 / 32;
#pragma unroll 4
    for (int k = rg; k < nk; k += C::NRG) {
        u32 w[C::NWORD];
        row_words<C::CPL>(vrows + k * C::RS + c0, w);
        const float sc = vsc[k * C::NG];
        float vf[C::CPL];
#pragma unroll
        for (int i = 0; i < C::NWORD; i++) i8x4_to_f32(w[i], vf + 4 * i);
#pragma unroll
        for (int c = 0; c < C::CPL; c++) vf[c] = __fmul_rn(vf[c], sc);
#pragma unroll
        for (int h = 0; h < HT; h++) {
            const float p = sh.S[h * C::SSTR + k];
#pragma unroll
            for (int c = 0; c < C::CPL; c++) acc[h][c] = __fmaf_rn(p, vf[c], acc[h][c]);
        }
    }
    __syncthreads();                             // K/V rows no longer needed: kv becomes red[NRG][HT][D]
    float* red = (float*)sh.kv;
#pragma unroll
    for (int h = 0; h < HT; h++)
#pragma unroll
        for (int c = 0; c < C::CPL; c += 4)
            *(f32x4*)(red + (rg * HT + h) * D + c0 + c) = {acc[h][c], acc[h][c + 1], acc[h][c + 2], acc[h][c + 3]};
    __syncthreads();
#pragma unroll
    for (int u = 0; u < C::EPT; u++) {           // row groups summed in order into red[0 .. HT*D)
        const int e = threadIdx.x + u * NT;
        if (e < HT * D) {
            float a = red[e];
            for (int g = 1; g < C::NRG; g++) a = __fadd_rn(a, red[g * HT * D + e]);
            red[e] = a;                          // only this thread touches element e of every row group
        }
    }
    __syncthreads();
}

// grid (n_tok, n_kv * n_ht, looped ? 1 : n_split_grid), block NT.
// Parallel mode: partials to ws_acc (cap, ws_splits, n_heads, D) and ws_ml (cap, ws_splits, n_heads, 2);
// CTAs past the token's own splits exit (attn_merge reads only the token's own splits).
// Looped mode: the CTA folds its splits itself and writes out (n_tok, n_heads, D).
template <int D, int HT>
__device__ __forceinline__ void attn_body(
    const float* __restrict__ q, const i32* __restrict__ token_seq, const i32* __restrict__ token_pos,
    const i32* __restrict__ page_tables, const i8* __restrict__ k_pages, const float* __restrict__ k_scales,
    const i8* __restrict__ v_pages, const float* __restrict__ v_scales, float* __restrict__ out,
    float* __restrict__ ws_acc, float* __restrict__ ws_ml, float qscale, int n_heads, int n_kv, int G,
    int n_ht, int page_size, int max_pages, int ws_splits, int looped) {
    using C = Cfg<D, HT>;
    __shared__ Smem<D, HT> sh;
    const int t = blockIdx.x;
    const int kvh = blockIdx.y / n_ht, tile = blockIdx.y % n_ht;
    const int h0 = kvh * G + tile * HT;
    const int hcount = min(HT, G - tile * HT);
    const int seq = token_seq[t];
    const int n_keys = token_pos[t] + 1;
    const int n_own = (n_keys + KPS - 1) / KPS;
    const int s0 = looped ? 0 : (int)blockIdx.z;
    const int s1 = looped ? n_own : s0 + 1;
    if (s0 >= n_own) return;                     // whole CTA: past this token's keys
    const float* red = (const float*)sh.kv;

    float M[C::EPT], L[C::EPT], A[C::EPT];
    for (int s = s0; s < s1; s++) {
        split_partial<D, HT>(q, page_tables, k_pages, k_scales, v_pages, v_scales, qscale, t, seq, kvh, h0,
                             hcount, s, min(KPS, n_keys - s * KPS), n_heads, n_kv, page_size, max_pages, sh);
#pragma unroll
        for (int u = 0; u < C::EPT; u++) {
            const int e = threadIdx.x + u * NT;
            if (e >= HT * D || e / D >= hcount) continue;
            const int h = e / D;
            if (!looped) {
                const i64 idx = ((i64)t * ws_splits + s) * n_heads + h0 + h;
                ws_acc[idx * D + e % D] = red[e];
                if (e % D == 0) {
                    ws_ml[2 * idx] = sh.sm[h];
                    ws_ml[2 * idx + 1] = sh.sl[h];
                }
            } else if (s == 0) {
                M[u] = sh.sm[h];
                L[u] = sh.sl[h];
                A[u] = red[e];
            } else {
                attn_fold(M[u], L[u], A[u], sh.sm[h], sh.sl[h], red[e]);
            }
        }
    }
    if (looped) {
#pragma unroll
        for (int u = 0; u < C::EPT; u++) {
            const int e = threadIdx.x + u * NT;
            if (e < HT * D && e / D < hcount)
                out[((i64)t * n_heads + h0 + e / D) * D + e % D] = __fdiv_rn(A[u], L[u]);
        }
    }
}

// 5 CTAs per SM where registers and shared memory allow (HT 8 and head_dim 256 would spill or not fit)
#define ATTN_KERNEL(D, HT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(NT, HT == 8 || D == 256 ? 4 : 5) attn_d##D##_h##HT(       \
        const float* __restrict__ q, const i32* __restrict__ token_seq, const i32* __restrict__ token_pos, \
        const i32* __restrict__ page_tables, const i8* __restrict__ k_pages,                               \
        const float* __restrict__ k_scales, const i8* __restrict__ v_pages,                                \
        const float* __restrict__ v_scales, float* __restrict__ out, float* __restrict__ ws_acc,           \
        float* __restrict__ ws_ml, float qscale, int n_heads, int n_kv, int G, int n_ht, int page_size,    \
        int max_pages, int ws_splits, int looped) {                                                        \
        grid_dependency_sync();                                                                           \
        attn_body<D, HT>(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, out,  \
                         ws_acc, ws_ml, qscale, n_heads, n_kv, G, n_ht, page_size, max_pages, ws_splits,   \
                         looped);                                                                          \
    }

ATTN_KERNEL(64, 1)
ATTN_KERNEL(64, 2)
ATTN_KERNEL(64, 4)
ATTN_KERNEL(64, 8)
ATTN_KERNEL(128, 1)
ATTN_KERNEL(128, 2)
ATTN_KERNEL(128, 4)
ATTN_KERNEL(128, 8)
ATTN_KERNEL(256, 1)
ATTN_KERNEL(256, 2)
ATTN_KERNEL(256, 4)

// Fold a token's own splits left to right: grid (n_tok, n_heads, D / 32), block NT; out (n_tok, n_heads, D).
// The fold is sequential in the splits, so its inputs are brought in bulk first (cp.async, MCH splits of 32
// channels at a time), the running maxima (a warp scan) and the weights ca, cb are computed in parallel once
// per split for the head, and warp 0 (lane = channel) applies them from shared memory.
#define MCH 256
extern "C" __global__ void __launch_bounds__(NT) attn_merge(const float* __restrict__ ws_acc,
                                                           const float* __restrict__ ws_ml,
                                                           const i32* __restrict__ token_pos,
                                                           float* __restrict__ out, int n_heads, int D,
                                                           int ws_splits) {
    grid_dependency_sync();
    __shared__ alignas(16) float a[MCH][WARP];
    __shared__ alignas(16) float ml[MCH][2];
    __shared__ float mprev[MCH], wa[MCH], wb[MCH];
    const int t = blockIdx.x, h = blockIdx.y, d0 = blockIdx.z * WARP, tid = threadIdx.x;
    const int n_own = (token_pos[t] + KPS) / KPS;   // ceil((pos + 1) / KPS)
    const i64 row0 = (i64)t * ws_splits * n_heads + h; // split s of (t, h) is row row0 + s * n_heads
    float carry = neg_inf(), L = 0.f, A = 0.f;      // warp 0: max of the splits before this chunk; sum, acc
    for (int c0 = 0; c0 < n_own; c0 += MCH) {
        const int n = min(MCH, n_own - c0);
        __syncthreads();                             // the previous chunk is consumed
        for (int i = tid; i < n * (WARP / 4); i += NT) {
            const int s = i / (WARP / 4), c = i % (WARP / 4);
            cp_async<16>(&a[s][4 * c], ws_acc + (row0 + (i64)(c0 + s) * n_heads) * D + d0 + 4 * c);
        }
        for (int i = tid; i < n; i += NT) cp_async<8>(&ml[i][0], ws_ml + 2 * (row0 + (i64)(c0 + i) * n_heads));
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (tid < WARP) {                            // mprev[i] = max of all earlier splits' m (max is exact:
            constexpr int PER = MCH / WARP;          // any order gives the serial fold's running max)
            float loc[PER], mx = neg_inf();
#pragma unroll
            for (int j = 0; j < PER; j++) {
                const int i = tid * PER + j;
                loc[j] = i < n ? ml[i][0] : neg_inf();
                mx = fmaxf(mx, loc[j]);
            }
            float inc = mx;                          // inclusive scan of the lanes' maxima
#pragma unroll
            for (int o = 1; o < WARP; o <<= 1) {
                const float v = __shfl_up_sync(0xffffffffu, inc, o);
                if (tid >= o) inc = fmaxf(inc, v);
            }
            const float before = __shfl_up_sync(0xffffffffu, inc, 1);
            float ex = tid == 0 ? carry : fmaxf(carry, before);
#pragma unroll
            for (int j = 0; j < PER; j++) {
                if (tid * PER + j < n) mprev[tid * PER + j] = ex;
                ex = fmaxf(ex, loc[j]);
            }
            carry = fmaxf(carry, __shfl_sync(0xffffffffu, inc, WARP - 1));
        }
        __syncthreads();
        for (int i = tid; i < n; i += NT) {          // (split 0 gets unused weights: it starts the fold)
            float mn, ca, cb;
            fold_weights(mprev[i], ml[i][0], mn, ca, cb);
            wa[i] = ca;
            wb[i] = cb;
        }
        __syncthreads();
        if (tid < WARP) {
            int i0 = 0;
            if (c0 == 0) {
                L = ml[0][1];
                A = a[0][tid];
                i0 = 1;
            }
#pragma unroll 8
            for (int i = i0; i < n; i++) {
                L = fold_apply(L, wa[i], ml[i][1], wb[i]);
                A = fold_apply(A, wa[i], a[i][tid], wb[i]);
            }
        }
    }
    if (tid < WARP) out[((i64)t * n_heads + h) * D + d0 + tid] = __fdiv_rn(A, L);
}
