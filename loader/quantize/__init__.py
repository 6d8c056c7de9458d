"""Row quantizers that write GGML block layouts (readable by gguf-py and llama.cpp).

    quantize_rows(qtype, rows, imatrix=None, llamacpp_exact=False) -> uint8 [n_rows, row_nbytes]

rows: float32 [n_rows, n_cols]; imatrix: float32 [n_cols] (importance weights,
llama-imatrix's mean of squared activations) or None.

| type    | block        | matches                                         | imatrix            |
|---------|--------------|-------------------------------------------------|--------------------|
| IQ3_XXS | 256 w, 98 B  | llama.cpp quantize_iq3_xxs, bit-exact, then a   | used (x^2 if None) |
|         |              | refinement pass (off with llamacpp_exact=True)  |                    |
| IQ4_NL  | 32 w, 18 B   | llama.cpp quantize_iq4_nl (ntry = 7)            | used (x^2 if None) |
| Q8_0    | 32 w, 34 B   | quantize_row_q8_0_ref / gguf-py, bit-exact      | ignored            |
| Q4_0    | 32 w, 18 B   | quantize_row_q4_0_ref / gguf-py, bit-exact      | ignored            |
| Q5_0    | 32 w, 22 B   | quantize_row_q5_0_ref / gguf-py, bit-exact;     | used (ref if None) |
|         |              | with imatrix: quantize_row_q5_0_impl            |                    |
| F32/F16 | 1 w          | plain casts (f16: round to nearest even)        | ignored            |

Other types raise UnsupportedQuantType. All kernels are @njit(cache=True) with
prange over rows (Numba's thread count, NUMBA_NUM_THREADS, sets the parallelism).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata_lite.kernels.qtypes import UnsupportedQuantType, row_nbytes

from .iq3_xxs import quantize_iq3_xxs
from .simple import quantize_iq4_nl, quantize_q4_0, quantize_q5_0, quantize_q8_0


def _f32(rows, imatrix=None):
    return np.ascontiguousarray(rows, dtype=np.float32).view(np.uint8).reshape(rows.shape[0], -1)


def _f16(rows, imatrix=None):
    return np.ascontiguousarray(rows, dtype=np.float32).astype(np.float16).view(np.uint8).reshape(rows.shape[0], -1)


QUANTIZERS = {
    QType.IQ3_XXS: quantize_iq3_xxs,
    QType.IQ4_NL: quantize_iq4_nl,
    QType.Q8_0: quantize_q8_0,
    QType.Q4_0: quantize_q4_0,
    QType.Q5_0: quantize_q5_0,
    QType.F32: _f32,
    QType.F16: _f16,
}

QUANTIZABLE_QTYPES = frozenset(QUANTIZERS)


def quantize_rows(qtype, rows: np.ndarray, imatrix: np.ndarray | None = None,
                  llamacpp_exact: bool = False) -> np.ndarray:
    """Quantize float32 rows [n_rows, n_cols] to GGML blocks: uint8 [n_rows, row_nbytes(qtype, n_cols)].
    llamacpp_exact: IQ3_XXS without the refinement pass, i.e. llama.cpp's bytes (the other types are
    llama.cpp's already).

    Raises UnsupportedQuantType for a type this module cannot produce or a row length that is not
    a multiple of the type's block size; ValueError for bad shapes.
    """
    try:
        qt = QType(int(qtype))
    except ValueError:
        raise UnsupportedQuantType(f"unknown GGML type id {int(qtype)}") from None
    fn = QUANTIZERS.get(qt)
    if fn is None:
        names = ", ".join(sorted(t.name for t in QUANTIZERS))
        raise UnsupportedQuantType(f"cannot quantize to {qt.name} (quantizable: {names})")
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ValueError(f"rows must be 2-D [n_rows, n_cols], got shape {rows.shape}")
    nbytes = row_nbytes(qt, rows.shape[1])      # raises UnsupportedQuantType on a bad row length
    if imatrix is not None:
        imatrix = np.asarray(imatrix, dtype=np.float32).reshape(-1)
        if imatrix.shape[0] != rows.shape[1]:
            raise ValueError(f"imatrix has {imatrix.shape[0]} entries, rows have {rows.shape[1]}")
    out = quantize_iq3_xxs(rows, imatrix, refine=not llamacpp_exact) if qt == QType.IQ3_XXS else fn(rows, imatrix)
    assert out.shape == (rows.shape[0], nbytes), (out.shape, nbytes)
    return out


__all__ = ["quantize_rows", "QUANTIZERS", "QUANTIZABLE_QTYPES", "UnsupportedQuantType",
           "quantize_iq3_xxs", "quantize_iq4_nl", "quantize_q4_0", "quantize_q5_0",
           "quantize_q8_0"]
