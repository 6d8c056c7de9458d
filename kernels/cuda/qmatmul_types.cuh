// GGUF weight types for the quantized mat-mul (qmatmul.cu): the lookup tables, bit helpers and, per type,
// how a unit of a row decodes into packed int8 weights and scales, dots with int8 activations and
// dequantizes to floats (bit-exact with gguf.quants).
#pragma once
#include "common.cuh"

// ---------------------------------------------------------------------------------------- tables
// ggml's iq3xxs_grid: 256 entries of 4 unsigned bytes (the magnitudes 4..62 of 4 weights).
__constant__ u32 IQ3XXS_GRID[256] = {
    0x04040404, 0x04040414, 0x04040424, 0x04040c0c, 0x04040c1c, 0x04040c3e, 0x04041404, 0x04041414,
    0x04041c0c, 0x04042414, 0x04043e1c, 0x04043e2c, 0x040c040c, 0x040c041c, 0x040c0c04, 0x040c0c14,
    0x040c140c, 0x040c142c, 0x040c1c04, 0x040c1c14, 0x040c240c, 0x040c2c24, 0x040c3e04, 0x04140404,
    0x04140414, 0x04140424, 0x04140c0c, 0x04141404, 0x04141414, 0x04141c0c, 0x04141c1c, 0x04141c3e,
    0x04142c0c, 0x04142c3e, 0x04143e2c, 0x041c040c, 0x041c043e, 0x041c0c04, 0x041c0c14, 0x041c142c,
    0x041c3e04, 0x04240c1c, 0x04241c3e, 0x04242424, 0x04242c3e, 0x04243e1c, 0x04243e2c, 0x042c040c,
    0x042c043e, 0x042c1c14, 0x042c2c14, 0x04341c2c, 0x04343424, 0x043e0c04, 0x043e0c24, 0x043e0c34,
    0x043e241c, 0x043e340c, 0x0c04040c, 0x0c04041c, 0x0c040c04, 0x0c040c14, 0x0c04140c, 0x0c04141c,
    0x0c041c04, 0x0c041c14, 0x0c041c24, 0x0c04243e, 0x0c042c04, 0x0c0c0404, 0x0c0c0414, 0x0c0c0c0c,
    0x0c0c1404, 0x0c0c1414, 0x0c14040c, 0x0c14041c, 0x0c140c04, 0x0c140c14, 0x0c14140c, 0x0c141c04,
    0x0c143e14, 0x0c1c0404, 0x0c1c0414, 0x0c1c1404, 0x0c1c1c0c, 0x0c1c2434, 0x0c1c3434, 0x0c24040c,
    0x0c24042c, 0x0c242c04, 0x0c2c1404, 0x0c2c1424, 0x0c2c2434, 0x0c2c3e0c, 0x0c34042c, 0x0c3e1414,
    0x0c3e2404, 0x14040404, 0x14040414, 0x14040c0c, 0x14040c1c, 0x14041404, 0x14041414, 0x14041434,
    0x14041c0c, 0x14042414, 0x140c040c, 0x140c041c, 0x140c042c, 0x140c0c04, 0x140c0c14, 0x140c140c,
    0x140c1c04, 0x140c341c, 0x140c343e, 0x140c3e04, 0x14140404, 0x14140414, 0x14140c0c, 0x14140c3e,
    0x14141404, 0x14141414, 0x14141c3e, 0x14142404, 0x14142c2c, 0x141c040c, 0x141c0c04, 0x141c0c24,
    0x141c3e04, 0x141c3e24, 0x14241c2c, 0x14242c1c, 0x142c041c, 0x142c143e, 0x142c240c, 0x142c3e24,
    0x143e040c, 0x143e041c, 0x143e0c34, 0x143e242c, 0x1c04040c, 0x1c040c04, 0x1c040c14, 0x1c04140c,
    0x1c04141c, 0x1c042c04, 0x1c04342c, 0x1c043e14, 0x1c0c0404, 0x1c0c0414, 0x1c0c1404, 0x1c0c1c0c,
    0x1c0c2424, 0x1c0c2434, 0x1c14040c, 0x1c14041c, 0x1c140c04, 0x1c14142c, 0x1c142c14, 0x1c143e14,
    0x1c1c0c0c, 0x1c1c1c1c, 0x1c241c04, 0x1c24243e, 0x1c243e14, 0x1c2c0404, 0x1c2c0434, 0x1c2c1414,
    0x1c2c2c2c, 0x1c340c24, 0x1c341c34, 0x1c34341c, 0x1c3e1c1c, 0x1c3e3404, 0x24040424, 0x24040c3e,
    0x24041c2c, 0x24041c3e, 0x24042c1c, 0x24042c3e, 0x240c3e24, 0x24141404, 0x24141c3e, 0x24142404,
    0x24143404, 0x24143434, 0x241c043e, 0x241c242c, 0x24240424, 0x24242c0c, 0x24243424, 0x242c142c,
    0x242c241c, 0x242c3e04, 0x243e042c, 0x243e0c04, 0x243e0c14, 0x243e1c04, 0x2c040c14, 0x2c04240c,
    0x2c043e04, 0x2c0c0404, 0x2c0c0434, 0x2c0c1434, 0x2c0c2c2c, 0x2c140c24, 0x2c141c14, 0x2c143e14,
    0x2c1c0414, 0x2c1c2c1c, 0x2c240c04, 0x2c24141c, 0x2c24143e, 0x2c243e14, 0x2c2c0414, 0x2c2c1c0c,
    0x2c342c04, 0x2c3e1424, 0x2c3e2414, 0x34041424, 0x34042424, 0x34042434, 0x34043424, 0x340c140c,
    0x340c340c, 0x34140c3e, 0x34143424, 0x341c1c04, 0x341c1c34, 0x34242424, 0x342c042c, 0x342c2c14,
    0x34341c1c, 0x343e041c, 0x343e140c, 0x3e04041c, 0x3e04042c, 0x3e04043e, 0x3e040c04, 0x3e041c14,
    0x3e042c14, 0x3e0c1434, 0x3e0c2404, 0x3e140c14, 0x3e14242c, 0x3e142c14, 0x3e1c0404, 0x3e1c0c2c,
    0x3e1c1c1c, 0x3e1c3404, 0x3e24140c, 0x3e24240c, 0x3e2c0404, 0x3e2c0414, 0x3e2c1424, 0x3e341c04,
};
// ggml's kvalues_iq4nl (int8) packed little-endian, 4 per word: -127 -104 -83 -65 | -49 -35 -22 -10 | 1 13 25 38 | 53 69 89 113
__constant__ u32 IQ4NL_VALUES[4] = {0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u};
// ggml's ksigns_iq2xs[i] (the 8 sign bits of 8 weights) is i | parity(i) << 7: computed, not tabled.

// ------------------------------------------------------------------------------------- helpers
// Weight loads go through __ldg: the read-only path, which also keeps the global address space that an
// address rounded through an integer would lose. (Loads that skip L1, ld.global.nc.L1::no_allocate,
// measured 1.1-3.7x slower on an H200: the 2-byte aligned blocks read overlapping words, which L1 serves;
// perf/kernel_notes.md.)
__device__ __forceinline__ u32 ldw(const unsigned int* p) { return __ldg(p); }
__device__ __forceinline__ uint4 ldw4(const uint4* p) { return __ldg(p); }
__device__ __forceinline__ u16 ld16(const u8* p) { return __ldg((const unsigned short*)p); }   // p 2-byte aligned
__device__ __forceinline__ float ldf16(const u8* p) { return f16_to_f32(ld16(p)); }

template <int N>   // N weight words from a 16-byte aligned address (N a multiple of 4)
__device__ __forceinline__ void load_a16(const void* p, u32* out) {
    const uint4* q = (const uint4*)p;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        const uint4 v = ldw4(q + i);
        out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
}
// bit i of n (i < 4) -> bit 0 of byte i
__device__ __forceinline__ u32 spread4(u32 n) { return (n * 0x00204081u) & 0x01010101u; }
// byte k of the result = byte k of g when bit k of s4 (< 16) is clear, -(byte k) when set. Needs bytes
// 0 < g < 128 (the IQ3_XXS grid's 4..62): then ~g + 1 stays inside its byte. The 0xff byte masks come from
// prmt's sign-replicating mode after a multiply puts bit k at the top of byte k.
__device__ __forceinline__ u32 neg_bytes(u32 g, u32 s4) {
    u32 m;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(m) : "r"(s4 * 0x10204080u), "r"(0u), "r"(0xba98u));
    return (g ^ m) + (m & 0x01010101u);
}
// bytes v in [0, 2H) -> v - H as int8 (H = 8, 16, 32): flip bit H, then set the bits above it where the
// result is negative (v < H); a few logic ops where the byte-SIMD subtraction is emulated on sm_70+.
template <u32 H>
__device__ __forceinline__ u32 recentre(u32 v) {
    const u32 h = H * 0x01010101u;
    return (v ^ h) | ((~v & h) * ((256u - 2u * H) / H));
}
__device__ __forceinline__ i32 dot8w(const u32* w, const i32* x, int nw) {
    i32 s = 0;
    for (int i = 0; i < nw; ++i) s = __dp4a((i32)w[i], x[i], s);
    return s;
}
__device__ __forceinline__ i32 sum_bytes(const i32* x, int nw) {   // sum of nw*4 int8
    i32 s = 0;
    for (int i = 0; i < nw; ++i) s = __dp4a(0x01010101, x[i], s);
    return s;
}
// 6-bit scales and mins of sub-blocks 2jj and 2jj+1 of a Q4_K/Q5_K block from its 12 scale bytes s[3]
// (ggml's get_scale_min_k4), a pair at once: byte 0 of each 16-bit pair is sub-block 2jj's.
__device__ __forceinline__ void k4_scale_min2(const u32* s, int jj, int* sc, int* m) {
    const u32 sh = 16u * (jj & 1);
    const u32 a = s[0] >> sh, b = s[1] >> sh, c = s[2] >> sh;
    const u32 scp = jj < 2 ? a & 0x3f3fu : (c & 0x0f0fu) | ((a >> 2) & 0x3030u);
    const u32 mp = jj < 2 ? b & 0x3f3fu : ((c >> 4) & 0x0f0fu) | ((b >> 2) & 0x3030u);
    sc[0] = scp & 0xffu;
    sc[1] = (scp >> 8) & 0xffu;
    m[0] = mp & 0xffu;
    m[1] = (mp >> 8) & 0xffu;
}
// 16-entry int8 table lookup of the 8 nibbles of q: lo = entries of the low nibbles of bytes 0..3, hi = of
// the high nibbles (ggml's get_int_from_table_16). Selector nibbles are masked to 3 bits for the first
// perms (no prmt sign mode); bit 3 picks between the two table halves.
__device__ __forceinline__ void lookup16(u32 q, const u32* t, u32& lo, u32& hi) {
    u32 tmp[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 sel = (q >> (16 * i)) & 0xffffu;
        const u32 a = __byte_perm(t[0], t[1], sel & 0x7777u);
        const u32 b = __byte_perm(t[2], t[3], sel & 0x7777u);
        tmp[i] = __byte_perm(a, b, 0x3210u | ((sel & 0x8888u) >> 1));
    }
    lo = __byte_perm(tmp[0], tmp[1], 0x6420u);
    hi = __byte_perm(tmp[0], tmp[1], 0x7531u);
}

// --------------------------------------------------------------------------------- weight types
// Each type (over TBase: UNIT, XB, NW, S, offset, xload, xpos): decode(row, k, u, tab, U&) (row: the row in
// its device layout, kernels/cuda/layouts.py; k: weights per row) -> the unit's weights as packed int8 words
// in the order of its activations and its scales; ints(U, x words) -> the integer part I of
// the unit's dot with one token (exact); tail(U, I, xd, a, b) -> the two operands of acc = fma(a, b, acc) that
// add a superblock's integer part to a token's running sum; deq(U, row out + offset(u)) -> gguf's float values.
// Q4_K splits decode into fetch(row, k, u, R&) (the unit's loads, raw) and unpack(R, u, U&), so that the
// small-token kernel can have one unit's loads in flight while it multiplies another (qmatmul_mma.cu Fetch).
// A superblock is S units that share the row's scale d and the activations' scale xd: IQ3_XXS and Q6_K take
// their 256-weight blocks' 8 units (S = XB / UNIT; ggml's own dot sums a block's sub-blocks as integers too),
// Q4_K and Q5_K their blocks' 4 units of 64 weights (K4_S; each unit alone in the unit_tails build; the two
// integer parts a pair, I2), the 32-weight types S = 1 (nothing to share). The kernels add a superblock's integer
// parts, in any order (exact), and apply the float tail once. Every mat-mul kernel shares that tail,
// so the dp4a kernels (qmatmul.cu) and the tensor-core ones (qmatmul_mma.cu) round alike. MMA says how the
// tensor-core kernel gets the integers: MMA_ONE (one 32-weight dot, scaled by mma_int), MMA_K4 (two 32-weight
// dots and their activation sums), MMA_Q6 (two 16-weight dots, one per scale).
// `tab` is the CTA's shared copy of IQ3XXS_GRID (unused by the other types).

// UNIT weights per unit, activations in blocks of XB, NW int8 words of activations per unit per token
enum { MMA_ONE = 0, MMA_K4 = 1, MMA_Q6 = 2 };

// Q4_K / Q5_K's integer parts: scales times dots, mins times activation sums
struct I2 {
    i32 sc, mn;
    __device__ __forceinline__ I2& operator+=(const I2& o) { sc += o.sc; mn += o.mn; return *this; }
    __device__ __forceinline__ I2 operator+(const I2& o) const { return I2{sc + o.sc, mn + o.mn}; }
};
// xor shuffles of a unit's integer parts (qmatmul.cu group_scatter)
__device__ __forceinline__ i32 shfl_xor(i32 v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ I2 shfl_xor(I2 v, int m) {
    return I2{__shfl_xor_sync(0xffffffffu, v.sc, m), __shfl_xor_sync(0xffffffffu, v.mn, m)};
}
// Units of 64 weights a Q4_K / Q5_K superblock sums as integers before its float tail: 4 (the 256-weight block,
// as ggml's own dot does), or 1 (each unit its own tail) in the "unit_tails" build (qmatmul.py BUILDS), whose
// kernels give their own bits, the same in every kernel of that build (perf/kernel_notes.md, "Q4_K block sums",
// "Block sums as the default")
#ifndef K4_S
#define K4_S 4
#endif
template <int UNIT_, int XB_, int NW_>
struct TBase {
    static constexpr int MMA = MMA_ONE;
    static constexpr int UNIT = UNIT_, XB = XB_, NW = NW_;
    static constexpr int UPX = XB_ / UNIT_, S = UPX;   // units per activation scale; S: see above
    typedef i32 I;
    static constexpr bool GRID = false;            // decode reads the IQ3_XXS grid (from shared memory)
    // offset of the unit's first weight in its row (= of its first activation in the token's row)
    static __device__ __forceinline__ int offset(int u) { return u * UNIT_; }
    // the unit's activations of one token row xr, in decode's weight order
    static __device__ __forceinline__ void xload(const i8* xr, int u, i32* x) {
        const uint4* q = (const uint4*)(xr + offset(u));   // activations: cached (every row reads them)
#pragma unroll
        for (int i = 0; i < NW_ / 4; ++i) {
            const uint4 v = __ldg(q + i);
            x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
        }
    }
    // the unit's activation words (xload's order) as XCHUNK-byte pieces: piece q = words q * XCHUNK / 4 .., at
    // byte xpos(u, q) of the token's row (the tensor-core kernels' reads of act_tiles' copy)
    static constexpr int XCHUNK = 16;
    static __device__ __forceinline__ int xpos(int u, int q) { return u * UNIT_ + 16 * q; }
};

// The 32-weight block types in their device layout (kernels/cuda/layouts.py): per row, a plane of each field
// (block u's quants at u * their size, then the f16 d's; Q5_0's fifth bits between), 16-byte aligned rows.
struct TQ8_0 : TBase<32, 32, 8> {
    struct U { u32 w[8]; float d; };
    static __device__ __forceinline__ void decode(const u8* row, int k, int u, const u32*, U& v) {
        load_a16<8>(row + 32 * u, v.w);
        v.d = ldf16(row + 32 * (k >> 5) + 2 * u);
    }
    static __device__ __forceinline__ i32 ints(const U& v, const i32* x) { return dot8w(v.w, x, 8); }
    static __device__ __forceinline__ i32 mma_int(const U&, i32 s) { return s; }
    // (float)s: exact (|s| <= 32 * 128 * 127 < 2^24), one I2FP, which on sm_86+ issues on the integer pipe
    static __device__ __forceinline__ void tail(const U& v, i32 s, float xd, float& a, float& b) {
        a = __fmul_rn(v.d, xd);
        b = (float)s;
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) {
        for (int i = 0; i < 32; ++i) o[i] = __fmul_rn((float)(i8)(v.w[i >> 2] >> (8 * (i & 3))), v.d);
    }
};

// Q4_0, IQ4_NL, Q5_0: weight j and j+16 of a block share byte j (low / high nibble)
struct TQ4_0 : TBase<32, 32, 8> {
    typedef TQ8_0::U U;
    static __device__ __forceinline__ void decode(const u8* row, int k, int u, const u32*, U& v) {
        u32 q[4];
        load_a16<4>(row + 16 * u, q);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v.w[i] = recentre<8>(q[i] & 0x0f0f0f0fu);
            v.w[4 + i] = recentre<8>((q[i] >> 4) & 0x0f0f0f0fu);
        }
        v.d = ldf16(row + 16 * (k >> 5) + 2 * u);
    }
    static __device__ __forceinline__ i32 ints(const U& v, const i32* x) { return TQ8_0::ints(v, x); }
    static __device__ __forceinline__ i32 mma_int(const U& v, i32 s) { return s; }
    static __device__ __forceinline__ void tail(const U& v, i32 s, float xd, float& a, float& b) { TQ8_0::tail(v, s, xd, a, b); }
    static __device__ __forceinline__ void deq(const U& v, float* o) {
        for (int i = 0; i < 32; ++i) o[i] = __fmul_rn(v.d, (float)(i8)(v.w[i >> 2] >> (8 * (i & 3))));
    }
};

struct TIQ4_NL : TBase<32, 32, 8> {
    typedef TQ4_0::U U;
    static __device__ __forceinline__ void decode(const u8* row, int k, int u, const u32*, U& v) {
        u32 q[4];
        load_a16<4>(row + 16 * u, q);
        const u32 t[4] = {IQ4NL_VALUES[0], IQ4NL_VALUES[1], IQ4NL_VALUES[2], IQ4NL_VALUES[3]};
#pragma unroll
        for (int i = 0; i < 4; ++i) lookup16(q[i], t, v.w[i], v.w[4 + i]);
        v.d = ldf16(row + 16 * (k >> 5) + 2 * u);
    }
    static __device__ __forceinline__ i32 ints(const U& v, const i32* x) { return TQ8_0::ints(v, x); }
    static __device__ __forceinline__ i32 mma_int(const U& v, i32 s) { return s; }
    static __device__ __forceinline__ void tail(const U& v, i32 s, float xd, float& a, float& b) { TQ8_0::tail(v, s, xd, a, b); }
    static __device__ __forceinline__ void deq(const U& v, float* o) { TQ4_0::deq(v, o); }
};

struct TQ5_0 : TBase<32, 32, 8> {
    typedef TQ4_0::U U;
    static __device__ __forceinline__ void decode(const u8* row, int k, int u, const u32*, U& v) {
        const int nb = k >> 5;
        u32 q[4];                       // the 16 nibble bytes; qh: bit j = 5th bit of weight j
        load_a16<4>(row + 16 * u, q);
        const u32 qh = ldw((const unsigned int*)(row + 16 * nb + 4 * u));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 lo = (q[i] & 0x0f0f0f0fu) | (spread4((qh >> (4 * i)) & 15u) << 4);
            const u32 hi = ((q[i] >> 4) & 0x0f0f0f0fu) | (spread4((qh >> (16 + 4 * i)) & 15u) << 4);
            v.w[i] = recentre<16>(lo);
            v.w[4 + i] = recentre<16>(hi);
        }
        v.d = ldf16(row + 20 * nb + 2 * u);
    }
    static __device__ __forceinline__ i32 ints(const U& v, const i32* x) { return TQ8_0::ints(v, x); }
    static __device__ __forceinline__ i32 mma_int(const U& v, i32 s) { return s; }
    static __device__ __forceinline__ void tail(const U& v, i32 s, float xd, float& a, float& b) { TQ8_0::tail(v, s, xd, a, b); }
    static __device__ __forceinline__ void deq(const U& v, float* o) { TQ4_0::deq(v, o); }
};

// Q4_K / Q5_K: unit = sub-blocks 2jj (w[0..7], low nibbles) and 2jj+1 (w[8..15], high nibbles) of a
// 256-block; value = d*sc*q - dmin*m. Blocks are 144 / 176 bytes, so 16-byte aligned.
struct KU { u32 w[16]; float d, dmin; int sc[2], m[2]; };
__device__ __forceinline__ void k4_head(const uint4 h, int jj, KU& v) {   // h: the block's d, dmin and 12 scale bytes
    v.d = f16_to_f32((u16)(h.x & 0xffffu));
    v.dmin = f16_to_f32((u16)(h.x >> 16));
    const u32 s[3] = {h.y, h.z, h.w};
    k4_scale_min2(s, jj, v.sc, v.m);
}
// sc = sum over the two sub-blocks of scale * (q . x), mn = sum of min * (sum of x)
__device__ __forceinline__ I2 k4_ints(const KU& v, const i32* x) {
    return I2{v.sc[0] * dot8w(v.w, x, 8) + v.sc[1] * dot8w(v.w + 8, x + 8, 8),
              v.m[0] * sum_bytes(x, 8) + v.m[1] * sum_bytes(x + 8, 8)};
}
__device__ __forceinline__ void k4_tail(const KU& v, I2 s, float xd, float& a, float& b) {
    a = xd;
    b = __fsub_rn(__fmul_rn(v.d, (float)s.sc), __fmul_rn(v.dmin, (float)s.mn));
}
__device__ __forceinline__ void k4_deq(const KU& v, float* o) {
    for (int h = 0; h < 2; ++h) {
        const float ds = __fmul_rn(v.d, (float)v.sc[h]), dm = __fmul_rn(v.dmin, (float)v.m[h]);
        for (int i = 0; i < 32; ++i) {
            const float q = (float)((v.w[8 * h + (i >> 2)] >> (8 * (i & 3))) & 0xffu);
            o[32 * h + i] = __fsub_rn(__fmul_rn(ds, q), dm);
        }
    }
}

struct TQ4_K : TBase<64, 256, 16> {
    static constexpr int MMA = MMA_K4, S = K4_S;
    typedef KU U;
    struct R { uint4 q[2], h; };                   // the pair's 32 quant bytes; d, dmin and the 12 scale bytes
    static __device__ __forceinline__ void fetch(const u8* row, int, int u, R& r) {
        const uint4* b = (const uint4*)(row + (size_t)(u >> 2) * 144);
        r.q[0] = ldw4(b + 1 + 2 * (u & 3));
        r.q[1] = ldw4(b + 2 + 2 * (u & 3));
        r.h = ldw4(b);
    }
    static __device__ __forceinline__ void unpack(const R& r, int u, U& v) {
        const u32 q[8] = {r.q[0].x, r.q[0].y, r.q[0].z, r.q[0].w, r.q[1].x, r.q[1].y, r.q[1].z, r.q[1].w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v.w[i] = q[i] & 0x0f0f0f0fu;
            v.w[8 + i] = (q[i] >> 4) & 0x0f0f0f0fu;
        }
        k4_head(r.h, u & 3, v);
    }
    static __device__ __forceinline__ void decode(const u8* row, int k, int u, const u32*, U& v) {
        R r;
        fetch(row, k, u, r);
        unpack(r, u, v);
    }
    typedef I2 I;
    static __device__ __forceinline__ I2 ints(const U& v, const i32* x) { return k4_ints(v, x); }
    static __device__ __forceinline__ void tail(const U& v, I2 s, float xd, float& a, float& b) { k4_tail(v, s, xd, a, b); }
    static __device__ __forceinline__ void deq(const U& v, float* o) { k4_deq(v, o); }
};

struct TQ5_K : TBase<64, 256, 16> {
    static constexpr int MMA = MMA_K4, S = K4_S;
    typedef KU U;
    static __device__ __forceinline__ void decode(const u8* row, int, int u, const u32*, U& v) {
        const int jj = u & 3;
        const u8* b = row + (size_t)(u >> 2) * 176;
        u32 q[8], h[8];                 // qs bytes of the pair; qh (bit j of byte k: 5th bit of weight k of sub-block j)
        load_a16<8>(b + 48 + 32 * jj, q);
        load_a16<8>(b + 16, h);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v.w[i] = (q[i] & 0x0f0f0f0fu) | (((h[i] >> (2 * jj)) & 0x01010101u) << 4);
            v.w[8 + i] = ((q[i] >> 4) & 0x0f0f0f0fu) | (((h[i] >> (2 * jj + 1)) & 0x01010101u) << 4);
        }
        k4_head(ldw4((const uint4*)b), jj, v);
    }
    typedef I2 I;
    static __device__ __forceinline__ I2 ints(const U& v, const i32* x) { return k4_ints(v, x); }
    static __device__ __forceinline__ void tail(const U& v, I2 s, float xd, float& a, float& b) { k4_tail(v, s, xd, a, b); }
    static __device__ __forceinline__ void deq(const U& v, float* o) { k4_deq(v, o); }
};

// Q6_K in its device layout (kernels/cuda/layouts.py: per row, planes lo | hi | scales | d, 16-byte aligned):
// unit u = the row's weights 32u .. 32u + 31, two 16-weight scale groups. Its 16 lo bytes carry the low nibbles
// of weights i (bits 0-3) and 16 + i (bits 4-7); hi word h byte b the top 2 bits of weight 16h + 4w + b at bits
// 2w: so word w of the unit (weights 4w .. 4w + 3) is one mask of a lo word and one shift and mask of a hi word.
struct TQ6_K : TBase<32, 256, 8> {
    static constexpr int MMA = MMA_Q6;
    struct U { u32 w[8]; float d; int sc[2]; };
    struct R { uint4 l; uint2 h; u32 s; u16 d; };   // the unit's fields, raw
    static __device__ __forceinline__ void fetch(const u8* row, int k, int u, R& r) {
        const int nb = k >> 8;                                // blocks per row
        r.l = ldw4((const uint4*)(row + 16 * u));
        r.h = __ldg((const uint2*)(row + 128 * nb + 8 * u));
        r.s = ld16(row + 192 * nb + 2 * u);
        r.d = ld16(row + 208 * nb + 2 * (u >> 3));
    }
    static __device__ __forceinline__ void unpack(const R& r, int, U& v) {
        const u32 lw[4] = {r.l.x, r.l.y, r.l.z, r.l.w};
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const u32 lo = (w < 4 ? lw[w] : lw[w - 4] >> 4) & 0x0f0f0f0fu;
            const u32 hb = (((w < 4 ? r.h.x : r.h.y) >> (2 * (w & 3))) & 0x03030303u) << 4;
            v.w[w] = recentre<32>(lo | hb);
        }
        v.sc[0] = (int)(i8)(r.s & 0xffu);
        v.sc[1] = (int)(i8)(r.s >> 8);
        v.d = f16_to_f32(r.d);
    }
    static __device__ __forceinline__ void decode(const u8* row, int k, int u, const u32*, U& v) {
        R r;
        fetch(row, k, u, r);
        unpack(r, u, v);
    }
    // the two 16-weight groups' scale * (q . x); a block's 8 units summed: |s| <= 256 * 32 * 128 * 127 < 2^28
    static __device__ __forceinline__ i32 ints(const U& v, const i32* x) {
        return v.sc[0] * dot8w(v.w, x, 4) + v.sc[1] * dot8w(v.w + 4, x + 4, 4);
    }
    static __device__ __forceinline__ void tail(const U& v, i32 s, float xd, float& a, float& b) {
        a = __fmul_rn(v.d, xd);
        b = (float)s;
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) {   // o: the row at offset(u)
        for (int c = 0; c < 2; ++c) {
            const float ds = __fmul_rn(v.d, (float)v.sc[c]);
            for (int i = 0; i < 16; ++i)
                o[16 * c + i] = __fmul_rn(ds, (float)(i8)(v.w[4 * c + (i >> 2)] >> (8 * (i & 3))));
        }
    }
};

// IQ3_XXS (98-byte blocks: d, 64 grid indices, 8 words of 4x7 sign bits + 4-bit scale) in its device layout
// (kernels/cuda/layouts.py: per group of 8 blocks, planes of the grid indices, the sign-and-scale words and the
// d's; a row's last group of r < 8 blocks has r-block planes): unit = sub-block.
struct TIQ3_XXS : TBase<32, 256, 8> {
    static constexpr bool GRID = true;
    struct U { u32 w[8]; float d4; i32 ls; };      // d / 4 (exact), the sub-block's scale 2 * l + 1
    static __device__ __forceinline__ void decode(const u8* row, int k, int u, const u32* grid, U& v) {
        const int nb = k >> 8, blk = u >> 3, g = blk >> 3, j = blk & 7, ib = u & 7;
        const int r = g < (nb >> 3) ? 8 : nb & 7;   // blocks in this group
        const u8* base = row + 784 * g;
        const uint2 q2 = __ldg((const uint2*)(base + 64 * j + 8 * ib));
        const u32 q[2] = {q2.x, q2.y}, aux = ldw((const unsigned int*)(base + 64 * r + 32 * j + 4 * ib));
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            u32 sg = (aux >> (7 * l)) & 127u;
            sg |= (__popc(sg) & 1u) << 7;               // ksigns_iq2xs[sg]
            const u32 qq = q[l >> 1] >> (16 * (l & 1));  // grid indices of weights 8l..8l+3 and 8l+4..8l+7
            v.w[2 * l] = neg_bytes(grid[qq & 0xffu], sg & 15u);
            v.w[2 * l + 1] = neg_bytes(grid[(qq >> 8) & 0xffu], sg >> 4);
        }
        v.d4 = __fmul_rn(ldf16(base + 96 * r + 2 * j), 0.25f);
        v.ls = 2 * (i32)(aux >> 28) + 1;
    }
    // ggml's weight is d * (0.5 + l) / 2 * grid * sign = d / 4 * (2l + 1) * (grid * sign): the integer part of
    // a unit is (2l + 1) * (q . x); a block's 8 units summed: |s| <= 256 * 31 * 62 * 127 < 2^26
    static __device__ __forceinline__ i32 ints(const U& v, const i32* x) { return v.ls * dot8w(v.w, x, 8); }
    static __device__ __forceinline__ i32 mma_int(const U& v, i32 s) { return v.ls * s; }
    static __device__ __forceinline__ void tail(const U& v, i32 s, float xd, float& a, float& b) {
        a = __fmul_rn(v.d4, xd);
        b = (float)s;
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) {   // db * grid, negated: exact as gguf's db*grid*sign
        const float db = __fmul_rn(__fmul_rn(__fmul_rn(v.d4, 4.0f), __fadd_rn(0.5f, (float)(v.ls >> 1))), 0.5f);
        for (int i = 0; i < 32; ++i) o[i] = __fmul_rn(db, (float)(i8)(v.w[i >> 2] >> (8 * (i & 3))));
    }
};

// A unit's loads apart from their decoding, for the types with such a split (T::R, T::fetch, T::unpack):
// fetch(row, k, u, tab, R&) issues the loads, unpack(R, row, k, u, tab, U&) decodes them. For the other types
// fetch does nothing and unpack decodes from the row (loads and all): a unit in flight cost Q8_0 more registers
// than it gained (small-token kernel 64 -> 80, 4096x14336 at 16 tokens 54.1 -> 61.8 us), Q5_K gained nothing.
// Users: the small-token kernel (qmatmul_mma.cu) and the explore build's pipelined one-token kernels (qmatmul.cu
// mm_q1, which had no gain from it: perf/kernel_notes.md, "One-token loops").
template <class T>
struct HasFetch {
    template <class X> __device__ static char test(typename X::R*);   // declarations only: sizeof needs no body
    template <class X> __device__ static int test(...);
    static constexpr bool value = sizeof(test<T>(nullptr)) == 1;
};
template <class T, bool SPLIT = HasFetch<T>::value>
struct Fetch {
    struct R {};
    static __device__ __forceinline__ void fetch(const u8*, int, int, const u32*, R&) {}
    static __device__ __forceinline__ void unpack(const R&, const u8* row, int k, int u, const u32* tab,
                                                  typename T::U& v) {
        T::decode(row, k, u, tab, v);
    }
};
template <class T>
struct Fetch<T, true> {
    typedef typename T::R R;
    static __device__ __forceinline__ void fetch(const u8* row, int k, int u, const u32*, R& r) {
        T::fetch(row, k, u, r);
    }
    static __device__ __forceinline__ void unpack(const R& r, const u8*, int, int u, const u32*, typename T::U& v) {
        T::unpack(r, u, v);
    }
};

// IQ3_XXS looks its grid up at 32 different indices per warp: from shared memory (constant memory would
// serialize them). Copied once per CTA, before any thread may leave. One copy: 32 bank-private copies (32 KB
// per CTA, one wavefront per lookup) measured 1.3x slower alone and 7x slower in the gate/up kernel on an H200
// (perf/kernel_notes.md): the shared-memory carveout they need takes the L1 that the weight loads rely on.
#define GRID_SMEM(T) __shared__ u32 grid[T::GRID ? 256 : 1]
template <class T>
__device__ __forceinline__ void load_grid(u32* sh) {
    if (T::GRID) {
        for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < 256; i += blockDim.x * blockDim.y)
            sh[i] = IQ3XXS_GRID[i];
        __syncthreads();
    }
}

// ------------------------------------------------------------------------------ output epilogue
// Where a mat-mul kernel puts output (token t, row) = s, the row's finished sum. Rows [0, c1) go to y0
// (n_tok, c1), [c1, c2) to y1 (n_tok, c2 - c1), [c2, n_out) to y2 (n_tok, n_out - c2): split_cols without
// its copies (c1 = c2 = n_out: all to y0). The value is s + bias[row] (bias given), added to what y holds
// when acc (the residual add). Each is the one rounding the separate add kernel would make, so the bits
// are those of mat-mul, then add. GLU kernels instead pair gate row i with up row i + n_out / 2 and put
// silu(gate) * up in y0 (n_tok, n_out / 2).
struct Out {
    float* y0;
    float* y1;
    float* y2;
    int c1, c2, acc;
    const float* bias;
    __device__ __forceinline__ void put(int t, int row, int n_out, float s) const {
        float* p = row < c1 ? y0 + (size_t)t * c1 + row
                 : row < c2 ? y1 + (size_t)t * (c2 - c1) + (row - c1)
                            : y2 + (size_t)t * (n_out - c2) + (row - c2);
        if (bias) s = __fadd_rn(s, bias[row]);
        *p = acc ? __fadd_rn(*p, s) : s;
    }
    __device__ __forceinline__ void glu(int t, int i, int half, float gate, float up) const {
        y0[(size_t)t * half + i] = silu_mul1(gate, up);
    }
};
#define OUT_PARAMS float *y0, float *y1, float *y2, int c1, int c2, const float *bias, int acc
#define OUT_ARGS Out{y0, y1, y2, c1, c2, acc, bias}
