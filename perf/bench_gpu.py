"""CUDA backend speed on the GPU: kernels as a fraction of the card's copy bandwidth measured in the same run,
and end-to-end prompt / decode tokens/s on synthetic models of real shapes (`strata-lite synth`).

Kernels: one CUDA graph holds a call per distinct copy of the weights (rotated through >= 1 GiB so they come
from HBM, not L2, as the llama.cpp reference figures were measured); the median replay time over the calls
is the kernel's time without Python launch overhead. Bytes moved = weight bytes +
activations + outputs (matmuls), K/V bytes + scales (attention).
End to end: decode steps are the captured graphs (one replay per step) plus greedy sampling, at batch 1 and 4
with every sequence at context 4K or 32K (the KV pages hold whatever is there: the work does not depend on it);
prompt = one eager forward of 512 tokens; then the same decode through the whole engine, 1 and 4 requests
(engine_rows). Then where a batch-1 decode step's time goes (step_breakdown).

Prompt mat-muls: 512 tokens of rounded activations through the dp4a kernel and the tensor-core kernel
(both give the same bits), TFLOP/s = 2 * rows * columns * tokens / time, beside llama.cpp's on the card.

usage: python perf/bench_gpu.py [--models DIR] [--quick] [--json FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import gguf
import numpy as np

ROTATE_BYTES = 1 << 30
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))


def timed(cp, fn, n_iter=50, warm=5):
    """Median seconds of fn() over n_iter runs, timed with events around each call."""
    for _ in range(warm):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(n_iter):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return float(np.median(times))


def capture(cp, calls):
    """`calls` (a list of thunks) captured back to back into one graph on the current stream -> a function that
    launches it."""
    stream = cp.cuda.get_current_stream()
    for call in calls[:2]:
        call()                                   # compile and load outside the capture
    stream.synchronize()
    stream.begin_capture()
    for call in calls:
        call()
    graph = stream.end_capture()
    return lambda: graph.launch(stream)


def timed_in_graph(cp, calls, n_iter=20, replay=None):
    """Median seconds per call of `calls` captured back to back into one graph (replay: capture()'s of calls)."""
    return timed(cp, replay or capture(cp, calls), n_iter=n_iter, warm=2) / len(calls)


def copy_bandwidth(cp):
    """Device-to-device copy of 2 GiB: (bytes read + written) / time."""
    n = 1 << 31
    src, dst = cp.empty(n, cp.uint8), cp.empty(n, cp.uint8)
    src.fill(1)
    t = timed(cp, lambda: cp.copyto(dst, src), n_iter=10)
    del src, dst
    return 2 * n / t


_READ_SRC = r"""
extern "C" __global__ void read_stream(const uint4* __restrict__ p, unsigned long long n16, unsigned* sink) {
    // each CTA reads UNROLL x blockDim 16-byte words once (the grid covers the buffer), xor-folded so the
    // loads stay; the store is taken only if the fold hits one arbitrary value
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
    unsigned acc = 0;
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
        unsigned long long j = i + (unsigned long long)k * blockDim.x;
        if (j < n16) { uint4 v = __ldg(p + j); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""


def read_floor(cp, nbytes: int) -> float:
    """Seconds of the fastest plain read of nbytes measured: one launch per distinct buffer of nbytes (random
    words, rotated through >= 1 GiB as the weights are), in one graph, grids of 256-thread CTAs covering the
    buffer with 1, 2, 4 or 8 16-byte loads a thread; the fastest of those. The time any one-launch kernel that
    must read those bytes from HBM needs at least (its fixed cost included), so a mat-mul's time over it is its
    fraction of what the card allows at that size, where "of copy" compares with a 2 GiB copy."""
    n16 = nbytes // 16
    copies = max(1, math.ceil(ROTATE_BYTES / nbytes))
    gen = cp.random.default_rng(0)
    bufs = [gen.random(n16 * 4, dtype=cp.float32).view(cp.uint32) for _ in range(copies)]
    sink = cp.zeros(1, cp.uint32)
    times = []
    for unroll in (1, 2, 4, 8):
        kern = cp.RawKernel(_READ_SRC.replace("UNROLL", str(unroll)), "read_stream")
        grid = (n16 + 256 * unroll - 1) // (256 * unroll)
        times.append(timed_in_graph(cp, [lambda b=b: kern((grid,), (256,), (b, cp.uint64(n16), sink)) for b in bufs]))
    del bufs
    return min(times)


def bench_matmul(cp, qm, qtype, n_out, n_in, n_tok, variant=None, build="default", glu=False):
    """(seconds, bytes moved) of one mat-mul through the launcher (variant, build: the dp4a kernel's, on
    activations rounded once outside the timing; see qmatmul.matmul_prequantized; glu: n_out gate and up rows)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

    qt = QT[qtype]
    elems, bsize = GGML_QUANT_SIZES[qt]
    row_bytes = n_in // elems * bsize
    nbytes = n_out * row_bytes
    copies = max(1, math.ceil(ROTATE_BYTES / nbytes))
    rng = np.random.default_rng(0)
    host = rng.integers(0, 256, size=(n_out, row_bytes), dtype=np.uint8)
    w = SimpleNamespace(name="bench", qtype=qt, n_out=n_out, n_in=n_in, raw=host)
    ws = [qm.upload(w) for _ in range(copies)]
    x = cp.asarray(rng.standard_normal((n_tok, n_in), dtype=np.float32))
    out = cp.empty((n_tok, n_out // 2 if glu else n_out), cp.float32)
    act = qm.ActBuffers(max(n_tok, 16), n_in)
    if variant is None:
        t = timed_in_graph(cp, [lambda w=w: qm.matmul(w, x, out, act, glu=glu) for w in ws])
    else:
        fmt = qm.act_format(qt)
        xq, xd = act.views(fmt, n_tok, n_in)
        qm.quantize_activations(fmt, x, xq, xd)
        t = timed_in_graph(cp, [lambda w=w: qm.matmul_prequantized(w, xq, xd, out, variant=variant, build=build,
                                                                   glu=glu) for w in ws])
    moved = nbytes + x.nbytes + out.nbytes
    del ws
    return t, moved


def upload_random(qm, qtype, n_out, n_in, seeds=range(4)):
    """One uploaded weight (qtype name) per seed, of test_dequant.random_rows' valid random rows (rows made once
    per distinct seed)."""
    from gguf import GGMLQuantizationType as QT
    from test_dequant import random_rows                        # tests/kernels (on sys.path above)

    qt = QT[qtype]
    raws = {s: random_rows(qt, n_out, n_in, seed=s) for s in set(seeds)}
    return [qm.upload(SimpleNamespace(name="bench", qtype=qt, n_out=n_out, n_in=n_in, raw=raws[s])) for s in seeds]


def gemm_inputs(cp, qm, qtype, n_out, n_in, n_tok):
    """4 uploaded copies of a random weight (qtype name) and n_tok rounded activation rows: (ws, xq, xd)."""
    ws = upload_random(qm, qtype, n_out, n_in)
    fmt = qm.act_format(ws[0].qtype)
    x = cp.asarray(np.random.default_rng(3).standard_normal((n_tok, n_in), dtype=np.float32))
    xq = cp.empty((n_tok, n_in), cp.int8)
    xd = cp.empty((n_tok, n_in // qm.XBLOCK[fmt]), cp.float32)
    qm.quantize_activations(fmt, x, xq, xd)
    return ws, xq, xd


def bench_gemm(cp, qm, qtype, n_out, n_in, n_tok, kernels):
    """{(kernel, mma variant): seconds} per prompt-chunk mat-mul on activations already rounded (the rounding is shared by every
    kernel choice), weights of random bytes with finite scales in 4 copies (the chunk is compute-bound)."""
    ws, xq, xd = gemm_inputs(cp, qm, qtype, n_out, n_in, n_tok)
    out = cp.empty((n_tok, n_out), cp.float32)
    tiles = qm.ActBuffers(n_tok, n_in, tiles=True)   # the tensor-core kernel's copy (timed with it: act_tiles)
    return {(kernel, mma): timed_in_graph(
        cp, [lambda w=w: qm.matmul_prequantized(w, xq, xd, out, kernel=kernel, mma=mma, tiles=tiles)
             for w in ws] * 2)
        for kernel, mma in kernels}


def attention_inputs(cp, n_keys, n_seq=1, n_heads=32, n_kv=8, hd=128, page_size=64, seed=1):
    """(q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales, scale, out) of one attention
    launch of n_seq sequences (one token each, at position n_keys - 1) over random int8 pages of n_keys keys each."""
    from strata_lite.kernels.kv_layout import kv_shapes
    per_seq = n_keys // page_size
    pages, scales = kv_shapes(1, per_seq * n_seq, page_size, n_kv, hd)
    rng = np.random.default_rng(seed)
    kp = cp.asarray(rng.integers(-127, 128, size=pages[1:], dtype=np.int8))
    vp = cp.asarray(rng.integers(-127, 128, size=pages[1:], dtype=np.int8))
    ks = cp.asarray(rng.random(scales[1:], dtype=np.float32) * 0.01)
    vs = cp.asarray(rng.random(scales[1:], dtype=np.float32) * 0.01)
    q = cp.asarray(rng.standard_normal((n_seq, n_heads, hd), dtype=np.float32))
    seq = cp.arange(n_seq, dtype=cp.int32)
    pos = cp.full(n_seq, n_keys - 1, cp.int32)
    tables = cp.arange(per_seq * n_seq, dtype=cp.int32).reshape(n_seq, per_seq)
    return q, seq, pos, tables, kp, ks, vp, vs, 1 / math.sqrt(hd), cp.empty_like(q)


def attention_call(cp, n_keys, n_seq=1, **shape):
    """(call, cache bytes): one attention launch over attention_inputs' arrays."""
    from strata_lite.kernels.cuda import attention as ak
    args = attention_inputs(cp, n_keys, n_seq, **shape)
    q, kp, ks, vp, vs = args[0], args[4], args[5], args[6], args[7]
    ws = ak.attention_workspace(n_seq, q.shape[1], q.shape[2], n_keys)
    def call():
        ak.attention(*args, ws, n_keys)
    call.out = args[-1]
    return call, kp.nbytes + vp.nbytes + ks.nbytes + vs.nbytes


def bench_attention(cp, n_keys):
    call, moved = attention_call(cp, n_keys)
    return timed_in_graph(cp, [call] * 16), moved


# --attn-ab: (label, keys per sequence, sequences, shape) of the attention A/B across attention.BUILDS
ATTN_AB_SHAPES = [("8B 32/8 D=128", 4096, 1, {}), ("8B 32/8 D=128", 32768, 1, {}), ("8B 32/8 D=128", 4096, 8, {}),
                  ("8B 32/8 D=128", 4096, 16, {}), ("8B 32/8 D=128", 32768, 4, {}), ("8B 32/8 D=128", 512, 64, {}),
                  ("0.5B 14/2 D=64", 4096, 1, dict(n_heads=14, n_kv=2, hd=64)),
                  ("0.5B 14/2 D=64", 32768, 1, dict(n_heads=14, n_kv=2, hd=64)),
                  ("0.5B 14/2 D=64", 4096, 16, dict(n_heads=14, n_kv=2, hd=64)),
                  ("0.5B 14/2 D=64", 512, 64, dict(n_heads=14, n_kv=2, hd=64))]


def attn_ab_rows(cp, rounds=2):
    """--attn-ab: every shape of ATTN_AB_SHAPES under each attention build (attention.BUILDS: the split-parallel
    kernels' CTAs per SM; P' or q' in one f16), builds alternating over `rounds`; (label, [µs per round] per
    build, same bits as the default build in every build that keeps them). Graph replays of 16 launches over one
    copy of the cache (beyond L2 from 16 x 4K keys)."""
    from strata_lite.kernels.cuda import attention as ak
    # (the tiled kernels' builds are --prefill-attn's)
    builds = [b for b in ak.BUILDS if not any(k.startswith("ATTN_TILED") for k in ak.BUILDS[b])]
    rows = []
    for name, keys, n_seq, shape in ATTN_AB_SHAPES:
        call, _ = attention_call(cp, keys, n_seq, **shape)
        times = {b: [] for b in builds}
        outs = {}
        for _ in range(rounds):
            for b in builds:
                ak.BUILD = b
                try:
                    call()
                    outs[b] = call.out.copy()
                    times[b].append(timed_in_graph(cp, [call] * 16) * 1e6)
                finally:
                    ak.BUILD = "default"
        base = outs["default"]
        same = all(bool(cp.array_equal(outs[b].view(cp.uint32), base.view(cp.uint32)))
                   for b in builds if ak.f16_rounding(b) == ak.f16_rounding("default"))
        dev = ", ".join(f"{b} {float(cp.abs(outs[b] - base).max() / cp.abs(base).max()):.1e}"
                        for b in builds if ak.f16_rounding(b) != ak.f16_rounding("default"))
        rows.append((f"{name}, {n_seq} x {keys} keys" + (f" (max |out - default's| / max: {dev})" if dev else ""),
                     times, same))
        del call
    return rows


# --prefill-attn: attention of a 512-token prompt chunk of one sequence at these depths (keys before it)
PREFILL_SHAPES = [("8B 32/8 D=128", {}), ("0.5B 14/2 D=64", dict(n_heads=14, n_kv=2, hd=64))]
PREFILL_DEPTHS = (0, 8192, 32768)


def prefill_attention_call(cp, depth, n_tok=512, **shape):
    """(call, flops): one attention launch of an n_tok-token chunk of one sequence at positions depth ..
    depth + n_tok - 1 over random int8 pages (attention_inputs' cache); flops = 4 x head_dim x the (token,
    head, key) triples (q.k and p.v, two each)."""
    from strata_lite.kernels.cuda import attention as ak
    keys = depth + n_tok
    _, _, _, tables, kp, ks, vp, vs, scale, _ = attention_inputs(cp, keys, 1, **shape)
    n_heads, hd = shape.get("n_heads", 32), shape.get("hd", 128)
    rng = np.random.default_rng(3)
    q = cp.asarray(rng.standard_normal((n_tok, n_heads, hd), dtype=np.float32))
    seq = cp.zeros(n_tok, cp.int32)
    pos = cp.arange(depth, keys, dtype=cp.int32)
    out = cp.empty_like(q)
    ws = ak.attention_workspace(n_tok, n_heads, hd, keys)
    def call():
        ak.attention(q, seq, pos, tables, kp, ks, vp, vs, scale, out, ws, keys)

    from strata_lite.kernels.cuda import attention_f16 as af
    scratch = af.f16_scratch(kp.shape[2], hd, keys)

    def call_f16():                                # the f16 flash-attention path (attention_f16.py)
        af.prompt_attention_f16(q, 0, pos, tables, kp, ks, vp, vs, scale, out, keys, scratch=scratch)
    call.out, call.args, call.f16 = out, (q, seq, pos, tables, kp, ks, vp, vs, scale), call_f16
    return call, 4 * hd * n_heads * sum(range(depth + 1, keys + 1))


def mixed_attention_call(cp, n_decode=4, keys=32768, chunk=256, **shape):
    """(call(split_rows), out): one attention launch of a mixed step: n_decode sequences' decode tokens at
    position keys - 1, then a chunk-token prompt chunk of another sequence from position 0 (attention_inputs'
    cache of n_decode + 1 sequences)."""
    from strata_lite.kernels.cuda import attention as ak
    _, _, _, tables, kp, ks, vp, vs, scale, _ = attention_inputs(cp, keys, n_decode + 1, **shape)
    n_heads, hd = shape.get("n_heads", 32), shape.get("hd", 128)
    n_tok = n_decode + chunk
    q = cp.asarray(np.random.default_rng(4).standard_normal((n_tok, n_heads, hd), dtype=np.float32))
    seq = cp.asarray(np.array(list(range(n_decode)) + [n_decode] * chunk, np.int32))
    pos = cp.asarray(np.array([keys - 1] * n_decode + list(range(chunk)), np.int32))
    out = cp.empty_like(q)
    ws = ak.attention_workspace(n_tok, n_heads, hd, keys)
    def call(split_rows):
        ak.attention(q, seq, pos, tables, kp, ks, vp, vs, scale, out, ws, keys, split_rows=split_rows)
    return call, out


def mixed_attention_rows(cp, rounds=2):
    """--prefill-attn: (label, [µs with the decode tokens apart], [µs all in one launch], same bits) of a
    mixed step's attention: 4 decode tokens after 32K keys beside a 256-token chunk from position 0."""
    rows = []
    for name, shape in PREFILL_SHAPES:
        call, out = mixed_attention_call(cp, **shape)
        times, outs = {4: [], 0: []}, {}
        for _ in range(rounds):
            for split in (4, 0):
                call(split)
                outs[split] = out.copy()
                times[split].append(timed_in_graph(cp, [lambda: call(split)] * 4, n_iter=5) * 1e6)
        same = bool(cp.array_equal(outs[4].view(cp.uint32), outs[0].view(cp.uint32)))
        rows.append((f"{name}, 4 decode tokens after 32K keys + 256-token chunk", times[4], times[0], same))
        del call
    return rows


# --prefill-attn: (label, attention.TILED, attention.BUILD) of each kernel timed; `q16` rounds q' to one f16 as well
# (attention.BUILDS) and `f16flash` is attention_f16.py's flash attention over an f16 copy of the keys, so both are
# compared with the default's outputs, not its bits
PREFILL_MODES = [("tiled", True, "default"), ("tiled1", True, "tiled1"), ("tiled4", True, "tiled4"),
                 ("looped", False, "default"), ("q16", True, "q16"), ("f16flash", True, "default")]


@contextlib.contextmanager
def attention_mode(tiled: bool, build: str = "default"):
    """Many-token attention launches tiled or looped (attention.TILED) in attention build `build` inside the
    block; the defaults again after it."""
    from strata_lite.kernels.cuda import attention as ak
    ak.TILED, ak.BUILD = tiled, build
    try:
        yield
    finally:
        ak.TILED, ak.BUILD = True, "default"


def prefill_attention_rows(cp, rounds=2):
    """--prefill-attn: (label, {mode: [µs per round]}, TFLOP/s of the default tiled kernel, same bits in every
    mode that keeps them, {mode: max |out - tiled's| / max |tiled's|} of the modes that round to f16) per shape
    and depth, PREFILL_MODES alternating over `rounds`, graph replays of 4 launches."""
    from strata_lite.kernels.cuda import attention as ak
    exact = {m for m, _, build in PREFILL_MODES
             if ak.f16_rounding(build) == ak.f16_rounding("default") and m != "f16flash"}
    rows = []
    for name, shape in PREFILL_SHAPES:
        for depth in PREFILL_DEPTHS:
            call, flops = prefill_attention_call(cp, depth, **shape)
            times, outs = {m[0]: [] for m in PREFILL_MODES}, {}
            for _ in range(rounds):
                for mode, tiled, build in PREFILL_MODES:
                    fn = call.f16 if mode == "f16flash" else call
                    with attention_mode(tiled, build):
                        fn()
                        outs[mode] = call.out.copy()
                        times[mode].append(timed_in_graph(cp, [fn] * 4, n_iter=5) * 1e6)   # per launch
            base = outs["tiled"]
            same = all(bool(cp.array_equal(outs[m].view(cp.uint32), base.view(cp.uint32))) for m in exact)
            dev = {m: float(cp.abs(o - base).max() / cp.abs(base).max()) for m, o in outs.items() if m not in exact}
            rows.append((f"{name}, 512 tokens after {depth} keys", times,
                         flops / (min(times["tiled"]) * 1e-6) / 1e12, same, dev))
            del call
    return rows


def llamacpp_attention(binary, depth, kv_type, n_tok=512, n_heads=32, n_kv=8, hd=128):
    """(µs, TFLOP/s) of llama.cpp's flash attention (ggml's CUDA backend) on prefill_attention_call's shape:
    perf/llamacpp_attention.cpp built by the user, given by path (--llamacpp-attn); None where it fails."""
    cmd = [binary, str(hd), str(n_heads), str(n_kv), str(n_tok), str(depth), kv_type]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"llama.cpp attention: {' '.join(cmd)}: {exc}")
        return None
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("llamacpp_attention ")), None)
    if res.returncode != 0 or line is None:
        print(f"llama.cpp attention: {' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()[-300:]}")
        return None
    fields = dict(f.split("=", 1) for f in line.split()[1:])
    return float(fields["us"]), float(fields["tflops"])


def llamacpp_attention_rows(binary):
    """--prefill-attn --llamacpp-attn: {(shape name, depth): {kv type: (µs, TFLOP/s) or None}} for f16 and q8_0
    caches at PREFILL_SHAPES x PREFILL_DEPTHS."""
    return {(name, depth): {t: llamacpp_attention(binary, depth, t, **shape) for t in ("f16", "q8_0")}
            for name, shape in PREFILL_SHAPES for depth in PREFILL_DEPTHS}


def print_llamacpp_attention(arows, lrows):
    """--llamacpp-attn's table: per shape and depth our tiled kernel's best µs (prefill_attention_rows), llama.cpp's
    with f16 and q8_0 caches (llamacpp_attention_rows) and ours / theirs (time: below 1 we are faster)."""
    print(f"\n{'prompt attention against llama.cpp, µs per launch':52s} {'ours':>8s} {'f16':>8s} {'TFLOP/s':>8s} "
          f"{'q8_0':>8s} {'TFLOP/s':>8s} {'ours/f16':>9s} {'ours/q8_0':>10s}")
    for name, _ in PREFILL_SHAPES:
        for depth in PREFILL_DEPTHS:
            label = f"{name}, 512 tokens after {depth} keys"
            ours = min(next(row[1] for row in arows if row[0] == label)["tiled"])
            cells, ratios = [], []
            for kv in ("f16", "q8_0"):
                r = lrows[(name, depth)][kv]
                cells.append(f"{r[0]:8.0f} {r[1]:8.1f}" if r else f"{'failed':>8s} {'':8s}")
                ratios.append(f"{ours / r[0]:.2f}x" if r else "-")
            print(f"{label:52s} {ours:8.0f} {cells[0]} {cells[1]} {ratios[0]:>9s} {ratios[1]:>10s}")


def attention_seconds(runner, batch):
    """Seconds one forward of batch spends in the backend's attention launches (CUDA events around each)."""
    import cupy as cp
    be, events = runner.backend, []
    plain = be.attention

    def timed_attention(*args, **kw):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        out = plain(*args, **kw)
        b.record()
        events.append((a, b))
        return out
    be.attention = timed_attention
    try:
        runner.forward(batch)
        cp.cuda.get_current_stream().synchronize()
    finally:
        del be.attention                         # the class's method again
    return sum(cp.cuda.get_elapsed_time(a, b) for a, b in events) * 1e-3


# prefill_rows' attention modes: (label, attention.TILED, the backend's prompt_attention)
PREFILL_FORWARD_MODES = [("tiled", True, "exact"), ("looped", False, "exact"), ("f16", True, "f16")]


def prefill_rows(model_path, depths=PREFILL_DEPTHS, n_pp=512, rounds=2):
    """(label, {mode: tok/s}, {mode: attention ms}) of one eager forward of an n_pp-token prompt chunk at each depth
    (keys already in the cache before it) in each PREFILL_FORWARD_MODES mode (the exact tiled and looped kernels,
    and `--prompt-attention f16`), alternating, best of 3 per round; then the milliseconds of one forward spent
    in attention launches."""
    from strata_lite.batch import Batch
    from strata_lite.runner import ModelRunner, load_model
    import cupy as cp
    loaded = load_model(model_path, backend="cuda")
    name = os.path.basename(model_path)
    n_ctx = max(depths) + n_pp
    runner = ModelRunner(loaded, kv_tokens=n_ctx + 64, page_size=64, host_bytes=0, n_ctx=n_ctx,
                         max_step_tokens=n_pp, max_seqs=1)
    be = runner.backend
    ids = np.random.default_rng(2).integers(0, loaded.config.n_vocab, n_pp).astype(np.int32)

    @contextlib.contextmanager
    def mode(tiled, prompt_attention):
        be.prompt_attention = prompt_attention
        try:
            with attention_mode(tiled):
                yield
        finally:
            be.prompt_attention = "exact"

    rows = []
    for depth in depths:
        batch = Batch.single(ids, depth, list(range((depth + n_pp) // 64 + 1)), logit_rows=[n_pp - 1])
        tps = {m: 0.0 for m, _, _ in PREFILL_FORWARD_MODES}
        for _ in range(rounds):
            for m, tiled, pa in PREFILL_FORWARD_MODES:
                with mode(tiled, pa):
                    tps[m] = max(tps[m], n_pp / timed(cp, lambda: runner.forward(batch), n_iter=3, warm=1))
        attn = {}
        for m, tiled, pa in PREFILL_FORWARD_MODES:
            with mode(tiled, pa):
                attn[m] = attention_seconds(runner, batch) * 1e3
        rows.append((f"{name} prompt {n_pp} after {depth}", tps, attn))
    return rows


KERNELS = [  # (label, qtype, n_out, n_in, n_tok) -- the shapes of the llama.cpp reference table
    ("IQ3_XXS 4096x14336 n=1", "IQ3_XXS", 14336, 4096, 1),
    ("IQ3_XXS 4096x14336 n=2", "IQ3_XXS", 14336, 4096, 2),
    ("IQ3_XXS 4096x14336 n=4", "IQ3_XXS", 14336, 4096, 4),
    ("IQ3_XXS 4096x14336 n=8", "IQ3_XXS", 14336, 4096, 8),
    ("IQ3_XXS 14336x4096 n=1", "IQ3_XXS", 4096, 14336, 1),
    ("Q4_K 4096x14336 n=1", "Q4_K", 14336, 4096, 1),
    ("Q4_K 4096x14336 n=8", "Q4_K", 14336, 4096, 8),
    ("Q8_0 4096x14336 n=1", "Q8_0", 14336, 4096, 1),
    ("F16 4096x14336 n=1", "F16", 14336, 4096, 1),
]


GEMMS = [  # (qtype, n_out, n_in, n_tok, llama.cpp TFLOP/s on the same card) -- prompt chunks
    ("IQ3_XXS", 14336, 4096, 512, 178),
    ("Q4_K", 14336, 4096, 512, 173),
    ("Q8_0", 14336, 4096, 512, None),
    ("Q6_K", 14336, 4096, 512, None),
    ("IQ3_XXS", 4096, 14336, 512, None),
    ("Q5_0", 4864, 896, 512, None),
    ("Q5_0", 896, 896, 512, None),
    ("Q4_K", 4096, 4096, 512, None),
    ("IQ3_XXS", 14336, 4096, 128, None),
    ("Q5_0", 4864, 896, 128, None),
    ("IQ3_XXS", 14336, 4096, 64, None),
    ("Q4_K", 14336, 4096, 64, None),
    ("Q5_0", 4864, 896, 64, None),
    ("Q5_0", 896, 896, 64, None),
]
# (kernel, the tensor-core kernel's variant: warps per CTA, n8 token tiles per warp)
GEMM_KERNELS = [("dp4a", None), ("mma", (4, 1)), ("mma", (2, 4)), ("mma", (4, 4))]


def gemm_rows(cp):
    from strata_lite.kernels.cuda import qmatmul as qm
    rows = []
    for qtype, n_out, n_in, n_tok, ref in GEMMS:
        times = bench_gemm(cp, qm, qtype, n_out, n_in, n_tok, GEMM_KERNELS)
        auto = qm.tensor_core_variant(n_out, n_tok)
        for (kernel, mma), t in times.items():
            label = f"{qtype} {n_in}x{n_out} n={n_tok} {kernel}" + (f" w{mma[0]} nb={mma[1]}" if mma else "")
            label += " *" if (mma == auto if kernel == "mma" else auto is None) else ""
            rows.append((label, t * 1e6, 2 * n_out * n_in * n_tok / t / 1e12, ref))
    return rows


FLOAT_GEMMS = [("F16", 14336, 4096, 512, 526), ("F16", 14336, 4096, 64, None)]   # (type, rows, row length, tokens, llama.cpp TFLOP/s)


def float_gemm_rows(cp):
    """--gemm: float-weight mat-muls of a prompt chunk, the default kernel (* : 8-token tiles, FLOAT_TILE8_ROWS a warp)
    against the explore build's tiles over qmatmul.EXPLORE_FLOAT_ROWS rows a warp, each checked bit for bit
    against the default on the same inputs."""
    from strata_lite.kernels.cuda import qmatmul as qm
    rows = []
    for qtype, n_out, n_in, n_tok, ref in FLOAT_GEMMS:
        ws = upload_random(qm, qtype, n_out, n_in)
        x = cp.asarray(np.random.default_rng(3).standard_normal((n_tok, n_in), dtype=np.float32))
        act = qm.ActBuffers(n_tok, n_in)
        want, out = cp.empty((n_tok, n_out), cp.float32), cp.empty((n_tok, n_out), cp.float32)
        qm.matmul(ws[0], x, want, act)
        for r in (None,) + qm.EXPLORE_FLOAT_ROWS:
            kw = {} if r is None else dict(rows=r, build="explore")
            qm.matmul(ws[0], x, out, act, **kw)
            same = bool(cp.array_equal(out.view(cp.uint32), want.view(cp.uint32)))
            t = timed_in_graph(cp, [lambda w=w, kw=kw: qm.matmul(w, x, out, act, **kw) for w in ws] * 2)
            label = f"{qtype} {n_in}x{n_out} n={n_tok} " + ("default *" if r is None else f"{r} rows")
            rows.append((label + ("" if same else " DIFFERENT BITS"), t * 1e6, 2 * n_out * n_in * n_tok / t / 1e12, ref))
        del ws
    return rows


def add_row(rows, label, t, moved, copy_bw) -> None:
    """Append (label, µs, GB/s, fraction of copy bandwidth) of a kernel that took t seconds and moved `moved`
    bytes, and print it at once (the --explore tables are long)."""
    rows.append((label, t * 1e6, moved / t / 1e9, moved / t / copy_bw))
    print(f"{label:48s} {t * 1e6:9.1f} {moved / t / 1e9:8.0f} {moved / t / copy_bw:9.0%}", flush=True)


def mb_label(variant) -> str:
    """' m<MB>' for a variant built under a minimum of MB CTAs per SM (qmatmul.EXPLORE_MB_VARIANTS), else ''."""
    return f" m{variant[3]}" if len(variant) > 3 else ""


def variant_rows(cp, copy_bw):
    """--explore: every dp4a variant (tile, rows per warp, units in flight) of the token count's tile."""
    from strata_lite.kernels.cuda import qmatmul as qm
    rows = []
    for label, qtype, n_out, n_in, n_tok in KERNELS + EXPLORE_KERNELS:
        if qtype in ("F16", "F32", "BF16"):
            continue
        tile = qm._tile(n_tok)            # and, past the largest tile the launcher takes, the explore build's wider ones
        for variant in [v for v in qm.EXPLORE_VARIANTS + qm.EXPLORE_MB_VARIANTS if v[0] == tile or tile < v[0] <= n_tok]:
            t, moved = bench_matmul(cp, qm, qtype, n_out, n_in, n_tok, variant, "explore")
            add_row(rows, f"{label} r{variant[1]} g{variant[2]}{mb_label(variant)}", t, moved, copy_bw)
    for label, qtype, n_out, n_in, n_tok in GLU_EXPLORE_KERNELS:   # gate-up row pairs per warp (* the default)
        tile = qm._tile(n_tok)
        default = qm.dp4a_variant(gguf.GGMLQuantizationType[qtype], tile, glu=True)
        for variant, build in [(default, "default")] + [(v, "explore") for v in qm.EXPLORE_GLU_VARIANTS
                                                         + qm.EXPLORE_MB_VARIANTS if v[0] == tile]:
            t, moved = bench_matmul(cp, qm, qtype, n_out, n_in, n_tok, variant, build, glu=True)
            add_row(rows, f"{label} r{variant[1]}{mb_label(variant)}{' *' if build == 'default' else ''}", t, moved,
                    copy_bw)
    return rows


GLU_EXPLORE_KERNELS = [(f"{qtype} gate+up 4096x2x14336 n={n}", qtype, 2 * 14336, 4096, n)
                       for qtype in ("IQ3_XXS", "Q4_K") for n in (1, 2, 4, 8, 16)]
# (type, rows, row length, GLU, tokens): decode steps of 16 sequences on the types `auto` leaves on dp4a there,
# and the IQ3_XXS mats of a 32-sequence step (q/k/v, down: dp4a 8-token tiles; gate+up: mmq's narrow tile)
SMALL_EXPLORE = [("Q6_K", 4096, 14336, False, 16), ("Q6_K", 32000, 4096, False, 16),
                 ("IQ3_XXS", 4096, 14336, False, 16), ("IQ3_XXS", 2 * 14336, 4096, True, 16),
                 ("IQ3_XXS", 6144, 4096, False, 32), ("IQ3_XXS", 4096, 14336, False, 32),
                 ("IQ3_XXS", 2 * 14336, 4096, True, 32)]


def launch_rows(cp, copy_bw, shapes, launches):
    """Rows of launches over each (qtype, n_out, n_in, glu, tokens) in shapes: launches(qtype, n_tok, glu) gives
    (name, matmul_prequantized keywords, None or the build whose dp4a kernel's bits on the same inputs the output
    must be); the chunk-major copy is timed with each launch."""
    from strata_lite.kernels.cuda import qmatmul as qm
    rows = []
    for qtype, n_out, n_in, glu, n_tok in shapes:
        ws, xq, xd = gemm_inputs(cp, qm, qtype, n_out, n_in, n_tok)
        tiles = qm.ActBuffers(n_tok, n_in, tiles=True)
        out = cp.empty((n_tok, n_out // 2 if glu else n_out), cp.float32)
        refs = {}
        for name, kw, ref_build in launches(ws[0].qtype, n_tok, glu):
            def call(w, kw=kw):
                qm.matmul_prequantized(w, xq, xd, out, glu=glu, tiles=tiles, **kw)
            call(ws[0])
            if ref_build is not None and ref_build not in refs:
                refs[ref_build] = cp.empty_like(out)
                qm.matmul_prequantized(ws[0], xq, xd, refs[ref_build], kernel="dp4a", glu=glu, build=ref_build)
            same = ref_build is None or bool(cp.array_equal(out.view(cp.uint32), refs[ref_build].view(cp.uint32)))
            t = timed_in_graph(cp, [lambda w=w: call(w) for w in ws] * 2)
            label = f"{qtype} {n_in}x{n_out}{' GLU' if glu else ''} n={n_tok} {name}"
            label += "" if same else " DIFFERENT BITS"
            add_row(rows, label, t, ws[0].raw.nbytes + xq.nbytes + out.nbytes, copy_bw)
        del ws
    return rows


def small_explore_rows(cp, copy_bw):
    """--explore: the small-token kernel of the explore build (qmatmul.SMALL_EXPLORE_WARPS) against what `auto`
    takes, each checked bit for bit against the dp4a kernel on the same inputs (chunk-major copy timed with it)."""
    from strata_lite.kernels.cuda import qmatmul as qm
    return launch_rows(cp, copy_bw, SMALL_EXPLORE, lambda qtype, n_tok, glu: [("auto *", {}, "default")] + [
        (f"small w{nk}", dict(kernel="small", small=nk, build="explore"), "default")
        for nk in qm.SMALL_EXPLORE_WARPS[qtype]])


# --explore: Q4_K / Q5_K shapes of the 8B-layer (and 0.5B) models in the default build (block sums) against the
# unit_tails build, and the superblock types' few-token tiles (mm_q against mm_q_tok): (qtype, n_out, n_in, glu,
# tokens)
BUILDS_EXPLORE = [("Q4_K", 14336, 4096, False, 1), ("Q4_K", 28672, 4096, True, 1), ("Q4_K", 4096, 14336, False, 1),
                    ("Q4_K", 4096, 4096, False, 1), ("Q4_K", 896, 4864, False, 1), ("Q5_K", 14336, 4096, False, 1),
                    ("Q4_K", 14336, 4096, False, 2), ("Q4_K", 14336, 4096, False, 4), ("Q4_K", 28672, 4096, True, 4),
                    ("Q4_K", 14336, 4096, False, 8), ("Q4_K", 28672, 4096, True, 8), ("Q4_K", 4096, 14336, False, 8),
                    ("Q5_K", 14336, 4096, False, 8), ("Q4_K", 14336, 4096, False, 16),
                    ("Q4_K", 28672, 4096, True, 16), ("Q4_K", 4096, 14336, False, 16), ("Q4_K", 4096, 4096, False, 16),
                    ("Q4_K", 28672, 4096, True, 32), ("Q4_K", 14336, 4096, False, 512),
                    ("IQ3_XXS", 4096, 14336, False, 2), ("IQ3_XXS", 14336, 4096, False, 2),
                    ("IQ3_XXS", 14336, 4096, False, 4), ("IQ3_XXS", 4096, 14336, False, 4),
                    ("IQ3_XXS", 28672, 4096, True, 4), ("IQ3_XXS", 14336, 4096, False, 8),
                    ("IQ3_XXS", 28672, 4096, True, 8), ("IQ3_XXS", 4096, 14336, False, 8),
                    ("Q6_K", 4096, 14336, False, 4), ("Q6_K", 4096, 14336, False, 8), ("Q6_K", 32000, 4096, False, 8)]


def iq3_group_rows(qm, tile: int, glu: bool, ref_build: str):
    """launch_rows entries of IQ3_XXS's group-loop kernels of a token tile: the default build's and the explore
    build's under launch bounds (qmatmul.EXPLORE_IQ3_GROUPS_MB), checked against ref_build's dp4a kernel."""
    variant = qm.iq3_groups_variant(tile, glu)
    name = f"t{tile} r{variant[1]} groups"
    return [(name, dict(variant=variant), ref_build)] + [
        (f"{name} m{v[3]}", dict(variant=v, build="explore"), ref_build)
        for v in qm.EXPLORE_IQ3_GROUPS_MB[glu] if v[0] == tile]


def builds_rows(cp, copy_bw):
    """--explore: each BUILDS_EXPLORE launch through `auto` in the default build, (Q4_K / Q5_K) in the unit_tails
    build and (IQ3_XXS, at most 8 tokens) through the loop over whole groups (qmatmul.IQ3_GROUPS), checked bit for
    bit against its build's dp4a kernel; one-token Q4_K / Q5_K launches also
    through the explore build's mm_q1 kernels (qmatmul.PIPE, ONE_LOOP); launches of 2-16 tokens through the 4- or
    8-token tile of mm_q and of mm_q_tok (PER_TOKEN)."""
    from strata_lite.kernels.cuda import qmatmul as qm

    def launches(qtype, n_tok, glu):
        k4 = qtype in (qm.QType.Q4_K, qm.QType.Q5_K)
        rows = [("default *", dict(build="default"), "default")]
        rows += [("unit_tails *", dict(build="unit_tails"), "unit_tails")] if k4 else []
        if qtype == qm.QType.IQ3_XXS and n_tok <= 8:
            rows += iq3_group_rows(qm, qm._tile(n_tok), glu, "default")
        if n_tok == 1 and k4:
            rows += [(f"r{rw} {how}", dict(variant=(1, rw, g), build="explore"), "default")
                     for g, how in ((qm.PIPE, "pipelined"), (qm.ONE_LOOP, "one loop"))
                     for rw in ((2, 4) if glu else (1, 2))]
        if 2 <= n_tok <= 16:
            tile = 8 if n_tok >= 8 else 4
            rw = qm.DP4A_GLU_ROWS[tile] if glu else qm.DP4A_VARIANTS[tile][0]
            rows += [(f"t{tile} r{rw} {how}", dict(variant=(tile, rw, g)), "default")
                     for g, how in ((1, "mm_q"), (qm.PER_TOKEN, "per token"))]
        return rows
    return launch_rows(cp, copy_bw, BUILDS_EXPLORE, launches)


# --explore: one-token launches of the superblock types (qmatmul_types.cuh S > 1: IQ3_XXS, Q6_K, Q4_K, Q5_K)
# through mm_q1's loop (the default) and mm_q's (the mmq_one_token build)
ONE_TOKEN_AB = [("IQ3_XXS", 14336, 4096, False, 1), ("IQ3_XXS", 4096, 14336, False, 1),
                ("IQ3_XXS", 28672, 4096, True, 1), ("IQ3_XXS", 6144, 4096, False, 1), ("Q6_K", 14336, 4096, False, 1),
                ("Q6_K", 4096, 14336, False, 1), ("Q6_K", 896, 4864, False, 1), ("Q6_K", 32000, 4096, False, 1),
                ("IQ3_XXS", 896, 4864, False, 1), ("IQ3_XXS", 4096, 4096, False, 1)]


def one_token_rows(cp, copy_bw):
    """--explore: ONE_TOKEN_AB through the mmq_one_token build, the default, and the explore build's mm_q1 kernels
    of other rows a warp (RW) and bounds (a minimum of one CTA an SM), and for IQ3_XXS the loop over whole groups
    (qmatmul.cu mm_q_iq3, qmatmul.IQ3_GROUPS), all checked bit for bit against the mmq_one_token build's dp4a
    kernel (mm_q's own loop) on the same inputs."""
    from strata_lite.kernels.cuda import qmatmul as qm

    def launches(qtype, n_tok, glu):
        rows = [("mm_q loop", dict(build="mmq_one_token", variant=qm.dp4a_variant(qtype, 1, glu)), "mmq_one_token"),
                ("auto *", dict(build="default"), "mmq_one_token")]
        if qtype == qm.QType.IQ3_XXS:
            rows += iq3_group_rows(qm, 1, glu, "mmq_one_token")
        rows += [(f"r{rw} (the default build's kernel)", dict(variant=(1, rw, 1), build="default"), "mmq_one_token")
                 for rw in ((4,) if glu else (1, 2))]
        rows += [(f"mm_q1 r{rw} g{g} min 1", dict(variant=(1, rw, g), build="explore"), "mmq_one_token")
                 for rw in ((2, 4) if glu else (1, 2)) for g in (qm.ONE_LOOP, qm.PIPE)]
        return rows
    return launch_rows(cp, copy_bw, ONE_TOKEN_AB, launches)


EXPLORE_KERNELS = [  # launch-bound shapes of the 0.5B model, and decode steps of 16 sequences, for --explore
    ("Q5_0 896x4864 n=1", "Q5_0", 4864, 896, 1),
    ("IQ3_XXS 4096x14336 n=16", "IQ3_XXS", 14336, 4096, 16),
    ("IQ3_XXS 14336x4096 n=16", "IQ3_XXS", 4096, 14336, 16),
    ("Q6_K 14336x4096 n=16", "Q6_K", 4096, 14336, 16),
    ("Q6_K 4096x32000 n=16", "Q6_K", 32000, 4096, 16),
    ("Q8_0 4096x14336 n=16", "Q8_0", 14336, 4096, 16),
    ("Q8_0 896x1152 n=1", "Q8_0", 1152, 896, 1),
    ("Q6_K 4864x896 n=1", "Q6_K", 896, 4864, 1),
    ("Q6_K 4096x14336 n=1", "Q6_K", 14336, 4096, 1),
    ("Q5_K 4096x14336 n=1", "Q5_K", 14336, 4096, 1),   # Q5_K_M files; its 8-token kernel takes ~173 registers
    ("Q5_K 4096x14336 n=8", "Q5_K", 14336, 4096, 8),
]


def kernel_rows(cp, copy_bw):
    from strata_lite.kernels.cuda import qmatmul as qm
    rows = []
    for label, qtype, n_out, n_in, n_tok in KERNELS:
        t, moved = bench_matmul(cp, qm, qtype, n_out, n_in, n_tok)
        rows.append((label, t * 1e6, moved / t / 1e9, moved / t / copy_bw))
    for keys in (4096, 32768):
        t, moved = bench_attention(cp, keys)
        rows.append((f"attention decode D=128 32/8 heads {keys} keys", t * 1e6, moved / t / 1e9, moved / t / copy_bw))
    return rows


# --batched: sequences decoding together; llama.cpp's aggregate decode tok/s on the same card for the 8B-layer
# shape's Q4_K_M mix (commit 0c1e570, CUDA graphs on, 2026-11-30: the reference figures README.md quotes)
BATCHED = (1, 8, 16, 32, 64)
BATCHED_REF = {1: 985, 8: 3503, 16: 7192, 64: 13878}


def ctx_label(ctx: int) -> str:
    """A context length as the tables print it: 4K, 32K, 512."""
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def e2e_rows(model_path, contexts=(4096, 32768), batches=(1, 4), n_pp=512, n_steps=64, paths=("graph",), rounds=1):
    """(label, tok/s) rows for one GGUF file on the CUDA backend. paths: how a decode step's greedy ids reach
    the host: "graph" (the engine's: the ids the step graph computed, runner.sample) and/or "launch" (a
    separate argmax launch after the replay, Backend.sample: the path before the ids moved into the graphs);
    with several, or rounds > 1, they alternate per context and batch and each round gets its own row."""
    from strata_lite.batch import Batch
    from strata_lite.kernels.sample_rows import SampleRows
    from strata_lite.runner import ModelRunner, load_model
    import cupy as cp

    loaded = load_model(model_path, backend="cuda")
    name = os.path.basename(model_path)
    rows = []
    ctx_max = max(contexts, default=n_pp)
    runner = ModelRunner(loaded, kv_tokens=ctx_max * max(batches) + n_pp, page_size=64, host_bytes=0,
                         n_ctx=ctx_max, max_step_tokens=n_pp, max_seqs=max(batches))
    be, ps = runner.backend, 64
    pages_per_seq = ctx_max // ps
    # prompt: one eager forward of n_pp tokens from position 0
    ids = np.random.default_rng(2).integers(0, loaded.config.n_vocab, n_pp).astype(np.int32)
    pp_batch = Batch.single(ids, 0, list(range(n_pp // ps + 1)), logit_rows=[n_pp - 1])
    t = timed(cp, lambda: runner.forward(pp_batch), n_iter=5, warm=2)
    rows.append((f"{name} prompt {n_pp}", n_pp / t))
    for ctx in contexts:
        for b in batches:
            tables = np.stack([np.arange(s * pages_per_seq, (s + 1) * pages_per_seq, dtype=np.int32)
                               for s in range(b)])
            batch = Batch(ids[:b].copy(), np.full(b, ctx - 1, np.int32), np.arange(b, dtype=np.int32), tables,
                          np.arange(b, dtype=np.int64))
            greedy = SampleRows.greedy(b)
            steps = {"graph": lambda: runner.sample(runner.forward(batch), greedy),
                     "launch": lambda: be.sample(runner.forward(batch), greedy, None)}
            for r in range(rounds):
                for path in paths:
                    step = steps[path]
                    for _ in range(3):
                        step()
                    be.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(n_steps):
                        step()                       # sampling returns host ids: every step ends in a sync
                    dt = (time.perf_counter() - t0) / n_steps
                    tag = f" ids by {path}" if len(paths) > 1 else ""
                    tag += f" round {r + 1}" if rounds > 1 else ""
                    rows.append((f"{name} decode batch {b} ctx {ctx_label(ctx)}{tag}", b / dt))
    return rows


def engine_rows(model_path, slots=(1, 4), n_tokens=None, rounds=2, backend="cuda"):
    """(label, tok/s) of decoding through the whole engine (scheduler, sampling, token events, metrics:
    what `serve` does per step), greedy, --spec off: `slots` concurrent requests of n_tokens each after a
    64-token prompt, each read by its own thread as a server's would be; tok/s = the tokens that arrived
    while every request was decoding (from the last first token to the first last token) / that time; with
    several requests the label also gives when the last of them got its first token (the burst's reads).
    The difference from e2e_rows' decode is the engine's host work per step. n_tokens: None = 256 + 16 per
    slot: a burst's prompts are read beside the first requests' decode at the scheduler's decode_share, so the
    last request's first token comes ~9 steps per request after the first one's (a simulated burst of 32 with
    GPU-like step costs: step 279), and the window needs every request still decoding then."""
    import threading
    from strata_lite.config import EngineConfig
    from strata_lite.engine import Engine
    from strata_lite.engine_events import TokenEvent
    from strata_lite.sampling import SamplingParams
    from strata_lite.sequence import Request

    eng = Engine(EngineConfig(model=model_path, backend=backend, n_ctx=4096, parallel=max(slots), spec="off"))
    eng.start()
    if not eng.wait_ready(600):
        raise RuntimeError(f"the engine did not start: {eng.load_error}")
    rng = np.random.default_rng(3)
    n_vocab = eng._runner.n_vocab
    name = os.path.basename(model_path)

    def one(rid, times, n_slots=1):
        prompt = tuple(int(t) for t in rng.integers(0, n_vocab, 64))
        h = eng.submit(Request(rid, prompt, SamplingParams(temperature=0.0, ignore_eos=True),
                               max_tokens=n_tokens or 256 + 16 * n_slots))
        times.extend(time.perf_counter() for ev in h.events() if isinstance(ev, TokenEvent))

    rows = []
    try:
        one("warm-up", [])
        for r in range(rounds):
            for n in slots:
                times = [[] for _ in range(n)]
                threads = [threading.Thread(target=one, args=(f"r{r}-{n}-{i}", times[i], n)) for i in range(n)]
                start = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                t0, t1 = max(ts[0] for ts in times), min(ts[-1] for ts in times)
                tag = f" round {r + 1}" if rounds > 1 else ""
                rate = sum(t0 < t <= t1 for ts in times for t in ts) / (t1 - t0) if t1 > t0 else float("nan")
                first = f", every first token by {t0 - start:.2f} s" if n > 1 else ""
                rows.append((f"{name} engine decode {n} slot{'s' if n > 1 else ''}{tag}{first}", rate))
    finally:
        eng.stop()
    return rows


def one_sequence_step_graph(cp, runner, n):
    """The runner's step graph for one sequence's n tokens (pending token and drafts) at positions 1,000 ..
    1,000 + n - 1, its inputs filled: ready to replay."""
    from strata_lite.batch import Batch
    batch = Batch(np.full(n, 5, np.int32), np.arange(1000, 1000 + n, dtype=np.int32), np.zeros(n, np.int32),
                  np.arange(64, dtype=np.int32)[None], np.arange(n, dtype=np.int64))
    graph, static, _, _ = runner.graphs._graphs[runner.graphs.bucket(batch)]
    static.fill(cp, batch)
    return graph


def verify_cost_rows(cp, model_path, tokens=(1, 2, 3, 4), rounds=2):
    """What more tokens in a decode / verify step cost: (label, µs) rows of the split-K kernel against the
    dp4a kernel the launcher takes for more than SPLIT_K_AUTO_TOKENS tokens, on the 0.5B shape's down
    projection (896 x 4864), of one row a warp against two at 2 tokens over that shape's few rows, and of the
    step graph of one sequence's 1, 2 and 4 tokens (pending token and
    drafts) at position 1,000 (CUDA events around replays, medians of 60) with the launcher sending split-K
    up to SPLIT_K_MAX_TOKENS tokens or one, alternating."""
    from strata_lite.kernels.cuda import qmatmul as qm
    from strata_lite.runner import ModelRunner, load_model

    rows = []
    for qtype in ("Q5_0", "Q6_K", "Q4_K"):
        for n in tokens:
            sk, _ = bench_matmul(cp, qm, qtype, 896, 4864, n, variant="sk")
            dp, _ = bench_matmul(cp, qm, qtype, 896, 4864, n, variant=qm.dp4a_variant(gguf.GGMLQuantizationType[qtype], qm._tile(n)))
            rows.append((f"{qtype} 896x4864, {n} tokens: split-K / dp4a", sk * 1e6, dp * 1e6))
    # two tokens over the 0.5B shape's few rows (rows x row length): one row a warp against two
    # (qmatmul.TWO_TOKEN_ONE_ROW_MAX_ROWS)
    for qtype, n_out, n_in in (("Q5_0", 1152, 896), ("Q5_0", 896, 896), ("Q8_0", 128, 896),
                               ("Q4_K", 896, 4864), ("Q5_0", 896, 4864)):
        r1, _ = bench_matmul(cp, qm, qtype, n_out, n_in, 2, variant=(2, 1, 1))
        r2, _ = bench_matmul(cp, qm, qtype, n_out, n_in, 2, variant=(2, 2, 1))
        rows.append((f"{qtype} {n_out} rows x {n_in}, 2 tokens: one row a warp / two", r1 * 1e6, r2 * 1e6))
    loaded = load_model(model_path, backend="cuda")
    name = os.path.basename(model_path)
    saved = qm.SPLIT_K_AUTO_TOKENS
    stream = cp.cuda.get_current_stream()
    for r in range(rounds):
        for limit in (qm.SPLIT_K_MAX_TOKENS, 1):
            qm.SPLIT_K_AUTO_TOKENS = limit      # read when the graphs are captured
            try:
                runner = ModelRunner(loaded, kv_tokens=4096 + 512, page_size=64, host_bytes=0, n_ctx=4096,
                                     max_step_tokens=64, max_seqs=4)
            finally:
                qm.SPLIT_K_AUTO_TOKENS = saved
            for n in (t for t in tokens if t in runner.graphs.buckets):
                graph = one_sequence_step_graph(cp, runner, n)
                for _ in range(5):
                    graph.launch(stream)
                t = []
                for _ in range(60):
                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    a.record()
                    graph.launch(stream)
                    b.record()
                    b.synchronize()
                    t.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
                rows.append((f"{name} step graph, {n} tokens, split-K up to {limit} (round {r + 1})",
                             float(np.median(t)), None))
            del runner
    return rows


def step_breakdown(model_path, ctx=4096, n_steps=100, programmatic=None):
    """(label, µs per step, graph µs, inputs µs, sampling µs) of a batch-1 decode step with the engine sized
    for ctx: the graph replay timed by CUDA events, the host work around it (batch checks and the input copy;
    greedy sampling after the step finished: the ids the graph computed, copied back) by host clocks.
    programmatic: capture the graphs with (True) or without (False) programmatic dependent launch (None: the
    backend's default)."""
    from strata_lite.batch import Batch
    from strata_lite.kernels.cuda.graphs import StepGraphs
    from strata_lite.kernels.sample_rows import SampleRows
    from strata_lite.runner import ModelRunner, load_model, step_forward
    import cupy as cp

    loaded = load_model(model_path, backend="cuda")
    runner = ModelRunner(loaded, kv_tokens=ctx + 512, page_size=64, host_bytes=0, n_ctx=ctx, max_step_tokens=512,
                         max_seqs=1)
    variant = []
    if programmatic is not None:
        runner.graphs = None
        runner.graphs = StepGraphs(step_forward(runner.backend, runner.model, runner.kv), max_pages=ctx // 64,
                                   max_keys=ctx, scratch_page=runner.scratch_page, programmatic=programmatic)
        variant = [f"PDL {'on' if runner.graphs.programmatic else 'off'}"]
    batch = Batch(np.array([5], np.int32), np.full(1, ctx - 1, np.int32), np.zeros(1, np.int32),
                  np.arange(ctx // 64, dtype=np.int32)[None], np.arange(1, dtype=np.int64))
    greedy = SampleRows.greedy(1)
    for _ in range(10):
        runner.sample(runner.forward(batch), greedy)
    runner.backend.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_steps):
        runner.sample(runner.forward(batch), greedy)
    step = (time.perf_counter() - t0) / n_steps
    graph, static, _, _ = runner.graphs._graphs[runner.graphs.bucket(batch)]
    stream = cp.cuda.get_current_stream()
    gpu = []
    for _ in range(n_steps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        graph.launch(stream)
        b.record()
        b.synchronize()
        gpu.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    t0 = time.perf_counter()
    for _ in range(n_steps):
        batch.validate(runner.kv.n_pages, runner.kv.page_size, runner.n_vocab)
        static.fill(cp, batch)
    stream.synchronize()
    inputs = (time.perf_counter() - t0) / n_steps
    sampling = 0.0
    for _ in range(n_steps):
        logits = runner.forward(batch)
        stream.synchronize()
        t0 = time.perf_counter()
        runner.sample(logits, greedy)
        sampling += (time.perf_counter() - t0) / n_steps
    label = f"{os.path.basename(model_path)} decode batch 1 ctx {ctx_label(ctx)}"
    return (" ".join([label] + variant), step * 1e6,
            float(np.median(gpu)) * 1e6, inputs * 1e6, sampling * 1e6)


def print_breakdown(brows):
    print(f"\n{'decode step, engine sized for 4K (µs)':60s} {'step':>7s} {'graph':>7s} {'inputs':>7s} {'sampling':>8s}")
    for label, step, gpu, inputs, sampling in brows:
        print(f"{label:60s} {step:7.0f} {gpu:7.0f} {inputs:7.0f} {sampling:8.0f}")


def synth_models(out_dir, quick, only=None):
    """The synthetic GGUF files (made once in out_dir): all three, the first (quick), or those whose
    "<preset>-<mix>" contains `only`."""
    specs = [("qwen2", "qwen2.5-0.5b", "q4_k_m"), ("llama", "llama-8b-layers", "q4_k_m"),
             ("llama", "llama-8b-layers", "iq3_xxs")]
    if quick:
        specs = specs[:1]
    if only:
        specs = [s for s in specs if only in f"{s[1]}-{s[2]}"]
    paths = []
    for arch, preset, mix in specs:
        path = os.path.join(out_dir, f"synth-{preset}-{mix}.gguf")
        if not os.path.exists(path):
            subprocess.run([sys.executable, "-m", "strata_lite.cli", "synth", "--arch", arch, "--preset", preset,
                            "--quant", mix, "--out", path], check=True)
        paths.append(path)
    return paths


GEMM_EXPLORE = [("IQ3_XXS", 14336, 4096, 512), ("Q4_K", 14336, 4096, 512), ("Q6_K", 14336, 4096, 512),
                ("Q8_0", 14336, 4096, 512), ("IQ3_XXS", 14336, 4096, 64), ("Q4_K", 14336, 4096, 64),
                ("Q4_K", 4096, 14336, 64)]
# (kernel name suffix, warps, n8 tiles per warp) of qmatmul_mma.cu built with -DMMQ_EXPLORE
MMA_EXPLORE = [("w4_n4", 4, 4), ("w4_n2", 4, 2), ("w2_n2", 2, 2), ("w8_n2", 8, 2), ("w2_n4", 2, 4),
               ("w2_n4_m6", 2, 4), ("w4_n1", 4, 1)]


def gemm_explore_rows(cp):
    """--gemm-explore: the tensor-core kernel's candidate variants and what `auto` takes (its chunk-major copy
    timed with it), each checked bit for bit against the default build's widest kernel on the same inputs."""
    from strata_lite.kernels.cuda import qmatmul as qm
    from strata_lite.kernels.cuda.runtime import cdiv, launch
    rows = []
    for qtype, n_out, n_in, n_tok in GEMM_EXPLORE:
        ws, xq, xd = gemm_inputs(cp, qm, qtype, n_out, n_in, n_tok)
        qt = ws[0].qtype
        ref = cp.empty((n_tok, n_out), cp.float32)
        qm.matmul_prequantized(ws[0], xq, xd, ref, kernel="mma", mma=qm.MMA_VARIANTS[0])
        out = cp.empty_like(ref)
        xt, xdt = qm.chunk_major(qm.act_format(qt), xq, xd, qm.ActBuffers(n_tok, n_in, tiles=True))
        for suffix, warps, nb in MMA_EXPLORE:
            def call(w, suffix=suffix, warps=warps, nb=nb):
                args = (w.raw, np.int32(w.raw.shape[1]), np.int32(n_out), np.int32(n_in), xt, xdt, np.int32(n_tok),
                        *qm._out_args(w, n_tok, out, None, False, False))
                launch(qm.CU_MMA, f"mmq_{qm._KNAME[qt]}_{suffix}", (cdiv(n_tok, 8 * nb * warps), cdiv(n_out, 32)),
                       (32, warps), args, shared_mem=qm.mma_smem(qt, warps, nb), options=qm.MMA_BUILDS["explore"])
            call(ws[0])
            same = bool(cp.array_equal(out.view(cp.uint32), ref.view(cp.uint32)))
            t = timed_in_graph(cp, [lambda w=w: call(w) for w in ws] * 2)
            label = f"{qtype} {n_in}x{n_out} n={n_tok} {suffix}" + ("" if same else " DIFFERENT BITS")
            rows.append((label, t * 1e6, 2 * n_out * n_in * n_tok / t / 1e12, None))
        tiles = qm.ActBuffers(n_tok, n_in, tiles=True)
        qm.matmul_prequantized(ws[0], xq, xd, out, tiles=tiles)
        same = bool(cp.array_equal(out.view(cp.uint32), ref.view(cp.uint32)))
        t = timed_in_graph(cp, [lambda w=w: qm.matmul_prequantized(w, xq, xd, out, tiles=tiles) for w in ws] * 2)
        label = f"{qtype} {n_in}x{n_out} n={n_tok} auto *" + ("" if same else " DIFFERENT BITS")
        rows.append((label, t * 1e6, 2 * n_out * n_in * n_tok / t / 1e12, None))
        del ws
    return rows


def print_gemm(grows):
    print(f"\n{'prompt mat-mul (activations rounded)':48s} {'us':>9s} {'TFLOP/s':>8s} {'llama.cpp':>10s}")
    for label, us, tfs, ref in grows:
        print(f"{label:48s} {us:9.1f} {tfs:8.1f} {ref if ref else '':>10}")


def write_json(path, be, **figures) -> None:
    """With --json PATH: the figures of this run, beside the device they come from."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": be.describe(), **figures}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="/dev/shm/strata-synth", help="folder for the synthetic GGUF files")
    ap.add_argument("--quick", action="store_true", help="one model, fewer kernels")
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    ap.add_argument("--explore", action="store_true",
                    help="only the dp4a kernel variants, the explore build's small-token kernels and the unit_tails "
                         "build's Q4_K / Q5_K kernels (kernel_notes.md)")
    ap.add_argument("--explore-part", default="all", choices=("all", "variants", "small", "builds", "one-token"),
                    help="--explore: only this part (the dp4a variants, the small-token kernels, the Q4_K builds and "
                         "few-token tiles, the superblock types' one-token loops)")
    ap.add_argument("--gemm", action="store_true", help="only the prompt mat-mul table (* marks the kernel auto takes)")
    ap.add_argument("--gemm-explore", action="store_true", help="only the tensor-core kernel's candidate variants")
    ap.add_argument("--prompt", action="store_true", help="only the synthetic models' 512-token prompt forwards")
    ap.add_argument("--decode", action="store_true",
                    help="only the synthetic models' decode at 4K (greedy ids from the step graph against a separate "
                         "argmax launch, alternating) and the step breakdown")
    ap.add_argument("--engine", action="store_true",
                    help="only the synthetic models' decode through the whole engine (scheduler, sampling, events) "
                         "at 1 and 4 slots, beside the runner-level decode of the same file")
    ap.add_argument("--batched", action="store_true",
                    help="only decode of 1-64 sequences together (runner: three rounds each; engine), beside "
                         "llama.cpp's figures")
    ap.add_argument("--only", default=None, help="only the synthetic models whose <preset>-<mix> contains this")
    ap.add_argument("--build", default="default", choices=("default", "unit_tails", "mmq_one_token"),
                    help="compile every mat-mul of the run as this build of qmatmul.cu / qmatmul_mma.cu (A/B of a "
                         "build's bits and kernels end to end; kernel_notes.md)")
    ap.add_argument("--one-row-max", type=int, default=None,
                    help="one-token launches over at most this many rows take one row a warp (qmatmul."
                         "ONE_ROW_MAX_ROWS; 0: never), for A/B runs of that choice")
    ap.add_argument("--two-token-one-row-max", type=int, default=None,
                    help="two-token launches over at most this many rows take one row a warp (qmatmul."
                         "TWO_TOKEN_ONE_ROW_MAX_ROWS; 0: never), for A/B runs of that choice")
    ap.add_argument("--mma-64", choices=("on", "off"), default=None,
                    help="on (the default, qmatmul.MMA_64): 64-token tensor-core launches take qmatmul."
                         "MMA_64_CANDIDATES (IQ3_XXS's 2 x 4 under 6 CTAs an SM, Q4_K / Q5_K's 4 x 2 over >= 4,096 "
                         "rows); off: "
                         "tensor_core_variant's choice, for A/B runs of that choice")
    ap.add_argument("--warps-per-cta", type=int, choices=(4, 8), default=None,
                    help="warps per CTA of the dp4a and float mat-muls (qmatmul.WARPS_PER_CTA; A/B runs)")
    ap.add_argument("--iq3-groups", choices=("auto", "off"), default="auto",
                    help="off: no IQ3_XXS launch takes the loop over whole groups (qmatmul.IQ3_GROUPS_CHOICES), "
                         "for A/B runs of that choice")
    ap.add_argument("--contexts", default="4096",
                    help="--batched: comma-separated contexts every sequence decodes at (default 4096)")
    ap.add_argument("--verify-cost", action="store_true",
                    help="only what 1-4 tokens of a step cost: split-K against dp4a on the 0.5B shape's down "
                         "projection, one row a warp against two at 2 tokens over its few rows, and its step graphs "
                         "with split-K for several tokens or one")
    ap.add_argument("--attn-ab", action="store_true",
                    help="only attention at several shapes under each attention build (attention.BUILDS: the "
                         "split-parallel kernels' CTAs per SM), alternating, with a bit check against the default")
    from strata_lite.kernels.cuda import attention as ak
    ap.add_argument("--attn-build", default="default", choices=tuple(ak.BUILDS),
                    help="the attention build every launch takes (attention.BUILDS), for A/B runs of whole models")
    ap.add_argument("--prefill-attn", action="store_true",
                    help="only prompt chunks at depth: attention of 512 tokens after 0 / 8K / 32K keys and the "
                         "synthetic models' 512-token forwards there, tiled and looped kernels alternating")
    ap.add_argument("--llamacpp-attn", metavar="BINARY",
                    help="--prefill-attn: also llama.cpp's flash attention on the same shapes, f16 and q8_0 caches "
                         "(perf/llamacpp_attention.cpp built against a CUDA build of ggml / llama.cpp)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="only the decode step breakdown, graphs captured without and with programmatic dependent "
                         "launch (twice each, alternating)")
    args = ap.parse_args(argv)
    parts = args.contexts.split(",")
    contexts = tuple(int(c) for c in parts if c.strip().isdigit())
    if len(contexts) != len(parts) or any(c < 64 or c % 64 for c in contexts):
        ap.error(f"--contexts takes comma-separated multiples of 64 (the KV page size), got {args.contexts!r}")
    import cupy as cp
    from strata_lite.kernels.cuda import qmatmul as qm
    from strata_lite.kernels.cuda.backend import CudaBackend
    qm.BUILDS["default"], qm.MMA_BUILDS["default"] = qm.BUILDS[args.build], qm.MMA_BUILDS[args.build]
    if args.one_row_max is not None:
        qm.ONE_ROW_MAX_ROWS = args.one_row_max
    if args.two_token_one_row_max is not None:
        qm.TWO_TOKEN_ONE_ROW_MAX_ROWS = args.two_token_one_row_max
    if args.iq3_groups == "off":
        qm.IQ3_GROUPS_CHOICES = {}
    if args.mma_64 is not None:
        qm.MMA_64 = args.mma_64 == "on"
    if args.warps_per_cta is not None:
        qm.WARPS_PER_CTA = args.warps_per_cta
    ak.BUILD = args.attn_build
    be = CudaBackend()
    copy_bw = copy_bandwidth(cp)
    if args.explore:
        print(f"\n{be.describe()}; copy bandwidth {copy_bw / 1e9:,.0f} GB/s (read + write)")
        parts = {"variants": variant_rows, "small": small_explore_rows, "builds": builds_rows,
                 "one-token": one_token_rows}
        for name, rows in parts.items():
            if args.explore_part in ("all", name):
                rows(cp, copy_bw)
        return 0
    if args.gemm or args.prompt or args.gemm_explore:
        print(f"\n{be.describe()}")
        if args.gemm_explore:
            print_gemm(gemm_explore_rows(cp))
        if args.gemm:
            print_gemm(gemm_rows(cp) + float_gemm_rows(cp))
        if args.prompt:
            os.makedirs(args.models, exist_ok=True)
            for path in synth_models(args.models, args.quick, args.only):
                for label, tps in e2e_rows(path, contexts=()):
                    print(f"{label:60s} {tps:9.0f} tok/s")
        return 0
    if args.decode:
        os.makedirs(args.models, exist_ok=True)
        erows, brows = [], []
        for path in synth_models(args.models, args.quick, args.only):
            erows += e2e_rows(path, contexts=(4096,), paths=("graph", "launch"), rounds=3)
            brows.append(step_breakdown(path))
        print(f"\n{'decode, greedy ids from the step graph or a launch after it':60s} {'tok/s':>9s}")
        for label, tps in erows:
            print(f"{label:60s} {tps:9.0f}")
        print_breakdown(brows)
        write_json(args.json, be, e2e=erows, step_breakdown=brows)
        return 0
    if args.engine:
        os.makedirs(args.models, exist_ok=True)
        rows = []
        for path in synth_models(args.models, args.quick, args.only):
            rows += e2e_rows(path, contexts=(4096,), batches=(1, 4), n_pp=64)[1:]
            rows += engine_rows(path)
        print(f"\n{'decode, runner level (graph replay + greedy ids) and engine level':60s} {'tok/s':>9s}")
        for label, tps in rows:
            print(f"{label:60s} {tps:9.0f}")
        write_json(args.json, be, engine=rows)
        return 0
    if args.batched:
        os.makedirs(args.models, exist_ok=True)
        rows = []
        for path in synth_models(args.models, args.quick, args.only):
            rows += e2e_rows(path, contexts=contexts, batches=BATCHED, n_pp=64, rounds=3)[1:]   # 3: the spread
            rows += engine_rows(path, slots=(16, 32), rounds=1)
        title = f"decode of many sequences at {', '.join(map(ctx_label, contexts))} context (runner, then engine)"
        print(f"\n{title:88s} {'tok/s':>9s} {'llama.cpp':>10s}")
        for label, tps in rows:
            ref = BATCHED_REF.get(int(label.split(" batch ")[1].split()[0])) if "8b-layers-q4_k_m" in label and \
                " batch " in label else None
            print(f"{label:88s} {tps:9.0f} " + (f"{ref:10,d}" if ref else ""))
        write_json(args.json, be, batched=rows)
        return 0
    if args.verify_cost:
        os.makedirs(args.models, exist_ok=True)
        path = synth_models(args.models, True)[0]
        vrows = verify_cost_rows(cp, path)
        print(f"\n{'what more tokens a step cost':70s} {'us':>8s} {'dp4a us':>8s}")
        for label, us, dp in vrows:
            print(f"{label:70s} {us:8.1f} " + (f"{dp:8.1f}" if dp is not None else ""))
        write_json(args.json, be, verify_cost=vrows)
        return 0
    if args.attn_ab:
        print(f"\n{be.describe()}; copy bandwidth {copy_bw / 1e9:,.0f} GB/s (read + write)")
        arows = attn_ab_rows(cp)
        builds = list(arows[0][1])
        print(f"\n{'attention, us per launch (rounds)':44s} " + " ".join(f"{b:>18s}" for b in builds))
        for label, times, same in arows:
            print(f"{label:44s} " + " ".join(f"{'/'.join(f'{t:.1f}' for t in times[b]):>18s}" for b in builds)
                  + ("" if same else "  DIFFERENT BITS"))
        write_json(args.json, be, attn_ab=[(label, times, same) for label, times, same in arows])
        return 0
    if args.prefill_attn:
        print(f"\n{be.describe()}")
        arows = prefill_attention_rows(cp)
        modes = [m[0] for m in PREFILL_MODES]
        print(f"\n{'prompt attention, us per launch (rounds)':48s} " + " ".join(f"{m:>16s}" for m in modes)
              + f" {'looped/tiled':>12s} {'TFLOP/s':>8s}  max |out - tiled's| / max |tiled's|")
        for label, times, tflops, same, dev in arows:
            print(f"{label:48s} " + " ".join(f"{'/'.join(f'{t:.0f}' for t in times[m]):>16s}" for m in modes)
                  + f" {min(times['looped']) / min(times['tiled']):11.2f}x {tflops:8.1f}  "
                  + " ".join(f"{m} {d:.1e}" for m, d in dev.items()) + ("" if same else "  DIFFERENT BITS"))
        lrows = None
        if args.llamacpp_attn:
            lrows = llamacpp_attention_rows(args.llamacpp_attn)
            print_llamacpp_attention(arows, lrows)
        mrows = mixed_attention_rows(cp)
        print(f"\n{'mixed step attention, us per launch (rounds)':64s} {'decodes apart':>16s} {'one launch':>16s}")
        for label, apart, together, same in mrows:
            print(f"{label:64s} {'/'.join(f'{t:.0f}' for t in apart):>16s} {'/'.join(f'{t:.0f}' for t in together):>16s}"
                  + ("" if same else "  DIFFERENT BITS"))
        os.makedirs(args.models, exist_ok=True)
        prows = []
        for path in synth_models(args.models, args.quick, args.only):
            prows += prefill_rows(path)
        modes = [m for m, _, _ in PREFILL_FORWARD_MODES]
        print(f"\n{'prompt forward at depth (best of 2 rounds), tok/s':60s} " + " ".join(f"{m:>10s}" for m in modes)
              + f"   attention ms ({' / '.join(modes)})")
        for label, tps, attn in prows:
            print(f"{label:60s} " + " ".join(f"{tps[m]:10,.0f}" for m in modes)
                  + "   " + " / ".join(f"{attn[m]:.2f}" for m in modes))
        write_json(args.json, be, prefill_attention=arows, mixed_attention=mrows, prefill=prows,
                   llamacpp_attention=None if lrows is None else [(f"{n}, {d}", r) for (n, d), r in lrows.items()])
        return 0
    if args.pdl_ab:
        os.makedirs(args.models, exist_ok=True)
        brows = [step_breakdown(path, programmatic=p) for path in synth_models(args.models, args.quick, args.only)
                 for p in (False, True, False, True)]
        print_breakdown(brows)
        write_json(args.json, be, step_breakdown=brows)
        return 0
    krows = kernel_rows(cp, copy_bw)
    grows = gemm_rows(cp)
    os.makedirs(args.models, exist_ok=True)
    erows, brows = [], []
    for path in synth_models(args.models, args.quick, args.only):
        erows += e2e_rows(path)
        brows.append(step_breakdown(path))
        erows += engine_rows(path, rounds=1)
    print(f"\n{be.describe()}; copy bandwidth {copy_bw / 1e9:,.0f} GB/s (read + write)")
    print(f"{'kernel':48s} {'us':>9s} {'GB/s':>8s} {'of copy bw':>10s}")
    for label, us, gbs, frac in krows:
        print(f"{label:48s} {us:9.1f} {gbs:8.0f} {frac:9.0%}")
    print_gemm(grows)
    print(f"\n{'end to end (synthetic weights)':60s} {'tok/s':>9s}")
    for label, tps in erows:
        print(f"{label:60s} {tps:9.0f}")
    print_breakdown(brows)
    write_json(args.json, be, copy_bw=copy_bw, kernels=krows, gemm=grows, e2e=erows, step_breakdown=brows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
