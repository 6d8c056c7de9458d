// Rotary embedding, shared by elementwise.cu (rope_f32, rope_qk_f32) and kv_store.cu (rope_kv_store): one
// definition, so every kernel that rotates a head gives the same bits.
#pragma once
#include "common.cuh"

// In place on x (n_tok, n_heads, head_dim), one CTA per token (grid n_tok). As the CPU kernel:
// theta_i = pos * freq_base^((-2 i) / n_rot) and its cos/sin in double, rounded to float once per
// (token, i) into shared memory, then a float rotation of each pair: (i, i + n_rot/2) when neox,
// else (2i, 2i+1). channel_scale (n_heads, head_dim) or null: afterwards every channel of the token
// (rotated or not) is multiplied by its factor (K smoothing folded into rope).
// The cos/sin come from a table (tab (tab_rows, n_rot / 2) of rope_table_f32's values) for positions it
// holds; others are computed here by the same code: the double pow/cos/sin is the slow part of the kernel.
#define ROPE_MAX_HALF 256

struct alignas(8) CS { float c, s; };

__device__ __forceinline__ CS rope_angle(int pos, int i, double freq_base, int n_rot) {
    const double th = (double)pos * pow(freq_base, (-2.0 * i) / (double)n_rot);
    return CS{(float)cos(th), (float)sin(th)};
}

// cos / sin of the token's angles into shared memory (one CTA per token)
__device__ __forceinline__ void rope_angles(float* cs, float* sn, int pos, double freq_base, int n_rot,
                                            const CS* tab, int tab_rows) {
    const int half = n_rot / 2;
    const bool from_tab = tab != nullptr && pos < tab_rows;      // the same for the whole CTA
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const CS a = from_tab ? tab[(i64)pos * half + i] : rope_angle(pos, i, freq_base, n_rot);
        cs[i] = a.c;
        sn[i] = a.s;
    }
    __syncthreads();
}

// rotate (and scale) the n_heads heads of one token xt; explicit roundings, so every kernel that calls
// it gives the same bits
__device__ __forceinline__ void rope_heads(float* xt, int n_heads, int head_dim, int n_rot, int neox,
                                           const float* channel_scale, const float* cs, const float* sn) {
    const int half = n_rot / 2;
    for (int k = threadIdx.x; k < n_heads * half; k += blockDim.x) {
        const int h = k / half, i = k % half;
        const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float* xh = xt + h * head_dim;
        const float a = xh[i0], b = xh[i1], c = cs[i], s = sn[i];
        float r0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)), r1 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
        if (channel_scale) {
            r0 = __fmul_rn(r0, channel_scale[h * head_dim + i0]);
            r1 = __fmul_rn(r1, channel_scale[h * head_dim + i1]);
        }
        xh[i0] = r0;
        xh[i1] = r1;
    }
    if (channel_scale && n_rot < head_dim) {      // the channels rope leaves alone
        const int rest = head_dim - n_rot;
        for (int k = threadIdx.x; k < n_heads * rest; k += blockDim.x) {
            const int h = k / rest, j = n_rot + k % rest;
            xt[h * head_dim + j] = __fmul_rn(xt[h * head_dim + j], channel_scale[h * head_dim + j]);
        }
    }
}
