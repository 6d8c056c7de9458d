"""Batch invariance of the CPU kernels: a token's result is bit-identical whatever else is in the call
(docs/speculative.md, docs/bounds.md). Mat-muls of the int8 layouts for any token count, attention with
and without a key split and next to other sequences, and the element-wise kernels in their serial and
parallel forms."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite.kernels.cpu import elementwise as ew
from strata_lite.kernels.cpu.attention import attention, kv_store
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu import repack as rp
from tiny_model import random_blocks

pytestmark = pytest.mark.skipif(not CpuBackend().int8, reason="the int8 kernels need AVX2 (this CPU has none)")


class _W:
    def __init__(self, qtype, raw, n_in):
        self.name, self.qtype, self.n_out, self.n_in, self.raw = "blk.0.ffn_up.weight", qtype, raw.shape[0], n_in, raw


@pytest.mark.parametrize("qtype,n_out,n_in,small", [(QT.Q8_0, 70, 512, False), (QT.Q5_0, 40, 256, True),
                                                    (QT.Q4_0, 33, 256, False), (QT.IQ4_NL, 20, 256, False),
                                                    (QT.Q4_K, 37, 512, False), (QT.Q6_K, 19, 768, False),
                                                    (QT.IQ3_XXS, 24, 512, False)])
def test_matmul_rows_do_not_depend_on_the_other_tokens(qtype, n_out, n_in, small, monkeypatch):
    monkeypatch.setattr(rp, "SMALL_BYTES", 1 << 30 if small else 0)
    be = CpuBackend()
    w = be.upload_weight(_W(qtype, random_blocks(np.random.default_rng(1), qtype, n_out, n_in), n_in))
    assert w.int8 and w.small == small
    x = np.random.default_rng(2).standard_normal((37, n_in), dtype=np.float32)
    full = be.qmatmul(w, x)
    for lo, hi in [(0, 1), (5, 6), (0, 2), (3, 8), (9, 12), (12, 37), (1, 36)]:
        np.testing.assert_array_equal(be.qmatmul(w, x[lo:hi].copy()), full[lo:hi])


def _cache(rng, n_pages=24, ps=16, n_kv=2, hd=64, n=300):
    from strata_lite.kernels.kv_layout import kv_shapes
    pages, scales = kv_shapes(1, n_pages, ps, n_kv, hd)
    cache = [np.zeros(pages[1:], np.int8), np.zeros(scales[1:], np.float32),
             np.zeros(pages[1:], np.int8), np.zeros(scales[1:], np.float32)]
    table = np.arange(n_pages, dtype=np.int32).reshape(2, n_pages // 2)
    for s in range(2):
        k = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
        v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
        kv_store(k, v, np.full(n, s, np.int32), np.arange(n, dtype=np.int32), table, *cache)
    return cache, table


@pytest.mark.parametrize("qk", ["float", "int8", "int16"])
@pytest.mark.parametrize("n_kv", [2, 1])
def test_attention_of_a_query_does_not_depend_on_the_call(qk, n_kv):
    """Alone, among its prompt chunk, next to another sequence's tokens, on 1 or 2 threads (one token
    over 1 KV head on 2 threads: the key range is split and the chunks merged): the same bits, on every
    q.k path. Positions past 512 keys exercise the chunk fold."""
    import numba
    rng = np.random.default_rng(3)
    cache, table = _cache(rng, n_pages=80, ps=16, n_kv=n_kv, n=620)
    n_heads, hd = 8, 64
    q = rng.standard_normal((40, n_heads, hd)).astype(np.float32)
    seq = np.array([0] * 30 + [1] * 10, np.int32)
    pos = np.array(list(range(590, 620)) + list(range(100, 110)), np.int32)

    def run(idx):
        out = np.empty((len(idx), n_heads, hd), np.float32)
        attention(q[idx].copy(), seq[idx].copy(), pos[idx].copy(), table, *cache, 0.125, out, qk=qk)
        return out

    everything = run(np.arange(40))
    threads = numba.get_num_threads()
    try:
        for n_threads in sorted({1, threads}):
            numba.set_num_threads(n_threads)
            for idx in ([29], [0], [35], list(range(0, 7)), [3, 33], list(range(20, 40))):
                np.testing.assert_array_equal(run(np.asarray(idx)), everything[idx])
    finally:
        numba.set_num_threads(threads)


def test_elementwise_serial_and_parallel_forms_agree():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((70, 14, 64)).astype(np.float32)      # 62,720 values: the parallel kernels
    pos = np.arange(500, 570, dtype=np.int32)
    scale = (1 + 0.1 * rng.standard_normal((14, 64))).astype(np.float32)
    many = x.copy()
    ew.rope(many, pos, 1e6, 64, True, channel_scale=scale)
    for t in (0, 13, 69):
        one = x[t:t + 1].copy()
        ew.rope(one, pos[t:t + 1], 1e6, 64, True, channel_scale=scale)
        np.testing.assert_array_equal(one[0], many[t])
    h = rng.standard_normal((70, 896)).astype(np.float32)
    w = rng.standard_normal(896).astype(np.float32)
    out = np.empty_like(h)
    ew.rmsnorm(h, w, 1e-6, out)
    for t in (0, 41):
        one = np.empty((1, 896), np.float32)
        ew.rmsnorm(h[t:t + 1], w, 1e-6, one)
        np.testing.assert_array_equal(one[0], out[t])


@pytest.mark.parametrize("qtype,n_in", [(QT.Q5_0, 256), (QT.Q4_K, 512), (QT.Q8_0, 256)])
def test_gate_up_in_row_pieces_is_the_one_call(qtype, n_in, monkeypatch):
    """CpuBackend.qmatmul_glu applies silu * up GLU_ROWS rows at a time, into the mat-mul's own output: the
    same bits as Backend.qmatmul_glu (split the whole output, then silu * up)."""
    from strata_lite.kernels.backend import Backend
    from strata_lite.kernels.cpu import backend as cpu_backend
    monkeypatch.setattr(cpu_backend, "GLU_ROWS", 16)
    be = CpuBackend()
    rng = np.random.default_rng(5)
    gate, up = (be.upload_weight(_W(qtype, random_blocks(rng, qtype, 40, n_in), n_in)) for _ in range(2))
    w = be.fuse_rows([gate, up])
    assert w is not None and w.int8
    for n_tok in (1, 16, 17, 37, 64):
        x = rng.standard_normal((n_tok, n_in), dtype=np.float32)
        got = be.qmatmul_glu(w, x)
        assert got.shape == (n_tok, 40) and got.flags.c_contiguous
        np.testing.assert_array_equal(got, Backend.qmatmul_glu(be, w, x))
