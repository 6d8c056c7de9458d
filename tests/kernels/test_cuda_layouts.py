"""The weight types' device layouts (kernels/cuda/layouts.py), on the CPU: lossless both ways, rows padded to
16 bytes, the 32-weight types' fields in aligned planes, and the Q6_K planes decoded as their documentation (and
TQ6_K in qmatmul_types.cuh) reads them give gguf's dequantization bit for bit."""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from strata_lite.kernels.cuda import layouts
from strata_lite.kernels.qtypes import row_nbytes

from test_dequant import random_rows


def decode_q6_k_planes(dev: np.ndarray, n_in: int) -> np.ndarray:
    """float64 weights from the device planes, field by field as layouts.py documents them."""
    n_out, nb = dev.shape[0], n_in // 256
    lo = dev[:, :128 * nb].reshape(n_out, nb * 8, 16).astype(np.int64)
    hi = dev[:, 128 * nb:192 * nb].reshape(n_out, nb * 8, 2, 4).astype(np.int64)
    scales = dev[:, 192 * nb:208 * nb].view(np.int8).astype(np.float64)
    d = np.ascontiguousarray(dev[:, 208 * nb:210 * nb]).view(np.float16).astype(np.float64)
    q = np.empty((n_out, nb * 8, 32), np.int64)
    for i in range(32):
        low = lo[:, :, i] & 15 if i < 16 else lo[:, :, i - 16] >> 4
        h, w, b = i // 16, i % 16 // 4, i % 4
        q[:, :, i] = low | ((hi[:, :, h, b] >> (2 * w)) & 3) << 4
    codes = q.reshape(n_out, n_in) - 32
    return np.repeat(d, 256, axis=1) * np.repeat(scales, 16, axis=1) * codes


@pytest.mark.parametrize("n_blocks", [1, 6, 16, 19, 35])
def test_q6_k_device_layout_is_lossless_and_decodes_like_gguf(n_blocks):
    n_in = 256 * n_blocks
    raw = random_rows(QType.Q6_K, 7, n_in, seed=n_blocks)
    dev = layouts.to_device(QType.Q6_K, raw)
    pitch = layouts.device_row_bytes(QType.Q6_K, n_in)
    assert dev.shape == (7, pitch) and pitch % 16 == 0 and 0 <= pitch - row_nbytes(QType.Q6_K, n_in) < 16
    assert not dev[:, 210 * n_blocks:].any()                     # the padding is zeros
    assert np.array_equal(layouts.from_device(QType.Q6_K, dev, n_in), raw)
    ref = dequantize(raw, QType.Q6_K).reshape(7, n_in).astype(np.float64)
    assert np.array_equal(decode_q6_k_planes(dev, n_in), ref)


def test_q6_k_conversion_in_chunks_equals_whole(monkeypatch):
    raw = random_rows(QType.Q6_K, 37, 256 * 3, seed=5)
    whole = layouts.to_device(QType.Q6_K, raw)
    monkeypatch.setattr(layouts, "CHUNK_BYTES", 3 * 630)        # 3 rows a chunk: 13 chunks, the last short
    assert np.array_equal(layouts.to_device(QType.Q6_K, raw), whole)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.IQ4_NL, QType.Q5_0, QType.IQ3_XXS],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 19, 28, 128, 152])
def test_block_fields_become_aligned_planes(qtype, n_blocks):
    """Each field of the file's blocks in its own plane (per row, or per group of GROUP_BLOCKS blocks, the last
    group shorter), block u's at u * its size, planes in PLANES order, the row padded to 16 bytes; lossless."""
    n_in = GGML_QUANT_SIZES[qtype][0] * n_blocks
    raw = random_rows(qtype, 5, n_in, seed=n_blocks)
    dev = layouts.to_device(qtype, raw)
    pitch = layouts.device_row_bytes(qtype, n_in)
    assert dev.shape == (5, pitch) and pitch % 16 == 0 and 0 <= pitch - raw.shape[1] < 16
    blocks = raw.reshape(5, n_blocks, -1)
    group = layouts.GROUP_BLOCKS.get(qtype, n_blocks)
    start = 0
    for b0 in range(0, n_blocks, group):
        n = min(group, n_blocks - b0)
        assert n < group or start % 16 == 0                        # every whole group 16-byte aligned
        for off, size in layouts.PLANES[qtype]:
            assert start % min(size, 8) == 0                       # each plane as aligned as its loads
            assert np.array_equal(dev[:, start:start + n * size], blocks[:, b0:b0 + n, off:off + size].reshape(5, -1))
            start += n * size
    assert start == raw.shape[1] and not dev[:, start:].any()
    assert np.array_equal(layouts.from_device(qtype, dev, n_in), raw)


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q5_K, QType.F16])
def test_other_types_keep_the_file_layout(qtype):
    raw = random_rows(qtype, 3, 512, seed=1)
    assert not layouts.repacked(qtype)
    assert layouts.device_row_bytes(qtype, 512) == row_nbytes(qtype, 512)
    assert np.array_equal(layouts.to_device(qtype, raw), raw)
    assert np.array_equal(layouts.from_device(qtype, raw, 512), raw)
