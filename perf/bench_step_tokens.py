"""What a decode / verify step costs by its token count while drafting: the engine's whole step (planning with
its drafts, the forward, sampling, completing the step: what SpecController's cost line learns from) and the
model's forward alone, per number of tokens in the step (the pending token and its verified drafts).

One slot answers held-out coding prompts of perf/eval_mtp.py (greedy) with a fixed drafting mode, so the steps
have the widths that mode gives; prints per token count the steps seen and the median ms of the step and of
the forward, and the cost line (intercept, slope) the controller fitted. On the CPU the forward is computed
inside the call; on a backend that queues work (CUDA) the forward's time is only its launch and the step's
is the measure.

usage: python perf/bench_step_tokens.py [--model M] [--mtp SIDECAR] [--spec mtp:3] [--backend cpu|cuda]
           [--prompts 6] [--max-tokens 128] [--threads N]
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import time

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.runner import ModelRunner
from strata_lite.sampling import SamplingParams
from strata_lite.sequence import Request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec import encode  # noqa: E402  (perf/ is not a package)
from eval_mtp import held_out_code  # noqa: E402


class ForwardClock:
    """Times ModelRunner.forward by the batch's token count while installed (a context manager)."""

    def __init__(self):
        self.by_tokens = collections.defaultdict(list)
        self._saved = None

    def __enter__(self):
        self._saved = forward = ModelRunner.forward
        clock = self

        def timed(runner, batch):
            t0 = time.perf_counter()
            out = forward(runner, batch)
            clock.by_tokens[len(batch.token_ids)].append(time.perf_counter() - t0)
            return out

        ModelRunner.forward = timed
        return self

    def __exit__(self, *exc):
        ModelRunner.forward = self._saved


def main(argv=None) -> dict[int, tuple[int, float, float]]:
    """-> {tokens in a step: (steps, median step ms, median forward ms)}, as printed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path or known model key (default: the default model)")
    ap.add_argument("--mtp", default=None, help="sidecar GGUF with the model's MTP block (default: its own or shipped)")
    ap.add_argument("--spec", default="mtp:3", help="drafting mode, as serve --spec (default mtp:3)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--prompts", type=int, default=6, help="held-out coding prompts answered (default 6)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    with ForwardClock() as clock:
        eng = Engine(EngineConfig(model=args.model, backend=args.backend, n_ctx=2048, parallel=1, step_tokens=256,
                                  threads=args.threads, spec=args.spec, host_kv_gib=0.25,
                                  mtp=args.mtp if str(args.spec).startswith("mtp") else None))
        eng.start()
        try:
            if not eng.wait_ready(900):
                raise SystemExit("the engine did not get ready")
            for i, text in enumerate(held_out_code(args.prompts)):
                handle = eng.submit(Request(f"step-tokens-{i}", encode(eng, [{"role": "user", "content": text}]),
                                            max_tokens=args.max_tokens, params=SamplingParams(temperature=0.0)))
                for _ in handle.events(600):
                    pass
            samples, line = list(eng._spec.cost.samples), eng._spec.cost.line()
        finally:
            eng.stop()
    steps = collections.defaultdict(list)
    for n, seconds in samples:               # the cost line's window: the last decode / verify steps
        steps[n].append(seconds)
    print(f"steps by token count, spec {args.spec}, {args.backend} backend "
          f"({platform.processor() or platform.machine()}, threads {args.threads or 'all'}); the last "
          f"{len(samples)} decode / verify steps, medians")
    out = {}
    for n in sorted(steps):
        forwards = clock.by_tokens[n][-len(steps[n]):]        # the same steps' forwards (the latest ones)
        out[n] = (len(steps[n]), 1e3 * statistics.median(steps[n]), 1e3 * statistics.median(forwards))
        print(f"{n} tokens: {out[n][0]:4d} steps, step {out[n][1]:8.2f} ms, forward {out[n][2]:8.2f} ms")
    if line is not None:
        print(f"cost line: {1e3 * line[0]:.2f} ms + {1e3 * line[1]:.2f} ms a token")
    return out


if __name__ == "__main__":
    main()
