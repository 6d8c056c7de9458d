"""CpuBackend: numpy arrays, Numba kernels."""
from __future__ import annotations

import os

import numba
import numpy as np
from gguf import GGMLQuantizationType as QType

from ..backend import Backend
from ..kv_layout import kv_shapes
from .act_quant import activation_format
from .attention import attention_nocheck, kv_store
from .decode_block import DecodeBlock
from .dequant import dequantize
from .isa import int8_enabled, kernel_family, log_kernel_family
from .elementwise import add, rmsnorm, rope, silu_mul
from .qmatmul import qmatmul_packed
from . import q6_k_int8, rows4_int8
from .repack import INT8_LAYOUTS, Q6K_I8, Q8_0_R4, PackedWeight, pack_weight, release_pages
from .rope_store import rope_kv_store
from .sampling import add_counts, argmax_prob, sample

# qmatmul_glu turns the fused gate/up output y (n, 2 * n_ff) into silu(gate) * up this many rows at a time,
# into y's own buffer: the split halves and the result then cost 2 x GLU_ROWS rows, not 2 x n (512 tokens of
# the 0.5B model: 19 MiB for the halves and 9.5 for the result; docs/cpu.md).
GLU_ROWS = 64
# residual adds of up to this many rows (decode steps) go straight to numpy: single-threaded, ~1 us at one token
DIRECT_ADD_ROWS = 8
# token embeddings of up to this many rows (decode and verify steps) are dequantized on the calling thread
EMBED_SERIAL_ROWS = 8


def _interleaved_q8_0_rows(raw, n_cols, ids):
    """Rows ids of an interleaved Q8_0 copy as float32: its blocks back in the file's order, dequantized."""
    return dequantize(QType.Q8_0, rows4_int8.q8_0_rows(raw, n_cols, ids), n_cols,
                      serial=np.size(ids) <= EMBED_SERIAL_ROWS)


# the repacked layouts a tied output's copy serves the embedding's rows from (the file's values, bit for bit), so
# that the copy replaces the file's pages instead of sitting beside them: layout -> rows(raw, n_cols, ids) float32
_EMBED_FROM_COPY = {Q8_0_R4: _interleaved_q8_0_rows, Q6K_I8: q6_k_int8.dequantize_rows}
_EMBED_FROM_COPY_TYPES = frozenset(INT8_LAYOUTS[layout][0] for layout in _EMBED_FROM_COPY)   # their file types


class _Raw:
    """Plain (name, qtype, n_out, n_in, raw) view of a weight, for pack_weight."""
    __slots__ = ("name", "qtype", "n_out", "n_in", "raw")

    def __init__(self, w):
        self.name, self.qtype, self.n_out, self.n_in, self.raw = w.name, w.qtype, w.n_out, w.n_in, w.raw


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, n_threads: int | None = None):
        if n_threads:
            numba.set_num_threads(min(int(n_threads), numba.config.NUMBA_NUM_THREADS))
        self.n_threads = numba.get_num_threads()
        self.repack = True            # lossless Q4_0/Q5_0/IQ4_NL -> Q8_0 at upload (repack.py)
        # AVX2 int8 kernels (docs/design.md): IQ3_XXS, Q4_K, Q5_K and Q6_K repacked losslessly for nibble_int8.py
        # (3-5x faster per weight than the float kernels, 1.11-1.47x the bytes) and Q8_0 mat-vecs in int8
        # (q8_0_int8.py: 2x). STRATA_LITE_INT8=0 keeps the float kernels and the file's layouts.
        self.int8 = int8_enabled()
        log_kernel_family()           # which int8 path (AVX2 or VNNI, isa.py), once a process
        self._matmul_cache = {}       # id(weight) -> (weight, PackedWeight) for _packed_for_matmul

    def describe(self) -> str:
        """cpu (threads; the kernel family: int8 AVX2 or float, and why; why auto chose the CPU)."""
        parts = [f"{self.n_threads} thread{'s' if self.n_threads != 1 else ''}", kernel_family()]
        if getattr(self, "auto_reason", None):
            parts.append(self.auto_reason)
        return f"cpu ({'; '.join(parts)})"

    def empty(self, shape, dtype="float32"):
        return np.empty(shape, dtype=dtype)

    def to_host(self, arr):
        return arr

    def from_host(self, arr):
        return np.ascontiguousarray(arr)

    def upload_weight(self, w, vocab_rows: bool = False):
        """-> PackedWeight (repack.py), kernel views precomputed: Q4_0/Q5_0/IQ4_NL in their own blocks for
        the AVX2 int8 kernel (without it losslessly repacked to Q8_0), IQ3_XXS/Q4_K/Q6_K repacked for it.
        The token embedding is only looked up row by row (embed), so it keeps its file layout; if it
        doubles as the output matrix it is repacked on its first qmatmul (_packed_for_matmul). vocab_rows:
        pack_weight's (every Q8_0 vocabulary matrix takes the one interleaved layout, so a row gives its bits
        in each, the tied output's copy included)."""
        if w.name.startswith("token_embd"):
            return PackedWeight(w.name, w.qtype, w.n_out, w.n_in, w.raw, final=not self.repack)
        return pack_weight(w, repack=self.repack, int8=self.int8, vocab_rows=vocab_rows)

    def fuse_rows(self, weights):
        ws = list(weights)
        if not all(type(w) is PackedWeight and w.final for w in ws):
            return None
        if len({(w.qtype, w.layout) for w in ws}) != 1 or len({w.n_in for w in ws}) != 1 \
                or len({activation_format(w.src_qtype) for w in ws}) != 1:
            return None
        raw = np.concatenate([w.raw for w in ws])
        for w in ws:    # the fused copy replaces them: drop their mapped pages from the process (RSS)
            release_pages(w.raw)
        return PackedWeight("+".join(w.name for w in ws), ws[0].qtype, raw.shape[0], ws[0].n_in, raw,
                            src_qtype=ws[0].src_qtype, layout=ws[0].layout, int8=self.int8)

    def decode_block(self, layer, n_heads, n_kv_heads, head_dim, eps, freq_base, n_rot, neox, qk_norm, scale):
        """decode_block.py's one-call block (the same bits); STRATA_LITE_DECODE_BLOCK=0 keeps every block on
        the per-call path, =shared takes decode_block_shared.py's block (one parallel region a block)."""
        mode = os.environ.get("STRATA_LITE_DECODE_BLOCK", "1")
        if mode == "0":
            return None
        return DecodeBlock.build(layer, n_heads, n_kv_heads, head_dim, eps, freq_base, n_rot, neox, qk_norm, scale,
                                 shared=mode == "shared", n_threads=self.n_threads)

    def qmatmul_add(self, w, x, out):
        y = self.qmatmul(w, x)
        if out.shape[0] <= DIRECT_ADD_ROWS:   # numpy's float32 add: the add kernel's bits, without its checks
            np.add(out, y, out=out)
        else:
            self.add(out, y, out=out)

    def qmatmul_glu(self, w, x):
        """silu(gate) * up (n, w.n_out / 2), as Backend.qmatmul_glu (one mat-mul, then the element-wise
        kernel, the same bits), GLU_ROWS rows at a time into the first half of the mat-mul's output: rows
        a..b of the result overwrite y's rows a/2..b/2, which their halves were copied out of already."""
        y = self.qmatmul(w, x)
        n, half = y.shape[0], w.n_out // 2
        if n == 1:      # one token: both halves are contiguous views, the result overwrites the gate half
            silu_mul(y[:, :half], y[:, half:], y[:, :half])
            return y[:, :half]
        act = y.reshape(-1)[:n * half].reshape(n, half)
        for a in range(0, n, GLU_ROWS):
            b = min(n, a + GLU_ROWS)
            g, u = self.split_cols(y[a:b], (half, half))
            silu_mul(g, u, act[a:b])
        return act

    def embed(self, w, token_ids):
        """Rows of the token embedding as float32. A decode step's few rows are dequantized on the calling
        thread: waking the thread pool for one row cost ~140 µs a step on the default model, the row itself
        a few µs. A tied output's repacked copy (Q8_0 interleaved, Q6_K), once made, replaced the file's pages, and
        the rows come from it (the same values, bit for bit)."""
        packed = self._matmul_cache.get(id(w))
        if packed is not None and packed[0] is w and packed[1].layout in _EMBED_FROM_COPY:
            return _EMBED_FROM_COPY[packed[1].layout](packed[1].raw, w.n_in, token_ids)
        raw = np.asarray(w.raw[token_ids])
        return dequantize(w.qtype, raw, w.n_in, serial=len(raw) <= EMBED_SERIAL_ROWS)

    def qmatmul(self, w, x, out=None):
        if type(w) is not PackedWeight or not w.final:
            w = self._packed_for_matmul(w)
        return qmatmul_packed(w, x, out)

    def _packed_for_matmul(self, w):
        """Weights not (or not yet) repacked: a QuantTensor that skipped upload_weight, or the
        token embedding used as the tied output matrix (a vocabulary's rows: pack_weight's vocab_rows).
        Packed once, cached. A Q8_0 or Q6_K tied output's repacked copy replaces the file's pages (embed reads
        its rows from the copy); other types keep the file's rows for embed beside their repacked copy."""
        key = id(w)
        hit = self._matmul_cache.get(key)
        if hit is None or hit[0] is not w:
            tied = isinstance(w, PackedWeight)       # the token embedding (upload_weight: not final)
            hit = (w, pack_weight(_Raw(w), repack=self.repack, int8=self.int8, vocab_rows=tied,
                                  release_source=tied and int(w.qtype) in _EMBED_FROM_COPY_TYPES))
            self._matmul_cache[key] = hit
        return hit[1]

    def rmsnorm(self, x, weight, eps, out=None, round_for=None):   # round_for: nothing to fuse here
        if out is None:
            out = np.empty_like(x)
        rmsnorm(x, weight, eps, out)
        return out

    def rope(self, x, positions, freq_base, n_rot, neox, channel_scale=None):
        rope(x, positions, freq_base, n_rot, neox, channel_scale)

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

    def split_cols(self, x, widths):
        out, at = [], 0
        for w in widths:
            out.append(np.ascontiguousarray(x[:, at:at + w]))
            at += w
        return out

    def take_rows(self, x, rows):
        return np.ascontiguousarray(x[rows])

    def kv_arrays(self, n_layers, n_pages, page_size, n_kv_heads, head_dim):
        pages, scales = kv_shapes(n_layers, n_pages, page_size, n_kv_heads, head_dim)
        return (np.zeros(pages, np.int8), np.zeros(scales, np.float32),
                np.zeros(pages, np.int8), np.zeros(scales, np.float32))

    def kv_store(self, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales):
        kv_store(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales)

    def attention(self, q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, out=None,
                  max_keys=None, split_rows=0, runs=()):
        # the engine validated the batch and built the cache (Backend contract): no checks per block
        if out is None:
            out = np.empty_like(q)
        attention_nocheck(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, out)
        return out

    def rope_kv_store(self, q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                      freq_base, n_rot, neox, q_scale=None, k_scale=None):
        rope_kv_store(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                      freq_base, n_rot, neox, q_scale, k_scale)

    def sample(self, logits, rows, counts):
        return sample(logits, rows, counts)

    def argmax_prob(self, logits):
        return argmax_prob(logits)

    def token_counts(self, n_rows, n_vocab):
        return np.zeros((n_rows, n_vocab), np.int32)

    def add_counts(self, counts, count_rows, ids):
        add_counts(counts, count_rows, ids)

    def reset_counts(self, counts, row):
        counts[row] = 0
