"""GGML quantization types that strata_lite can compute with, and their block geometry."""
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

SUPPORTED_QTYPES = frozenset({
    QType.F32, QType.F16, QType.BF16,
    QType.Q4_0, QType.Q5_0, QType.Q8_0,
    QType.Q4_K, QType.Q5_K, QType.Q6_K,
    QType.IQ4_NL, QType.IQ3_XXS,
})


class UnsupportedQuantType(ValueError):
    """A tensor uses a GGML type that has no kernels here."""


def check_supported(qtype) -> QType:
    try:
        qtype = QType(int(qtype))
    except ValueError:
        raise UnsupportedQuantType(f"unknown GGML type id {int(qtype)}") from None
    if qtype not in SUPPORTED_QTYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_QTYPES))
        raise UnsupportedQuantType(f"quant type {qtype.name} is not supported (supported: {names})")
    return qtype


def block_geometry(qtype) -> tuple[int, int]:
    """(weights per block, bytes per block)."""
    return GGML_QUANT_SIZES[QType(int(qtype))]


def row_nbytes(qtype, n_cols: int) -> int:
    elems, nbytes = block_geometry(qtype)
    if n_cols % elems:
        raise UnsupportedQuantType(f"{QType(int(qtype)).name} rows must be a multiple of {elems} weights, got {n_cols}")
    return n_cols // elems * nbytes
