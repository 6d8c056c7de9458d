"""Q5_0, Q4_0, IQ4_NL and Q8_0 interleaved by 4 rows, as repack.py's INT8_LAYOUTS wants a layout: QK, BLOCK_BYTES, repack and
matvec. The layout and the mat-vec kernel: rows4_int8.py; prompt chunks of MIN_TOK+ tokens: rows4_gemm.py
(the same bits)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

from . import rows4_gemm, rows4_int8
from .isa import INT8_ISA


_KIND = {QType.Q5_0: rows4_int8.Q5_0_KIND, QType.Q4_0: rows4_int8.Q4_0_KIND, QType.IQ4_NL: rows4_int8.IQ4_NL_KIND,
         QType.Q8_0: rows4_int8.Q8_0_KIND}


class Rows4Format:
    """One interleaved format (Q5_0, Q4_0, IQ4_NL or Q8_0). BLOCK_BYTES: per row and 32 columns, the file's (the layout
    rearranges the bytes of 4 rows, it does not add any)."""
    QK = rows4_int8.QK

    def __init__(self, qtype: QType):
        self.qtype = qtype
        self.kind = _KIND[qtype]
        self.BLOCK_BYTES = rows4_int8.BLOCK_BYTES[self.kind]

    def repack(self, raw: np.ndarray, n_cols: int, f16t=None) -> np.ndarray:
        """ggml rows (n_rows a multiple of 4) -> the interleaved layout, the same shape (f16t: unused)."""
        return rows4_int8.repack_rows(raw, n_cols, self.kind)

    def matvec(self, raw3: np.ndarray, x3: np.ndarray, out: np.ndarray, isa: int = INT8_ISA,
               serial: bool = False) -> None:
        """out (n_tok, n_rows) = x @ W.T; raw3 this layout viewed (n_rows, nb, BLOCK_BYTES), x3 float32
        (n_tok, nb, 32). Prompt chunks (rows4_gemm.MIN_TOK+ tokens) take the GEMM, fewer tokens the mat-vec
        kernel (serial: on the calling thread, for small matrices); the same bits either way."""
        if x3.shape[0] >= rows4_gemm.MIN_TOK:
            rows4_gemm.matmul(raw3, x3, out, self.kind, isa)
        else:
            rows4_int8.matvec(raw3, x3, out, self.kind, isa, serial)


Q5_0_R4 = Rows4Format(QType.Q5_0)
Q4_0_R4 = Rows4Format(QType.Q4_0)
IQ4_NL_R4 = Rows4Format(QType.IQ4_NL)
Q8_0_R4 = Rows4Format(QType.Q8_0)
