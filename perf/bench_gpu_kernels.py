"""pytest-benchmark suite for the CUDA kernels, at the shapes of llama.cpp's reference table (the same H200, its
CUDA backend at commit 0c1e570 with CUDA graphs, 2026-11-30), every kernel's output checked before it is timed.

    python -m pytest perf/bench_gpu_kernels.py --benchmark-only -q        # needs CuPy and an NVIDIA GPU

Without CuPy or a GPU the module is skipped. A round is one replay of a CUDA graph holding one call per copy of
the weights (rotated through 1 GiB, so they come from HBM as in llama.cpp's figures) and a synchronize, so
pytest-benchmark's times are per graph; extra_info has the per-call figures from CUDA events
(bench_gpu.timed_in_graph): "us", "GB/s" (weights + activations + outputs; attention: the K/V pages and scales)
or "TFLOP/s", "of copy" (the fraction of the device-to-device copy bandwidth measured once per session),
for mat-vecs "read floor us" and "of floor" (the fastest plain one-launch read of the same bytes, rotated the
same way: bench_gpu.read_floor; what the card allows at that size, fixed cost included) and llama.cpp's figure
where its table has the shape; perf/conftest.py prints those as one table after the run.

Checks, on the first weight copy: mat-muls against float64 over the weights dequantized by the device (bit-exact
with gguf) and the activations as the launch rounded them, within 3e-5 of sum |x w| per output (the GPU tests'
bound, tests/kernels/cuda/test_qmatmul_cuda.py); attention against the CPU backend's kernel on the same cache
within 2e-5 of each output plus 2e-5 of the largest plus what the kernels' f16 p.V weights move it by at most
(tests/kernels/cuda/test_attention_cuda.py's bound against the CPU, reference.f16_rounding_bound).
"""
import functools
import math
import os
import sys

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
try:
    _GPUS = cp.cuda.runtime.getDeviceCount()
except cp.cuda.runtime.CUDARuntimeError:
    _GPUS = 0
if not _GPUS:
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as bg  # noqa: E402  (also puts tests/kernels on sys.path)

from gguf import GGMLQuantizationType as QType  # noqa: E402
from strata_lite.kernels.qtypes import row_nbytes  # noqa: E402

# (type, rows, row length, tokens, llama.cpp µs) -- rows x row length as the mat-mul's W (n_out, n_in)
MATVEC = [("IQ3_XXS", 14336, 4096, 1, 21.0), ("IQ3_XXS", 14336, 4096, 2, 23.5), ("IQ3_XXS", 14336, 4096, 4, 30.3),
          ("IQ3_XXS", 14336, 4096, 8, 44.2), ("IQ3_XXS", 4096, 14336, 1, 23.4), ("Q4_K", 14336, 4096, 1, 17.1),
          ("Q4_K", 14336, 4096, 8, 48.0), ("Q8_0", 14336, 4096, 1, 22.9), ("F16", 14336, 4096, 1, 30.6),
          ("Q6_K", 14336, 4096, 1, None), ("Q5_0", 14336, 4096, 1, None)]
# (type, rows, row length, tokens, llama.cpp TFLOP/s)
GEMM = [("IQ3_XXS", 14336, 4096, 512, 178), ("Q4_K", 14336, 4096, 512, 173), ("F16", 14336, 4096, 512, 526)]
# (keys, llama.cpp µs with its q8_0 KV cache): D = 128, 32 query / 8 KV heads, one token
ATTENTION = [(4096, None), (32768, 122.7)]
# keys before a 512-token prompt chunk of one sequence, same heads (the tiled kernels)
PREFILL_DEPTHS = [0, 32768]


@pytest.fixture(scope="session")
def device():
    """(qmatmul module, copy bandwidth in bytes/s); the CUDA backend makes its non-blocking stream current,
    which graph capture needs."""
    from strata_lite.kernels.cuda import qmatmul as qm
    from strata_lite.kernels.cuda.backend import CudaBackend
    CudaBackend()
    return qm, bg.copy_bandwidth(cp)


def _check_matmul(qm, w, n_tok, x, act, out):
    """out (n_tok, n_out) against float64 over the device-dequantized weights and the rounded activations."""
    w64 = cp.empty((w.n_out, w.n_in), cp.float32)
    qm.dequant_rows(w, cp.arange(w.n_out, dtype=cp.int32), w64)
    w64 = w64.astype(cp.float64)
    fmt = qm.act_format(w.qtype)
    if fmt is None:
        x64 = x.astype(cp.float64)
    else:
        xq, xd = act.views(fmt, n_tok, w.n_in)
        x64 = xq.astype(cp.float64) * cp.repeat(xd.astype(cp.float64), qm.XBLOCK[fmt], axis=1)
    ref = x64 @ w64.T
    bound = 3e-5 * (cp.abs(x64) @ cp.abs(w64).T)
    worst = float(cp.max(cp.abs(out.astype(cp.float64) - ref) - bound))
    assert worst <= 0.0, f"{w.qtype.name} {w.n_out}x{w.n_in}, {n_tok} tokens: off the float64 reference by {worst:.3g}"


def _matmul_case(qm, qtype, n_out, n_in, n_tok):
    """(calls, bytes moved): one qmatmul.matmul per weight copy, the first checked."""
    nbytes = n_out * row_nbytes(QType[qtype], n_in)
    ws = bg.upload_random(qm, qtype, n_out, n_in, seeds=[0] * max(1, math.ceil(bg.ROTATE_BYTES / nbytes)))
    x = cp.asarray(np.random.default_rng(1).standard_normal((n_tok, n_in), dtype=np.float32))
    out = cp.empty((n_tok, n_out), cp.float32)
    act = qm.ActBuffers(max(n_tok, 16), n_in)
    qm.matmul(ws[0], x, out, act)
    _check_matmul(qm, ws[0], n_tok, x, act, out)
    return [lambda w=w: qm.matmul(w, x, out, act) for w in ws], nbytes + x.nbytes + out.nbytes


def _run(benchmark, calls, info):
    """Capture calls into one graph; time a call by CUDA events, put info(seconds) into extra_info, then the
    pytest-benchmark rounds: a replay and a synchronize each."""
    replay = bg.capture(cp, calls)
    benchmark.extra_info.update(info(bg.timed_in_graph(cp, calls, replay=replay)))
    stream = cp.cuda.get_current_stream()
    benchmark.pedantic(lambda: (replay(), stream.synchronize()), rounds=10, warmup_rounds=1)


def _bandwidth(moved, copy_bw, **ref):
    return lambda t: {"us": round(t * 1e6, 2), "GB/s": round(moved / t / 1e9), "of copy": round(moved / t / copy_bw, 3),
                      **ref}


@pytest.mark.parametrize("qtype,n_out,n_in,n_tok,llama_us", MATVEC,
                         ids=[f"{q}-{i}x{o}-n{t}" for q, o, i, t, _ in MATVEC])
def test_matvec(benchmark, device, qtype, n_out, n_in, n_tok, llama_us):
    qm, copy_bw = device
    calls, moved = _matmul_case(qm, qtype, n_out, n_in, n_tok)
    floor = _read_floor(moved)
    _run(benchmark, calls, lambda t: {**_bandwidth(moved, copy_bw)(t), "read floor us": round(floor * 1e6, 2),
                                      "of floor": round(floor / t, 3), "llama.cpp us": llama_us})


@functools.cache
def _read_floor(nbytes: int) -> float:
    """bench_gpu.read_floor of nbytes, once per size in a session."""
    return bg.read_floor(cp, nbytes)


@pytest.mark.parametrize("qtype,n_out,n_in,n_tok,llama_tflops", GEMM,
                         ids=[f"{q}-{i}x{o}-n{t}" for q, o, i, t, _ in GEMM])
def test_gemm(benchmark, device, qtype, n_out, n_in, n_tok, llama_tflops):
    qm, _ = device
    calls, _ = _matmul_case(qm, qtype, n_out, n_in, n_tok)
    _run(benchmark, calls, lambda t: {"us": round(t * 1e6, 1), "TFLOP/s": round(2 * n_out * n_in * n_tok / t / 1e12, 1),
                                      "llama.cpp TFLOP/s": llama_tflops})


def _check_attention(n_keys):
    """The GPU attention of bench_gpu.attention_inputs' arrays against the CPU backend's kernel on copies."""
    from strata_lite.kernels.cpu import attention as cpu_attention
    from strata_lite.kernels.cuda import attention as ak
    args = bg.attention_inputs(cp, n_keys)
    q, scale, out = args[0], args[8], args[9]
    ak.attention(*args, ak.attention_workspace(1, q.shape[1], q.shape[2], n_keys), n_keys)
    host = [a.get() for a in args[:8]]
    want = np.empty_like(host[0])
    cpu_attention.attention(*host, scale, want)
    excess = np.abs(out.get() - want) - _attention_bound(want, host, scale)
    assert excess.max() <= 0.0, f"attention over {n_keys} keys off the CPU backend beyond the bound by {excess.max():.3g}"


def _attention_bound(want, host, scale):
    """Per output: 2e-5 of it plus 2e-5 of the largest, and what the kernels' f16 weights P' move it by at most
    (reference.f16_rounding_bound over host = q, token_seq, token_pos, page_tables, K/V pages and scales)."""
    import reference
    from strata_lite.kernels.cuda import attention as ak
    f16 = reference.f16_rounding_bound(*ak.f16_rounding(ak.BUILD), *host, scale)
    return 2e-5 * (np.abs(want) + np.abs(want).max()) + f16


@pytest.mark.parametrize("n_keys,llama_us", ATTENTION, ids=[f"{k}-keys" for k, _ in ATTENTION])
def test_attention_decode(benchmark, device, n_keys, llama_us):
    _, copy_bw = device
    _check_attention(n_keys)
    call, moved = bg.attention_call(cp, n_keys)
    _run(benchmark, [call] * 16, _bandwidth(moved, copy_bw, **{"llama.cpp us (q8_0 KV)": llama_us}))


@pytest.mark.parametrize("depth", PREFILL_DEPTHS, ids=[f"after-{d}-keys" for d in PREFILL_DEPTHS])
def test_attention_prefill(benchmark, device, depth):
    """Attention of a 512-token chunk after `depth` keys; its first and last 8 tokens checked against the CPU
    backend (the bound of _check_attention). TFLOP/s: 4 x head_dim per (token, head, key)."""
    from strata_lite.kernels.cpu import attention as cpu_attention
    call, flops = bg.prefill_attention_call(cp, depth)
    call()
    q, seq, pos, *cache, scale = call.args
    host = [a.get() for a in cache]
    for rows in (slice(0, 8), slice(504, 512)):
        part = [q[rows].get(), seq[rows].get(), pos[rows].get(), *host]
        want = np.empty_like(part[0])
        cpu_attention.attention(*part, scale, want)
        excess = np.abs(call.out[rows].get() - want) - _attention_bound(want, part, scale)
        assert excess.max() <= 0.0, f"prompt attention after {depth} keys off the CPU backend by {excess.max():.3g}"
    _run(benchmark, [call] * 2, lambda t: {"us": round(t * 1e6, 1), "TFLOP/s": round(flops / t / 1e12, 1)})
