"""needless_read is counted independently of placement: the trie's own walk (PrefixTrie.held_len) before
placement, minus what placement reused or restored. A placement that misses cached KV (a lookup that finds
nothing, or one that ignores the host tier) shows up in the count, and the count equals the fake model's
ledger of tokens computed twice; the walk agrees with match() and with a brute force over every node."""
import random

import pytest

from fake_engine import make_scheduler, run
from strata_lite.prefix_trie import Match, PrefixTrie, common_prefix
from strata_lite.sequence import Request


def toks(rng, n):
    return [rng.randrange(0, 500) for _ in range(n)]


def brute_held(trie: PrefixTrie, tokens) -> int:
    """The longest prefix of tokens spelled by any root-to-node path (every non-root node holds KV)."""
    best = 0
    for node in trie.nodes():
        path = [t for n in node.path() for t in n.tokens]
        best = max(best, common_prefix(path, 0, tokens, 0))
    return best


def conversations(sched, runner, rng, histories, turns=1):
    """Each history gets `turns` more turns (history + new user tokens; the first turn of an empty
    history is a fresh prompt), run to the end; returns (every prompt sent, the histories after)."""
    prompts = []
    for t in range(turns):
        seqs = []
        for i, h in enumerate(histories):
            prompt = h + toks(rng, rng.randint(1, 30)) if h else toks(rng, rng.randint(5, 90))
            prompts.append(prompt)
            seqs.append(sched.add(Request(f"c{i}/{len(prompts)}", prompt, max_tokens=rng.randint(1, 12))))
        run(sched, runner)
        histories = [list(s.tokens) for s in seqs]
    return prompts, histories


@pytest.mark.parametrize("seed", range(4))
def test_held_len_agrees_with_match_and_brute_force_and_changes_nothing(seed):
    rng = random.Random(seed)
    sched, runner = make_scheduler(n_pages=40, page_size=8, host_pages=300, n_slots=2, step_tokens=24)
    prompts, _ = conversations(sched, runner, rng, [[]] * 4, turns=3)
    trie = sched.tiers.trie
    queries = prompts + [p[:rng.randint(0, len(p))] + toks(rng, 5) for p in prompts] + [toks(rng, 40)]
    assert any(brute_held(trie, q) for q in queries)
    for q in queries:
        uses = [(id(n), n.last_use) for n in trie.nodes()]
        tick = trie.tick
        held = trie.held_len(q)
        assert [(id(n), n.last_use) for n in trie.nodes()] == uses and trie.tick == tick
        assert held == brute_held(trie, q) == trie.match(q).n_matched, q


def _no_lookup(trie):
    return lambda tokens: Match(0, [])


def _device_only(trie):
    """A lookup that stops at the first node parked in the host pool (forgets the host tier)."""
    match = trie.match

    def lookup(tokens):
        m = match(tokens)
        for k, node in enumerate(m.path):
            if not node.on_device:
                return Match(node.start, m.path[:k])
        return m
    return lookup


@pytest.mark.parametrize("broken", [_no_lookup, _device_only])
def test_a_placement_that_misses_cached_kv_is_counted(broken):
    """The old count (placement's own `cached` minus what it used) stays 0 with a broken lookup; the
    independent one equals the tokens computed twice."""
    rng = random.Random(11)
    sched, runner = make_scheduler(n_pages=16, page_size=8, host_pages=400, n_slots=1, step_tokens=32)
    _, histories = conversations(sched, runner, rng, [[]] * 4)     # the device holds about two of them
    assert sched.metrics()["host_pages"] > 0
    sched.tiers.trie.match = broken(sched.tiers.trie)
    conversations(sched, runner, rng, histories)
    m = sched.metrics()
    assert m["needless_read_tokens"] > 0
    assert m["needless_read_tokens"] == runner.recomputed


def test_a_sound_placement_counts_none_and_recomputes_none():
    rng = random.Random(5)
    sched, runner = make_scheduler(n_pages=40, page_size=8, host_pages=400, n_slots=2, step_tokens=16)
    conversations(sched, runner, rng, [[]] * 4, turns=4)
    m = sched.metrics()
    assert m["tokens_reused"] + m["tokens_restored"] > 0 and m["tokens_restored"] > 0
    assert m["needless_read_tokens"] == 0 and runner.recomputed == 0
