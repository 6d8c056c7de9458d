"""perf/ab_builds.py: builds alternate in their own processes, a row's runs pool across inner rounds and burst
times, and a failed run is reported and makes the exit status 1 (a stand-in benchmark script, no GPU)."""
import json
import os
import subprocess
import sys
import textwrap

PERF = os.path.join(os.path.dirname(__file__), "..", "perf")

FAKE = textwrap.dedent('''
    import json, sys
    a = sys.argv[1:]
    build = a[a.index("--build") + 1] if "--build" in a else "default"
    out = a[a.index("--json") + 1]
    with open(sys.argv[0] + ".args", "a") as f:
        f.write(json.dumps(a) + "\\n")
    with open(sys.argv[0] + ".log", "a") as f:
        f.write(build + "\\n")
    if build == "broken":
        print("no such kernel"); sys.exit(3)
    base = {"default": 100.0, "fast": 150.0}[build] * (2 if "--one-row-max" in a else 1)
    rows = [["m.gguf decode batch 1 ctx 512 round %d" % r, base + r] for r in (1, 2, 3)]
    rows.append(["m.gguf engine decode 16 slots, every first token by 0.%d1 s" % len(build), 10 * base])
    json.dump({"device": "fake", "batched": rows}, open(out, "w"))
''')


def _run(tmp_path, builds, *extra):
    bench = tmp_path / "fake_bench.py"
    bench.write_text(FAKE)
    arms = ["--builds", builds] if builds else []
    r = subprocess.run([sys.executable, os.path.join(PERF, "ab_builds.py"), *arms, "--rounds", "2",
                        "--bench", str(bench), *extra], capture_output=True, text=True, timeout=120)
    order = (tmp_path / "fake_bench.py.log").read_text().split()
    return r, order


def test_builds_alternate_and_rows_pool(tmp_path):
    r, order = _run(tmp_path, "default,fast", "--only", "8b", "--contexts", "512")
    assert r.returncode == 0, r.stdout + r.stderr
    assert order == ["default", "fast", "default", "fast"]
    lines = r.stdout.splitlines()
    decode = next(line for line in lines if line.startswith("m.gguf decode batch 1 ctx 512"))
    engine = next(line for line in lines if line.startswith("m.gguf engine decode 16 slots"))
    assert "101-103" in decode and "151-153" in decode and decode.split()[-1] == "1.490"   # medians 152 / 102
    assert "1,000-1,000" in engine and "1,500-1,500" in engine and engine.split()[-1] == "1.500"


def test_bench_arguments_are_passed_on(tmp_path):
    r, _ = _run(tmp_path, "default,fast", "--only", "8b-layers", "--contexts", "512,4096", "--one-row-max", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [json.loads(line) for line in (tmp_path / "fake_bench.py.args").read_text().splitlines()]
    assert len(runs) == 4
    for a in runs:
        assert a[0] == "--batched"
        for flag, value in (("--only", "8b-layers"), ("--contexts", "512,4096"), ("--one-row-max", "0")):
            assert a[a.index(flag) + 1] == value


def test_a_failed_run_is_reported(tmp_path):
    r, order = _run(tmp_path, "default,broken")
    assert r.returncode == 1
    assert "arm broken" in r.stdout and "exited 3" in r.stdout and "no such kernel" in r.stdout
    line = next(line for line in r.stdout.splitlines() if line.startswith("m.gguf decode batch 1 ctx 512"))
    assert line.split()[-2:] == ["-", "-"]


def test_arms_of_other_arguments(tmp_path):
    """--arm gives each arm its own bench arguments (here the same build with and without --one-row-max)."""
    r, order = _run(tmp_path, None, "--arm", "", "--arm", "--one-row-max 0")
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [json.loads(line) for line in (tmp_path / "fake_bench.py.args").read_text().splitlines()]
    assert ["--one-row-max" in a for a in runs] == [False, True, False, True]
    decode = next(line for line in r.stdout.splitlines() if line.startswith("m.gguf decode batch 1 ctx 512"))
    assert decode.split()[-1] == "1.980"          # medians 202 / 102
    bad = subprocess.run([sys.executable, os.path.join(PERF, "ab_builds.py"), "--builds", "a,b", "--arm", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not both" in bad.stderr
