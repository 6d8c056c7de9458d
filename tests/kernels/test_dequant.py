"""Dequantizer tests (bit-exact vs gguf.quants) and random valid GGML blocks shared with test_qmatmul and the benchmarks."""
import numpy as np
from gguf import GGMLQuantizationType as QType

from strata_lite.kernels.qtypes import block_geometry

# byte offsets of the float16 scale fields inside one block
F16_FIELDS = {
    QType.Q4_0: (0,), QType.Q5_0: (0,), QType.Q8_0: (0,), QType.IQ4_NL: (0,), QType.IQ3_XXS: (0,),
    QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
}


def random_rows(qtype, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """uint8 (n_rows, row_nbytes): random bytes with sane f16 scales (1e-3..1e-2, random sign) so no NaN/inf."""
    rng = np.random.default_rng(seed)
    qtype = QType(int(qtype))
    if qtype == QType.F32:
        return rng.standard_normal((n_rows, n_cols), dtype=np.float32).view(np.uint8)
    if qtype == QType.F16:
        return rng.standard_normal((n_rows, n_cols)).astype(np.float16).view(np.uint8)
    if qtype == QType.BF16:
        w = rng.standard_normal((n_rows, n_cols), dtype=np.float32)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    elems, nbytes = block_geometry(qtype)
    nb = n_cols // elems
    raw = rng.integers(0, 256, (n_rows, nb, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.uniform(1e-3, 1e-2, (n_rows, nb)) * rng.choice([-1.0, 1.0], (n_rows, nb))).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n_rows, nb, 2)
    return raw.reshape(n_rows, nb * nbytes)


# ----------------------------------------------------------------------------------------- tests
import gguf.quants  # noqa: E402
import pytest  # noqa: E402

from strata_lite.kernels.cpu.dequant import F16_TABLE, dequantize  # noqa: E402
from strata_lite.kernels.qtypes import SUPPORTED_QTYPES, UnsupportedQuantType  # noqa: E402

ALL_TYPES = sorted(SUPPORTED_QTYPES, key=lambda t: t.name)


def _n_cols(qtype):
    return 512 if block_geometry(qtype)[0] == 256 else 96


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact(qtype):
    n_cols = _n_cols(qtype)
    raw = random_rows(qtype, 7, n_cols, seed=int(qtype))
    got = dequantize(qtype, raw, n_cols)
    want = gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)
    assert got.dtype == np.float32 and got.shape == (7, n_cols)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) or np.array_equal(got, want)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_readonly_memmap_like_slice(qtype):
    n_cols = _n_cols(qtype)
    raw = random_rows(qtype, 9, n_cols, seed=1)
    ro = raw[2:6]
    ro.flags.writeable = False
    assert np.array_equal(dequantize(qtype, ro, n_cols), gguf.quants.dequantize(raw[2:6], qtype))


def test_f16_table_exact():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    assert np.array_equal(F16_TABLE.view(np.uint32), want.view(np.uint32))


def test_dequantize_rejects_bad_input():
    raw = random_rows(gguf.GGMLQuantizationType.Q8_0, 2, 64)
    with pytest.raises(ValueError):
        dequantize(gguf.GGMLQuantizationType.Q8_0, raw, 96)          # wrong row size
    with pytest.raises(ValueError):
        dequantize(gguf.GGMLQuantizationType.Q8_0, raw.view(np.int8), 64)
    with pytest.raises(UnsupportedQuantType):
        dequantize(gguf.GGMLQuantizationType.Q2_K, raw, 64)
