"""End-to-end CPU speed of the default model: prompt (512 tokens) and decode (128 tokens) tok/s, with
peak RSS, side by side with llama.cpp when llama-cpp-python is installed (optional) and with ik_llama.cpp
when its llama-bench binary is given (--ik-bench PATH; build it yourself, it is not part of this project:
its pp512 / tg128 tests, once per --ik-flags set). Prints one table.

Each engine runs in its own child process with the caller's environment: strata_lite sets OpenMP
wait-policy variables for its Numba threads at import, and llama.cpp (built with OpenMP) would
inherit them in a shared process.

With --rounds R (default 1) the engines take turns R times (strata_lite, llama.cpp, ik_llama.cpp per flags set,
each --runs runs a turn): on a shared machine whose memory bandwidth drifts over minutes (the development VM's
moves by up to 30%), every engine then sees each stretch of it. The table gives medians over all samples, and
each ratio's range over the rounds (one ratio per round: the two engines' medians in that round).

usage: python perf/bench_e2e.py [--model PATH] [--threads 2] [--runs 3] [--rounds 1]
           [--ik-bench PATH/llama-bench [--ik-flags "" --ik-flags "-rtr 1 -fa 0" ...]]
       python perf/bench_e2e.py --model PATH --vs-q8-0-repack 4
           strata_lite only: Q4_0 / Q5_0 / IQ4_NL matrices in their own blocks (the default on AVX2) against
           the same matrices repacked to Q8_0 blocks at load (the layout before 2026-12-01), both in one
           process, 4 alternating rounds, medians; `--child strata-q8_0 --model PATH` alone gives the
           repacked layout's peak RSS
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


def _force_q8_0_repack():
    """Make the CPU backend repack Q4_0 / Q5_0 / IQ4_NL to Q8_0 blocks for the int8 kernel (the layout their
    own-block kernels replaced; the same bits), for --vs-q8-0-repack."""
    from gguf import GGMLQuantizationType as QType
    from strata_lite.kernels.cpu import backend as cpu_backend, repack as rp
    own_blocks = cpu_backend.pack_weight

    def pack_weight(w, repack=True, release_source=True, int8=False, **kw):
        if not (int8 and repack and not isinstance(w, rp.PackedWeight) and int(w.qtype) in rp.REPACK_TO_Q8_0):
            return own_blocks(w, repack=repack, release_source=release_source, int8=int8, **kw)
        packed = rp.repack_to_q8_0(QType(int(w.qtype)), w.raw, w.n_in)
        if release_source:
            rp.release_pages(w.raw)
        return rp.PackedWeight(w.name, QType.Q8_0, w.n_out, w.n_in, packed, src_qtype=w.qtype, int8=True)
    cpu_backend.pack_weight = pack_weight


def bench_strata(model, threads, runs, q8_0_repack=False):
    from strata_lite import LLM
    if q8_0_repack:
        _force_q8_0_repack()
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
    if engine in ("strata", "strata-q8_0"):
        pp, tg, path = bench_strata(model, threads, runs, q8_0_repack=engine == "strata-q8_0")
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
    ap.add_argument("--rounds", type=int, default=1, help="turns of every engine, taken in alternation (default 1)")
    ap.add_argument("--ik-bench", default=None, help="ik_llama.cpp's llama-bench binary (optional column)")
    ap.add_argument("--ik-flags", action="append", default=None,
                    help="extra llama-bench flags for ik_llama.cpp, one row per use (default: none)")
    ap.add_argument("--vs-q8-0-repack", type=int, default=0, metavar="N",
                    help="strata_lite only: own-block Q4_0/Q5_0/IQ4_NL against their Q8_0 repacking, N "
                         "alternating rounds in one process")
    ap.add_argument("--child", choices=["strata", "strata-q8_0", "llamacpp"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.model, args.threads, args.runs)
        return 0
    if args.vs_q8_0_repack:
        return _vs_q8_0_repack(args.model, args.threads, args.vs_q8_0_repack)
    ik_sets = (args.ik_flags or [""]) if args.ik_bench else []
    rounds = []            # per round: {engine label: (pp samples, tg samples)}
    path, rss = None, 0.0
    for _ in range(max(1, args.rounds)):
        r = {}
        ours = _run_child("strata", args.model, args.threads, args.runs)
        path, rss = ours["path"], max(rss, ours["rss"])
        r["strata_lite"] = (ours["pp"], ours["tg"])
        ref = _run_child("llamacpp", path, args.threads, args.runs)
        if ref:
            r["llama.cpp"] = (ref["pp"], ref["tg"])
        for flags in ik_sets:
            r["ik_llama" + (f" {flags}" if flags else "")] = bench_ik(args.ik_bench, path, args.threads, args.runs,
                                                                      flags)
        rounds.append(r)
    _print_table(rounds, os.path.basename(path), args.threads, args.runs, rss)
    return 0


def _print_table(rounds, name, threads, runs, rss):
    """Medians over every round's samples; each other engine's ratio (strata_lite / it) as the median of all
    samples and, with several rounds, the range of the per-round ratios."""
    med = statistics.median

    def pooled(label, i):
        return med([v for r in rounds for v in r[label][i]])

    n = len(rounds)
    print(f"\nmodel {name}, {threads} threads, median of {runs * n} runs"
          + (f" ({n} rounds of {runs}, the engines in turn)" if n > 1 else ""))
    print(f"{'engine':<12}{'prompt 512 tok/s':>18}{'decode 128 tok/s':>18}")
    print(f"{'strata_lite':<12}{pooled('strata_lite', 0):>18.1f}{pooled('strata_lite', 1):>18.1f}"
          f"   peak RSS {rss:,.0f} MiB")
    if "llama.cpp" not in rounds[0]:
        print("llama.cpp: not measured (pip install llama-cpp-python for this column)")
    for label in [k for k in rounds[0] if k != "strata_lite"]:
        print(f"{label:<12}{pooled(label, 0):>18.1f}{pooled(label, 1):>18.1f}")
        ratio = [pooled("strata_lite", i) / pooled(label, i) for i in (0, 1)]
        line = f"{'ratio':<12}{ratio[0]:>18.2f}{ratio[1]:>18.2f}"
        if n > 1:
            per = [[med(r["strata_lite"][i]) / med(r[label][i]) for r in rounds] for i in (0, 1)]
            line += f"   per round {min(per[0]):.2f}-{max(per[0]):.2f} / {min(per[1]):.2f}-{max(per[1]):.2f}"
        print(line)


def _vs_q8_0_repack(model, threads, rounds):
    """One process holding the model twice, own blocks and Q8_0 repacking, prompt + decode on each in
    alternating order for `rounds` rounds (on a loaded machine separate processes minutes apart differ
    by more than the layouts do). Prints the table and whether the prompt logits are bit-identical (they are
    where every such matrix keeps its own blocks; matrices of 4k rows are interleaved by 4 rows, whose kernels sum
    in another float order than the Q8_0 blocks' kernel)."""
    from strata_lite import LLM
    from strata_lite.kernels.cpu import backend as cpu_backend
    own_blocks = cpu_backend.pack_weight
    llms = {"own blocks": LLM(model, backend="cpu", n_ctx=N_PP + N_TG + 16, n_threads=threads)}
    _force_q8_0_repack()
    llms["Q8_0 repacking"] = LLM(model, backend="cpu", n_ctx=N_PP + N_TG + 16, n_threads=threads)
    cpu_backend.pack_weight = own_blocks
    ids = llms["own blocks"].tokenize(TEXT.read_text(encoding="utf-8"), add_special=False)[:N_PP]

    def pp(llm):
        t = time.perf_counter()
        logits = llm.eval(ids, 0, [N_PP - 1])
        return N_PP / (time.perf_counter() - t), logits

    def tg(llm):
        tok, t = ids[0], time.perf_counter()
        for i in range(N_TG):
            tok = int(np.argmax(llm.eval([tok], i, [0])[0]))
        return N_TG / (time.perf_counter() - t)

    first = [pp(llm)[1] for llm in llms.values()]
    [tg(llm) for llm in llms.values()]
    res = {k: ([], []) for k in llms}
    for r in range(rounds):
        for k in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            res[k][0].append(pp(llms[k])[0])
            res[k][1].append(tg(llms[k]))
    med = statistics.median
    print(f"\nmodel {os.path.basename(str(model))}, {threads} threads, one process, {rounds} alternating rounds, "
          f"medians; prompt logits bit-identical: {np.array_equal(first[0], first[1])}")
    print(f"{'layout':<18}{'prompt 512 tok/s':>18}{'decode 128 tok/s':>18}")
    for k, (p, g) in res.items():
        print(f"{k:<18}{med(p):>18.1f}{med(g):>18.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
