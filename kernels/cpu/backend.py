"""CpuBackend: numpy arrays, Numba kernels."""
from __future__ import annotations

import numba
import numpy as np

from ..backend import Backend
from .attention import attention, kv_store
from .dequant import dequantize
from .elementwise import add, rmsnorm, rope, silu_mul
from .qmatmul import qmatmul


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, n_threads: int | None = None):
        if n_threads:
            numba.set_num_threads(min(int(n_threads), numba.config.NUMBA_NUM_THREADS))
        self.n_threads = numba.get_num_threads()

    def empty(self, shape, dtype="float32"):
        return np.empty(shape, dtype=dtype)

    def to_host(self, arr):
        return arr

    def from_host(self, arr):
        return np.ascontiguousarray(arr)

    def upload_weight(self, w):
        return w

    def embed(self, w, token_ids):
        ids = np.asarray(token_ids, dtype=np.int64)
        return dequantize(w.qtype, np.asarray(w.raw[ids]), w.n_in)

    def qmatmul(self, w, x, out=None):
        if out is None:
            out = np.empty((x.shape[0], w.n_out), dtype=np.float32)
        qmatmul(w.qtype, w.raw, w.n_in, x, out)
        return out

    def rmsnorm(self, x, weight, eps, out=None):
        if out is None:
            out = np.empty_like(x)
        rmsnorm(x, weight, eps, out)
        return out

    def rope(self, x, positions, freq_base, n_rot, neox):
        rope(x, positions, freq_base, n_rot, neox)

    def silu_mul(self, gate, up, out=None):
        if out is None:
            out = np.empty_like(gate)
        silu_mul(gate, up, out)
        return out

    def add(self, a, b, out=None):
        if out is None:
            out = np.empty_like(a)
        if b.ndim == 1:   # bias over rows: numpy broadcasting is already memory-bound and vectorized
            np.add(a, b, out=out)
        else:
            add(a, b, out)
        return out

    def mul(self, a, b, out=None):
        return np.multiply(a, b, out=out)

    def take_rows(self, x, rows):
        return np.ascontiguousarray(x[np.asarray(rows, dtype=np.int64)])

    def kv_arrays(self, n_layers, n_pages, page_size, n_kv_heads, head_dim):
        shape = (n_layers, n_pages, page_size, n_kv_heads, head_dim)
        return (np.zeros(shape, np.int8), np.zeros(shape[:-1], np.float32),
                np.zeros(shape, np.int8), np.zeros(shape[:-1], np.float32))

    def kv_store(self, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales):
        kv_store(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales)

    def attention(self, q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, out=None):
        if out is None:
            out = np.empty_like(q)
        attention(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, out)
        return out
