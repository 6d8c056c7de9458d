"""One decode token's CPU attention over a long int8 KV cache, against the bytes it reads.

    python perf/bench_attention_cpu.py [--keys 4096,16384,32768] [--runs 9] [--threads N] [--prompt]

For each shape (query heads / KV heads / head_dim, layers) and key count: the time of one layer's
`attention` call for one query token on each q.k path (attention.QK_PATHS; min / median of --runs
rounds, the paths alternating within a round), the GB/s of int8 K/V + scales that makes, the same
bytes' time at the machine's copy bandwidth (numpy copy of 256 MiB, read + write counted), and the
whole step's attention (x layers). --prompt times a 512-token prompt chunk over the keys instead (its
last 512 positions). Numbers for docs/cpu.md ("CPU attention at long context").
"""
import argparse
import time

import numba
import numpy as np

from strata_lite.kernels.cpu import attention as att
from strata_lite.kernels.kv_layout import kv_shapes

SHAPES = [("0.5B: 14/2 heads, head_dim 64", 14, 2, 64, 24), ("8B: 32/8 heads, head_dim 128", 32, 8, 128, 32)]
PAGE = 256


def copy_bandwidth():
    a = np.ones(256 << 20, np.uint8)
    b = np.empty_like(a)
    best = min(_time(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def case(n_heads, n_kv, hd, n_keys, n_tok=1):
    pages, scales = kv_shapes(1, n_keys // PAGE, PAGE, n_kv, hd)
    rng = np.random.default_rng(0)
    kp, vp = (rng.integers(-127, 128, pages[1:], dtype=np.int8) for _ in range(2))
    ks, vs = (rng.uniform(0.001, 0.01, scales[1:]).astype(np.float32) for _ in range(2))
    table = np.arange(n_keys // PAGE, dtype=np.int32)[None, :]
    q = rng.standard_normal((n_tok, n_heads, hd), dtype=np.float32)
    pos = np.arange(n_keys - n_tok, n_keys, dtype=np.int32)
    args = (q, np.zeros(n_tok, np.int32), pos, table, kp, ks, vp, vs, hd ** -0.5)
    return args, kp.nbytes + vp.nbytes + ks.nbytes + vs.nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="4096,16384,32768")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", action="store_true")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    bw = copy_bandwidth()
    paths = att.QK_PATHS
    print(f"threads {numba.get_num_threads()}, copy bandwidth {bw / 1e9:.1f} GB/s; q.k paths {paths}")
    print("| shape | keys | KV MB/layer | path | us/layer min / median | GB/s | at copy bw | ms/step (x layers) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, nh, nkv, hd, layers in SHAPES:
        for n_keys in (int(k) for k in a.keys.split(",")):
            args, nbytes = case(nh, nkv, hd, n_keys, 512 if a.prompt else 1)
            out = np.empty_like(args[0])
            times = {p: [] for p in paths}
            for p in paths:
                att.attention(*args, out, qk=p)                  # compile / warm
            for _ in range(a.runs):                              # alternating: the VM's noise hits both
                for p in paths:
                    times[p].append(_time(lambda: att.attention(*args, out, qk=p)))
            for p in paths:
                t = sorted(times[p])
                tmin, tmed = t[0], t[len(t) // 2]
                print(f"| {name} | {n_keys} | {nbytes / 1e6:.1f} | {p} | {tmin * 1e6:.0f} / {tmed * 1e6:.0f} | "
                      f"{nbytes / tmin / 1e9:.1f} | {nbytes / bw * 1e6:.0f} us | {tmed * layers * 1e3:.1f} |")


if __name__ == "__main__":
    main()
