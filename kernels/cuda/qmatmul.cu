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
// Weight loads go through __ldg (read-only path, and keeps the global address space that an address
// rounded through an integer would lose: generic loads otherwise).
__device__ __forceinline__ u16 ld16(const u8* p) { return __ldg((const unsigned short*)p); }   // p 2-byte aligned
__device__ __forceinline__ float ldf16(const u8* p) { return f16_to_f32(ld16(p)); }

// N little-endian words from a 2-byte aligned address: aligned 4-byte loads and a funnel shift. The word
// past the end is only read when p is misaligned (then it still lies inside the data's last word).
template <int N>
__device__ __forceinline__ void load_a2(const u8* p, u32* out) {
    const u32 mis = (u32)(unsigned long long)p & 2u;
    const unsigned int* q = (const unsigned int*)(p - mis);
    const u32 sh = mis * 8u;
    u32 w[N + 1];
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __ldg(q + i);
    w[N] = sh ? __ldg(q + N) : 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __funnelshift_r(w[i], w[i + 1], sh);
}
template <int N>   // N words from a 16-byte aligned address (N a multiple of 4)
__device__ __forceinline__ void load_a16(const void* p, u32* out) {
    const uint4* q = (const uint4*)p;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        const uint4 v = __ldg(q + i);
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
// Each type (over TBase: UNIT, XB, NW, offset, xload): decode(row, u, tab, U&) -> the unit's weights as packed int8 words in the order of its activations and
// its scales; dot(U, x words, token's xd, acc) -> acc plus the token's contribution; deq(U, row out +
// offset(u)) -> gguf's float values of the unit.
// `tab` is the CTA's shared copy of IQ3XXS_GRID (unused by the other types).

// UNIT weights per unit, activations in blocks of XB, NW int8 words of activations per unit per token
template <int UNIT_, int XB_, int NW_>
struct TBase {
    static constexpr int UNIT = UNIT_, XB = XB_, NW = NW_;
    static constexpr bool GRID = false;            // decode reads the IQ3_XXS grid (from shared memory)
    // offset of the unit's first weight in its row (= of its first activation in the token's row)
    static __device__ __forceinline__ int offset(int u) { return u * UNIT_; }
    // the unit's activations of one token row xr, in decode's weight order (contiguous for all but Q6_K)
    static __device__ __forceinline__ void xload(const i8* xr, int u, i32* x) {
        load_a16<NW_>(xr + offset(u), (u32*)x);
    }
};

struct TQ8_0 : TBase<32, 32, 8> {
    struct U { u32 w[8]; float d; };
    static __device__ __forceinline__ void decode(const u8* row, int u, const u32*, U& v) {
        const u8* b = row + (size_t)u * 34;
        load_a2<8>(b + 2, v.w);
        v.d = ldf16(b);
    }
    static __device__ __forceinline__ float dot(const U& v, const i32* x, float xd, float acc) {
        return __fmaf_rn(__fmul_rn(v.d, xd), (float)dot8w(v.w, x, 8), acc);
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) {
        for (int i = 0; i < 32; ++i) o[i] = __fmul_rn((float)(i8)(v.w[i >> 2] >> (8 * (i & 3))), v.d);
    }
};

// Q4_0, IQ4_NL, Q5_0: weight j and j+16 of a block share byte j (low / high nibble)
struct TQ4_0 : TBase<32, 32, 8> {
    typedef TQ8_0::U U;
    static __device__ __forceinline__ void decode(const u8* row, int u, const u32*, U& v) {
        const u8* b = row + (size_t)u * 18;
        u32 q[4];
        load_a2<4>(b + 2, q);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v.w[i] = recentre<8>(q[i] & 0x0f0f0f0fu);
            v.w[4 + i] = recentre<8>((q[i] >> 4) & 0x0f0f0f0fu);
        }
        v.d = ldf16(b);
    }
    static __device__ __forceinline__ float dot(const U& v, const i32* x, float xd, float acc) {
        return TQ8_0::dot(v, x, xd, acc);
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) {
        for (int i = 0; i < 32; ++i) o[i] = __fmul_rn(v.d, (float)(i8)(v.w[i >> 2] >> (8 * (i & 3))));
    }
};

struct TIQ4_NL : TBase<32, 32, 8> {
    typedef TQ4_0::U U;
    static __device__ __forceinline__ void decode(const u8* row, int u, const u32*, U& v) {
        const u8* b = row + (size_t)u * 18;
        u32 q[4];
        load_a2<4>(b + 2, q);
        const u32 t[4] = {IQ4NL_VALUES[0], IQ4NL_VALUES[1], IQ4NL_VALUES[2], IQ4NL_VALUES[3]};
#pragma unroll
        for (int i = 0; i < 4; ++i) lookup16(q[i], t, v.w[i], v.w[4 + i]);
        v.d = ldf16(b);
    }
    static __device__ __forceinline__ float dot(const U& v, const i32* x, float xd, float acc) {
        return TQ4_0::dot(v, x, xd, acc);
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) { TQ4_0::deq(v, o); }
};

struct TQ5_0 : TBase<32, 32, 8> {
    typedef TQ4_0::U U;
    static __device__ __forceinline__ void decode(const u8* row, int u, const u32*, U& v) {
        const u8* b = row + (size_t)u * 22;
        u32 q[5];                       // qh (bit j: 5th bit of weight j), then the 16 nibble bytes
        load_a2<5>(b + 2, q);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 lo = (q[1 + i] & 0x0f0f0f0fu) | (spread4((q[0] >> (4 * i)) & 15u) << 4);
            const u32 hi = ((q[1 + i] >> 4) & 0x0f0f0f0fu) | (spread4((q[0] >> (16 + 4 * i)) & 15u) << 4);
            v.w[i] = recentre<16>(lo);
            v.w[4 + i] = recentre<16>(hi);
        }
        v.d = ldf16(b);
    }
    static __device__ __forceinline__ float dot(const U& v, const i32* x, float xd, float acc) {
        return TQ4_0::dot(v, x, xd, acc);
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) { TQ4_0::deq(v, o); }
};

// Q4_K / Q5_K: unit = sub-blocks 2jj (w[0..7], low nibbles) and 2jj+1 (w[8..15], high nibbles) of a
// 256-block; value = d*sc*q - dmin*m. Blocks are 144 / 176 bytes, so 16-byte aligned.
struct KU { u32 w[16]; float d, dmin; int sc[2], m[2]; };
__device__ __forceinline__ void k4_head(const u8* b, int jj, KU& v) {
    const u32 dd = __ldg((const unsigned int*)b);
    v.d = f16_to_f32((u16)(dd & 0xffffu));
    v.dmin = f16_to_f32((u16)(dd >> 16));
    const unsigned int* sp = (const unsigned int*)(b + 4);
    const u32 s[3] = {__ldg(sp), __ldg(sp + 1), __ldg(sp + 2)};
    k4_scale_min2(s, jj, v.sc, v.m);
}
__device__ __forceinline__ float k4_dot(const KU& v, const i32* x, float xd, float acc) {
    const i32 isc = v.sc[0] * dot8w(v.w, x, 8) + v.sc[1] * dot8w(v.w + 8, x + 8, 8);
    const i32 imn = v.m[0] * sum_bytes(x, 8) + v.m[1] * sum_bytes(x + 8, 8);
    return __fmaf_rn(xd, __fsub_rn(__fmul_rn(v.d, (float)isc), __fmul_rn(v.dmin, (float)imn)), acc);
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
    typedef KU U;
    static __device__ __forceinline__ void decode(const u8* row, int u, const u32*, U& v) {
        const int jj = u & 3;
        const u8* b = row + (size_t)(u >> 2) * 144;
        u32 q[8];
        load_a16<8>(b + 16 + 32 * jj, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v.w[i] = q[i] & 0x0f0f0f0fu;
            v.w[8 + i] = (q[i] >> 4) & 0x0f0f0f0fu;
        }
        k4_head(b, jj, v);
    }
    static __device__ __forceinline__ float dot(const U& v, const i32* x, float xd, float acc) { return k4_dot(v, x, xd, acc); }
    static __device__ __forceinline__ void deq(const U& v, float* o) { k4_deq(v, o); }
};

struct TQ5_K : TBase<64, 256, 16> {
    typedef KU U;
    static __device__ __forceinline__ void decode(const u8* row, int u, const u32*, U& v) {
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
        k4_head(b, jj, v);
    }
    static __device__ __forceinline__ float dot(const U& v, const i32* x, float xd, float acc) { return k4_dot(v, x, xd, acc); }
    static __device__ __forceinline__ void deq(const U& v, float* o) { k4_deq(v, o); }
};

// Q6_K (210-byte blocks: ql[128] qh[64] int8 scales[16] d): unit (n, q) = u & 7 of block u >> 3 takes
// positions 8q..8q+7 of the four 32-weight chunks c = 4n+0..3, i.e. block offsets 128n + 32c + 8q + 0..7,
// so that its 24 bytes (8 of ql at 64n+8q, 8 at 64n+32+8q, 8 of qh at 128+32n+8q) are read by no other
// unit. w[2c], w[2c+1]: chunk c's 8 weights (q - 32), sc[c] its 16-group scale 8n + 2c + (q >> 1).
struct TQ6_K : TBase<32, 256, 8> {
    struct U { u32 w[8]; float d; int sc[4]; };
    static __device__ __forceinline__ void decode(const u8* row, int u, const u32*, U& v) {
        const int n = (u >> 2) & 1, q = u & 3;
        const u8* b = row + (size_t)(u >> 3) * 210;
        u32 la[2], lb[2], h[2], s[2];
        load_a2<2>(b + 64 * n + 8 * q, la);
        load_a2<2>(b + 64 * n + 32 + 8 * q, lb);
        load_a2<2>(b + 128 + 32 * n + 8 * q, h);
        load_a2<2>(b + 192 + 8 * n, s);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 l = c & 1 ? lb[i] : la[i];
                const u32 ql = (c >> 1 ? l >> 4 : l) & 0x0f0f0f0fu;
                const u32 qh = ((h[i] >> (2 * c)) & 0x03030303u) << 4;
                v.w[2 * c + i] = recentre<32>(ql | qh);
            }
            const int sb = 2 * c + (q >> 1);                 // byte of the 8 scale bytes of this n
            v.sc[c] = (int)(i8)((s[sb >> 2] >> (8 * (sb & 3))) & 0xffu);
        }
        v.d = ldf16(b + 208);
    }
    static __device__ __forceinline__ int offset(int u) { return (u >> 3) * 256 + 128 * ((u >> 2) & 1) + 8 * (u & 3); }
    static __device__ __forceinline__ void xload(const i8* xr, int u, i32* x) {   // 4 runs of 8, in c order
        const i8* p = xr + offset(u);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int2 r = *(const int2*)(p + 32 * c);
            x[2 * c] = r.x;
            x[2 * c + 1] = r.y;
        }
    }
    static __device__ __forceinline__ float dot(const U& v, const i32* x, float xd, float acc) {
        i32 s = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) s += v.sc[c] * dot8w(v.w + 2 * c, x + 2 * c, 2);
        return __fmaf_rn(__fmul_rn(v.d, xd), (float)s, acc);
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) {   // o: the row at offset(u)
        for (int c = 0; c < 4; ++c) {
            const float ds = __fmul_rn(v.d, (float)v.sc[c]);
            for (int i = 0; i < 8; ++i)
                o[32 * c + i] = __fmul_rn(ds, (float)(i8)(v.w[2 * c + (i >> 2)] >> (8 * (i & 3))));
        }
    }
};

// IQ3_XXS (98-byte blocks: d, 64 grid indices, 8 words of 4x7 sign bits + 4-bit scale): unit = sub-block.
struct TIQ3_XXS : TBase<32, 256, 8> {
    static constexpr bool GRID = true;
    struct U { u32 w[8]; float db; };
    static __device__ __forceinline__ void decode(const u8* row, int u, const u32* grid, U& v) {
        const int ib = u & 7;
        const u8* b = row + (size_t)(u >> 3) * 98;
        u32 q[2], aux;
        load_a2<2>(b + 2 + 8 * ib, q);
        load_a2<1>(b + 66 + 4 * ib, &aux);
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            u32 sg = (aux >> (7 * l)) & 127u;
            sg |= (__popc(sg) & 1u) << 7;               // ksigns_iq2xs[sg]
            const u32 qq = q[l >> 1] >> (16 * (l & 1));  // grid indices of weights 8l..8l+3 and 8l+4..8l+7
            v.w[2 * l] = neg_bytes(grid[qq & 0xffu], sg & 15u);
            v.w[2 * l + 1] = neg_bytes(grid[(qq >> 8) & 0xffu], sg >> 4);
        }
        v.db = __fmul_rn(__fmul_rn(ldf16(b), __fadd_rn(0.5f, (float)(aux >> 28))), 0.5f);
    }
    static __device__ __forceinline__ float dot(const U& v, const i32* x, float xd, float acc) {
        return __fmaf_rn(__fmul_rn(v.db, xd), (float)dot8w(v.w, x, 8), acc);
    }
    static __device__ __forceinline__ void deq(const U& v, float* o) {   // db * grid, negated: exact as gguf's db*grid*sign
        for (int i = 0; i < 32; ++i) o[i] = __fmul_rn(v.db, (float)(i8)(v.w[i >> 2] >> (8 * (i & 3))));
    }
};

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

// IQ3_XXS looks its grid up at 32 different indices per warp: from shared memory (constant memory would
// serialize them). Copied once per CTA, before any thread may leave.
template <class T>
__device__ __forceinline__ void load_grid(u32* sh) {
    if (T::GRID) {
        for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < 256; i += blockDim.x * blockDim.y)
            sh[i] = IQ3XXS_GRID[i];
        __syncthreads();
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
