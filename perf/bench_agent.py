"""Replay an agent workload against the HTTP server and print one table.

Starts `strata-lite serve` itself (default model, --backend cpu unless told, a free 127.0.0.1 port; or use a running
server with --url), waits for /health, warms it up, reads /metrics, then:

1. Agent turns: more conversations than slots, all sharing one system prompt with ~300 tokens of tool
   JSON schema. Every round, each conversation sends one turn (seeded random order, from a pool of client
   threads, max_tokens 16-32, streamed for the client-side TTFT); the turn then appends a tool-call
   assistant message, a tool result (a few hundred tokens of code) and a user message, so the prompts grow.
   The tool schema is written into the system prompt (Qwen's `# Tools ... <tools>` block) rather than
   sent as `tools`: with `tools` the server holds back streamed `<tool_call>` text, hiding the first token.
2. Decode starvation: conversation A streams a long answer ("count from 1 to 300", temperature 0; the
   server has no ignore_eos) alone, then again while conversation B sends one long fresh prompt
   (--long-read-tokens of new text). A's per-token arrival times give its tok/s during B's read and
   its largest inter-token gap, compared with its solo rate and solo median step time.

/metrics is read before and after (prompt tokens read/reused/restored, needless reads, step seconds);
read seconds come from the server's admission log lines when this script started the server.

usage: python perf/bench_agent.py [--backend cpu|cuda] [--parallel 2] [--conversations 4] [--turns 4] [--threads 2]
           [--step-tokens 256] [--long-read-tokens 4000] [--stream-tokens 200] [--decode-share 0.8]
           [--model M] [--url URL]
--threads is the server's CPU threads; --client-threads the client's (default: one per conversation).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

TARGET_DECODE_SHARE = 0.70      # A keeps >= 70% of its solo tok/s during B's read
TARGET_GAP_RATIO = 4.0          # no inter-token gap of A above 4x its solo median step
CHARS_PER_TOKEN_GUESS = 3.3     # replaced by a measurement during warm-up

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the repository, optionally a line range.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root"},
            "start_line": {"type": "integer", "description": "First line to return (1-based)"},
            "end_line": {"type": "integer", "description": "Last line to return (inclusive)"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Create or overwrite a file with the given content.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root"},
            "content": {"type": "string", "description": "The complete new content of the file"}},
            "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string", "description": "Python regular expression"},
            "glob": {"type": "string", "description": "Only files matching this glob, e.g. '*.py'"},
            "max_results": {"type": "integer", "description": "At most this many matches (default 50)"}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_shell", "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The command line"},
            "timeout_s": {"type": "number", "description": "Kill the command after this many seconds"}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List the entries of a directory.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Directory relative to the repository root"},
            "recursive": {"type": "boolean", "description": "Descend into subdirectories"}},
            "required": ["path"]}}},
]

SYSTEM = ("You are a careful coding agent working in a Python repository. Use the tools to inspect files, "
          "search the code and run commands before you change anything; keep answers short.\n\n# Tools\n\n"
          "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
          "signatures within <tools></tools> XML tags:\n<tools>\n"
          + "\n".join(json.dumps(t) for t in TOOLS) +
          "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
          "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
          "<args-json-object>}\n</tool_call>")

TASKS = ["Find why the text wrapper breaks long words in the middle and propose a fix.",
         "Add type hints to the JSON decoder helpers and make sure nothing else changes.",
         "The shell lexer mishandles escaped quotes inside words; locate the code and explain.",
         "Write a unit test for the diff matcher's ratio() on empty sequences.",
         "Explain how the heap functions keep the invariant when an item is replaced.",
         "Refactor the argument parser's help formatter so long option lists wrap nicely."]
FOLLOW_UPS = ["Good. Keep going.", "Now check the caller of that function.", "Look at the next part.",
              "Is there a test for this? Search for it.", "Continue with the plan.", "What does this part do?"]
SOURCE_MODULES = ("textwrap", "json.decoder", "shlex", "difflib", "heapq", "argparse", "fnmatch", "bisect",
                  "string", "calendar", "ipaddress", "fractions")


def source_corpus() -> str:
    import importlib
    parts = []
    for name in SOURCE_MODULES:
        try:
            parts.append(inspect.getsource(importlib.import_module(name)))
        except (ImportError, OSError, TypeError):
            pass
    return "\n".join(parts)


def snippet(corpus: str, rng: random.Random, n_chars: int) -> str:
    start = rng.randrange(0, max(1, len(corpus) - n_chars))
    start = corpus.rfind("\n", 0, start) + 1
    return corpus[start:start + n_chars]


class Sizer:
    """Text of about n tokens: cut with the model's tokenizer (read from the GGUF, no weights), or by a
    chars-per-token estimate (measured by the warm-up) when the tokenizer cannot be loaded."""

    def __init__(self, model):
        self.tok, self.chars_per_token = None, CHARS_PER_TOKEN_GUESS
        try:
            from strata_lite.loader.gguf_file import read_metadata
            from strata_lite.loader.known_models import resolve_model
            from strata_lite.loader.tokenizer import Tokenizer
            self.tok = Tokenizer.from_gguf_metadata(read_metadata(resolve_model(model)))
        except Exception as e:          # noqa: BLE001 - e.g. --url serving a model not present here
            print(f"(no local tokenizer: {e}; sizing text by characters)")

    def snippet(self, corpus: str, rng: random.Random, n_tokens: int) -> str:
        if self.tok is None:
            return snippet(corpus, rng, int(n_tokens * self.chars_per_token))
        text = snippet(corpus, rng, n_tokens * 8)
        return self.tok.decode(self.tok.encode(text, add_special=False)[:n_tokens])


# -------------------------------------------------------------------------------------------- server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`strata-lite serve` as a subprocess; keeps its log lines (admission lines give read seconds)."""
    READ_LINE = re.compile(r": prompt (\d+) tokens = (\d+) reused \+ (\d+) restored \+ (\d+) read.* in ([\d.]+) s")

    def __init__(self, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "import sys; from strata_lite.cli import main; sys.exit(main())", "serve",
               "--backend", args.backend, "--host", "127.0.0.1", "--port", str(self.port), "--parallel", str(args.parallel),
               "--ctx-size", str(args.ctx_size), "--step-tokens", str(args.step_tokens), "--log-level", "info"]
        if args.model:
            cmd += ["--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.kv_tokens:
            cmd += ["--kv-tokens", str(args.kv_tokens)]
        self.lines: list[str] = []
        self.reads: list[tuple[int, float]] = []     # (tokens read, seconds) per admission
        self._lock = threading.Lock()
        cmd += ["--decode-share", str(args.decode_share or 0)]   # the scheduler's time budget (0 = off)
        env = dict(os.environ)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=env)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._lock:
                self.lines.append(line)
                m = self.READ_LINE.search(line)
                if m:
                    self.reads.append((int(m.group(4)), float(m.group(5))))

    def mark(self) -> int:
        with self._lock:
            return len(self.reads)

    def reads_since(self, mark: int) -> list[tuple[int, float]]:
        with self._lock:
            return list(self.reads[mark:])

    def tail(self, n=30) -> str:
        with self._lock:
            return "\n".join(self.lines[-n:])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            code, _ = http_get(self.url + "/health")
            if code == 200:
                return
            if code == 500:
                raise RuntimeError(f"the model failed to load:\n{self.tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


METRIC_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')


def read_metrics(url: str) -> dict[str, float]:
    code, text = http_get(url + "/metrics")
    if code != 200:
        raise RuntimeError(f"GET /metrics answered {code}")
    out = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric_delta(before: dict, after: dict, key: str) -> float | None:
    if key not in after:
        return None
    return after[key] - before.get(key, 0.0)


# -------------------------------------------------------------------------------------------- client

class Stream:
    """One streamed chat request: send time, per-token (content chunk) arrival times, usage, text."""

    def __init__(self):
        self.t_send = self.t_end = None
        self.times: list[float] = []
        self.text = ""
        self.usage = None
        self.error = None

    @property
    def ttft(self):
        return self.times[0] - self.t_send if self.times else None


def stream_chat(client, model, messages, max_tokens, on_token=None, temperature=0.0, seed=None) -> Stream:
    st = Stream()
    st.t_send = time.perf_counter()
    try:
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                              temperature=temperature, seed=seed, stream=True,
                                              stream_options={"include_usage": True})
        for chunk in resp:
            now = time.perf_counter()
            if chunk.usage is not None:
                st.usage = chunk.usage
            for ch in chunk.choices or ():
                piece = ch.delta.content if ch.delta else None
                if piece:
                    st.times.append(now)
                    st.text += piece
                    if on_token:
                        on_token(len(st.times))
    except Exception as e:          # noqa: BLE001 - reported in the table
        st.error = f"{type(e).__name__}: {e}"
    st.t_end = time.perf_counter()
    return st


class Conversation:
    def __init__(self, i: int, run_id: str, rng: random.Random):
        self.i, self.rng = i, rng
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"[session {run_id}-{i}] {TASKS[i % len(TASKS)]}"}]
        self.n_calls = 0

    def append_turn(self, corpus: str, answer: str, tool_tokens: int, sizer: Sizer) -> None:
        tool = TOOLS[self.rng.randrange(len(TOOLS))]["function"]["name"]
        args = {"read_file": {"path": f"src/module_{self.rng.randrange(40)}.py", "start_line": 1, "end_line": 120},
                "write_file": {"path": f"src/patch_{self.rng.randrange(40)}.py", "content": "pass\n"},
                "search_code": {"pattern": r"def \w+\(", "glob": "*.py"},
                "run_shell": {"command": "python -m pytest -q tests/ -x"},
                "list_dir": {"path": "src", "recursive": False}}[tool]
        call_id = f"call_{self.i}_{self.n_calls}"
        self.n_calls += 1
        content = (answer.split("<tool_call>")[0].strip() or "Let me check that.")[:200]
        self.messages.append({"role": "assistant", "content": content, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": sizer.snippet(corpus, self.rng, tool_tokens)})
        self.messages.append({"role": "user", "content": FOLLOW_UPS[self.rng.randrange(len(FOLLOW_UPS))]})


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def warm_up(client, model, corpus, rng) -> float:
    """Two concurrent requests (JIT compilation, a mixed decode + read step); returns chars per token of
    code, measured on fresh text."""
    text = f"[warm-up {rng.random()}]\n" + snippet(corpus, rng, 2400)
    msgs = [{"role": "user", "content": text}]
    bare = stream_chat(client, model, [{"role": "user", "content": "hi"}], 2)
    with ThreadPoolExecutor(2) as ex:
        f1 = ex.submit(stream_chat, client, model, msgs, 4)
        time.sleep(0.2)
        f2 = ex.submit(stream_chat, client, model, [{"role": "user", "content": f"Say hello {rng.random()}"}], 8)
        a, b = f1.result(), f2.result()
    for s in (bare, a, b):
        if s.error:
            raise RuntimeError(f"warm-up request failed: {s.error}")
    n_text = a.usage.prompt_tokens - bare.usage.prompt_tokens + 1 if a.usage and bare.usage else None
    return len(text) / n_text if n_text and n_text > 100 else CHARS_PER_TOKEN_GUESS


def run_turns(client, model, convs, args, corpus, sizer, rng):
    results = []
    lock = threading.Lock()

    def turn(conv):
        st = stream_chat(client, model, conv.messages, rng_max_tokens[conv.i])
        with lock:
            results.append(st)
        if not st.error:
            conv.append_turn(corpus, st.text, tool_tokens[conv.i], sizer)
        return st

    with ThreadPoolExecutor(args.client_threads) as ex:
        for t in range(args.turns):
            order = list(convs)
            rng.shuffle(order)
            rng_max_tokens = {c.i: rng.randint(16, 32) for c in convs}
            tool_tokens = {c.i: rng.randint(200, 450) for c in convs}
            futures = []
            for c in order:
                futures.append(ex.submit(turn, c))
                time.sleep(rng.uniform(0.0, 0.15))     # tool results come back at slightly different times
            for f in futures:
                f.result()
            print(f"  round {t + 1}/{args.turns}: prompts "
                  f"{sorted(s.usage.prompt_tokens for s in results[-len(convs):] if s.usage)} tokens", flush=True)
    return results


COUNT_PROMPT = ("No tool call for this one: answer in plain text. Count from 1 to 300, separated by commas, "
                "numbers only.")


def starvation(client, model, conv_a, conv_b, args, corpus, sizer, rng, url):
    msgs_a = conv_a.messages + [{"role": "user", "content": COUNT_PROMPT}]
    solo = stream_chat(client, model, msgs_a, args.stream_tokens)
    if solo.error:
        raise RuntimeError(f"the solo stream failed: {solo.error}")
    long_text = (f"[fresh document {rng.random()}] Summarize what the following code does in one sentence.\n\n"
                 + sizer.snippet(corpus, rng, args.long_read_tokens))
    msgs_b = conv_b.messages + [{"role": "user", "content": long_text}]
    started = threading.Event()
    lead = max(2, min(10, args.stream_tokens // 10))
    box = {}

    def on_token(n):
        if n >= lead:
            started.set()

    def run_b():
        started.wait(300)
        box["m0"] = read_metrics(url)
        box["b"] = stream_chat(client, model, msgs_b, 8)

    tb = threading.Thread(target=run_b)
    tb.start()
    both = stream_chat(client, model, msgs_a, args.stream_tokens, on_token=on_token)
    m1 = read_metrics(url)          # the engine steps while A decoded next to B (if B still reads)
    started.set()
    tb.join()
    return solo, both, box["b"], (box.get("m0", {}), m1)


def decode_stats(st: Stream):
    gaps = [b - a for a, b in zip(st.times, st.times[1:])]
    rate = (len(st.times) - 1) / (st.times[-1] - st.times[0]) if len(st.times) > 1 else None
    return rate, (statistics.median(gaps) if gaps else None), gaps


def during_read(a: Stream, b: Stream):
    """A's tokens while B was reading: the window from B's send to B's first token (cut at A's end)."""
    w0 = b.t_send
    w1 = min(b.times[0] if b.times else b.t_end, a.times[-1])
    inside = [t for t in a.times if w0 < t <= w1]
    if w1 <= w0 or not inside:
        return None
    prev = [t for t in a.times if t <= w0]
    last = prev[-1] if prev else w0
    max_gap = 0.0
    for t in inside:
        max_gap, last = max(max_gap, t - last), t
    after = [t for t in a.times if t > w1]               # the gap that spans the window's end
    if after and b.times and w1 == b.times[0]:
        max_gap = max(max_gap, after[0] - inside[-1])
    return dict(rate=len(inside) / (w1 - w0), max_gap=max_gap, window=w1 - w0, n=len(inside))


# -------------------------------------------------------------------------------------------- report

def fmt(x, spec=".0f", unit=""):
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def print_table(rows):
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    line = f"+-{'-' * w0}-+-{'-' * w1}-+-{'-' * w2}-+------+"
    print(line)
    print(f"| {'metric':<{w0}} | {'value':>{w1}} | {'target':<{w2}} |      |")
    print(line)
    for name, value, target, ok in rows:
        mark = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"| {name:<{w0}} | {value:>{w1}} | {target:<{w2}} | {mark:<4} |")
    print(line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parallel", type=int, default=2, help="server slots (default 2)")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"], help="server --backend (default cpu)")
    ap.add_argument("--conversations", type=int, default=4, help="agent conversations (default 4)")
    ap.add_argument("--turns", type=int, default=4, help="tool-call turns per conversation (default 4)")
    ap.add_argument("--threads", type=int, default=None, help="server CPU threads (default: all cores)")
    ap.add_argument("--client-threads", type=int, default=None, help="client threads (default: conversations)")
    ap.add_argument("--step-tokens", type=int, default=256, help="server --step-tokens (default 256)")
    ap.add_argument("--long-read-tokens", type=int, default=4000, help="B's fresh prompt, tokens (default 4000)")
    ap.add_argument("--stream-tokens", type=int, default=200, help="A's streamed answer, max_tokens (default 200)")
    ap.add_argument("--ctx-size", type=int, default=None, help="server --ctx-size (default: fits the workload)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="server --kv-tokens (default: ctx-size x parallel)")
    ap.add_argument("--model", default=None, help="server --model (default: the default model)")
    ap.add_argument("--decode-share", type=float, default=0.8,
                    help="server time budget: decoders keep this share of their speed during reads "
                         "(STRATA_LITE_DECODE_SHARE; 0 = off, the plain step_tokens budget; default 0.8)")
    ap.add_argument("--url", default=None, help="use this running server instead of starting one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-timeout", type=float, default=900.0, help="seconds to wait for /health")
    args = ap.parse_args(argv)
    if args.conversations < 2:
        ap.error("--conversations must be >= 2 (A streams while B reads)")
    args.client_threads = args.client_threads or args.conversations
    need = 1200 + args.turns * 700 + max(args.long_read_tokens, args.stream_tokens) + 512
    args.ctx_size = args.ctx_size or max(8192, -(-need // 1024) * 1024)

    from openai import OpenAI
    rng = random.Random(args.seed)
    run_id = f"{os.getpid()}-{int(time.time())}"      # fresh conversations even against a warm server
    corpus = source_corpus()
    server = None
    t_start = time.perf_counter()
    try:
        if args.url:
            url = args.url.rstrip("/").removesuffix("/v1")
        else:
            server = ServerProcess(args)
            url = server.url
            print(f"starting the server on {url} (--parallel {args.parallel}, --ctx-size {args.ctx_size}, "
                  f"--step-tokens {args.step_tokens}, decode share {args.decode_share or 'off'})", flush=True)
            server.wait_ready(args.load_timeout)
        client = OpenAI(base_url=url + "/v1", api_key=os.environ.get("STRATA_LITE_API_KEY", "none"),
                        timeout=1800, max_retries=0)
        model = client.models.list().data[0].id
        t0 = time.perf_counter()
        sizer = Sizer(args.model)
        sizer.chars_per_token = warm_up(client, model, corpus, rng)
        print(f"ready: {model}; warm-up {time.perf_counter() - t0:.1f} s", flush=True)

        before = read_metrics(url)
        mark = server.mark() if server else 0
        convs = [Conversation(i, run_id, random.Random(args.seed * 1000 + i)) for i in range(args.conversations)]
        t0 = time.perf_counter()
        turns = run_turns(client, model, convs, args, corpus, sizer, rng)
        t_turns = time.perf_counter() - t0
        print(f"turns done in {t_turns:.1f} s; decode-starvation phase", flush=True)
        mid = read_metrics(url)
        solo, both, b, overlap = starvation(client, model, convs[0], convs[1], args, corpus, sizer, rng, url)
        after = read_metrics(url)
        reads = server.reads_since(mark) if server else []
    finally:
        if server:
            server.stop()

    # ---- numbers
    def d(key, m0=before, m1=after):
        return metric_delta(m0, m1, key)

    read_tok, reused, restored = (d(f'strata_prompt_tokens_total{{how="{h}"}}') for h in ("read", "reused", "restored"))
    needless = d("strata_needless_read_tokens_total")
    evicted = d("strata_evicted_read_tokens_total")
    step_s, steps = d("strata_step_seconds_sum"), d("strata_step_seconds_count")
    turn_read = d('strata_prompt_tokens_total{how="read"}', before, mid)
    errors = [s.error for s in turns + [solo, both, b] if s.error]
    ttfts = [s.ttft for s in turns if s.ttft is not None]
    cached = sum(s.usage.prompt_tokens_details.cached_tokens or 0 for s in turns
                 if s.usage and s.usage.prompt_tokens_details)
    prompt_total = sum(s.usage.prompt_tokens for s in turns if s.usage)
    solo_rate, solo_step, _ = decode_stats(solo)
    win = during_read(both, b)
    share = win["rate"] / solo_rate if win and solo_rate else None
    gap_ratio = win["max_gap"] / solo_step if win and solo_step else None
    b_read_s = b.ttft
    b_prompt = b.usage.prompt_tokens if b.usage else None
    b_cached = (b.usage.prompt_tokens_details.cached_tokens or 0) if b.usage and b.usage.prompt_tokens_details else 0
    read_secs = sum(s for _, s in reads) if server else None

    # the engine's own step times while A decoded next to B's read (histogram buckets of strata_step_seconds)
    o0, o1 = overlap
    n_ov, s_ov = d("strata_step_seconds_count", o0, o1), d("strata_step_seconds_sum", o0, o1)
    hist = []
    prev = 0.0
    for le in ("0.1", "0.2", "0.5", "1.0", "+Inf"):
        c = d(f'strata_step_seconds_bucket{{le="{le}"}}', o0, o1)
        if c is not None:
            hist.append(f"{'>1.0' if le == '+Inf' else '<=' + le}:{c - prev:.0f}")
            prev = c
    rows = [
        ("agent turns (conversations x turns, slots)", f"{len(turns)} ({args.conversations}x{args.turns}, {args.parallel})", "", None),
        ("errors", str(len(errors)), "0", not errors),
        ("prompt tokens read (all phases)", fmt(read_tok), "", None),
        ("  of which in agent turns", fmt(turn_read), "", None),
        ("prompt tokens reused (device)", fmt(reused), "", None),
        ("prompt tokens restored (host->device)", fmt(restored), "", None),
        ("agent turns: cached / prompt tokens (usage)", f"{cached} / {prompt_total}", "", None),
        ("needless read tokens", fmt(needless), "0", None if needless is None else needless == 0),
        ("re-read after eviction for memory", fmt(evicted), "", None),
        ("read seconds, sum over admissions (log)",
         fmt(read_secs, ".1f", " s") + (f" ({len(reads)} adm.)" if server else ""), "", None),
        ("engine step seconds / steps (metrics)", f"{fmt(step_s, '.1f', ' s')} / {fmt(steps)}", "", None),
        ("agent-turn TTFT median / p90 (client)",
         f"{fmt(pct(ttfts, 0.5), '.2f', ' s')} / {fmt(pct(ttfts, 0.9), '.2f', ' s')}", "", None),
        ("A solo: decode tok/s, median step", f"{fmt(solo_rate, '.1f')} tok/s, {fmt(solo_step and solo_step * 1e3, '.0f', ' ms')}", "", None),
        ("B long read: prompt (cached), TTFT, read tok/s",
         f"{b_prompt} ({b_cached}), {fmt(b_read_s, '.1f', ' s')}, "
         f"{fmt(b_prompt and b_read_s and (b_prompt - b_cached) / b_read_s, '.0f')}", "", None),
        ("A during B's read: window, tokens",
         f"{fmt(win and win['window'], '.1f', ' s')}, {win['n'] if win else 'n/a'}"
         + (f" ({win['window'] / b_read_s:.0%} of the read)" if win and b_read_s else ""), "", None),
        ("engine steps from B's send to A's end: n, mean",
         f"{fmt(n_ov)}, {fmt(n_ov and s_ov / n_ov * 1e3, '.0f', ' ms')}", "", None),
        ("  their durations (s)", " ".join(hist) or "n/a", "", None),
        ("A tok/s during B's read / solo", f"{fmt(win and win['rate'], '.1f')} / {fmt(solo_rate, '.1f')} = {fmt(share, '.2f')}",
         f">= {TARGET_DECODE_SHARE:.2f}", None if share is None else share >= TARGET_DECODE_SHARE),
        ("A largest gap during B's read / solo step",
         f"{fmt(win and win['max_gap'] * 1e3, '.0f', ' ms')} = {fmt(gap_ratio, '.1f', 'x')}",
         f"<= {TARGET_GAP_RATIO:.0f}x", None if gap_ratio is None else gap_ratio <= TARGET_GAP_RATIO),
    ]
    print()
    print_table(rows)
    for e in errors[:5]:
        print("error:", e)
    print(f"A's answer ({solo.usage.completion_tokens if solo.usage else '?'} tokens solo, "
          f"{both.usage.completion_tokens if both.usage else '?'} during the read): {both.text[:60]!r}...")
    if both.usage and len(both.times) != both.usage.completion_tokens:
        print(f"note: A's stream had {len(both.times)} content chunks for {both.usage.completion_tokens} tokens")
    slow = [ln for ln in (server.lines if server else []) if "slow step" in ln]
    for ln in slow[-5:]:
        print("server:", ln.split("strata_lite: ", 1)[-1])
    print(f"total {time.perf_counter() - t_start:.0f} s")
    ok = not errors and needless == 0 and share is not None and share >= TARGET_DECODE_SHARE \
        and gap_ratio is not None and gap_ratio <= TARGET_GAP_RATIO
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
