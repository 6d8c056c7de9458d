// Quantized mat-mul y = x @ W.T for prompt chunks on the tensor cores (int8 mma.sync m16n8k32), over the
// same raw GGUF blocks and ggml-rounded int8 activations as the dp4a kernels of qmatmul.cu, and with the
// same bits: every output equals the dp4a kernel's for the same row and token, so a token's logits do not
// depend on which kernel its step took (batch invariance; the launcher picks by token count).
//
// How the bits are kept. The dp4a kernel gives unit u of a row to lane u % 32, which adds the unit's
// contributions in order, fin(U, ints, xd, acc) per unit (qmatmul_types.cuh), and then sums the 32 lane
// partials with warp_sum's xor tree: lane 0 ends with ((p0 + p16) + (p8 + p24)) + ... Here a thread owns
// whole outputs, so it walks the units class by class: class l = the units l, l + 32, ... (the dp4a
// kernel's lane l), classes visited in bit-reversed order (0, 16, 8, 24, 4, ...), and each finished class
// sum is pushed onto a 5-level pairwise stack, which adds exactly the pairs of the xor tree. The integer
// parts come from mma instead of dp4a: integer sums are exact, so they are equal whatever the order.
//
// Work split: a warp takes 32 weight rows (two m16 tiles; lane r decodes row r's unit into shared memory)
// by 8 * NB tokens (NB n8 tiles); MMA_WARPS warps per CTA along the rows; grid (token tiles, row tiles)
// (GLU kernels: the first m16 tile holds 16 gate rows i.., the second the up rows i + n_out / 2.., so one
// thread ends with both sums of an output of silu(gate) * up; Out in qmatmul_types.cuh)
// so that the CTAs sharing weight rows run together and find them in L2. No CTA-wide barrier after the
// IQ3_XXS grid copy: each warp only syncs with itself.
#include "qmatmul_types.cuh"

#define MMA_WARPS 4

// d (16x8, s32) = a (16x32, s8, row-major) . b (32x8, s8, column-major). Fragments (lane = 4 * g + t):
// a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..]; b0 = B[4t..4t+3][g],
// b1 = B[16+4t..][g]; d0 = D[g][2t], d1 = D[g][2t+1], d2 = D[g+8][2t], d3 = D[g+8][2t+1].
__device__ __forceinline__ void mma_s8(i32* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

// A fragment of words w0..w0+7 of rows ra (g) and rb (g + 8); keep(word index) zeroes the others
// (Q6_K takes its four 8-weight chunks in separate products).
template <class U>
__device__ __forceinline__ void a_frag(const U& ra, const U& rb, int w0, int t, u32 keep_lo, u32 keep_hi,
                                       u32* a) {
    a[0] = ra.w[w0 + t] & keep_lo;
    a[1] = rb.w[w0 + t] & keep_lo;
    a[2] = ra.w[w0 + 4 + t] & keep_hi;
    a[3] = rb.w[w0 + 4 + t] & keep_hi;
}

// W (n_out, row_bytes) u8; xq (n_tok, k) int8; xd (n_tok, k / XB) f32.
// grid (cdiv(n_tok, 8 * NB), cdiv(n_out, 32 * MMA_WARPS)) (GLU: cdiv(n_out / 2, 16 * MMA_WARPS)),
// block (32, MMA_WARPS).
template <class T, int NB, bool GLU>
__device__ __forceinline__ void mmq(const u8* __restrict__ W, int row_bytes, int n_out, int k,
                                    const i8* __restrict__ xq, const float* __restrict__ xd, int n_tok,
                                    const Out& o, const u32* tab, typename T::U* su) {
    typedef typename T::U U;
    constexpr int NO = 2 * NB * 4;                 // outputs per thread: m tile (2) x n tile (NB) x d register (4)
    constexpr int WROWS = GLU ? 16 : 32;           // output rows per warp
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3, half = n_out / 2;
    const int r0 = (blockIdx.y * MMA_WARPS + threadIdx.y) * WROWS, t0 = blockIdx.x * (8 * NB);
    if (r0 >= (GLU ? half : n_out)) return;        // whole warps
    const int my_row = GLU ? min(r0 + (lane & 15), half - 1) + (lane < 16 ? 0 : half) : min(r0 + lane, n_out - 1);
    const u8* wr = W + (size_t)my_row * row_bytes; // the row this lane decodes
    const int n_units = k / T::UNIT, n_xd = k / T::XB, upx = T::XB / T::UNIT;
    const i8* xb[NB];                              // B fragments: token g of each n tile
    const float* xs[NB][2];                        // scales of the tokens of this thread's outputs: 2t, 2t + 1
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        xb[nb] = xq + (size_t)min(t0 + 8 * nb + g, n_tok - 1) * k;
#pragma unroll
        for (int j = 0; j < 2; ++j) xs[nb][j] = xd + (size_t)min(t0 + 8 * nb + 2 * t + j, n_tok - 1) * n_xd;
    }
    float stk[5][NO];                              // the pairwise stack of class sums (level j: 2^j classes);
                                                   // stk[0] ends holding the total (free after the last class)
    for (int i = 0; i < 32; ++i) {
        const int l = __brev(i) >> 27;             // class visited i-th: the xor tree's leaf order
        float ch[NO];
#pragma unroll
        for (int o = 0; o < NO; ++o) ch[o] = 0.0f;
        for (int u = l; u < n_units; u += 32) {
            U v;
            T::decode(wr, u, tab, v);
            __syncwarp();                          // the previous unit's readers are done
            su[lane] = v;
            __syncwarp();
            float xdv[NB][2];
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                xdv[nb][0] = __ldg(xs[nb][0] + u / upx);
                xdv[nb][1] = __ldg(xs[nb][1] + u / upx);
            }
            // activation sums per sub-block (Q4_K/Q5_K mins): a product with all-ones weights
            i32 sx[NB][2][4];
            if constexpr (T::MMA == MMA_K4) {
#pragma unroll
                for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        mma_s8(sx[nb][h], 0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u,
                               T::xword(xb[nb], u, 8 * h + t), T::xword(xb[nb], u, 8 * h + 4 + t));
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const U& ra = su[16 * mt + g];
                const U& rb = su[16 * mt + g + 8];
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    float* c = ch + 4 * (NB * mt + nb);
                    if constexpr (T::MMA == MMA_ONE) {
                        u32 a[4];
                        i32 d[4];
                        a_frag(ra, rb, 0, t, ~0u, ~0u, a);
                        mma_s8(d, a[0], a[1], a[2], a[3], T::xword(xb[nb], u, t), T::xword(xb[nb], u, 4 + t));
#pragma unroll
                        for (int r = 0; r < 4; ++r) c[r] = T::fin(r < 2 ? ra : rb, d[r], xdv[nb][r & 1], c[r]);
                    } else if constexpr (T::MMA == MMA_K4) {
                        u32 a[4];
                        i32 d0[4], d1[4];
                        a_frag(ra, rb, 0, t, ~0u, ~0u, a);
                        mma_s8(d0, a[0], a[1], a[2], a[3], T::xword(xb[nb], u, t), T::xword(xb[nb], u, 4 + t));
                        a_frag(ra, rb, 8, t, ~0u, ~0u, a);
                        mma_s8(d1, a[0], a[1], a[2], a[3], T::xword(xb[nb], u, 8 + t), T::xword(xb[nb], u, 12 + t));
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            const U& q = r < 2 ? ra : rb;
                            const i32 isc = q.sc[0] * d0[r] + q.sc[1] * d1[r];
                            const i32 imn = q.m[0] * sx[nb][0][r] + q.m[1] * sx[nb][1][r];
                            c[r] = T::fin(q, isc, imn, xdv[nb][r & 1], c[r]);
                        }
                    } else {                       // MMA_Q6: chunk cc = words 2cc, 2cc + 1, scale sc[cc]
                        i32 s[4] = {0, 0, 0, 0};
                        const u32 b0 = T::xword(xb[nb], u, t), b1 = T::xword(xb[nb], u, 4 + t);
#pragma unroll
                        for (int cc = 0; cc < 4; ++cc) {
                            u32 a[4];
                            i32 d[4];
                            a_frag(ra, rb, 0, t, (t >> 1) == cc ? ~0u : 0u, 2 + (t >> 1) == cc ? ~0u : 0u, a);
                            mma_s8(d, a[0], a[1], a[2], a[3], b0, b1);
#pragma unroll
                            for (int r = 0; r < 4; ++r) s[r] += (r < 2 ? ra : rb).sc[cc] * d[r];
                        }
#pragma unroll
                        for (int r = 0; r < 4; ++r) c[r] = T::fin(r < 2 ? ra : rb, s[r], xdv[nb][r & 1], c[r]);
                    }
                }
            }
        }
        // push the class sums: level j holds the sum of 2^j classes until its partner arrives
#pragma unroll
        for (int o = 0; o < NO; ++o) {
            float v = ch[o];
            if (!(i & 1)) { stk[0][o] = v; continue; }
            v = __fadd_rn(stk[0][o], v);
            if (!(i & 2)) { stk[1][o] = v; continue; }
            v = __fadd_rn(stk[1][o], v);
            if (!(i & 4)) { stk[2][o] = v; continue; }
            v = __fadd_rn(stk[2][o], v);
            if (!(i & 8)) { stk[3][o] = v; continue; }
            v = __fadd_rn(stk[3][o], v);
            if (!(i & 16)) { stk[4][o] = v; continue; }
            stk[0][o] = __fadd_rn(stk[4][o], v);
        }
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int tok = t0 + 8 * nb + 2 * t + (r & 1);
            if (tok >= n_tok) continue;
            if constexpr (GLU) {
                const int i = r0 + g + 8 * (r >> 1);
                if (i < half) o.glu(tok, i, half, stk[0][4 * nb + r], stk[0][4 * (NB + nb) + r]);
            } else {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const int row = r0 + 16 * mt + g + 8 * (r >> 1);
                    if (row < n_out) o.put(tok, row, n_out, stk[0][4 * (NB * mt + nb) + r]);
                }
            }
        }
}

#define MMQ_KERNEL(NAME, T, NB, GLU, PREFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS) PREFIX##_##NAME##_n##NB(                \
        const u8* __restrict__ W, int row_bytes, int n_out, int k, const i8* __restrict__ xq,             \
        const float* __restrict__ xd, int n_tok, OUT_PARAMS) {                                            \
        GRID_SMEM(T);                                                                                     \
        __shared__ T::U su[MMA_WARPS][32];                                                                \
        load_grid<T>(grid);                                                                               \
        grid_dependency_sync();                                                                           \
        mmq<T, NB, GLU>(W, row_bytes, n_out, k, xq, xd, n_tok, OUT_ARGS, grid, su[threadIdx.y]);          \
    }
#define MMQ_KERNELS(NAME, T) MMQ_KERNEL(NAME, T, 1, false, mmq) MMQ_KERNEL(NAME, T, 2, false, mmq) \
    MMQ_KERNEL(NAME, T, 1, true, mmqglu) MMQ_KERNEL(NAME, T, 2, true, mmqglu)

MMQ_KERNELS(q8_0, TQ8_0)
MMQ_KERNELS(q4_0, TQ4_0)
MMQ_KERNELS(q5_0, TQ5_0)
MMQ_KERNELS(iq4_nl, TIQ4_NL)
MMQ_KERNELS(q4_k, TQ4_K)
MMQ_KERNELS(q5_k, TQ5_K)
MMQ_KERNELS(q6_k, TQ6_K)
MMQ_KERNELS(iq3_xxs, TIQ3_XXS)
