"""perf/bench_step_tokens.py run small on a tiny model with an MTP block: one row per token count its steps had,
each with a step and a forward time, and the step (which includes the drafting) never shorter than its forward
(what it measures, not how fast)."""
import os
import sys

from gguf import GGMLQuantizationType as QT

from tiny_model import write_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
import bench_step_tokens  # noqa: E402  (perf/ is not a package)


def test_rows_by_token_count(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "mtp.gguf", mtp=True, arch="qwen2", qtype=QT.Q8_0)
    rows = bench_step_tokens.main(["--model", str(model), "--spec", "mtp:2", "--prompts", "1",
                                   "--max-tokens", "24", "--threads", "1"])
    # a fixed width of 2 drafts two tokens every step: steps verify them with the pending token
    assert rows and set(rows) <= {1, 2, 3} and 3 in rows, rows
    assert all(n_steps > 0 and step_ms >= fwd_ms > 0 for n_steps, step_ms, fwd_ms in rows.values()), rows
    out = capsys.readouterr().out
    assert "3 tokens:" in out and "cost line:" in out, out
