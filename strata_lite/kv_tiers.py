"""TieredKV: device pages (KVCache) + host pages (HostPool) indexed by one PrefixTrie, and optionally a
disk tier (kv_disk.DiskKV) that keeps every committed full page in a file.

It places a sequence where its longest cached prefix is (shares device pages, restores host pages,
copies a partial last page: copy-on-write), grows its pages as it computes, commits its full pages to
the trie as they fill (so others can share them at once, and they are refcounted), and on release
gives the trie everything computed. Device pages are freed only through trie eviction, which parks
their KV in the host pool first (dropped only when the host pool cannot hold it).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from .host_pool import HostPool, KVCopier
from .prefix_trie import DEVICE, HOST, PrefixTrie, TrieNode, common_prefix

log = logging.getLogger("strata_lite")


@dataclass
class Placement:
    cached: int      # prefix tokens whose KV was cached anywhere (trie or a running sequence)
    reused: int      # of the sequence's tokens: KV taken from the device
    restored: int    # KV copied from the host pool
    from_disk: int = 0   # KV read from the disk tier


class TieredKV:
    def __init__(self, kv, host: HostPool, copier: KVCopier, disk=None, reread_last: bool = False):
        """reread_last: the KV holds a layer (the MTP drafter's) whose row at position i depends on the token
        at i + 1 and on the main model's hidden state at i, which is not cached: a placement then keeps
        one cached token less than it could (its row and hidden state are computed again), unless the
        whole sequence matched."""
        self.kv, self.host, self.copier, self.disk = kv, host, copier, disk
        self.P = kv.page_size
        self.lag = 1 if reread_last else 0
        self.trie = PrefixTrie(self.P)
        self.stats = dict(pages_parked=0, pages_restored=0, cow_copies=0, device_tokens_dropped=0,
                          host_tokens_dropped=0, pages_from_disk=0)

    # allocation (evicting through the trie)
    def alloc_device(self, n: int, partial: bool = False) -> list[int] | None:
        """n device pages (fewer if partial and memory is short; None if not partial and short)."""
        if n > self.kv.n_free:
            self.trie.evict(DEVICE, n - self.kv.n_free, self._evict_device)
        if n > self.kv.n_free:
            if not partial:
                return None
            n = self.kv.n_free
        return self.kv.alloc(n)

    def alloc_host(self, n: int) -> list[int] | None:
        if n > self.host.n_free:
            self.trie.evict(HOST, n - self.host.n_free, self._evict_host)
        return self.host.alloc(n)

    def _evict_device(self, node: TrieNode) -> list[int] | None:
        dev, host = node.dev_pages, node.host_pages
        if host is None:
            host = self.alloc_host(len(dev))
            if host is not None:
                try:
                    self.copier.copy_pages_to_host(dev, host)
                except BaseException:         # the node keeps its device pages; the trie is unchanged
                    self.host.free(host)
                    raise
                self.stats["pages_parked"] += len(dev)
            else:
                self.stats["device_tokens_dropped"] += len(node.tokens)
        self.kv.free(dev)
        return host

    def _evict_host(self, node: TrieNode) -> None:
        self.host.free(node.host_pages)
        if node.dev_pages is None:
            self.stats["host_tokens_dropped"] += len(node.tokens)

    def device_headroom(self) -> int:
        """Device pages free or held only by unreferenced trie nodes."""
        return self.kv.n_free + self.trie.page_counts()["device_evictable"]

    # placement
    def cached_len(self, tokens, live=()) -> int:
        """Tokens of this prefix cached anywhere now (also marks the path as recently wanted)."""
        m = self.trie.match(tokens)
        return max([m.n_matched] + [self._live_len(r, tokens, m, len(tokens)) for r in live])

    def _live_len(self, r, tokens, m, cap: int) -> int:
        """How far a running sequence r's computed tokens (past its committed node) match `tokens`."""
        e = r.node.end
        if e > m.n_matched or (r.node is not self.trie.root and r.node not in m.path):
            return 0
        return e + common_prefix(r.tokens, e, tokens, e, max(0, min(r.n_computed, cap) - e))

    def place(self, seq, live=(), reserve: int | None = None) -> Placement | None:
        """Give a waiting sequence its cached prefix: shared device pages, restored host pages, and a
        copy of a partly matched page. At least its last token is left to compute (for its logits).
        With `reserve` (device pages promised to running sequences), returns None when the rest of the
        sequence would not fit next to them; also None when device memory cannot take the restore."""
        P, tokens = self.P, seq.tokens
        cap = len(tokens) - 1
        m = self.trie.match(tokens)
        usable, source = self.usable(m.n_matched, cap), None
        cached = m.n_matched
        for r in live:
            n = self._live_len(r, tokens, m, len(tokens))
            cached = max(cached, n)
            if self.usable(n, cap) > usable:
                usable, source = self.usable(n, cap), r
        b = usable // P * P
        anchor = source.node if source is not None else self.trie.anchor(m.path, b)
        below = None if source is not None or usable == b else next(n for n in m.path if n.start == b)
        disk_keys = self._disk_run(tokens, b, cap) if source is None else []
        if (b // P + len(disk_keys)) * P <= usable + self.lag:
            disk_keys = []
        else:                             # the disk holds more than the trie: no partial page copy
            below, usable = None, b
        chain = anchor.path()
        restore = [n for n in chain if not n.on_device]
        n_new = sum(len(n.host_pages) for n in restore) + (usable > b) + len(disk_keys)
        if reserve is not None:
            pinned = sum(len(n.dev_pages) for n in chain + [below] if n is not None and n.on_device and n.ref == 0)
            rest = -(-(len(tokens) + 1) // P) - b // P
            if rest + sum(len(n.host_pages) for n in restore) > self.device_headroom() - pinned - reserve:
                return None
        held = below if below is not None else anchor
        self.trie.lock(held)              # the matched path cannot be evicted while pages are allocated
        try:
            dev = self.alloc_device(n_new)
            if dev is None:
                return None
            restored, reused = self._fill(restore, dev, source, below, b, usable)
            first_disk = len(dev) - len(disk_keys)          # the disk pages come last in dev
            n_disk = self._read_disk(disk_keys, dev[first_disk:])
            self.trie.lock(anchor)
        finally:
            self.trie.unlock(held)
        disk_pages = dev[first_disk:first_disk + n_disk]
        self.kv.free(dev[first_disk + n_disk:])
        from_disk = n_disk * P - (self.lag if n_disk else 0)     # the re-read token is not reused
        seq.node, seq.n_computed, seq.n_shared_pages = anchor, usable + from_disk, anchor.end // P
        seq.pages = [p for n in anchor.path() for p in n.dev_pages] + ([dev[-1]] if usable > b else []) + disk_pages
        return Placement(cached, reused, restored, from_disk)

    def usable(self, n_matched: int, cap: int) -> int:
        """Tokens a placement keeps of a match of n_matched: at most cap, less the re-read one (lag)."""
        return max(0, min(n_matched - self.lag, cap))

    def _disk_run(self, tokens, b: int, cap: int) -> list[str]:
        """Names of the pages from position b on that the disk tier holds, consecutively, each ending at or
        before cap (the last token is always computed)."""
        if self.disk is None or cap // self.P <= b // self.P:
            return []
        keys = self.disk.keys(tokens, cap // self.P)
        j = b // self.P
        while j < len(keys) and self.disk.has(keys[j]):
            j += 1
        return keys[b // self.P:j]

    def _read_disk(self, keys: list[str], dev: list[int]) -> int:
        """Read the pages `keys` into device pages dev, in order, up to the first unreadable one; returns
        how many were read."""
        for i, (key, page) in enumerate(zip(keys, dev)):
            if not self.disk.read(key, page):
                return i
        self.stats["pages_from_disk"] += len(keys)
        return len(keys)

    def _write_disk(self, seq, lo: int, hi: int) -> None:
        """Write seq's full pages lo .. hi - 1 to the disk tier (a failing disk only logs: it is a cache)."""
        if self.disk is None or hi <= lo:
            return
        try:
            keys = self.disk.keys(seq.tokens, hi)
            for j in range(lo, hi):
                self.disk.write(keys[j], seq.tokens, j * self.P, seq.pages[j])
        except OSError as e:
            log.warning("KV disk tier: writing a page failed (%s); the prefix stays cached in memory only", e)

    def _fill(self, restore: list[TrieNode], dev: list[int], source, below, b: int, usable: int) -> tuple[int, int]:
        """Copy the restored pages and the partial page into `dev`; (restored, reused) tokens. A failed
        copy frees the pages of `dev` that no trie node took, then raises."""
        taken = 0
        try:
            restored = self._restore(restore, dev)
            taken = sum(len(n.dev_pages) for n in restore)
            reused = b - restored
            if usable > b:
                restored += self._copy_partial(source, below, b, usable - b, dev[-1])
                reused = usable - restored
        except BaseException:
            self.kv.free(dev[taken:])
            raise
        return restored, reused

    def _restore(self, nodes: list[TrieNode], dev: list[int]) -> int:
        if not nodes:
            return 0
        host = [p for n in nodes for p in n.host_pages]
        self.copier.copy_pages_to_device(host, dev[:len(host)])
        i = 0
        for n in nodes:
            n.dev_pages = dev[i:i + len(n.host_pages)]
            i += len(n.host_pages)
        self.stats["pages_restored"] += len(host)
        return sum(len(n.tokens) for n in nodes)

    def _copy_partial(self, source, below: TrieNode | None, b: int, n_tokens: int, dst: int) -> int:
        """Copy-on-write of the page at position b; returns the tokens restored from the host."""
        self.stats["cow_copies"] += 1
        if source is not None:
            self.copier.copy_page_prefix(source.pages[b // self.P], dst, n_tokens)
        elif below.on_device:
            self.copier.copy_page_prefix(below.dev_pages[0], dst, n_tokens)
        else:
            self.copier.copy_pages_to_device([below.host_pages[0]], [dst])
            self.stats["pages_restored"] += 1
            return n_tokens
        return 0

    # growth and hand-back
    def grow(self, seq, n_tokens: int) -> int:
        """Pages for the next n_tokens of seq; returns how many of them fit (<= n_tokens)."""
        need = -(-(seq.n_computed + n_tokens) // self.P) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.alloc_device(need, partial=True))
        return min(n_tokens, len(seq.pages) * self.P - seq.n_computed)

    def grow_free(self, seq, n_tokens: int) -> int:
        """grow() from free device pages only (no eviction): for drafted tokens, which must not push a
        cached prefix out. Returns how many of the n_tokens fit."""
        need = -(-(seq.n_computed + n_tokens) // self.P) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.kv.alloc(min(need, self.kv.n_free)))
        return min(n_tokens, len(seq.pages) * self.P - seq.n_computed)

    def trim(self, seq) -> None:
        """Free seq's private pages past the one its next token goes to (after rejected drafted tokens)."""
        keep = max(seq.node.end // self.P, (seq.n_computed + 1 + self.P - 1) // self.P)
        if len(seq.pages) > keep:
            self.kv.free(seq.pages[keep:])
            del seq.pages[keep:]

    def commit(self, seq) -> None:
        """Put seq's newly filled pages into the trie (locked by seq, shareable by others)."""
        full = seq.n_computed // self.P * self.P
        if full > seq.node.end:
            lo = seq.node.end // self.P
            self._insert(seq, full, lock=True)
            self._write_disk(seq, lo, full // self.P)

    def release(self, seq) -> None:
        """Hand everything seq computed to the trie (partial last page too); free the rest."""
        if seq.node is None:
            return
        lo = seq.node.end // self.P
        used = -(-seq.n_computed // self.P)
        self.kv.free(seq.pages[used:])
        del seq.pages[used:]
        if seq.n_computed > seq.node.end:
            self._write_disk(seq, lo, seq.n_computed // self.P)
            self._insert(seq, seq.n_computed, lock=False)
        else:
            assert len(seq.pages) == lo
        self.trie.unlock(seq.node)
        seq.node, seq.pages, seq.n_shared_pages = None, [], 0

    def _insert(self, seq, end: int, lock: bool) -> None:
        lo, hi = seq.node.end // self.P, -(-end // self.P)
        res = self.trie.insert(seq.node, seq.tokens[:end], seq.node.end, seq.pages[lo:hi])
        seq.pages[lo:hi] = res.pages
        self.kv.free(res.free_dev)
        self.host.free(res.free_host)
        if lock:
            self.trie.lock(res.node)
            self.trie.unlock(seq.node)
            seq.node, seq.n_shared_pages = res.node, res.node.end // self.P

    # checks after a failure
    def audit(self, running=(), reserved=()) -> list[str]:
        """Page and reference accounting (empty list: consistent): every device page is free, reserved
        (the runner's scratch page), in the trie or private to one running sequence, exactly once; every
        host page free or in the trie, once; each trie node's ref equals the running sequences holding it."""
        problems, refs = [], Counter()
        dev, host = Counter(_free_pages(self.kv)), Counter(_free_pages(self.host))
        dev.update(reserved)
        for node in self.trie.nodes():
            dev.update(node.dev_pages or ())
            host.update(node.host_pages or ())
        for seq in running:
            chain = seq.node.path() if seq.node is not None else []
            shared = sum(len(n.dev_pages or ()) for n in chain)
            dev.update(seq.pages[shared:])
            refs.update(id(n) for n in chain)
        for name, seen, n_pages in (("device", dev, self.kv.n_pages), ("host", host, self.host.n_pages)):
            missing = n_pages - len(seen)
            twice = sum(1 for c in seen.values() if c > 1)
            if missing or twice or any(not 0 <= p < n_pages for p in seen):
                problems.append(f"{name} pages: {missing} unaccounted for, {twice} owned twice")
        wrong = [n for n in self.trie.nodes() if n is not self.trie.root and n.ref != refs[id(n)]]
        if wrong:
            problems.append(f"{len(wrong)} trie nodes with a reference count that no sequence explains")
        return problems

    def clear(self, reserved=()) -> None:
        """Forget every cached prefix: a new empty trie, every page free but `reserved`. For after a
        failure left the accounting inconsistent (audit); nothing may be running."""
        self.trie = PrefixTrie(self.P)
        keep = set(reserved)
        self.kv.alloc(self.kv.n_free)
        self.kv.free([p for p in range(self.kv.n_pages) if p not in keep])
        self.host.alloc(self.host.n_free)
        self.host.free(range(self.host.n_pages))


def _free_pages(pool) -> list[int]:
    """The free page ids of a KVCache or HostPool (taken and given back in order: nothing changes)."""
    pages = pool.alloc(pool.n_free)
    pool.free(pages)
    return pages
