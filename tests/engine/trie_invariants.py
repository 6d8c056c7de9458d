"""Invariant checks of the prefix trie, page ownership and (with fake KV) page contents."""
from __future__ import annotations

from collections import Counter

import numpy as np

from strata_lite.prefix_trie import PrefixTrie


def check_trie(trie: PrefixTrie) -> None:
    P, root = trie.page_size, trie.root
    seen_dev, seen_host = Counter(), Counter()
    for node in trie.nodes():
        seen_dev.update(node.dev_pages or ())
        seen_host.update(node.host_pages or ())
        if node is root:
            assert node.dev_pages == [] and not node.tokens and node.ref >= sum(c.ref for c in node.children.values())
            continue
        assert node.tokens, node
        assert node.start == node.parent.end and node.start % P == 0, node
        assert node.parent.children[tuple(node.tokens[:P])] is node, node
        assert node.dev_pages is not None or node.host_pages is not None, f"{node} has its KV nowhere"
        n_pages = -(-len(node.tokens) // P)
        for pages in (node.dev_pages, node.host_pages):
            assert pages is None or len(pages) == n_pages, node
        if node.on_device:
            assert node.parent.on_device, f"{node} on the device below a parent that is not"
        if node.children:
            assert len(node.tokens) % P == 0, f"{node} ends inside a page but has children"
        assert node.ref >= sum(c.ref for c in node.children.values()), node
        first_pages = [tuple(c.tokens[:P]) for c in node.children.values()]
        assert len(set(first_pages)) == len(first_pages)
    assert all(c == 1 for c in seen_dev.values()), "a device page owned twice in the trie"
    assert all(c == 1 for c in seen_host.values()), "a host page owned twice in the trie"


def check_ownership(sched) -> None:
    """Every device page is free, in the trie, or private to one running sequence; every host page is
    free or in the trie; the refs are exactly the running sequences' locks; shared pages match the trie."""
    tiers = sched.tiers
    trie, kv, host, P = tiers.trie, tiers.kv, tiers.host, tiers.P
    check_trie(trie)
    owners = Counter(kv._free)
    host_owners = Counter(host._free)
    locks = Counter()
    for node in trie.nodes():
        owners.update(node.dev_pages or ())
        host_owners.update(node.host_pages or ())
    for seq in sched.running:
        assert seq.node is not None and seq.node.end <= seq.n_computed, seq
        chain = seq.node.path()
        assert chain == [] or chain[0].parent is trie.root, f"{seq} holds a node no longer in the trie"
        shared = [p for n in chain for p in n.dev_pages]
        assert seq.pages[:len(shared)] == shared, seq
        owners.update(seq.pages[len(shared):])
        for n in chain:
            locks[id(n)] += 1
        assert len(seq.pages) * P >= seq.n_computed
    assert sorted(owners) == list(range(kv.n_pages)) and set(owners.values()) == {1}, "device page ownership"
    assert sorted(host_owners) == list(range(host.n_pages)) and set(host_owners.values()) <= {1}, "host pages"
    for node in trie.nodes():
        if node is not trie.root:
            assert node.ref == locks[id(node)], f"{node}: ref {node.ref}, locked by {locks[id(node)]}"


def check_contents(sched, hashes: bool = False) -> None:
    """Each trie node's device and host pages hold exactly its tokens at their positions (and, with
    `hashes`, the fake model's prefix hash of the whole path); running sequences' KV is theirs."""
    from fake_engine import SEED, mix, views
    tiers = sched.tiers
    P = tiers.P
    dev = views(tiers.kv.k_pages, tiers.kv.v_pages)
    hst = views(tiers.host.k_pages, tiers.host.v_pages)
    stack = [(tiers.trie.root, SEED)]
    while stack:
        node, h = stack.pop()
        n = len(node.tokens)
        want = np.stack([np.asarray(node.tokens), np.arange(node.start, node.end)], axis=1)
        exp_h = []
        if hashes:
            for t in node.tokens:
                h = mix(h, t)
                exp_h.append(h)
        for pages, (H, TP) in ((node.dev_pages, dev), (node.host_pages, hst)):
            if pages:
                assert np.array_equal(TP[pages].reshape(-1, 2)[:n], want), node
                if hashes:
                    assert np.array_equal(H[pages].reshape(-1)[:n], np.asarray(exp_h, np.uint64)), node
        stack.extend((c, h) for c in node.children.values())
    for seq in sched.running:
        n = seq.n_computed
        tp = dev[1][np.asarray(seq.pages[:-(-n // P)], np.int64)].reshape(-1, 2)[:n]
        assert np.array_equal(tp[:, 0], seq.tokens[:n]) and np.array_equal(tp[:, 1], np.arange(n)), seq


def check_scheduler(sched, contents: bool = True) -> None:
    check_ownership(sched)
    for seq in sched.running:           # the converted page table the steps use (Sequence.page_row)
        assert seq.page_row().tolist() == seq.pages, seq
    if contents:
        check_contents(sched)
