"""How close a CPU decode step comes to the machine's memory bandwidth: the matrices a one-token step reads,
class by class, against a plain read of the same bytes in the same process.

A decode step of a small model reads every weight matrix once (the output matrix included), so its floor is
bytes per token over the bandwidth a plain streaming read reaches on the same threads. For each class of
matrix (role, type, layout: e.g. the 24 fused gate/up matrices in Q5_0 with 4 rows interleaved) this times

- kernel: one token through every matrix of the class in turn (`CpuBackend.qmatmul`, the kernels a decode
  step runs);
- read: a parallel streaming read of the same buffers (an XOR reduction over their 64-bit words, split
  over the threads as the kernels split rows: the ceiling a kernel that does no arithmetic would reach);

each after a read of a `--flush-mb` buffer that evicts the caches (so both come from DRAM, as the weights of
a step whose matrices exceed the caches do), alternating, `--rounds` times; it prints GB/s of each (medians;
the best in brackets) and their ratio. Then the whole step: decode ms a token (greedy, one-call decoder
blocks, as `perf/bench_decode_block.py` times it) against a plain read of all those matrices in the step's
order, alternating with it (no flush: the caches hold what they hold in a step; on a CPU whose last-level
cache holds the model, that is the floor, not DRAM).

    python perf/bench_decode_bandwidth.py [--model FILE] [--threads 2] [--rounds 9] [--flush-mb 512]

Without --model: the default model (which must be installed). Figures: docs/cpu.md, "Decode against the
memory bandwidth".
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit, prange

# the matrices of a block a decode step multiplies, as models/transformer.py's _Layer names them (a fused
# matrix replaces its parts: the parts are None then)
BLOCK_MATRICES = ("qkv", "qk", "attn_q", "attn_k", "attn_v", "attn_output", "gate_up", "ffn_gate", "ffn_up",
                  "ffn_down")
N_TOK = 32          # greedy decodes a step timing
START = 16          # after a prompt of this many tokens


@njit(parallel=True, cache=True)
def _xor_read(words, n_chunks):
    """XOR of every 64-bit word of `words`, n_chunks contiguous chunks over the threads (the compiler
    vectorizes the loop: no arithmetic limits it)."""
    part = np.zeros(n_chunks, np.uint64)
    n = words.size // n_chunks
    for c in prange(n_chunks):
        chunk = words[c * n:words.size if c == n_chunks - 1 else (c + 1) * n]
        acc = np.uint64(0)
        for i in range(chunk.size):
            acc ^= chunk[i]
        part[c] = acc
    out = np.uint64(0)
    for c in range(n_chunks):
        out ^= part[c]
    return out


def _words(raw: np.ndarray) -> np.ndarray:
    """The buffer as 64-bit words (its whole 8-byte prefix; rows of packed blocks are not 8-byte multiples)."""
    flat = raw.reshape(-1)
    return flat[: flat.size // 8 * 8].view(np.uint64)


def matrix_classes(model) -> dict:
    """{(role, type name, layout): [PackedWeight, ...]} of every matrix a one-token decode step multiplies."""
    classes = {}
    for layer in model.layers:
        for role in BLOCK_MATRICES:
            w = getattr(layer, role, None)
            if w is not None:
                classes.setdefault((role, w.qtype.name, w.layout), []).append(w)
    classes.setdefault(("output", model.output.qtype.name, model.output.layout), []).append(model.output)
    return classes


def class_bandwidth(backend, weights, rounds: int, n_threads: int, flush: np.ndarray):
    """-> (kernel seconds list, read seconds list, bytes): one token through every matrix, and the plain read
    of the same buffers, alternating, each after a read of `flush` (uint64 words)."""
    xs = [np.random.default_rng(0).standard_normal((1, w.n_in)).astype(np.float32) for w in weights]
    outs = [np.empty((1, w.n_out), np.float32) for w in weights]
    words = [_words(w.raw) for w in weights]
    chunks = max(1, n_threads)

    def kernel():
        for w, x, o in zip(weights, xs, outs):
            backend.qmatmul(w, x, o)

    def read():
        for a in words:
            _xor_read(a, chunks)

    kernel(), read()                              # warm-up: compiles, and pages in mapped matrices
    tk, tr = [], []
    for _ in range(rounds):
        for f, times in ((kernel, tk), (read, tr)):
            _xor_read(flush, chunks)
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
    return tk, tr, sum(w.raw.nbytes for w in weights)


def step_against_read(llm, rounds: int, n_threads: int):
    """-> (ms a token of N_TOK greedy decodes from position START, ms of a plain read of every matrix of a step
    in the step's order), `rounds` of each, alternating."""
    words = [_words(w.raw) for ws in step_order(llm.model) for w in ws]
    llm.eval(list(range(1, START + 1)), 0, [START - 1])
    step, read = [], []
    for r in range(rounds + 1):                   # the first round: warm-up
        tok, t = 7, time.perf_counter()
        for i in range(N_TOK):
            tok = int(np.argmax(llm.eval([tok], START + i, [0])[0])) % 1000
        step.append((time.perf_counter() - t) / N_TOK * 1e3)
        t = time.perf_counter()
        for _ in range(N_TOK):
            for a in words:
                _xor_read(a, n_threads)
        read.append((time.perf_counter() - t) / N_TOK * 1e3)
    return step[1:], read[1:]


def step_order(model) -> list:
    """[[the matrices of block 0 in BLOCK_MATRICES order], ..., [output]]"""
    blocks = [[w for w in (getattr(layer, role, None) for role in BLOCK_MATRICES) if w is not None]
              for layer in model.layers]
    return blocks + [[model.output]]


def _gbs(nbytes, seconds):
    return nbytes / seconds / 1e9


def main(argv=None):
    """Prints the tables; returns {"classes": [dict(role, type, layout, count, bytes, kernel, read)], "step":
    dict(ms, bytes)}: seconds lists and byte counts."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--flush-mb", type=int, default=512, help="buffer read before each class timing (evicts caches)")
    a = ap.parse_args(argv)
    from strata_lite import LLM
    llm = LLM(a.model, backend="cpu", n_ctx=START + N_TOK + 8, n_threads=a.threads)
    backend = llm.model.backend
    n_threads = numba.get_num_threads()
    rows, total = [], 0
    flush = np.ones(a.flush_mb * (1 << 20) // 8, np.uint64)
    print(f"{n_threads} threads, {a.rounds} alternating rounds; GB/s, median (best)")
    print("| matrices | type, layout | count | MB | kernel GB/s | plain read GB/s | kernel / read |")
    print("|---|---|---|---|---|---|---|")
    for (role, qtype, layout), ws in matrix_classes(llm.model).items():
        tk, tr, nbytes = class_bandwidth(backend, ws, a.rounds, n_threads, flush)
        total += nbytes
        rows.append(dict(role=role, type=qtype, layout=layout, count=len(ws), bytes=nbytes, kernel=tk, read=tr))
        k, r = _gbs(nbytes, np.median(tk)), _gbs(nbytes, np.median(tr))
        print(f"| {role} | {qtype}, {layout} | {len(ws)} | {nbytes / 1e6:.1f} | {k:.1f} ({_gbs(nbytes, min(tk)):.1f}) | "
              f"{r:.1f} ({_gbs(nbytes, min(tr)):.1f}) | {k / r:.2f} |", flush=True)
    del flush
    ms, read = step_against_read(llm, a.rounds, n_threads)
    m, r = float(np.median(ms)), float(np.median(read))
    print(f"\nstep: {total / 1e6:.1f} MB of matrices a token; decode {m:.2f} ms a token (best {min(ms):.2f}) = "
          f"{_gbs(total, m / 1e3):.1f} GB/s; a plain read of those matrices in the step's order {r:.2f} ms "
          f"(best {min(read):.2f}) = {_gbs(total, r / 1e3):.1f} GB/s: the step takes {m / r:.2f}x that floor")
    return dict(classes=rows, step=dict(ms=ms, read_ms=read, bytes=total))


if __name__ == "__main__":
    main()
