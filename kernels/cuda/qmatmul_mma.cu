// Quantized mat-mul y = x @ W.T for prompt chunks on the tensor cores (int8 mma.sync m16n8k32), over the
// same raw GGUF blocks and ggml-rounded int8 activations as the dp4a kernels of qmatmul.cu, and with the
// same bits: every output equals the dp4a kernel's for the same row and token, so a token's logits do not
// depend on which kernel its step took (batch invariance; the launcher picks by token count).
//
// How the bits are kept. The dp4a kernel gives unit u of a row to lane u % 32; the S units of a superblock
// (qmatmul_types.cuh) lie in a group of S consecutive lanes (S = 1: every lane its own group). Each output's sum
// is its groups' sums added left to right, ((0 + p0) + p1) + ..., where group gi's sum adds the float tails
// (T::tail) of its superblocks in round order, each tail applied once to the superblock's exact integer sum.
// Here a thread owns whole outputs, so it walks the units group by group (UnitWalk): each superblock's
// integer parts summed, its tail added to the group's sum, each group's sum added to the output's running
// sum: two floats and an integer part per output. The integer parts come from mma instead of dp4a: integer
// sums are exact, so they are equal whatever the order.
//
// Work split: a CTA takes 32 weight rows (two m16 tiles; GLU: 16 gate rows i.. and the up rows
// i + n_out / 2.., so one thread ends with both sums of an output of silu(gate) * up) by W * 8 * NB
// tokens, warp w the w-th 8 * NB of them. The CTA walks the units in the order above, W at a
// time (a step): warp w decodes the step's w-th unit of the 32 rows into shared memory (lane r: row r)
// and stages that unit's activations and scales of the CTA's tokens there too (the B fragments, copied
// from the chunk-major copy of the activations that the launcher makes first: a step's units may lie 32
// units apart, so from row-major activations each copy gathered 32-byte pieces of many rows); then every warp
// multiplies all W decoded units with its tokens, so each decoded unit serves W * 8 * NB tokens. Two
// buffers: the next step's units are decoded and staged while slower warps still read this step's, and
// one barrier per step orders them. Grid (token tiles, row tiles): the CTAs sharing weight rows run
// together and find them in L2.
#include "qmatmul_types.cuh"

// d (16x8, s32) = a (16x32, s8, row-major) . b (32x8, s8, column-major). Fragments (lane = 4 * g + t):
// a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..]; b0 = B[4t..4t+3][g],
// b1 = B[16+4t..][g]; d0 = D[g][2t], d1 = D[g][2t+1], d2 = D[g+8][2t], d3 = D[g+8][2t+1].
__device__ __forceinline__ void mma_s8(i32* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}
// The same with k = 16 (m16n8k16): a0 = A[g][4t..4t+3], a1 = A[g+8][4t..4t+3]; b0 = B[4t..4t+3][g].
__device__ __forceinline__ void mma_s8_k16(i32* d, u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

// A fragment of words w0..w0+7 of rows ra (g) and rb (g + 8).
template <class U>
__device__ __forceinline__ void a_frag(const U& ra, const U& rb, int w0, int t, u32* a) {
    a[0] = ra.w[w0 + t];
    a[1] = rb.w[w0 + t];
    a[2] = ra.w[w0 + 4 + t];
    a[3] = rb.w[w0 + 4 + t];
}

// The units of a row in the order the outputs add them. The dp4a kernel's lanes form groups of S (lanes
// S * gi .. S * gi + S - 1 hold a superblock's units in each round); group gi's sum is its superblocks' in round
// order, and the outputs add the groups' sums left to right. So: groups gi = 0, 1, ..., 32 / S - 1; in each,
// rounds j = 0, 1, ...; in each round the units 32j + S * gi .. 32j + S * gi + S - 1. Groups without units are
// the last ones (rows of fewer than 32 units): the walk ends there (u >= n_units).
template <int S>
struct UnitWalk {
    int gi = 0, u = 0;                             // group gi, unit u; group 0 is never empty
    __device__ __forceinline__ bool block_ends() const { return (u + 1) % S == 0; }
    // at a block's end: whether it is its group's last
    __device__ __forceinline__ bool group_ends(int n_units) const { return u + 1 + 32 - S >= n_units; }
    __device__ __forceinline__ void next(int n_units) {
        ++u;
        if (u % S == 0) {
            u += 32 - S;
            if (u >= n_units && gi < 32 / S - 1) u = S * ++gi;
        }
    }
};

// Staged activations of one unit: word i (T::xload's order) of the CTA's token c at xw[c * XSTRIDE + i],
// the padding making a warp's B-fragment reads (8 tokens x 4 words) hit 32 different banks.
template <class T>
struct Staged {
    static constexpr int XSTRIDE = T::NW + 4;
};

// A unit's activations as the B fragments read them: word i (T::xload's order) of the warp's token c.
// StagedX: staged in shared memory (mmq), from the warp's first token; ChunkX: straight from the chunk-major
// copy act_tiles makes (mmqs: xt (k / 16, n_tok, 16)), token tok0 + c clamped to the last one (whose outputs
// are not stored). A B-fragment read (4 words of 8 consecutive tokens) is then 128 contiguous bytes, one L1
// wavefront; from the row-major rows it touched 8 rows (ncu: the small-token kernel was bound by L1 wavefronts).
template <class T>
struct StagedX {
    const u32* xw;
    __device__ __forceinline__ u32 word(int c, int i) const { return xw[c * Staged<T>::XSTRIDE + i]; }
};
template <class T>
struct ChunkX {
    const i8* xt;
    int n_tok, last, tok0, u;
    __device__ __forceinline__ u32 word(int c, int i) const {
        constexpr int CW = T::XCHUNK / 4;              // words per chunk
        const int o = T::xpos(u, i / CW);              // the chunk's byte in the token's row
        const i8* chunk = xt + ((size_t)(o >> 4) * n_tok + min(tok0 + c, last)) * 16 + (o & 15);
        return __ldg((const u32*)chunk + i % CW);
    }
};

// One unit (su: the 32 rows' decoded unit; x: its activations) times this warp's tokens: the integer parts
// added into the superblock's sums ci (output o = 4 * (NB * mt + nb) + r).
template <class T, int NB, class X>
__device__ __forceinline__ void unit_mma(const typename T::U* su, const X& x, int g, int t, typename T::I* ci) {
    typedef typename T::U U;
    constexpr int NX = T::MMA == MMA_K4 ? 4 : 2;   // B words per lane and n tile: words t, 4 + t, 8 + t, 12 + t
    u32 xb[NB][NX];                                // of token g of each n tile
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < NX; ++i) xb[nb][i] = x.word(8 * nb + g, 4 * i + t);
    // activation sums per sub-block (Q4_K/Q5_K mins): a product with all-ones weights
    i32 sx[NB][2][4];
    if constexpr (T::MMA == MMA_K4) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                mma_s8(sx[nb][h], 0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u, xb[nb][2 * h],
                       xb[nb][2 * h + 1]);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const U& ra = su[16 * mt + g];
        const U& rb = su[16 * mt + g + 8];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            typename T::I* c = ci + 4 * (NB * mt + nb);
            if constexpr (T::MMA == MMA_ONE) {
                u32 a[4];
                i32 d[4];
                a_frag(ra, rb, 0, t, a);
                mma_s8(d, a[0], a[1], a[2], a[3], xb[nb][0], xb[nb][1]);
#pragma unroll
                for (int r = 0; r < 4; ++r) c[r] += T::mma_int(r < 2 ? ra : rb, d[r]);
            } else if constexpr (T::MMA == MMA_K4) {
                u32 a[4];
                i32 d0[4], d1[4];
                a_frag(ra, rb, 0, t, a);
                mma_s8(d0, a[0], a[1], a[2], a[3], xb[nb][0], xb[nb][1]);
                a_frag(ra, rb, 8, t, a);
                mma_s8(d1, a[0], a[1], a[2], a[3], xb[nb][2], xb[nb][3]);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const U& q = r < 2 ? ra : rb;
                    c[r] += I2{q.sc[0] * d0[r] + q.sc[1] * d1[r], q.m[0] * sx[nb][0][r] + q.m[1] * sx[nb][1][r]};
                }
            } else {                               // MMA_Q6: words 0-3 take scale sc[0], words 4-7 sc[1]
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    i32 d[4];
                    mma_s8_k16(d, ra.w[4 * h + t], rb.w[4 * h + t], xb[nb][h]);
#pragma unroll
                    for (int r = 0; r < 4; ++r) c[r] += (r < 2 ? ra : rb).sc[h] * d[r];
                }
            }
        }
    }
}

// A superblock's end: its integer parts ci scaled into the group sums ch (T::tail with the rows' scales from
// su, the block's last unit, and xs(c), the scale of the warp's token c), ci cleared.
template <class T, int NB, class XS>
__device__ __forceinline__ void block_tail(const typename T::U* su, const XS& xs, int g, int t,
                                           typename T::I* ci, float* ch) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int o = 4 * (NB * mt + nb) + r;
                float a, b;
                T::tail(su[16 * mt + g + 8 * (r >> 1)], ci[o], xs(8 * nb + 2 * t + (r & 1)), a, b);
                ch[o] = __fmaf_rn(a, b, ch[o]);
                ci[o] = typename T::I();
            }
}

// Asynchronous global -> shared copies (cp.async, sm_80+): the staged activations take no registers and
// land while the warp decodes and multiplies; cp_async_wait() before the barrier that publishes them.
__device__ __forceinline__ u32 shared_addr(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(src));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(shared_addr(dst)), "l"(g), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Decode unit u of this lane's row into su[lane] and stage the unit's activations of the CTA's TOK tokens
// (token c: token min(tok0 + c, n_tok - 1)) into xw [TOK][XSTRIDE] and their scales into xs [TOK], from the
// chunk-major copies act_tiles makes (qmatmul.cu): xt (k / 16, n_tok, 16) int8, xdt (k / XB, n_tok) f32. Each
// copy instruction takes one chunk of 32 consecutive tokens, so it reads 32 x XCHUNK contiguous bytes (the
// row-major gather of 16 rows took 5x the L1 wavefronts) and writes 32 rows of xw, XSTRIDE words apart, in
// distinct banks. The copies are issued first, then the decode's loads.
template <class T, int TOK>
__device__ __forceinline__ void decode_and_stage(const u8* wr, int k, int u, const u32* tab, typename T::U* su,
                                                 const i8* __restrict__ xt, const float* __restrict__ xdt,
                                                 int tok0, int n_tok, u32* xw, float* xs) {
    const int lane = threadIdx.x;
    constexpr int CW = T::XCHUNK / 4, NCH = T::NW / CW, XS = Staged<T>::XSTRIDE;   // words per chunk, chunks per token
    static_assert(TOK % 32 == 0, "a copy instruction takes 32 tokens of one chunk");
#pragma unroll
    for (int m = 0; m < TOK * NCH / 32; ++m) {
        const int q = m / (TOK / 32), c = 32 * (m % (TOK / 32)) + lane, o = T::xpos(u, q);
        const int tok = min(tok0 + c, n_tok - 1);
        cp_async<T::XCHUNK>(xw + c * XS + q * CW, xt + ((size_t)(o >> 4) * n_tok + tok) * 16 + (o & 15));
    }
#pragma unroll
    for (int m = 0; m < TOK / 32; ++m)
        cp_async<4>(xs + 32 * m + lane, xdt + (size_t)(u / T::UPX) * n_tok + min(tok0 + 32 * m + lane, n_tok - 1));
    typename T::U v;
    T::decode(wr, k, u, tab, v);
    su[lane] = v;
}

// The outputs a thread owns (rows r0 + 16 mt + g + 8 (r >> 1), tokens t0 + 8 nb + 2 t + (r & 1); GLU: gate
// tile mt = 0, up tile mt = 1) from their finished sums tot[4 * (NB * mt + nb) + r] into o.
template <int NB, bool GLU>
__device__ __forceinline__ void store_outputs(const Out& o, const float* tot, int t0, int n_tok, int r0, int n_out,
                                              int g, int t) {
    const int half = n_out / 2;
    if (t0 >= n_tok) return;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int tok = t0 + 8 * nb + 2 * t + (r & 1);
            if (tok >= n_tok) continue;
            if constexpr (GLU) {
                const int i = r0 + g + 8 * (r >> 1);
                if (i < half) o.glu(tok, i, half, tot[4 * nb + r], tot[4 * (NB + nb) + r]);
            } else {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const int row = r0 + 16 * mt + g + 8 * (r >> 1);
                    if (row < n_out) o.put(tok, row, n_out, tot[4 * (NB * mt + nb) + r]);
                }
            }
        }
}

// W (n_out, row_bytes) u8; xt (k / 16, n_tok, 16) int8 and xdt (k / XB, n_tok) f32: the activations and scales
// chunk-major (act_tiles); su: [2][NW][32] decoded units; xw
// [2][NW][TOK][XSTRIDE] and xs [2][NW][TOK] staged activations and scales (dynamic shared memory: qmatmul.py
// mma_smem). grid (cdiv(n_tok, TOK), cdiv(n_out, 32)) (GLU: cdiv(n_out / 2, 16)), block (32, NW).
template <class T, int NW, int NB, bool GLU>
__device__ __forceinline__ void mmq(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                    const i8* __restrict__ xt, const float* __restrict__ xdt, int n_tok,
                                    const Out& o, const u32* tab, typename T::U (*su)[NW][32], u32* xw, float* xs) {
    constexpr int NO = 2 * NB * 4;                 // outputs per thread: m tile (2) x n tile (NB) x d register (4)
    constexpr int TOK = NW * 8 * NB, XBUF = TOK * Staged<T>::XSTRIDE;   // tokens per CTA, staged words per unit
    const int lane = threadIdx.x, warp = threadIdx.y, g = lane >> 2, t = lane & 3, half = n_out / 2;
    const int r0 = blockIdx.y * (GLU ? 16 : 32), tok0 = blockIdx.x * TOK, tw = warp * 8 * NB;
    const int my_row = GLU ? min(r0 + (lane & 15), half - 1) + (lane < 16 ? 0 : half) : min(r0 + lane, n_out - 1);
    const u8* wr = W + (size_t)my_row * row_bytes; // the row this lane decodes
    const int n_units = k / T::UNIT;
    UnitWalk<T::S> dec;                            // the unit this warp decodes: step s's warp-th
    for (int j = 0; j < warp; ++j) dec.next(n_units);
    if (warp < n_units)
        decode_and_stage<T, TOK>(wr, k, dec.u, tab, su[0][warp], xt, xdt, tok0, n_tok, xw + warp * XBUF,
                                 xs + warp * TOK);
    cp_async_wait();
    __syncthreads();
    typename T::I ci[NO];                          // the superblock being summed: integer parts
    float ch[NO], tot[NO];                         // the group being summed; the groups before it, added in order
#pragma unroll
    for (int o = 0; o < NO; ++o) {
        ci[o] = typename T::I();
        ch[o] = tot[o] = 0.0f;
    }
    UnitWalk<T::S> sum;                            // the unit being added
    const int steps = (n_units + NW - 1) / NW;
    for (int s = 0; s < steps; ++s) {
        const int buf = s & 1;
        // decode and stage the next step's unit into the other buffers: their readers (step s - 1) passed the
        // last barrier
#pragma unroll
        for (int j = 0; j < NW; ++j) dec.next(n_units);
        if ((s + 1) * NW + warp < n_units)
            decode_and_stage<T, TOK>(wr, k, dec.u, tab, su[buf ^ 1][warp], xt, xdt, tok0, n_tok,
                                     xw + ((buf ^ 1) * NW + warp) * XBUF, xs + ((buf ^ 1) * NW + warp) * TOK);
        const int nu = min(NW, n_units - s * NW);
        for (int j = 0; j < nu; ++j) {
            unit_mma<T, NB>(su[buf][j], StagedX<T>{xw + (buf * NW + j) * XBUF + tw * Staged<T>::XSTRIDE}, g, t, ci);
            if (sum.block_ends()) {
                const float* xsw = xs + (buf * NW + j) * TOK + tw;
                block_tail<T, NB>(su[buf][j], [xsw](int c) { return xsw[c]; }, g, t, ci, ch);
                if (sum.group_ends(n_units)) {     // the group ends: add it to the outputs' running sums
#pragma unroll
                    for (int o = 0; o < NO; ++o) {
                        tot[o] = __fadd_rn(tot[o], ch[o]);
                        ch[o] = 0.0f;
                    }
                }
            }
            sum.next(n_units);
        }
        cp_async_wait();
        __syncthreads();
    }
    store_outputs<NB, GLU>(o, tot, tok0 + tw, n_tok, r0, n_out, g, t);
}

// Small token counts (decode steps of 9-63 sequences, verify steps): mmq's CTAs share decoded units among token
// tiles, so with one tile most of their warps multiply padding, and each warp keeps one unit's loads in flight.
// Here a CTA takes 32 rows (GLU: 16 gate and their 16 up rows) by 16 tokens, and its NK warps split the row's
// groups (UnitWalk) instead: in round rnd warp w walks group gi = rnd * NK + w, decoding G units at a time
// into its own shared slots (lane r: row r) and multiplying them with the tokens' activations read straight
// from the chunk-major copy (ChunkX; no staging, no barrier per unit). Each group's sum is left in part[w];
// after a round warp 0 adds the NK groups' sums to the outputs' running sums in group order, so every output
// gets the bits of mmq and the dp4a kernels. Where the type splits its loads from their decoding (Fetch), the
// next G units' loads (at a round's end: the next round's first) are issued before this G's products: on an
// H200 (2026-12-04, 16 tokens) Q4_K 14336x4096 55.8 -> 50.8 us, gate+up 4096x2x14336 94.1 -> 90.2, 4096x4096
// 22.5 -> 21.4. xt (k / 16, n_tok, 16) int8 and xdt (k / XB, n_tok) f32: act_tiles'
// copy of the activations and scales; grid (cdiv(n_tok, 16), cdiv(n_out, 32)) (GLU: cdiv(n_out / 2, 16)),
// block (32, NK).
template <class T, int NK, int G, bool GLU>
__device__ __forceinline__ void mmqs(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                     const i8* __restrict__ xt, const float* __restrict__ xdt, int n_tok,
                                     const Out& o, const u32* tab, typename T::U (*su)[G][32], float (*part)[16][32]) {
    constexpr int NB = 2, NO = 2 * NB * 4, S = T::S, NG = 32 / S;
    static_assert(NG % NK == 0, "whole rounds of groups");
    const int lane = threadIdx.x, warp = threadIdx.y, g = lane >> 2, t = lane & 3, half = n_out / 2;
    const int r0 = blockIdx.y * (GLU ? 16 : 32), tok0 = blockIdx.x * 8 * NB, last = n_tok - 1;
    const int my_row = GLU ? min(r0 + (lane & 15), half - 1) + (lane < 16 ? 0 : half) : min(r0 + lane, n_out - 1);
    const u8* wr = W + (size_t)my_row * row_bytes;
    const int n_units = k / T::UNIT;
    float tot[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) tot[i] = 0.0f;
    // the units of group gi in walk order: m -> unit 32 (m / S) + S gi + m % S, for m < m_end(gi)
    auto m_end_of = [n_units](int gi) { return (n_units / 32) * S + max(0, min(S, n_units % 32 - S * gi)); };
    auto unit = [](int gi, int m) { return 32 * (m / S) + S * gi + m % S; };
    // the next G units' loads are issued before this G's products (fetched: G raw units, those of group gi from m)
    typedef Fetch<T> F;
    typename F::R fetched[G];
    auto fetch = [&](int gi, int m, int m_end) {
#pragma unroll
        for (int j = 0; j < G; ++j) F::fetch(wr, k, unit(gi, min(m + j, m_end - 1)), tab, fetched[j]);
    };
    auto fetch_first = [&](int gi) {               // a group's first units (none past the row)
        const int m_end = m_end_of(gi);
        if (m_end > 0) fetch(gi, 0, m_end);
    };
    fetch_first(warp);
    for (int rnd = 0; rnd < NG / NK; ++rnd) {
        const int gi = rnd * NK + warp, m_end = m_end_of(gi);
        typename T::I ci[NO];
        float ch[NO];
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            ci[i] = typename T::I();
            ch[i] = 0.0f;
        }
        for (int m0 = 0; m0 < m_end; m0 += G) {
#pragma unroll
            for (int j = 0; j < G; ++j)
                if (m0 + j < m_end) {
                    typename T::U v;
                    F::unpack(fetched[j], wr, k, unit(gi, m0 + j), tab, v);
                    su[warp][j][lane] = v;
                }
            if (m0 + G < m_end)                    // the same for the whole warp
                fetch(gi, m0 + G, m_end);
            else if (rnd + 1 < NG / NK)
                fetch_first(gi + NK);
            __syncwarp();
#pragma unroll
            for (int j = 0; j < G; ++j)
                if (m0 + j < m_end) {
                    const int u = unit(gi, m0 + j);
                    unit_mma<T, NB>(su[warp][j], ChunkX<T>{xt, n_tok, last, tok0, u}, g, t, ci);
                    if ((u + 1) % S == 0) {
                        const float* xs = xdt + (size_t)(u / T::UPX) * n_tok;
                        block_tail<T, NB>(su[warp][j], [xs, tok0, last](int c) { return __ldg(xs + min(tok0 + c, last)); },
                                          g, t, ci, ch);
                    }
                }
            __syncwarp();
        }
#pragma unroll
        for (int i = 0; i < NO; ++i) part[warp][i][lane] = ch[i];
        __syncthreads();
        if (warp == 0)                             // the round's groups in order; empty ones (past the row) skipped
            for (int w = 0; w < NK; ++w)
                if (S * (rnd * NK + w) < n_units)
#pragma unroll
                    for (int i = 0; i < NO; ++i) tot[i] = __fadd_rn(tot[i], part[w][i][lane]);
        __syncthreads();
    }
    if (warp == 0) store_outputs<NB, GLU>(o, tot, tok0, n_tok, r0, n_out, g, t);
}

// kernels mmq[glu]_<type>_w<NW>_n<NB>: NW warps per CTA, NB n8 token tiles per warp (qmatmul.py MMA_VARIANTS);
// MINB: CTAs per SM the register allocation must allow (0: the compiler's choice). For the types with
// superblock sums of 8 units (IQ3_XXS, Q6_K) 4 x 4 takes 3, the CTAs its shared memory allows: the compiler then
// keeps more products in flight (IQ3_XXS 4096 x 14336 at 512 tokens 435 -> 381-384 us on an H200; Q4_K and Q8_0
// measured 1.6-2.4% slower with it, Q4_K with block sums 495 -> 525 us: 168 registers and
// spills); IQ3_XXS's 2 x 4 takes 8 (128 registers instead of 149: 128 tokens 175 -> 134 us, 64 tokens 89 -> 96;
// perf/kernel_notes.md)
#define MMQ_KERNEL(NAME, T, NW, NB, GLU, PREFIX, MINB, SUFFIX)                                            \
    extern "C" __global__ void __launch_bounds__(32 * NW, MINB) PREFIX##_##NAME##_w##NW##_n##NB##SUFFIX( \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xt,             \
        const float* __restrict__ xdt, int n_tok, OUT_PARAMS) {                                           \
        GRID_SMEM(T);                                                                                     \
        __shared__ T::U su[2][NW][32];                                                                    \
        extern __shared__ __align__(16) u32 staged[];                                                     \
        load_grid<T>(grid);                                                                               \
        grid_dependency_sync();                                                                           \
        mmq<T, NW, NB, GLU>(W, row_bytes, n_out, k, xt, xdt, n_tok, OUT_ARGS, grid, su, staged,           \
                            (float*)(staged + 2 * NW * (NW * 8 * NB) * Staged<T>::XSTRIDE));              \
    }
#define MMQ_VARIANT(NAME, T, NW, NB, MINB) MMQ_KERNEL(NAME, T, NW, NB, false, mmq, MINB, ) \
    MMQ_KERNEL(NAME, T, NW, NB, true, mmqglu, MINB, )
// the variants the launcher takes (qmatmul.py MMA_VARIANTS), with their MINB
#define MMQ_DEFAULT(NAME, T) MMQ_VARIANT(NAME, T, 4, 1, 0) MMQ_VARIANT(NAME, T, 2, 4, (T::GRID ? 8 : 0)) \
    MMQ_VARIANT(NAME, T, 4, 4, (T::S > 1 && T::MMA != MMA_K4 ? 3 : 0))
// kernels mmqs[glu]_<type>_w<NK> (qmatmul.py small_variant): NK warps per CTA, each decoding G units at a
// time, G as many as fit 24 KB of unit slots per CTA (at most 4). Built for Q4_K, Q5_K and Q8_0: on an H200
// the other types measured slower than their dp4a kernels at 9-16 tokens (perf/kernel_notes.md)
template <class T, int NK>
struct SmallG {
    static constexpr int FIT = 24576 / (NK * 32 * (int)sizeof(typename T::U));
    static constexpr int G = FIT < 1 ? 1 : FIT > 4 ? 4 : FIT;
};
#define MMQS_KERNEL(NAME, T, NK, GLU, PREFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * NK) PREFIX##_##NAME##_w##NK(                          \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xt,              \
        const float* __restrict__ xdt, int n_tok, OUT_PARAMS) {                                            \
        constexpr int G = SmallG<T, NK>::G;                                                                \
        GRID_SMEM(T);                                                                                      \
        __shared__ T::U su[NK][G][32];                                                                     \
        __shared__ float part[NK][16][32];                                                                 \
        load_grid<T>(grid);                                                                                \
        grid_dependency_sync();                                                                            \
        mmqs<T, NK, G, GLU>(W, row_bytes, n_out, k, xt, xdt, n_tok, OUT_ARGS, grid, su, part);              \
    }
#define MMQS_KERNELS(NAME, T) MMQS_KERNEL(NAME, T, 4, false, mmqs) MMQS_KERNEL(NAME, T, 4, true, mmqsglu) \
    MMQS_KERNEL(NAME, T, 8, false, mmqs) MMQS_KERNEL(NAME, T, 8, true, mmqsglu)
// The 64-token candidates (qmatmul.py MMA_64_CANDIDATES), plain and GLU: the 2 x 4 variant under a minimum of 6
// CTAs an SM (_m6; sm_90: IQ3_XXS 161-162 registers where its default 2 x 4 takes 128 under 8; Q4_K / Q5_K with block
// sums 211 -> 168 registers and 216 bytes spilled) and the 4 x 2 variant (64 tokens a CTA in 4 warps).
#define MMQ_M6(NAME, T) MMQ_KERNEL(NAME, T, 2, 4, false, mmq, 6, _m6) MMQ_KERNEL(NAME, T, 2, 4, true, mmqglu, 6, _m6)
#define MMQ_W4N2(NAME, T) MMQ_VARIANT(NAME, T, 4, 2, 0)
#ifdef MMQ_EXPLORE   // perf/bench_gpu.py --gemm-explore: candidates beside the default kernels, every type
#define MMQ_KERNELS(NAME, T) MMQ_DEFAULT(NAME, T) MMQ_M6(NAME, T) MMQ_W4N2(NAME, T) \
    MMQ_KERNEL(NAME, T, 2, 2, false, mmq, 0, ) MMQ_KERNEL(NAME, T, 8, 2, false, mmq, 0, )
#define MMQ_64(NAME, T, WHICH)
#else
#define MMQ_KERNELS(NAME, T) MMQ_DEFAULT(NAME, T)
#define MMQ_64(NAME, T, WHICH) WHICH(NAME, T)     // the types MMA_64_CANDIDATES names, in every build
#endif


MMQ_KERNELS(q8_0, TQ8_0)
MMQS_KERNELS(q8_0, TQ8_0)
MMQ_KERNELS(q4_0, TQ4_0)
MMQ_KERNELS(q5_0, TQ5_0)
MMQ_KERNELS(iq4_nl, TIQ4_NL)
MMQ_KERNELS(q4_k, TQ4_K)
MMQ_64(q4_k, TQ4_K, MMQ_W4N2)
MMQS_KERNELS(q4_k, TQ4_K)
MMQ_KERNELS(q5_k, TQ5_K)
MMQ_64(q5_k, TQ5_K, MMQ_W4N2)
MMQS_KERNELS(q5_k, TQ5_K)
MMQ_KERNELS(q6_k, TQ6_K)
MMQ_KERNELS(iq3_xxs, TIQ3_XXS)
MMQ_64(iq3_xxs, TIQ3_XXS, MMQ_M6)
#ifdef MMQ_EXPLORE   // the small-token kernel for types the launcher leaves on dp4a at 9-63 tokens (bench_gpu.py
                     // --explore; qmatmul.py SMALL_EXPLORE_WARPS): 4 warps for the 4-group superblock types
MMQS_KERNEL(q6_k, TQ6_K, 4, false, mmqs) MMQS_KERNEL(q6_k, TQ6_K, 4, true, mmqsglu)
MMQS_KERNEL(iq3_xxs, TIQ3_XXS, 4, false, mmqs) MMQS_KERNEL(iq3_xxs, TIQ3_XXS, 4, true, mmqsglu)
#endif
