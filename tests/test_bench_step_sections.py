"""perf/bench_step_sections.py run small on a tiny model with an MTP block: a row per mode with decode-only steps,
its sections inside the step's time, and drafts only where the mode drafts (what it measures, not how fast)."""
import os
import sys

from gguf import GGMLQuantizationType as QT

from tiny_model import write_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
import bench_step_sections  # noqa: E402  (perf/ is not a package)


def test_sections_by_mode(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "mtp.gguf", mtp=True, arch="qwen2", qtype=QT.Q8_0)
    res = bench_step_sections.main(["--model", str(model), "--slots", "2", "--max-tokens", "16", "--specs",
                                    "off,mtp:1", "--kinds", "code", "--threads", "1"])
    assert set(res) == {("code", "off"), ("code", "mtp:1")}
    for (_, spec), r in res.items():
        us = r["us"]
        assert r["steps"] > 0 and r["tokens_per_step"] >= 1 and r["tok_s"] > 0, r
        inside = us["plan"] + us["forward"] + us["sample"] + us["complete"]
        assert 0 < inside <= us["step"] * (1 + 1e-9), r
        assert us["chain"] <= us["plan"] and us["fill"] <= us["complete"], r
        assert (r["drafted"] > 0) == (spec != "off") and r["accepted"] <= r["drafted"], r
        assert (us["fill"] > 0) == (spec != "off"), r        # the block's fill runs where a block is loaded
    out = capsys.readouterr().out
    assert "decode-only steps" in out and "mtp:1" in out, out
