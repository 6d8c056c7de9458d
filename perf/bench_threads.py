"""How a CPU decode token's cost scales with the thread count on this machine, and what a parallel region costs:
for each way of waiting between regions (each its own process: libgomp reads its settings once) and each thread
count (set in the process between timings, alternating over rounds):

- an empty parallel region (one `prange` iteration a thread, called from Python; ~0.3 µs of it is the call): the
  start and join that each of a decode block's ~5 regions pays;
- decode ms a token with one-call blocks and on the per-call path (perf/bench_decode_block.py's timing), on its
  cache-resident 24-block model (the fixed cost of a token) and on a model of the default model's shapes
  (`strata-lite synth --preset qwen2.5-0.5b`: random valid weights, the same types and bytes as the default
  model's file; or --model FILE);
- with --shared, the shared blocks (kernels/cpu/decode_block_shared.py) as well.

Waiting modes: `default` (what kernels/cpu/matvec.py sets: OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=10000),
`spin` (GOMP_SPINCOUNT=20000000), `passive` (OMP_WAIT_POLICY=PASSIVE alone: no spin, a futex wake-up a region),
`workqueue` (Numba's own thread pool instead of OpenMP).

    python perf/bench_threads.py [--threads 1,2,4,8,16] [--waits default,spin] [--rounds 3] [--model FILE]
                                 [--shared] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import numba
from numba import njit, prange

WAITS = {
    "default": {},
    "spin": {"GOMP_SPINCOUNT": "20000000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "workqueue": {"NUMBA_THREADING_LAYER": "workqueue"},
}
REGION_CALLS = 3000


@njit(parallel=True)
def _touch(out, n):
    for i in prange(n):
        out[i * 16] += 1.0              # a cache line per thread


def region_us(n_threads: int) -> float:
    """Median µs of an empty parallel region of n_threads (medians of 5 batches of REGION_CALLS calls)."""
    out = np.zeros(16 * 64, np.float64)
    numba.set_num_threads(n_threads)
    _touch(out, n_threads)
    batches = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(REGION_CALLS):
            _touch(out, n_threads)
        batches.append((time.perf_counter() - t) / REGION_CALLS * 1e6)
    return float(np.median(batches))


def child(a) -> dict:
    """One waiting mode: {threads: {region_us: [...], model label: {path: [ms ...]}}}."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_decode_block import START, N_TOK, decode_ms, shared_blocks
    from strata_lite import LLM

    threads = [int(t) for t in a.threads.split(",") if int(t) <= numba.config.NUMBA_NUM_THREADS]
    res = {"layer": None, "threads": {str(t): {"region_us": []} for t in threads}}
    llms = []
    for label, path in json.loads(a.models):
        llm = LLM(path, backend="cpu", n_ctx=START + N_TOK + 16, n_threads=max(threads))
        paths = {"one-call": [layer.compiled for layer in llm.model.layers],
                 "per-call": [None] * len(llm.model.layers)}
        if a.shared:
            paths["shared"] = shared_blocks(llm)
        llm.eval(list(range(1, START + 1)), 0, [START - 1])
        for blocks in paths.values():   # warm-up (compiles)
            decode_ms(llm, blocks)
        llms.append((label, llm, paths))
    res["layer"] = numba.threading_layer()
    for _ in range(a.rounds):
        for t in threads:
            row = res["threads"][str(t)]
            row["region_us"].append(region_us(t))
            for label, llm, paths in llms:
                numba.set_num_threads(t)
                for name, blocks in paths.items():
                    row.setdefault(label, {}).setdefault(name, []).append(decode_ms(llm, blocks))
    return res


def med(xs) -> str:
    return f"{np.median(xs):.2f} ({min(xs):.2f})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--waits", default="default,spin")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="a real model (default: a synthetic one of the default model's shapes)")
    ap.add_argument("--tiny", default=None, help=argparse.SUPPRESS)   # the cache-resident model's file (tests)
    ap.add_argument("--shared", action="store_true", help="time the shared blocks too")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--models", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return None
    waits = a.waits.split(",")
    unknown = [w for w in waits if w not in WAITS]
    if unknown:
        ap.error(f"--waits: unknown mode(s) {', '.join(unknown)} (known: {', '.join(WAITS)})")
    results = {}
    with tempfile.TemporaryDirectory() as d:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_decode_block import write_tiny
        models = [("24 blocks, cache-resident", a.tiny or str(write_tiny(Path(d) / "tiny24.gguf")))]
        if a.model:
            models.append((Path(a.model).name, a.model))
        else:
            from strata_lite.loader.synth import PRESETS, synth_model
            path = str(Path(d) / "q05.gguf")
            synth_model(path, PRESETS["qwen2.5-0.5b"], quant="q4_k_m")
            models.append(("0.5B shapes, Q4_K_M mix (synthetic)", path))
        names = ["one-call", "per-call"] + (["shared"] if a.shared else [])
        print(f"{os.cpu_count()} CPUs; {a.rounds} rounds; region µs and decode ms a token, median (min)")
        print("| waiting | threads | empty region µs | " + " | ".join(f"{m[0]}: {n}" for m in models for n in names)
              + " |")
        print("|---|---|---|" + "---|" * (len(models) * len(names)), flush=True)
        for w in waits:             # a mode's rows as soon as its process ends
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            env.update(WAITS[w])
            cmd = [sys.executable, __file__, "--child", w, "--threads", a.threads, "--rounds", str(a.rounds),
                   "--models", json.dumps(models)] + (["--shared"] if a.shared else [])
            t0 = time.perf_counter()
            out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
            r = results[w] = json.loads(out.strip().splitlines()[-1])
            for t, row in r["threads"].items():
                cells = [med(row[m[0]][n]) for m in models for n in names]
                print(f"| {w} | {t} | {med(row['region_us'])} | " + " | ".join(cells) + " |")
            print(f"({w}: {time.perf_counter() - t0:.0f} s, threading layer {r['layer']})", flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
