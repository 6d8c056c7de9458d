// Causal GQA attention over the paged int8 KV cache (flash-decoding split along the keys).
//
// Cache, per layer (kernels/kv_layout.py): k_pages/v_pages int8 (n_pages, page_size, n_kv, D),
// k_scales/v_scales float32 (n_pages, page_size, n_kv, D / 32). Token t (sequence token_seq[t]) attends
// to positions 0..token_pos[t]; position p lives at page page_tables[seq, p / page_size], slot p % page_size.
//
// Work item (one CTA of 4 warps) = (token, kv head, head tile of HT query heads, split of KPS keys), so each
// K/V row read serves HT query heads. Per split (phase_scores, phase_softmax, phase_values):
//   0  the split's K and V rows and scales are copied into shared memory with cp.async (every row in
//      flight at once: one memory round trip per split instead of one per step), V behind K;
//   A  scores q.k on the tensor cores (int8 K exact in f16, q split into two f16 halves);
//   B  softmax over the split's scores, one warp per head: m = max, p = exp2(s - m) (log2(e) is folded
//      into q), l = sum p; all KPS scores sit in shared memory, so nothing is rescaled inside a split;
//   C  acc[h][c] = sum of p[h][k] * v[k][c] on the tensor cores (int8 V exact, p times the V scale rounded
//      to one f16: each output within 2^-11 of sum p |v| / l of the float result, tests/kernels/reference.py
//      f16_rounding_bound; a weight's hi + lo halves cost twice the mma for error far below the int8 cache's).
// Splits are folded in groups of consecutive splits (group_splits: by the token's own key count). A
// group's partial (m, l, acc) is either written to the workspace and folded by attn_merge (groups in
// parallel: decode), or folded in the same CTA (`_looped` kernels: one CTA walks all its groups; many
// tokens). Both modes fold with attn_fold in the same order (splits left to right within a group, groups
// left to right), and every float operation on the value path is an explicitly rounded intrinsic (no
// contraction choices left to the compiler), so a token's output is the same bits in either mode and
// whatever else shares the launch (batch invariance).
#include "common.cuh"
#include "tensor_f16.cuh"

#define KPS 128              // keys per split (attention.py: keys_per_split)
#define NW 4                 // warps per CTA
#define NT (NW * WARP)

struct alignas(8) u32x2 { u32 a, b; };
struct alignas(16) f32x4 { float x, y, z, w; };


// 2^e as a float (e in [-126, 127]) and the binary exponent of m >= 0 (floor(log2 m); zero and subnormals
// count as -127) clamped to [-100, 100], so 2^(13 - e) and 2^(e - 13) are normal floats.
__device__ __forceinline__ float pow2i(int e) { return __int_as_float((e + 127) << 23); }
__device__ __forceinline__ int exponent_of(float m) {
    return min(100, max(-100, ((__float_as_int(m) >> 23) & 0xff) - 127));
}

// A/B switch (attention.py BUILDS `q16`): q' (phase A's B operand) as hi + lo f16 halves (1) or as hi alone (0: the
// lo accumulators stay zero, join_f16_sums(hi, 0) is hi, and the compiler drops the lo halves' arithmetic), each
// output then within what tests/kernels/reference.py f16_rounding_bound allows for q' in one f16.
#ifndef ATTN_Q_LO
#define ATTN_Q_LO 1
#endif


// Two int8 values of the biased word x (x = w ^ 0x80808080: byte = v + 128) -> half2 (exact): sel 0x4140
// takes bytes 0, 1 and 0x4342 bytes 2, 3; byte_perm puts each under 0x64, the half 1024 + byte, and
// subtracting 1152 (0x6480) leaves v.
__device__ __forceinline__ u32 i8pair_to_h2(u32 x, u32 sel) {
    const u32 h = __byte_perm(x, 0x64646464u, sel);
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x64806480u));
    return r;
}

// x = hi + lo * 2^-11 with hi = f16(x), lo = f16((x - hi) * 2^11) (x - hi is exact in float): the pair
// carries ~22 of float's 24 bits; each half goes through its own mma accumulator.
__device__ __forceinline__ void split_f16(float x, u32& hi, u32& lo) {
    const u16 h = f32_to_f16_rn(x);
    hi = h;
    lo = f32_to_f16_rn(__fmul_rn(__fsub_rn(x, f16_to_f32(h)), 2048.f));
}
__device__ __forceinline__ float join_f16_sums(float hi, float lo) { return __fmaf_rn(lo, 1.f / 2048.f, hi); }
// split_f16 of two floats, packed: hi = hi(a) | hi(b) << 16, lo likewise.
__device__ __forceinline__ void split_f16x2(float a, float b, u32& hi, u32& lo) {
    u32 ah, al, bh, bl;
    split_f16(a, ah, al);
    split_f16(b, bh, bl);
    hi = ah | bh << 16;
    lo = al | bl << 16;
}

// q' fragments of 8 consecutive channels xs of one head (phase_scores' B operand: bh[i] = channels (2i, 2i + 1)):
// each x * qscale * f split into hi and lo f16 halves.
__device__ __forceinline__ void q_pairs(const float (&xs)[8], float qscale, float f, u32 (&bh)[4], u32 (&bl)[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
        split_f16x2(__fmul_rn(__fmul_rn(xs[2 * i], qscale), f), __fmul_rn(__fmul_rn(xs[2 * i + 1], qscale), f),
                    bh[i], bl[i]);
}

// Phase A's A operand of k-step st of one 16-key tile and 32-channel group, from this lane's 8-byte reads wa, wb
// of rows pk and pk + 8 (int8 exact in f16; phase_scores explains the row and channel order).
__device__ __forceinline__ void k_fragment(const u32x2& wa, const u32x2& wb, int st, u32 (&a)[4]) {
    const u32 xa = (st ? wa.b : wa.a) ^ 0x80808080u, xb = (st ? wb.b : wb.a) ^ 0x80808080u;
    a[0] = i8pair_to_h2(xa, 0x4140);
    a[1] = i8pair_to_h2(xb, 0x4140);
    a[2] = i8pair_to_h2(xa, 0x4342);
    a[3] = i8pair_to_h2(xb, 0x4342);
}

// Phase C's A operand of tile m of a key step from the biased V words x of keys (k0, k1, k2, k3)
// (phase_values explains the order): bytes 2m, 2m + 1 of each key, as f16 pairs.
__device__ __forceinline__ void v_fragment(const u32 (&x)[4], int m, u32 (&a)[4]) {
    const u32 t01 = __byte_perm(x[0], x[1], m ? 0x7362 : 0x5140);   // bytes 2m, 2m + 1 of keys
    const u32 t23 = __byte_perm(x[2], x[3], m ? 0x7362 : 0x5140);   // (k0, k1) and (k2, k3)
    a[0] = i8pair_to_h2(t01, 0x4140);
    a[1] = i8pair_to_h2(t01, 0x4342);
    a[2] = i8pair_to_h2(t23, 0x4140);
    a[3] = i8pair_to_h2(t23, 0x4342);
}



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
    static constexpr int NG = D / 32;                     // 32-channel scale groups per row
    // shared row stride in bytes: 16-byte aligned for cp.async and 4 words mod 32 banks, which the fragment
    // loads below rely on (rows 2i hit banks 8i apart)
    static constexpr int RS = D + 16;
    static constexpr bool ONE_BUF = 2 * KPS * RS > 40960; // head_dim 256: K and V take turns in one buffer
    static constexpr int KV_BYTES = (ONE_BUF ? 1 : 2) * KPS * RS;
    static constexpr int SC_CHUNK = NG * 4 < 16 ? NG * 4 : 16;   // cp.async size for a row's scales
    static constexpr int SSTR = KPS + 8;                  // score row stride
    static constexpr int MTW = KPS / 16 / NW;             // phase A: 16-key tiles per warp
    static constexpr int GPW = NG > NW ? NG / NW : 1;     // phase C: channel groups per warp
    static constexpr int KSPLIT = NW > NG ? NW / NG : 1;  // phase C: warps sharing a group (its key steps split)
    static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
    static_assert(HT <= 8, "a head tile is at most the 8 columns of an m16n8 tile");
    static_assert((KSPLIT - 1) * HT * D <= HT * SSTR, "the second key-step set's sums must fit in the scores");
};

// Shared memory of one CTA (static, < 48 KB for every instantiation).
template <int D, int HT>
struct Smem {
    using C = Cfg<D, HT>;
    alignas(16) u8 kv[C::KV_BYTES];          // K rows [KPS][RS], then V rows (or V over K: ONE_BUF)
    alignas(16) float scl[2][KPS * C::NG];   // K, V scales of the split's keys
    float S[HT * C::SSTR];                   // scores, then p, per head; then (head_dim 64) part 1's sums
    int rowoff[KPS];                         // cache row (page * page_size + slot) per key
    float sm[HT], sl[HT];                    // split max (log2 units) and sum per head
    float qf[HT], qinv[HT];                  // per head: 2^(13 - e), 2^(e - 13), e = exponent of max |q * qscale|
};

// Issue cp.async copies of the nk keys' rows of one kv head (and their scales) into shared memory. Each
// thread copies the same 16-byte chunk of every row it stages; a row's source is one 32 x 32 -> 64-bit
// multiply-add (cache row index x row bytes + the thread's base), a full split's copies are unrolled.
template <int D, int HT>
__device__ __forceinline__ void stage_rows(u8* rows, float* scl, const i8* __restrict__ pages,
                                           const float* __restrict__ scales, const int* rowoff, int nk,
                                           int kvh, int n_kv) {
    using C = Cfg<D, HT>;
    constexpr int CPR = D / 16;                              // 16-byte chunks per row
    constexpr int STEP = NT / CPR;                           // rows per pass of the CTA
    const int c = threadIdx.x % CPR, k0 = threadIdx.x / CPR;
    const u32 row_bytes = (u32)(n_kv * D);
    const u8* src = (const u8*)pages + kvh * D + c * 16;
    const u32 dst = smem_u32(rows) + k0 * C::RS + c * 16;
    if (nk == KPS) {
#pragma unroll
        for (int i = 0; i < KPS / STEP; i++)
            cp_async_s<16>(dst + i * STEP * C::RS, src + (u64)(u32)rowoff[k0 + i * STEP] * row_bytes);
    } else {
        for (int i = 0; k0 + i * STEP < nk; i++)
            cp_async_s<16>(dst + i * STEP * C::RS, src + (u64)(u32)rowoff[k0 + i * STEP] * row_bytes);
    }
    constexpr int SPR = C::NG * 4 / C::SC_CHUNK;             // scale chunks per row (1 or 2)
    const u32 scale_row_bytes = (u32)(n_kv * C::NG * 4);
    const u8* ssrc = (const u8*)scales + kvh * C::NG * 4;
    const u32 sdst = smem_u32(scl);
    for (int i = threadIdx.x; i < nk * SPR; i += NT) {
        const int k = i / SPR, cc = i % SPR;
        cp_async_s<C::SC_CHUNK>(sdst + k * C::NG * 4 + cc * C::SC_CHUNK,
                                ssrc + cc * C::SC_CHUNK + (u64)(u32)rowoff[k] * scale_row_bytes);
    }
    cp_async_commit();
}

// What one CTA works on: token t (sequence seq, n_keys keys), kv head kvh, query heads h0 .. h0 + hcount.
struct Work {
    const float* q;              // (n_tok, n_heads, D)
    int t, seq, n_keys, kvh, h0, hcount, n_heads, n_kv;
    float qscale;
};

// Phase A of split s (nk keys; K rows and scales in shared memory): the scores S[h][k], in log2 units.
//   S[h][k] = sum over groups G of ks[k][G] * (q'_h . k_k over G's 32 channels) * 2^(e_h - 13),
// q'_h = q_h * qscale * 2^(13 - e_h) (a power of two: exact) with its largest element in [2^13, 2^14): far
// from f16's overflow and subnormals whatever q's magnitude. A = 16 keys x 16 channels of K, B = 16
// channels x 8 heads of q' (hi and lo halves); warp w takes keys 16 MTW w .. , one accumulator pair per group.
// Tile row r holds key pk (r = g) or pk + 8 (r = g + 8), pk = 2g for g < 4 and 2g - 7 above: a half-warp's
// 8-byte row reads then fall on banks 8 words apart. Index k of a k-step of group G is channel
// 32G + 8tq + 4st + (0, 1, 2, 3) for k = (2tq, 2tq + 1, 2tq + 8, 2tq + 9), step st = 0, 1: one 8-byte read
// per row and group. Rows past nk (stale bytes and scales) are never stored.
// This lane's B fragments of q' for group grp (head g = lane / 4, channels 32 grp + 8tq ..): bh[2st] =
// channels (0, 1), bh[2st + 1] = (2, 3) of k-step st; bl the lo halves.
template <int D, int HT>
__device__ __forceinline__ void q_fragments(const Work& w, int grp, const Smem<D, HT>& sh, u32 (&bh)[4],
                                            u32 (&bl)[4]) {
    const int g = threadIdx.x % WARP / 4, tq = threadIdx.x % 4;
    f32x4 x0 = {0.f, 0.f, 0.f, 0.f}, x1 = x0;
    float f = 0.f;
    if (g < w.hcount) {
        const float* qg = w.q + ((i64)w.t * w.n_heads + w.h0 + g) * D + grp * 32 + 8 * tq;
        x0 = *(const f32x4*)qg;
        x1 = *(const f32x4*)(qg + 4);
        f = sh.qf[g];
    }
    const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    q_pairs(xs, w.qscale, f, bh, bl);
}

// q' fragments of every group, built once per CTA where they fit in registers (head_dim <= 128; 256 builds
// each group's in every split instead).
template <int D, int HT>
struct QFrags {
    static constexpr bool KEEP = D <= 128;
    u32 h[KEEP ? D / 32 : 1][4], l[KEEP ? D / 32 : 1][4];
    __device__ __forceinline__ void build(const Work& w, const Smem<D, HT>& sh) {
        if constexpr (KEEP) {
#pragma unroll
            for (int grp = 0; grp < D / 32; grp++) q_fragments<D, HT>(w, grp, sh, h[grp], l[grp]);
        }
    }
};

template <int D, int HT>
__device__ __forceinline__ void phase_scores(const Work& w, const QFrags<D, HT>& qf, const u8* krows, int nk,
                                             Smem<D, HT>& sh) {
    using C = Cfg<D, HT>;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, tq = lane % 4;
    const int pk = g < 4 ? 2 * g : 2 * g - 7;
    const float* ksc = sh.scl[0];
    float sacc[C::MTW][4];
#pragma unroll
    for (int grp = 0; grp < C::NG; grp++) {
        u32 bh[4], bl[4];
        if constexpr (QFrags<D, HT>::KEEP) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                bh[i] = qf.h[grp][i];
                bl[i] = qf.l[grp][i];
            }
        } else {
            q_fragments<D, HT>(w, grp, sh, bh, bl);
        }
#pragma unroll
        for (int j = 0; j < C::MTW; j++) {
            const int kb = (warp * C::MTW + j) * 16;
            if (kb >= nk) break;                 // warp-uniform: tiles past the split's keys
            const u32x2 wa = *(const u32x2*)(krows + (kb + pk) * C::RS + grp * 32 + 8 * tq);
            const u32x2 wb = *(const u32x2*)(krows + (kb + pk + 8) * C::RS + grp * 32 + 8 * tq);
            float ch[4] = {0.f, 0.f, 0.f, 0.f}, cl[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int st = 0; st < 2; st++) {
                u32 a[4];
                k_fragment(wa, wb, st, a);
                mma_f16(ch, a, bh[2 * st], bh[2 * st + 1]);
                if (ATTN_Q_LO) mma_f16(cl, a, bl[2 * st], bl[2 * st + 1]);
            }
            const float ka = ksc[(kb + pk) * C::NG + grp], kz = ksc[(kb + pk + 8) * C::NG + grp];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float d = join_f16_sums(ch[i], cl[i]), ks = i < 2 ? ka : kz;
                sacc[j][i] = grp == 0 ? __fmul_rn(ks, d) : __fmaf_rn(ks, d, sacc[j][i]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < C::MTW; j++) {
        const int kb = (warp * C::MTW + j) * 16;
        if (kb >= nk) break;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int h = 2 * tq + (i & 1), k = kb + pk + (i >> 1) * 8;
            if (h < w.hcount && k < nk) sh.S[h * C::SSTR + k] = __fmul_rn(sacc[j][i], sh.qinv[h]);
        }
    }
}

// Softmax statistics of one column (a head, or a token's head) over its nk keys' scores Sc, one warp: m = max,
// p = exp2(s - m) in place, sum of p (lane sums over keys lane, lane + 32, ..., then warp_sum). WHOLE (the tiled
// kernels): a whole split's KPS keys in registers, without the strided loops' remainder code (the same
// operations in the same order).
template <bool WHOLE = false>
__device__ __forceinline__ void column_softmax(float* Sc, int nk, float& m, float& sum) {
    const int lane = threadIdx.x % WARP;
    m = neg_inf();
    sum = 0.f;
    if (WHOLE && nk == KPS) {
        float v[KPS / WARP];
#pragma unroll
        for (int i = 0; i < KPS / WARP; i++) {
            v[i] = Sc[lane + i * WARP];
            m = fmaxf(m, v[i]);
        }
        m = warp_max(m);
#pragma unroll
        for (int i = 0; i < KPS / WARP; i++) {
            const float p = exp2f(__fsub_rn(v[i], m));
            Sc[lane + i * WARP] = p;
            sum = __fadd_rn(sum, p);
        }
    } else {
        for (int k = lane; k < nk; k += WARP) m = fmaxf(m, Sc[k]);
        m = warp_max(m);
        for (int k = lane; k < nk; k += WARP) {
            const float p = exp2f(__fsub_rn(Sc[k], m));
            Sc[k] = p;
            sum = __fadd_rn(sum, p);
        }
    }
    sum = warp_sum(sum);
}

// Phase B: softmax statistics per head (one warp per head), p = exp2(s - m) in place of the scores;
// log2(e) is folded into qscale, and all KPS scores sit in shared memory, so nothing is rescaled in a split.
template <int D, int HT>
__device__ __forceinline__ void phase_softmax(const Work& w, int nk, Smem<D, HT>& sh) {
    using C = Cfg<D, HT>;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    for (int h = warp; h < w.hcount; h += NW) {
        float m, sum;
        column_softmax(sh.S + h * C::SSTR, nk, m, sum);
        if (lane == 0) {
            sh.sm[h] = m;
            sh.sl[h] = sum;
        }
    }
}

// Phase C: acc = sum over the split's keys of p[h][k] * vs[k][G] * v[k][c] = 2^(e_G - 13) * (V^T P'), with
// A = 16 channels x 16 keys of V (exact) and B = 16 keys x 8 heads of P' = p * vs * 2^(13 - e_G) (one
// f16, nearest; e_G the exponent of the split's largest scale of group G, so P' < 2^14). Warp w takes group w
// (head_dim 64: two warps per group take alternate key steps, `part`; 256: groups w and w + 4). Tile m of
// group G: row g is channel 32G + 4g + 2m, row g + 8 the next one; index k of a key step is key 2tq, 2tq + 8,
// 2tq + 1, 2tq + 9 for k = 2tq, 2tq + 1, 2tq + 8, 2tq + 9: one 4-byte read per key (channels 4g .. 4g + 3)
// feeds both tiles, and rows 2tq fall on banks 8 words apart. acc[gi][m][i] is (head 2tq + (i & 1),
// channel chan(gi, m, i)) of this warp's part.
template <int D, int HT>
__device__ __forceinline__ int value_group(int gi) {
    return threadIdx.x / WARP % (Cfg<D, HT>::NG < NW ? Cfg<D, HT>::NG : NW) + gi * NW;
}
template <int D, int HT>
__device__ __forceinline__ int value_channel(int gi, int m, int i) {
    return value_group<D, HT>(gi) * 32 + 4 * (threadIdx.x % WARP / 4) + 2 * m + (i >> 1);
}
// f(gi, m, i, h, c) for each of this thread's phase-C sums: acc[gi][m][i] is (head h, channel c).
template <int D, int HT, class F>
__device__ __forceinline__ void for_each_value(F f) {
#pragma unroll
    for (int gi = 0; gi < Cfg<D, HT>::GPW; gi++)
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int i = 0; i < 4; i++) f(gi, m, i, 2 * (threadIdx.x % 4) + (i & 1), value_channel<D, HT>(gi, m, i));
}
// f(gi, m, i, c) for those of head 2 tq + e only (i & 1 == e)
template <int D, int HT, class F>
__device__ __forceinline__ void for_each_value_of_head(int e, F f) {
#pragma unroll
    for (int gi = 0; gi < Cfg<D, HT>::GPW; gi++)
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int i = e; i < 4; i += 2) f(gi, m, i, value_channel<D, HT>(gi, m, i));
}
template <int D, int HT>
__device__ __forceinline__ void phase_values(const Work& w, const u8* vrows, int nk, Smem<D, HT>& sh,
                                             float (&acc)[Cfg<D, HT>::GPW][2][4]) {
    using C = Cfg<D, HT>;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, tq = lane % 4;
    const float* vsc = sh.scl[1];
    const int part = warp / C::NG;
#pragma unroll
    for (int gi = 0; gi < C::GPW; gi++) {
        const int grp = value_group<D, HT>(gi);
        float mv = 0.f;                          // the split's largest V scale of the group -> e_G
        for (int k = lane; k < nk; k += WARP) mv = fmaxf(mv, vsc[k * C::NG + grp]);
        const int ev = exponent_of(warp_max(mv));
        const float fv = pow2i(13 - ev);
        float c[2][4] = {};
        // HT <= 4: this lane's P' pair is head lane / 8, keys kb + lane % 8 (+ 8)
        const bool head_ok = lane / 8 < w.hcount;
        const float* pS = sh.S + min(lane / 8, HT - 1) * C::SSTR + lane % 8;
        const float* pvs = vsc + lane % 8 * C::NG + grp;
        const int src = g % 4 * 8 + 2 * tq;
        for (int kb = part * 16; kb < nk; kb += 16 * C::KSPLIT) {
            const int kk[4] = {kb + 2 * tq, kb + 2 * tq + 8, kb + 2 * tq + 1, kb + 2 * tq + 9};
            u32 x[4], b0, b1;
#pragma unroll
            for (int j = 0; j < 4; j++) x[j] = *(const u32*)(vrows + kk[j] * C::RS + grp * 32 + 4 * g) ^ 0x80808080u;
            if constexpr (HT <= 4) {
                // 16 keys x at most 4 heads: lane L makes the pair of head L / 8, keys L % 8 and L % 8 + 8,
                // and lane (g, tq) takes its fragments from lanes 8g + 2tq and 8g + 2tq + 1 (columns g >= HT
                // get another head's values: they are never stored). Loads in bounds whatever the key and
                // head, the zeros by selection: no branches in the loop.
                float pv[2];
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int k = kb + 8 * j;
                    const float p = __fmul_rn(__fmul_rn(pS[k], pvs[k * C::NG]), fv);
                    pv[j] = head_ok && k + lane % 8 < nk ? p : 0.f;
                }
                const u32 w2 = pack_f16x2(pv[0], pv[1]);
                b0 = __shfl_sync(0xffffffffu, w2, src);
                b1 = __shfl_sync(0xffffffffu, w2, src + 1);
            } else {
                float pv[4];
#pragma unroll
                for (int j = 0; j < 4; j++) {    // P' of head g (0 past the keys and for heads past hcount)
                    const float p = __fmul_rn(__fmul_rn(sh.S[g * C::SSTR + kk[j]], vsc[kk[j] * C::NG + grp]), fv);
                    pv[j] = g < w.hcount && kk[j] < nk ? p : 0.f;
                }
                b0 = pack_f16x2(pv[0], pv[1]);
                b1 = pack_f16x2(pv[2], pv[3]);
            }
#pragma unroll
            for (int m = 0; m < 2; m++) {
                u32 a[4];
                v_fragment(x, m, a);
                mma_f16(c[m], a, b0, b1);
            }
        }
        const float fvinv = pow2i(ev - 13);
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[gi][m][i] = __fmul_rn(c[m][i], fvinv);
    }
}

// Splits folded together in the CTA before anything leaves it: a token with n_own splits of keys folds
// them in groups of group_splits consecutive splits (left to right within a group, then the groups left to
// right). The group size is a function of the token's own split count and of the model's shape (width =
// kv heads x head tiles: the CTAs a split of one token needs) only, so both modes and every launch share
// the order: the largest of 1, 2, 4, 8 that leaves a single token at least GROUP_CTAS work items (groups x
// width), so a decode keeps ~4 CTAs per SM busy while long contexts leave one partial per group, not per
// split, to the workspace and the merge.
#define GROUP_CTAS 512       // attention.py: GROUP_CTAS
__device__ __forceinline__ int group_splits(int n_own, int width) {
    const int r = n_own * width / GROUP_CTAS;                          // attention.py: group_splits
    return r >= 8 ? 8 : r >= 4 ? 4 : r >= 2 ? 2 : 1;
}

// grid (n_tok, n_kv * n_ht, LOOPED ? 1 : Z), block NT. The CTA takes the groups g = z, z + Z, ... of its
// token (z = blockIdx.z; LOOPED: z = 0, Z = 1) and their splits in order, so the copies of the next split
// fly while one is computed: K(next) is issued when phase A of s is done with the K buffer, V(next) when
// phase C is done with the V buffer (head_dim 256, one buffer: V(s) after A, K(next) after C). cp.async
// groups complete in issue order, hence the wait counts.
// Split-parallel (!LOOPED): each group's partial to ws_acc (cap, ws_splits, n_heads, D) and ws_ml (cap,
// ws_splits, n_heads, 2) at the group's index, folded by attn_merge. LOOPED: the CTA also folds its groups
// in order and writes out (n_tok, n_heads, D). A group's partial is the same bits whichever CTA computes it.
template <int D, int HT, bool LOOPED>
__device__ __forceinline__ void attn_body(
    const float* __restrict__ q, const i32* __restrict__ token_seq, const i32* __restrict__ token_pos,
    const i32* __restrict__ page_tables, const i8* __restrict__ k_pages, const float* __restrict__ k_scales,
    const i8* __restrict__ v_pages, const float* __restrict__ v_scales, float* __restrict__ out,
    float* __restrict__ ws_acc, float* __restrict__ ws_ml, float qscale, int n_heads, int n_kv, int G,
    int n_ht, int page_size, int max_pages, int ws_splits) {
    using C = Cfg<D, HT>;
    static_assert(KPS == NT, "one key of a split per thread");
    constexpr int HPW = (HT + NW - 1) / NW;      // heads per warp in the q normalization
    __shared__ Smem<D, HT> sh;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    Work w;
    w.q = q;
    w.t = blockIdx.x;
    w.kvh = blockIdx.y / n_ht;
    const int tile = blockIdx.y % n_ht;
    w.h0 = w.kvh * G + tile * HT;
    w.hcount = min(HT, G - tile * HT);
    w.n_heads = n_heads;
    w.n_kv = n_kv;
    w.qscale = qscale;
    // q of the heads this warp normalizes, loaded first: behind the K/V copies these loads would wait
    // for the copies' traffic
    float qv[HPW][D / WARP];
#pragma unroll
    for (int j = 0; j < HPW; j++) {
        const int h = warp + j * NW;
#pragma unroll
        for (int i = 0; i < D / WARP; i++)
            qv[j][i] = h < w.hcount ? q[((i64)w.t * n_heads + w.h0 + h) * D + lane + i * WARP] : 0.f;
    }
    w.seq = token_seq[w.t];
    w.n_keys = token_pos[w.t] + 1;
    const int n_own = (w.n_keys + KPS - 1) / KPS;
    const int P = group_splits(n_own, n_kv * n_ht), n_grp = (n_own + P - 1) / P;
    const int z = LOOPED ? 0 : (int)blockIdx.z, Z = LOOPED ? 1 : (int)gridDim.z;
    if (z >= n_grp) return;                      // whole CTA: past this token's keys
    u8* krows = sh.kv;
    u8* vrows = C::ONE_BUF ? sh.kv : sh.kv + KPS * C::RS;
    auto page_row = [&](int s) {                 // cache row of this thread's key of split s
        const int p = s * KPS + tid;
        return p < w.n_keys ? page_tables[(i64)w.seq * max_pages + p / page_size] * page_size + p % page_size : 0;
    };
    auto keys_of = [&](int s) { return min(KPS, w.n_keys - s * KPS); };
    auto group_end = [&](int s) { return min((s / P + 1) * P, n_own); };   // one past the last split of s's group
    auto next_split = [&](int s) {               // the split after s in this CTA's walk; n_own: none
        if (s + 1 < group_end(s)) return s + 1;
        const int gn = s / P + Z;
        return gn < n_grp ? gn * P : n_own;
    };

    sh.rowoff[tid] = page_row(z * P);
    __syncthreads();
    stage_rows<D, HT>(krows, sh.scl[0], k_pages, k_scales, sh.rowoff, keys_of(z * P), w.kvh, n_kv);
    if constexpr (!C::ONE_BUF)
        stage_rows<D, HT>(vrows, sh.scl[1], v_pages, v_scales, sh.rowoff, keys_of(z * P), w.kvh, n_kv);
#pragma unroll
    for (int j = 0; j < HPW; j++) {              // the heads' power-of-two normalizations (while K flies)
        const int h = warp + j * NW;
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < D / WARP; i++) m = fmaxf(m, fabsf(__fmul_rn(qv[j][i], qscale)));
        m = warp_max(m);
        if (lane == 0 && h < w.hcount) {
            const int e = exponent_of(m);
            sh.qf[h] = pow2i(13 - e);
            sh.qinv[h] = pow2i(e - 13);
        }
    }

    __syncthreads();                             // the normalizations are in
    QFrags<D, HT> qf;
    qf.build(w, sh);
    float Mg[C::GPW][2][4], Lg[C::GPW][2][4], Ag[C::GPW][2][4];   // the fold of this thread's elements: group
    float M[LOOPED ? C::GPW : 1][2][4], L[LOOPED ? C::GPW : 1][2][4], A[LOOPED ? C::GPW : 1][2][4];  // all
    for (int s = z * P; s < n_own;) {
        const int nk = keys_of(s), sn = next_split(s);
        const bool more = sn < n_own;
        const int row_next = more ? page_row(sn) : 0;           // loaded now, stored after phase A
        if constexpr (C::ONE_BUF) cp_async_wait<0>(); else cp_async_wait<1>();   // K(s) is here
        __syncthreads();
        phase_scores<D, HT>(w, qf, krows, nk, sh);
        __syncthreads();                         // K buffer and scales free
        if constexpr (C::ONE_BUF) {
            stage_rows<D, HT>(vrows, sh.scl[1], v_pages, v_scales, sh.rowoff, nk, w.kvh, n_kv);
        } else if (more) {
            sh.rowoff[tid] = row_next;
            __syncthreads();
            stage_rows<D, HT>(krows, sh.scl[0], k_pages, k_scales, sh.rowoff, keys_of(sn), w.kvh, n_kv);
        }
        phase_softmax<D, HT>(w, nk, sh);
        if (!C::ONE_BUF && more) cp_async_wait<1>(); else cp_async_wait<0>();    // V(s) is here
        __syncthreads();
        float acc[C::GPW][2][4];
        phase_values<D, HT>(w, vrows, nk, sh, acc);
        __syncthreads();                         // V buffer, its scales and the p's free
        if (more) {
            if constexpr (C::ONE_BUF) {
                sh.rowoff[tid] = row_next;
                __syncthreads();
                stage_rows<D, HT>(krows, sh.scl[0], k_pages, k_scales, sh.rowoff, keys_of(sn), w.kvh, n_kv);
            } else {
                stage_rows<D, HT>(vrows, sh.scl[1], v_pages, v_scales, sh.rowoff, keys_of(sn), w.kvh, n_kv);
            }
        }
        const int part = warp / C::NG;           // head_dim 64: part 1's sums go through the score buffer
        if constexpr (C::KSPLIT > 1) {
            float* red = sh.S;                   // [KSPLIT - 1][HT][D]
            if (part > 0) {
                for_each_value<D, HT>([&](int gi, int m, int i, int h, int c) {
                    if (h < HT) red[((part - 1) * HT + h) * D + c] = acc[gi][m][i];
                });
            }
            __syncthreads();
            if (part == 0) {
                for_each_value<D, HT>([&](int gi, int m, int i, int h, int c) {
                    if (h >= HT) return;
                    for (int p = 1; p < C::KSPLIT; p++)
                        acc[gi][m][i] = __fadd_rn(acc[gi][m][i], red[((p - 1) * HT + h) * D + c]);
                });
            }
        }
        const int g = s / P;
        const bool first = s == g * P, last = s + 1 == group_end(s);
        if (part == 0) {
            for_each_value<D, HT>([&](int gi, int m, int i, int h, int c) {
                if (h >= w.hcount) return;
                if (first) {
                    Mg[gi][m][i] = sh.sm[h];
                    Lg[gi][m][i] = sh.sl[h];
                    Ag[gi][m][i] = acc[gi][m][i];
                } else {
                    attn_fold(Mg[gi][m][i], Lg[gi][m][i], Ag[gi][m][i], sh.sm[h], sh.sl[h], acc[gi][m][i]);
                }
                if (!last) return;
                if constexpr (LOOPED) {
                    if (g == 0) {
                        M[gi][m][i] = Mg[gi][m][i];
                        L[gi][m][i] = Lg[gi][m][i];
                        A[gi][m][i] = Ag[gi][m][i];
                    } else {
                        attn_fold(M[gi][m][i], L[gi][m][i], A[gi][m][i], Mg[gi][m][i], Lg[gi][m][i], Ag[gi][m][i]);
                    }
                } else {
                    const i64 idx = ((i64)w.t * ws_splits + g) * n_heads + w.h0 + h;
                    ws_acc[idx * D + c] = Ag[gi][m][i];
                    if (c == 0) {                // one thread per head holds channel 0
                        ws_ml[2 * idx] = Mg[gi][m][i];
                        ws_ml[2 * idx + 1] = Lg[gi][m][i];
                    }
                }
            });
        }
        s = sn;
    }
    if constexpr (LOOPED) {
        if (warp / C::NG == 0) {
            for_each_value<D, HT>([&](int gi, int m, int i, int h, int c) {
                if (h < w.hcount) out[((i64)w.t * n_heads + w.h0 + h) * D + c] = __fdiv_rn(A[gi][m][i], L[gi][m][i]);
            });
        }
    }
}

// Per (head_dim, head tile): attn_d{D}_h{HT} (split-parallel) and attn_d{D}_h{HT}_looped. The split-parallel
// kernels ask for ATTN_MIN_CTAS(D, HT) CTAs per SM (attention.py split_min_ctas gives the same numbers to the
// grid): 5 at head_dim 64 (head tiles <= 4), 4 at head tile 8 (46 KB of shared memory at head_dim 128: five do
// not fit), head_dim 256 (spills at 96 registers) and head_dim 128 (117 registers). Five at head_dim 128 (96
// registers, no spill) and at head tile 8 of head_dim 64 measured slower on an H200 (A/B builds `d128_min5`,
// `h8_min5`: ATTN_D128_MIN_CTAS, ATTN_H8_MIN_CTAS; perf/kernel_notes.md "Attention at five CTAs an SM"): the
// kernel is bound by its instructions, not by the warps an SM holds. The looped kernels keep a second fold (all
// groups) in registers: 3 CTAs per SM (2 at head_dim 256).
#define ATTN_KERNEL_MODE(D, HT, LOOPED, NAME, MIN_CTAS)                                                    \
    extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS) NAME(                                       \
        const float* __restrict__ q, const i32* __restrict__ token_seq, const i32* __restrict__ token_pos, \
        const i32* __restrict__ page_tables, const i8* __restrict__ k_pages,                               \
        const float* __restrict__ k_scales, const i8* __restrict__ v_pages,                                \
        const float* __restrict__ v_scales, float* __restrict__ out, float* __restrict__ ws_acc,           \
        float* __restrict__ ws_ml, float qscale, int n_heads, int n_kv, int G, int n_ht, int page_size,    \
        int max_pages, int ws_splits) {                                                                    \
        grid_dependency_sync();                                                                           \
        attn_body<D, HT, LOOPED>(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages,         \
                                 v_scales, out, ws_acc, ws_ml, qscale, n_heads, n_kv, G, n_ht, page_size,  \
                                 max_pages, ws_splits);                                                    \
    }
#ifndef ATTN_D128_MIN_CTAS
#define ATTN_D128_MIN_CTAS 4
#endif
#ifndef ATTN_H8_MIN_CTAS
#define ATTN_H8_MIN_CTAS 4
#endif
#define ATTN_MIN_CTAS(D, HT) (D >= 256 ? 4 : HT == 8 ? ATTN_H8_MIN_CTAS : D == 128 ? ATTN_D128_MIN_CTAS : 5)
#define ATTN_KERNEL(D, HT)                                                                                  \
    ATTN_KERNEL_MODE(D, HT, false, attn_d##D##_h##HT, ATTN_MIN_CTAS(D, HT))                                \
    ATTN_KERNEL_MODE(D, HT, true, attn_d##D##_h##HT##_looped, D >= 256 ? 2 : 3)

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

// ---------------------------------------------------------------------------------------------------------
// Tiled kernels for many tokens (prompt chunks): attn_d{D}_h{HT}_tiled. The columns of the mma tiles are
// (token, head) pairs, NC = 8 * NTL of them (token j of the tile, head h at column j * HT + h), so a split's K
// and V rows are staged and converted to f16 once for TT = NC / HT tokens of one sequence, where the looped
// kernel does that per token for HT columns (half of them empty at the 8B shape's 4 heads a kv head). Grid
// (ceil(n_tok / TT), n_kv * n_ht), block NT, dynamic shared memory sizeof(TSmem) (attention.py
// tiled_smem_bytes). A CTA takes tokens TT * x .. and walks each run of consecutive tokens of one sequence in
// turn (a mixed step's decode tokens are runs of one), every split of the run's keys in order: K(s) in the one
// row buffer for phase A, V(s) over it while the softmax runs, K(s + 1) over that after phase C (49 KB at head_dim
// 128: 4 CTAs an SM); the columns' fold weights by one lane each at once; phase C without per-key masks where every
// token of the run has the whole split.
// Every column's arithmetic is the looped kernel's: the same fragments and k positions in every mma, the same
// float operations in the same order (per column: q's normalization, the scores' group sums, the softmax over
// the token's own keys of the split, P' with the exponent of the token's own V scales, the fold of splits in
// its own groups and of the groups), so a token's output is the same bits as in attn_d{D}_h{HT}[_looped]
// whatever shares its tile. A column whose token has fewer keys in a split than the run adds products with
// P' = 0 for the run's extra keys (an exact no-op on its accumulators); columns of absent tokens or heads
// compute on zeros and are never stored.
extern __shared__ __align__(16) u8 attn_dyn_smem[];

template <int D, int HT, int NTL>
struct TCfg {
    static constexpr int NC = 8 * NTL;           // columns
    static constexpr int TT = NC / HT;           // tokens per tile
    static_assert(D <= 128, "tiled kernels are built for head_dim <= 128 (256 takes the looped kernels)");
};

// Shared memory of one tiled CTA (dynamic: > 48 KB at head_dim 128). Every array's size is a multiple of 16
// bytes but the last three, so attention.py's tiled_smem_bytes adds them up (and the kernel checks it).
template <int D, int HT, int NTL>
struct TSmem {
    using C = Cfg<D, HT>;
    static constexpr int NC = TCfg<D, HT, NTL>::NC, TT = TCfg<D, HT, NTL>::TT;
    alignas(16) u8 kv[KPS * C::RS];              // K rows, then V rows over them (V(s) staged after phase A)
    alignas(16) float scl[2][KPS * C::NG];       // K, V scales of the split's keys
    alignas(16) u32 qfr[C::NG][NTL][2][WARP][4]; // q' fragments (hi, lo) per group, n-tile and lane
    alignas(16) float S[NC * C::SSTR];           // scores, then p, per column; then (head_dim 64) part 1's sums
    alignas(16) float A[NC * D];                 // the fold of all groups, per column and channel
    alignas(16) int rowoff[KPS];                 // cache row per key of the split
    float qf[NC], qinv[NC];                      // per column: 2^(13 - e), 2^(e - 13)
    float sm[NC], sl[NC];                        // per column: this split's softmax max and sum
    float Mg[NC], Lg[NC], M[NC], L[NC];          // per column: the running fold of the group and of all groups
    float gca[NC], gcb[NC], oca[NC], ocb[NC];    // this split's fold weights: into the group, the group into all
    int flag[NC];                                // this split: 1 active, 2 first of a group, 4 last, 8 group 0
    float fv[NW][TT], fvinv[NW][TT];             // per warp (its V group) and token: 2^(13 - e_G), 2^(e_G - 13)
    int nkeys[TT], nown[TT], pgrp[TT];           // per token: keys, splits, splits per group
};

__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// Phase A for NTL n-tiles of columns: as phase_scores, the K fragments converted once per 16-key tile and
// group and multiplied with every active n-tile's q' fragments (nta: n-tiles holding a token of the run).
template <int D, int HT, int NTL>
__device__ __forceinline__ void tiled_scores(const u8* krows, int nk, int nta, TSmem<D, HT, NTL>& sh) {
    using C = Cfg<D, HT>;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, tq = lane % 4;
    const int pk = g < 4 ? 2 * g : 2 * g - 7;
    const float* ksc = sh.scl[0];
    float sacc[NTL][C::MTW][4];
#pragma unroll
    for (int grp = 0; grp < C::NG; grp++) {
#pragma unroll
        for (int j = 0; j < C::MTW; j++) {
            const int kb = (warp * C::MTW + j) * 16;
            if (kb >= nk) break;                 // warp-uniform: tiles past the split's keys
            const u32x2 wa = *(const u32x2*)(krows + (kb + pk) * C::RS + grp * 32 + 8 * tq);
            const u32x2 wb = *(const u32x2*)(krows + (kb + pk + 8) * C::RS + grp * 32 + 8 * tq);
            u32 a[2][4];
#pragma unroll
            for (int st = 0; st < 2; st++) k_fragment(wa, wb, st, a[st]);
            const float ka = ksc[(kb + pk) * C::NG + grp], kz = ksc[(kb + pk + 8) * C::NG + grp];
#pragma unroll
            for (int nt = 0; nt < NTL; nt++) {
                if (nt >= nta) break;            // warp-uniform
                const uint4 h4 = *(const uint4*)sh.qfr[grp][nt][0][lane];
                const uint4 l4 = *(const uint4*)sh.qfr[grp][nt][1][lane];
                const u32 bh[4] = {h4.x, h4.y, h4.z, h4.w}, bl[4] = {l4.x, l4.y, l4.z, l4.w};
                float ch[4] = {0.f, 0.f, 0.f, 0.f}, cl[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int st = 0; st < 2; st++) {
                    mma_f16(ch, a[st], bh[2 * st], bh[2 * st + 1]);
                    if (ATTN_Q_LO) mma_f16(cl, a[st], bl[2 * st], bl[2 * st + 1]);
                }
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float d = join_f16_sums(ch[i], cl[i]), ks = i < 2 ? ka : kz;
                    sacc[nt][j][i] = grp == 0 ? __fmul_rn(ks, d) : __fmaf_rn(ks, d, sacc[nt][j][i]);
                }
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < NTL; nt++) {
        if (nt >= nta) break;
#pragma unroll
        for (int j = 0; j < C::MTW; j++) {
            const int kb = (warp * C::MTW + j) * 16;
            if (kb >= nk) break;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int c = nt * 8 + 2 * tq + (i & 1), k = kb + pk + (i >> 1) * 8;
                if (k < nk) sh.S[c * C::SSTR + k] = __fmul_rn(sacc[nt][j][i], sh.qinv[c]);
            }
        }
    }
}

// Phase C for NTL n-tiles: as phase_values, the V fragments converted once per key step and multiplied with
// every active n-tile's P'. Lane (g, tq) makes the P' of column 8 nt + g for its four keys (the k positions
// of phase_values: keys 2tq, 2tq + 8, 2tq + 1, 2tq + 9), zero past the column's own keys (nkc) with MASK;
// without it (every present column has all KPS keys of the split), absent columns multiply their zero scores.
template <int D, int HT, int NTL, bool MASK>
__device__ __forceinline__ void tiled_values(const u8* vrows, int nk, int nta, int s, int nrun, int hcount,
                                             TSmem<D, HT, NTL>& sh, float (&acc)[NTL][Cfg<D, HT>::GPW][2][4]) {
    using C = Cfg<D, HT>;
    constexpr int TT = TCfg<D, HT, NTL>::TT;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, tq = lane % 4;
    const float* vsc = sh.scl[1];
    const int part = warp / C::NG;
#pragma unroll
    for (int gi = 0; gi < C::GPW; gi++) {
        const int grp = value_group<D, HT>(gi);
        // e_G of every token of the run: the largest V scale of the group over the token's own keys
        float mall = 0.f;
        for (int k = lane; k < nk; k += WARP) mall = fmaxf(mall, vsc[k * C::NG + grp]);
        mall = warp_max(mall);
        for (int j = 0; j < nrun; j++) {
            const int nkj = min(KPS, sh.nkeys[j] - s * KPS);
            float mv = mall;
            if (nkj < nk) {                      // warp-uniform: a token ending inside the split
                mv = 0.f;
                for (int k = lane; k < nkj; k += WARP) mv = fmaxf(mv, vsc[k * C::NG + grp]);
                mv = warp_max(mv);
            }
            if (lane == 0) {
                const int ev = exponent_of(mv);
                sh.fv[warp][j] = pow2i(13 - ev);
                sh.fvinv[warp][j] = pow2i(ev - 13);
            }
        }
        __syncwarp();
        int nkc[NTL];
        float fvc[NTL];
        const float* pS[NTL];
#pragma unroll
        for (int nt = 0; nt < NTL; nt++) {
            const int c = nt * 8 + g, j = c / HT;
            const bool ok = j < nrun && c % HT < hcount;
            nkc[nt] = ok ? min(KPS, sh.nkeys[j] - s * KPS) : 0;
            fvc[nt] = sh.fv[warp][min(j, TT - 1)];
            pS[nt] = sh.S + c * C::SSTR;
        }
        float c[NTL][2][4] = {};
        for (int kb = part * 16; kb < nk; kb += 16 * C::KSPLIT) {
            const int kk[4] = {kb + 2 * tq, kb + 2 * tq + 8, kb + 2 * tq + 1, kb + 2 * tq + 9};
            u32 x[4];
            float vs[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                x[j] = *(const u32*)(vrows + kk[j] * C::RS + grp * 32 + 4 * g) ^ 0x80808080u;
                vs[j] = vsc[kk[j] * C::NG + grp];
            }
            u32 a[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++) v_fragment(x, m, a[m]);
#pragma unroll
            for (int nt = 0; nt < NTL; nt++) {
                if (nt >= nta) break;            // warp-uniform
                const float2 p02 = *(const float2*)(pS[nt] + kb + 2 * tq);       // keys kk[0], kk[2]
                const float2 p13 = *(const float2*)(pS[nt] + kb + 2 * tq + 8);   // keys kk[1], kk[3]
                const float ps[4] = {p02.x, p13.x, p02.y, p13.y};
                float pv[4];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float p = __fmul_rn(__fmul_rn(ps[j], vs[j]), fvc[nt]);
                    pv[j] = !MASK || kk[j] < nkc[nt] ? p : 0.f;
                }
                const u32 b0 = pack_f16x2(pv[0], pv[1]), b1 = pack_f16x2(pv[2], pv[3]);
#pragma unroll
                for (int m = 0; m < 2; m++) mma_f16(c[nt][m], a[m], b0, b1);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NTL; nt++)
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int j = min((nt * 8 + 2 * tq + (i & 1)) / HT, TT - 1);
                    acc[nt][gi][m][i] = __fmul_rn(c[nt][m][i], sh.fvinv[warp][j]);
                }
    }
}

// Column c (token j) after the softmax of split s (max m, sum l): its group's running fold (Mg, Lg) and, at the
// group's last split, the group folded into all groups (M, L), as attn_body folds each element; the weights and
// flag tell the element folds after phase C what to do. Group sizes are powers of two (group_splits).
template <class Sm>
__device__ __forceinline__ void column_fold(Sm& sh, int c, int j, int s, float m, float l) {
    const int P = sh.pgrp[j], gi = s >> (__ffs(P) - 1);
    const bool first = s == gi * P, last = s + 1 == min((gi + 1) * P, sh.nown[j]);
    if (first) {
        sh.Mg[c] = m;
        sh.Lg[c] = l;
    } else {
        float mn, ca, cb;
        fold_weights(sh.Mg[c], m, mn, ca, cb);
        sh.Lg[c] = fold_apply(sh.Lg[c], ca, l, cb);
        sh.Mg[c] = mn;
        sh.gca[c] = ca;
        sh.gcb[c] = cb;
    }
    if (last) {
        if (gi == 0) {
            sh.M[c] = sh.Mg[c];
            sh.L[c] = sh.Lg[c];
        } else {
            float mn, ca, cb;
            fold_weights(sh.M[c], sh.Mg[c], mn, ca, cb);
            sh.L[c] = fold_apply(sh.L[c], ca, sh.Lg[c], cb);
            sh.M[c] = mn;
            sh.oca[c] = ca;
            sh.ocb[c] = cb;
        }
    }
    sh.flag[c] = 1 | first << 1 | last << 2 | (gi == 0) << 3;
}

template <int D, int HT, int NTL>
__device__ __forceinline__ void attn_tiled_body(
    const float* __restrict__ q, const i32* __restrict__ token_seq, const i32* __restrict__ token_pos,
    const i32* __restrict__ page_tables, const i8* __restrict__ k_pages, const float* __restrict__ k_scales,
    const i8* __restrict__ v_pages, const float* __restrict__ v_scales, float* __restrict__ out, float qscale,
    int n_tok, int n_heads, int n_kv, int G, int n_ht, int page_size, int max_pages) {
    using C = Cfg<D, HT>;
    using Sm = TSmem<D, HT, NTL>;
    constexpr int NC = Sm::NC, TT = Sm::TT;
    static_assert(KPS == NT, "one key of a split per thread");
    Sm& sh = *reinterpret_cast<Sm*>(attn_dyn_smem);
    if (dynamic_smem_bytes() < sizeof(Sm)) __trap();   // attention.py tiled_smem_bytes must match
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int kvh = blockIdx.y / n_ht, tile = blockIdx.y % n_ht;
    const int h0 = kvh * G + tile * HT, hcount = min(HT, G - tile * HT), width = n_kv * n_ht;
    const int tend = min((int)(blockIdx.x + 1) * TT, n_tok);
    u8* const rows = sh.kv;                      // K(s), then V(s), then K(s + 1): one buffer, so 4 CTAs an SM
    for (int r0 = blockIdx.x * TT; r0 < tend;) {
        const int seq = token_seq[r0];
        int r1 = r0 + 1;
        while (r1 < tend && token_seq[r1] == seq) r1++;
        const int nrun = r1 - r0, nta = (nrun * HT + 7) / 8;
        __syncthreads();                         // the previous run's shared memory is consumed
        if (tid < TT) {
            const int nk = tid < nrun ? token_pos[r0 + tid] + 1 : 0;
            const int no = (nk + KPS - 1) / KPS;
            sh.nkeys[tid] = nk;
            sh.nown[tid] = no;
            sh.pgrp[tid] = no ? group_splits(no, width) : 1;
        }
        for (int c = warp; c < NC; c += NW) {    // the columns' power-of-two normalizations
            const int j = c / HT, h = c % HT;
            const bool ok = j < nrun && h < hcount;
            float m = 0.f;
            if (ok) {
                const float* qc = q + ((i64)(r0 + j) * n_heads + h0 + h) * D;
#pragma unroll
                for (int i = 0; i < D / WARP; i++) m = fmaxf(m, fabsf(__fmul_rn(qc[lane + i * WARP], qscale)));
            }
            m = warp_max(m);
            if (lane == 0) {
                const int e = exponent_of(m);
                sh.qf[c] = ok ? pow2i(13 - e) : 0.f;
                sh.qinv[c] = pow2i(e - 13);
            }
        }
        __syncthreads();
        int nkmax = 0, nkmin = 1 << 30;
        for (int j = 0; j < nrun; j++) {
            nkmax = max(nkmax, sh.nkeys[j]);
            nkmin = min(nkmin, sh.nkeys[j]);
        }
        const int nomax = (nkmax + KPS - 1) / KPS;
        auto page_row = [&](int s) {             // cache row of this thread's key of split s
            const int p = s * KPS + tid;
            return p < nkmax ? page_tables[(i64)seq * max_pages + p / page_size] * page_size + p % page_size : 0;
        };
        auto keys_of = [&](int s) { return min(KPS, nkmax - s * KPS); };
        sh.rowoff[tid] = page_row(0);
        for (int it = tid; it < C::NG * NTL * WARP; it += NT) {   // q' fragments (q_fragments per column)
            const int grp = it / (NTL * WARP), nt = it / WARP % NTL, l = it % WARP;
            const int c = nt * 8 + l / 4, j = c / HT, h = c % HT;
            f32x4 x0 = {0.f, 0.f, 0.f, 0.f}, x1 = x0;
            float f = 0.f;
            if (j < nrun && h < hcount) {
                const float* qg = q + ((i64)(r0 + j) * n_heads + h0 + h) * D + grp * 32 + 8 * (l % 4);
                x0 = *(const f32x4*)qg;
                x1 = *(const f32x4*)(qg + 4);
                f = sh.qf[c];
            }
            const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            u32 bh[4], bl[4];
            q_pairs(xs, qscale, f, bh, bl);
            *(uint4*)sh.qfr[grp][nt][0][l] = make_uint4(bh[0], bh[1], bh[2], bh[3]);
            *(uint4*)sh.qfr[grp][nt][1][l] = make_uint4(bl[0], bl[1], bl[2], bl[3]);
        }
        __syncthreads();                         // row offsets and fragments are in
        stage_rows<D, HT>(rows, sh.scl[0], k_pages, k_scales, sh.rowoff, keys_of(0), kvh, n_kv);
        float Ag[NTL][C::GPW][2][4] = {};
        for (int s = 0; s < nomax; s++) {
            const int nk = keys_of(s);
            const bool more = s + 1 < nomax;
            const int row_next = more ? page_row(s + 1) : 0;
            cp_async_wait<0>();                  // K(s) is here
            __syncthreads();
            tiled_scores<D, HT, NTL>(rows, nk, nta, sh);
            __syncthreads();                     // K rows and scales free: V(s) comes while the softmax runs
            stage_rows<D, HT>(rows, sh.scl[1], v_pages, v_scales, sh.rowoff, nk, kvh, n_kv);
            // phase B per column (one warp each), its statistics kept for the fold weights below
            for (int c = warp; c < NC; c += NW) {
                const int j = c / HT;
                const int nkj = j < nrun && c % HT < hcount ? min(KPS, sh.nkeys[j] - s * KPS) : 0;
                if (nkj <= 0) continue;          // warp-uniform: no token, or the token's keys are done
                float m, sum;
                column_softmax<true>(sh.S + c * C::SSTR, nkj, m, sum);
                if (lane == 0) {
                    sh.sm[c] = m;
                    sh.sl[c] = sum;
                }
            }
            cp_async_wait<0>();                  // V(s) is here
            __syncthreads();
            if (warp == 0 && lane < NC) {        // the fold weights of all columns at once: lane c, column c
                const int j = lane / HT;
                const bool live = j < nrun && lane % HT < hcount && sh.nkeys[j] > s * KPS;
                if (live) column_fold(sh, lane, j, s, sh.sm[lane], sh.sl[lane]);
                else sh.flag[lane] = 0;
            }
            float acc[NTL][C::GPW][2][4];
            if (nk == KPS && nkmin >= (s + 1) * KPS)   // CTA-uniform: every token has the whole split
                tiled_values<D, HT, NTL, false>(rows, nk, nta, s, nrun, hcount, sh, acc);
            else
                tiled_values<D, HT, NTL, true>(rows, nk, nta, s, nrun, hcount, sh, acc);
            __syncthreads();                     // V rows, their scales and the p's free
            if (more) {
                sh.rowoff[tid] = row_next;
                __syncthreads();
                stage_rows<D, HT>(rows, sh.scl[0], k_pages, k_scales, sh.rowoff, keys_of(s + 1), kvh, n_kv);
            }
            const int part = warp / C::NG;       // head_dim 64: part 1's sums go through the score buffer
            if constexpr (C::KSPLIT > 1) {
                static_assert((C::KSPLIT - 1) * NC * D <= NC * C::SSTR, "part sums must fit in the scores");
                float* red = sh.S;               // [KSPLIT - 1][NC][D]
                if (part > 0) {
#pragma unroll
                    for (int nt = 0; nt < NTL; nt++)
                        for_each_value<D, HT>([&](int gi, int m, int i, int h, int c) {
                            red[((part - 1) * NC + nt * 8 + h) * D + c] = acc[nt][gi][m][i];
                        });
                }
                __syncthreads();
                if (part == 0) {
#pragma unroll
                    for (int nt = 0; nt < NTL; nt++)
                        for_each_value<D, HT>([&](int gi, int m, int i, int h, int c) {
                            for (int p = 1; p < C::KSPLIT; p++)
                                acc[nt][gi][m][i] = __fadd_rn(acc[nt][gi][m][i], red[((p - 1) * NC + nt * 8 + h) * D + c]);
                        });
                }
            }
            if (part == 0) {
                // this thread's values are of columns nt * 8 + 2 tq + e (for_each_value's h): per column, its flag
                // and weights once, then its values of the group fold branch-free, the fold of all groups at
                // the group's last split
#pragma unroll
                for (int nt = 0; nt < NTL; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int col = nt * 8 + 2 * (lane % 4) + e, f = sh.flag[col];
                        if (!(f & 1)) continue;
                        const bool first = f & 2;
                        const float ca = sh.gca[col], cb = sh.gcb[col];
                        for_each_value_of_head<D, HT>(e, [&](int gi, int m, int i, int c) {
                            float& ag = Ag[nt][gi][m][i];
                            const float x = acc[nt][gi][m][i];
                            ag = first ? x : fold_apply(ag, ca, x, cb);
                        });
                        if (f & 4) {
                            const bool g0 = f & 8;
                            const float oa = sh.oca[col], ob = sh.ocb[col];
                            for_each_value_of_head<D, HT>(e, [&](int gi, int m, int i, int c) {
                                float& a = sh.A[col * D + c];
                                const float ag = Ag[nt][gi][m][i];
                                a = g0 ? ag : fold_apply(a, oa, ag, ob);
                            });
                        }
                    }
            }
        }
        __syncthreads();                         // the folds are in
        for (int it = tid; it < NC * D; it += NT) {
            const int c = it / D, ch = it % D, j = c / HT, h = c % HT;
            if (j < nrun && h < hcount)
                out[((i64)(r0 + j) * n_heads + h0 + h) * D + ch] = __fdiv_rn(sh.A[it], sh.L[c]);
        }
        r0 = r1;
    }
}

// attn_d{D}_h{HT}_tiled: ATTN_TILED_NTL n-tiles, 2 by default (16 columns: 4 tokens at head tile 4, 2 at head
// tile 8); the A/B builds `tiled1` and `tiled4` (attention.py BUILDS) take 1 and 4.
#ifndef ATTN_TILED_NTL
#define ATTN_TILED_NTL 2
#endif
// CTAs an SM the registers are bounded for: 4 at 16 columns (what the shared memory allows at head_dim 128),
// 2 at 32 (tiled4: its accumulators would spill under 128 registers)
#define ATTN_TILED_MIN_CTAS (ATTN_TILED_NTL <= 2 ? 4 : 2)
#define ATTN_TILED_KERNEL(D, HT)                                                                            \
    extern "C" __global__ void __launch_bounds__(NT, ATTN_TILED_MIN_CTAS) attn_d##D##_h##HT##_tiled(         \
        const float* __restrict__ q, const i32* __restrict__ token_seq, const i32* __restrict__ token_pos, \
        const i32* __restrict__ page_tables, const i8* __restrict__ k_pages,                               \
        const float* __restrict__ k_scales, const i8* __restrict__ v_pages,                                \
        const float* __restrict__ v_scales, float* __restrict__ out, float qscale, int n_tok, int n_heads, \
        int n_kv, int G, int n_ht, int page_size, int max_pages) {                                         \
        grid_dependency_sync();                                                                           \
        attn_tiled_body<D, HT, ATTN_TILED_NTL>(q, token_seq, token_pos, page_tables, k_pages, k_scales,   \
                                               v_pages, v_scales, out, qscale, n_tok, n_heads, n_kv, G,    \
                                               n_ht, page_size, max_pages);                                \
    }
ATTN_TILED_KERNEL(64, 1)
ATTN_TILED_KERNEL(64, 2)
ATTN_TILED_KERNEL(64, 4)
ATTN_TILED_KERNEL(64, 8)
ATTN_TILED_KERNEL(128, 1)
ATTN_TILED_KERNEL(128, 2)
ATTN_TILED_KERNEL(128, 4)
ATTN_TILED_KERNEL(128, 8)

// Fold a token's own group partials left to right: grid (n_tok, n_heads, D / 32), block NT; out (n_tok,
// n_heads, D). The fold is sequential in the groups, so its inputs are brought in bulk first (cp.async, MCH
// groups of 32 channels at a time), the running maxima (a warp scan) and the weights ca, cb are computed in
// parallel once per group for the head, and warp 0 (lane = channel) applies them from shared memory.
#define MCH 256
extern "C" __global__ void __launch_bounds__(NT) attn_merge(const float* __restrict__ ws_acc,
                                                           const float* __restrict__ ws_ml,
                                                           const i32* __restrict__ token_pos,
                                                           float* __restrict__ out, int n_heads, int D,
                                                           int ws_splits, int width) {
    grid_dependency_sync();
    __shared__ alignas(16) float a[MCH][WARP];
    __shared__ alignas(16) float ml[MCH][2];
    __shared__ float mprev[MCH], wa[MCH], wb[MCH];
    const int t = blockIdx.x, h = blockIdx.y, d0 = blockIdx.z * WARP, tid = threadIdx.x;
    const int n_split = (token_pos[t] + KPS) / KPS; // ceil((pos + 1) / KPS)
    const int P = group_splits(n_split, width), n_own = (n_split + P - 1) / P;   // the token's groups
    const i64 row0 = (i64)t * ws_splits * n_heads + h; // group s of (t, h) is row row0 + s * n_heads
    float carry = neg_inf(), L = 0.f, A = 0.f;      // warp 0: max of the groups before this chunk; sum, acc
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
