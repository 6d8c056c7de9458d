"""PrefixTrie: a radix tree over token ids indexing every KV page that holds a computed prefix.

A node is a run of tokens starting at a page-aligned position (`start`) plus the pages holding their
KV: `dev_pages` (ids in the device KVCache) and/or `host_pages` (ids in the HostPool), one per
page_size tokens, the last one possibly partial. Only leaves may end inside a page, so a node's
children start at its `end`, which is page-aligned. Children are keyed by their first page of tokens;
two children never share a full first page (insert merges them); a shorter key is a partial leaf.

Residency: the nodes with device pages form a rooted subtree (a node on the device has its parent
on the device); every non-root node has its KV somewhere. Reference counts are path counts: lock(node)
adds one to the node and every ancestor, so `ref == 0` means no running sequence uses the node or
anything below it. Eviction takes unreferenced leaves of a tier, least recently used first and the
deepest first among equals, splitting a leaf at a page boundary to free no more than asked.

The trie never touches KV arrays or allocators: eviction calls back into its owner (kv_tiers).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterator

DEVICE, HOST = "device", "host"


class TrieNode:
    __slots__ = ("tokens", "start", "parent", "children", "dev_pages", "host_pages", "ref", "last_use")

    def __init__(self, tokens: list[int], start: int, parent: "TrieNode | None",
                 dev_pages: list[int] | None = None, host_pages: list[int] | None = None, last_use: int = 0):
        self.tokens, self.start, self.parent = tokens, start, parent
        self.children: dict[tuple, TrieNode] = {}
        self.dev_pages, self.host_pages = dev_pages, host_pages
        self.ref, self.last_use = 0, last_use

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def on_device(self) -> bool:
        return self.dev_pages is not None

    @property
    def on_host(self) -> bool:
        return self.host_pages is not None

    def pages(self, tier: str) -> list[int] | None:
        return self.dev_pages if tier == DEVICE else self.host_pages

    def path(self) -> list["TrieNode"]:
        """Nodes from the root's first child down to this one (empty for the root)."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def __repr__(self) -> str:
        where = "D" * self.on_device + "H" * self.on_host
        return f"TrieNode([{self.start},{self.end}) {where} ref={self.ref} use={self.last_use})"


@dataclass
class Match:
    n_matched: int            # tokens of the query found in the trie (token granularity)
    path: list[TrieNode]      # nodes walked, root excluded; the last one may be matched only partly


@dataclass
class Inserted:
    node: TrieNode            # the node ending at the end of the inserted run (exactly, when it is page-aligned)
    pages: list[int]          # the device pages now holding the run (the trie's, where it had them);
    #                           meaningful when the run ends page-aligned (a running sequence's commit)
    free_dev: list[int]       # device pages the caller gave or the trie dropped, now unowned
    free_host: list[int]      # host pages the trie dropped (dominated partial leaves)


def common_prefix(a, a0: int, b, b0: int, limit: int | None = None) -> int:
    """Length of the common prefix of a[a0:] and b[b0:] (at most limit); compares in slices."""
    n = min(len(a) - a0, len(b) - b0)
    n = n if limit is None else min(n, limit)
    i, step = 0, 256
    while i + step <= n and a[a0 + i:a0 + i + step] == b[b0 + i:b0 + i + step]:
        i += step
    while i < n and a[a0 + i] == b[b0 + i]:
        i += 1
    return i


class PrefixTrie:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = TrieNode([], 0, None, dev_pages=[])
        self.tick = 0

    def _key(self, tokens, i: int = 0) -> tuple:
        return tuple(tokens[i:i + self.page_size])

    def _touch(self, node: TrieNode) -> None:
        node.last_use = self.tick

    # lookup
    def match(self, tokens) -> Match:
        """The longest prefix of `tokens` whose KV is in the trie (device or host), and its path."""
        self.tick += 1
        node, pos, path, n, P = self.root, 0, [], len(tokens), self.page_size
        while pos < n:
            child = node.children.get(self._key(tokens, pos)) if n - pos >= P else None
            if child is None:          # diverges (or ends) inside the first page: best partial child
                best, best_len = None, 0
                for c in node.children.values():
                    m = common_prefix(c.tokens, 0, tokens, pos, P)
                    if m > best_len:
                        best, best_len = c, m
                if best is not None:
                    self._touch(best)
                    path.append(best)
                    pos += best_len
                break
            m = common_prefix(child.tokens, 0, tokens, pos)
            self._touch(child)
            path.append(child)
            pos += m
            if m < len(child.tokens):
                break
            node = child
        return Match(pos, path)

    def anchor(self, path: list[TrieNode], n_tokens: int) -> TrieNode:
        """The node ending exactly at page-aligned `n_tokens` along `path` (splitting one if needed)."""
        assert n_tokens % self.page_size == 0
        if n_tokens == 0:
            return self.root
        for node in path:
            if node.start < n_tokens <= node.end:
                return node if n_tokens == node.end else self.split(node, n_tokens - node.start)
        raise ValueError(f"{n_tokens} tokens is beyond the path")

    # structure
    def split(self, node: TrieNode, k: int) -> TrieNode:
        """Cut node after its first k tokens (page-aligned); returns the new head. The tail keeps the
        node's identity (so sequences holding it stay valid), its children and its ref count."""
        P = self.page_size
        assert k % P == 0 and 0 < k < len(node.tokens), (k, node)
        kp = k // P
        head = TrieNode(node.tokens[:k], node.start, node.parent,
                        None if node.dev_pages is None else node.dev_pages[:kp],
                        None if node.host_pages is None else node.host_pages[:kp], node.last_use)
        head.ref = node.ref
        node.parent.children[self._key(head.tokens)] = head
        node.tokens, node.start, node.parent = node.tokens[k:], node.start + k, head
        if node.dev_pages is not None:
            node.dev_pages = node.dev_pages[kp:]
        if node.host_pages is not None:
            node.host_pages = node.host_pages[kp:]
        head.children[self._key(node.tokens)] = node
        return head

    def remove(self, node: TrieNode) -> None:
        assert not node.children and node.ref == 0 and node.parent is not None, node
        del node.parent.children[self._key(node.tokens)]
        node.parent = None

    def lock(self, node: TrieNode) -> None:
        while node is not None:
            node.ref += 1
            node = node.parent

    def unlock(self, node: TrieNode) -> None:
        """Drop one reference along the path; the path counts as used now."""
        self.tick += 1
        while node is not None:
            node.last_use = self.tick
            assert node.ref > 0, node
            node.ref -= 1
            node = node.parent

    # insert
    def insert(self, parent: TrieNode, tokens, first: int, dev_pages: list[int]) -> Inserted:
        """Insert tokens[first:] with their device pages (one per page, from position first) under
        `parent`, which must be on the device and end at `first` (page-aligned). Pages the trie already
        holds on the device win over the caller's (returned in free_dev); host-only nodes adopt them."""
        P = self.page_size
        assert parent.end == first and first % P == 0 and parent.on_device
        self.tick += 1
        node, i, n = parent, first, len(tokens)
        pages, free_dev, free_host = list(dev_pages), [], []
        while i < n:
            child = self._child_for(node, tokens, i)
            if child is None:
                new = TrieNode(list(tokens[i:]), i, node, pages[(i - first) // P:], None, self.tick)
                node.children[self._key(new.tokens)] = new
                self._drop_dominated(node, new, free_dev, free_host)
                return Inserted(new, pages, free_dev, free_host)
            m = common_prefix(child.tokens, 0, tokens, i)
            if i + m == n and (m == len(child.tokens) or n % P):
                covered = child                                    # the run ends inside child: all present
            elif m == len(child.tokens) and m % P == 0:
                covered = child                                    # child fully matched, go on below it
            else:                                                  # split at the last common full page
                covered = self.split(child, m // P * P)
            self._share(covered, pages, (covered.start - first) // P, covered.end <= n, free_dev)
            self._touch(covered)
            node, i = covered, covered.end
            if i >= n:
                return Inserted(covered, pages, free_dev, free_host)
        return Inserted(node, pages, free_dev, free_host)

    def _child_for(self, node: TrieNode, tokens, i: int) -> TrieNode | None:
        if len(tokens) - i >= self.page_size:
            return node.children.get(self._key(tokens, i))
        rest = len(tokens) - i             # a partial run: a child already holding all of it
        for c in node.children.values():
            if len(c.tokens) >= rest and common_prefix(c.tokens, 0, tokens, i, rest) == rest:
                return c
        return None

    def _share(self, node: TrieNode, pages: list[int], lo: int, whole: bool, free_dev: list[int]) -> None:
        """pages[lo:] hold the KV of node's tokens, all of them if `whole`, else a prefix."""
        k = min(-(-len(node.tokens) // self.page_size), len(pages) - lo)
        if node.dev_pages is None and whole:
            node.dev_pages = pages[lo:lo + k]                      # host-only node adopts the caller's
            return
        if node.dev_pages is None:      # the run ends inside a host-only node: the KV is kept there already
            free_dev.extend(pages[lo:lo + k])
            return
        free_dev.extend(pages[lo:lo + k])
        pages[lo:lo + k] = node.dev_pages[:k]

    def _drop_dominated(self, parent: TrieNode, new: TrieNode, free_dev: list, free_host: list) -> None:
        """Remove partial-leaf siblings whose tokens are a strict prefix of new's (new holds them all)."""
        for c in list(parent.children.values()):
            if (c is not new and len(c.tokens) < self.page_size and not c.children and c.ref == 0
                    and common_prefix(c.tokens, 0, new.tokens, 0) == len(c.tokens)):
                free_dev.extend(c.dev_pages or ())
                free_host.extend(c.host_pages or ())
                self.remove(c)

    # eviction
    def evict(self, tier: str, n_pages: int, on_victim: Callable[[TrieNode], list[int] | None]) -> int:
        """Free up to n_pages of `tier`, least valuable first; returns the pages freed.

        device: victims are unreferenced nodes with no child on the device. on_victim(node) frees
        node.dev_pages and returns host pages it parked the KV in (the node stays, host-only) or None
        (the KV is dropped and the node, then a leaf, removed).
        host: victims are nodes also on the device (dropping the host copy loses nothing; taken first)
        or unreferenced leaves. on_victim(node) frees node.host_pages; a host-only node is removed.
        Only unreferenced nodes are split, so nodes that running sequences hold never change shape."""
        heap = [(self._priority(n, tier), id(n), n) for n in self.nodes() if self._is_victim(n, tier)]
        heapq.heapify(heap)
        freed = 0
        while freed < n_pages and heap:
            node = heapq.heappop(heap)[2]
            if node.parent is None or not self._is_victim(node, tier):
                continue
            have = len(node.pages(tier))
            if have > n_pages - freed and node.ref == 0:     # lossy: free no more than asked
                self.split(node, (have - (n_pages - freed)) * self.page_size)
            freed += len(node.pages(tier))
            parent = node.parent
            self._release(node, tier, on_victim)
            if parent is not self.root and self._is_victim(parent, tier):
                heapq.heappush(heap, (self._priority(parent, tier), id(parent), parent))
        return freed

    def _release(self, node: TrieNode, tier: str, on_victim) -> None:
        parked = on_victim(node)
        if tier == DEVICE:
            node.dev_pages = None
            if parked is not None:
                node.host_pages = parked
                return
            assert node.host_pages is None
        else:
            node.host_pages = None
            if node.dev_pages is not None:
                return
        self.remove(node)

    def _is_victim(self, node: TrieNode, tier: str) -> bool:
        if node is self.root:
            return False
        if tier == DEVICE:
            return (node.dev_pages is not None and node.ref == 0
                    and not any(c.dev_pages is not None for c in node.children.values()))
        return node.host_pages is not None and (node.dev_pages is not None or (node.ref == 0 and not node.children))

    @staticmethod
    def _priority(node: TrieNode, tier: str) -> tuple:
        lossy = tier == DEVICE or node.dev_pages is None
        return (lossy, node.last_use, -node.end)

    # inspection
    def held_len(self, tokens) -> int:
        """Tokens of `tokens`' prefix whose KV the trie holds (device or host), by a plain token-by-token
        walk that is independent of match() and changes nothing (no use times): the scheduler's check
        that placement missed nothing (needless reads)."""
        node, pos, n = self.root, 0, len(tokens)
        while pos < n:
            best, best_len = None, 0
            for c in node.children.values():      # the child agreeing longest (at most one agrees past a page)
                k = 0
                while k < len(c.tokens) and pos + k < n and c.tokens[k] == tokens[pos + k]:
                    k += 1
                if k > best_len:
                    best, best_len = c, k
            pos += best_len
            if best is None or best_len < len(best.tokens):
                return pos
            node = best
        return pos

    def nodes(self) -> Iterator[TrieNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def page_counts(self) -> dict[str, int]:
        """device/host pages held; device_evictable = device pages of unreferenced nodes."""
        dev = host = free = 0
        for n in self.nodes():
            dev += len(n.dev_pages or ())
            host += len(n.host_pages or ())
            free += len(n.dev_pages or ()) if n.ref == 0 else 0
        return {"device": dev, "host": host, "device_evictable": free}
