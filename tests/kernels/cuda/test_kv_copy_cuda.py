"""CudaKVCopier against ArrayKVCopier over numpy copies of the same arrays (bit-exact: copies move bytes),
plus its ordering against the compute stream and its timing counters."""
from types import SimpleNamespace

import numpy as np
import pytest

from strata_lite.host_pool import ArrayKVCopier
from strata_lite.kernels.cuda.kv_copy import CudaKVCopier
from strata_lite.kernels.kv_layout import kv_shapes

pytestmark = pytest.mark.gpu

SMALL = dict(n_layers=3, page_size=4, n_kv_heads=2, head_dim=64)   # page of one layer: 512 B int8, 64 B scales


class _NumpyBackend:
    """Identity to_host / from_host: ArrayKVCopier over numpy arrays is the reference."""
    @staticmethod
    def to_host(a):
        return a

    @staticmethod
    def from_host(a):
        return a


def _random_arrays(rng, n_layers, n_pages, page_size, n_kv_heads, head_dim):
    """(k_pages, k_scales, v_pages, v_scales) numpy, random bytes in every page."""
    pages, scales = kv_shapes(n_layers, n_pages, page_size, n_kv_heads, head_dim)
    out = []
    for shape in (pages, scales, pages, scales):
        if len(out) % 2 == 0:
            out.append(rng.integers(-128, 128, size=shape, dtype=np.int8))
        else:
            out.append(rng.standard_normal(shape).astype(np.float32))
    return out


class _Setup:
    """Device arrays (cupy), host arrays (numpy), the copier, and a numpy reference of both sides."""

    def __init__(self, cp, n_dev, n_host, staging_bytes=64 << 20, seed=0, threads=4, **dims):
        rng = np.random.default_rng(seed)
        dims = dims or SMALL
        dev_np = _random_arrays(rng, n_pages=n_dev, **dims)
        self.host = _random_arrays(rng, n_pages=n_host, **dims)
        self.dev = [cp.asarray(a) for a in dev_np]
        self.copier = CudaKVCopier(self.dev, self.host, staging_bytes=staging_bytes, threads=threads)
        self.ref_dev, self.ref_host = [a.copy() for a in dev_np], [a.copy() for a in self.host]
        kv = SimpleNamespace(k_pages=self.ref_dev[0], k_scales=self.ref_dev[1],
                             v_pages=self.ref_dev[2], v_scales=self.ref_dev[3])
        self.ref = ArrayKVCopier(kv, SimpleNamespace(arrays=lambda: self.ref_host), _NumpyBackend())

    def check(self, cp):
        """Both sides equal the reference byte for byte (also the pages that must be untouched)."""
        cp.cuda.Device().synchronize()
        for got, want in zip(self.dev, self.ref_dev):
            assert np.array_equal(cp.asnumpy(got).view(np.uint8), want.view(np.uint8))
        for got, want in zip(self.host, self.ref_host):
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.fixture
def cp():
    import cupy
    compute = cupy.cuda.Stream(non_blocking=True)     # like CudaBackend's: no implicit sync with the copier
    with compute:
        yield cupy


CASES = {
    "scattered": ([7, 2, 9, 0], [3, 8, 1, 5]),
    "runs": ([2, 3, 4, 5, 9, 10], [0, 1, 2, 3, 6, 7]),
    "run_on_one_side": ([1, 2, 3], [5, 4, 3]),
    "unsorted_runs": ([11, 5, 6, 10], [9, 1, 2, 8]),
    "one": ([4], [6]),
    "empty": ([], []),
}
# 64 MiB: one batch; 8 KiB (two 4 KiB slots): 2 int8 pages of all 3 layers per piece, several batches;
# 2 KiB (two 1 KiB slots): one int8 page of 3 layers is 1.5 KiB, so pieces also split the layer axis.
STAGING = [64 << 20, 8 << 10, 2 << 10]


@pytest.mark.parametrize("staging", STAGING)
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(cp, case, staging):
    s = _Setup(cp, n_dev=12, n_host=10, staging_bytes=staging)
    dev_pages, host_pages = CASES[case]
    for a in s.host:                                    # poison the destinations (NaN / 0x7f bytes)
        a.view(np.uint8)[:, host_pages] = 0x7f
    for a in s.ref_host:
        a.view(np.uint8)[:, host_pages] = 0x7f
    s.copier.copy_pages_to_host(dev_pages, host_pages)
    s.ref.copy_pages_to_host(dev_pages, host_pages)
    s.check(cp)                                         # copy_pages_to_host returns with the host written
    back = [(d + 5) % 12 for d in dev_pages]            # restore into other device pages
    s.copier.copy_pages_to_device(host_pages, back)
    s.ref.copy_pages_to_device(host_pages, back)
    s.check(cp)


def test_long_lists_many_batches(cp):
    """32 scattered pages through two 1 KiB slots: dozens of batches through both slots."""
    s = _Setup(cp, n_dev=40, n_host=48, staging_bytes=2 << 10, seed=1)
    rng = np.random.default_rng(2)
    dev_pages = rng.permutation(40)[:32].tolist()
    host_pages = list(range(8, 40))
    s.copier.copy_pages_to_host(dev_pages, host_pages)
    s.ref.copy_pages_to_host(dev_pages, host_pages)
    s.check(cp)
    back = rng.permutation(40)[:32].tolist()
    s.copier.copy_pages_to_device(host_pages[::-1], back)
    s.ref.copy_pages_to_device(host_pages[::-1], back)
    s.check(cp)


LARGE = dict(n_layers=4, page_size=64, n_kv_heads=8, head_dim=128)   # 144 KiB per page and layer


@pytest.mark.parametrize("threads", [1, 4])
def test_round_trip_large(cp, threads):
    """18 MiB each way in 8 MiB slots: the host side copies run on the thread pool (threads=4)."""
    s = _Setup(cp, n_dev=64, n_host=48, threads=threads, **LARGE)
    dev_pages, host_pages = list(range(3, 19)) + [40, 33, 60, 61] + list(range(44, 56)), list(range(31)) + [47]
    s.copier.copy_pages_to_host(dev_pages, host_pages)
    s.ref.copy_pages_to_host(dev_pages, host_pages)
    s.check(cp)
    back = list(range(30, 62))
    s.copier.copy_pages_to_device(host_pages, back)
    s.ref.copy_pages_to_device(host_pages, back)
    s.check(cp)


def _busy(cp):
    """~tens of ms of queued work on the current stream (so an unordered copy would see stale data)."""
    a = cp.full((4096, 4096), 1.0 / 4096, cp.float32)
    for _ in range(20):
        a = a @ a
    return a


def test_to_host_waits_for_compute_writes(cp):
    s = _Setup(cp, n_dev=8, n_host=8)
    _busy(cp)
    for d in s.dev:                                     # kernels on the compute stream, queued behind _busy
        d[:, 5] = 42
    s.copier.copy_pages_to_host([5, 6], [2, 3])
    for d, h in zip(s.ref_dev, s.ref_host):
        d[:, 5] = 42
        h[:, [2, 3]] = d[:, [5, 6]]
    s.check(cp)


def test_restore_ordered_with_compute(cp):
    """A read queued before copy_pages_to_device sees the old pages; the first read on the compute stream
    after it sees the restored ones (27 MiB in 8 MiB slots, the last ones still in flight at return)."""
    s = _Setup(cp, n_dev=64, n_host=64, **LARGE)
    host_pages, dev_pages = list(range(48)), list(range(8, 56))
    _busy(cp)
    before = [d[:, 8:56].copy() for d in s.dev]         # queued behind _busy, before the restore
    s.copier.copy_pages_to_device(host_pages, dev_pages)
    after = [d[:, 8:56].copy() for d in s.dev]          # on the compute stream, right after the call
    cp.cuda.get_current_stream().synchronize()
    for b, a, old, h in zip(before, after, s.ref_dev, s.host):
        assert np.array_equal(cp.asnumpy(b).view(np.uint8), old[:, 8:56].view(np.uint8))
        assert np.array_equal(cp.asnumpy(a).view(np.uint8), h[:, :48].view(np.uint8))


@pytest.mark.parametrize("n_tokens", [0, 1, 3, 4])
def test_copy_page_prefix(cp, n_tokens):
    s = _Setup(cp, n_dev=6, n_host=2)
    for a in s.dev:
        a.view(cp.uint8)[:, 4] = 0x7f
    for a in s.ref_dev:
        a.view(np.uint8)[:, 4] = 0x7f
    _busy(cp)                                           # ordered behind the compute stream's work
    s.copier.copy_page_prefix(1, 4, n_tokens)
    s.ref.copy_page_prefix(1, 4, n_tokens)
    s.check(cp)


def test_counters_grow(cp):
    s = _Setup(cp, n_dev=8, n_host=8)
    page = sum(a[:, 0].nbytes for a in s.host)          # one page, every layer and array
    s.copier.copy_pages_to_host([1, 2, 5], [0, 1, 2])
    assert s.copier.to_host_s > 0 and s.copier.to_host_bytes == 3 * page
    assert s.copier.to_device_s == 0 and s.copier.restore_s == 0
    s.copier.copy_pages_to_device([0, 1], [6, 7])
    t = s.copier.restore_s
    assert t > 0 and s.copier.to_device_s == t and s.copier.to_device_bytes == 2 * page
    s.copier.copy_pages_to_device([2], [3])
    assert s.copier.restore_s > t


def test_bad_arguments(cp):
    s = _Setup(cp, n_dev=8, n_host=4)
    with pytest.raises(ValueError):
        s.copier.copy_pages_to_host([1, 2], [0])
    with pytest.raises(ValueError):
        s.copier.copy_pages_to_host([8], [0])
    with pytest.raises(ValueError):
        s.copier.copy_pages_to_device([4], [0])
    with pytest.raises(ValueError):
        s.copier.copy_page_prefix(0, 1, 5)
    with pytest.raises(ValueError):                     # a 256 B slot cannot hold one int8 page of a layer
        CudaKVCopier(s.dev, s.host, staging_bytes=512)
