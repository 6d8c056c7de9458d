"""CudaBackend: cupy arrays on one GPU, CuPy RawKernels (.cu files here) and Numba CUDA kernels.

Every kernel runs on the backend's own non-blocking stream (graph capture needs one). Arrays returned by the
compute methods are newly allocated from CuPy's memory pool unless `out` is given; while a decode step is
being captured (graphs.py) that pool is the graph's private one, so the step's intermediates keep fixed
addresses for every replay. Long-lived buffers (activation rounding, attention partials, sampling scratch)
are allocated once by `reserve` from the sizes the runner plans, before anything is captured.
"""
from __future__ import annotations

import os

import numpy as np

from ..backend import Backend
from ..kv_layout import kv_shapes
from . import attention as attn_k
from . import attention_f16 as attn_f16
from . import elementwise as ew
from . import qmatmul as qm
from . import sampling as smp
from .kv_store import kv_store, rope_kv_store
from .layouts import device_row_bytes
from .memory import VramPlan
from .runtime import cupy

ROPE_TABLE_MAX_BYTES = 64 << 20   # cos/sin tables (per freq_base, n_rot) above this: angles computed per launch


class CudaBackend(Backend):
    name = "cuda"
    uses_scratch_page = True
    queues_work = True

    def __init__(self, device: int = 0, vram_reserve_mib: int = 1024):
        cp = self.cp = cupy()
        self.device = cp.cuda.Device(int(device))
        self.device.use()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.stream.use()                 # CuPy's current stream for this thread: every launch goes here
        props = cp.cuda.runtime.getDeviceProperties(self.device.id)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.plan = VramPlan(self.device, vram_reserve_mib)
        self._act = self._attn_ws = self._sample_ws = None
        self._rounded = None            # (rmsnorm output, format) whose rounding sits in self._act
        self._rope_tables = {}          # (freq_base, n_rot) -> ew.RopeTable or None (_rope_table)
        self.max_keys = 0
        # how prompt runs' attention is read: "exact" (the decode kernels' bits, attention.py) or "f16" (a flash
        # attention over an f16 copy of the sequence's keys, attention_f16.py, for the head dims in
        # prompt_head_dims; set from EngineConfig)
        self.prompt_attention = "exact"
        self.prompt_head_dims = attn_f16.HEAD_DIMS

    def describe(self) -> str:
        free, total = self.cp.cuda.runtime.memGetInfo()
        return f"cuda:{self.device.id} ({self.device_name}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free)"

    # ------------------------------------------------------------------ memory
    def empty(self, shape, dtype="float32"):
        return self.cp.empty(shape, dtype=dtype)

    def to_host(self, arr):
        if isinstance(arr, np.ndarray):
            return arr
        return self.cp.asnumpy(arr, stream=self.stream)   # ordered after the work that produced it

    def from_host(self, arr):
        if isinstance(arr, self.cp.ndarray):
            return arr
        return self.cp.asarray(np.ascontiguousarray(arr))

    def upload_weight(self, w, vocab_rows: bool = False):
        """A QuantTensor's raw blocks copied to the device in the type's device layout (layouts.py: the file's
        blocks, or the same bytes as aligned field planes; a row's bits never depend on the matrix, vocab_rows
        or not)."""
        self.plan.check_fits(w.n_out * device_row_bytes(w.qtype, w.n_in), f"weight {w.name}")
        return qm.upload(w)

    def fuse_rows(self, weights):
        return qm.concat_rows(list(weights))

    def reserve(self, max_tokens: int, max_width: int, n_heads: int, head_dim: int, max_keys: int,
                n_vocab: int, max_rows: int) -> None:
        """Allocate the long-lived workspaces for forwards of up to max_tokens tokens whose widest matrix
        input is max_width, attention over up to max_keys keys, and sampling of up to max_rows rows. The
        activation and attention buffers are checked against the VRAM plan first (the sampling buffers are
        a few KB per row)."""
        need = (qm.act_buffers_nbytes(max_tokens, max_width)
                + attn_k.attention_workspace_nbytes(max_tokens, n_heads, head_dim, max_keys))
        self.plan.check_fits(need, f"the step workspaces ({max_tokens} tokens, {max_keys} keys)")
        self._act = qm.ActBuffers(max_tokens, max_width)
        self._rounded = None
        self._attn_ws = attn_k.attention_workspace(max_tokens, n_heads, head_dim, max_keys)
        self._sample_ws = smp.sampling_workspace(max_rows, n_vocab)
        self.max_tokens, self.max_keys = int(max_tokens), int(max_keys)
        self._rope_tables = {}

    # ------------------------------------------------------------------ compute
    def embed(self, w, token_ids):
        ids = self.from_host(np.asarray(token_ids, np.int32) if isinstance(token_ids, np.ndarray) else token_ids)
        out = self.cp.empty((ids.shape[0], w.n_in), dtype=self.cp.float32)
        qm.dequant_rows(w, ids, out)
        return out

    def qmatmul(self, w, x, out=None):
        if out is None:
            out = self.cp.empty((x.shape[0], w.n_out), dtype=self.cp.float32)
        self._matmul(w, x, out)
        return out

    def qmatmul_split(self, w, x, widths, bias=None):
        outs = [self.cp.empty((x.shape[0], int(width)), dtype=self.cp.float32) for width in widths]
        self._matmul(w, x, outs, bias=bias)
        return outs

    def qmatmul_add(self, w, x, out) -> None:
        self._matmul(w, x, out, accumulate=True)

    def qmatmul_glu(self, w, x):
        out = self.cp.empty((x.shape[0], w.n_out // 2), dtype=self.cp.float32)
        self._matmul(w, x, out, glu=True)
        return out

    def _matmul(self, w, x, out, **epilogue) -> None:
        """qm.matmul, or the mat-mul alone when x is the rmsnorm output already rounded for w's format
        (rmsnorm round_for). Any other rounding into the same buffers ends that."""
        act = self._workspace_act(x.shape[0])
        fmt = qm.act_format(w.qtype)
        rounded = self._rounded
        if fmt is not None and rounded is not None and rounded[0] is x and rounded[1] == fmt:
            xq, xd = act.views(fmt, x.shape[0], w.n_in)
            qm.matmul_prequantized(w, xq, xd, out, tiles=act, **epilogue)
            return
        if fmt is not None and rounded is not None and rounded[1] == fmt:
            self._rounded = None
        qm.matmul(w, x, out, act, **epilogue)

    def _workspace_act(self, n):
        if self._act is None or n > self.max_tokens:
            raise ValueError(f"a forward of {n} tokens exceeds the reserved workspace "
                             f"({0 if self._act is None else self.max_tokens} tokens); call reserve() first")
        return self._act

    def rmsnorm(self, x, weight, eps, out=None, round_for=None):
        if out is None:
            out = self.cp.empty_like(x)
        fmt = None if round_for is None else qm.act_format(round_for.qtype)
        if fmt is not None and ew.can_round(x, weight, out, fmt) and x.shape[1] == round_for.n_in:
            xq, xd = self._workspace_act(x.shape[0]).views(fmt, x.shape[0], x.shape[1])
            ew.rmsnorm_round(x, weight, float(eps), out, fmt, xq, xd)
            self._rounded = (out, fmt)          # holds out: its identity cannot be reused while marked
            return out
        ew.rmsnorm(x, weight, float(eps), out)
        return out

    def _rope_table(self, freq_base, n_rot):
        """The cos / sin table of (freq_base, n_rot) for positions < max_keys, made at its first use after
        reserve(); None before reserve() or when it would exceed ROPE_TABLE_MAX_BYTES (rope then computes
        the angles in the launch: the same bits)."""
        key = (float(freq_base), int(n_rot))
        if key not in self._rope_tables:
            n_pos = self.max_keys
            fits = 0 < n_pos * (int(n_rot) // 2) * 8 <= ROPE_TABLE_MAX_BYTES
            with self.cp.cuda.using_allocator(self.cp.get_default_memory_pool().malloc):   # not a graph's pool
                self._rope_tables[key] = ew.rope_table(*key, n_pos) if fits else None
        return self._rope_tables[key]

    def rope(self, x, positions, freq_base, n_rot, neox, channel_scale=None):
        ew.rope(x, self.from_host(positions), float(freq_base), int(n_rot), bool(neox), channel_scale,
                table=self._rope_table(freq_base, n_rot))

    def rope_qk(self, q, k, positions, freq_base, n_rot, neox, q_scale=None, k_scale=None):
        ew.rope_qk(q, k, self.from_host(positions), float(freq_base), int(n_rot), bool(neox), q_scale, k_scale,
                   table=self._rope_table(freq_base, n_rot))

    def silu_mul(self, gate, up, out=None):
        if out is None:
            out = self.cp.empty_like(gate)
        ew.silu_mul(gate, up, out)
        return out

    def add(self, a, b, out=None):
        if out is None:
            out = self.cp.empty_like(a)
        ew.add(a, b, out)
        return out

    def take_rows(self, x, rows):
        rows = self.from_host(np.asarray(rows, np.int32) if isinstance(rows, np.ndarray) else rows)
        out = self.cp.empty((rows.shape[0], x.shape[1]), dtype=x.dtype)
        ew.take_rows(x, rows, out)
        return out

    def split_cols(self, x, widths):
        pieces, at = [], 0
        for w in widths:
            out = self.cp.empty((x.shape[0], w), dtype=x.dtype)
            ew.copy_cols(x, at, w, out)
            pieces.append(out)
            at += w
        return pieces

    # ------------------------------------------------------------------ KV cache
    def kv_arrays(self, n_layers, n_pages, page_size, n_kv_heads, head_dim):
        pages, scales = kv_shapes(n_layers, n_pages, page_size, n_kv_heads, head_dim)
        need = 2 * (int(np.prod(pages)) + 4 * int(np.prod(scales)))
        self.plan.check_fits(need, f"the KV cache ({n_pages} pages of {page_size} tokens)")
        cp = self.cp
        return (cp.zeros(pages, cp.int8), cp.zeros(scales, cp.float32),
                cp.zeros(pages, cp.int8), cp.zeros(scales, cp.float32))

    def kv_store(self, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales):
        kv_store(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales)

    def rope_kv_store(self, q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                      freq_base, n_rot, neox, q_scale=None, k_scale=None):
        rope_kv_store(q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                      float(freq_base), int(n_rot), bool(neox), q_scale, k_scale,
                      table=self._rope_table(freq_base, n_rot))

    def attention(self, q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale,
                  out=None, max_keys=None, split_rows=0, runs=()):
        if out is None:
            out = self.cp.empty_like(q)
        if self._attn_ws is None:
            raise ValueError("attention before reserve(): no workspace")
        keys = self.max_keys if max_keys is None else int(max_keys)
        cache = (page_tables, k_pages, k_scales, v_pages, v_scales)
        if self.prompt_attention == "f16" and runs and q.shape[-1] in attn_f16.HEAD_DIMS:
            # the rows before the prompt runs (decode and verify tokens) as always, then each prompt run through the
            # f16 copy of its sequence's keys (attention_f16.py)
            decode = runs[0][0]
            if decode > 0:
                attn_k.attention(q[:decode], token_seq[:decode], token_pos[:decode], *cache,
                                 float(scale), out[:decode], self._attn_ws, keys)
            for a, b, seq, n_keys in runs:
                attn_f16.prompt_attention_f16(q[a:b], seq, token_pos[a:b], *cache, float(scale), out[a:b], n_keys)
            return out
        attn_k.attention(q, token_seq, token_pos, *cache, float(scale), out, self._attn_ws, keys,
                         split_rows=int(split_rows))
        return out

    # ------------------------------------------------------------------ sampling
    def token_counts(self, n_rows, n_vocab):
        return self.cp.zeros((int(n_rows), int(n_vocab)), dtype=self.cp.int32)

    def add_counts(self, counts, count_rows, ids):
        smp.add_counts(counts, np.asarray(count_rows, np.int32), np.asarray(ids, np.int32))

    def reset_counts(self, counts, row):
        counts[int(row)].fill(0)

    def sample(self, logits, rows, counts):
        return smp.sample(logits, rows, counts, self._sample_ws)

    def argmax_prob(self, logits):
        return smp.greedy_with_prob(logits)

    def argmax_ids(self, logits):
        return smp.greedy_ids(logits, self.cp.empty(logits.shape[0], self.cp.int32))

    def step_results(self, logits, ids=None):
        return smp.step_results(logits, ids)

    def draft_results(self, logits, res):
        smp.draft_results(logits, res)

    # ------------------------------------------------------------------ services
    def kv_copier(self, dev_arrays, host_arrays):
        from .kv_copy import CudaKVCopier
        return CudaKVCopier(dev_arrays, host_arrays)

    def decode_graphs(self, forward, max_pages, max_keys, scratch_page, logits=True, row_inputs=(), max_seqs=1,
                      max_tokens=16):
        if os.environ.get("STRATA_LITE_CUDA_GRAPHS", "1") == "0":
            return None
        from .graphs import StepGraphs, step_buckets
        return StepGraphs(forward, max_pages, max_keys, scratch_page, buckets=step_buckets(max_seqs, max_tokens),
                          logits=logits, row_inputs=row_inputs)

    def is_fault(self, exc):
        """Every CUDA runtime / driver error: CuPy raises them for faults of earlier kernels too, and the
        common ones (illegal address, launch failure) are sticky for the whole context."""
        from cupy_backends.cuda.api import driver, runtime
        return isinstance(exc, (runtime.CUDARuntimeError, driver.CUDADriverError))

    def synchronize(self) -> None:
        """Wait for the stream; a CUDA fault raised by earlier kernels surfaces here."""
        self.stream.synchronize()
