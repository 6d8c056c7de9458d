"""Q5_0 / Q4_0 / IQ4_NL / Q8_0 matrices of 4k rows, interleaved by 4 rows (kernels/cpu/rows4_int8.py), against
gguf.quants and float64, for batch invariance and through the backend.

* Lossless: the kernel fed 127 e_j (activation scale exactly 1) returns 127 x the weight gguf.quants.dequantize
  gives, bit for bit, for every column j of every row: every nibble, fifth bit and scale of the file reaches
  the integer dot where it belongs.
* Float64 reference (weights and Q8_0-rounded activations are exact float32 products, so the reference is
  exact): per (token, row) the kernel rounds the scale product d_w d_a once (relative 2^-24) and its running
  sum once per block (nb FMAs, each within 2^-24 of the partial sum, which is at most sum |w| |x|). Bound:
  (nb + 2) 2^-24 sum |w| |x|, rigorous; measured at most ~0.02 of it over these cases (the errors are
  ~2^-25 of the sum, the bound grows with nb). A single wrong weight moves a result by ~1 / n_cols of that sum
  (>= 2e-4 here), orders of magnitude above the bound.
* Batch invariance: every token's row is the same bits alone, in any chunk of 1-8 tokens, in a prompt of 17 or
  70, on one thread or several, with AVX2 or VNNI instructions (where the CPU has VNNI).
"""
from types import SimpleNamespace

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from numba import njit

from strata_lite.kernels.cpu import repack as rp
from strata_lite.kernels.cpu import rows4, rows4_gemm
from strata_lite.kernels.cpu import rows4_int8 as r4
from strata_lite.kernels.cpu.act_quant import round_activations
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.isa import AVX2, VNNI, VNNI_BUILT, host_has_avx2
from test_dequant import random_rows
# random blocks with the extremes; activations with an all-zero and a large block
from test_own_blocks_int8 import _rows as _own_rows, _x

pytestmark = pytest.mark.skipif(not host_has_avx2(), reason="the int8 kernels need an AVX2 CPU")

FORMATS = {QType.Q5_0: rows4.Q5_0_R4, QType.Q4_0: rows4.Q4_0_R4, QType.IQ4_NL: rows4.IQ4_NL_R4,
           QType.Q8_0: rows4.Q8_0_R4}
LAYOUTS = {QType.Q5_0: rp.Q5_0_R4, QType.Q4_0: rp.Q4_0_R4, QType.IQ4_NL: rp.IQ4_NL_R4, QType.Q8_0: rp.Q8_0_R4}
TYPES = sorted(FORMATS, key=lambda t: t.name)
SHAPES = [(4, 64), (12, 896), (36, 4864)]            # (rows, columns): one group, the 0.5B's widths; odd groups
ISAS = (AVX2, VNNI) if VNNI_BUILT else (AVX2,)


def _rows(qtype, n_out, n_cols, seed):
    """_own_rows' blocks; Q8_0 also gets a block of -128 (|w| = 128 in the sign form) and one of 127."""
    raw = _own_rows(qtype, n_out, n_cols, seed)
    if qtype == QType.Q8_0:
        b = raw.reshape(n_out, n_cols // 32, -1)
        b[0, -1, 2:] = 0x80
        b[-1, 0, 2:] = 0x7F
    return raw


def _run(fmt, raw3, x, **kw):
    out = np.full((x.shape[0], raw3.shape[0]), np.nan, np.float32)
    fmt.matvec(raw3, x.reshape(x.shape[0], -1, 32), out, **kw)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unpacking_is_lossless(qtype):
    n_out, n_cols = 8, 256
    raw = _rows(qtype, n_out, n_cols, seed=11)
    fmt = FORMATS[qtype]
    raw3 = fmt.repack(raw, n_cols).reshape(n_out, n_cols // 32, -1)
    x = np.zeros((n_cols, n_cols), np.float32)
    np.fill_diagonal(x, 127.0)                      # token j: 127 at column j (scale 1, q 127)
    for isa in ISAS:
        np.testing.assert_array_equal(_run(fmt, raw3, x, isa=isa),
                                      np.float32(127) * gguf.quants.dequantize(raw, qtype).T)


@pytest.mark.parametrize("n_out,n_cols", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_against_float64_and_batch_invariant(qtype, n_out, n_cols):
    raw = _rows(qtype, n_out, n_cols, seed=n_out)
    fmt = FORMATS[qtype]
    packed = fmt.repack(raw, n_cols)
    assert packed.shape == raw.shape and packed.dtype == np.uint8
    raw3 = packed.reshape(n_out, n_cols // 32, -1)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    bound = (n_cols // 32 + 2) * 2.0 ** -24
    x = _x(70, n_cols, seed=n_cols)
    xr = round_activations(QType.Q8_0, x).astype(np.float64)            # llama.cpp's Q8_0 rounding
    full = _run(fmt, raw3, x)
    scale = np.abs(xr) @ np.abs(w).T                 # 0 where a (token, row) meets only zeros: the result must be 0
    err = np.abs(full.astype(np.float64) - xr @ w.T) / np.where(scale > 0, scale, 1.0)
    assert np.all(err <= bound), f"{np.max(err) / bound:.3g} of the bound"
    assert rows4_gemm.MIN_TOK <= 17                  # 17 and 70 tokens take the GEMM, fewer the mat-vec kernel
    alone = np.concatenate([_run(fmt, raw3, x[t:t + 1]) for t in range(x.shape[0])])
    np.testing.assert_array_equal(full, alone)
    for n_tok in (2, 3, 8, 9, 17):
        for isa in ISAS:
            for serial in (False, True):
                np.testing.assert_array_equal(_run(fmt, raw3, x[:n_tok], isa=isa, serial=serial), full[:n_tok],
                                              err_msg=f"{n_tok} tokens, isa {isa}, serial {serial}")


def _order_gemm(tile):
    """rows4_gemm's GEMM on one thread with `tile` (an AVX2 tile of any order) for every group and token pair."""
    @njit
    def gemm(raw3, x3, out, kind, w_rec):
        n_groups, nb = raw3.shape[0] // r4.ROWS, raw3.shape[1]
        n_tg = (x3.shape[0] + 7) // 8
        a = np.empty((n_tg, nb, rows4_gemm.a_record(8)[3]), dtype=np.uint8)
        rows4_gemm._pack_activations(x3, a, a.view(np.float32), a.view(np.int32), r4.offset(kind, AVX2), 8)
        pw = np.empty((n_groups, nb, w_rec), dtype=np.uint8)
        for i in range(n_groups):
            rows4_gemm._unpack(kind, AVX2, raw3, i, pw, i)
        for tg in range(0, n_tg, 2):
            for i in range(n_groups):
                tile(pw, i, a, tg, min(tg + 1, n_tg - 1), out, r4.ROWS * i)
    return gemm


@pytest.mark.parametrize("order", [rows4_gemm.LANES, rows4_gemm.ROWS_UNROLLED, rows4_gemm.ROW_LOOP],
                         ids=["lanes", "rows_unrolled", "row_loop"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_tile_order_gives_the_mat_vec_bits(qtype, order):
    """The AVX2 tiles walk a block in three orders (which one a CPU runs depends on its type, _make_tile); each
    gives the mat-vec kernel's bits, the sign form (IQ4_NL, Q8_0) and the codes' int16 sums alike."""
    fmt = FORMATS[qtype]
    sign = r4.sign_form(fmt.kind, AVX2)
    n_out, n_cols = 12, 896
    raw3 = fmt.repack(_rows(qtype, n_out, n_cols, seed=5), n_cols).reshape(n_out, n_cols // 32, -1)
    x = _x(19, n_cols, seed=7)
    out = np.full((x.shape[0], n_out), np.nan, np.float32)
    _order_gemm(rows4_gemm._make_tile(AVX2, sign, order=order))(raw3, x.reshape(19, -1, 32), out, fmt.kind,
                                                                 rows4_gemm._w_rec(sign))
    matvec = np.concatenate([_run(fmt, raw3, x[t:t + 8], isa=AVX2) for t in (0, 8, 16)])   # 8, 8, 3 tokens
    np.testing.assert_array_equal(out, matvec)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_backend_takes_it_for_4k_rows_only(qtype):
    be = CpuBackend()
    n_cols = 896
    ws = [SimpleNamespace(name=f"w{i}", qtype=qtype, n_out=n, n_in=n_cols, raw=_rows(qtype, n, n_cols, seed=n))
          for i, n in enumerate((64, 8, 7))]
    up = [be.upload_weight(w) for w in ws]
    assert [u.layout for u in up] == [LAYOUTS[qtype]] * 2 + [rp.GGML]
    assert up[0].nbytes == ws[0].raw.nbytes                                  # the file's bytes, rearranged
    x = _x(5, n_cols, seed=3)
    xr = round_activations(QType.Q8_0, x).astype(np.float64)
    for w, u in zip(ws, up):
        ref = xr @ gguf.quants.dequantize(w.raw, qtype).astype(np.float64).T
        np.testing.assert_allclose(be.qmatmul(u, x), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    fused = be.fuse_rows(up[:2])                                             # q/k/v-style concatenation
    assert fused.layout == up[0].layout and fused.n_out == 72
    np.testing.assert_array_equal(be.qmatmul(fused, x), np.concatenate([be.qmatmul(u, x) for u in up[:2]], 1))
    assert be.fuse_rows(up) is None                                         # layouts differ: kept apart


def test_q8_0_vocabulary_rows_take_one_layout_at_any_count_and_a_tied_output_is_looked_up_from_it():
    """Rows that score the vocabulary (vocab_rows: the output matrix, MTP heads) are interleaved whatever their
    count, the last group padded with zero rows, so a head cut to any number of them gives the full matrix's
    bits. A Q8_0 token embedding doubling as the output (tied) takes the same layout on its first mat-mul, its
    cut rows give its bits, and its embedding rows then come from the interleaved copy, the file's values."""
    n_cols = 256
    emb_raw = _rows(QType.Q8_0, 64, n_cols, seed=5)
    be = CpuBackend()
    x = _x(3, n_cols, seed=4)
    vocab = SimpleNamespace(name="output.weight", qtype=QType.Q8_0, n_out=64, n_in=n_cols, raw=emb_raw)
    head = be.upload_weight(vocab, vocab_rows=True)
    assert head.layout == rp.Q8_0_R4 and head.pad == 0
    for step in (10, 3, 16):          # 7, 22 and 4 rows: interleaved, padded by 1, 2 and 0 rows
        cut = be.upload_weight(SimpleNamespace(name="output.weight[draft_vocab]", qtype=QType.Q8_0,
                                               n_out=len(range(0, 64, step)), n_in=n_cols,
                                               raw=np.ascontiguousarray(emb_raw[::step])), vocab_rows=True)
        assert cut.layout == rp.Q8_0_R4 and cut.pad == (-cut.n_out) % 4
        y = be.qmatmul(cut, x)
        assert y.shape == (3, cut.n_out)
        np.testing.assert_array_equal(y, be.qmatmul(head, x)[:, ::step])
        out = np.full((3, cut.n_out), np.nan, np.float32)             # into a given array: the same
        be.qmatmul(cut, x, out)
        np.testing.assert_array_equal(out, y)
    emb = be.upload_weight(SimpleNamespace(name="token_embd.weight", qtype=QType.Q8_0, n_out=64, n_in=n_cols,
                                           raw=emb_raw))
    ids = np.array([63, 0, 17, 17, 2], np.int32)
    np.testing.assert_array_equal(be.embed(emb, ids), gguf.quants.dequantize(emb_raw[ids], QType.Q8_0))
    np.testing.assert_array_equal(be.qmatmul(emb, x), be.qmatmul(head, x))          # the tied output
    packed = be._packed_for_matmul(emb)
    assert packed.layout == rp.Q8_0_R4 and packed.raw is not emb_raw
    emb_raw_copy = emb_raw.copy()
    emb_raw[:] = 0                    # the file's rows are no longer read: lookups take the interleaved copy
    np.testing.assert_array_equal(be.embed(emb, ids), gguf.quants.dequantize(emb_raw_copy[ids], QType.Q8_0))
    np.testing.assert_array_equal(r4.q8_0_rows(packed.raw, n_cols, [5, 1]), emb_raw_copy[[5, 1]])
    with pytest.raises(IndexError):
        r4.q8_0_rows(packed.raw, n_cols, [64])


def test_repack_rejects_rows_not_in_groups_of_4():
    raw = random_rows(QType.Q5_0, 6, 64)
    with pytest.raises(ValueError, match="groups of 4"):
        r4.repack_rows(raw, 64, r4.Q5_0_KIND)
