"""perf/bench_threads.py and perf/bench_gemm_lanes.py run small: every waiting mode and thread count asked for is
timed in its own process, every path on every model; both GEMM widths give one set of bits (what they measure,
not how fast)."""
import os
import sys

import pytest

from tiny_model import write_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
import bench_gemm_lanes  # noqa: E402  (perf/ is not a package)
import bench_threads  # noqa: E402


def test_every_mode_and_thread_count_is_timed(tmp_path, capsys):
    import numba
    model = str(tmp_path / "m.gguf")
    write_tiny_model(model, n_layers=2)
    threads = [1, 2] if numba.config.NUMBA_NUM_THREADS >= 2 else [1]
    res = bench_threads.main(["--threads", ",".join(map(str, threads)), "--waits", "default,passive",
                              "--rounds", "1", "--model", model, "--tiny", model, "--shared"])
    assert sorted(res) == ["default", "passive"]
    for mode in res.values():
        assert mode["layer"] in ("omp", "tbb", "workqueue")
        assert sorted(mode["threads"], key=int) == [str(t) for t in threads]
        for row in mode["threads"].values():
            assert len(row["region_us"]) == 1 and row["region_us"][0] > 0
            for label in ("24 blocks, cache-resident", "m.gguf"):
                assert sorted(row[label]) == ["one-call", "per-call", "shared"]
                assert all(len(v) == 1 and v[0] > 0 for v in row[label].values())
    assert "| passive | 1 |" in capsys.readouterr().out


def test_unknown_waiting_mode_is_named(capsys):
    with pytest.raises(SystemExit):
        bench_threads.main(["--waits", "default,busy"])
    assert "unknown mode(s) busy" in capsys.readouterr().err


@pytest.mark.skipif(not bench_gemm_lanes.isa.WIDE_BUILT, reason="no AVX-512 VNNI (as Numba compiles for this CPU): "
                    "no 512-bit tiles to compare")
def test_gemm_lanes_times_both_widths():
    rows = bench_gemm_lanes.main(["--rounds", "1", "--threads", "1", "--tokens", "33",
                                  "--shapes", "0.5B attn_out Q5_0", "1.5B q IQ3_XXS"])
    assert [r[:3] for r in rows] == [("0.5B attn_out Q5_0", 33, 1), ("1.5B q IQ3_XXS", 33, 1)]
    assert all(r[3] > 0 and r[4] > 0 for r in rows)
