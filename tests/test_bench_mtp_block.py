"""perf/bench_mtp_block.py run small on a tiny model with an MTP block: one timing per row count asked for,
printed per forward and per row for the fill and the whole block (what it measures, not how fast)."""
import os
import sys

from gguf import GGMLQuantizationType as QT

from tiny_model import write_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
import bench_mtp_block  # noqa: E402  (perf/ is not a package)


def test_one_timing_per_row_count(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "mtp.gguf", mtp=True, arch="qwen2", qtype=QT.Q8_0, n_embd=64, n_ff=128,
                             n_heads=4, n_kv_heads=2)
    rows = bench_mtp_block.main(["--model", str(model), "--rows", "1,8", "--runs", "1"])
    assert [n for n, _, _ in rows] == [1, 8] and all(fill > 0 and whole > 0 for _, fill, whole in rows)
    out = capsys.readouterr().out
    assert "rows    1: fill" in out and "rows    8: fill" in out and "whole block on every row" in out
