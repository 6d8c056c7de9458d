"""A fake model for scheduler tests: its "KV" of position p is (token, p, hash of tokens[:p+1]) written
into real KVCache / HostPool arrays, and its next token is a function of that hash. A token's hash is
chained from the KV of position p-1 read through the page table, so reused, restored or copied KV that
is wrong anywhere changes the generated tokens; every logit row also checks the whole context."""
from __future__ import annotations

from collections import Counter

import numpy as np

from strata_lite.host_pool import ArrayKVCopier, HostPool
from strata_lite.kernels.kv_layout import kv_shapes
from strata_lite.kv_cache import KVCache
from strata_lite.scheduler import Scheduler
from strata_lite.sequence import SeqStatus

VOCAB = 50_000
SEED = np.uint64(0x9E3779B97F4A7C15)
MULT = np.uint64(0x100000001B3)


class FakeBackend:
    name = "fake"

    def kv_arrays(self, n_layers, n_pages, page_size, n_kv_heads, head_dim):
        pages, scales = kv_shapes(n_layers, n_pages, page_size, n_kv_heads, head_dim)
        return (np.zeros(pages, np.int8), np.zeros(scales, np.float32),
                np.zeros(pages, np.int8), np.zeros(scales, np.float32))

    def to_host(self, a):
        return a

    def from_host(self, a):
        return np.ascontiguousarray(a)


def mix(h, t):
    with np.errstate(over="ignore"):
        return (np.asarray(h, np.uint64) * MULT + np.asarray(t, np.uint64) + np.uint64(1)).astype(np.uint64)


def chain(tokens) -> int:
    h = SEED
    for t in tokens:
        h = mix(h, t)
    return int(h)


def next_token(h: int) -> int:
    return int(h % VOCAB)


def reference_generation(tokens, n: int) -> list[int]:
    """What the fake model generates after `tokens` (greedy, no stop)."""
    h, out = chain(tokens), []
    for _ in range(n):
        t = next_token(h)
        out.append(t)
        h = int(mix(h, t))
    return out


def make_kv(n_pages: int, page_size: int) -> KVCache:
    # head_dim 8 int8 = one int64 slot: K holds the prefix hash, V holds (token, position) as two int32
    return KVCache(FakeBackend(), n_layers=1, n_kv_heads=1, head_dim=8, n_pages=n_pages, page_size=page_size)


def views(k_pages, v_pages):
    """(hash (n_pages, P) uint64, token/pos (n_pages, P, 2) int32) views of KV page arrays."""
    return k_pages.view(np.uint64)[0, :, :, 0, 0], v_pages.view(np.int32)[0, :, :, 0, :]


class FakeRunner:
    def __init__(self, kv: KVCache):
        self.kv = kv
        self.H, self.TP = views(kv.k_pages, kv.v_pages)
        self.computed = Counter()     # prefix hash -> times its KV was computed
        self.n_computed = 0

    @property
    def recomputed(self) -> int:
        return sum(c - 1 for c in self.computed.values())

    def forward(self, plan) -> list[int]:
        b, P = plan.batch, self.kv.page_size
        context = {}                  # page-table row -> the tokens its positions hold (drafted ones too)
        for i in range(len(b.token_ids)):
            s, p, tok = int(b.token_seq[i]), int(b.positions[i]), int(b.token_ids[i])
            ctx = context.setdefault(s, list(plan.seqs[s].tokens[:p]))
            assert len(ctx) == p, "a sequence's tokens in the batch are not consecutive"
            ctx.append(tok)
            table = b.page_tables[s]
            if p > 0:
                pp, ps = table[(p - 1) // P], (p - 1) % P
                assert tuple(self.TP[pp, ps]) == (ctx[p - 1], p - 1), (plan.seqs[s], p)
                prev = self.H[pp, ps]
            else:
                prev = SEED
            h = mix(prev, tok)
            self.H[table[p // P], p % P] = h
            self.TP[table[p // P], p % P] = (tok, p)
            self.computed[int(h)] += 1
            self.n_computed += 1
        out = []
        for r in b.logit_rows:
            s, p = int(b.token_seq[r]), int(b.positions[r])
            self.check_context(b.page_tables[s], context[s][:p + 1])
            out.append(next_token(int(self.H[b.page_tables[s][p // P], p % P])))
        return out

    def check_context(self, table, tokens) -> None:
        n, P = len(tokens), self.kv.page_size
        pages = np.asarray(table[:-(-n // P)])
        tp = self.TP[pages].reshape(-1, 2)[:n]
        h = self.H[pages].reshape(-1)[:n]
        assert np.array_equal(tp[:, 0], tokens), "KV holds other tokens"
        assert np.array_equal(tp[:, 1], np.arange(n)), "KV holds other positions"
        assert h[0] == mix(SEED, tokens[0]) and np.array_equal(h[1:], mix(h[:-1], tp[1:, 0])), "hash chain"


def make_scheduler(n_pages=64, page_size=16, host_pages=256, **kw):
    kv = make_kv(n_pages, page_size)
    host = HostPool.like(kv, max_bytes=host_pages * HostPool.like(kv, 0).page_bytes)
    sched = Scheduler(kv, host, ArrayKVCopier(kv, host), **kw)
    return sched, FakeRunner(kv)


def step(sched, runner, check=True):
    """One engine step; checks that no decoding sequence was left out and the invariants hold."""
    plan = sched.plan_step()
    if plan is None:
        return None, []
    decoding = [s for s in sched.running if s.status is SeqStatus.DECODING]
    in_plan = dict(zip(plan.seqs, plan.n_tokens))
    assert all(in_plan.get(s) == 1 + len(plan.drafts.get(s, ())) for s in decoding), \
        "a decoding sequence was left out of the step"
    assert plan.n_read <= sched.step_tokens
    events = sched.complete_step(plan, runner.forward(plan))
    if check:
        from trie_invariants import check_scheduler
        check_scheduler(sched)
    return plan, events


def run(sched, runner, max_steps=100_000, check=True):
    for _ in range(max_steps):
        if not sched.has_work:
            return
        plan, _ = step(sched, runner, check)
        assert plan is not None, "work left but nothing planned"
    raise AssertionError("did not finish")
