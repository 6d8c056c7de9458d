"""Quantize a whole GGUF model file: `quantize_file(in_path, out_path, target, imatrix, threads)`.

The input may be float or quantized (any type `kernels/cpu/dequant.py` reads): every tensor is
dequantized to float32 row chunks and re-quantized with `loader/quantize` to the type chosen by
`loader/quant_policy.py`. All metadata fields are copied with their GGUF value types and order
(tokenizer included); `general.file_type` is set to the target's llama.cpp ftype. Tensors are written
one at a time (input memory-mapped; at most one output tensor and one float32 chunk in memory).
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType, GGUFValueType as VT, GGUFWriter
from tqdm import tqdm

from strata_lite.kernels.cpu.dequant import dequantize
from strata_lite.kernels.qtypes import UnsupportedQuantType, check_supported

from .atomic_file import written_whole
from .errors import GGUFError
from .gguf_file import GGUFFile
from .quant_policy import FILE_TYPE, TypeChoice, parse_target, plan_types
from .quantize import quantize_rows

CHUNK_FLOATS = 8 << 20          # float32 elements dequantized at a time (32 MiB)


@dataclass
class QuantizeReport:
    out_path: str
    target: QType
    tensor_types: dict[str, TypeChoice] = field(default_factory=dict)
    by_type: dict[str, list] = field(default_factory=dict)     # type name -> [count, bytes, elements]
    nbytes: int = 0                                            # output file size
    seconds: float = 0.0
    imatrix_used: int = 0                                      # tensors quantized with an importance entry

    def summary(self) -> str:
        lines = [f"{'type':<8} {'tensors':>7} {'bytes':>15} {'bits/weight':>11}"]
        tot_b = tot_e = 0
        for name, (count, nbytes, elems) in sorted(self.by_type.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"{name:<8} {count:>7} {nbytes:>15,} {8 * nbytes / max(elems, 1):>11.3f}")
            tot_b, tot_e = tot_b + nbytes, tot_e + elems
        lines.append(f"{'total':<8} {sum(v[0] for v in self.by_type.values()):>7} {tot_b:>15,} "
                     f"{8 * tot_b / max(tot_e, 1):>11.3f}")
        rules = Counter(c.rule for c in self.tensor_types.values() if c.rule != "1-D")
        if rules:     # why the matrices got their types (docs/quantize.md, type policy)
            lines.append("rules: " + ", ".join(f"{r} x{n}" for r, n in rules.most_common()))
        lines.append(f"file {self.out_path}: {self.nbytes:,} bytes, {self.seconds:.1f} s, "
                     f"{self.imatrix_used} tensors with importance weights")
        return "\n".join(lines)


def quantize_file(in_path, out_path, target: str, imatrix: dict | None = None, threads: int | None = None,
                  progress: bool = True, pure: bool = False, log=None, llamacpp_exact: bool = False) -> QuantizeReport:
    """Write out_path: in_path's model quantized to `target` (IQ3_XXS, IQ4_NL, Q8_0, Q5_0, Q4_0; F16, F32).

    imatrix: {tensor name: float32 importance per input column} (llama-imatrix's mean of x²) or None;
    entries are used by the types that take them (IQ3_XXS, IQ4_NL, Q5_0). threads: Numba threads.
    llamacpp_exact: IQ3_XXS tensors as llama.cpp writes them (no refinement pass, docs/quantize.md)."""
    t0 = time.perf_counter()
    log = sys.stderr if log is None else log
    qtarget = parse_target(target)
    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    gf = GGUFFile(in_path)
    if os.path.exists(out_path) and os.path.samefile(in_path, out_path):
        raise GGUFError(out_path, "the output file must differ from the input file")
    arch = gf.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(in_path, "missing metadata field 'general.architecture'")
    plan = plan_types({name: info.shape for name, info in gf.tensors.items()}, qtarget, pure)
    _check_inputs(gf, plan, imatrix)
    if threads:
        import numba
        numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))

    report = QuantizeReport(out_path, qtarget, plan)
    with written_whole(out_path) as tmp:
        w = GGUFWriter(tmp, arch)
        _copy_metadata(gf, w, qtarget, imatrix)
        infos = list(gf.tensors.values())
        for info in infos:
            qt = plan[info.name].qtype
            elems, bsize = GGML_QUANT_SIZES[qt]
            n = int(np.prod(info.shape, dtype=np.int64))
            w.add_tensor_info(info.name, tuple(reversed(info.shape)), np.dtype(np.float32), n // elems * bsize,
                              raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(int(np.prod(i.shape, dtype=np.int64)) for i in infos)
        with tqdm(total=total, unit="w", unit_scale=True, desc=f"quantize {qtarget.name}", disable=not progress,
                  file=log) as bar:
            for info in infos:
                bar.set_postfix_str(f"{info.name} -> {plan[info.name].qtype.name}", refresh=False)
                data, used = _quantize_tensor(gf, info, plan[info.name].qtype, imatrix, bar, llamacpp_exact)
                w.write_tensor_data(data)
                report.imatrix_used += used
                entry = report.by_type.setdefault(plan[info.name].qtype.name, [0, 0, 0])
                entry[0] += 1
                entry[1] += data.nbytes
                entry[2] += int(np.prod(info.shape, dtype=np.int64))
                del data
        w.close()
    report.nbytes = os.path.getsize(out_path)
    report.seconds = time.perf_counter() - t0
    if progress:
        print(report.summary(), file=log)
    return report


def _check_inputs(gf: GGUFFile, plan: dict, imatrix: dict | None) -> None:
    """Fail before writing anything: unreadable source types, imatrix entries of the wrong length."""
    for name, info in gf.tensors.items():
        try:
            check_supported(info.qtype)
        except UnsupportedQuantType as e:
            raise GGUFError(gf.path, f"tensor {name!r} cannot be read for re-quantization: {e}") from None
        if imatrix is not None and name in imatrix and plan[name].qtype != QType.F32 and len(info.shape) >= 2:
            n = int(np.asarray(imatrix[name]).size)
            if n != info.shape[0]:
                raise GGUFError(gf.path, f"tensor {name!r} has rows of {info.shape[0]} weights but its imatrix "
                                         f"entry has {n} values (imatrix from a different model?)")


def _copy_metadata(gf: GGUFFile, w: GGUFWriter, target: QType, imatrix: dict | None) -> None:
    w.kv_data[0].clear()               # re-added below in the input's order
    for key, value in gf.metadata.items():
        vtype, etype = gf.field_types[key]
        if key == "general.file_type":
            value = FILE_TYPE[target]
        if vtype == VT.ARRAY:
            value = value.tolist() if isinstance(value, np.ndarray) else list(value)
            if not value:          # GGUFWriter cannot write an empty array; keep the (rare) field out
                continue
            w.add_key_value(key, value, VT.ARRAY, sub_type=VT(etype))
        else:
            w.add_key_value(key, value, VT(vtype))
    if "general.file_type" not in gf.metadata:
        w.add_key_value("general.file_type", FILE_TYPE[target], VT.UINT32)
    if "general.quantization_version" not in gf.metadata:
        w.add_key_value("general.quantization_version", 2, VT.UINT32)
    if imatrix:
        w.add_key_value("quantize.imatrix.entries_count", len(imatrix), VT.INT32)
    align = gf.metadata.get("general.alignment")
    if align:
        w.data_alignment = int(align)


def _quantize_tensor(gf: GGUFFile, info, qt: QType, imatrix: dict | None, bar,
                     llamacpp_exact: bool = False) -> tuple[np.ndarray, int]:
    """-> (uint8 bytes of the tensor in type qt, 1 if an importance entry was used)."""
    raw = gf.rows(info.name)
    n_rows, n_cols = raw.shape[0], int(info.shape[0])
    elems, bsize = GGML_QUANT_SIZES[qt]
    out = np.empty((n_rows, n_cols // elems * bsize), dtype=np.uint8)
    im = None
    if imatrix is not None and qt in (QType.IQ3_XXS, QType.IQ4_NL, QType.Q5_0) and info.name in imatrix:
        im = np.ascontiguousarray(imatrix[info.name], dtype=np.float32).reshape(-1)
    step = max(1, CHUNK_FLOATS // max(n_cols, 1))
    for lo in range(0, n_rows, step):
        hi = min(lo + step, n_rows)
        try:
            x = dequantize(info.qtype, np.asarray(raw[lo:hi]), n_cols)
        except (UnsupportedQuantType, ValueError) as e:
            raise GGUFError(gf.path, f"tensor {info.name!r}: {e}") from None
        if len(info.shape) == 1:
            x = x.reshape(1, -1)
        out[lo:hi] = quantize_rows(qt, x, im, llamacpp_exact=llamacpp_exact)
        bar.update((hi - lo) * n_cols)
    return out.reshape(-1), int(im is not None)
