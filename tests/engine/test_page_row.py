"""Sequence.page_row: the int32 page table a step uses equals `pages` after every change kv_tiers.py makes
(extend at the tail, entries at or past n_shared_pages replaced or cut, n_shared_pages growing, a new list),
although it converts only what may have changed."""
import numpy as np

from strata_lite.sequence import Request, Sequence


def test_page_row_follows_every_kind_of_change():
    rng = np.random.default_rng(0)
    seq = Sequence(Request("r", (1, 2, 3)))
    assert seq.page_row().tolist() == []
    for step in range(3000):
        op = rng.integers(0, 6)
        pages = seq.pages
        if op == 0:                                   # grow: new pages at the tail
            pages.extend(rng.integers(0, 10_000, rng.integers(1, 40)).tolist())
        elif op == 1 and len(pages) > seq.n_shared_pages:   # commit: the private part replaced (trie dedup)
            lo = seq.n_shared_pages
            hi = int(rng.integers(lo + 1, len(pages) + 1))
            pages[lo:hi] = rng.integers(0, 10_000, hi - lo).tolist()
            seq.n_shared_pages = hi                   # the node the sequence now holds ends there
        elif op == 2 and len(pages) > seq.n_shared_pages:   # trim after rejected drafts
            del pages[int(rng.integers(seq.n_shared_pages, len(pages))):]
        elif op == 3:                                 # release / placement: a new list
            seq.pages = rng.integers(0, 10_000, rng.integers(0, 300)).tolist()
            seq.n_shared_pages = int(rng.integers(0, len(seq.pages) + 1))
        if rng.integers(0, 2):                        # not every change is followed by a step
            row = seq.page_row()
            assert row.dtype == np.int32 and row.tolist() == seq.pages, step
