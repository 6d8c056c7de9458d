// Quantized mat-mul y = x @ W.T over raw GGUF blocks, the activation quantizers that feed it (ggml's
// Q8_0 / Q8_K rounding, bit-exact with kernels/cpu/act_quant.py) and the row dequantizer (embedding
// lookup, bit-exact with gguf.quants.dequantize).
//
// Work split of the mat-mul: one warp per RW output rows (RW consecutive rows, or for GLU kernels gate row
// i and up row i + n_out / 2), blockDim.y warps per CTA, TILE tokens per CTA along grid.y. A row is cut
// into "units" (32 weights; 64 for Q4_K/Q5_K, 8 for float weights); lane l takes units l, l+32, ... and
// decodes each unit once for the whole token tile; G units per lane are loaded before their arithmetic,
// so G * RW weight loads per lane are in flight at once, and each activation load serves RW rows. Per
// token, the unit's int8 weights are dotted with the int8 activations by __dp4a; the integer parts of a
// superblock's units (IQ3_XXS and Q6_K: the 8 units of a 256-weight block, which lie in 8 consecutive lanes;
// one unit for the other types: qmatmul_types.cuh) are summed by shuffles and scaled in float once, with
// explicit __fmul_rn/__fmaf_rn (no contraction choices left to the compiler), into the running sum of the
// lane group; and the groups' sums are added left to right (lane_fold, common.cuh, for one-unit groups;
// store_groups otherwise). So every output's arithmetic depends only on its
// row and its token, never on TILE, RW, G, the token's slot in the tile, or what else shares the launch
// (batch invariance). The output goes through Out (qmatmul_types.cuh): bias, residual add, split, GLU.
#include "qmatmul_types.cuh"
#include "act_quant.cuh"

// --------------------------------------------------------------------------------------- mat-mul
// Rows of warp w: RW consecutive rows from w * RW, or (GLU) RW / 2 consecutive gate rows i = w * RW / 2 ..
// and their up rows i + n_out / 2 ... -> false when the warp has none (whole warps leave: each warp folds its
// own lanes). Gate rows past the last (n_out / 2 odd) read up rows; their outputs are not stored.
template <int RW, bool GLU>
__device__ __forceinline__ bool warp_rows(int n_out, int* rows) {
    const int w = blockIdx.x * blockDim.y + threadIdx.y;
    if constexpr (GLU) {
        static_assert(RW % 2 == 0, "a GLU warp takes gate rows and their up rows");
        constexpr int P = RW / 2;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            rows[p] = w * P + p;
            rows[P + p] = w * P + p + n_out / 2;
        }
        return rows[0] < n_out / 2;
    } else {
#pragma unroll
        for (int r = 0; r < RW; ++r) rows[r] = w * RW + r;
        return rows[0] < n_out;
    }
}

constexpr int MM_WARPS = 8;                        // warps per CTA at most (__launch_bounds__(256); qmatmul.py WARPS_PER_CTA)

// The fold's output: lane t < nt writes token t0 + t's outputs from res (value t * RW + r: row rows[r]).
template <int RW, bool GLU>
__device__ __forceinline__ void put_rows(const Out& o, const int* rows, int n_out, int t0, int nt, const float* res) {
    const int t = threadIdx.x;
    if (t >= nt) return;
    const float* s = res + t * RW;
    if constexpr (GLU) {
#pragma unroll
        for (int p = 0; p < RW / 2; ++p)
            if (rows[p] < n_out / 2) o.glu(t0 + t, rows[p], n_out / 2, s[p], s[RW / 2 + p]);
    } else {
#pragma unroll
        for (int r = 0; r < RW; ++r)
            if (rows[r] < n_out) o.put(t0 + t, rows[r], n_out, s[r]);
    }
}

// One-unit superblocks: each lane holds its units' partial sums acc[r][t] of row rows[r] and token t0 + t; the
// lanes' partials of an output are added in lane order (lane_fold over the lanes that had units).
template <int RW, int TILE, bool GLU>
__device__ __forceinline__ void store_rows(const Out& o, const int* rows, int n_out, int n_units, int t0, int nt,
                                           float (&acc)[RW][TILE]) {
    constexpr int NV = RW * TILE;
    __shared__ __align__(16) float fold_buf[MM_WARPS][fold_words(NV)];
    __shared__ float fold_res[MM_WARPS][NV];
    float v[NV];
#pragma unroll
    for (int t = 0; t < TILE; ++t)
#pragma unroll
        for (int r = 0; r < RW; ++r) v[t * RW + r] = acc[r][t];
    lane_fold<NV>(v, min(WARP, n_units), fold_buf[threadIdx.y], fold_res[threadIdx.y]);
    put_rows<RW, GLU>(o, rows, n_out, t0, nt, fold_res[threadIdx.y]);
}

// Reduce-scatter of NV integer parts over the S lanes of a group (S and NV powers of two): halving steps, each
// lane keeping the half its position bit names and adding its partner's copy of it. On return the lane at
// position p = lane % S holds in v[0 .. OWN) the group's sums of the values p * NV / S, p * NV / S + 1, ...,
// OWN = max(NV / S, 1) (for NV < S, the S / NV lanes sharing a value all hold it). Every lane calls it.
template <int S, int NV, class I>
__device__ __forceinline__ void group_scatter(I* v) {
    if constexpr (S > 1) {
        const int lane = threadIdx.x;
        int len = NV;
#pragma unroll
        for (int m = S / 2; m >= 1; m /= 2) {
            if (len > 1) {
                const bool up = lane & m;
                len /= 2;
#pragma unroll
                for (int i = 0; i < NV / 2; ++i)
                    if (i < len) {
                        const I send = up ? v[i] : v[i + len], keep = up ? v[i + len] : v[i];
                        v[i] = keep + shfl_xor(send, m);
                    }
            } else {
                v[0] += shfl_xor(v[0], m);
            }
        }
    }
}

// Superblocks of S > 1 units: after group_scatter the lane at position p of group gi owns OWN of the warp's NV
// values (acc[o]: value p * NV / S + o; for NV < S only the value's first lane adds); the output of value v
// is ((0 + group 0's sum) + group 1's) + ..., the groups' sums passed through shared memory.
// After each value's owners wrote part[v][gi] (group gi's sum of value v = t * RW + r): value v's output is
// ((0 + part[v][0]) + part[v][1]) + ..., through res (this warp's NV floats of shared memory), then put_rows.
template <int NV, int NG, int RW, bool GLU>
__device__ __forceinline__ void fold_groups(const Out& o, const int* rows, int n_out, int t0, int nt,
                                            const float (*part)[NG], float* res) {
    const int lane = threadIdx.x;
    __syncwarp();
    if (lane < NV) {
        float s = 0.0f;
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) s = __fadd_rn(s, part[lane][gi]);
        res[lane] = s;
    }
    __syncwarp();
    put_rows<RW, GLU>(o, rows, n_out, t0, nt, res);
}

template <int S, int RW, int TILE, bool GLU>
__device__ __forceinline__ void store_groups(const Out& o, const int* rows, int n_out, int t0, int nt,
                                             const float* acc) {
    constexpr int NV = RW * TILE, OWN = NV >= S ? NV / S : 1, NG = WARP / S;
    __shared__ float group_part[MM_WARPS][NV][NG];
    __shared__ float fold_res[MM_WARPS][NV];
    const int lane = threadIdx.x, p = lane % S, w = threadIdx.y;
    if (p * NV % S == 0)
#pragma unroll
        for (int i = 0; i < OWN; ++i) group_part[w][p * NV / S + i][lane / S] = acc[i];
    fold_groups<NV, NG, RW, GLU>(o, rows, n_out, t0, nt, group_part[w], fold_res[w]);
}

// One token's step after group_scatter<S, RW>(iv) for the lane at position p of its group: acc[i] += the float
// tail of row p * RW / S + i's integer part iv[i] (its scales from v, the decoded units of the warp's RW rows; xs
// the activations' scale), for the OWN values the lane owns; only where adds (the lane's unit is in the row and
// it is its value's first owner).
template <class T, int S, int RW>
__device__ __forceinline__ void add_owned_tails(const typename T::U* v, const typename T::I* iv, int p, float xs,
                                                bool adds, float* acc) {
    constexpr int OWN = RW >= S ? RW / S : 1;
#pragma unroll
    for (int i = 0; i < OWN; ++i) {
        const int r = p * RW / S + i;
        typename T::U q = v[0];                    // row r's scales (tail reads no weights)
#pragma unroll
        for (int rr = 1; rr < RW; ++rr)
            if (r == rr) q = v[rr];
        float a, b;
        T::tail(q, iv[i], xs, a, b);
        if (adds) acc[i] = __fmaf_rn(a, b, acc[i]);
    }
}

// One token a warp's rows, lane l taking units l, l + 32, ... as mm_q does with TILE = G = 1 (kernels
// mm[glu]_<type>_t1_r<RW>_g<p|s>). PIPE (G = "p"): the loads of the lane's unit of round j + 1 (Fetch: the raw
// words, for the types that split them from their decoding) are issued before round j's products, so a warp
// waits on one round's loads at a time instead of each round's in turn; G = "s": the same loop without that.
// Each output's arithmetic is mm_q's (TILE 1, G 1) in the same order: the same bits. Token blockIdx.y, as
// mm_q's grid of one-token tiles.
template <class T, int RW, bool GLU, bool PIPE>
__device__ __forceinline__ void mm_q1(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                      const i8* __restrict__ xq, const float* __restrict__ xd, const Out& o,
                                      const u32* tab) {
    const int lane = threadIdx.x, t0 = blockIdx.y;
    int rows[RW];
    if (!warp_rows<RW, GLU>(n_out, rows)) return;
    const u8* wr[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) wr[r] = W + (size_t)min(rows[r], n_out - 1) * row_bytes;
    const int n_units = k / T::UNIT;
    xq += (size_t)t0 * k;
    xd += (size_t)t0 * (k / T::XB);
    constexpr int S = T::S, UPX = T::UPX, OWN = RW >= S ? RW / S : 1;
    typedef Fetch<T, PIPE && HasFetch<T>::value> F;
    typename F::R cur[RW], nxt[RW];
    if (lane < n_units)
#pragma unroll
        for (int r = 0; r < RW; ++r) F::fetch(wr[r], k, lane, tab, cur[r]);
    float acc[S == 1 ? RW : OWN];
#pragma unroll
    for (int i = 0; i < (S == 1 ? RW : OWN); ++i) acc[i] = 0.0f;
    for (int ub = 0; ub < n_units; ub += WARP) {
        const int u = ub + lane;
        if (u + WARP < n_units)                    // round j + 1's loads first
#pragma unroll
            for (int r = 0; r < RW; ++r) F::fetch(wr[r], k, u + WARP, tab, nxt[r]);
        if constexpr (S == 1) {
            if (u < n_units) {
                i32 x[T::NW];
                T::xload(xq, u, x);
                const float s = __ldg(xd + u / UPX);
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    typename T::U v;
                    F::unpack(cur[r], wr[r], k, u, tab, v);
                    float a, b;
                    T::tail(v, T::ints(v, x), s, a, b);
                    acc[r] = __fmaf_rn(a, b, acc[r]);
                }
            }
        } else {                                   // every lane takes part in the group's shuffles
            const int uc = min(u, n_units - 1), p = lane % S;
            const bool adds = u < n_units && p * RW % S == 0;
            typename T::U v[RW];
            typename T::I iv[RW];
            i32 x[T::NW];
            T::xload(xq, uc, x);
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                F::unpack(cur[r], wr[r], k, uc, tab, v[r]);
                iv[r] = T::ints(v[r], x);
            }
            group_scatter<S, RW>(iv);
            add_owned_tails<T, S, RW>(v, iv, p, __ldg(xd + uc / UPX), adds, acc);
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) cur[r] = nxt[r];
    }
    if constexpr (S == 1) {
        float acc1[RW][1];
#pragma unroll
        for (int r = 0; r < RW; ++r) acc1[r][0] = acc[r];
        store_rows<RW, 1, GLU>(o, rows, n_out, n_units, t0, 1, acc1);
    } else {
        store_groups<S, RW, 1, GLU>(o, rows, n_out, t0, 1, acc);
    }
}

// After per-token folds (mm_q_tok, mm_q_iq3): the lane at position p of group gi holds acc[t * OWN + i], group gi's
// sum of row p * RW / S + i for token t0 + t (OWN = max(RW / S, 1)); the groups' sums are added left to right, as
// store_groups adds them (fold_groups), and put_rows writes tokens t < nt.
template <int S, int TILE, int RW, bool GLU>
__device__ __forceinline__ void store_tok_groups(const Out& o, const int* rows, int n_out, int t0, int nt,
                                                 const float* acc) {
    constexpr int OWN = RW >= S ? RW / S : 1, NV = RW * TILE, NG = WARP / S;
    __shared__ float group_part[MM_WARPS][NV][NG];
    __shared__ float fold_res[MM_WARPS][NV];
    const int lane = threadIdx.x, p = lane % S, w = threadIdx.y;
    if (p * RW % S == 0)
#pragma unroll
        for (int t = 0; t < TILE; ++t)
#pragma unroll
            for (int i = 0; i < OWN; ++i) group_part[w][t * RW + p * RW / S + i][lane / S] = acc[t * OWN + i];
    fold_groups<NV, NG, RW, GLU>(o, rows, n_out, t0, nt, group_part[w], fold_res[w]);
}

// The byte masks of IQ3_XXS sign group l (weights 8l .. 8l + 7) of a sub-block's sign-and-scale word: byte j of
// m0 (m1) is 0xff where weight 8l + j (8l + 4 + j) is negative. One multiply each puts sign bit i at the top of
// byte i (7-bit inputs make no carries) for prmt's sign-replicating mode; the eighth sign, the parity of the
// seven (ksigns_iq2xs), is added at bit 31 of the second.
__device__ __forceinline__ void iq3_masks(u32 aux, int l, u32& m0, u32& m1) {
    const u32 sg = (aux >> (7 * l)) & 127u;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(m0) : "r"(sg * 0x10204080u), "r"(0u), "r"(0xba98u));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(m1) : "r"(sg * 0x00020408u + ((u32)__popc(sg) << 31)), "r"(0u),
        "r"(0xba98u));
}
// The grid words of sign group l's weights 8l .. 8l + 3 (g0) and 8l + 4 .. 8l + 7 (g1), from the sub-block's 8
// grid indices q
__device__ __forceinline__ void iq3_grid(uint2 q, int l, const u32* grid, u32& g0, u32& g1) {
    const u32 qq = (l < 2 ? q.x : q.y) >> (16 * (l & 1));
    g0 = grid[qq & 0xffu];
    g1 = grid[(qq >> 8) & 0xffu];
}
// The integer dot of one IQ3_XXS sub-block (32 weights: grid indices q, sign-and-scale word aux) with its 32
// activations x, before its scale: sum of grid * sign * x, the value TIQ3_XXS::decode + dot8w give. The signs go
// in by a second dp4a against the byte masks: for a negative weight (g ^ 0xff) + 1 = -g (0 < g < 128), so the sum
// is dp4a(g ^ m, x) - dp4a(m, x) (m's 0xff bytes are -1). One token: 20 instructions a sign group.
__device__ __forceinline__ i32 iq3_dot(uint2 q, u32 aux, const i32* x, const u32* grid) {
    i32 s = 0, t = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        u32 m0, m1, g0, g1;
        iq3_masks(aux, l, m0, m1);
        iq3_grid(q, l, grid, g0, g1);
        s = __dp4a((i32)(g0 ^ m0), x[2 * l], s);
        s = __dp4a((i32)(g1 ^ m1), x[2 * l + 1], s);
        t = __dp4a((i32)m0, x[2 * l], t);
        t = __dp4a((i32)m1, x[2 * l + 1], t);
    }
    return s - t;
}
// The same sub-block's signed weights (TIQ3_XXS::decode's w), for kernels that dot them with several tokens
__device__ __forceinline__ void iq3_weights(uint2 q, u32 aux, const u32* grid, u32* w) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        u32 m0, m1, g0, g1;
        iq3_masks(aux, l, m0, m1);
        iq3_grid(q, l, grid, g0, g1);
        w[2 * l] = (g0 ^ m0) + (m0 & 0x01010101u);
        w[2 * l + 1] = (g1 ^ m1) + (m1 & 0x01010101u);
    }
}

// One sub-block of RW rows (unit u, block b of its row) against every token of the tile: its RW integer parts
// (RAW: from the raw fields q, aux by iq3_dot, one token; else from the decoded weights v), reduce-scattered over
// the block's lanes, and the lane's owned float tails added to acc + t * OWN where adds (mm_q_iq3).
template <int TILE, int RW, bool RAW>
__device__ __forceinline__ void iq3_tokens(const TIQ3_XXS::U* v, const uint2* q, const u32* aux, const u32* grid,
                                           const i8* xq, const float* xd, int k, int t0, int nt, int u, int b,
                                           int p, bool adds, float* acc) {
    typedef TIQ3_XXS T;
    constexpr int S = T::S, OWN = RW >= S ? RW / S : 1;
#pragma unroll
    for (int t = 0; t < TILE; ++t) {
        const int tt = t0 + min(t, nt - 1);
        i32 x[T::NW], iv[RW];
        T::xload(xq + (size_t)tt * k, u, x);
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            if constexpr (RAW)
                iv[r] = v[r].ls * iq3_dot(q[r], aux[r], x, grid);
            else
                iv[r] = T::ints(v[r], x);
        }
        group_scatter<S, RW>(iv);
        add_owned_tails<T, S, RW>(v, iv, p, __ldg(xd + (size_t)tt * (k >> 8) + b), adds, acc + t * OWN);
    }
}

// IQ3_XXS, TILE tokens: mm_q1's (one token) and mm_q_tok's (per-token folds) work split and arithmetic (the same
// bits: each block's integer part exact, its float tail in the same lane and order), with the loop written for
// the device layout's full groups of 8 blocks (kernels/cuda/layouts.py, 784 bytes: grid indices 8 x 64 |
// sign-and-scale words 8 x 32 | d's 8 x 2). Round h of group g holds units 64g + 32h + lane, i.e. blocks 8g + 4h
// + lane / 8, sub-block lane % 8: the lane's fields lie at fixed offsets from the group (8 lane + 256 h, 512 + 4
// lane + 128 h, 768 + 2 (lane / 8) + 8 h), so a group costs one pointer step a row instead of the per-unit group /
// block / plane arithmetic of TIQ3_XXS::decode (~55 instructions a row pair, perf/kernel_notes.md). One token
// dots each sub-block by iq3_dot; more tokens decode it once (iq3_weights) and dot it with each. A row's last
// group of fewer than 8 blocks (k not a multiple of 2048) goes through TIQ3_XXS::decode.
// Kernels mm[glu]_iq3_xxs_t<TILE>_r<RW>_gw[_m<MB>] (qmatmul.py IQ3_GROUPS_CHOICES picks them per token tile and
// grid; kernel_notes.md, "IQ3_XXS group loop under launch bounds"). A group's two rounds are unrolled at one token
// (both rounds' loads in flight; sm_90: 78 registers for two rows, 109 for two GLU pairs; not unrolled, 64 / 71
// registers measured 14336x4096 16.7 against 14.5 us); tiles of more tokens never unroll them (unrolled, the
// 8-token four-row tile took 136 registers). More registers than mm_q1's / mm_q's loops (56 / 63 / 100 for the
// two-row, two-pair and 8-token kernels), so fewer CTAs an SM: unbounded, the loop wins where the grid fits one
// wave (H200 14336x4096 one token 17.5 -> 13.8 us) and loses on several waves (4096x14336 at 8 tokens 29.2 ->
// 37.2); under a minimum of 4 CTAs an SM (one token, _m4 in every build: 64 registers, no spill) it wins on those
// too (4096x14336 17.0 -> 15.3, gate+up pairs 26.2 -> 22.6). The explore build also has the 8-token ones under a
// minimum of 2 (_m2: 128 registers).
template <int TILE, int RW, bool GLU>
__device__ __forceinline__ void mm_q_iq3(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                         const i8* __restrict__ xq, const float* __restrict__ xd, int n_tok,
                                         const Out& o, const u32* grid) {
    typedef TIQ3_XXS T;
    constexpr int S = T::S, OWN = RW >= S ? RW / S : 1;
    const int lane = threadIdx.x, t0 = blockIdx.y * TILE, nt = min(TILE, n_tok - t0), p = lane % S;
    int rows[RW];
    if (!warp_rows<RW, GLU>(n_out, rows)) return;
    const int nb = k >> 8, n_full = nb >> 3, n_units = k / T::UNIT;
    const bool owner = p * RW % S == 0;
    const u8* f[RW];                               // the lane's grid indices in group g, round 0
#pragma unroll
    for (int r = 0; r < RW; ++r) f[r] = W + (size_t)min(rows[r], n_out - 1) * row_bytes + 8 * lane;
    const int aux_off = 512 - 4 * lane, d_off = 768 + 2 * (lane >> 3) - 8 * lane;   // from f
    float acc[TILE * OWN];
#pragma unroll
    for (int i = 0; i < TILE * OWN; ++i) acc[i] = 0.0f;
    constexpr int ROUNDS_UNROLL = TILE == 1 ? 2 : 1;   // more tokens: not unrolled (registers)
    for (int g = 0; g < n_full; ++g) {
#pragma unroll ROUNDS_UNROLL
        for (int h = 0; h < 2; ++h) {
            const int u = 64 * g + 32 * h + lane, b = 8 * g + 4 * h + (lane >> 3);
            T::U v[RW];
            uint2 q[RW];
            u32 aux[RW];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                q[r] = __ldg((const uint2*)(f[r] + 256 * h));
                aux[r] = ldw((const unsigned int*)(f[r] + aux_off + 128 * h));
                v[r].d4 = __fmul_rn(ldf16(f[r] + d_off + 8 * h), 0.25f);
                v[r].ls = 2 * (i32)(aux[r] >> 28) + 1;
                if constexpr (TILE > 1) iq3_weights(q[r], aux[r], grid, v[r].w);
            }
            iq3_tokens<TILE, RW, TILE == 1>(v, q, aux, grid, xq, xd, k, t0, nt, u, b, p, owner, acc);
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) f[r] += 784;
    }
    for (int ub = 64 * n_full; ub < n_units; ub += WARP) {   // the last group, r < 8 blocks
        const int u = ub + lane, uc = min(u, n_units - 1);
        const bool adds = u < n_units && owner;
        T::U v[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) T::decode(f[r] - 784 * n_full - 8 * lane, k, uc, grid, v[r]);
        iq3_tokens<TILE, RW, false>(v, nullptr, nullptr, grid, xq, xd, k, t0, nt, uc, uc / T::UPX, p, adds, acc);
    }
    store_tok_groups<S, TILE, RW, GLU>(o, rows, n_out, t0, nt, acc);
}

// W (n_out, row_bytes) u8 rows of blocks; xq (n_tok, k) int8 with 16-byte aligned rows; xd (n_tok, k / XB)
// f32. grid (cdiv(warps, blockDim.y), cdiv(n_tok, TILE)), block (32, warps per CTA).
// One token and G = 1 with S > 1 goes through mm_q1's loop instead, which measured faster on an H200
// (2026-12-05, kernel_notes.md, us): IQ3_XXS 4096x14336 17.7 -> 17.0, 14336x4096 19.3 -> 17.7, Q6_K 4096x14336
// 17.1 -> 15.6, 14336x4096 19.6 -> 17.3, 4096x32000 32.4 -> 30.5; Q4_K (block sums) 4096x14336 14.3 -> 11.4,
// gate+up one pair 23.0 -> 20.4. IQ3_XXS's GLU kernel of two pairs lost at 40 registers (H200 28.4 -> 32.8)
// and gained under a minimum of one CTA an SM (59 registers; H100 29.6 -> 26.9), which its kernel now asks for.
// The build "mmq_one_token" (-DQMM_MMQ_ONE_TOKEN) keeps this loop everywhere, for A/B runs.
// S > 1: every lane runs every round and dots every token slot of the tile (past the tile's last token, the
// last token again: the shuffles take the whole warp); lanes past the row's last unit decode nothing and add
// nothing (rows hold whole superblocks, so whole groups are past it). A unit's NV integer parts are
// reduce-scattered over its group, and each lane adds the float tails of the values it owns.
template <class T, int TILE, int RW, int G, bool GLU>
__device__ __forceinline__ void mm_q(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                     const i8* __restrict__ xq, const float* __restrict__ xd, int n_tok,
                                     const Out& o, const u32* tab) {
#ifndef QMM_MMQ_ONE_TOKEN
    if constexpr (TILE == 1 && G == 1 && T::S > 1) {   // mm_q1's loop (same bits)
        mm_q1<T, RW, GLU, false>(W, row_bytes, n_out, k, xq, xd, o, tab);
        return;
    }
#endif
    const int lane = threadIdx.x, t0 = blockIdx.y * TILE, nt = min(TILE, n_tok - t0);
    int rows[RW];
    if (!warp_rows<RW, GLU>(n_out, rows)) return;
    const u8* wr[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) wr[r] = W + (size_t)min(rows[r], n_out - 1) * row_bytes;
    const int n_units = k / T::UNIT, n_xd = k / T::XB;
    constexpr int S = T::S, UPX = T::UPX;
    if constexpr (S == 1) {
        float acc[RW][TILE];
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int t = 0; t < TILE; ++t) acc[r][t] = 0.0f;
        for (int ub = lane; ub < n_units; ub += WARP * G) {
            typename T::U v[G][RW];
#pragma unroll
            for (int g = 0; g < G; ++g)            // all weight loads first
#pragma unroll
                for (int r = 0; r < RW; ++r)
                    if (ub + WARP * g < n_units) T::decode(wr[r], k, ub + WARP * g, tab, v[g][r]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const int u = ub + WARP * g;
                if (u >= n_units) break;
#pragma unroll
                for (int t = 0; t < TILE; ++t) {
                    if (t < nt) {
                        i32 x[T::NW];
                        T::xload(xq + (size_t)(t0 + t) * k, u, x);
                        const float s = __ldg(xd + (size_t)(t0 + t) * n_xd + u / UPX);
#pragma unroll
                        for (int r = 0; r < RW; ++r) {
                            float a, b;
                            T::tail(v[g][r], T::ints(v[g][r], x), s, a, b);
                            acc[r][t] = __fmaf_rn(a, b, acc[r][t]);
                        }
                    }
                }
            }
        }
        store_rows<RW, TILE, GLU>(o, rows, n_out, n_units, t0, nt, acc);
    } else {
        constexpr int NV = RW * TILE, OWN = NV >= S ? NV / S : 1;
        const int p = lane % S;
        float acc[OWN];
#pragma unroll
        for (int i = 0; i < OWN; ++i) acc[i] = 0.0f;
        for (int ub = 0; ub < n_units; ub += WARP * G) {
            typename T::U v[G][RW];
#pragma unroll
            for (int g = 0; g < G; ++g)            // all weight loads first
#pragma unroll
                for (int r = 0; r < RW; ++r)
                    if (ub + WARP * g + lane < n_units) T::decode(wr[r], k, ub + WARP * g + lane, tab, v[g][r]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (ub + WARP * g >= n_units) break;   // the same for every lane
                const int u = min(ub + WARP * g + lane, n_units - 1);
                const bool adds = ub + WARP * g + lane < n_units && p * NV % S == 0;
                typename T::I iv[NV];
#pragma unroll
                for (int t = 0; t < TILE; ++t) {
                    i32 x[T::NW];
                    T::xload(xq + (size_t)(t0 + min(t, nt - 1)) * k, u, x);
#pragma unroll
                    for (int r = 0; r < RW; ++r) iv[t * RW + r] = T::ints(v[g][r], x);
                }
                group_scatter<S, NV>(iv);
#pragma unroll
                for (int i = 0; i < OWN; ++i) {
                    const int vi = p * NV / S + i, t = vi / RW, r = vi % RW;
                    typename T::U q = v[g][0];     // row r's scales (tail reads no weights)
#pragma unroll
                    for (int rr = 1; rr < RW; ++rr)
                        if (r == rr) q = v[g][rr];
                    float a, b;
                    T::tail(q, iv[i], __ldg(xd + (size_t)(t0 + min(t, nt - 1)) * n_xd + u / UPX), a, b);
                    if (adds) acc[i] = __fmaf_rn(a, b, acc[i]);
                }
            }
        }
        store_groups<S, RW, TILE, GLU>(o, rows, n_out, t0, nt, acc);
    }
}

// mm_q's superblock loop (S > 1) with each token's integer parts reduce-scattered over the group before the next
// token's (kernels mm[glu]_<type>_t<TILE>_r<RW>_gt, qmatmul.py PER_TOKEN_TILES): RW values a step instead of
// RW * TILE, so a lane holds one token's RW integer parts at a time instead of the tile's (mm_q: 64 registers of
// them for Q4_K at 8 tokens and 4 rows, 128 registers and a spill in all). Lane p of a group owns rows
// p * RW / S .. (OWN of them) of every token; each output's arithmetic is mm_q's in the same order (the same
// bits). S = 1 types run mm_q itself (their lanes fold in another order).
template <class T, int TILE, int RW, bool GLU>
__device__ __forceinline__ void mm_q_tok(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                         const i8* __restrict__ xq, const float* __restrict__ xd, int n_tok,
                                         const Out& o, const u32* tab) {
    constexpr int S = T::S, UPX = T::UPX, OWN = RW >= S ? RW / S : 1;
    if constexpr (S == 1) {
        mm_q<T, TILE, RW, 1, GLU>(W, row_bytes, n_out, k, xq, xd, n_tok, o, tab);
    } else {
        const int lane = threadIdx.x, t0 = blockIdx.y * TILE, nt = min(TILE, n_tok - t0), p = lane % S;
        int rows[RW];
        if (!warp_rows<RW, GLU>(n_out, rows)) return;
        const u8* wr[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) wr[r] = W + (size_t)min(rows[r], n_out - 1) * row_bytes;
        const int n_units = k / T::UNIT, n_xd = k / T::XB;
        float acc[TILE][OWN];
#pragma unroll
        for (int t = 0; t < TILE; ++t)
#pragma unroll
            for (int i = 0; i < OWN; ++i) acc[t][i] = 0.0f;
        for (int ub = 0; ub < n_units; ub += WARP) {
            const bool has = ub + lane < n_units, adds = has && p * RW % S == 0;
            const int u = min(ub + lane, n_units - 1);
            typename T::U v[RW];
            if (has)
#pragma unroll
                for (int r = 0; r < RW; ++r) T::decode(wr[r], k, u, tab, v[r]);
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                const int tt = t0 + min(t, nt - 1);
                i32 x[T::NW];
                T::xload(xq + (size_t)tt * k, u, x);
                typename T::I iv[RW];
#pragma unroll
                for (int r = 0; r < RW; ++r) iv[r] = T::ints(v[r], x);
                group_scatter<S, RW>(iv);
                add_owned_tails<T, S, RW>(v, iv, p, __ldg(xd + (size_t)tt * n_xd + u / UPX), adds, acc[t]);
            }
        }
        store_tok_groups<S, TILE, RW, GLU>(o, rows, n_out, t0, nt, acc[0]);
    }
}

// Up to SK_MAX_TOKENS tokens with more warps per row (split-K): the same sums as mm_q, token by token. A CTA
// of blockDim.y warps takes row blockIdx.x; warp w decodes the unit rounds w, w + blockDim.y, ... (round j =
// units 32j .. 32j + 31, unit 32j + l in lane l, as mm_q deals them), dots each unit with every token and
// leaves the two fma operands of (token t, unit) in shared memory, part[t * stride + j * 32 + l] (S > 1: the
// superblock's, in its group's first lane, zeros in the others); then warp t folds token t: lane l's units in
// mm_q's order (acc = fma(a, b, acc) over rounds 0, 1, ...), and lane_fold adds the lanes, i.e. the groups'
// sums in mm_q's order (adding +0 changes no sum that is not -0, and a sum from 0 is never -0). For matrices of
// few, long rows, where mm_q has too few warps to keep loads in flight (qmatmul.py split_k). part: dynamic
// shared memory, n_tok * cdiv(k / UNIT, 32) * 32 float2; xq, xd as mm_q's; n_tok <= blockDim.y.
template <class T>
__device__ __forceinline__ void mm_q_sk(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                        const i8* __restrict__ xq, const float* __restrict__ xd, int n_tok,
                                        const Out& o, const u32* tab, float2* part) {
    const int lane = threadIdx.x, w = threadIdx.y, nw = blockDim.y, row = blockIdx.x;
    const u8* wr = W + (size_t)row * row_bytes;
    const int n_units = k / T::UNIT, n_xd = k / T::XB, rounds = (n_units + WARP - 1) / WARP;
    constexpr int S = T::S, UPX = T::UPX;
    const int stride = rounds * WARP;                  // part entries per token
    for (int j = w; j < rounds; j += nw) {
        const bool has = j * WARP + lane < n_units;    // S > 1: lanes without a unit stay for the shuffles
        if constexpr (S == 1) {
            if (!has) continue;
        }
        const int u = min(j * WARP + lane, n_units - 1);
        typename T::U v;
        if (has) T::decode(wr, k, u, tab, v);
        for (int t = 0; t < n_tok; ++t) {
            i32 x[T::NW];
            T::xload(xq + (size_t)t * k, u, x);
            typename T::I iv = T::ints(v, x);
            group_scatter<S, 1>(&iv);
            float a, b;
            T::tail(v, iv, __ldg(xd + (size_t)t * n_xd + u / UPX), a, b);
            if (has) part[t * stride + j * WARP + lane] = lane % S == 0 ? make_float2(a, b) : make_float2(0.0f, 0.0f);
        }
    }
    __syncthreads();
    if (w >= n_tok) return;
    const float2* pt = part + w * stride;              // warp w folds token w
    float acc = 0.0f;
    for (int j = 0; j < rounds && j * WARP + lane < n_units; ++j) {
        const float2 p = pt[j * WARP + lane];
        acc = __fmaf_rn(p.x, p.y, acc);
    }
    __shared__ __align__(16) float fold_buf[MM_WARPS][fold_words(1)];
    __shared__ float fold_res[MM_WARPS][1];
    lane_fold<1>(&acc, min(WARP, n_units), fold_buf[w], fold_res[w]);
    if (lane == 0) o.put(w, row, n_out, fold_res[w][0]);
}

#define MM_Q_SK_KERNEL(NAME, T)                                                                           \
    extern "C" __global__ void __launch_bounds__(256) mmsk_##NAME(                                        \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xq,             \
        const float* __restrict__ xd, int n_tok, OUT_PARAMS) {                                            \
        GRID_SMEM(T);                                                                                     \
        extern __shared__ float2 part[];                                                                  \
        load_grid<T>(grid);                                                                               \
        grid_dependency_sync();                                                                           \
        mm_q_sk<T>(W, row_bytes, n_out, k, xq, xd, n_tok, OUT_ARGS, grid, part);                          \
    }

// One dp4a mat-mul kernel: PREFIX mm (dense) or mmglu (GLU), named PREFIX_<type>_t<TILE>_r<RW>_g<G><SUFFIX>,
// with BOUNDS its __launch_bounds__. A minimum of CTAs per SM is given only where measured: even a minimum of 1
// changes ptxas's register targets (sm_90: the IQ3_XXS 8-token GLU kernel 99 -> 146 registers).
#define MM_Q_KERNEL_AS(PREFIX, NAME, T, TILE, RW, G, GLU, BOUNDS, SUFFIX)                                  \
    extern "C" __global__ void BOUNDS PREFIX##_##NAME##_t##TILE##_r##RW##_g##G##SUFFIX(                   \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xq,             \
        const float* __restrict__ xd, int n_tok, OUT_PARAMS) {                                            \
        GRID_SMEM(T);                                                                                     \
        load_grid<T>(grid);                                                                               \
        grid_dependency_sync();                                                                           \
        mm_q<T, TILE, RW, G, GLU>(W, row_bytes, n_out, k, xq, xd, n_tok, OUT_ARGS, grid);                 \
    }
#define MM_Q_KERNEL(NAME, T, TILE, RW, G) MM_Q_KERNEL_AS(mm, NAME, T, TILE, RW, G, false, __launch_bounds__(256), )
// mm_q1's kernels: PREFIX mm or mmglu, one token, RW rows a warp, G p (PIPE) or s, under a minimum of one CTA an
// SM (as the two-row one-token kernels)
#define MM_Q1_KERNEL(PREFIX, NAME, T, RW, GLU, G, PIPE)                                                   \
    extern "C" __global__ void __launch_bounds__(256, 1) PREFIX##_##NAME##_t1_r##RW##_g##G(              \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xq,             \
        const float* __restrict__ xd, int, OUT_PARAMS) {                                                  \
        GRID_SMEM(T);                                                                                     \
        load_grid<T>(grid);                                                                               \
        grid_dependency_sync();                                                                           \
        mm_q1<T, RW, GLU, PIPE>(W, row_bytes, n_out, k, xq, xd, OUT_ARGS, grid);                          \
    }
#define MM_Q1_KERNELS(NAME, T, G, PIPE)                                                                   \
    MM_Q1_KERNEL(mm, NAME, T, 1, false, G, PIPE) MM_Q1_KERNEL(mm, NAME, T, 2, false, G, PIPE)             \
    MM_Q1_KERNEL(mmglu, NAME, T, 2, true, G, PIPE) MM_Q1_KERNEL(mmglu, NAME, T, 4, true, G, PIPE)
#define MM_Q_GLU_KERNEL(NAME, T, TILE, RW, G)                                                             \
    MM_Q_KERNEL_AS(mmglu, NAME, T, TILE, RW, G, true, __launch_bounds__(256), )
// CTAs of 256 threads an SM holds: 2048 threads on sm_80 / sm_90 / sm_100, 1536 on sm_86 / sm_87 / sm_89 / sm_120
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
#define FULL_SM_CTAS 6
#else
#define FULL_SM_CTAS 8
#endif
// The variants the launcher picks from (qmatmul.py dp4a_variant: (TILE, RW, G) by token tile and type). The
// one-token, one-row kernel asks for a full SM of CTAs (32 registers on an H200); the two-row ones (dense and
// GLU) for a minimum of one, which lets ptxas give them more registers (sm_90: Q4_K 48 -> 62, IQ3_XXS 44 -> 48)
// and was faster (qmatmul.py DP4A_TILE1 and DP4A_GLU_ROWS have the figures). T8_BOUNDS: the 8-token four-row
// kernels' (dense and GLU) bounds: a minimum of 2 CTAs an SM for Q4_K, Q5_K, Q6_K and Q8_0 (T8_MIN2), which caps
// them at 128 registers (sm_90: Q4_K 159 -> 128, Q5_K 171 -> 128, Q6_K 100 -> 127): on an H100 (2026-12-05,
// kernel_notes.md, us without / with) Q4_K 4096x14336 at 8 tokens 39.9 / 37.8, gate+up 69.3 / 66.9, Q5_K 49.7 /
// 43.4, at 16 tokens (two tiles) Q6_K 14336x4096 55.8 / 42.7, 4096x32000 111.0 / 103.1, Q8_0 110.3 / 96.0;
// IQ3_XXS lost (29.0 / 30.5, gate+up 51.1 / 52.1) and keeps none
#define T8_MIN2 __launch_bounds__(256, 2)
#define T8_ANY __launch_bounds__(256)
#define MM_Q_KERNELS(NAME, T, T8_BOUNDS)                                                                  \
    MM_Q_SK_KERNEL(NAME, T)                                                                               \
    MM_Q_KERNEL_AS(mm, NAME, T, 1, 1, 1, false, __launch_bounds__(256, FULL_SM_CTAS), )                  \
    MM_Q_KERNEL_AS(mm, NAME, T, 1, 2, 1, false, __launch_bounds__(256, 1), )                             \
    MM_Q_KERNEL(NAME, T, 2, 1, 1) MM_Q_KERNEL(NAME, T, 2, 2, 1) MM_Q_KERNEL(NAME, T, 4, 2, 1)             \
    MM_Q_KERNEL_AS(mm, NAME, T, 8, 4, 1, false, T8_BOUNDS, )                                             \
    MM_Q_KERNEL_AS(mmglu, NAME, T, 1, 2, 1, true, __launch_bounds__(256, 1), )                            \
    MM_Q_GLU_KERNEL(NAME, T, 2, 4, 1) MM_Q_GLU_KERNEL(NAME, T, 4, 4, 1)                                   \
    MM_Q_KERNEL_AS(mmglu, NAME, T, 8, 4, 1, true, T8_BOUNDS, )
#ifdef QMM_EXPLORE   // perf/bench_gpu.py --explore: the other candidates (qmatmul.py EXPLORE_VARIANTS) of 6 types
// one-token kernels under a minimum of MB CTAs per SM (fewer registers, so a grid of more CTAs than 132 x 5
// fits in one wave); kernel names end in _m<MB>
#define MM_Q_KERNEL_MB(NAME, T, MB)                                                                       \
    MM_Q_KERNEL_AS(mm, NAME, T, 1, 2, 1, false, __launch_bounds__(256, MB), _m##MB)                        \
    MM_Q_KERNEL_AS(mmglu, NAME, T, 1, 2, 1, true, __launch_bounds__(256, MB), _m##MB)
// ... and the 8-token kernels (four rows) under a minimum of 2, the CTAs an SM they get anyway (~100 registers)
#define MM_Q_KERNEL_T8_MB(NAME, T, MB)                                                                    \
    MM_Q_KERNEL_AS(mm, NAME, T, 8, 4, 1, false, __launch_bounds__(256, MB), _m##MB)                        \
    MM_Q_KERNEL_AS(mmglu, NAME, T, 8, 4, 1, true, __launch_bounds__(256, MB), _m##MB)
#define MM_Q_MORE(NAME, T)                                                                                \
    MM_Q_KERNEL_MB(NAME, T, 1) MM_Q_KERNEL_MB(NAME, T, 6) MM_Q_KERNEL_MB(NAME, T, 8)                      \
    MM_Q_KERNEL_T8_MB(NAME, T, 2)                                                                         \
    MM_Q1_KERNELS(NAME, T, p, true) MM_Q1_KERNELS(NAME, T, s, false)                                      \
    MM_Q_KERNEL(NAME, T, 1, 1, 4) MM_Q_KERNEL(NAME, T, 1, 2, 2) MM_Q_KERNEL(NAME, T, 1, 2, 4)             \
    MM_Q_KERNEL(NAME, T, 1, 4, 1)                                                                         \
    MM_Q_KERNEL(NAME, T, 2, 2, 2) MM_Q_KERNEL(NAME, T, 4, 1, 1)                                           \
    MM_Q_KERNEL(NAME, T, 4, 4, 1) MM_Q_KERNEL(NAME, T, 8, 1, 1) MM_Q_KERNEL(NAME, T, 8, 2, 1)             \
    MM_Q_KERNEL(NAME, T, 8, 2, 2) MM_Q_KERNEL(NAME, T, 16, 1, 1) MM_Q_KERNEL(NAME, T, 16, 2, 1)             \
    MM_Q_GLU_KERNEL(NAME, T, 1, 4, 1) MM_Q_GLU_KERNEL(NAME, T, 2, 2, 1) MM_Q_GLU_KERNEL(NAME, T, 4, 2, 1)    \
    MM_Q_GLU_KERNEL(NAME, T, 8, 2, 1)
#define MM_Q_GLU_TILE1_R4(NAME, T)   // in MM_Q_MORE already
#else
#define MM_Q_MORE(NAME, T)
#define MM_Q_GLU_TILE1_R4(NAME, T)   /* qmatmul.py DP4A_GLU_TILE1 */                                       \
    MM_Q_KERNEL_AS(mmglu, NAME, T, 1, 4, 1, true, __launch_bounds__(256, 1), )
#endif
// mm_q_tok's kernels: TILE tokens, RW rows a warp (GLU: RW / 2 row pairs), G = t, under BOUNDS; built for the
// superblock types (the explore build: for Q8_0 and Q5_0 too, where they are mm_q's kernels under other names)
#define MM_Q_TOK_KERNEL(PREFIX, NAME, T, TILE, RW, GLU, BOUNDS)                                           \
    extern "C" __global__ void BOUNDS PREFIX##_##NAME##_t##TILE##_r##RW##_gt(                             \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xq,             \
        const float* __restrict__ xd, int n_tok, OUT_PARAMS) {                                            \
        GRID_SMEM(T);                                                                                     \
        load_grid<T>(grid);                                                                               \
        grid_dependency_sync();                                                                           \
        mm_q_tok<T, TILE, RW, GLU>(W, row_bytes, n_out, k, xq, xd, n_tok, OUT_ARGS, grid);                \
    }
// mm_q_iq3's kernels (IQ3_XXS's loop over whole groups): PREFIX mm or mmglu, TILE tokens, RW rows a warp (GLU:
// RW / 2 row pairs), named ..._gw<SUFFIX>, under BOUNDS
#define MM_IQ3_KERNEL(PREFIX, TILE, RW, GLU, BOUNDS, SUFFIX)                                              \
    extern "C" __global__ void BOUNDS PREFIX##_iq3_xxs_t##TILE##_r##RW##_gw##SUFFIX(                     \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xq,             \
        const float* __restrict__ xd, int n_tok, OUT_PARAMS) {                                            \
        GRID_SMEM(TIQ3_XXS);                                                                              \
        load_grid<TIQ3_XXS>(grid);                                                                        \
        grid_dependency_sync();                                                                           \
        mm_q_iq3<TILE, RW, GLU>(W, row_bytes, n_out, k, xq, xd, n_tok, OUT_ARGS, grid);                   \
    }
#define MM_Q_TOK_KERNELS(NAME, T)                                                                         \
    MM_Q_TOK_KERNEL(mm, NAME, T, 8, 4, false, T8_MIN2) MM_Q_TOK_KERNEL(mmglu, NAME, T, 8, 4, true, T8_MIN2)    \
    MM_Q_TOK_KERNEL(mm, NAME, T, 4, 2, false, __launch_bounds__(256))                                     \
    MM_Q_TOK_KERNEL(mmglu, NAME, T, 4, 4, true, __launch_bounds__(256))

MM_Q_KERNELS(q8_0, TQ8_0, T8_MIN2) MM_Q_MORE(q8_0, TQ8_0)
MM_Q_KERNELS(q4_0, TQ4_0, T8_ANY)
MM_Q_KERNELS(q5_0, TQ5_0, T8_ANY) MM_Q_MORE(q5_0, TQ5_0)
MM_Q_KERNELS(iq4_nl, TIQ4_NL, T8_ANY)
MM_Q_KERNELS(q4_k, TQ4_K, T8_MIN2) MM_Q_MORE(q4_k, TQ4_K)
MM_Q_KERNELS(q5_k, TQ5_K, T8_MIN2) MM_Q_MORE(q5_k, TQ5_K)
MM_Q_KERNELS(q6_k, TQ6_K, T8_MIN2) MM_Q_MORE(q6_k, TQ6_K)
MM_Q_KERNELS(iq3_xxs, TIQ3_XXS, T8_ANY) MM_Q_MORE(iq3_xxs, TIQ3_XXS) MM_Q_GLU_TILE1_R4(iq3_xxs, TIQ3_XXS)
MM_IQ3_KERNEL(mm, 1, 2, false, __launch_bounds__(256, 1), ) MM_IQ3_KERNEL(mm, 2, 2, false, T8_ANY, )
MM_IQ3_KERNEL(mm, 4, 2, false, T8_ANY, ) MM_IQ3_KERNEL(mm, 8, 4, false, T8_ANY, )
MM_IQ3_KERNEL(mmglu, 1, 4, true, __launch_bounds__(256, 1), ) MM_IQ3_KERNEL(mmglu, 2, 4, true, T8_ANY, )
MM_IQ3_KERNEL(mmglu, 4, 4, true, T8_ANY, ) MM_IQ3_KERNEL(mmglu, 8, 4, true, T8_ANY, )
// one token under a minimum of 4 CTAs an SM (sm_90: 64 registers, no spill; qmatmul.py IQ3_GROUPS_CHOICES)
MM_IQ3_KERNEL(mm, 1, 2, false, __launch_bounds__(256, 4), _m4)
MM_IQ3_KERNEL(mmglu, 1, 4, true, __launch_bounds__(256, 4), _m4)
#ifdef QMM_EXPLORE   // qmatmul.py EXPLORE_IQ3_GROUPS_MB
MM_IQ3_KERNEL(mm, 8, 4, false, T8_MIN2, _m2) MM_IQ3_KERNEL(mmglu, 8, 4, true, T8_MIN2, _m2)
#endif
MM_Q_TOK_KERNELS(q4_k, TQ4_K) MM_Q_TOK_KERNELS(q5_k, TQ5_K) MM_Q_TOK_KERNELS(q6_k, TQ6_K)
MM_Q_TOK_KERNELS(iq3_xxs, TIQ3_XXS)
#ifdef QMM_EXPLORE
MM_Q_TOK_KERNELS(q8_0, TQ8_0) MM_Q_TOK_KERNELS(q5_0, TQ5_0)
#endif

// Float weights with float activations: unit = 8 weights (one 16-byte load of f16/bf16, two of f32). Plain
// loads: measured faster here than __ldg (F16 4096x14336: 31.2 against 34.2 us on an H200).
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

// x (n_tok, k) f32 with 16-byte aligned rows, k % 8 == 0; otherwise as mm_q (G = 1). Each output's sum is one
// fma chain per lane over its units in order, then lane_fold: the same bits for every RW and TILE.
template <int TILE, int RW, bool GLU, void (*LOADW)(const u8*, int, float*)>
__device__ __forceinline__ void mm_f(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                     const float* __restrict__ x, int n_tok, const Out& o) {
    const int lane = threadIdx.x, t0 = blockIdx.y * TILE, nt = min(TILE, n_tok - t0);
    int rows[RW];
    if (!warp_rows<RW, GLU>(n_out, rows)) return;
    float acc[RW][TILE];
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int t = 0; t < TILE; ++t) acc[r][t] = 0.0f;
    for (int u = lane; u < k / 8; u += WARP) {
        float w[RW][8];
#pragma unroll
        for (int r = 0; r < RW; ++r)   // rows past the matrix (RW > 1 dense, RW > 2 GLU) read its last row
            LOADW(W + (size_t)(RW > (GLU ? 2 : 1) ? min(rows[r], n_out - 1) : rows[r]) * row_bytes, u, w[r]);
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            if (t < nt) {
                const float4* p = (const float4*)(x + (size_t)(t0 + t) * k + 8 * u);
                const float4 a = p[0], b = p[1];
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    float s = acc[r][t];
                    s = __fmaf_rn(w[r][0], a.x, s); s = __fmaf_rn(w[r][1], a.y, s);
                    s = __fmaf_rn(w[r][2], a.z, s); s = __fmaf_rn(w[r][3], a.w, s);
                    s = __fmaf_rn(w[r][4], b.x, s); s = __fmaf_rn(w[r][5], b.y, s);
                    s = __fmaf_rn(w[r][6], b.z, s); s = __fmaf_rn(w[r][7], b.w, s);
                    acc[r][t] = s;
                }
            }
        }
    }
    store_rows<RW, TILE, GLU>(o, rows, n_out, k / 8, t0, nt, acc);
}

// PREFIX_<type>_t<TILE><SUFFIX>: PREFIX mm (RW rows a warp) or mmglu (RW / 2 gate rows and their up rows)
#define MM_F_KERNEL_AS(PREFIX, NAME, LOADW, TILE, RW, GLU, SUFFIX)                                        \
    extern "C" __global__ void __launch_bounds__(256) PREFIX##_##NAME##_t##TILE##SUFFIX(                  \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const float* __restrict__ x,           \
        int n_tok, OUT_PARAMS) {                                                                          \
        grid_dependency_sync();                                                                           \
        mm_f<TILE, RW, GLU, LOADW>(W, row_bytes, n_out, k, x, n_tok, OUT_ARGS);                           \
    }
#define MM_F_KERNEL(NAME, LOADW, TILE, RW)                                                                \
    MM_F_KERNEL_AS(mm, NAME, LOADW, TILE, RW, false, ) MM_F_KERNEL_AS(mmglu, NAME, LOADW, TILE, 2, true, )
#ifdef QMM_EXPLORE   // perf/bench_gpu.py --gemm: 8-token tiles over RW rows a warp (qmatmul.py EXPLORE_FLOAT_ROWS)
#define MM_F_MORE(NAME, LOADW)                                                                            \
    MM_F_KERNEL_AS(mm, NAME, LOADW, 8, 4, false, _r4) MM_F_KERNEL_AS(mm, NAME, LOADW, 8, 8, false, _r8)   \
    MM_F_KERNEL_AS(mmglu, NAME, LOADW, 8, 4, true, _r4) MM_F_KERNEL_AS(mmglu, NAME, LOADW, 8, 8, true, _r8)
#else
#define MM_F_MORE(NAME, LOADW)
#endif
// dense kernels: one row a warp, but 8-token tiles over 4 rows (qmatmul.py FLOAT_TILE8_ROWS); GLU: one row pair
#define MM_F_KERNELS(NAME, LOADW)                                                                         \
    MM_F_KERNEL(NAME, LOADW, 1, 1) MM_F_KERNEL(NAME, LOADW, 2, 1) MM_F_KERNEL(NAME, LOADW, 4, 1)          \
    MM_F_KERNEL(NAME, LOADW, 8, 4) MM_F_MORE(NAME, LOADW)

MM_F_KERNELS(f32, w8_f32)
MM_F_KERNELS(f16, w8_f16)
MM_F_KERNELS(bf16, w8_bf16)

// ---------------------------------------------------------------------------- activation rounding
// One warp per block of 32 (q8_0) or 256 (q8_k) activations; the arithmetic is act_quant.cuh's, shared
// with the fused rmsnorm + rounding of elementwise.cu.
extern "C" __global__ void __launch_bounds__(256) quant_q8_0(const float* __restrict__ x, i8* __restrict__ xq,
                                                             float* __restrict__ xd, int n_blocks) {
    grid_dependency_sync();
    const int blk = blockIdx.x * blockDim.y + threadIdx.y;
    if (blk >= n_blocks) return;
    round_q8_0(x[(size_t)blk * 32 + threadIdx.x], xq + (size_t)blk * 32, xd + blk);
}

extern "C" __global__ void __launch_bounds__(256) quant_q8_k(const float* __restrict__ x, i8* __restrict__ xq,
                                                             float* __restrict__ xd, int n_blocks) {
    grid_dependency_sync();
    const int blk = blockIdx.x * blockDim.y + threadIdx.y, lane = threadIdx.x;
    if (blk >= n_blocks) return;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = x[(size_t)blk * 256 + 32 * i + lane];
    round_q8_k(v, xq + (size_t)blk * 256, xd + blk);
}

// The tensor-core kernel's copy of rounded activations, chunk-major: xt (k / 16, n, 16) int8 and xdt (k / xb, n)
// f32 from xq (n, k) and xd (n, k / xb), so that its staging copies (one 16-byte chunk of consecutive tokens)
// read contiguous memory (qmatmul_mma.cu decode_and_stage). Thread i: chunk i / n of token i % n (the writes
// contiguous), and while i < n * (k / xb) scale i / n of token i % n. 1-D grid over n * (k / 16) threads.
extern "C" __global__ void __launch_bounds__(256) act_tiles(const i8* __restrict__ xq, const float* __restrict__ xd,
                                                            i8* __restrict__ xt, float* __restrict__ xdt, int n,
                                                            int k, int xb) {
    grid_dependency_sync();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * (k / 16)) return;
    const size_t c = i % n, j = i / n;
    ((uint4*)xt)[i] = ((const uint4*)(xq + c * k))[j];
    if (i < (size_t)n * (k / xb)) xdt[i] = xd[c * (k / xb) + j];
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
    T::decode(W + (size_t)id * row_bytes, k, u, tab, v);
    T::deq(v, o + T::offset(u));
}

#define DQ_KERNEL(NAME, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) dq_##NAME(const u8* __restrict__ W, int row_bytes, \
        int n_out, int k, const i32* __restrict__ ids, float* __restrict__ out) {                         \
        GRID_SMEM(T);                                                                                     \
        load_grid<T>(grid);                                                                               \
        grid_dependency_sync();                                                                           \
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
        grid_dependency_sync();                                                                           \
        dq_rows_f<LOADW>(W, row_bytes, n_out, k, ids, out);                                               \
    }
DQ_F_KERNEL(f32, w8_f32)
DQ_F_KERNEL(f16, w8_f16)
DQ_F_KERNEL(bf16, w8_bf16)
