"""perf/bench_decode_block.py run small: it times the three paths on its cache-resident model and on the model it
is given, and every block of those takes the one-call path (what it measures, not how fast)."""
import os
import sys

from tiny_model import write_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
import bench_decode_block  # noqa: E402  (perf/ is not a package)


def test_every_path_timed_on_both_models(tmp_path, capsys):
    model = str(tmp_path / "m.gguf")
    write_tiny_model(model, n_layers=3)
    rows = bench_decode_block.main(["--model", model, "--rounds", "1"])
    assert [(r["taken"], r["blocks"]) for r in rows] == [(24, 24), (3, 3)]
    for r in rows:
        assert len(r["on"]) == len(r["shared"]) == len(r["off"]) == 1 and min(r["on"] + r["shared"] + r["off"]) > 0
    out = capsys.readouterr().out
    assert "| 24 blocks, cache-resident (9 MB) |" in out and "| m.gguf |" in out
