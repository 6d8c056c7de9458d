"""perf/bench_decode_bandwidth.py run small: every matrix a decode step multiplies is in exactly one class, each
class and the step are timed, and the byte counts are the matrices' own (what it measures, not how fast)."""
import os
import sys

from tiny_model import write_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
import bench_decode_bandwidth  # noqa: E402  (perf/ is not a package)


def test_classes_cover_the_step_and_are_timed(tmp_path, capsys):
    model = str(tmp_path / "m.gguf")
    write_tiny_model(model, n_layers=3)
    res = bench_decode_bandwidth.main(["--model", model, "--rounds", "2", "--flush-mb", "8"])
    from strata_lite import LLM
    m = LLM(model, backend="cpu", n_ctx=64).model
    step = [w for ws in bench_decode_bandwidth.step_order(m) for w in ws]
    assert len(step) == sum(c["count"] for c in res["classes"]) >= 3 * 3 + 1   # fused qkv, o, gate_up, down + output
    assert res["step"]["bytes"] == sum(c["bytes"] for c in res["classes"]) == sum(w.raw.nbytes for w in step)
    for c in res["classes"]:
        assert len(c["kernel"]) == len(c["read"]) == 2 and min(c["kernel"] + c["read"]) > 0
    assert len(res["step"]["ms"]) == len(res["step"]["read_ms"]) == 2 and min(res["step"]["ms"]) > 0
    out = capsys.readouterr().out
    assert "| output | Q8_0," in out and "the step takes" in out
