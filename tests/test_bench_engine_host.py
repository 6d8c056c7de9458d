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
    rows = bench_engine_host.main(["--model", model, "--slots", "4", "--tokens", "48", "--device-ms", "3",
                                   "--rounds", "1"])
    assert [r["consumers"] for r in rows] == ["threads", "poll"]
    for r in rows:
        # a step waits for the stand-in's 3 ms and then does host work; 4 tokens a step at most
        assert r["ms_step"] >= 3.0 and r["host_ms"] == pytest.approx(r["ms_step"] - 3.0)
        assert 0 < r["tok_s"] <= 4 / 3e-3 * 1.01
    out = capsys.readouterr().out
    assert "| 0 | threads |" in out and "| 0 | poll |" in out


@pytest.mark.parametrize("args", [["--consumers", "threads,queue"], ["--consumers", ""], ["--tokens", "2"]])
def test_bad_arguments_are_refused(args):
    with pytest.raises(SystemExit) as e:
        bench_engine_host.main(args)
    assert e.value.code == 2
