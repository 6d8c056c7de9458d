"""Which GGML type each tensor gets when a model is quantized to a target (`strata-lite quantize`).

The mixes follow llama.cpp's `llama_tensor_get_type` in spirit, restricted to the types we can write
(IQ3_XXS, IQ4_NL, Q8_0, Q5_0, Q4_0, F16, F32); docs/quantize.md has the table and the reasons.

    tensor_type(name, shape, target, pure=False, has_output=True) -> TypeChoice
    plan_types(shapes, target, pure=False) -> {name: TypeChoice}   (a whole model: adds the ffn_down rule)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

# targets and the llama.cpp `general.file_type` (enum llama_ftype) each one writes
TARGETS = {"IQ3_XXS": QType.IQ3_XXS, "IQ4_NL": QType.IQ4_NL, "Q8_0": QType.Q8_0, "Q5_0": QType.Q5_0,
           "Q4_0": QType.Q4_0, "F16": QType.F16, "F32": QType.F32}
FILE_TYPE = {QType.IQ3_XXS: 23, QType.IQ4_NL: 25, QType.Q8_0: 7, QType.Q5_0: 8, QType.Q4_0: 2, QType.F16: 1,
             QType.F32: 0}

# when a row length is not a multiple of the chosen type's block: the next type to try
FALLBACK = {QType.IQ3_XXS: QType.IQ4_NL, QType.IQ4_NL: QType.F16, QType.Q4_0: QType.F16, QType.Q5_0: QType.F16,
            QType.Q8_0: QType.F16, QType.F16: QType.F16, QType.F32: QType.F32}

# the IQ3_XXS mix: tensors given more bits than the target (pattern on the name without "blk.N.").
# llama.cpp's IQ3_XXS file type gives output Q5_K (Q8_0 when its rows are not 256-blocks) and attn_v
# Q4_K (Q5_0 when they are not); we write Q5_0 (5.5 bits/weight, Q5_K's size) for both, whatever the
# row length (Q5_0 has 32-weight blocks). Its IQ3_S (token_embd, attn_output) and IQ2_S (attn_q,
# attn_k) tensors stay at the target here: for Qwen2.5-Coder-1.5B this file is 761 MB against
# llama.cpp's 769 MB.
IQ3_XXS_MIX = (
    ("output.weight", QType.Q5_0, "output"),
    ("attn_v.weight", QType.Q5_0, "attn_v"),
)

# ffn_down never gets fewer bits than its layer's ffn_gate/ffn_up. It matters when the row length
# forced those up (Qwen2.5-0.5B: 896-wide rows make ffn_gate/ffn_up IQ4_NL, while ffn_down's 4864-wide
# rows could hold IQ3_XXS): a 3-bit ffn_down among 4.5-bit matrices was that model's largest error
# (docs/quantize.md: mean KL 0.083 -> 0.041 with it at IQ4_NL, and the file is still smaller than
# llama.cpp's because the output matrix is Q5_0 instead of Q8_0).
_FFN_DOWN = re.compile(r"^(blk\.\d+\.)ffn_down\.weight$")
_FFN_SIBLINGS = ("ffn_gate.weight", "ffn_up.weight")

_BLK = re.compile(r"^blk\.\d+\.")


class UnsupportedTarget(ValueError):
    pass


@dataclass(frozen=True)
class TypeChoice:
    qtype: QType
    rule: str          # why: "1-D", "target", "pure", "output", "attn_v", ... ; "+fallback" when the row length forced it


def parse_target(name: str) -> QType:
    key = str(name).strip().upper()
    if key not in TARGETS:
        raise UnsupportedTarget(f"unsupported quantization type {name!r} (supported: {', '.join(TARGETS)})")
    return TARGETS[key]


def is_matrix(name: str, shape) -> bool:
    """Quantizable: a weight with at least 2 dimensions (norms, biases and other vectors stay F32)."""
    return len(shape) >= 2 and name.endswith(".weight")


def tensor_type(name: str, shape, target: QType, pure: bool = False, has_output: bool = True) -> TypeChoice:
    """shape in GGML order (shape[0] = row length). has_output: the file has its own output.weight
    (else token_embd doubles as the output matrix and is treated like it)."""
    if not is_matrix(name, shape):
        return TypeChoice(QType.F32, "1-D")
    if pure:
        choice = TypeChoice(target, "pure")
    else:
        choice = _mix(name, target, has_output)
    return _fit(choice, int(shape[0]))


def _mix(name: str, target: QType, has_output: bool) -> TypeChoice:
    short = _BLK.sub("", name)
    if not has_output and short == "token_embd.weight":
        short = "output.weight"
    if target == QType.IQ3_XXS:
        for pattern, qtype, rule in IQ3_XXS_MIX:
            if short == pattern:
                return TypeChoice(qtype, rule)
        return TypeChoice(target, "target")
    if target in (QType.IQ4_NL, QType.Q4_0) and short == "output.weight":
        return TypeChoice(QType.Q8_0, "output")      # llama.cpp: Q6_K
    return TypeChoice(target, "target")


def plan_types(shapes: dict, target: QType, pure: bool = False) -> dict[str, TypeChoice]:
    """shapes: {tensor name: GGML shape} of a whole model -> {name: TypeChoice}: tensor_type for each,
    then (mixes only) ffn_down raised to the largest type of its layer's ffn_gate/ffn_up."""
    has_output = "output.weight" in shapes
    plan = {name: tensor_type(name, shape, target, pure, has_output) for name, shape in shapes.items()}
    if pure:
        return plan
    for name, choice in plan.items():
        m = _FFN_DOWN.match(name)
        if not m:
            continue
        siblings = [plan[m.group(1) + s] for s in _FFN_SIBLINGS if m.group(1) + s in plan]
        richest = max(siblings, key=lambda c: bits_per_weight(c.qtype), default=None)
        if richest is not None and bits_per_weight(richest.qtype) > bits_per_weight(choice.qtype):
            plan[name] = _fit(TypeChoice(richest.qtype, "ffn_down>=ffn_up"), int(shapes[name][0]))
    return plan


def bits_per_weight(qtype: QType) -> float:
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    return 8.0 * nbytes / elems


def _fit(choice: TypeChoice, row_len: int) -> TypeChoice:
    qtype, rule = choice.qtype, choice.rule
    while row_len % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK[qtype]
        if not rule.endswith("+fallback"):
            rule += "+fallback"
    return TypeChoice(qtype, rule)
