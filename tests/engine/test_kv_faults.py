"""A page copy that fails while a sequence is placed (restore from host, copy-on-write of a partial page) or
while the trie parks a node's KV leaks nothing: no page, no trie reference; and TieredKV.audit / clear,
what the engine's supervisor checks and rebuilds after a failure of its loop."""
import pytest

from fake_engine import make_kv
from strata_lite.host_pool import ArrayKVCopier, HostPool
from strata_lite.kv_tiers import TieredKV
from strata_lite.prefix_trie import DEVICE
from strata_lite.sequence import Request, Sequence
from trie_invariants import check_ownership

P = 4


class CopyFailed(RuntimeError):
    pass


class FailingCopier:
    """ArrayKVCopier whose method `fail` raises (after its first `after` calls succeed)."""

    def __init__(self, inner, fail: str, after: int = 0):
        self.inner, self.fail, self.after = inner, fail, after

    def __getattr__(self, name):
        real = getattr(self.inner, name)

        def call(*args):
            if name == self.fail:
                if self.after == 0:
                    raise CopyFailed(f"{name} failed (injected)")
                self.after -= 1
            return real(*args)
        return call


class Tiers:
    """TieredKV over fake pages, with helpers to compute and release a sequence (running=[] for checks)."""

    def __init__(self, n_dev=16, n_host=16):
        kv = make_kv(n_dev, P)
        host = HostPool.like(kv, n_host * HostPool.like(kv, 0).page_bytes)
        self.good = ArrayKVCopier(kv, host)
        self.tiers = TieredKV(kv, host, self.good)
        self.running, self.n = [], 0

    def compute(self, tokens):
        """Place, compute and release a sequence of `tokens` (its KV ends in the trie)."""
        self.n += 1
        seq = Sequence(Request(f"s{self.n}", list(tokens)))
        assert self.tiers.place(seq) is not None
        n = self.tiers.grow(seq, len(tokens) - seq.n_computed)
        seq.n_computed += n
        self.tiers.commit(seq)
        self.tiers.release(seq)

    def park_all(self):
        self.tiers.trie.evict(DEVICE, self.tiers.kv.n_pages, self.tiers._evict_device)

    def check_idle(self):
        """Nothing leaked: every page free or in the trie once, no trie reference left."""
        check_ownership(self)
        assert self.tiers.audit() == []
        assert all(n.ref == 0 for n in self.tiers.trie.nodes())


def _place_failing(t: Tiers, tokens, fail: str, after: int = 0):
    t.tiers.copier = FailingCopier(t.good, fail, after)
    free = t.tiers.kv.n_free
    with pytest.raises(CopyFailed):
        t.tiers.place(Sequence(Request("x", list(tokens))))
    t.tiers.copier = t.good
    t.check_idle()
    return free


def test_failed_restore_from_host_leaks_no_page_or_lock():
    t = Tiers()
    t.compute([1] * 10)
    t.park_all()                                  # its KV now only in the host pool
    free = _place_failing(t, [1] * 10 + [5], "copy_pages_to_device")
    assert t.tiers.kv.n_free == free
    assert t.tiers.place(Sequence(Request("y", [1] * 10 + [5]))).restored == 10   # works once copies do


def test_failed_partial_page_copy_leaks_no_page_or_lock():
    t = Tiers()
    t.compute([1] * 6)                            # pages [1 1 1 1] [1 1 . .] on the device
    free = _place_failing(t, [1] * 6 + [7], "copy_page_prefix")
    assert t.tiers.kv.n_free == free


def test_failed_partial_copy_after_a_restore_keeps_the_restored_pages():
    t = Tiers()
    t.compute([2] * 6)
    t.park_all()
    _place_failing(t, [2] * 6 + [9], "copy_pages_to_device", after=1)   # full page restored, partial fails
    node = next(n for n in t.tiers.trie.nodes() if n.tokens[:P] == [2] * P)
    assert node.on_device                         # the restored page is the trie's, not leaked


def test_failed_park_frees_the_host_pages_and_keeps_the_kv_on_the_device():
    t = Tiers(n_dev=4)
    t.compute([3] * 8)                            # two device pages in the trie
    t.tiers.copier = FailingCopier(t.good, "copy_pages_to_host")
    with pytest.raises(CopyFailed):
        t.tiers.alloc_device(4)                   # has to evict (park) the node
    t.tiers.copier = t.good
    t.check_idle()
    assert t.tiers.host.n_free == t.tiers.host.n_pages
    assert t.tiers.trie.match([3] * 8).n_matched == 8


def test_audit_finds_a_leaked_page_and_clear_rebuilds():
    t = Tiers()
    t.compute([4] * 9)
    assert t.tiers.audit() == []
    leaked = t.tiers.kv.alloc(1)                  # a page nobody accounts for
    problems = t.tiers.audit()
    assert problems and "device pages: 1 unaccounted" in problems[0]
    assert t.tiers.audit(reserved=leaked) == []   # a reserved page (the runner's scratch page) is fine
    node = next(n for n in t.tiers.trie.nodes() if n.tokens)
    node.ref += 1                                 # a reference no running sequence explains
    assert any("reference" in p for p in t.tiers.audit(reserved=leaked))
    t.tiers.clear(reserved=leaked)
    assert t.tiers.audit(reserved=leaked) == []
    assert t.tiers.kv.n_free == t.tiers.kv.n_pages - 1 and t.tiers.trie.match([4] * 9).n_matched == 0
