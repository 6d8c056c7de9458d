"""perf/mtp_chain_walk.py: the walk over teacher-forced hits against a hand count, and the tool run small on a tiny
model with an MTP block (its tokens are checked against the engine's, and the two acceptance figures printed side
by side: what it measures, not how good the tiny block is)."""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as QT

from tiny_model import write_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
import mtp_chain_walk  # noqa: E402  (perf/ is not a package)


def test_walk_accepts_the_leading_right_depths_and_moves_past_them():
    """Tokens 0..12, the first generated token at 4 (drafts from row 3). Depth 1 right at rows 3, 5, 6, 9, depth 2
    at rows 3 and 6, depth 3 at row 6. K = 3: step at m = 4 (row 3) accepts 2 -> m = 7 (row 6) accepts 3 -> m = 11:
    11 + 3 > 12 ends. K = 1: m = 4 (1) -> 6 (1: row 5) -> 8 (0: row 7) -> 9 (0) -> 10 (1: row 9) -> 12 ends."""
    T = 12
    hits = [np.zeros(T - d, bool) for d in range(3)]
    hits[0][[3, 5, 6, 9]] = True
    hits[1][[3, 6]] = True
    hits[2][6] = True
    assert mtp_chain_walk.walk(hits, 4, 12, 3) == [2, 3]
    assert mtp_chain_walk.walk(hits, 4, 12, 1) == [1, 1, 0, 0, 1]
    assert mtp_chain_walk.walk(hits, 4, 12, 2) == [2, 2, 1]          # m = 4, 7, 10 (row 9: depth 1 only), 12
    assert mtp_chain_walk.walk(hits, 11, 12, 2) == []


def test_tool_on_a_tiny_model(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "mtp.gguf", mtp=True, arch="qwen2", qtype=QT.F32)
    res = mtp_chain_walk.main(["--model", str(model), "--code", "2", "--max-tokens", "24", "--ks", "1,3",
                               "--engine", "--threads", "1"])
    assert len(res["agreement"]) == 3 and all(0 <= a <= 1 for a in res["agreement"])
    for k in (1, 3):
        assert 0 <= res["walk"][k] <= k and 0 <= res["engine"][k] <= k
        assert len(res["reach"][k]) == k and sorted(res["reach"][k], reverse=True) == res["reach"][k]
    out = capsys.readouterr().out
    assert "walk acc/step" in out and "agreement along the answers" in out, out
