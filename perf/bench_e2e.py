"""End-to-end CPU speed of the default model: prompt (512 tokens) and decode (128 tokens) tok/s, with
peak RSS, side by side with llama.cpp when llama-cpp-python is installed (optional) and with ik_llama.cpp
when its llama-bench binary is given (--ik-bench PATH; build it yourself, it is not part of this project:
its pp512 / tg128 tests, once per --ik-flags set). Prints one table.

Each engine runs in its own child process with the caller's environment: strata_lite sets OpenMP
wait-policy variables for its Numba threads at import, and llama.cpp (built with OpenMP) would
inherit them in a shared process.

usage: python perf/bench_e2e.py [--model PATH] [--threads 2] [--runs 3]
           [--ik-bench PATH/llama-bench [--ik-flags "" --ik-flags "-rtr 1 -fa 0" ...]]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "heapq.py"
N_PP, N_TG = 512, 128


def bench_strata(model, threads, runs):
    from strata_lite import LLM
    llm = LLM(model, backend="cpu", n_ctx=N_PP + N_TG + 16, n_threads=threads)
    ids = llm.tokenize(TEXT.read_text(encoding="utf-8"), add_special=False)[:N_PP]

    def pp():
        t = time.perf_counter()
        llm.eval(ids, 0, [N_PP - 1])
        return N_PP / (time.perf_counter() - t)

    def tg():
        tok, t = ids[0], time.perf_counter()
        for i in range(N_TG):
            tok = int(np.argmax(llm.eval([tok], i, [0])[0]))
        return N_TG / (time.perf_counter() - t)

    pp(), tg()   # warm-up: JIT compile, page in the weights
    return [pp() for _ in range(runs)], [tg() for _ in range(runs)], llm.model_path


def bench_llamacpp(model, threads, runs):
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model, n_ctx=N_PP + N_TG + 16, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, logits_all=False, verbose=False)
    ids = llm.tokenize(TEXT.read_text(encoding="utf-8").encode(), add_bos=False, special=False)[:N_PP]

    def pp():
        llm.reset()
        llm._ctx.kv_cache_clear()
        t = time.perf_counter()
        llm.eval(ids)
        return N_PP / (time.perf_counter() - t)

    def tg():
        llm.reset()
        llm._ctx.kv_cache_clear()
        tok, t = ids[0], time.perf_counter()
        for _ in range(N_TG):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return N_TG / (time.perf_counter() - t)

    pp(), tg()
    return [pp() for _ in range(runs)], [tg() for _ in range(runs)]


def bench_ik(binary, model, threads, runs, flags: str):
    """ik_llama.cpp's llama-bench pp512 / tg128 (its own timing, runs repetitions): (pp samples, tg samples)."""
    cmd = [binary, "-m", str(model), "-p", str(N_PP), "-n", str(N_TG), "-t", str(threads), "-r", str(runs),
           "-o", "json", *flags.split()]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    rows = json.loads(out[out.index("["):])
    pp = next(r["samples_ts"] for r in rows if r["n_prompt"] == N_PP and r["n_gen"] == 0)
    tg = next(r["samples_ts"] for r in rows if r["n_gen"] == N_TG and r["n_prompt"] == 0)
    return pp, tg


def _child(engine, model, threads, runs):
    """Run one engine in this process and print its result as one JSON line."""
    if engine == "strata":
        pp, tg, path = bench_strata(model, threads, runs)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"pp": pp, "tg": tg, "path": str(path), "rss": rss}))
    else:
        res = bench_llamacpp(model, threads, runs)
        print(json.dumps(None if res is None else {"pp": res[0], "tg": res[1]}))


def _run_child(engine, model, threads, runs):
    cmd = [sys.executable, __file__, "--child", engine, "--threads", str(threads), "--runs", str(runs)]
    if model:
        cmd += ["--model", str(model)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ik-bench", default=None, help="ik_llama.cpp's llama-bench binary (optional column)")
    ap.add_argument("--ik-flags", action="append", default=None,
                    help="extra llama-bench flags for ik_llama.cpp, one row per use (default: none)")
    ap.add_argument("--child", choices=["strata", "llamacpp"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.model, args.threads, args.runs)
        return 0
    ours = _run_child("strata", args.model, args.threads, args.runs)
    ref = _run_child("llamacpp", ours["path"], args.threads, args.runs)
    med = statistics.median
    print(f"\nmodel {os.path.basename(ours['path'])}, {args.threads} threads, median of {args.runs} runs")
    print(f"{'engine':<12}{'prompt 512 tok/s':>18}{'decode 128 tok/s':>18}")
    print(f"{'strata_lite':<12}{med(ours['pp']):>18.1f}{med(ours['tg']):>18.1f}   peak RSS {ours['rss']:,.0f} MiB")
    if ref:
        print(f"{'llama.cpp':<12}{med(ref['pp']):>18.1f}{med(ref['tg']):>18.1f}")
        print(f"{'ratio':<12}{med(ours['pp']) / med(ref['pp']):>18.2f}{med(ours['tg']) / med(ref['tg']):>18.2f}")
    else:
        print("llama.cpp: not measured (pip install llama-cpp-python for this column)")
    for flags in (args.ik_flags or [""]) if args.ik_bench else []:
        pp, tg = bench_ik(args.ik_bench, ours["path"], args.threads, args.runs, flags)
        label = "ik_llama" + (f" {flags}" if flags else "")
        print(f"{label:<12}{med(pp):>18.1f}{med(tg):>18.1f}")
        print(f"{'ratio':<12}{med(ours['pp']) / med(pp):>18.2f}{med(ours['tg']) / med(tg):>18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
