"""kernels/numba_cache.py: a cached Numba function that calls a kernel in another file of a stamped folder is
compiled again when that file changes (Numba alone would load the old callee), and loads from the cache when
nothing changed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

CALLEE = "from numba import njit\n\n\n@njit(cache=True)\ndef value():\n    return {}\n"
CALLER = "from numba import njit\n\nfrom .callee import value\n\n\n@njit(cache=True)\ndef call():\n    return value()\n"
STAMP = "from strata_lite.kernels.numba_cache import stamp_folder\n\nstamp_folder(__file__)\n"
RUN = ("from pkg.caller import call\nv = call()\n"
       "print(v, sum(call.stats.cache_hits.values()), sum(call.stats.cache_misses.values()))")


def _run(root: Path, env: dict) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", RUN], cwd=root, env=env, capture_output=True, text=True, check=True)
    value, hits, misses = map(int, out.stdout.split())
    return value, hits, misses


@pytest.mark.parametrize("where", ["in_tree", "NUMBA_CACHE_DIR"])
def test_an_edited_callee_compiles_its_callers_again(tmp_path, where):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(STAMP)
    (pkg / "caller.py").write_text(CALLER)
    (pkg / "callee.py").write_text(CALLEE.format(1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + sys.path)
    if where == "NUMBA_CACHE_DIR":
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba_cache")
    assert _run(tmp_path, env) == (1, 0, 1)          # compiled and written
    assert _run(tmp_path, env) == (1, 1, 0)          # nothing changed: loaded from the cache
    (pkg / "callee.py").write_text(CALLEE.format(2))
    assert _run(tmp_path, env) == (2, 0, 1)          # the callee's file changed: the caller compiled again
    assert _run(tmp_path, env) == (2, 1, 0)
    if where == "NUMBA_CACHE_DIR":
        assert not (pkg / "__pycache__").exists() or not list((pkg / "__pycache__").glob("*.nbi"))
