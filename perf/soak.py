"""Soak the HTTP server with mixed traffic for a bounded time and print one table.

Starts `strata-lite serve` itself (default model or --model, CPU backend, a free 127.0.0.1 port; loopback
only), waits for /health, then for --minutes (default 30) runs --clients client threads, each looping over:
  - agent-like multi-turn chats: every conversation starts with one shared system prompt (~300 tokens of
    tool schema, so prefixes are shared across threads), then grows by an answer, a tool result (a code
    snippet) and a follow-up per turn; restarted after --turns turns. Half the turns stream.
  - client disconnects: a streamed request closed after its first chunk, or before any byte is read.
  - bad requests (broken JSON, wrong types, unknown roles, a prompt over the context...): a 4xx is the
    expected outcome; a 2xx or 5xx is counted as such.
Every --sample-s seconds a sampler reads the server's RSS (psutil if installed, else /proc/<pid>/status),
/slots and /metrics. A slot is "stuck" when it stays busy on one request with no progress (seq_len and
read unchanged) for more than --stuck-s seconds (default 60).

The table: requests by outcome; p50/p99 latency of the completed requests per 5-minute window; RSS after
warm-up (the first --warmup-minutes, default min(5, minutes/5)) and at the end, with the slope in MiB/hour
by least squares over the samples after warm-up; stuck slots; the slots and KV state after the traffic.

usage: python perf/soak.py [--minutes 30] [--clients 4] [--model M] [--parallel 2] [--ctx-size 4096]
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from collections import Counter

from bench_agent import FOLLOW_UPS, SYSTEM, TASKS, ServerProcess, http_get, read_metrics, snippet, source_corpus

WINDOW_S = 300.0                 # latency windows: 5 minutes


def bad_requests(n_ctx: int) -> list[tuple[str, bytes]]:
    """(path, body) pairs the server must answer with a 4xx."""
    user = [{"role": "user", "content": "hi"}]
    dump = lambda d: json.dumps(d).encode()          # noqa: E731 - a table of bodies
    return [("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"'),
            ("/v1/chat/completions", dump({"messages": "hi"})),
            ("/v1/chat/completions", dump({"messages": []})),
            ("/v1/chat/completions", dump({"messages": user, "max_tokens": -5})),
            ("/v1/chat/completions", dump({"messages": user, "temperature": "hot"})),
            ("/v1/chat/completions", dump({"messages": [{"role": "wizard", "content": "x"}]})),
            ("/v1/chat/completions", dump({"messages": [{"role": "user", "content": "word " * (n_ctx * 2)}]})),
            ("/v1/completions", dump({"prompt": 5})),
            ("/v1/completions", b"\xff\xfe not utf-8")]


class Client:
    """One client thread's traffic; outcomes and latencies go to the shared Stats."""

    def __init__(self, i: int, port: int, args, stats: "Stats", corpus: str, deadline: float):
        self.i, self.port, self.args, self.stats, self.corpus = i, port, args, stats, corpus
        self.deadline, self.rng = deadline, random.Random(args.seed * 1000 + i)
        self.bad = bad_requests(args.ctx_size)
        self.messages, self.turn, self.n_conv = [], 0, 0

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            r = self.rng.random()
            if r < self.args.bad_share:
                path, body = self.rng.choice(self.bad)
                self.stats.add(self._bad(path, body))
            elif r < self.args.bad_share + self.args.disconnect_share:
                self.stats.add(self._disconnect())
            else:
                self._agent_turn()

    def _post(self, path: str, body: bytes, timeout: float = 900.0) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        return conn

    def _bad(self, path: str, body: bytes) -> str:
        try:
            conn = self._post(path, body, timeout=60)
            status = conn.getresponse().status
            conn.close()
        except OSError:
            return "transport error"
        return "bad: 4xx" if 400 <= status < 500 else f"bad: answered {status}"

    def _disconnect(self) -> str:
        body = {"messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": self.rng.choice(TASKS)}],
                "max_tokens": 64, "stream": True}
        try:
            conn = self._post("/v1/chat/completions", json.dumps(body).encode())
            if self.rng.random() < 0.5:       # close before reading a byte: the server learns it on its write
                conn.close()
                return "disconnect: before the answer"
            resp = conn.getresponse()
            resp.fp.readline()                # the first SSE line
            conn.close()
            return "disconnect: mid-stream" if resp.status == 200 else f"disconnect: answered {resp.status}"
        except OSError:
            return "transport error"

    def _agent_turn(self) -> None:
        if not self.messages or self.turn >= self.args.turns:
            self.n_conv += 1
            self.messages = [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"[client {self.i} conv {self.n_conv}] "
                                                         f"{self.rng.choice(TASKS)}"}]
            self.turn = 0
        stream = self.rng.random() < 0.5
        body = {"messages": self.messages, "max_tokens": self.rng.randint(8, self.args.max_tokens),
                "temperature": 0.7, "seed": self.rng.randrange(2**31), "stream": stream}
        t0 = time.monotonic()
        try:
            conn = self._post("/v1/chat/completions", json.dumps(body).encode())
            resp = conn.getresponse()
            text = _read_stream(resp) if stream and resp.status == 200 else _read_whole(resp)
            conn.close()
        except (OSError, ValueError, KeyError) as e:
            self.stats.add(f"error: {type(e).__name__}")
            self.messages = []
            return
        kind = "stream" if stream else "whole"
        if resp.status != 200:
            self.stats.add(f"{kind}: answered {resp.status}")
            self.messages = [] if resp.status != 503 else self.messages
            return
        self.stats.add(f"{kind}: ok", t0, time.monotonic())
        self.turn += 1
        self.messages += [{"role": "assistant", "content": text},
                          {"role": "user", "content": "Tool output:\n```\n" + snippet(self.corpus, self.rng, 600)
                                                      + "\n```\n" + self.rng.choice(FOLLOW_UPS)}]


def _read_stream(resp) -> str:
    """The content of an SSE chat stream (ValueError if it ends without [DONE])."""
    text = ""
    for raw in resp:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return text
        if line.startswith("data: "):
            for ch in json.loads(line[6:]).get("choices") or ():
                text += (ch.get("delta") or {}).get("content") or ""
    raise ValueError("the stream ended without [DONE]")


def _read_whole(resp) -> str:
    data = resp.read()
    return json.loads(data)["choices"][0]["message"]["content"] if resp.status == 200 else ""


class Stats:
    """Outcome counts and (start, latency) of completed requests, shared by the client threads."""

    def __init__(self, t_start: float):
        self.t_start, self.lock = t_start, threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.latencies: list[tuple[float, float]] = []     # (seconds since the start, latency seconds)

    def add(self, outcome: str, t0: float | None = None, t1: float | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if t0 is not None:
                self.latencies.append((t0 - self.t_start, t1 - t0))


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:              # noqa: BLE001 - the process is gone
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Sampler:
    """Every sample_s: (t, RSS) of the server, /metrics, and slot progress for the stuck-slot check."""

    def __init__(self, url: str, pid: int, t_start: float, stuck_s: float):
        self.url, self.pid, self.t_start, self.stuck_s = url, pid, t_start, stuck_s
        self.rss: list[tuple[float, int]] = []                      # (seconds since the start, bytes)
        self.rss_less_host: list[tuple[float, int]] = []            # RSS less the KV parked in the host pool
        self.progress: dict[int, tuple[object, tuple, float]] = {}   # slot -> (request_id, progress, since)
        self.stuck: dict[tuple[int, object], float] = {}             # (slot, request_id) -> longest stall s
        self.metrics: dict[str, float] = {}
        self.errors: Counter[str] = Counter()

    def sample(self) -> None:
        now = time.monotonic()
        rss = rss_bytes(self.pid)
        try:
            self.metrics = read_metrics(self.url)
        except RuntimeError as e:
            self.errors[str(e)] += 1
        if rss is not None:
            self.rss.append((now - self.t_start, rss))
            self.rss_less_host.append((now - self.t_start, rss - int(self.metrics.get("strata_host_kv_bytes", 0))))
        code, text = http_get(self.url + "/slots")
        if code != 200:
            self.errors[f"GET /slots answered {code}"] += 1
            return
        for s in json.loads(text):
            rid, prog = s.get("request_id"), (s.get("seq_len"), s.get("read"))
            last_rid, last_prog, since = self.progress.get(s["slot"], (None, None, now))
            if s.get("state") == "idle" or (rid, prog) != (last_rid, last_prog):
                self.progress[s["slot"]] = (rid, prog, now)
            elif now - since > self.stuck_s:
                k = (s["slot"], rid)
                self.stuck[k] = max(self.stuck.get(k, 0.0), now - since)

    def run(self, stop: threading.Event, sample_s: float) -> None:
        while not stop.wait(sample_s):
            self.sample()


def slope_mib_per_hour(points: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of RSS over time, MiB/hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mt) * (r - mr) for t, r in points) / var * 3600 / 2**20


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def print_rss(points: list[tuple[float, int]], name: str, warmup_minutes: float) -> None:
    """Value after warm-up, at the end, peak, and the least-squares slope over the samples after warm-up.
    The host pool grows by design (up to --host-kv-gib) as distinct prefixes are parked, hence the 2nd line."""
    after_warm = [(t, r) for t, r in points if t >= warmup_minutes * 60]
    if not after_warm:
        print(f"{name}: not measured (no psutil and no /proc, or no sample after the warm-up)")
        return
    slope = slope_mib_per_hour(after_warm)
    print(f"{name}: {after_warm[0][1] / 2**20:.0f} MiB after the {warmup_minutes:g}-min warm-up, "
          f"{points[-1][1] / 2**20:.0f} MiB at the end, peak {max(r for _, r in points) / 2**20:.0f} MiB; "
          f"slope {'n/a' if slope is None else f'{slope:+.1f}'} MiB/hour ({len(after_warm)} samples)")


def print_report(stats: Stats, sampler: Sampler, args, after: dict, slots: list) -> None:
    total = sum(stats.outcomes.values())
    print(f"\nrequests: {total} in {args.minutes:g} min, {args.clients} client threads")
    for outcome, n in sorted(stats.outcomes.items()):
        print(f"  {outcome:<32} {n:>6}")
    print("latency of completed requests (s), per 5-minute window:")
    print(f"  {'window':<12} {'n':>6} {'p50':>8} {'p99':>8}")
    for w in range(int(args.minutes * 60 // WINDOW_S) + 1):
        xs = [lat for t, lat in stats.latencies if w * WINDOW_S <= t < (w + 1) * WINDOW_S]
        if xs:
            print(f"  {w * 5:>3}-{w * 5 + 5:<3} min {len(xs):>6} {pct(xs, 0.5):>8.2f} {pct(xs, 0.99):>8.2f}")
    print_rss(sampler.rss, "RSS", args.warmup_minutes)
    print_rss(sampler.rss_less_host, "RSS less the host KV pool's parked pages", args.warmup_minutes)
    print(f"stuck slots (busy, no progress > {args.stuck_s:g} s): {len(sampler.stuck)}"
          + "".join(f"\n  slot {s} request {rid}: {d:.0f} s" for (s, rid), d in sampler.stuck.items()))
    if sampler.errors:
        print("sampler errors: " + "; ".join(f"{e} x{n}" for e, n in sampler.errors.items()))
    busy = [s for s in slots if s.get("state") != "idle"]
    print(f"after the traffic: {len(busy)} busy slots, running {after.get('strata_requests_running', 'n/a')}, "
          f"waiting {after.get('strata_requests_waiting', 'n/a')}, KV usage "
          f"{after.get('strata_kv_usage_ratio', float('nan')):.2f} (cached prefixes included), host pool "
          f"{after.get('strata_host_kv_bytes', 0) / 2**20:.0f} MiB, generated tokens "
          f"{after.get('strata_generated_tokens_total', 0):.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="traffic duration (default 30)")
    ap.add_argument("--warmup-minutes", type=float, default=None, help="default min(5, minutes / 5)")
    ap.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    ap.add_argument("--turns", type=int, default=5, help="turns per conversation before a new one (default 5)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of a turn: 8..this (default 32)")
    ap.add_argument("--bad-share", type=float, default=0.1, help="share of bad requests (default 0.1)")
    ap.add_argument("--disconnect-share", type=float, default=0.1, help="share of disconnects (default 0.1)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="sampling period, seconds (default 5)")
    ap.add_argument("--stuck-s", type=float, default=60.0, help="a busy slot without progress this long is stuck")
    ap.add_argument("--model", default=None, help="server --model (default: the default model)")
    ap.add_argument("--parallel", type=int, default=2, help="server --parallel (default 2)")
    ap.add_argument("--ctx-size", type=int, default=4096, help="server --ctx-size (default 4096)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="server --kv-tokens (default ctx-size x parallel)")
    ap.add_argument("--step-tokens", type=int, default=256, help="server --step-tokens (default 256)")
    ap.add_argument("--threads", type=int, default=None, help="server CPU threads (default: all cores)")
    ap.add_argument("--decode-share", type=float, default=0.8, help="server --decode-share (default 0.8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-timeout", type=float, default=900.0, help="seconds to wait for /health")
    args = ap.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60:
        ap.error("--minutes must be in (0, 1440]")
    if args.warmup_minutes is None:
        args.warmup_minutes = min(5.0, args.minutes / 5)
    server = ServerProcess(args)
    try:
        print(f"starting the server on {server.url} (--parallel {args.parallel}, --ctx-size {args.ctx_size})",
              flush=True)
        server.wait_ready(args.load_timeout)
        t_start = time.monotonic()
        stats, sampler = Stats(t_start), Sampler(server.url, server.proc.pid, t_start, args.stuck_s)
        sampler.sample()
        stop = threading.Event()
        threading.Thread(target=sampler.run, args=(stop, args.sample_s), daemon=True).start()
        corpus, deadline = source_corpus(), t_start + args.minutes * 60
        clients = [threading.Thread(target=Client(i, server.port, args, stats, corpus, deadline).run, daemon=True)
                   for i in range(args.clients)]
        for c in clients:
            c.start()
        print(f"traffic for {args.minutes:g} min from {args.clients} client threads", flush=True)
        for c in clients:
            c.join()
        stop.set()
        time.sleep(args.sample_s)                  # let cancelled work and the last steps finish
        sampler.sample()
        code, text = http_get(server.url + "/slots")
        print_report(stats, sampler, args, sampler.metrics, json.loads(text) if code == 200 else [])
        if server.proc.poll() is not None:
            print(f"the server exited with {server.proc.returncode}:\n{server.tail()}")
            return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
