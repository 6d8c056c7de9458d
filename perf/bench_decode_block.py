"""The fixed cost of a decode token on the CPU, and what the one-call decoder block (kernels/cpu/decode_block.py)
saves: decode ms a token with every block in one compiled call, with the work-sharing form of it
(kernels/cpu/decode_block_shared.py: one parallel region a block) and on the per-call path, alternating in one
process (the VM's speed moves between runs; alternation cancels most of it), on

- a model of the default model's block count whose weights stay in cache (`strata-lite synth`'s qwen2 layout,
  24 blocks of 256 / 512, vocabulary 2,048, Q4_K_M mix, 9 MB): what is left is the per-token cost of the
  calls themselves, not of reading weights;
- --model FILE (default: the default model, from its installed package): a real step.

--ik-bench PATH (ik_llama.cpp's llama-bench) adds its tg128 on each file, `-rtr 1 -fa 0`: on the
cache-resident one, the fixed cost of a token in the fastest CPU engine.

    python perf/bench_decode_block.py [--model FILE] [--threads 2] [--rounds 5] [--ik-bench PATH] [--busy N]

--busy N runs N busy-looping processes during the timings (a machine with more busy threads than cores).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TINY = dict(name="qwen2-24x256", arch="qwen2", n_layers=24, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2,
            head_dim=64, n_vocab=2048, rope_freq_base=1e6, rms_eps=1e-6, n_ctx_train=4096)
N_TOK = 64          # decode tokens a timing
START = 32          # after a prompt of this many tokens


def write_tiny(path: Path) -> Path:
    from strata_lite.loader.synth import Preset, synth_model
    synth_model(str(path), Preset(**TINY), quant="q4_k_m")
    return path


def decode_ms(llm, blocks) -> float:
    """ms a token over N_TOK greedy decodes from position START with these blocks (None: the per-call path)."""
    for layer, block in zip(llm.model.layers, blocks):
        layer.compiled = block
    tok, t = 7, time.perf_counter()
    for i in range(N_TOK):
        tok = int(np.argmax(llm.eval([tok], START + i, [0])[0])) % 2000
    return (time.perf_counter() - t) / N_TOK * 1e3


def shared_blocks(llm):
    """decode_block_shared.py's blocks for the model's layers, asked of the backend as the model asks it for its
    blocks (models/transformer.py _Layer.compile) with STRATA_LITE_DECODE_BLOCK=shared; the layers keep theirs."""
    import os
    from unittest import mock
    blocks = []
    with mock.patch.dict(os.environ, {"STRATA_LITE_DECODE_BLOCK": "shared"}):
        for layer in llm.model.layers:
            own = layer.compiled
            layer.compile(llm.model.backend, llm.model.cfg)
            blocks.append(layer.compiled)
            layer.compiled = own
    return blocks


def bench(model: str, threads: int, rounds: int):
    """-> (one-call ms, shared ms, per-call ms) lists of `rounds` timings each, blocks taken, blocks."""
    from strata_lite import LLM
    llm = LLM(model, backend="cpu", n_ctx=START + N_TOK + 16, n_threads=threads)
    blocks = [layer.compiled for layer in llm.model.layers]
    shared, none = shared_blocks(llm), [None] * len(blocks)
    taken = sum(b is not None for b in blocks)
    llm.eval(list(range(1, START + 1)), 0, [START - 1])
    for b in (blocks, shared, none):           # warm-up (compiles)
        decode_ms(llm, b)
    on, sh, off = [], [], []
    for _ in range(rounds):
        on.append(decode_ms(llm, blocks))
        sh.append(decode_ms(llm, shared))
        off.append(decode_ms(llm, none))
    return on, sh, off, taken, len(blocks)


@contextlib.contextmanager
def busy_processes(n: int):
    """n processes that loop without end while the block runs (other work on the machine)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def ik_tg(binary: str, model: str, threads: int) -> float:
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", "0", "-n", "128", "-r", "5",
                          "-rtr", "1", "-fa", "0", "-o", "json"], check=True, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True).stdout
    rows = json.loads(out[out.index("["):])
    return 1e3 / float(np.median(rows[0]["samples_ts"]))


def main(argv=None):
    """Prints the table; returns its rows as dicts (model, on / shared / off ms lists, blocks taken / all)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a real model as well (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ik-bench", default=None, help="ik_llama.cpp's llama-bench binary (optional)")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes running during the timings")
    a = ap.parse_args(argv)
    models, rows = [], []
    with tempfile.TemporaryDirectory() as d:
        tiny = str(write_tiny(Path(d) / "tiny24.gguf"))
        models.append(("24 blocks, cache-resident (9 MB)", tiny))
        real = a.model
        if real is None:
            from strata_lite.loader.known_models import ModelNotInstalled, resolve_model
            try:
                real = resolve_model(None)
            except ModelNotInstalled as e:
                print(f"(the default model is not installed, its row left out: {e})")
        if real:
            models.append((Path(real).name, real))
        print(f"{a.threads} threads, {a.rounds} alternating rounds of {N_TOK} decodes from position {START}; "
              "ms a token, median (min)")
        print("| model | one-call blocks | shared blocks | per-call | saved (one-call) | blocks taken |"
              + (" ik_llama.cpp tg128 |" if a.ik_bench else ""))
        print("|---|---|---|---|---|---|" + ("---|" if a.ik_bench else ""))
        for label, path in models:
            with busy_processes(a.busy):
                on, sh, off, taken, n = bench(path, a.threads, a.rounds)
            rows.append(dict(model=label, on=on, shared=sh, off=off, taken=taken, blocks=n))
            ik = f" {ik_tg(a.ik_bench, path, a.threads):.2f} |" if a.ik_bench else ""
            print(f"| {label} | {np.median(on):.2f} ({min(on):.2f}) | {np.median(sh):.2f} ({min(sh):.2f}) | "
                  f"{np.median(off):.2f} ({min(off):.2f}) | "
                  f"{np.median(off) - np.median(on):.2f} ms ({np.median(off) / np.median(on):.2f}x) | {taken} / {n} |"
                  + ik, flush=True)
    return rows


if __name__ == "__main__":
    main()
