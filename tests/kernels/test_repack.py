"""Load-time repacking (kernels/cpu/repack.py): Q4_0 / Q5_0 / IQ4_NL -> Q8_0 must be lossless
(bit-identical dequantization vs gguf.quants), and PackedWeight through CpuBackend.qmatmul must
match the float64 reference like the unpacked kernels (same tolerance as test_qmatmul)."""
from types import SimpleNamespace

import gguf.quants
from act_reference import round_like_ggml
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from strata_lite.kernels.cpu import q6_k_int8, repack as rp
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.dequant import dequantize
from strata_lite.kernels.cpu.repack import PackedWeight, pack_weight, release_pages, repack_to_q8_0
from strata_lite.kernels.qtypes import block_geometry
from test_dequant import random_rows
from test_qmatmul import RTOL

REPACKED = sorted(rp.REPACK_TO_Q8_0, key=lambda t: t.name)


def _qt(qtype, raw, n_in, name="blk.0.ffn_up.weight"):
    return SimpleNamespace(name=name, qtype=qtype, n_out=raw.shape[0], n_in=n_in, raw=raw)


@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
def test_repack_bit_exact(qtype):
    n_cols = 256
    raw = random_rows(qtype, 11, n_cols, seed=7)
    r8 = repack_to_q8_0(qtype, raw, n_cols)
    assert r8.dtype == np.uint8 and r8.shape == (11, n_cols // 32 * 34)
    want = gguf.quants.dequantize(raw, qtype)
    got = gguf.quants.dequantize(r8, QType.Q8_0)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(dequantize(QType.Q8_0, r8, n_cols).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_repack_any_bytes_every_quant(qtype):
    # fully random bytes (every nibble / 5th-bit pattern, any f16 scale incl. inf/NaN patterns)
    elems, nbytes = block_geometry(qtype)
    raw = np.random.default_rng(3).integers(0, 256, (64, 4 * nbytes), dtype=np.uint8)
    r8 = repack_to_q8_0(qtype, raw, 4 * elems)
    want = gguf.quants.dequantize(raw, qtype)
    got = gguf.quants.dequantize(r8, QType.Q8_0)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_repack_rejects_other_types():
    with pytest.raises(ValueError):
        repack_to_q8_0(QType.Q4_K, random_rows(QType.Q4_K, 2, 256), 256)


def test_pack_weight_views_and_types():
    raw = random_rows(QType.Q5_0, 6, 64)
    p = pack_weight(_qt(QType.Q5_0, raw, 64))
    assert isinstance(p, PackedWeight)
    assert (p.qtype, p.src_qtype, p.n_out, p.n_in, p.nbytes) == (QType.Q8_0, QType.Q5_0, 6, 64, 6 * 68)
    assert p.raw3.shape == (6, 2, 34) and p.final
    k = pack_weight(_qt(QType.Q6_K, random_rows(QType.Q6_K, 3, 256), 256))
    assert k.qtype == k.src_qtype == QType.Q6_K
    assert pack_weight(p) is p
    noop = pack_weight(_qt(QType.Q5_0, raw, 64), repack=False)
    assert noop.qtype == QType.Q5_0 and noop.raw is raw


def _reference(raw, qtype, x):
    """float64 product with the activations rounded as ggml rounds them for this weight type (the
    backend does the same, act_quant.py), and the scale |x||W| the tolerance is relative to."""
    w64 = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    xr = round_like_ggml(qtype, x).astype(np.float64)
    return xr @ w64.T, np.abs(xr) @ np.abs(w64).T


@pytest.mark.parametrize("n_tok", [1, 3, 40])
@pytest.mark.parametrize("n_out", [5, 300, 4000], ids=lambda n: f"out{n}")   # serial / parallel matvec
@pytest.mark.parametrize("qtype", REPACKED + [QType.Q8_0, QType.Q6_K, QType.Q4_K, QType.F16],
                         ids=lambda t: t.name)
def test_backend_qmatmul_packed(qtype, n_out, n_tok):
    n_cols = 256
    raw = random_rows(qtype, n_out, n_cols, seed=n_out)
    be = CpuBackend()
    w = be.upload_weight(_qt(qtype, raw, n_cols))
    x = np.random.default_rng(1).standard_normal((n_tok, n_cols), dtype=np.float32)
    ref, scale = _reference(raw, qtype, x)
    out = be.qmatmul(w, x)
    assert np.all(np.abs(out - ref) <= RTOL * scale + 1e-30)
    out2 = np.full_like(out, np.nan)
    assert be.qmatmul(w, x, out=out2) is out2
    np.testing.assert_array_equal(out2, out)


def test_small_threshold_both_paths(monkeypatch):
    raw = random_rows(QType.Q5_0, 64, 128, seed=2)
    x = np.random.default_rng(0).standard_normal((2, 128), dtype=np.float32)
    be = CpuBackend()
    monkeypatch.setattr(rp, "SMALL_BYTES", 0)
    big = be.upload_weight(_qt(QType.Q5_0, raw, 128))
    monkeypatch.setattr(rp, "SMALL_BYTES", 1 << 30)
    small = be.upload_weight(_qt(QType.Q5_0, raw, 128))
    assert small.small and not big.small
    assert small.int8 == big.int8 == be.int8             # small: the same int8 kernel, on one thread
    ref, scale = _reference(raw, QType.Q5_0, x)
    for w in (small, big):
        assert np.all(np.abs(be.qmatmul(w, x) - ref) <= RTOL * scale + 1e-30)
    for n_tok in (1, 2, 5, 13):                          # bit-identical: batch invariance either way
        xs = np.random.default_rng(n_tok).standard_normal((n_tok, 128), dtype=np.float32)
        np.testing.assert_array_equal(be.qmatmul(small, xs), be.qmatmul(big, xs))


def test_token_embd_kept_for_lookup_and_repacked_for_tied_output():
    raw = random_rows(QType.Q5_0, 40, 64, seed=4)
    be = CpuBackend()
    qt = _qt(QType.Q5_0, raw, 64, name="token_embd.weight")
    emb = be.upload_weight(qt)
    assert emb.qtype == QType.Q5_0 and emb.raw is raw       # row lookups read the file layout
    ids = np.array([3, 0, 39], dtype=np.int32)
    np.testing.assert_array_equal(be.embed(emb, ids), gguf.quants.dequantize(raw[ids], QType.Q5_0))
    x = np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32)
    ref, scale = _reference(raw, QType.Q5_0, x)
    for w in (emb, qt):                                       # tied output; a never-uploaded tensor
        out = be.qmatmul(w, x)
        assert np.all(np.abs(out - ref) <= RTOL * scale + 1e-30)
    assert len(be._matmul_cache) == 2


def test_tied_q6_k_output_replaces_the_file_rows_for_lookups():
    """A Q6_K token embedding doubling as the output (Llama 3.2's Q4_K_M files): its first mat-mul repacks it for
    the int8 kernel, and its embedding rows then come from the repacked copy (the file's pages are released),
    the values gguf dequantizes, bit for bit."""
    raw = random_rows(QType.Q6_K, 40, 512, seed=6)
    keep = raw.copy()
    be = CpuBackend()
    emb = be.upload_weight(_qt(QType.Q6_K, raw, 512, name="token_embd.weight"))
    ids = np.array([39, 0, 7, 7], dtype=np.int32)
    np.testing.assert_array_equal(be.embed(emb, ids), gguf.quants.dequantize(keep[ids], QType.Q6_K))
    x = np.random.default_rng(1).standard_normal((2, 512), dtype=np.float32)
    ref, scale = _reference(keep, QType.Q6_K, x)
    assert np.all(np.abs(be.qmatmul(emb, x) - ref) <= RTOL * scale + 1e-30)      # the tied output
    if be._packed_for_matmul(emb).layout != rp.Q6K_I8:
        pytest.skip("no int8 kernels on this CPU: the Q6_K output keeps the file's blocks")
    raw[:] = 0                        # the file's rows are no longer read
    np.testing.assert_array_equal(be.embed(emb, ids), gguf.quants.dequantize(keep[ids], QType.Q6_K))
    with pytest.raises(IndexError):
        q6_k_int8.dequantize_rows(be._packed_for_matmul(emb).raw, 512, [40])


def test_qmatmul_packed_rejects_bad_x_and_out():
    be = CpuBackend()
    w = be.upload_weight(_qt(QType.Q5_0, random_rows(QType.Q5_0, 4, 64), 64))
    with pytest.raises(ValueError):
        be.qmatmul(w, np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError):
        be.qmatmul(w, np.zeros((1, 64), np.float64))
    with pytest.raises(ValueError):
        be.qmatmul(w, np.zeros((64, 2), np.float32).T)
    with pytest.raises(ValueError):
        be.qmatmul(w, np.zeros((1, 64), np.float32), out=np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError):
        be.qmatmul(w, np.zeros((1, 64), np.float32), out=np.zeros((1, 4), np.float64))


def test_release_pages_on_memmap(tmp_path):
    raw = random_rows(QType.Q5_0, 2000, 256, seed=9)          # 2000 x 176 bytes, several pages
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm.reshape(2000, 176)
    assert np.array_equal(view, raw)
    p = pack_weight(_qt(QType.Q5_0, view, 256))                # releases the source pages
    assert np.array_equal(view, raw)                           # still readable (faults back in)
    want = gguf.quants.dequantize(raw, QType.Q5_0)
    assert np.array_equal(dequantize(p.qtype, p.raw, 256).view(np.uint32), want.view(np.uint32))
    assert release_pages(view[10:1500]) is True
    assert release_pages(raw) is False                         # not a memory map: nothing done
