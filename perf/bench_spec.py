"""Speculative decoding on an agent workload: decode tok/s with `--spec off` and `--spec auto` (or N),
acceptance and mean accepted length per turn type, at 1, 2 and 4 decoding slots and next to a long prompt
read. In-process engines on the CPU backend (--backend cuda: the GPU; default model unless --model),
greedy, so both modes generate the same tokens (checked) and only the speed differs.

Turn types (one conversation each, built with the model's chat template):
  tool   - a tool-calling conversation (tool schema in the system prompt, earlier tool calls and results);
           the user asks for three more reads: the answer repeats the JSON call format
  quote  - the user asks for a function of a file the conversation already holds, verbatim
  edit   - rewrite a function shown in the prompt with one name changed
  prose  - free prose
Scenarios: each turn alone (1 slot); two turns at once (2 slots: tool+edit, quote+prose); the four turns
at once (4 slots); the edit turn
while another request reads a --long-read-tokens prompt (acceptance and tok/s during the read, against
the edit turn alone in the same mode).

usage: python perf/bench_spec.py [--spec auto|mtp|N] [--mtp SIDECAR] [--threads 2] [--max-tokens 128]
           [--long-read-tokens 3000] [--model M] [--eager-fill] [--json out.json]
(--spec mtp drafts with an MTP block: the model's own or a sidecar from `strata-lite train-mtp`.)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.engine_events import DoneEvent, TokenEvent
from strata_lite.sequence import Request
from strata_lite.spec.suffix_index import GlobalIndex

ROOT = Path(__file__).resolve().parent.parent
CODE = (ROOT / "tests" / "data" / "heapq.py").read_text(encoding="utf-8")
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "file path"}},
                   "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search the repository for a regular expression",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                       "path": {"type": "string"}}, "required": ["pattern"]}}}]


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


# Three variants of every turn (other functions, files and subjects): the 1-slot, 2-slot and long-read
# scenarios each get their own, so no measured answer repeats an earlier one (the global index would
# draft it from the earlier request's output, which is real but not what each scenario measures).
VARIANTS = [
    dict(push="def heappush", pop="def heappop", sift="def _siftdown(", sift_end="def _siftup(",
         files="lib/queue.py, lib/bisect.py and lib/sched.py", story="a lighthouse keeper and a storm"),
    dict(push="def heapreplace", pop="def heappushpop", sift="def _siftup(", sift_end="def _siftdown_max(",
         files="src/parser.py, src/lexer.py and src/ast.py", story="a baker who finds an old map"),
    dict(push="def heappushpop", pop="def heapify", sift="def _heappop_max(", sift_end="def _heapreplace_max(",
         files="app/models.py, app/views.py and app/urls.py", story="two children building a raft"),
    dict(push="def _heapify_max", pop="def _siftdown(", sift="def _siftup_max(", sift_end="def merge(",
         files="pkg/io.py, pkg/net.py and pkg/fs.py", story="a fox who learns to sing"),
]


def conversations(v: dict) -> dict[str, list[dict]]:
    f_push = CODE[CODE.index(v["push"]):CODE.index(v["pop"])]
    f_sift = CODE[CODE.index(v["sift"]):CODE.index(v["sift_end"])]
    sift_name = v["sift"][4:-1]
    tool = [{"role": "system", "content": "You are a coding agent. Use the tools to inspect the repository."},
            {"role": "user", "content": "Look at the heap implementation."},
            {"role": "assistant", "content": "", "tool_calls": [_call("read_file", path="lib/heapq.py")]},
            {"role": "tool", "content": CODE[:2500]},
            {"role": "assistant", "content": "", "tool_calls": [_call("grep", pattern="def heap", path="lib")]},
            {"role": "tool", "content": "lib/heapq.py:130:def heappush(heap, item):\n"
                                        "lib/heapq.py:135:def heappop(heap):\nlib/heapq.py:145:def heapreplace(heap, item):"},
            {"role": "user", "content": f"Now read {v['files']}, one tool call each."}]
    quote = [{"role": "user", "content": "Here is a file:\n\n" + CODE[:14000]},
             {"role": "assistant", "content": "I have read the file. What should I do with it?"},
             {"role": "user", "content": f"Quote the function {sift_name} exactly as it appears in the file."}]
    edit = [{"role": "user", "content": "Rename the parameter `heap` to `h` everywhere in these functions and "
                                        "print both of them in full:\n\n" + f_push + "\n" + f_sift}]
    prose = [{"role": "user", "content": f"Write a short story about {v['story']}."}]
    return {"tool": tool, "quote": quote, "edit": edit, "prose": prose}


def encode(eng, messages) -> list[int]:
    text = eng.chat_template.render(messages, tools=TOOLS if any(m.get("tool_calls") for m in messages) else None,
                                    add_generation_prompt=True)
    return eng.tokenizer.encode(text, add_special=True, parse_special=True)


class Run:
    """One request: its token arrival times and the drafts verified for it."""

    def __init__(self, eng, rid: str, prompt: list[int], max_tokens: int):
        self.rid, self.times, self.tokens = rid, [], []
        self.handle = eng.submit(Request(rid, tuple(prompt), max_tokens=max_tokens))
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self):
        for ev in self.handle.events(timeout=3600):
            if isinstance(ev, TokenEvent):
                self.times.append(time.perf_counter())
                self.tokens.append(ev.token_id)
            elif not isinstance(ev, DoneEvent):
                raise RuntimeError(f"{self.rid}: {ev}")

    def join(self):
        self.thread.join()
        return self

    def rate(self, t0: float | None = None, t1: float | None = None) -> float:
        """Decode tok/s from the first token on (within [t0, t1] when given)."""
        ts = [t for t in self.times if (t0 is None or t >= t0) and (t1 is None or t <= t1)]
        return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else 0.0


class DraftLog:
    """Drafted / accepted tokens per request, from the controller's observe() calls."""

    def __init__(self, eng):
        self.by_id: dict[str, list[tuple[int, int]]] = {}
        self.window: list[tuple[int, int]] | None = None
        ctl = eng._spec
        real = ctl.observe

        def observe(seq, n_drafted, n_accepted):
            self.by_id.setdefault(seq.id, []).append((n_drafted, n_accepted))
            if self.window is not None and seq.id.startswith("edit"):
                self.window.append((n_drafted, n_accepted))
            real(seq, n_drafted, n_accepted)
        ctl.observe = observe

    def stats(self, rid: str, outcomes=None) -> tuple[float, float]:
        """(acceptance rate, mean accepted tokens per verified draft)."""
        o = outcomes if outcomes is not None else self.by_id.get(rid, [])
        drafted, accepted = sum(d for d, _ in o), sum(a for _, a in o)
        return (accepted / drafted if drafted else 0.0), (accepted / len(o) if o else 0.0)


def run_mode(args, spec) -> dict:
    eng = Engine(EngineConfig(model=args.model, backend=args.backend, n_ctx=8192, parallel=4, step_tokens=256,
                              threads=args.threads, spec=spec, host_kv_gib=1.0,
                              mtp=args.mtp if str(spec).split(":")[0] in ("mtp", "auto") else None))
    eng.start()
    eng.wait_ready(600)
    if args.eager_fill and eng._runner.mtp is not None:
        eng._runner.mtp.fill_eagerly()          # the MTP block's KV rows in every step, not deferred
    log = DraftLog(eng)
    prompts, pair_prompts, read_prompts, four_prompts = ({k: encode(eng, m) for k, m in conversations(v).items()}
                                                         for v in VARIANTS)
    out = {"alone": {}, "pairs": {}, "four": {}, "read": {}}
    try:
        warm = [*prompts.items(), *pair_prompts.items(), *four_prompts.items(), ("edit", read_prompts["edit"])]
        for name, p in warm:
            Run(eng, f"warm-{name}-{len(p)}", p, 1).join()    # prefill: every measured turn reuses its prompt
        for name, p in prompts.items():
            r = Run(eng, f"{name}-alone", p, args.max_tokens).join()
            out["alone"][name] = dict(tok_s=r.rate(), tokens=r.tokens, stats=log.stats(r.rid))
        for a, b in (("tool", "edit"), ("quote", "prose")):
            ra = Run(eng, f"{a}-pair", pair_prompts[a], args.max_tokens)
            rb = Run(eng, f"{b}-pair", pair_prompts[b], args.max_tokens)
            for name, r in ((a, ra.join()), (b, rb.join())):
                out["pairs"][name] = dict(tok_s=r.rate(), tokens=r.tokens, stats=log.stats(r.rid))
        runs = {name: Run(eng, f"{name}-four", p, args.max_tokens) for name, p in four_prompts.items()}
        for name, r in runs.items():
            r.join()
            out["four"][name] = dict(tok_s=r.rate(), tokens=r.tokens, stats=log.stats(r.rid))
        long_text = (CODE * 4)[:args.long_read_tokens * 4]
        long_prompt = eng.tokenizer.encode(long_text, add_special=True)[:args.long_read_tokens]
        # the third edit turn alone, then again during the read; the global index is emptied before
        # each, so the second run cannot draft from the first one's output
        eng._spec.drafter.global_index = GlobalIndex()
        alone = Run(eng, "edit-read-alone", read_prompts["edit"], args.max_tokens).join()
        eng._spec.drafter.global_index = GlobalIndex()
        log.window = []
        edit = Run(eng, "edit-read", read_prompts["edit"], args.max_tokens)
        while not edit.times:
            time.sleep(0.01)
        t0 = time.perf_counter()
        reader = Run(eng, "reader", long_prompt, 1)
        reader.join()
        t1 = reader.times[0] if reader.times else time.perf_counter()
        during, log.window = log.window, None
        edit.join()
        out["read"] = dict(tok_s_during=edit.rate(t0, t1), tok_s_alone=alone.rate(), read_s=t1 - t0,
                           stats_during=log.stats("", during), stats_alone=log.stats(alone.rid),
                           tokens=edit.tokens, n_read=len(long_prompt))
    finally:
        eng.stop()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--spec", default="auto", help="the drafting mode to compare with off (auto, mtp or N)")
    ap.add_argument("--mtp", default=None, help="sidecar GGUF with an MTP block (strata-lite train-mtp)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-read-tokens", type=int, default=3000)
    ap.add_argument("--eager-fill", action="store_true",
                    help="write the MTP block's KV rows in every step (MtpDrafter.fill_eagerly) instead of "
                         "deferring them until a draft or a full page needs them (the CPU's default), for A/B runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {mode: run_mode(args, mode) for mode in ("off", args.spec)}
    off, on = res["off"], res[args.spec]
    same = all(off[s][k]["tokens"] == on[s][k]["tokens"] for s in ("alone", "pairs", "four") for k in off[s]) \
        and off["read"]["tokens"] == on["read"]["tokens"]
    print(f"strata_lite speculative decoding, {args.backend} backend, {os.cpu_count()} cores "
          f"({platform.processor() or platform.machine()}),"
          f" threads {args.threads or 'all'}, max_tokens {args.max_tokens}; same tokens in both modes: {same}")
    print(f"{'scenario':<10} {'turn':<6} {'off tok/s':>9} {args.spec + ' tok/s':>11} {'speed-up':>8} "
          f"{'accepted':>8} {'tok/draft':>9}")
    for scen in ("alone", "pairs", "four"):
        for name in off[scen]:
            a, b = off[scen][name]["tok_s"], on[scen][name]["tok_s"]
            rate, length = on[scen][name]["stats"]
            print(f"{scen:<10} {name:<6} {a:>9.1f} {b:>11.1f} {b / a if a else 0:>7.2f}x {rate:>8.0%} {length:>9.2f}")
    # several slots share every step: what they decode together (tok/s summed over the turns run at once)
    for scen, groups in (("pairs", (("tool", "edit"), ("quote", "prose"))), ("four", (tuple(off["four"]),))):
        for g in groups:
            a, b = (sum(r[scen][k]["tok_s"] for k in g) for r in (off, on))
            print(f"{scen:<10} {'+'.join(g):<22} together: off {a:.1f} tok/s, {args.spec} {b:.1f} tok/s "
                  f"({b / a if a else 0:.2f}x)")
    rd_off, rd_on = off["read"], on["read"]
    print(f"edit turn during a {rd_on['n_read']}-token read: off {rd_off['tok_s_during']:.1f} tok/s "
          f"({rd_off['tok_s_during'] / rd_off['tok_s_alone']:.0%} of its {rd_off['tok_s_alone']:.1f} alone), "
          f"{args.spec} {rd_on['tok_s_during']:.1f} tok/s ({rd_on['tok_s_during'] / rd_on['tok_s_alone']:.0%} of its "
          f"{rd_on['tok_s_alone']:.1f} alone); acceptance {rd_on['stats_during'][0]:.0%} during the read, "
          f"{rd_on['stats_alone'][0]:.0%} alone; the read took {rd_off['read_s']:.1f} s / {rd_on['read_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
