"""Replay agent conversations against `strata-lite fleet` (CPU replicas behind sglang-router) and print,
per replica count and routing policy: prompt tokens read vs reused/restored across the fleet, cross-replica
needless re-reads, and time to first token.

More conversations than the fleet has slots; every conversation shares one system prompt and grows by a
tool result (`--tool-tokens` of source text) and a follow-up per turn; turns are sent one at a time in
seeded random order across conversations (streamed, greedy, `--max-tokens`). After each turn every
replica's /metrics is read: the replica whose prompt-token counters moved served it. A cross-replica
needless re-read is a turn's prompt tokens read on one replica although another replica held them: the
conversation's previous turn (its prompt and answer) was served elsewhere and the serving replica read
more than the new part. The shared system prompt read once per replica is not counted as needless.

usage: python perf/bench_fleet.py [--replicas 2 4] [--policies cache_aware round_robin] [--conversations 6]
           [--turns 3] [--tool-tokens 120] [--max-tokens 8] [--threads-per-replica 1] [--model M]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import openai

from bench_agent import Conversation, Sizer, http_get, pct, read_metrics, source_corpus, stream_chat

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from live_server import free_port_run, wait_until  # noqa: E402  (the tests' helpers for live servers)

READ, REUSED, RESTORED, DISK = ('strata_prompt_tokens_total{how="read"}', 'strata_prompt_tokens_total{how="reused"}',
                                'strata_prompt_tokens_total{how="restored"}', 'strata_prompt_tokens_total{how="disk"}')


def http_json(url: str):
    code, text = http_get(url)
    if code != 200:
        raise RuntimeError(f"GET {url} answered {code}")
    return json.loads(text)


def counters(urls) -> list[tuple[float, float, float]]:
    out = []
    for u in urls:
        m = read_metrics(u)
        out.append((m.get(READ, 0.0), m.get(REUSED, 0.0), m.get(RESTORED, 0.0), m.get(DISK, 0.0)))
    return out


def run_config(args, n_replicas: int, policy: str, corpus: str, sizer: Sizer, restart: bool = False) -> dict:
    """One replay; with `restart`, replica 0 (started with a disk tier) is killed half-way and the fleet
    restarts it: the turns it then serves for conversations it held show what came back from its disk."""
    port = free_port_run(n_replicas + 1)
    disk = ["--kv-disk", tempfile.mkdtemp(prefix="strata-fleet-kv-")] if restart else []
    cmd = [sys.executable, "-m", "strata_lite.cli", "fleet", "-n", str(n_replicas), "--policy", policy,
           "--port", str(port), "--threads-per-replica", str(args.threads_per_replica), "--", "--parallel", "1",
           "--ctx-size", "8192", "--host-kv-gib", "1", "--spec", "off"] + disk + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router, replicas = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{port + 1 + i}" for i in range(n_replicas)]
    try:
        client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=600)
        wait_until(lambda: client.models.list().data, 900, "the fleet")
        model = client.models.list().data[0].id
        for u in replicas:                      # compile the kernels on every replica before measuring
            warm = openai.OpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=600)
            stream_chat(warm, model, [{"role": "user", "content": f"warm-up {u}"}], 2)
        rng = random.Random(args.seed)
        convs = [Conversation(i, f"fleet{n_replicas}{policy}", random.Random(args.seed * 100 + i))
                 for i in range(args.conversations)]
        order = [c for c in convs for _ in range(args.turns)]
        rng.shuffle(order)
        last: dict[int, tuple[int, int]] = {}   # conversation -> (replica, tokens it held: prompt + answer)
        prompt = read = cached = needless = 0
        ttfts, errors = [], 0
        held_by_0, after_restart = set(), dict(turns=0, from_disk=0, from_zero=0)
        before = counters(replicas)
        for k, conv in enumerate(order):
            if restart and k == len(order) // 2:
                held_by_0 = {c for c, (r, _) in last.items() if r == 0}
                pid = http_json(replicas[0] + "/server_info")["pid"]
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda: http_json(replicas[0] + "/server_info")["pid"] != pid, 600, "the restarted replica")
                stream_chat(openai.OpenAI(base_url=replicas[0] + "/v1", api_key="none", max_retries=0, timeout=600),
                            model, [{"role": "user", "content": "warm-up after the restart"}], 2)
                time.sleep(3 * 2)                # the router's health checks bring it back into rotation
                before = counters(replicas)
            st = stream_chat(client, model, conv.messages, args.max_tokens)
            after = counters(replicas)
            moved = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
            disk_0 = after[0][3] - before[0][3]          # tokens replica 0 restored from its disk in this turn
            before = after
            if st.error or st.usage is None or len(moved) != 1:
                errors += 1
                continue
            r, u = moved[0], st.usage
            c = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            prompt, cached, read = prompt + u.prompt_tokens, cached + c, read + u.prompt_tokens - c
            if conv.i in last and last[conv.i][0] != r:
                needless += max(0, min(last[conv.i][1], u.prompt_tokens) - c)
            if conv.i in held_by_0 and r == 0:
                held_by_0.discard(conv.i)        # its first turn after the restart
                after_restart["turns"] += 1
                after_restart["from_disk"] += int(disk_0)
                after_restart["from_zero"] += int(c == 0)
            last[conv.i] = (r, u.prompt_tokens + u.completion_tokens)
            ttfts.append(st.ttft)
            conv.append_turn(corpus, st.text, args.tool_tokens, sizer)
        return dict(replicas=n_replicas, policy=policy, prompt=prompt, read=read, cached=cached,
                    needless=needless, ttft50=pct(ttfts, 0.5), ttft99=pct(ttfts, 0.99), errors=errors,
                    turns=len(order), restart=after_restart if restart else None)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tool-tokens", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--restart-mid", action="store_true",
                    help="also: a cache_aware replay with a disk tier where replica 0 is killed half-way")
    args = ap.parse_args(argv)
    corpus, sizer = source_corpus(), Sizer(args.model)
    rows = [run_config(args, n, p, corpus, sizer) for n in args.replicas for p in args.policies]
    if args.restart_mid:
        rows.append(run_config(args, args.replicas[0], "cache_aware", corpus, sizer, restart=True))
    print(f"fleet replay: {args.conversations} conversations x {args.turns} turns, {os.cpu_count()} cores, "
          f"{args.threads_per_replica} thread(s) per replica, 1 slot each")
    print(f"{'replicas':>8} {'policy':<12} {'prompt':>7} {'read':>6} {'reused+restored':>15} "
          f"{'needless (cross-replica)':>24} {'TTFT p50':>8} {'p99':>6} {'errors':>6}")
    for r in rows:
        share = r["needless"] / r["prompt"] if r["prompt"] else 0.0
        print(f"{r['replicas']:>8} {r['policy']:<12} {r['prompt']:>7} {r['read']:>6} {r['cached']:>15} "
              f"{r['needless']:>16} ({share:5.1%}) {r['ttft50']:>7.2f}s {r['ttft99']:>5.2f}s {r['errors']:>6}")
        if r["restart"] is not None:
            x = r["restart"]
            print(f"{'':>8} (replica 0 killed half-way and restarted, disk tier on: {x['turns']} turns of "
                  f"conversations it held came back to it, {x['from_disk']} tokens restored from its disk, "
                  f"{x['from_zero']} read again from token 0)")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
