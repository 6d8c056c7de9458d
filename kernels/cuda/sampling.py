"""Token sampling on the device, exactly the semantics of kernels/sample_rows.py (as kernels/cpu/sampling.py).

sample(): when every row is greedy without penalties or logprobs (the common decode step), one CuPy kernel
(argmax.cu: lowest id of the largest logit) and the ids cross to the host. Otherwise one Numba CUDA kernel
over all rows (one CTA per row) applies the presence/frequency penalties in float64, takes the argmax
(lowest id on ties) and, for rows asking logprobs, the raw log-sum-exp; greedy rows need nothing more. Rows with temperature > 0
get their penalized logits written to a (k, n_vocab) float64 buffer and are finished with CuPy array ops
(a stable argsort per row, softmax, top-k/top-p/min-p, inverse CDF with the row's uniform), mirroring
the CPU code operation for operation in float64, so with the same uniforms both pick the same token
except at float ties. Only ids and logprobs cross to the host, packed into one array: never the logits.

Memory: sampling runs outside the captured decode graph, so per-call temporaries (the k sampled rows'
buffers, CuPy's sort scratch) come from CuPy's pool; sampling_workspace() preallocates only the per-row
parameter/result buffers of the kernel. Arrays may also be numpy (workspace made with xp=numpy): then
the kernels run in numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1), which is how CI tests them.

Measured on an H200 (n_vocab 151936, this workplace's gVisor host, where each launch costs ~30-40 us of host
time): greedy through the Numba kernel ~195-390 us per call for 1 or 32 rows (the kernel itself ~37 us: one
CTA streams a whole row, float64 compares); one sampled row ~2.3 ms and 8 rows ~2.7 ms (a 1-D sort per row
plus ~25 CuPy launches); top-5 logprobs ~1 ms. The plain greedy path (argmax.cu) is docs/cuda.md's figure.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..sample_rows import SampleRows, Sampled, count_pairs
from .runtime import cdiv, cupy, launch

__all__ = ["SamplingWorkspace", "sampling_workspace", "sample", "greedy_ids", "greedy_with_prob", "step_results",
           "draft_results", "add_counts"]

_ARGMAX_THREADS = 1024      # ARGMAX_THREADS in argmax.cu


def _kernels():
    """sampling_kernels.py (importing it imports numba.cuda, so only once sampling runs)."""
    from . import sampling_kernels
    return sampling_kernels


@functools.lru_cache(maxsize=8)
def _numba_stream(ptr: int):
    from numba import cuda
    return cuda.external_stream(ptr)


def _view(a):
    """What a Numba launch takes: numpy as it is (the simulator), else Numba's view of a cupy array.
    sync=False: every launch goes to the stream the arrays were made on, so no host wait is needed."""
    if isinstance(a, np.ndarray):
        return a
    from numba import cuda
    return cuda.as_cuda_array(a, sync=False)


def _launch(kern, grid: int, block: int, *args) -> None:
    """Numba launch on CuPy's current stream (args from _view); the simulator takes numpy arrays."""
    if isinstance(args[0], np.ndarray):
        kern[grid, block](*args)
    else:
        kern[grid, block, _numba_stream(cupy().cuda.get_current_stream().ptr)](*args)


@dataclass
class SamplingWorkspace:
    xp: object                 # cupy (or numpy for the simulator)
    n_vocab: int
    params: object             # (max_rows, N_PARAMS) float64
    best: object               # (max_rows,) int32
    stats: object              # (max_rows, 2) float64
    no_counts: object          # (1, 1) int32, passed when no row has penalties
    no_z: object               # (1, 1) float64, passed when every row is greedy
    views: tuple = ()          # Numba views of params, best, stats, no_counts, no_z: made once (~17 us each)


def sampling_workspace(max_rows: int, n_vocab: int, xp=None) -> SamplingWorkspace:
    """Buffers for sample() of up to max_rows rows of n_vocab logits; xp=numpy for the simulator."""
    xp = cupy() if xp is None else xp
    bufs = (xp.zeros((max_rows, _kernels().N_PARAMS), xp.float64), xp.zeros(max_rows, xp.int32),
            xp.zeros((max_rows, 2), xp.float64), xp.zeros((1, 1), xp.int32), xp.zeros((1, 1), xp.float64))
    return SamplingWorkspace(xp, int(n_vocab), *bufs, views=tuple(_view(b) for b in bufs))


def _check(logits, rows: SampleRows, counts, ws: SamplingWorkspace) -> None:
    xp = ws.xp
    if not isinstance(logits, xp.ndarray) or logits.ndim != 2 or logits.dtype != np.float32 \
            or not logits.flags.c_contiguous:
        raise ValueError(f"logits must be a C-contiguous 2-D float32 {xp.__name__} array")
    m, n_vocab = logits.shape          # fewer columns than the workspace's: an MTP head's draft vocabulary
    if n_vocab > ws.n_vocab or m > ws.params.shape[0]:
        raise ValueError(f"logits {logits.shape} exceed the workspace ({ws.params.shape[0]}, {ws.n_vocab})")
    if len(rows) != m:
        raise ValueError(f"{len(rows)} sample rows for {m} logit rows")
    if m and rows.count_rows.max() >= 0:
        if not isinstance(counts, xp.ndarray) or counts.dtype != np.int32 or counts.ndim != 2 \
                or counts.shape[1] != n_vocab or not counts.flags.c_contiguous:
            raise ValueError(f"penalties need a C-contiguous int32 (n_rows, {n_vocab}) count table")
        if rows.count_rows.max() >= counts.shape[0]:
            raise ValueError(f"count row {rows.count_rows.max()} beyond the table's {counts.shape[0]} rows")


def sample(logits, rows: SampleRows, counts, ws: SamplingWorkspace) -> Sampled:
    """Device logits (m, n <= ws.n_vocab) float32 (unchanged), host SampleRows, device int32 count table (or
    None when no row has penalties), ws from sampling_workspace -> host Sampled. Synchronizes."""
    _check(logits, rows, counts, ws)
    xp, m = ws.xp, logits.shape[0]
    if m == 0:
        return Sampled.empty(0, 0)
    if xp is not np and rows.plain_greedy():
        out = Sampled.empty(m, 0)
        out.ids[:] = _host(xp, greedy_ids(logits, ws.best[:m]))
        return out
    sampled = np.flatnonzero(rows.temperature != 0)           # rows finished by _choose
    slot = np.full(m, -1, np.int64)
    slot[sampled] = np.arange(len(sampled))
    kern = _kernels()
    prm = np.empty((m, kern.N_PARAMS), np.float64)
    for col, v in ((kern.P_PRESENCE, rows.presence), (kern.P_FREQUENCY, rows.frequency),
                   (kern.P_COUNT_ROW, rows.count_rows),
                   (kern.P_N_LOGPROBS, rows.n_logprobs), (kern.P_SLOT, slot)):
        prm[:, col] = v
    _set(xp, ws.params[:m], prm)
    params_v, best_v, stats_v, no_counts_v, no_z_v = ws.views    # whole buffers: the grid covers m rows
    z = xp.empty((len(sampled), logits.shape[1]), xp.float64) if len(sampled) else None
    _launch(kern.penalize_argmax, m, kern.BLOCK, _view(logits), no_counts_v if counts is None else _view(counts),
            params_v, no_z_v if z is None else _view(z), best_v, stats_v)
    ids, stats = ws.best[:m], ws.stats[:m]
    if len(sampled):
        ids[xp.asarray(sampled)] = _choose(xp, z, rows, sampled).astype(xp.int32)
    if rows.n_logprobs.max() < 0:
        out = Sampled.empty(m, 0)
        out.ids[:] = _host(xp, ids)
        return out
    return _with_logprobs(xp, logits, rows, ids, stats)


def greedy_ids(logits, best, stride: int = 1):
    """best (m,) device int32 <- the lowest id of each row's largest logit (NaN never wins; a row without a
    finite-or-+inf value gives 0): penalize_argmax's ids for unpenalized rows. logits (m, V) device
    float32, C-contiguous; best: row r's id at best.ravel()[stride * r] (a contiguous buffer; stride > 1
    writes a column of a wider one). -> best. One launch, no host wait (graph-capturable)."""
    m, n_vocab = logits.shape
    vec4 = n_vocab % 4 == 0 and logits.data.ptr % 16 == 0
    launch("argmax.cu", "argmax_rows", (m,), (_ARGMAX_THREADS,),
           (logits, best, np.int32(n_vocab), np.int32(vec4), np.int32(stride)))
    return best


STEP_COLS = 3       # a step's row results: greedy id bits | draft column bits | draft probability (float32)


def step_results(logits, ids=None):
    """A captured step's per-row results, (m, STEP_COLS) float32 device, one host copy for all of them:
    column 0 the int32 bits of each row's greedy id (greedy_ids; copied from ids, a device int32 (m,) of
    them, where the caller has them already), columns 1-2 zero until draft_results fills them."""
    cp = cupy()
    res = cp.zeros((logits.shape[0], STEP_COLS), cp.float32)
    if ids is None:
        greedy_ids(logits, res, STEP_COLS)
    else:
        res.view(cp.int32)[:, 0] = ids
    return res


def draft_results(logits, res) -> None:
    """Columns 1-2 of step_results' res <- each row's argmax column of logits (a draft head's, (m, n)) and its
    softmax probability (argmax_prob_rows)."""
    argmax_prob_rows(logits, res.ravel()[1:], STEP_COLS)


def greedy_with_prob(logits):
    """-> host (ids (m,) int64, probs (m,) float64): greedy_ids' ids and their softmax probabilities
    (argmax.cu argmax_prob_rows: 1 / sum exp(x - max), one CTA per row in a fixed order), in one launch and one
    copy to the host (the Numba path with logprobs costs ~200-400 us of host time per call)."""
    cp = cupy()
    out = cp.empty((logits.shape[0], 2), cp.float32)
    argmax_prob_rows(logits, out)
    host = out.get()
    return host[:, 0].view(np.int32).astype(np.int64), host[:, 1].astype(np.float64)


def argmax_prob_rows(logits, out, stride: int = 2) -> None:
    """Queue argmax.cu argmax_prob_rows: device logits (m, n_vocab) -> per row the argmax column's int32 bits
    and its softmax probability as float32 at out.ravel()[stride * r], [stride * r + 1] (out contiguous:
    stride 2 fills an (m, 2) array; a wider stride fills two columns of a wider buffer)."""
    m, n_vocab = logits.shape
    if m == 0:
        return
    vec4 = n_vocab % 4 == 0 and logits.data.ptr % 16 == 0
    launch("argmax.cu", "argmax_prob_rows", (m,), (_ARGMAX_THREADS,),
           (logits, out, np.int32(n_vocab), np.int32(vec4), np.int32(stride)))


def _set(xp, dst, host) -> None:
    if xp is np:
        dst[...] = host
    else:
        dst.set(np.ascontiguousarray(host))


def _host(xp, a):
    return a.copy() if xp is np else a.get()     # .get() waits for the current stream


def _best_first(xp, a, width: int):
    """ids (rows, width) of each row's `width` largest values, best first, ties lower id first. One 1-D
    stable argsort per row: CuPy radix-sorts 1-D float keys, but merge-sorts (row, key) tuples in 2-D."""
    return xp.stack([xp.argsort(-row, kind="stable")[:width] for row in a])


def _first(xp, mask, none: int):
    """Per row, the first column where mask is True, or `none` (an int) where it never is."""
    col = xp.arange(mask.shape[1])[None, :]
    return xp.where(mask, col, none).min(axis=1)


def _choose(xp, z, rows: SampleRows, sampled: np.ndarray):
    """Token ids (k,) for the sampled rows from their penalized float64 logits z (k, n_vocab)."""
    n_vocab = z.shape[1]
    top_k = rows.top_k[sampled].astype(np.int64)
    n_cand = np.where((top_k <= 0) | (top_k >= n_vocab), n_vocab, top_k)
    width = int(n_cand.max())
    # per-row parameters as f64 columns, as the CPU uses them: float(f32 value)
    prm = xp.asarray(np.stack([rows.temperature[sampled], rows.top_p[sampled], rows.min_p[sampled],
                               rows.uniform[sampled], n_cand], axis=1).astype(np.float64))
    temperature, top_p, min_p, uniform = (prm[:, i:i + 1] for i in range(4))
    n_cand = prm[:, 4].astype(xp.int64)
    z = z / temperature
    order = _best_first(xp, z, width)                                # the candidates' ids
    zs = xp.take_along_axis(z, order, axis=1)
    col = xp.arange(width)[None, :]
    cand = col < n_cand[:, None]
    p = xp.where(cand, xp.exp(zs - zs[:, :1]), 0.0)
    p /= p.sum(axis=1, keepdims=True)
    keep = n_cand
    # top_p: searchsorted(cumsum(p), top_p, 'left') + 1 = first index with cumsum >= top_p, plus one
    first = _first(xp, cand & (xp.cumsum(p, axis=1) >= top_p), width)
    keep = xp.where(top_p[:, 0] < 1.0, xp.minimum(keep, first + 1), keep)
    n_min = (cand & (p >= min_p * p[:, :1])).sum(axis=1)
    keep = xp.where(min_p[:, 0] > 0.0, xp.minimum(keep, xp.maximum(n_min, 1)), keep)
    kept = col < keep[:, None]
    q = xp.where(kept, p, 0.0)
    q /= q.sum(axis=1, keepdims=True)
    cdf = xp.cumsum(q, axis=1)
    cdf /= xp.take_along_axis(cdf, (keep - 1)[:, None], axis=1)
    i = xp.minimum(_first(xp, kept & (cdf > uniform), width), keep - 1)     # inverse CDF, clamped
    return xp.take_along_axis(order, i[:, None], axis=1)[:, 0]


def _with_logprobs(xp, logits, rows: SampleRows, ids, stats) -> Sampled:
    """Sampled with the raw log-softmax of the chosen tokens and of each row's n best tokens."""
    m, n_vocab = logits.shape
    n_top = rows.n_top
    width = min(n_top, n_vocab)
    pack = xp.full((m, 2 + 2 * n_top), np.nan, xp.float64)     # ids, logprob, top ids, top logprobs
    pack[:, 0] = ids
    chosen = logits[xp.arange(m), ids].astype(xp.float64)
    pack[:, 1] = (chosen - stats[:, 0]) - stats[:, 1]           # as the CPU: (z - max) - log(sum)
    asks = np.flatnonzero(rows.n_logprobs > 0)
    if len(asks):
        sel = xp.asarray(asks)
        sub = logits[sel]
        best = _best_first(xp, sub, width)
        lp = (xp.take_along_axis(sub, best, axis=1).astype(xp.float64) - stats[sel, 0:1]) - stats[sel, 1:2]
        pack[sel, 2:2 + width] = best
        pack[sel, 2 + n_top:2 + n_top + width] = lp
    host = _host(xp, pack)
    out = Sampled.empty(m, n_top)
    out.ids[:] = host[:, 0]
    asked = rows.n_logprobs >= 0
    out.logprob[asked] = host[asked, 1]
    shown = np.arange(n_top)[None, :] < np.minimum(rows.n_logprobs, width)[:, None]   # (m, n_top)
    out.top_ids[shown] = host[:, 2:2 + n_top][shown]
    out.top_logprobs[shown] = host[:, 2 + n_top:][shown]
    return out


def add_counts(counts, count_rows: np.ndarray, ids: np.ndarray) -> None:
    """counts (device int32 (n_rows, n_vocab))[count_rows[i], ids[i]] += 1 where count_rows[i] >= 0;
    count_rows, ids host int32 (m,). Repeats add up (atomic adds)."""
    found = count_pairs(counts.shape, count_rows, ids)
    if found is None:
        return
    pairs = np.stack(found, axis=1).astype(np.int32)                  # (k, 2): row, id
    xp = np if isinstance(counts, np.ndarray) else cupy()
    _launch(_kernels().add_pairs, cdiv(len(pairs), 128), 128, _view(counts), _view(xp.asarray(pairs)))
