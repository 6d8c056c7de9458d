"""Decoder blocks of decode steps as one parallel region whose workers share the work (STRATA_LITE_DECODE_BLOCK=
shared): the alternative to decode_block.py's block, which starts a parallel region for each of its mat-vecs and
for attention (about five a block) and runs small matrices on the calling thread.

Here one region a block: each of n_threads workers runs the whole block, and every phase (the projections, the
gathering into q / k / v with rope and the KV store, attention's items, the output projection, gate and up, down)
is cut into n_threads chunks of the kernels' own work items. A worker takes its own chunk first and then any chunk
no other worker has taken (an atomic counter a chunk, kernels/cpu/atomics.py), so a worker that the OS does not run,
or runs late, never holds the others up: they do its share. At the end of a phase each waits until the phase's
items are finished (spinning, then yielding its time slice). What every item of a phase reads (the norm of x, the
rounded activations, silu's output) each worker computes for itself; the shared arrays are written only by items,
and the output projection's and down projection's items add their own rows to the residual stream.

The items are the calls the per-call kernels make (rows4_int8, nibble_int8, q8_0_int8: the same row groups and
token chunks; attention.ITEM_FLOAT and merge_one), so a token's logits are the same bits as on the per-call path and
decode_block.py's block (tests/kernels/test_decode_block.py runs every case both ways).

One module-level function serves every set of kernels a block's matrices take, so that Numba's cache holds it:
made per set of routes, as decode_block.make_block makes its blocks, these functions would close over the jitted
functions they call, whose pickles (part of the cache key) differ in every process, and every process would
compile them again. So the first use compiles the callees of every route (~2-3 min on a 2-core machine), once.

Measured (docs/cpu.md, "Decoder blocks as one parallel region"): on the 2-core development VM no faster than
decode_block.py's block; meant for machines with many threads, where a region's start and join and the small
matrices left on one thread cost more.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import nibble_int8, q8_0_int8, rows4_int8
from .atomics import STRIDE, fetch_add, load_acquire, spin_pause, yield_thread
from .attention import ITEM_FLOAT, _CHUNK_KEYS, _TILE_Q, _plan, merge_one, split_states
from .decode_block import _BIAS, _DOWN, _GATE, _KIND, _MM, _N_OUT, _O, _PROJ, _UP, ABSENT, NIBBLE, ROWS4
from .elementwise import _rmsnorm_ser, _silu_mul_ser
from .rope_store import _serial as _rope_kv_store

# The phases of a block: the projection slots' mat-vecs (biases added by their items), the gathering into q / k /
# v with q/k norms, rope and the KV store (one item), attention's items, the split merge, the output projection
# (its items add their rows to the residual stream), gate (or gate_up) and up, down (and its residual add)
_P_PROJ, _P_QKV, _P_ATTN, _P_MERGE, _P_O, _P_GATE, _P_UP, _P_DOWN = 0, 3, 4, 5, 6, 7, 8, 9
_N_PHASES = 10


@njit(cache=True, inline="always")
def _counter(p, c, n_threads):
    """Index in the sync array of phase p's counter c: 0 .. n_threads - 1 whether chunk c is taken, n_threads
    its finished items (each on its own cache line, kernels/cpu/atomics.py)."""
    return (p * (n_threads + 1) + c) * STRIDE


@njit(cache=True, inline="always")
def _take(sync, p, c, n_threads):
    """Whether this thread takes chunk c of phase p (the first to ask does)."""
    return fetch_add(sync, _counter(p, c, n_threads), 1) == 0


@njit(cache=True, inline="always")
def _done(sync, p, k, n_threads):
    fetch_add(sync, _counter(p, n_threads, n_threads), k)


_SPINS = 2000     # pauses (tens of microseconds) before a waiting thread gives up its time slice between tries


@njit(cache=True, inline="always")
def _wait(sync, p, n_items, n_threads):
    """Until all n_items items of phase p are finished: every chunk is taken by now, by a thread that runs, or
    that will once the OS runs it again (hence the yields after a while: the machine may have more busy threads
    than cores)."""
    spins = 0
    while load_acquire(sync, _counter(p, n_threads, n_threads)) < n_items:
        spin_pause()
        spins += 1
        if spins > _SPINS:
            yield_thread()


@njit(cache=True, inline="always")
def _chunk(c, n_chunks, n_items):
    """Items of chunk c of n_chunks: consecutive, sizes within one of each other."""
    return n_items * c // n_chunks, n_items * (c + 1) // n_chunks


@njit(cache=True, inline="always")
def _rows_per_item(how, n, raw3):
    """Rows an item of a NIBBLE or OWN_BLOCKS mat-vec over raw3 covers for n tokens: the rows one call of the
    kernel's own loop takes (one token: nibble_int8 1 or 4 by the row's bytes, q8_0_int8 1), or its row group."""
    if how == NIBBLE:
        return (1 if nibble_int8.one_row_calls(raw3) else 4) if n == 1 else nibble_int8.ROW_GROUP
    return 1 if n == 1 else q8_0_int8.ROW_GROUP

@njit(cache=True)
def _n_items(spec, s, raws, n):
    """Work items of the mat-vec in slot s for n tokens: the loop of the kernel qmatmul_packed gives it."""
    how, rows = spec[s, _MM], raws[s].shape[0]
    if how == ABSENT:
        return 0
    if how == ROWS4:
        groups = rows // rows4_int8.ROWS
        return groups if n == 1 else (groups + rows4_int8.GROUP_RUN - 1) // rows4_int8.GROUP_RUN
    per = _rows_per_item(how, n, raws[s])
    return (rows + per - 1) // per

@njit(cache=True)
def _prepare(spec, s, x, bufs, isa):
    """This thread's rounding of x (n, n_in) for the mat-vec in slot s, into its flat buffers bufs, as the
    kernel rounds -> the views its items read: int8 values (n, n_in / 32, 32), their permuted copy, scales
    and sums of 32 (ROWS4, OWN_BLOCKS); offset uint8 values (n, n_in / 256, 256), scales and sums of 32
    (NIBBLE)."""
    xq, xp, xd, xc, xu, xb = bufs
    n, k = x.shape
    how, kind = spec[s, _MM], spec[s, _KIND]
    nb, nb8 = k // 32, k // 256 if k % 256 == 0 else 0
    q3, p3 = xq[:n * k].reshape(n, nb, 32), xp[:4 * n * k].reshape(n, nb, 128)
    d2, c2 = xd[:n * nb].reshape(n, nb), xc[:n * nb].reshape(n, nb)
    u3, d8, b3 = xu[:n * nb8 * 256].reshape(n, nb8, 256), xd[:n * nb8].reshape(n, nb8), \
        xb[:n * nb8 * 8].reshape(n, nb8, 8)
    if how == ROWS4:
        rows4_int8._prepare_serial(x.reshape(n, nb, 32), q3, p3, d2, c2, rows4_int8.offset(kind, isa))
    elif how == NIBBLE:
        x3 = x.reshape(n, nb8, 256)
        for t in range(n):
            for b in range(nb8):
                nibble_int8._quantize_block(x3, u3, d8, b3, t, b)
    else:
        q8_0_int8._quantize_rows(x.reshape(n, nb, 32), q3, d2)
    return q3, p3, d2, c2, u3, d8, b3

@njit(cache=True)
def _items(spec, s, raws, tables, i0, i1, n, v, out, isa):
    """Items i0 .. i1 - 1 of the mat-vec in slot s (views v of _prepare) into out (n, n_out): the calls the
    kernel's own loop makes for them, so every output is the same bits."""
    q3, p3, d2, c2, u3, d8, b3 = v
    raw3, how, kind = raws[s], spec[s, _MM], spec[s, _KIND]
    if how == ROWS4:
        for i in range(i0, i1):
            if n == 1:
                rows4_int8._dot(kind, isa, raw3, i, p3, d2, c2, 0, 1, out)
            else:
                rows4_int8._group_run(kind, isa, raw3, i, p3, d2, c2, out)
    elif how == NIBBLE:
        table, one_row = tables[s], nibble_int8.one_row_calls(raw3)
        for i in range(i0, i1):
            if n == 1 and one_row:
                nibble_int8._dot1(kind, raw3, i, u3, d8, b3, out, table)
            elif n == 1:
                nibble_int8._dot(kind, raw3, 4 * i, u3, d8, b3, 0, 1, out, table)
            else:
                n_chunks = (n + nibble_int8.MAX_TOK - 1) // nibble_int8.MAX_TOK
                r0, r1 = i * nibble_int8.ROW_GROUP, min(raw3.shape[0], (i + 1) * nibble_int8.ROW_GROUP)
                for c in range(n_chunks):
                    t0 = n * c // n_chunks
                    for r in range(r0, r1):
                        nibble_int8._dot(kind, raw3, r, u3, d8, b3, t0, n * (c + 1) // n_chunks - t0, out, table)
    else:
        for i in range(i0, i1):
            if n == 1:
                q8_0_int8._dot(kind, isa, raw3, i, q3, d2, 0, 1, out)
            else:
                q8_0_int8._row_group(kind, isa, raw3, i, q3, d2, out)

@njit(cache=True)
def _item_rows(spec, s, raws, n, i0, i1):
    """The output rows of items i0 .. i1 - 1 of slot s (a kernel call past the last row recomputes the last
    row, which its own item holds)."""
    how = spec[s, _MM]
    per = (rows4_int8.ROWS if n == 1 else rows4_int8.ROWS * rows4_int8.GROUP_RUN) if how == ROWS4 else \
        _rows_per_item(how, n, raws[s])
    return i0 * per, min(raws[s].shape[0], i1 * per)

@njit(cache=True)
def _matvec_phase(tid, n_threads, sync, p, spec, s, raws, tables, biases, x, bufs, out, add, residual, isa):
    """This thread's share of phase p, the mat-vec of slot s on x (n, n_in) into out: its own chunk of the
    items first, then any chunk no other thread has taken; x rounded into its own buffers before its
    first chunk. The items add the slot's bias to their rows, and where `add` also their rows of out to
    residual (n, n_out): elementwise, so the same sums as the per-call path's. -> the phase's items (no
    wait)."""
    n = x.shape[0]
    n_items = _n_items(spec, s, raws, n)
    ready = False
    for j in range(n_threads if n_items > 0 else 0):
        c = (tid + j) % n_threads
        if not _take(sync, p, c, n_threads):
            continue
        i0, i1 = _chunk(c, n_threads, n_items)
        if i0 < i1:
            if not ready:
                v = _prepare(spec, s, x, bufs, isa)
                ready = True
            _items(spec, s, raws, tables, i0, i1, n, v, out, isa)
            r0, r1 = _item_rows(spec, s, raws, n, i0, i1)
            if spec[s, _BIAS]:
                b = biases[s]
                for t in range(n):
                    for r in range(r0, r1):
                        out[t, r] = out[t, r] + b[r]
            if add:
                for t in range(n):
                    for r in range(r0, r1):
                        residual[t, r] = residual[t, r] + out[t, r]
        _done(sync, p, i1 - i0, n_threads)
    return n_items

@njit(cache=True)
def _worker(tid, n_threads, sync, bufs, hbuf, x, ys, q, k, v, a, y_o, y_g, y_u, y_d, spec, raws, tables, biases,
            norms, eps, qk_norm, n_heads, n_kv_heads, head_dim, inv, n_rot, neox, q_scale, has_q, k_scale, has_k,
            token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale_log2e,
            tstart, tend, n_split, items, counts, part_acc, part_m, part_l, isa):
    """Worker tid's part of the block (hbuf, bufs: its own buffers): its chunk of every phase's items and
    whatever chunk is left, a wait at the end of each phase, and its own copy of what the next phase's
    items read (the norms, silu); the shared arrays are written only by items."""
    n, d = x.shape
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    h = hbuf[:n * d].reshape(n, d)
    _rmsnorm_ser(x, norms[0], eps, h)
    for s in range(_PROJ, _PROJ + 3):
        _matvec_phase(tid, n_threads, sync, _P_PROJ + s, spec, s, raws, tables, biases, h, bufs, ys[s], False, x,
                      isa)
    for s in range(_PROJ, _PROJ + 3):
        _wait(sync, _P_PROJ + s, _n_items(spec, s, raws, n), n_threads)
    # the projections' outputs into q / k / v; q/k norms; rope and the KV store
    if _take(sync, _P_QKV, 0, n_threads):
        q2, k2, v2 = q.reshape(n, q_dim), k.reshape(n, kv_dim), v.reshape(n, kv_dim)
        col = 0
        for s in range(_PROJ, _PROJ + 3):
            if spec[s, _MM] == ABSENT:
                continue
            y = ys[s]
            for t in range(n):         # columns col .. of [q | k | v]
                for j in range(min(y.shape[1], q_dim - col)):
                    q2[t, col + j] = y[t, j]
                for j in range(max(0, q_dim - col), min(y.shape[1], q_dim + kv_dim - col)):
                    k2[t, col + j - q_dim] = y[t, j]
                for j in range(max(0, q_dim + kv_dim - col), y.shape[1]):
                    v2[t, col + j - q_dim - kv_dim] = y[t, j]
            col += y.shape[1]
        if qk_norm:
            qh, kh = q.reshape(n * n_heads, head_dim), k.reshape(n * n_kv_heads, head_dim)
            _rmsnorm_ser(qh, norms[2], eps, qh)
            _rmsnorm_ser(kh, norms[3], eps, kh)
        _rope_kv_store(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                       inv, n_rot, neox, q_scale, has_q, k_scale, has_k)
        _done(sync, _P_QKV, 1, n_threads)
    _wait(sync, _P_QKV, 1, n_threads)
    # attention: _plan's items as it deals them to threads (its chunk c: counts[c] ..), then the splits' merge
    n_att = items.shape[0]
    for j in range(n_threads):
        c = (tid + j) % n_threads
        if not _take(sync, _P_ATTN, c, n_threads):
            continue
        for ii in range(counts[c], counts[c + 1]):
            ITEM_FLOAT(items[ii], q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                       scale_log2e, a, tstart, tend, n_split, part_acc, part_m, part_l)
        _done(sync, _P_ATTN, counts[c + 1] - counts[c], n_threads)
    _wait(sync, _P_ATTN, n_att, n_threads)
    if n_split > 1:
        n_merge = n * n_heads
        for j in range(n_threads):
            c = (tid + j) % n_threads
            if _take(sync, _P_MERGE, c, n_threads):
                i0, i1 = _chunk(c, n_threads, n_merge)
                for th in range(i0, i1):
                    merge_one(part_acc, part_m, part_l, a, th)
                _done(sync, _P_MERGE, i1 - i0, n_threads)
        _wait(sync, _P_MERGE, n_merge, n_threads)
    # output projection, its rows added to x by its items
    _wait(sync, _P_O, _matvec_phase(tid, n_threads, sync, _P_O, spec, _O, raws, tables, biases, a.reshape(n, q_dim),
                                    bufs, y_o, True, x, isa), n_threads)
    # feed-forward: gate and up (or the two in one matrix), silu, down (its rows added to x)
    _rmsnorm_ser(x, norms[1], eps, h)
    n_gate = _matvec_phase(tid, n_threads, sync, _P_GATE, spec, _GATE, raws, tables, biases, h, bufs, y_g, False, x,
                           isa)
    n_up = _matvec_phase(tid, n_threads, sync, _P_UP, spec, _UP, raws, tables, biases, h, bufs, y_u, False, x, isa)
    _wait(sync, _P_GATE, n_gate, n_threads)
    _wait(sync, _P_UP, n_up, n_threads)
    f = y_g.shape[1] // 2 if spec[_UP, _MM] == ABSENT else y_g.shape[1]
    act = hbuf[:n * f].reshape(n, f)
    if spec[_UP, _MM] == ABSENT:
        _silu_mul_ser(y_g[:, :f], y_g[:, f:], act)
    else:
        _silu_mul_ser(y_g, y_u, act)
    _matvec_phase(tid, n_threads, sync, _P_DOWN, spec, _DOWN, raws, tables, biases, act, bufs, y_d, True, x, isa)


@njit(cache=True, parallel=True)
def shared_block(x, spec, raws, tables, biases, norms, eps, qk_norm, n_heads, n_kv_heads, head_dim,
                 inv, n_rot, neox, q_scale, has_q, k_scale, has_k,
                 token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale_log2e, n_threads, isa):
    """models/transformer.py decoder_block on x (n, n_embd) in place, as the per-call path computes it, in
    one parallel region: n_threads workers share each phase's items through atomic counters (a thread that
    finds none left waits for the phase's last items, so the block is done whether the workers run at once
    or one after another). norms: (attn_norm, ffn_norm, q norm, k norm); biases: the projection slots'."""
    n, d = x.shape
    q_dim = n_heads * head_dim
    ys = (np.empty((n, max(1, spec[_PROJ, _N_OUT])), np.float32),
          np.empty((n, max(1, spec[_PROJ + 1, _N_OUT])), np.float32),
          np.empty((n, max(1, spec[_PROJ + 2, _N_OUT])), np.float32))
    q = np.empty((n, n_heads, head_dim), np.float32)
    k = np.empty((n, n_kv_heads, head_dim), np.float32)
    v = np.empty((n, n_kv_heads, head_dim), np.float32)
    a = np.empty((n, n_heads, head_dim), np.float32)
    y_o = np.empty((n, d), np.float32)
    y_g = np.empty((n, spec[_GATE, _N_OUT]), np.float32)
    y_u = np.empty((n, max(1, spec[_UP, _N_OUT])), np.float32)
    y_d = np.empty((n, d), np.float32)
    f = y_g.shape[1] // 2 if spec[_UP, _MM] == ABSENT else y_g.shape[1]
    n_in = max(d, q_dim, f)
    tstart, tend, n_split, items, counts = _plan(token_seq, token_pos, k_pages.shape[2], n_threads, _TILE_Q,
                                                 _CHUNK_KEYS)
    part_acc, part_m, part_l = split_states(token_pos, n_split, n_heads, head_dim)
    sync = np.zeros(_N_PHASES * (n_threads + 1) * STRIDE, np.int64)
    # each worker's activation buffers (rows n_threads: flat int8 / uint8 values, permuted int8, scales,
    # sums), and its rows of h: the normalized input, then silu's output
    xq = np.empty((n_threads, n * n_in), np.int8)
    xp = np.empty((n_threads, 4 * n * n_in), np.int8)
    xd = np.empty((n_threads, n * n_in // 32), np.float32)
    xc = np.empty((n_threads, n * n_in // 32), np.int32)
    xu = np.empty((n_threads, n * n_in), np.uint8)
    xb = np.empty((n_threads, n * n_in // 32), np.int32)
    hs = np.empty((n_threads, n * n_in), np.float32)
    for tid in prange(n_threads):
        _worker(tid, n_threads, sync, (xq[tid], xp[tid], xd[tid], xc[tid], xu[tid], xb[tid]), hs[tid], x, ys,
                q, k, v, a, y_o, y_g, y_u, y_d, spec, raws, tables, biases, norms, eps, qk_norm, n_heads,
                n_kv_heads, head_dim, inv, n_rot, neox, q_scale, has_q, k_scale, has_k, token_seq, token_pos,
                page_tables, k_pages, k_scales, v_pages, v_scales, scale_log2e, tstart, tend, n_split, items,
                counts, part_acc, part_m, part_l, isa)

