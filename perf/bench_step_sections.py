"""Where a decode step's time goes with several requests: the engine thread's sections per decode-only step, by
drafting mode.

Each mode (--specs) runs in an engine of its own with --slots slots; --slots held-out coding prompts of
perf/eval_mtp.py (kind "code") or its chat prompts ("chat") are submitted together and answered greedily (up to
--max-tokens tokens). While they run, the engine's sections are timed by wrappers (wall clock): planning
(Scheduler.plan_step, of it the MTP chain: MtpDrafter.propose), the forward's host part (ModelRunner.forward:
on a backend that queues work, its launch), sampling (which waits for the device), completing the step
(Scheduler.complete_step, of it the MTP block's fill), the bookkeeping after it and handing tokens out. Only
steps that read no prompt tokens count (prompt reads are another cost). Printed per kind and mode: decode steps,
µs a step, tokens a step, each section's µs a step, the requests' decode tok/s summed, drafted / accepted tokens,
and how many sequences the steps decoded (the commonest (sequences, tokens) pairs).

usage: python perf/bench_step_sections.py [--model M] [--mtp SIDECAR] [--backend cpu|cuda] [--slots 4]
           [--max-tokens 128] [--specs off,mtp:1,mtp] [--kinds code,chat] [--threads N]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec import DraftLog, Run, encode  # noqa: E402  (perf/ is not a package)
from eval_mtp import CHAT, held_out_code  # noqa: E402

SECTIONS = ("plan", "chain", "forward", "sample", "complete", "fill", "after", "hand_out")


class SectionClock:
    """Wall-clock seconds of the engine's sections, summed over the decode-only steps."""

    def __init__(self, eng):
        self.eng, self.live = eng, collections.Counter()
        self.total, self.steps, self.tokens = collections.Counter(), 0, 0
        self.shapes = collections.Counter()        # (sequences decoding, tokens) -> steps
        self.plan = None
        sched, runner = eng._sched, eng._runner
        self._wrap(sched, "plan_step", "plan", keep=True)
        self._wrap(runner, "forward", "forward")
        self._wrap(eng, "_sample_step", "sample")
        self._wrap(sched, "complete_step", "complete")
        self._wrap(eng, "_after_step", "after")
        self._wrap(eng, "_hand_out", "hand_out")
        if runner.mtp is not None:
            self._wrap(runner.mtp, "propose", "chain")
            self._wrap(sched, "kv_filler", "fill")       # the scheduler holds MtpDrafter.fill as its hook
        step = eng._step

        def timed_step():
            self.live.clear()
            self.plan = None
            t = time.perf_counter()
            try:
                return step()
            finally:
                p = self.plan
                if p is not None and p.n_read == 0:
                    self.total["step"] += time.perf_counter() - t
                    self.total.update(self.live)
                    self.steps += 1
                    self.tokens += p.n_tokens_total
                    self.shapes[p.n_decode, p.n_tokens_total] += 1
        eng._step = timed_step

    def _wrap(self, obj, name, key, keep=False):
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                out = f(*a, **k)
                if keep:
                    self.plan = out
                return out
            finally:
                self.live[key] += time.perf_counter() - t
        setattr(obj, name, timed)

    def per_step_us(self) -> dict:
        n = max(self.steps, 1)
        return {k: 1e6 * self.total[k] / n for k in ("step",) + SECTIONS}


def run(args, spec: str, texts: list[str]) -> dict:
    eng = Engine(EngineConfig(model=args.model, backend=args.backend, n_ctx=2048, parallel=args.slots,
                              step_tokens=256, threads=args.threads, spec=spec, host_kv_gib=0.25,
                              mtp=args.mtp if spec.startswith("mtp") else None))
    eng.start()
    if not eng.wait_ready(900):
        raise SystemExit(f"spec {spec}: the engine did not get ready")
    try:
        clock = SectionClock(eng)
        log = DraftLog(eng) if eng._spec.enabled else None
        prompts = [encode(eng, [{"role": "user", "content": t}]) for t in texts]
        runs = [Run(eng, f"r{i}", p, args.max_tokens) for i, p in enumerate(prompts)]
        for r in runs:
            r.join()
    finally:
        eng.stop()
    outcomes = [o for v in log.by_id.values() for o in v] if log else []
    return dict(steps=clock.steps, tokens_per_step=clock.tokens / max(clock.steps, 1), us=clock.per_step_us(),
                tok_s=sum(r.rate() for r in runs), drafted=sum(d for d, _ in outcomes),
                accepted=sum(a for _, a in outcomes), shapes=clock.shapes.most_common(4))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path or known model key (default: the default model)")
    ap.add_argument("--mtp", default=None, help="sidecar GGUF for the mtp modes (default: the model's own or shipped)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--specs", default="off,mtp:1,mtp", help="drafting modes, each in an engine of its own")
    ap.add_argument("--kinds", default="code,chat", help="prompt kinds: code (held-out), chat")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if args.slots < 1 or not kinds or set(kinds) - {"code", "chat"}:
        ap.error("--slots >= 1 and --kinds from code, chat")
    res = {}
    print(f"decode-only steps with {args.slots} requests at once, {args.backend} backend, {args.max_tokens} tokens "
          f"each; µs a step")
    print(f"{'kind':5} {'spec':6} {'steps':>5} {'µs':>7} {'tok':>5} " + " ".join(f"{s:>8}" for s in SECTIONS)
          + f" {'tok/s':>7} {'drafted':>7} {'accepted':>8}  (sequences, tokens): steps")
    for kind in kinds:
        texts = held_out_code(args.slots) if kind == "code" else list(CHAT[:args.slots])
        for spec in [s for s in args.specs.split(",") if s]:
            r = res[kind, spec] = run(args, spec, texts)
            print(f"{kind:5} {spec:6} {r['steps']:>5} {r['us']['step']:>7.0f} {r['tokens_per_step']:>5.2f} "
                  + " ".join(f"{r['us'][s]:>8.0f}" for s in SECTIONS)
                  + f" {r['tok_s']:>7.0f} {r['drafted']:>7} {r['accepted']:>8}  "
                  + ", ".join(f"{shape}: {n}" for shape, n in r["shapes"]), flush=True)
    return res


if __name__ == "__main__":
    main()
