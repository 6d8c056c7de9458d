"""CUDA attention over the paged int8 cache against the float64 reference (tests/kernels/reference.py) and
the CPU backend's attention on the same cache; batch invariance; split-parallel vs looped; graph replay.

Tolerances: the reference runs in float64 on the *same* dequantized int8 cache, so the only differences
are float32 rounding in the kernel: q.k over head_dim products (~sqrt(head_dim) * 6e-8 relative), exp2f
(2 ulp), p @ v over up to a few thousand keys and the fold of the splits' partials. All of that stays
well under 1e-5 of the output scale: |out - ref| <= 1e-5 * |ref| + 1e-5 * max|ref| (an absolute floor
relative to the output magnitude, since single outputs can be near zero). Against the CPU backend (also
float32, different order) the bound is the sum of both errors: 2e-5. On top of that, what rounding the p.V
weights P' to one f16 moves an output by (reference.f16_rounding_bound: every build), and for the A/B build
`q16` (attention.py BUILDS) q' as well.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_lite.kernels.cpu.attention import attention as cpu_attention, kv_store as cpu_kv_store
from strata_lite.kernels.kv_layout import kv_scale_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))       # tests/kernels: reference.py
import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

RTOL = 1e-5


class Cache:
    """A random int8 cache for a few sequences on non-contiguous pages, host (numpy) and device (cupy)."""

    def __init__(self, cp, rng, lens, n_kv, hd, page_size=16, amp=1.0):
        self.cp, self.hd, self.n_kv = cp, hd, n_kv
        max_pages = max(-(-n // page_size) for n in lens) + 1
        n_pages = len(lens) * max_pages + 5
        self.pt = rng.permutation(n_pages)[: len(lens) * max_pages].reshape(len(lens), max_pages).astype(np.int32)
        ng = kv_scale_groups(hd)
        pages = np.zeros((n_pages, page_size, n_kv, hd), np.int8)
        scales = np.zeros((n_pages, page_size, n_kv, ng), np.float32)
        self.host = [pages, scales, pages.copy(), scales.copy()]
        for s, n in enumerate(lens):
            k = (rng.standard_normal((n, n_kv, hd)) * amp).astype(np.float32)
            v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
            cpu_kv_store(k, v, np.full(n, s, np.int32), np.arange(n, dtype=np.int32), self.pt, *self.host)
        self.dev = [cp.asarray(a) for a in self.host]
        self.dpt = cp.asarray(self.pt)


def run_cuda(c, q, seq, pos, scale, max_keys, split_tokens=64, ws=None, split_rows=0):
    """out (numpy) of the CUDA attention, `out` poisoned with NaN first."""
    from strata_lite.kernels.cuda.attention import attention, attention_workspace
    cp = c.cp
    n, n_heads, hd = q.shape
    if ws is None:
        ws = attention_workspace(max(n, 1), n_heads, hd, max_keys, split_tokens=split_tokens)
    out = cp.full(q.shape, np.nan, cp.float32)
    attention(cp.asarray(q), cp.asarray(np.asarray(seq, np.int32)), cp.asarray(np.asarray(pos, np.int32)),
              c.dpt, *c.dev, scale, out, ws, max_keys, split_rows=split_rows)
    return out.get()


def check_against_refs(c, q, seq, pos, scale, got):
    seq = np.asarray(seq, np.int32)
    pos = np.asarray(pos, np.int32)
    assert np.all(np.isfinite(got))
    from strata_lite.kernels.cuda import attention as ak
    want = ref.attention(q, seq, pos, c.pt, *c.host, scale)
    f16 = ref.f16_rounding_bound(*ak.f16_rounding(ak.BUILD), q, seq, pos, c.pt, *c.host, scale)
    ref.assert_within(got, want, RTOL, RTOL * np.abs(want).max() + f16)
    cpu = np.full_like(q, np.nan)
    cpu_attention(q, seq, pos, c.pt, *c.host, scale, cpu)
    ref.assert_within(got, cpu, 2 * RTOL, 2 * RTOL * np.abs(want).max() + f16)


# (n_heads, n_kv, head_dim): GQA groups 7 (the 0.5B model), 1, 2, 4 (8B-like), 12 (two head tiles, the second
# partial) and 16 at head_dim 256 (four tiles of 4)
SHAPES = [(14, 2, 64), (8, 8, 128), (8, 4, 64), (32, 8, 128), (12, 1, 128), (16, 1, 256)]


@pytest.mark.parametrize("n_heads,n_kv,hd", SHAPES)
def test_mixed_batch(n_heads, n_kv, hd):
    """Two sequences: a 40-token prompt chunk of sequence 0 crossing page (16) and split (keys_per_split)
    boundaries, interleaved with decode tokens (positions 0, 1, a page end and > 2 splits); both modes, bit-equal."""
    import cupy as cp
    rng = np.random.default_rng(hd * 100 + n_heads)
    c = Cache(cp, rng, [560, 700], n_kv, hd)
    chunk = list(range(490, 530))
    seq = [1] + [0] * 20 + [1, 0] + [0] * 20 + [1]
    pos = [699] + chunk[:20] + [0, 1] + chunk[20:] + [255]
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    scale = hd ** -0.5
    par = run_cuda(c, q, seq, pos, scale, max_keys=1024)           # split-parallel (44 <= 64 tokens)
    check_against_refs(c, q, seq, pos, scale, par)
    looped = run_cuda(c, q, seq, pos, scale, max_keys=1024, split_tokens=1)
    np.testing.assert_array_equal(looped.view(np.uint32), par.view(np.uint32))


def test_batch_invariance():
    """A token's output is the same bits alone, in a batch, at another place in the batch, and under a larger
    grid (max_keys); also in looped mode."""
    import cupy as cp
    rng = np.random.default_rng(11)
    n_heads, n_kv, hd = 14, 2, 64
    c = Cache(cp, rng, [1500, 300, 40], n_kv, hd)
    seq = [0, 1, 2, 0, 0, 1]
    pos = [1499, 299, 39, 700, 256, 0]
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    scale = hd ** -0.5
    batch = run_cuda(c, q, seq, pos, scale, max_keys=1500)
    check_against_refs(c, q, seq, pos, scale, batch)
    perm = rng.permutation(len(seq))
    shuffled = run_cuda(c, q[perm], np.asarray(seq)[perm], np.asarray(pos)[perm], scale, max_keys=4096)
    np.testing.assert_array_equal(shuffled.view(np.uint32), batch[perm].view(np.uint32))
    for t in range(len(seq)):
        alone = run_cuda(c, q[t:t + 1], seq[t:t + 1], pos[t:t + 1], scale, max_keys=pos[t] + 1)
        np.testing.assert_array_equal(alone.view(np.uint32), batch[t:t + 1].view(np.uint32))
    looped = run_cuda(c, q, seq, pos, scale, max_keys=1500, split_tokens=2)
    np.testing.assert_array_equal(looped.view(np.uint32), batch.view(np.uint32))


@pytest.mark.parametrize("n_heads,n_kv,hd", [(14, 2, 64), (32, 8, 128), (16, 1, 256)])
def test_ctas_walking_several_splits_give_the_same_bits(n_heads, n_kv, hd, monkeypatch):
    """Split-parallel launches whose CTAs walk several splits each (z, z + Z, ...: the next split's copies
    fly while one is computed) give the bits of one CTA per split, for Z = 1, 3 and every split."""
    import cupy as cp
    from strata_lite.kernels.cuda import attention as ak
    rng = np.random.default_rng(hd + n_kv)
    c = Cache(cp, rng, [1500, 900], n_kv, hd, page_size=32)
    seq, pos = [0, 1, 0], [1499, 899, 700]
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    runs = {}
    for z in (None, 1, 3):
        monkeypatch.setattr(ak, "split_stride", lambda n_items, n_group, n_sm, ctas, z=z: z or n_group)
        runs[z] = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=1500)
    check_against_refs(c, q, seq, pos, hd ** -0.5, runs[None])
    for z in (1, 3):
        np.testing.assert_array_equal(runs[z].view(np.uint32), runs[None].view(np.uint32))


@pytest.mark.parametrize("n_heads,n_kv,hd", [(14, 2, 64), (32, 8, 128)])
def test_every_build_gives_the_same_bits(n_heads, n_kv, hd, monkeypatch):
    """The A/B builds (attention.BUILDS: the split-parallel kernels compiled for other CTAs per SM, and the grid
    following them; the tiled kernels' widths) give the default build's bits, which match the references; the
    builds that round to f16 match the references within what that rounding allows."""
    import cupy as cp
    from strata_lite.kernels.cuda import attention as ak
    rng = np.random.default_rng(7 * hd + n_kv)
    c = Cache(cp, rng, [3000, 1200] * 4, n_kv, hd, page_size=64)
    seq, pos = list(range(8)) * 2, [2999, 1199] * 4 + [100, 1000, 2000, 50, 1500, 700, 2500, 10]
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    runs = {}
    for build in ak.BUILDS:
        monkeypatch.setattr(ak, "BUILD", build)
        runs[build] = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=3000)
    for build in ak.BUILDS:
        if ak.f16_rounding(build) != ak.f16_rounding("default"):
            monkeypatch.setattr(ak, "BUILD", build)
            check_against_refs(c, q, seq, pos, hd ** -0.5, runs[build])
        else:
            np.testing.assert_array_equal(runs[build].view(np.uint32), runs["default"].view(np.uint32))
    monkeypatch.setattr(ak, "BUILD", "default")
    check_against_refs(c, q, seq, pos, hd ** -0.5, runs["default"])


# (n_heads, n_kv, head_dim, sequence lengths, token positions, their group sizes): width 8 (the 8B shape)
# and 32 (32 kv heads of 64: groups at fewer keys)
GROUPED = [(32, 8, 128, [33000, 17000], [32999, 16999, 16383, 5000], [4, 2, 2, 1]),
           (32, 32, 64, [16500, 9000], [16499, 8999, 5000, 1000], [8, 4, 2, 1])]


@pytest.mark.parametrize("n_heads,n_kv,hd,lens,pos,sizes", GROUPED)
def test_groups_of_splits(n_heads, n_kv, hd, lens, pos, sizes, monkeypatch):
    """Long tokens fold their splits in groups of 2, 4 and 8 (group_splits): the reference and the CPU
    backend within the tolerances, and the same bits with one CTA per group, CTAs walking several groups
    (Z = 1, 3) and the looped kernels."""
    import cupy as cp
    from strata_lite.kernels.cuda import attention as ak
    rng = np.random.default_rng(hd + 3 * n_kv)
    c = Cache(cp, rng, lens, n_kv, hd, page_size=64)
    seq = [0, 1, 0, 1]
    width = n_kv * -(-(n_heads // n_kv) // ak._head_tile(n_heads // n_kv, hd))
    assert [ak.group_splits(-(-(p + 1) // ak.keys_per_split), width) for p in pos] == sizes
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    runs = {}
    for z in (None, 1, 3):
        monkeypatch.setattr(ak, "split_stride", lambda n_items, n_group, n_sm, ctas, z=z: z or n_group)
        runs[z] = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=lens[0])
    check_against_refs(c, q, seq, pos, hd ** -0.5, runs[None])
    runs["looped"] = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=lens[0], split_tokens=1)
    for z in (1, 3, "looped"):
        np.testing.assert_array_equal(runs[z].view(np.uint32), runs[None].view(np.uint32))


@pytest.mark.parametrize("build", ["default", "tiled1", "tiled4"])
@pytest.mark.parametrize("n_heads,n_kv,hd", [s for s in SHAPES if s[2] <= 128])
def test_tiled_kernels_give_every_token_its_own_bits(n_heads, n_kv, hd, build, monkeypatch):
    """Many-token launches take the tiled kernels (tokens of one sequence sharing each split's K and V rows):
    a 70-token chunk crossing a split (128) and pages, other sequences' decode tokens between its tokens (runs
    of one inside a tile), a tile shared by two sequences. Every token gets the bits of the looped kernels and
    of the split-parallel ones (whose tokens never share anything), and the references' values; in every
    tiled build (attention.BUILDS: 16 columns a CTA by default, 8 in `tiled1`, 32 in `tiled4`)."""
    import cupy as cp
    from strata_lite.kernels.cuda import attention as ak
    rng = np.random.default_rng(hd * 7 + n_heads)
    c = Cache(cp, rng, [700, 300, 260], n_kv, hd)
    seq = [0] * 30 + [1, 2] + [0] * 40 + [2, 1, 1, 0]
    pos = list(range(100, 130)) + [299, 5] + list(range(130, 170)) + [259, 200, 201, 699]
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    scale = hd ** -0.5
    monkeypatch.setattr(ak, "BUILD", build)
    tiled = run_cuda(c, q, seq, pos, scale, max_keys=700, split_tokens=1)
    check_against_refs(c, q, seq, pos, scale, tiled)
    par = run_cuda(c, q, seq, pos, scale, max_keys=700, split_tokens=len(seq))
    np.testing.assert_array_equal(tiled.view(np.uint32), par.view(np.uint32))
    monkeypatch.setattr(ak, "TILED", False)
    looped = run_cuda(c, q, seq, pos, scale, max_keys=700, split_tokens=1)
    np.testing.assert_array_equal(tiled.view(np.uint32), looped.view(np.uint32))


@pytest.mark.parametrize("n_heads,n_kv,hd", [(32, 8, 128), (14, 2, 64)])
def test_mixed_steps_short_runs_apart(n_heads, n_kv, hd):
    """split_rows: a mixed step's leading decode and verify tokens (runs of 1 and 3) computed split-parallel and
    the 80-token chunk after them tiled give every token the bits of one launch of all of them, and the
    references' values."""
    import cupy as cp
    rng = np.random.default_rng(31 + hd)
    c = Cache(cp, rng, [3000, 2000, 700], n_kv, hd, page_size=64)
    seq = [1, 2, 2, 2] + [0] * 80
    pos = [1999, 600, 601, 602] + list(range(2900, 2980))
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    apart = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=3000, split_rows=4)
    check_against_refs(c, q, seq, pos, hd ** -0.5, apart)
    together = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=3000)
    np.testing.assert_array_equal(apart.view(np.uint32), together.view(np.uint32))


def test_tiled_kernels_fold_each_tokens_own_groups(monkeypatch):
    """The 8B shape (width 8) at 16K keys: a chunk whose tokens go from one split a group to two (16,257 keys)
    inside one tile, across a split boundary; tiled, looped and split-parallel bit for bit."""
    import cupy as cp
    from strata_lite.kernels.cuda import attention as ak
    rng = np.random.default_rng(21)
    n_heads, n_kv, hd = 32, 8, 128
    c = Cache(cp, rng, [16384], n_kv, hd, page_size=64)
    pos = list(range(16230, 16300))
    assert {ak.group_splits(-(-(p + 1) // ak.keys_per_split), n_kv) for p in pos} == {1, 2}
    seq = [0] * len(pos)
    q = rng.standard_normal((len(seq), n_heads, hd)).astype(np.float32)
    tiled = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=16384, split_tokens=1)
    check_against_refs(c, q, seq, pos, hd ** -0.5, tiled)
    par = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=16384, split_tokens=len(seq))
    np.testing.assert_array_equal(tiled.view(np.uint32), par.view(np.uint32))
    monkeypatch.setattr(ak, "TILED", False)
    looped = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=16384, split_tokens=1)
    np.testing.assert_array_equal(tiled.view(np.uint32), looped.view(np.uint32))


def test_long_context_sharp_softmax():
    """Large scores across many splits (the fold rescales partials whose maxima differ a lot)."""
    import cupy as cp
    rng = np.random.default_rng(12)
    n_heads, n_kv, hd = 32, 8, 128
    n = 3000
    c = Cache(cp, rng, [n], n_kv, hd, page_size=32, amp=3.0)
    q = (rng.standard_normal((3, n_heads, hd)) * 3).astype(np.float32)
    seq, pos = [0, 0, 0], [n - 1, 1000, 5]
    got = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=n)
    check_against_refs(c, q, seq, pos, hd ** -0.5, got)


def test_merge_over_many_splits():
    """More splits than the merge folds per chunk (256): the running max carries across chunks."""
    import cupy as cp
    from strata_lite.kernels.cuda.attention import keys_per_split
    rng = np.random.default_rng(15)
    n_heads, n_kv, hd = 4, 1, 64
    n = 257 * keys_per_split + 100
    c = Cache(cp, rng, [n], n_kv, hd, page_size=64, amp=2.0)
    q = (rng.standard_normal((3, n_heads, hd)) * 2).astype(np.float32)
    seq, pos = [0, 0, 0], [n - 1, 256 * keys_per_split - 1, 256 * keys_per_split]   # 258, 256, 257 splits
    par = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=n)
    check_against_refs(c, q, seq, pos, hd ** -0.5, par)
    looped = run_cuda(c, q, seq, pos, hd ** -0.5, max_keys=n, split_tokens=1)
    np.testing.assert_array_equal(looped.view(np.uint32), par.view(np.uint32))


def test_graph_replay_any_positions():
    """Captured once with max_keys = the context length, replayed for decode tokens at other positions."""
    import cupy as cp
    from strata_lite.kernels.cuda.attention import attention, attention_workspace
    rng = np.random.default_rng(13)
    n_heads, n_kv, hd, ctx = 32, 8, 128, 2048
    c = Cache(cp, rng, [ctx, ctx], n_kv, hd)
    scale = hd ** -0.5
    ws = attention_workspace(2, n_heads, hd, ctx)
    dq = cp.zeros((2, n_heads, hd), cp.float32)
    dseq = cp.asarray(np.array([0, 1], np.int32))
    dpos = cp.zeros(2, cp.int32)
    out = cp.full(dq.shape, np.nan, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        attention(dq, dseq, dpos, c.dpt, *c.dev, scale, out, ws, ctx)   # compile outside the capture
        stream.begin_capture()
        attention(dq, dseq, dpos, c.dpt, *c.dev, scale, out, ws, ctx)
        graph = stream.end_capture()
    for pos in ([5, 2047], [1024, 300], [0, 255]):
        q = rng.standard_normal((2, n_heads, hd)).astype(np.float32)
        with stream:
            dq.set(q)
            dpos.set(np.array(pos, np.int32))
            out.fill(np.nan)
            graph.launch(stream)
        stream.synchronize()
        got = out.get()
        check_against_refs(c, q, [0, 1], pos, scale, got)
        direct = run_cuda(c, q, [0, 1], pos, scale, max_keys=ctx)
        np.testing.assert_array_equal(got.view(np.uint32), direct.view(np.uint32))


def test_validation():
    import cupy as cp
    from strata_lite.kernels.cuda.attention import attention, attention_workspace
    rng = np.random.default_rng(14)
    n_heads, n_kv, hd = 4, 2, 64
    c = Cache(cp, rng, [20], n_kv, hd)
    ws = attention_workspace(3, n_heads, hd, 64)
    q = cp.asarray(rng.standard_normal((3, n_heads, hd)).astype(np.float32))
    seq = cp.zeros(3, cp.int32)
    pos = cp.arange(3, dtype=cp.int32)
    out = cp.empty_like(q)
    attention(q, seq, pos, c.dpt, *c.dev, 0.125, out, ws, 64)                      # valid call
    kp, ks, vp, vs = c.dev
    bad = [
        lambda: attention(q, seq, pos, c.dpt, *c.dev, 0.125, cp.empty((3, n_heads, hd + 1), cp.float32), ws, 64),
        lambda: attention(q.astype(cp.float64), seq, pos, c.dpt, *c.dev, 0.125, out, ws, 64),
        lambda: attention(q, seq[:2], pos, c.dpt, *c.dev, 0.125, out, ws, 64),
        lambda: attention(q, seq.astype(cp.int64), pos, c.dpt, *c.dev, 0.125, out, ws, 64),
        lambda: attention(q, seq, pos, c.dpt, kp, ks, vp[:3], vs, 0.125, out, ws, 64),
        lambda: attention(q, seq, pos, c.dpt, kp, ks[..., :1], vp, vs, 0.125, out, ws, 64),
        lambda: attention(q, seq, pos, c.dpt, *c.dev, 0.125, out, ws, 65),          # beyond the workspace
        lambda: attention(q, seq, pos, c.dpt, *c.dev, 0.125, out, attention_workspace(2, n_heads, hd, 64), 64),
        lambda: attention(q[:, :3].copy(), seq, pos, c.dpt, *c.dev, 0.125, out[:, :3].copy(), ws, 64),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
    q80 = cp.zeros((3, 2, 80), cp.float32)                                          # head_dim 80: unsupported
    c80 = Cache(cp, rng, [4], 1, 80)
    with pytest.raises(ValueError):
        attention(q80, seq, pos, c80.dpt, *c80.dev, 0.1, q80.copy(), attention_workspace(3, 2, 80, 64), 64)
