"""perf/bench_engine_host.py: the engine's host work per step on a device stand-in, run small on the tiny
model (what it measures and refuses, not how fast: timings belong to the benchmark's own output)."""
import os
import sys

import pytest

from tiny_model import write_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
import bench_engine_host  # noqa: E402  (perf/ is not a package)


def test_rounds_measure_steps_of_every_request_decoding(tmp_path, capsys):
    model = str(tmp_path / "m.gguf")
    write_tiny_model(model)
    rows = bench_engine_host.main(["--model", model, "--slots", "4", "--tokens", "96", "--device-ms", "3",
                                   "--rounds", "1"])
    assert [r["consumers"] for r in rows] == ["threads", "poll"]
    for r in rows:
        # a step ends at least 3 ms after the previous one ended (its launch came after that, and it waits for
        # the stand-in's 3 ms after its launch), so its rows give at most 4 tokens a 3 ms; the token window's
        # edges are the readers' clocks (the poller reads every 10 ms: up to ~4 steps early or late over ~95)
        assert r["ms_step"] >= 3.0 and r["host_ms"] == pytest.approx(r["ms_step"] - 3.0)
        assert 0 < r["tok_s"] <= 4 / 3e-3 * 1.15
    out = capsys.readouterr().out
    assert "| 0 | threads |" in out and "| 0 | poll |" in out


@pytest.mark.parametrize("args", [["--consumers", "threads,queue"], ["--consumers", ""], ["--tokens", "2"]])
def test_bad_arguments_are_refused(args):
    with pytest.raises(SystemExit) as e:
        bench_engine_host.main(args)
    assert e.value.code == 2
