"""One decoder block of a decode-sized step (1 .. MAX_TOK tokens) in a single compiled call.

Why: a decode step makes ~9 backend calls a block (norms, q/k/v, rope + KV store, attention, output
projection, gate/up, down, residual adds), ~220 a token on a 24-block model. On such a model whose weights
stay in cache (so what is left is the fixed cost of a token: `perf/bench_decode_block.py`) those calls took
1.7-2.2 ms a token on the 2-core development VM, where ik_llama.cpp's whole token took 0.5-0.7 ms: the time
went to Python, argument checks, allocations and Numba's dispatch of each call, not to arithmetic. Here the block's
kernel calls are made from compiled code: one dispatch a block.

The kernels are the functions the per-call path runs (kernels/cpu/backend.py), called in the same order with
the same arguments, so a token's outputs are the same bits either way (tests/kernels/test_decode_block.py
compares logits bit for bit): batch invariance and the llama.cpp goldens carry over.

Which blocks take it (DecodeBlock.build): every matrix in a layout the int8 mat-vec kernels read (4-row
interleaved Q5_0 / Q4_0 / IQ4_NL / Q8_0, the IQ3_XXS / Q4_K / Q5_K / Q6_K repackings, Q8_0 / Q5_0 / Q4_0 /
IQ4_NL in their own blocks) or F16 / BF16 / F32 in the file's rows (half_matvec.py), and attention's float q.k
path (the default). Other blocks (the float kernels of CPUs without AVX2 or STRATA_LITE_INT8=0,
STRATA_LITE_ATTN_QK=int8 / int16; with STRATA_LITE_DECODE_BLOCK=shared, F16 / BF16 / F32 ones too), steps of more
than MAX_TOK tokens and forwards with an observer (the imatrix) take the per-call path.
"""
from __future__ import annotations

import ctypes

import numba
import numpy as np
from gguf import GGMLQuantizationType as QType
from numba import njit

from . import half_matvec, nibble_int8, q8_0_int8, rows4_int8
from .attention import _CHUNK_KEYS, _KERNELS, _LOG2E, _TILE_Q, _attn_merge, _plan, qk_path, split_states
from .elementwise import _NO_SCALE, _inv_freq, _rmsnorm_ser, _silu_mul_ser
from .iq3_int8 import CODE_TABLE
from .isa import INT8_ISA
from .q4_k_int8 import _NO_TABLE
from .q8_0_int8 import Q8_0_KIND
from .qmatmul import _INT8_KIND
from .repack import GGML, IQ3_I8, INT8_LAYOUTS, Q4K_I8, Q5K_I8, Q6K_I8, ROWS4_LAYOUTS, PackedWeight
from .rope_store import _serial as _rope_kv_store

MAX_TOK = 8            # tokens a call: every kernel below then takes its mat-vec form (the GEMMs start at 16)

# how a matrix slot is multiplied (column _MM of a block's spec); HALF's kind: 1 for BF16, 0 for F16; FLOAT32:
# F32 rows, half_matvec's loop on float32 loads
ABSENT, ROWS4, NIBBLE, OWN_BLOCKS, HALF, FLOAT32 = -1, 0, 1, 2, 3, 4
_MM, _KIND, _SMALL, _N_OUT, _BIAS = range(5)
# the slots: q/k/v projections (one fused matrix, q+k and v, or q, k and v), attn_output, gate_up (or gate),
# up (when not fused), ffn_down
_PROJ, _O, _GATE, _UP, _DOWN = 0, 3, 4, 5, 6
_N_SLOTS = 7
_NIBBLE_KIND = {IQ3_I8: nibble_int8.IQ3, Q4K_I8: nibble_int8.Q4K, Q5K_I8: nibble_int8.Q5K, Q6K_I8: nibble_int8.Q6K}
_HALF_KIND = {QType.F16: 0, QType.BF16: 1}
_NO_MATRIX = np.zeros((1, 1, 1), np.uint8)
_NO_VECTOR = np.zeros(1, np.float32)
_FLOAT_ATTENTION = _KERNELS["float"]


def matrix_route(w):
    """(how, kind, table) the per-call path (qmatmul.qmatmul_packed) takes for w at up to MAX_TOK tokens,
    or None where that is not one of the int8 mat-vec kernels."""
    if type(w) is not PackedWeight or not w.final:
        return None
    if w.layout in ROWS4_LAYOUTS:
        return ROWS4, INT8_LAYOUTS[w.layout][1].kind, _NO_TABLE
    if w.layout in _NIBBLE_KIND:
        return NIBBLE, _NIBBLE_KIND[w.layout], CODE_TABLE if w.layout == IQ3_I8 else _NO_TABLE
    if w.layout not in INT8_LAYOUTS and w.int8:
        return OWN_BLOCKS, _INT8_KIND.get(w.qtype, Q8_0_KIND), _NO_TABLE
    if w.layout == GGML and w.qtype in _HALF_KIND and half_matvec.fits(w.n_in):
        return HALF, _HALF_KIND[w.qtype], _NO_TABLE
    if w.layout == GGML and w.qtype == QType.F32 and half_matvec.fits(w.n_in):
        return FLOAT32, 0, _NO_TABLE
    return None


def block_raw(w, how: int) -> np.ndarray:
    """The uint8 (n_out, blocks, block bytes) view of w's rows a block's slot holds (HALF, FLOAT32: one block a
    row)."""
    return w.raw.reshape(w.n_out, 1, w.raw.shape[1]) if how in (HALF, FLOAT32) else w.raw3


# the kernels a block's matrices take, as bits: a block function is compiled with only those (make_block), since
# Numba compiles every callee a function names and links it in (~7-16 s each on a 2-core machine)
R4_PARALLEL, R4_SERIAL, NIBBLE_ANY, OWN_PARALLEL, OWN_SERIAL, HALF_ANY, FLOAT32_ANY = 1, 2, 4, 8, 16, 32, 64


def route_bit(how: int, small: bool) -> int:
    """The bit of the kernel a matrix of route `how` takes (the 4-row and own-block kernels have a serial
    form for small matrices)."""
    if how == NIBBLE:
        return NIBBLE_ANY
    if how == HALF:
        return HALF_ANY
    if how == FLOAT32:
        return FLOAT32_ANY
    if how == ROWS4:
        return R4_SERIAL if small else R4_PARALLEL
    return OWN_SERIAL if small else OWN_PARALLEL


@njit(cache=True)
def _add_rows(y, b):
    """y (n, m) += b (m,) in place: numpy's broadcast float32 add, element by element."""
    for t in range(y.shape[0]):
        for j in range(y.shape[1]):
            y[t, j] = y[t, j] + b[j]


@njit(cache=True)
def _residual(x, y):
    """x += y, float32, element by element (numpy's add, as the per-call path)."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[t, j] = x[t, j] + y[t, j]


@njit(cache=True)
def _rmsnorm(x, w, eps):
    """rmsnorm of x's rows (n, d) by w into a new array (elementwise.rmsnorm's rows)."""
    out = np.empty_like(x)
    _rmsnorm_ser(x, w, eps, out)
    return out


@njit(cache=True)
def _attention(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale_log2e, n_threads):
    """attention.attention_nocheck with the float q.k path: -> (n, n_heads, head_dim). n_threads: Numba's
    (numba.get_num_threads() inside compiled code would keep this function out of Numba's cache)."""
    out = np.empty_like(q)
    tstart, tend, n_split, items, counts = _plan(token_seq, token_pos, k_pages.shape[2], n_threads, _TILE_Q,
                                                 _CHUNK_KEYS)
    part_acc, part_m, part_l = split_states(token_pos, n_split, q.shape[1], q.shape[2])
    _FLOAT_ATTENTION(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale_log2e,
                     out, tstart, tend, n_split, items, counts, part_acc, part_m, part_l)
    if n_split > 1:
        _attn_merge(part_acc, part_m, part_l, out)
    return out


_BLOCKS = {}      # routes -> the block function compiled for them


def make_block(routes: int):
    """The block function for matrices taking the routes in `routes` (route_bit), made once a process."""
    fn = _BLOCKS.get(routes)
    if fn is None:
        fn = _BLOCKS[routes] = _make_block(routes)
    return fn


def _make_block(routes: int):
    """_block for the routes in the bit set `routes`. The closure holds only bools (Numba's cache key hashes a
    closure's contents: a jitted function in it would make every process compile again), and the branches of
    routes not taken are pruned before their callees are typed."""
    r4_par, r4_ser, nib = bool(routes & R4_PARALLEL), bool(routes & R4_SERIAL), bool(routes & NIBBLE_ANY)
    own_par, own_ser, half = bool(routes & OWN_PARALLEL), bool(routes & OWN_SERIAL), bool(routes & HALF_ANY)
    f32 = bool(routes & FLOAT32_ANY)

    @njit(cache=True)
    def _block(x, spec, raws, tables, biases, norms, eps, qk_norm, n_heads, n_kv_heads, head_dim,
               inv, n_rot, neox, q_scale, has_q, k_scale, has_k,
               token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale_log2e, n_threads, isa):
        """models/transformer.py decoder_block on x (n, n_embd) in place, as the per-call path computes it.
        norms: (attn_norm, ffn_norm, q norm, k norm); biases: the projection slots' biases."""

        def _matmul(spec, s, raws, tables, x, isa):
            """x (n, n_in) float32 C-contiguous @ W.T for the matrix in slot s -> new (n, n_out): the kernel
            and arguments qmatmul_packed gives it (serial where the matrix is small)."""
            n = x.shape[0]
            raw3 = raws[s]
            out = np.empty((n, spec[s, _N_OUT]), np.float32)
            x3 = x.reshape(n, raw3.shape[1], x.shape[1] // raw3.shape[1])       # (tokens, blocks, block weights)
            how, kind, small = spec[s, _MM], spec[s, _KIND], spec[s, _SMALL] != 0
            if how == NIBBLE:
                if nib:
                    nibble_int8.matvec(raw3, x3, out, tables[s], kind)
            elif how == HALF:                      # raw3 (n_out, 1, 2 n_in): the file's F16 / BF16 rows
                if half:
                    half_matvec._mv(raw3.reshape(raw3.shape[0], raw3.shape[2]).view(np.uint16), x, out, kind == 1)
            elif how == FLOAT32:                   # raw3 (n_out, 1, 4 n_in): the file's F32 rows
                if f32:
                    half_matvec._mv(raw3.reshape(raw3.shape[0], raw3.shape[2]).view(np.float32), x, out, False)
            elif how == ROWS4:
                if small:
                    if r4_ser:
                        rows4_int8._matmul_serial(raw3, x3, out, kind, isa)
                elif r4_par:
                    rows4_int8._matmul(raw3, x3, out, kind, isa)
            else:
                if small:
                    if own_ser:
                        q8_0_int8.mv_avx2_serial(raw3, x3, out, kind, isa)
                elif own_par:
                    q8_0_int8.mv_avx2(raw3, x3, out, kind, isa)
            return out

        n = x.shape[0]
        q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        h = _rmsnorm(x, norms[0], eps)
        qkv = np.empty((n, q_dim + 2 * kv_dim), np.float32)    # the projections' outputs side by side
        col = 0
        for s in range(_PROJ, _PROJ + 3):
            if spec[s, _MM] == ABSENT:
                continue
            y = _matmul(spec, s, raws, tables, h, isa)
            if spec[s, _BIAS]:
                _add_rows(y, biases[s])
            qkv[:, col:col + y.shape[1]] = y
            col += y.shape[1]
        q = np.ascontiguousarray(qkv[:, :q_dim]).reshape(n, n_heads, head_dim)
        k = np.ascontiguousarray(qkv[:, q_dim:q_dim + kv_dim]).reshape(n, n_kv_heads, head_dim)
        v = np.ascontiguousarray(qkv[:, q_dim + kv_dim:]).reshape(n, n_kv_heads, head_dim)
        if qk_norm:
            q2 = q.reshape(n * n_heads, head_dim)
            _rmsnorm_ser(q2, norms[2], eps, q2)
            k2 = k.reshape(n * n_kv_heads, head_dim)
            _rmsnorm_ser(k2, norms[3], eps, k2)
        _rope_kv_store(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                       inv, n_rot, neox, q_scale, has_q, k_scale, has_k)
        a = _attention(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale_log2e,
                       n_threads)
        _residual(x, _matmul(spec, _O, raws, tables, a.reshape(n, q_dim), isa))
        h = _rmsnorm(x, norms[1], eps)
        if spec[_UP, _MM] == ABSENT:                # gate and up rows in one matrix
            y = _matmul(spec, _GATE, raws, tables, h, isa)
            f = y.shape[1] // 2
            g = np.ascontiguousarray(y[:, :f])
            act = np.empty_like(g)
            _silu_mul_ser(g, np.ascontiguousarray(y[:, f:]), act)
        else:
            act = _matmul(spec, _GATE, raws, tables, h, isa)
            _silu_mul_ser(act, _matmul(spec, _UP, raws, tables, h, isa), act)
        _residual(x, _matmul(spec, _DOWN, raws, tables, act, isa))
    return _block


def _writable(a, dtype):
    """A C-contiguous array of dtype holding a's values with Numba's writable array type (the arrays of a
    tuple argument need one type, and the kernels are compiled for writable arrays): a itself, a copy for
    small vectors, and for a read-only matrix (the mapped file's bytes) a writable-typed view of the same
    memory, never written (mat-mul weights are only read). The caller keeps a alive."""
    a = np.ascontiguousarray(a, dtype)
    if a.flags.writeable:
        return a
    if a.ndim < 3:
        return a.copy()
    buf = (ctypes.c_uint8 * a.nbytes).from_address(a.ctypes.data)
    return np.frombuffer(buf, dtype).reshape(a.shape)


class DecodeBlock:
    """A block's weights and constants, ready for _block. Build with DecodeBlock.build (None where the block
    has a matrix or a path _block does not take); call with a step's x and KV arrays."""
    max_tokens = MAX_TOK

    def __init__(self, fn, weights, specs, raws, tables, biases, norms, eps, qk_norm, n_heads, n_kv_heads,
                 head_dim, rope, scale_log2e, n_threads):
        self.fn = fn                  # make_block's function for this block's routes
        self.weights = weights        # the PackedWeights whose memory raws' writable views alias
        self.args = (specs, raws, tables, biases, norms, float(eps), bool(qk_norm), int(n_heads),
                     int(n_kv_heads), int(head_dim))
        self.rope = rope
        self.scale_log2e = np.float32(scale_log2e)
        # the threads attention's work plan counts on: the building thread's Numba thread count (thread-local; the
        # backend builds the blocks on the thread that runs them), read once: numba.get_num_threads() costs
        # ~2 us a call, ~45 us a token on a 24-block model
        self.n_threads = int(n_threads)

    @classmethod
    def build(cls, layer, n_heads, n_kv_heads, head_dim, eps, freq_base, n_rot, neox, qk_norm, scale,
              shared: bool = False, n_threads: int | None = None):
        """layer: models/transformer.py's _Layer (its matrices as the CPU backend packed them, norms,
        biases, K-smoothing scales); scale: attention's softmax scale; shared: decode_block_shared.py's block
        (one parallel region whose workers share every phase) instead of this module's; n_threads: the threads
        the block's parallel kernels run on (None: this thread's Numba count). -> DecodeBlock or None."""
        if qk_path(head_dim) != "float":
            return None
        if layer.qkv is not None:
            proj = [(layer.qkv, layer.qkv_bias)]
        elif layer.qk is not None:
            proj = [(layer.qk, layer.qk_bias), (layer.attn_v, layer.attn_v_bias)]
        else:
            proj = [(layer.attn_q, layer.attn_q_bias), (layer.attn_k, layer.attn_k_bias),
                    (layer.attn_v, layer.attn_v_bias)]
        proj += [(None, None)] * (3 - len(proj))
        ffn = [(layer.gate_up, None), (None, None)] if layer.gate_up is not None else \
            [(layer.ffn_gate, None), (layer.ffn_up, None)]
        slots = proj + [(layer.attn_output, None)] + ffn + [(layer.ffn_down, None)]
        specs = np.full((_N_SLOTS, 5), ABSENT, np.int64)
        raws, tables, biases, routes = [], [], [], 0
        for s, (w, bias) in enumerate(slots):
            raws.append(_writable(_NO_MATRIX, np.uint8))
            tables.append(_writable(_NO_TABLE, np.int8))
            biases.append(_writable(_NO_VECTOR if bias is None else bias, np.float32))
            if w is None:
                continue
            route = matrix_route(w)
            if route is None:
                return None
            how, kind, table = route
            if shared and how in (HALF, FLOAT32):   # the shared block's phases split int8 rows only
                return None
            routes |= route_bit(how, w.small)
            specs[s] = (how, kind, int(bool(w.small)), w.n_out, int(bias is not None))
            raws[s], tables[s] = _writable(block_raw(w, how), np.uint8), _writable(table, np.int8)
        if qk_norm and (layer.attn_q_norm is None or layer.attn_k_norm is None):
            return None
        norms = tuple(_writable(_NO_VECTOR if v is None else v, np.float32)
                      for v in (layer.attn_norm, layer.ffn_norm, layer.attn_q_norm, layer.attn_k_norm))
        q_scale, k_scale = layer.q_scale, layer.k_inv_scale
        rope = (_inv_freq(freq_base, n_rot), int(n_rot), bool(neox),
                _NO_SCALE if q_scale is None else q_scale, q_scale is not None,
                _NO_SCALE if k_scale is None else k_scale, k_scale is not None)
        if shared:       # one function for every route (its module says why)
            from .decode_block_shared import shared_block as fn
        else:
            fn = make_block(routes)
        return cls(fn, [w for w, _ in slots if w is not None], specs, tuple(raws), tuple(tables),
                   tuple(biases), norms, eps, qk_norm, n_heads, n_kv_heads, head_dim, rope, scale * _LOG2E,
                   numba.get_num_threads() if n_threads is None else n_threads)

    def __call__(self, x, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales) -> None:
        """The block on x (n <= MAX_TOK, n_embd) float32 C-contiguous, in place; this step's K/V stored
        first, indices validated by the engine (the Backend contract)."""
        self.fn(x, *self.args, *self.rope, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages,
               v_scales, self.scale_log2e, self.n_threads, INT8_ISA)
