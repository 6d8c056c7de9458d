"""numpy transcriptions of ggml's activation quantization before quantized mat-muls (values only):
quantize_row_q8_0 (32-blocks, f16 scale amax/127) and quantize_row_q8_K (256-blocks, scale -max/127)."""
import numpy as np
from gguf import GGMLQuantizationType as QT

Q8_K_WEIGHTS = {QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ3_XXS}
Q8_0_WEIGHTS = {QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.IQ4_NL}


def ref_q8_0(x):
    x = np.asarray(x, dtype=np.float32)
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * d.astype(np.float16).astype(np.float32)).reshape(x.shape)


def ref_q8_k(x):
    x = np.asarray(x, dtype=np.float32)
    b = x.reshape(x.shape[0], -1, 256)
    mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    iscale = np.where(mx != 0, np.float32(-127) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
    s = np.where(iscale != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return (np.minimum(127, np.rint(iscale * b)) * s).reshape(x.shape)


def ref_bf16(x):
    """x rounded to BF16 values (to nearest, ties to even), as float32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    return (((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) << np.uint32(16)).view(
        np.float32)


def round_like_ggml(qtype, x, bf16_chunk: bool = False):
    """x as the mat-mul of a qtype weight sees it; bf16_chunk: a BF16 weight's chunk on the CPU's BF16 dot
    products (kernels/cpu/half_gemm.py takes), whose activations are rounded to BF16 as ggml's are."""
    if qtype in Q8_0_WEIGHTS:
        return ref_q8_0(x)
    if qtype in Q8_K_WEIGHTS:
        return ref_q8_k(x)
    if qtype == QT.BF16 and bf16_chunk:
        return ref_bf16(x)
    return x
