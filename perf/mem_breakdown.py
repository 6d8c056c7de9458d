"""Where the CPU process's memory goes: RSS (and its anonymous / file-backed parts, and the pages of the
model file's mapping) after each load step and forward of perf/bench_e2e.py's run (512-token prompt,
then decodes), plus the sizes of the weights the CPU backend holds. docs/cpu.md has the figures.

usage: python perf/mem_breakdown.py [--model PATH] [--threads 2]
The first run after installing or editing a kernel file also shows Numba compiling (NUMBA_CACHE_DIR=an
empty folder forces that); bench_e2e.py's peak RSS is the last line's "peak" on a warm cache.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()


def _status() -> dict:
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                d[k] = int(v.split()[0]) / 1024
    return d


def _mapped_mib(path: str) -> float:
    """Resident pages of this process's mappings of `path` (MiB)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total / 1024


class Steps:
    def __init__(self):
        self.model, self.last = None, 0.0

    def __call__(self, what: str) -> None:
        s = _status()
        mapped = _mapped_mib(self.model) if self.model else 0.0
        print(f"{what:<44}{s['VmRSS']:8.1f}{s['VmRSS'] - self.last:+8.1f}{s['RssAnon']:8.1f}{s['RssFile']:8.1f}"
              f"{mapped:8.1f}{s['VmHWM']:8.1f}   {time.perf_counter() - _T0:5.1f} s", flush=True)
        self.last = s["VmRSS"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not sys.platform.startswith("linux"):
        print("needs Linux (/proc/self/status, /proc/self/smaps)")
        return 1
    step = Steps()
    print(f"{'MiB after':<44}{'RSS':>8}{'delta':>8}{'anon':>8}{'file':>8}{'model':>8}{'peak':>8}")
    step("python")
    import numba  # noqa: F401  (numpy, numba and llvmlite)
    step("import numpy + numba")
    import numpy as np
    from strata_lite.batch import Batch
    from strata_lite.kernels import get_backend
    from strata_lite.kv_cache import KVCache
    from strata_lite.loader.gguf_file import GGUFFile
    from strata_lite.loader.known_models import resolve_model
    from strata_lite.loader.model_config import config_from_metadata
    from strata_lite.loader.tokenizer import Tokenizer
    from strata_lite.loader.weights import load_weights
    from strata_lite.models import MODELS
    from strata_lite.runner import chat_template_of
    step("import strata_lite")
    path = resolve_model(args.model)
    step.model = os.path.realpath(path)
    gguf = GGUFFile(path)
    cfg = config_from_metadata(gguf.metadata, path)
    step("GGUF header parsed (metadata)")
    tok = Tokenizer.from_gguf_metadata(gguf.metadata, source=path)
    chat_template_of(gguf.metadata, tok)
    step("tokenizer")
    be = get_backend("cpu", args.threads)
    step("CPU backend (Numba threads)")
    model = MODELS[cfg.arch](be, cfg, load_weights(gguf, cfg))
    step("weights uploaded (repacked, fused)")
    del gguf
    n_pp, n_tg = 512, 128
    n_ctx = n_pp + n_tg + 16
    kv = KVCache(be, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_pages=math.ceil(n_ctx / 64), page_size=64)
    model.reserve(512, n_ctx, 1)
    step(f"KV cache ({n_ctx} positions), reserve()")

    held = {}
    for layer in [*model.layers, model]:
        for name in dir(layer):
            w = getattr(layer, name, None)
            if hasattr(w, "layout") and hasattr(w, "raw"):
                held[id(w.raw)] = w
    by_kind = {}
    for w in held.values():
        root = w.raw
        while getattr(root, "base", None) is not None and not isinstance(root, np.memmap):
            root = root.base
        kind = "mapped file" if isinstance(root, np.memmap) else "copy"
        key = (kind, w.src_qtype.name, w.layout)
        by_kind[key] = by_kind.get(key, 0) + w.raw.nbytes
    for (kind, qtype, layout), n in sorted(by_kind.items()):
        print(f"    weights, {kind:<12}{qtype:<8}{layout:<12}{n / 2**20:8.1f} MiB")
    kv_bytes = sum(a.nbytes for a in (kv.k_pages, kv.k_scales, kv.v_pages, kv.v_scales))
    print(f"    KV cache arrays {kv_bytes / 2**20:.1f} MiB")

    text = (Path(__file__).resolve().parent.parent / "tests" / "data" / "heapq.py").read_text(encoding="utf-8")
    ids = np.asarray(tok.encode(text, add_special=False)[:n_pp], np.int32)
    pages = list(range(kv.n_pages))
    model.forward(Batch.single(ids[:1], 0, pages, [0]), kv)
    step("first decode (kernels compiled or loaded)")
    for k in range(2):
        model.forward(Batch.single(ids, 0, pages, [n_pp - 1]), kv)
        step(f"prompt of {n_pp} tokens, {'first' if k == 0 else 'again'}")
    tok_id = int(ids[0])
    for i in range(n_tg):
        tok_id = int(np.argmax(model.forward(Batch.single(np.array([tok_id], np.int32), i, pages, [0]), kv)[0]))
    step(f"{n_tg} decodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
