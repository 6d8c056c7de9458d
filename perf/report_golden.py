"""Correctness figures of the default model against llama.cpp's golden data (tests/data/), printed as
one table for the README: argmax agreement, KL, max |dlogit|, greedy continuations, perplexity.

usage: python perf/report_golden.py [--threads 2]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from strata_lite import LLM
from strata_lite.perplexity import log_softmax, perplexity

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def logits_figures(llm, golden):
    agree = total = 0
    kls, worst = [], 0.0
    for inp in json.loads((DATA / "logits.json").read_text())["inputs"]:
        name = inp["name"]
        ids = golden[name + "__ids"].tolist()
        full = golden[name + "__logits_all"] if name + "__logits_all" in golden else golden[name + "__logits_last"][None]
        pos = np.arange(len(ids)) if len(full) == len(ids) else np.array([len(ids) - 1])
        top_pos = golden[name + "__topk_pos"] if name + "__topk_pos" in golden else np.zeros(0, int)
        want = np.union1d(pos, top_pos)
        ours = llm.eval(ids, 0, want)
        of = ours[np.searchsorted(want, pos)]
        lp, lq = log_softmax(full), log_softmax(of)
        kls += list((np.exp(lp) * (lp - lq)).sum(-1))
        worst = max(worst, float(np.abs(of - full).max()))
        agree += int((of.argmax(-1) == full.argmax(-1)).sum())
        total += len(full)
        if len(top_pos):
            ot = ours[np.searchsorted(want, top_pos)]
            tid = golden[name + "__topk_ids"].astype(np.int64)
            worst = max(worst, float(np.abs(np.take_along_axis(ot, tid, 1) - golden[name + "__topk_vals"]).max()))
            agree += int((ot.argmax(-1) == tid[:, 0]).sum())
            total += len(ot)
    return agree, total, float(np.mean(kls)), len(kls), worst


def greedy_figures(llm):
    equal = []
    for c in json.loads((DATA / "greedy.json").read_text())["cases"]:
        out = llm.generate(c["prompt_ids"], max_tokens=len(c["output_ids"]), temperature=0.0)
        ref, ours = c["output_ids"], out.token_ids
        same = next((i for i in range(min(len(ref), len(ours))) if ref[i] != ours[i]), min(len(ref), len(ours)))
        equal.append((c["name"], same, len(ref), c["top1_minus_top2_logit"][same] if same < len(ref) else None))
    return equal


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    llm = LLM(backend="cpu", n_ctx=2048, n_threads=args.threads)
    agree, total, kl, n_kl, worst = logits_figures(llm, np.load(DATA / "logits.npz"))
    greedy = greedy_figures(llm)
    ref_ppl = json.loads((DATA / "perplexity.json").read_text())["ppl"]
    ppl = perplexity(llm, (DATA / "heapq.py").read_text(encoding="utf-8"), ctx=512, progress=False).ppl
    print(f"| argmax equal to llama.cpp's | {agree}/{total} stored positions ({agree / total:.1%}) |")
    print(f"| mean KL(llama.cpp || ours), full-vocabulary positions | {kl:.5f} nats over {n_kl} positions |")
    print(f"| max abs dlogit | {worst:.3f} |")
    n32 = sum(1 for _, same, n, _ in greedy if same >= min(32, n))
    print(f"| greedy, first 32 tokens equal | {n32}/8 |")
    for name, same, n, margin in greedy:
        tail = "" if margin is None else f", then diverges (llama.cpp margin there {margin:.3f})"
        print(f"|   {name} | {same}/{n} leading tokens equal{tail} |")
    print(f"| perplexity, heapq.py, ctx 512 | {ppl:.4f} vs llama.cpp {ref_ppl} ({ppl / ref_ppl - 1:+.2%}) |")


if __name__ == "__main__":
    main()
