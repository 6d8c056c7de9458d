"""Numba CUDA kernels of sampling.py (penalties + argmax + log-sum-exp per row; count-table updates).

Imported only by sampling.py, and only when sampling runs: importing this imports numba.cuda. The kernels
reference the module-level `cuda` so numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1) can run them on
numpy arrays, with a small CTA there since every simulated thread is a Python thread.
"""
import math

from numba import config, cuda, float32, float64, int32

BLOCK = 32 if config.ENABLE_CUDASIM else 1024     # threads per row (a power of two)
# columns of the per-row parameter table (float64: holds the f32 and i32 values exactly)
P_PRESENCE, P_FREQUENCY, P_COUNT_ROW, P_N_LOGPROBS, P_SLOT = range(5)
N_PARAMS = 5


@cuda.jit(device=True)
def _visit(x, j, r, counts, crow, presence, frequency, z, slot, bv, bi, mx):
    """One logit x = logits[r, j]: penalize, store to the slot's row, keep the running best and raw max."""
    mx = max(mx, x)
    v = float64(x)
    if crow >= 0:
        c = counts[crow, j]
        if c > 0:                    # z -= frequency * c + presence * (c > 0), as the CPU does
            v -= frequency * c + presence
    if slot >= 0:
        z[slot, j] = v
    if v > bv:                       # strict: the lower id wins ties (a thread visits ids in order)
        bv = v
        bi = j
    return bv, bi, mx


@cuda.jit
def penalize_argmax(logits, counts, params, z, best, stats):
    """One CTA per row r of logits (m, V) float32.
    counts (R, V) int32; params (m, N_PARAMS) float64 (columns P_*);
    z (k, V) float64 out: row params[r, P_SLOT] (when >= 0) gets the penalized logits of row r;
    best (m,) int32 out: argmax of the penalized logits, lowest id on ties;
    stats (m, 2) float64 out, rows with n_logprobs >= 0: raw max, log(sum(exp(raw - max)))."""
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    V = logits.shape[1]
    crow = int32(params[r, P_COUNT_ROW])
    presence = params[r, P_PRESENCE]
    frequency = params[r, P_FREQUENCY]
    slot = int32(params[r, P_SLOT])
    bv = float64(-math.inf)          # this thread's best penalized value and its id (ids ascend)
    bi = V
    mx = float32(-math.inf)          # this thread's raw max
    j = t
    while j + 3 * BLOCK < V:         # 4 loads in flight per thread (one CTA must stream a whole row)
        x0, x1, x2, x3 = logits[r, j], logits[r, j + BLOCK], logits[r, j + 2 * BLOCK], logits[r, j + 3 * BLOCK]
        bv, bi, mx = _visit(x0, j, r, counts, crow, presence, frequency, z, slot, bv, bi, mx)
        bv, bi, mx = _visit(x1, j + BLOCK, r, counts, crow, presence, frequency, z, slot, bv, bi, mx)
        bv, bi, mx = _visit(x2, j + 2 * BLOCK, r, counts, crow, presence, frequency, z, slot, bv, bi, mx)
        bv, bi, mx = _visit(x3, j + 3 * BLOCK, r, counts, crow, presence, frequency, z, slot, bv, bi, mx)
        j += 4 * BLOCK
    while j < V:
        bv, bi, mx = _visit(logits[r, j], j, r, counts, crow, presence, frequency, z, slot, bv, bi, mx)
        j += BLOCK
    sv = cuda.shared.array(BLOCK, float64)
    si = cuda.shared.array(BLOCK, int32)
    sm = cuda.shared.array(BLOCK, float32)
    ss = cuda.shared.array(BLOCK, float64)
    sv[t] = bv
    si[t] = bi
    sm[t] = mx
    cuda.syncthreads()
    s = BLOCK // 2
    while s > 0:                   # fixed tree: the result never depends on other rows
        if t < s:
            ov = sv[t + s]
            oi = si[t + s]
            if ov > sv[t] or (ov == sv[t] and oi < si[t]):
                sv[t] = ov
                si[t] = oi
            sm[t] = max(sm[t], sm[t + s])
        cuda.syncthreads()
        s //= 2
    if int32(params[r, P_N_LOGPROBS]) >= 0:      # uniform over the CTA
        m0 = sm[0]
        acc = float64(0.0)             # float32 exps (<= 2 ulp each), float64 sum
        j = t
        while j + 3 * BLOCK < V:
            x0, x1, x2, x3 = logits[r, j], logits[r, j + BLOCK], logits[r, j + 2 * BLOCK], logits[r, j + 3 * BLOCK]
            acc += math.exp(x0 - m0)
            acc += math.exp(x1 - m0)
            acc += math.exp(x2 - m0)
            acc += math.exp(x3 - m0)
            j += 4 * BLOCK
        while j < V:
            acc += math.exp(logits[r, j] - m0)
            j += BLOCK
        ss[t] = acc
        cuda.syncthreads()
        s = BLOCK // 2
        while s > 0:
            if t < s:
                ss[t] += ss[t + s]
            cuda.syncthreads()
            s //= 2
        if t == 0:
            stats[r, 0] = m0
            stats[r, 1] = math.log(ss[0])
    if t == 0:
        best[r] = si[0] if si[0] < V else 0      # only NaN rows leave the sentinel


@cuda.jit
def add_pairs(counts, pairs):
    """counts[pairs[i, 0], pairs[i, 1]] += 1 (atomic: repeated pairs add up)."""
    i = cuda.grid(1)
    if i < pairs.shape[0]:
        cuda.atomic.add(counts, (pairs[i, 0], pairs[i, 1]), 1)
