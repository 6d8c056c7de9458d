"""The engine's host work per decode step with many requests, measured without a GPU.

On a GPU the engine thread launches a step's forward, hands out the last step's tokens while the device
computes (Backend.queues_work), then waits for the sampled tokens and plans the next step; the host work
that does not overlap the device (sampling bookkeeping, completing the step, metrics, planning) adds to
every step. Here the device is a stand-in: the runner's forward returns at once, and its sample() sleeps
until --device-ms after that launch (a sleeping thread, like one waiting on a GPU, holds no interpreter
lock) and returns the tokens the real model gave for that many rows (computed once). The engine runs on
the CPU backend with queues_work set, so its order of work is the CUDA backend's.

Each round submits --slots requests of --tokens greedy tokens (32-token random prompts) and reads their
token events either with one thread per request (as the server's streaming responses do) or with one
thread polling every handle every 10 ms. Printed per round: ms a step while every request decodes, the
host's share beyond the stand-in's device time, and tok/s.

usage: python perf/bench_engine_host.py [--model M.gguf] [--slots 32] [--device-ms 2.5] [--tokens 400]
           [--consumers threads,poll] [--rounds 2]
Without --model a 2-block synthetic model of the Qwen2.5-0.5B shape (its 151,936-token vocabulary) is
written to a temporary folder.
"""
from __future__ import annotations

import argparse
import os
import queue
import tempfile
import threading
import time

import numpy as np

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.engine_events import DoneEvent, ErrorEvent, TokenEvent
from strata_lite.sampling import SamplingParams
from strata_lite.sequence import Request

CONSUMERS = ("threads", "poll")
PROMPT_TOKENS = 32


class DeviceStandIn:
    """Replaces a runner's forward and sample (the module docstring); counts steps with their end times.
    The real model runs once (the first forward and sample); every later step gets that first row's logits
    and tokens for each of its rows, so that no step costs the host a forward (which would also teach the
    scheduler's cost model that prompt tokens are dear)."""

    def __init__(self, runner, device_ms: float):
        self.device_s = device_ms / 1e3
        self._forward, self._sample = runner.forward, runner.sample
        self._row = self._first = None
        self._logits, self._sampled = {}, {}
        self.launched = 0.0
        self.step_ends: list[float] = []
        runner.forward, runner.sample = self.forward, self.sample
        runner.backend.queues_work = True     # the engine hands tokens out while the "device" computes

    def forward(self, batch):
        n = len(batch.logit_rows)
        if self._row is None:
            logits = self._forward(batch)
            if n == 0:                        # a prompt chunk without logit rows: nothing to keep yet
                self.launched = time.perf_counter()
                return logits
            self._row = np.array(logits[:1])
        if n not in self._logits:
            self._logits[n] = np.repeat(self._row, n, axis=0)
        self.launched = time.perf_counter()
        return self._logits[n]

    def sample(self, logits, rows):
        wait = self.launched + self.device_s - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        n = len(logits)
        if self._first is None:
            self._first = self._sample(logits, rows)
        if n not in self._sampled:
            f = self._first
            self._sampled[n] = type(f)(**{k: np.repeat(getattr(f, k)[:1], n, axis=0)
                                          for k in ("ids", "logprob", "top_ids", "top_logprobs")})
        self.step_ends.append(time.perf_counter())
        return self._sampled[n]


def _consume_threads(handles, token_times):
    def read(i):
        for ev in handles[i].events():
            if isinstance(ev, TokenEvent):
                token_times[i].append(time.perf_counter())
    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _consume_poll(handles, token_times):
    left = set(range(len(handles)))
    while left:
        time.sleep(0.01)
        for i in list(left):
            while True:
                try:
                    ev = handles[i]._events.get_nowait()    # the handle's queue, read without blocking
                except queue.Empty:
                    break
                if isinstance(ev, TokenEvent):
                    token_times[i].append(time.perf_counter())
                elif isinstance(ev, (DoneEvent, ErrorEvent)):
                    left.discard(i)
                    break


def run_round(engine, stand_in, slots: int, tokens: int, consumers: str, rng, tag: str) -> dict:
    """One round: `slots` requests at once; -> {ms_step, host_ms, tok_s} over the window in which every
    request decodes (from the last first token to the first last token)."""
    n_vocab = engine._runner.n_vocab
    handles = [engine.submit(Request(f"{tag}-{i}", tuple(int(t) for t in rng.integers(0, n_vocab, PROMPT_TOKENS)),
                                     SamplingParams(temperature=0.0, ignore_eos=True), max_tokens=tokens))
               for i in range(slots)]
    times: list[list[float]] = [[] for _ in range(slots)]
    (_consume_threads if consumers == "threads" else _consume_poll)(handles, times)
    if any(len(ts) < 2 for ts in times):
        raise RuntimeError(f"a request ended with fewer than 2 tokens: {[len(ts) for ts in times]}")
    t0, t1 = max(ts[0] for ts in times), min(ts[-1] for ts in times)
    n_tok = sum(t0 < t <= t1 for ts in times for t in ts)
    steps = [t for t in stand_in.step_ends if t0 < t <= t1]
    if len(steps) < 2:
        raise RuntimeError(f"too few steps in the decoding window ({len(steps)}; tokens {[len(ts) for ts in times]}, "
                           f"window {t1 - t0:.3f} s): ask for more --tokens")
    ms_step = (steps[-1] - steps[0]) / (len(steps) - 1) * 1e3
    return {"ms_step": ms_step, "host_ms": ms_step - stand_in.device_s * 1e3, "tok_s": n_tok / (t1 - t0)}


def _default_model(folder: str) -> str:
    from strata_lite.loader.synth import synth_model
    path = os.path.join(folder, "qwen2.5-0.5b-2blocks.gguf")
    synth_model(path, "qwen2.5-0.5b", blocks=2, progress=False)
    return path


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--device-ms", type=float, default=2.5)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--consumers", default=",".join(CONSUMERS))
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.consumers.split(",") if m.strip()]
    bad = [m for m in modes if m not in CONSUMERS]
    if bad or not modes:
        ap.error(f"--consumers takes a comma-separated list of {', '.join(CONSUMERS)}, got {a.consumers!r}")
    if a.slots < 1 or a.tokens < 8 or a.device_ms < 0 or a.rounds < 1:
        ap.error("--slots >= 1, --tokens >= 8, --device-ms >= 0 and --rounds >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or _default_model(tmp)
        engine = Engine(EngineConfig(model=model, backend="cpu", n_ctx=PROMPT_TOKENS + a.tokens + 64,
                                     parallel=a.slots, spec="off"))
        engine.start()
        try:
            if not engine.wait_ready(600):
                raise RuntimeError(f"the engine did not start: {engine.load_error}")
            stand_in = DeviceStandIn(engine._runner, a.device_ms)
            rng = np.random.default_rng(0)
            run_round(engine, stand_in, 1, 8, "threads", rng, "warm")
            print(f"{a.slots} requests of {a.tokens} tokens, device stand-in {a.device_ms} ms a step")
            print("| round | consumers | ms a step | host beyond the device | tok/s |")
            print("|---|---|---|---|---|")
            rows = []
            for r in range(a.rounds):
                for mode in modes:
                    res = run_round(engine, stand_in, a.slots, a.tokens, mode, rng, f"r{r}{mode}")
                    rows.append({"round": r, "consumers": mode, **res})
                    print(f"| {r} | {mode} | {res['ms_step']:.2f} | {res['host_ms']:.2f} | {res['tok_s']:.0f} |")
            return rows
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
