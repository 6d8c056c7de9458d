"""MTP drafts against suffix drafts at fixed widths k = 1..4: first-draft acceptance, mean accepted length,
drafted tokens per step and decode tok/s on held-out code prompts and on chat prompts.

For a model (default: the default model) and an MTP sidecar (--mtp, from `strata-lite train-mtp`; default:
the model's own block or the one shipped for the default model), on the CPU
backend (--backend cuda: the GPU), greedy, one request at a time: every prompt is answered (up to --max-tokens tokens) by an engine
with `--spec off`, then by one with `--spec mtp:K` (the block drafts exactly up to K tokens every step) and one
with `--spec K` (the suffix index drafts up to K tokens whenever it has them) for each K. Every mode must
generate the same tokens as off (greedy; the script fails if one does not), so only the drafting differs.

Text kinds:
  code - the held-out coding prompts of train-mtp (mtp_train_prompts.prompts() split by
         mtp_train_data.split_held_out: every prompt whose CRC32 is 0 mod 10; a prompt's own CRC decides, so
         these are never trained on whatever `--answers N` the sidecar was made with)
  chat - everyday non-code questions written for this script (CHAT below)

Per kind and mode, from the controller's observe() calls (bench_spec.DraftLog; checked against
SpecController.by_source): a "step" is a decode step of a request that verified a draft
  first-acc   share of steps whose first drafted token was accepted
  acc/step    accepted drafted tokens per step (the mean accepted length)
  draft/step  drafted tokens per step
  tok/fwd     generated tokens per decode forward (1 + accepted per step; steps without a draft count as 1)
  tok/s       decode tok/s from each request's first token on (all requests of the kind together)

With --rounds R every mode answers every prompt R times, the modes taking turns (their order reversed every other
round), and the figures pool the rounds, with the range of each mode's per-round tok/s ratio to off: on a machine
whose memory bandwidth drifts over minutes (the development VM's), modes run one after another otherwise meet
different stretches of it.

usage: python perf/eval_mtp.py [--mtp M.mtp.gguf] [--model M] [--backend cpu|cuda] [--threads 2]
           [--max-tokens 128] [--code 6] [--chat 6] [--ks 1,2,3,4] [--suffix-ks 1,2,3,4] [--rounds 1]
           [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench_spec import DraftLog, Run, encode

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.mtp_train_data import split_held_out
from strata_lite.mtp_train_prompts import prompts as train_prompts

CHAT = (
    "What are some good ways to keep a basil plant alive on a windowsill?",
    "How should I prepare for a job interview next week?",
    "Can you explain why the sky looks blue during the day and red at sunset?",
    "I have chicken, rice, an onion and some spinach. What could I cook for dinner tonight?",
    "What is the difference between weather and climate?",
    "Give me a few tips for sleeping better when I am stressed.",
    "How do I politely decline an invitation to a friend's party?",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Why do cats purr, and does it always mean they are happy?",
    "How can I save money on groceries without eating badly?",
    "What are the main causes of the French Revolution, in short?",
    "Suggest a simple weekly exercise plan for someone who sits at a desk all day.",
)


def held_out_code(n: int) -> list[str]:
    """The first n held-out coding prompts of train-mtp, in its (CRC32) order."""
    return split_held_out(train_prompts(), str)[1][:n]


def run_mode(args, spec, texts: dict[str, list[str]]) -> dict:
    """Answer every prompt with one engine in drafting mode spec -> {kind: [per-prompt dict]}."""
    eng = Engine(EngineConfig(model=args.model, backend=args.backend, n_ctx=args.n_ctx, parallel=1, step_tokens=256,
                              threads=args.threads, spec=spec, host_kv_gib=0.25,
                              mtp=args.mtp if str(spec).startswith("mtp") else None))
    eng.start()
    if not eng.wait_ready(900):
        raise SystemExit(f"spec {spec}: the engine did not get ready")
    log = DraftLog(eng) if eng._spec.enabled else None
    out = {}
    try:
        for kind, items in texts.items():
            out[kind] = []
            for i, text in enumerate(items):
                prompt = encode(eng, [{"role": "user", "content": text}])
                r = Run(eng, f"{kind}-{i}", prompt, args.max_tokens).join()
                out[kind].append(dict(tokens=r.tokens, times=r.times,
                                      outcomes=log.by_id.get(r.rid, []) if log else []))
        if log:                          # DraftLog's record against the controller's own totals
            want = {s: dict(drafted=0, accepted=0) for s in ("suffix", "mtp")}
            want["mtp" if str(spec).startswith("mtp") else "suffix"] = dict(
                drafted=sum(d for o in log.by_id.values() for d, _ in o),
                accepted=sum(a for o in log.by_id.values() for _, a in o))
            if eng._spec.by_source != want:
                raise SystemExit(f"spec {spec}: the controller counted {eng._spec.by_source}, the log {want}")
    finally:
        eng.stop()
    return out


def summary(runs: list[dict]) -> dict:
    """Per-kind figures over its requests (module docstring)."""
    outcomes = [o for r in runs for o in r["outcomes"]]
    steps = len(outcomes)
    drafted, accepted = sum(d for d, _ in outcomes), sum(a for _, a in outcomes)
    n_decode = sum(max(len(r["tokens"]) - 1, 0) for r in runs)            # tokens after each first one
    span = sum(r["times"][-1] - r["times"][0] for r in runs if len(r["times"]) > 1)
    return dict(steps=steps, drafted=drafted, accepted=accepted, tokens=n_decode + len(runs),
                first_acc=sum(a > 0 for _, a in outcomes) / steps if steps else None,
                acc_per_step=accepted / steps if steps else None, draft_per_step=drafted / steps if steps else None,
                tok_per_fwd=n_decode / (n_decode - accepted) if n_decode > accepted else None,
                tok_s=n_decode / span if span > 0 else 0.0)


def check_same(off: dict, got: dict, spec) -> None:
    """Greedy: every mode's tokens equal off's; otherwise stop here, naming the first difference."""
    for kind, runs in off.items():
        for i, (a, b) in enumerate(zip(runs, got[kind])):
            if a["tokens"] != b["tokens"]:
                at = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                          min(len(a["tokens"]), len(b["tokens"])))
                raise SystemExit(f"FAIL: spec {spec} generated other tokens than off for {kind} prompt {i} from "
                                 f"token {at} on ({len(b['tokens'])} vs {len(a['tokens'])} tokens): drafting "
                                 f"changed greedy output")


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path or known model key (default: the default model)")
    ap.add_argument("--mtp", default=None, help="sidecar GGUF with the model's MTP block (strata-lite train-mtp); "
                                                "default: the model's own, or the one shipped for the default model")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (default 128)")
    ap.add_argument("--code", type=int, default=6, help="held-out code prompts (default 6)")
    ap.add_argument("--chat", type=int, default=6, help=f"chat prompts, at most {len(CHAT)} (default 6)")
    ap.add_argument("--ks", default="1,2,3,4", help="fixed MTP draft widths to measure (default 1,2,3,4)")
    ap.add_argument("--suffix-ks", default=None, help="fixed suffix draft widths (default: --ks; '' for none)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1, help="turns of every mode, taken in alternation (default 1)")
    ap.add_argument("--json", default=None, help="write the figures (and per-prompt outcomes) here")
    ap.add_argument("--two-token-one-row-max", type=int, default=None,
                    help="cuda: 2-token mat-muls over at most this many rows take one row a warp (qmatmul."
                         "TWO_TOKEN_ONE_ROW_MAX_ROWS; 0: never), for A/B runs of a verified draft token's cost")
    args = ap.parse_args()
    if args.two_token_one_row_max is not None:
        if args.backend != "cuda":
            ap.error("--two-token-one-row-max chooses CUDA kernels: it needs --backend cuda")
        from strata_lite.kernels.cuda import qmatmul
        qmatmul.TWO_TOKEN_ONE_ROW_MAX_ROWS = args.two_token_one_row_max
    ks = [int(k) for k in args.ks.split(",")]
    sks = ks if args.suffix_ks is None else [int(k) for k in args.suffix_ks.split(",") if k]
    texts = {"code": held_out_code(args.code), "chat": list(CHAT[:args.chat])}
    modes = ["off"] + [f"mtp:{k}" for k in ks] + sks
    t0, rounds = time.perf_counter(), []
    for r in range(max(1, args.rounds)):
        got = {}
        for spec in (modes if r % 2 == 0 else modes[::-1]):
            t = time.perf_counter()
            got[str(spec)] = run_mode(args, spec, texts)
            print(f"round {r}, spec {spec}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        for spec in modes:
            check_same(rounds[0]["off"] if rounds else got["off"], got[str(spec)], spec)
        rounds.append(got)
    res = {str(m): {kind: [run for g in rounds for run in g[str(m)][kind]] for kind in texts} for m in modes}
    figs = {str(m): {kind: summary(runs) for kind, runs in res[str(m)].items()} for m in modes}

    def per_round(m, kind) -> str:
        """The range of mode m's tok/s ratio to off over the rounds ('' with one round)."""
        if len(rounds) < 2 or not figs["off"][kind]["tok_s"]:
            return ""
        ratio = [summary(g[m][kind])["tok_s"] / max(summary(g["off"][kind])["tok_s"], 1e-9) for g in rounds]
        return f"  per round {min(ratio):.2f}-{max(ratio):.2f}x"
    block = Path(args.mtp).name if args.mtp else "shipped/own"
    print(f"\nMTP vs suffix drafts at fixed widths: {args.model or 'default model'}, MTP {block}; "
          f"{args.backend} backend, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), threads "
          f"{args.threads or 'all'}; greedy, 1 slot, max_tokens {args.max_tokens}; "
          + ", ".join(f"{len(v)} {k} prompts ({figs['off'][k]['tokens'] // len(rounds)} tokens)"
                      for k, v in texts.items())
          + (f"; {len(rounds)} rounds, the modes in turn" if len(rounds) > 1 else "")
          + f"; every mode generated the same tokens as off; {time.perf_counter() - t0:.0f} s in all")
    print(f"{'kind':<5} {'drafter':<7} {'K':>2} {'first-acc':>9} {'acc/step':>8} {'draft/step':>10} {'steps':>5} "
          f"{'tok/fwd':>7} {'tok/s':>6} {'vs off':>6}")
    for kind in texts:
        base = figs["off"][kind]["tok_s"]
        print(f"{kind:<5} {'off':<7} {'-':>2} {'-':>9} {'-':>8} {'-':>10} {0:>5} {1:>7.2f} {base:>6.1f} {1:>5.2f}x")
        for src, widths in (("mtp", ks), ("suffix", sks)):
            for k in widths:
                f = figs[f"mtp:{k}" if src == "mtp" else str(k)][kind]
                print(f"{kind:<5} {src:<7} {k:>2} {_f(f['first_acc'], '>9.1%')} {_f(f['acc_per_step'], '>8.2f')} "
                      f"{_f(f['draft_per_step'], '>10.2f')} {f['steps']:>5} {_f(f['tok_per_fwd'], '>7.2f')} "
                      f"{f['tok_s']:>6.1f} {f['tok_s'] / base if base else 0:>5.2f}x"
                      + per_round(f"mtp:{k}" if src == "mtp" else str(k), kind))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            settings=dict(model=args.model, mtp=args.mtp, backend=args.backend, threads=args.threads,
                          rounds=len(rounds),
                          two_token_one_row_max=args.two_token_one_row_max,
                          max_tokens=args.max_tokens, ks=ks, suffix_ks=sks, cores=os.cpu_count()),
            prompts=texts, figures=figs,
            outcomes={m: {k: [r["outcomes"] for r in runs] for k, runs in r_m.items()} for m, r_m in res.items()}),
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
