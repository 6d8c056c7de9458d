"""A/B of kernel builds (or other bench arguments) end to end on the GPU: `perf/bench_gpu.py --batched` run in
its own process per arm, the arms alternating for several rounds (so the card's and the host's drift falls on
all alike), then one table of every row's tok/s per arm (the range over the rounds and their three inner rounds)
and the ratio of the medians against the first arm.

usage: python perf/ab_builds.py --builds default,unit_tails [--rounds 2] [--only 8b-layers-q4_k_m]
           [--contexts 512] [--one-row-max N] [--bench perf/bench_gpu.py]
       python perf/ab_builds.py --arm "" --arm "--iq3-groups off" [--only 8b-layers-iq3_xxs ...]

An arm is a build (--builds: each arm is `--build B`) or a string of bench_gpu.py arguments (--arm, repeated).

Each run writes its rows with --json into a temporary folder; a run that fails is reported with its last
output lines and leaves its build's cells empty for that round.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# what differs between the rows of one measurement: bench_gpu.py's inner round and the engine rows' burst time
_PER_RUN = re.compile(r" round \d+|, every first token by [0-9.]+ s")


def row_key(label: str) -> str:
    """A bench row's label without its inner round and burst time, so that a build's runs pool per row."""
    return _PER_RUN.sub("", label)


def run_once(bench: str, arm: list[str], extra: list[str], json_path: str) -> tuple[list[tuple[str, float]], str]:
    """One bench process with an arm's arguments -> (its batched rows (label, tok/s), the tail of its output on
    failure)."""
    cmd = [sys.executable, bench, "--batched", *arm, "--json", json_path, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(json_path):
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-12:])
        return [], f"{' '.join(cmd)} exited {r.returncode}:\n{tail}"
    with open(json_path) as f:
        rows = json.load(f).get("batched", [])
    return [(row_key(str(label)), float(rate)) for label, rate in rows], ""


def table(builds: list[str], results: dict[str, dict[str, list[float]]]) -> list[str]:
    """Lines of the comparison: per row label, each arm's min-max over its runs and the ratio of its median
    to the first arm's."""
    labels: list[str] = []
    for b in builds:
        for label in results[b]:
            if label not in labels:
                labels.append(label)
    head = f"{'row':72s}" + "".join(f" {b:>19s}" for b in builds) + "".join(
        f" {b + ' / ' + builds[0]:>24s}" for b in builds[1:])
    lines = [head]
    for label in labels:
        cells, medians = [], []
        for b in builds:
            v = results[b].get(label, [])
            cells.append(f" {min(v):9,.0f}-{max(v):<9,.0f}" if v else f" {'-':>19s}")
            medians.append(statistics.median(v) if v else None)
        ratios = [f" {m / medians[0]:24.3f}" if m and medians[0] else f" {'-':>24s}" for m in medians[1:]]
        lines.append(f"{label:72s}" + "".join(cells) + "".join(ratios))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", default=None, help="comma-separated qmatmul.BUILDS names; the first is the base")
    ap.add_argument("--arm", action="append", default=None,
                    help="bench_gpu.py arguments of one arm (repeat; the first is the base), instead of --builds")
    ap.add_argument("--rounds", type=int, default=2, help="processes per build, alternating (default 2)")
    ap.add_argument("--bench", default=os.path.join(HERE, "bench_gpu.py"), help="the benchmark script")
    ap.add_argument("--only", default=None, help="bench_gpu.py --only")
    ap.add_argument("--contexts", default=None, help="bench_gpu.py --contexts")
    ap.add_argument("--one-row-max", default=None, help="bench_gpu.py --one-row-max")
    args = ap.parse_args(argv)
    if (args.builds is None) == (args.arm is None):
        ap.error("give --builds or --arm, not both")
    if args.builds is not None:
        arms = {b: ["--build", b] for b in args.builds.split(",") if b}
    else:
        arms = {a.strip() or "(as given)": a.split() for a in args.arm}
    builds = list(arms)
    if len(builds) < 2 or args.rounds < 1:
        ap.error("two or more different arms (builds) are needed, --rounds at least 1")
    extra = []
    for flag, value in (("--only", args.only), ("--contexts", args.contexts), ("--one-row-max", args.one_row_max)):
        if value is not None:
            extra += [flag, str(value)]
    results: dict[str, dict[str, list[float]]] = {b: {} for b in builds}
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for b in builds:
                rows, err = run_once(args.bench, arms[b], extra, os.path.join(tmp, f"{builds.index(b)}-{rnd}.json"))
                if err:
                    failures += 1
                    print(f"round {rnd + 1}, arm {b}: {err}", flush=True)
                for label, rate in rows:
                    results[b].setdefault(label, []).append(rate)
                print(f"round {rnd + 1}, arm {b}: {len(rows)} rows", flush=True)
    print("\n".join(table(builds, results)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
