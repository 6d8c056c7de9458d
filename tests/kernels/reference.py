"""Float64 numpy references for the elementwise and attention kernels (tests only)."""
import numpy as np


def rmsnorm(x, weight, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(np.float64)


def rope(x, positions, freq_base, n_rot, neox):
    """x (n_tok, n_heads, head_dim); angles theta_i = pos * base^(-2i/n_rot) in float64."""
    x = x.astype(np.float64).copy()
    half = n_rot // 2
    inv = float(freq_base) ** (-2.0 * np.arange(half) / n_rot)
    theta = positions.astype(np.float64)[:, None] * inv[None, :]          # (n_tok, half)
    c = np.cos(theta)[:, None, :]
    s = np.sin(theta)[:, None, :]
    if neox:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = 2 * np.arange(half), 2 * np.arange(half) + 1
    a, b = x[..., i0].copy(), x[..., i1].copy()
    x[..., i0] = a * c - b * s
    x[..., i1] = a * s + b * c
    return x


def silu_mul(gate, up):
    g = gate.astype(np.float64)
    with np.errstate(over="ignore"):                 # exp(-g) -> inf gives silu -> -0
        return g / (1.0 + np.exp(-g)) * up.astype(np.float64)


def quantize_rows(x, n_groups):
    """Symmetric int8 per group of the last axis (n_groups equal groups), computed exactly as the
    kernel specifies in float32: scale = max|x|/127, q = round-half-away(x/scale) clipped to +-127.
    -> (q with x's shape, scales (..., n_groups))."""
    x = x.astype(np.float32)
    xg = x.reshape(x.shape[:-1] + (n_groups, x.shape[-1] // n_groups))
    amax = np.max(np.abs(xg), axis=-1, keepdims=True)
    scale = amax / np.float32(127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(scale > 0, xg / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    r = np.trunc(y)
    r = np.where(np.abs(y - r) >= 0.5, r + np.sign(y), r)
    q = np.clip(r, -127, 127).astype(np.int8)
    return q.reshape(x.shape), scale[..., 0]


def dequantize_groups(q, scales):
    """float64 q * scale, each scale covering its group of the last axis."""
    ng = scales.shape[-1]
    qg = q.astype(np.float64).reshape(q.shape[:-1] + (ng, q.shape[-1] // ng))
    return (qg * scales.astype(np.float64)[..., None]).reshape(q.shape)


def gather_kv(pages, scales, page_table_row, n_pos):
    """Dequantized (n_pos, n_kv_heads, head_dim) float64 of one sequence's first n_pos positions."""
    ps = pages.shape[1]
    p = np.arange(n_pos)
    pg = page_table_row[p // ps]
    sl = p % ps
    return dequantize_groups(pages[pg, sl], scales[pg, sl])


# Rounding to f16 (11 significant bits): within 2^-11 of the value. The CUDA attention kernels round the
# weights P' of the p.V products to one f16 (kernels/cuda/attention.cu phase_values), moving each weight by
# that, so each output by at most 2^-11 of the same sum over |V| (attention(..., magnitudes=True)); the A/B
# build `q16` (kernels/cuda/attention.py BUILDS) also rounds q' of the q.k products, moving each score by at most
# D = 2^-11 x score_magnitudes, so each weight by a factor within exp(+-2D) and each output by at most
# ((1 + 2^-11) exp(2D) - 1) times the sum over |V| (exp(2D) - 1 without the weights' rounding).
F16_ROUNDING = 2.0 ** -11


def attention(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, magnitudes=False):
    """Causal GQA attention in float64 over the dequantized int8 cache (magnitudes: the same weights over |V|,
    sum p |v| / l per output: what rounding each weight by a relative e moves an output by at most e times)."""
    n_tok, n_heads, hd = q.shape
    n_kv = k_pages.shape[2]
    G = n_heads // n_kv
    out = np.empty((n_tok, n_heads, hd), np.float64)
    for t in range(n_tok):
        s, p = int(token_seq[t]), int(token_pos[t])
        K = gather_kv(k_pages, k_scales, page_tables[s], p + 1)
        V = gather_kv(v_pages, v_scales, page_tables[s], p + 1)
        for h in range(n_heads):
            g = h // G
            sc = K[:, g, :] @ q[t, h].astype(np.float64) * scale
            w = np.exp(sc - sc.max())
            w /= w.sum()
            out[t, h] = w @ (np.abs(V[:, g, :]) if magnitudes else V[:, g, :])
    return out


def score_magnitudes(q, token_seq, token_pos, page_tables, k_pages, k_scales, scale):
    """(n_tok, n_heads): the largest over each token's keys of scale x sum |q_i k_i| (float64, dequantized K)."""
    n_tok, n_heads, hd = q.shape
    G = n_heads // k_pages.shape[2]
    out = np.empty((n_tok, n_heads), np.float64)
    for t in range(n_tok):
        K = np.abs(gather_kv(k_pages, k_scales, page_tables[int(token_seq[t])], int(token_pos[t]) + 1))
        for h in range(n_heads):
            out[t, h] = (K[:, h // G, :] @ np.abs(q[t, h].astype(np.float64))).max() * scale
    return out


def f16_rounding_bound(p_f16, q_f16, q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                       scale):
    """What rounding the weights P' (p_f16) and q' (q_f16) to one f16 moves each attention output by at most
    (F16_ROUNDING above), per output: 0 where neither is rounded."""
    if not (p_f16 or q_f16):
        return 0.0
    mag = attention(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, True)
    p_part = F16_ROUNDING if p_f16 else 0.0
    if not q_f16:
        return p_part * mag
    d = F16_ROUNDING * score_magnitudes(q, token_seq, token_pos, page_tables, k_pages, k_scales, scale)
    return ((1 + p_part) * np.exp(2 * d)[..., None] - 1) * mag


def f16_flash_bound(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale):
    """What kernels/cuda/attention_f16.py moves each output by at most: q' and K rounded to f16 move each product
    q_i k_i by a relative (1 + 2^-11)^2 - 1, so each score by D = that x score_magnitudes and each weight by a
    factor within exp(+-2D); the weights p and V rounded to f16 move each p v by (1 + 2^-11)^2 - 1: in all
    ((1 + 2^-11)^2 exp(2D) - 1) x sum p |v| / l. Plus what f16 subnormals lose (weights or values below 2^-14 are
    rounded to 2^-24 absolute): at most 2^-24 x max |V| per key (l >= 1)."""
    e2 = (1 + F16_ROUNDING) ** 2
    mag = attention(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, True)
    d = (e2 - 1) * score_magnitudes(q, token_seq, token_pos, page_tables, k_pages, k_scales, scale)
    vmax = np.abs(dequantize_groups(v_pages, v_scales)).max()
    keys = np.asarray(token_pos, np.float64) + 1
    return (e2 * np.exp(2 * d)[..., None] - 1) * mag + (keys * 2.0 ** -24 * vmax)[:, None, None]


def assert_within(got, want, rtol, atol):
    """|got - want| <= rtol |want| + atol elementwise, atol a scalar or an array broadcast against want (what
    numpy's assert_allclose does not take: its message formats atol as a number); NaN fails."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    lim = rtol * np.abs(want) + atol
    bad = ~(np.abs(got - want) <= lim)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, np.abs(got - want) - lim, -np.inf)), bad.shape)
        raise AssertionError(f"{int(bad.sum())} of {bad.size} elements outside rtol {rtol:g} + atol; worst at {i}: "
                             f"got {got[i]!r}, want {want[i]!r}, allowed {np.broadcast_to(lim, bad.shape)[i]!r}")


def round_query(q, path):
    """q (..., head_dim) float32 as attention's q.k path multiplies it (kernels/cpu/attention_int8.py), per
    32 channels: "int8" as ggml's Q8_0 (act_reference.ref_q8_0), "int16" q = rint(x / d) * d with
    d = max|x| / 32767 in float32; "float": q itself."""
    from act_reference import ref_q8_0
    if path == "float":
        return q
    if path == "int8":
        return ref_q8_0(q.reshape(-1, q.shape[-1])).reshape(q.shape)
    b = q.reshape(q.shape[:-1] + (-1, 32)).astype(np.float32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(32767)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(q.shape)
