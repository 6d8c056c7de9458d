"""PrefixTrie unit tests, and property tests (hypothesis) of random turns / splits / locks / evictions
through TieredKV over fake KV pages: the trie invariants hold, every page has one owner, referenced
nodes are never evicted, pages hold exactly their tokens, and placement finds the longest cached prefix."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_engine import make_kv, views
from strata_lite.host_pool import ArrayKVCopier, HostPool
from strata_lite.kv_tiers import TieredKV
from strata_lite.prefix_trie import DEVICE, HOST, PrefixTrie, common_prefix
from strata_lite.sequence import Request, Sequence
from trie_invariants import check_contents, check_ownership, check_trie

P = 4


def trie_with(*runs):
    """A trie holding each run (device pages numbered as they come); returns (trie, next page id)."""
    trie, nxt = PrefixTrie(P), 0
    for run in runs:
        m = trie.match(run)
        b = min(m.n_matched, len(run)) // P * P
        node = trie.anchor(m.path, b)
        n_pages = -(-(len(run) - b) // P)
        trie.insert(node, run, b, list(range(nxt, nxt + n_pages)))
        nxt += n_pages
    return trie, nxt


def test_common_prefix():
    a = list(range(1000))
    b = a[:700] + [-1] + a[701:]
    assert common_prefix(a, 0, b, 0) == 700 and common_prefix(a, 10, b, 10, 5) == 5
    assert common_prefix(a, 0, a, 0) == 1000 and common_prefix([], 0, a, 0) == 0


def test_match_token_granularity_and_split():
    trie, _ = trie_with([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert trie.match([1, 2, 3, 4, 5, 6, 0]).n_matched == 6
    assert trie.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]).n_matched == 10
    assert trie.match([2]).n_matched == 0
    m = trie.match([1, 2, 3, 4, 5, 6, 0])
    tail = m.path[0]
    tail.ref = 1
    head = trie.anchor(m.path, 4)
    assert head.end == 4 and tail.start == 4 and tail.parent is head and head.ref == 1
    assert head.dev_pages == [0] and tail.dev_pages == [1, 2]
    tail.ref = head.ref = 0
    check_trie(trie)


def test_siblings_diverging_inside_a_page_and_best_partial():
    trie, _ = trie_with([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 9, 9, 9, 9])
    assert trie.match([1, 2, 3, 4, 5, 6, 7, 0]).n_matched == 7
    assert trie.match([1, 2, 3, 4, 5, 9, 9, 9, 9, 9]).n_matched == 9
    assert trie.match([1, 2, 3, 4, 5, 1]).n_matched == 5
    head = trie.root.children[(1, 2, 3, 4)]
    assert head.end == 4 and len(head.children) == 2
    check_trie(trie)


def test_insert_existing_run_returns_trie_pages():
    trie, nxt = trie_with([1, 2, 3, 4, 5, 6, 7, 8, 9])
    res = trie.insert(trie.root, [1, 2, 3, 4, 5, 6, 7, 8], 0, [50, 51])
    assert res.pages == [0, 1] and sorted(res.free_dev) == [50, 51] and res.node.end == 8
    check_trie(trie)


def test_dominated_partial_leaf_is_dropped():
    trie, _ = trie_with([1, 2, 3, 4, 5, 6])                       # pages 0, 1 (partial: 5, 6)
    head = trie.anchor(trie.match([1, 2, 3, 4, 5, 6, 7]).path, 4)
    res = trie.insert(head, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [10, 11])
    assert res.free_dev == [1] and trie.match([1, 2, 3, 4, 5, 6, 7, 8, 9]).n_matched == 9
    assert len(trie.root.children[(1, 2, 3, 4)].children) == 1
    check_trie(trie)


def test_host_only_node_adopts_device_pages():
    trie, _ = trie_with([1, 2, 3, 4, 5, 6, 7, 8])
    node = trie.root.children[(1, 2, 3, 4)]
    node.host_pages, node.dev_pages = [7, 8], None
    res = trie.insert(trie.root, [1, 2, 3, 4], 0, [20])
    head = trie.root.children[(1, 2, 3, 4)]
    assert res.node is head and head.dev_pages == [20] and head.host_pages == [7] and not res.free_dev
    check_trie(trie)


def test_evict_lru_deepest_first_partial_and_refs():
    trie, _ = trie_with([1] * 12, [2] * 8, [3] * 8)
    a, b, c = (trie.root.children[(t,) * 4] for t in (1, 2, 3))
    a.last_use, b.last_use, c.last_use = 1, 3, 2
    trie.lock(c)
    freed = []
    n = trie.evict(DEVICE, 4, lambda node: freed.append(list(node.dev_pages)) or None)
    assert n == 4 and freed == [[0, 1, 2], [4]]                  # all of a (oldest), then b's last page
    assert trie.match([2] * 8).n_matched == 4 and trie.match([3] * 8).n_matched == 8
    assert trie.evict(DEVICE, 10, lambda node: None) == 1          # c is locked: only b's head goes
    trie.unlock(c)
    check_trie(trie)


def test_evict_host_drops_copies_of_device_nodes_first():
    trie, _ = trie_with([1] * 8, [2] * 8)
    a, b = trie.root.children[(1,) * 4], trie.root.children[(2,) * 4]
    a.host_pages, b.host_pages, b.dev_pages = [0, 1], [2, 3], None
    a.last_use, b.last_use = 5, 1
    assert trie.evict(HOST, 2, lambda node: None) == 2
    assert a.host_pages is None and a.dev_pages is not None and b.parent is trie.root


# property tests ---------------------------------------------------------------------------------

class Harness:
    def __init__(self, n_dev=14, n_host=8):
        kv = make_kv(n_dev, P)
        host = HostPool.like(kv, n_host * HostPool.like(kv, 0).page_bytes)
        self.tiers = TieredKV(kv, host, ArrayKVCopier(kv, host))
        self.TP = views(kv.k_pages, kv.v_pages)[1]
        self.running, self.stored, self.n = [], [[]], 0

    def turn(self, base, cut, suffix, keep):
        tokens = (self.stored[base % len(self.stored)][:cut] + suffix) or [0]
        self.n += 1
        seq = Sequence(Request(f"s{self.n}", tokens))
        longest = self.longest(tokens)
        placed = self.tiers.place(seq, ())
        if placed is None:
            return
        assert placed.cached == longest and placed.reused + placed.restored == min(longest, len(tokens) - 1)
        while seq.n_computed < len(tokens):
            n = self.tiers.grow(seq, len(tokens) - seq.n_computed)
            if n == 0:
                break
            for p in range(seq.n_computed, seq.n_computed + n):
                self.TP[seq.pages[p // P], p % P] = (tokens[p], p)
            seq.n_computed += n
            self.tiers.commit(seq)
        self.stored.append(tokens[:seq.n_computed])
        if keep:
            self.running.append(seq)
        else:
            self.tiers.release(seq)

    def longest(self, tokens) -> int:
        """Brute force: the longest prefix of tokens along any root-to-node path of the trie."""
        best, stack = 0, [(self.tiers.trie.root, [])]
        while stack:
            node, path = stack.pop()
            path = path + node.tokens
            best = max(best, common_prefix(path, 0, tokens, 0))
            stack.extend((c, path) for c in node.children.values())
        return best

    def check(self):
        check_ownership(self)
        check_contents(self)


ops = st.one_of(
    st.tuples(st.just("turn"), st.integers(0, 50), st.integers(0, 40),
              st.lists(st.integers(0, 2), max_size=14), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 10)),
    st.tuples(st.just("evict"), st.sampled_from([DEVICE, HOST]), st.integers(1, 10)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=10, max_size=60), st.integers(6, 16), st.integers(0, 12))
def test_random_operations_keep_invariants(program, n_dev, n_host):
    h = Harness(n_dev, n_host)
    for op in program:
        if op[0] == "turn":
            h.turn(*op[1:])
        elif op[0] == "release" and h.running:
            h.tiers.release(h.running.pop(op[1] % len(h.running)))
        elif op[0] == "evict":
            locked = [(s, s.node, list(s.pages)) for s in h.running]
            h.tiers.trie.evict(op[1], op[2], h.tiers._evict_device if op[1] == DEVICE else h.tiers._evict_host)
            for s, node, pages in locked:                # referenced KV never moves
                assert s.node is node and s.pages == pages and node.on_device
        h.check()
    for s in h.running:
        h.tiers.release(s)
    h.running = []
    h.check()
    assert all(n.ref == 0 for n in h.tiers.trie.nodes())


def test_seeded_random_programs():
    """The same operations, many seeded programs of 40 steps (cheaper per program than hypothesis)."""
    import random
    for seed in range(400):
        rng = random.Random(seed)
        h = Harness(rng.randint(6, 16), rng.randint(0, 12))
        for _ in range(40):
            r = rng.random()
            if r < 0.6:
                h.turn(rng.randint(0, 50), rng.randint(0, 40), [rng.randint(0, 2) for _ in range(rng.randint(0, 14))],
                       rng.random() < 0.5)
            elif r < 0.75 and h.running:
                h.tiers.release(h.running.pop(rng.randrange(len(h.running))))
            else:
                tier = rng.choice([DEVICE, HOST])
                h.tiers.trie.evict(tier, rng.randint(1, 10),
                                   h.tiers._evict_device if tier == DEVICE else h.tiers._evict_host)
            h.check()
