"""Scheduler + TieredKV + HostPool against a fake model whose KV is the token, position and prefix hash
(fake_engine.py): generated tokens equal the reference only if every reused/restored/copied page held
exactly the right tokens' KV; the fake model's ledger counts every token whose KV was computed twice."""
import random

import numpy as np
import pytest

from fake_engine import make_kv, make_scheduler, reference_generation, run, step
from strata_lite.host_pool import ArrayKVCopier, HostPool
from strata_lite.sampling import InvalidRequest, SamplingParams
from strata_lite.sequence import Request, SeqStatus
from trie_invariants import check_contents


def toks(rng, n, lo=0, hi=1000):
    return [rng.randrange(lo, hi) for _ in range(n)]


class Conversation:
    """A client conversation: each turn = the whole history + new user tokens."""

    def __init__(self, cid, rng, first=120, user=(10, 60), gen=(5, 40)):
        self.cid, self.rng, self.user, self.gen = cid, rng, user, gen
        self.history, self.turn, self.computed = toks(rng, first), 0, 0

    def request(self) -> Request:
        self.turn += 1
        prompt = self.history + toks(self.rng, self.rng.randint(*self.user)) if self.turn > 1 else self.history
        return Request(f"{self.cid}/{self.turn}", prompt, max_tokens=self.rng.randint(*self.gen))

    def absorb(self, seq) -> None:
        assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "length"
        assert seq.generated == reference_generation(seq.tokens[:seq.n_prompt], seq.request.max_tokens)
        self.history, self.computed = list(seq.tokens), len(seq.tokens) - 1


def check_turn(conv, seq, exact=True):
    """A later turn reads only its new tokens: its cached history is reused or restored, never re-read."""
    rec = seq.records[0]
    assert rec.reused + rec.restored + rec.read == rec.n_prompt
    assert rec.needless_read == 0, rec.log_line()
    if exact and conv.computed:
        assert rec.reused + rec.restored == conv.computed, rec.log_line()


def test_single_turn_matches_reference():
    sched, runner = make_scheduler()
    p = toks(random.Random(1), 100)
    seq = sched.add(Request("a", p, max_tokens=30))
    run(sched, runner)
    assert seq.generated == reference_generation(p, 30) and seq.finish_reason == "length"
    assert seq.records[0].log_line() == "a: prompt 100 tokens = 0 reused + 0 restored + 100 read"
    assert seq.records[0].t_read_done is not None
    check_contents(sched, hashes=True)


@pytest.mark.parametrize("n_slots", [1, 2, 3, 8])
@pytest.mark.parametrize("order", ["rounds", "shuffled", "reversed"])
def test_turn_orders_never_reread(n_slots, order):
    """5 conversations, 4 turns each, sent concurrently in various orders, over few slots and a device
    too small for all of them: every turn reuses or restores its whole history."""
    rng = random.Random(hash((n_slots, order)) & 0xFFFF)
    sched, runner = make_scheduler(n_pages=80, page_size=16, host_pages=600, n_slots=n_slots, step_tokens=48)
    convs = [Conversation(f"c{i}", rng) for i in range(5)]
    for _ in range(4):
        batch = list(convs)
        if order == "shuffled":
            rng.shuffle(batch)
        elif order == "reversed":
            batch.reverse()
        seqs = [(c, sched.add(c.request())) for c in batch]
        run(sched, runner)
        for conv, seq in seqs:
            check_turn(conv, seq)
            conv.absorb(seq)
    m = sched.metrics()
    assert m["needless_read_tokens"] == 0 and runner.recomputed == 0
    assert m["pages_parked"] > 0 and m["tokens_restored"] > 0       # the device was too small: parking happened
    check_contents(sched, hashes=True)


@pytest.mark.parametrize("n_slots", [1, 4])
def test_continuous_turns(n_slots):
    """Each conversation sends its next turn as soon as the previous one finished (interleaved turns)."""
    rng = random.Random(7 + n_slots)
    sched, runner = make_scheduler(n_pages=60, page_size=16, host_pages=800, n_slots=n_slots, step_tokens=32)
    convs = {f"c{i}": Conversation(f"c{i}", rng, first=rng.randint(20, 200)) for i in range(6)}
    live = {}
    for c in convs.values():
        live[c.cid] = sched.add(c.request())
    turns = 0
    while live:
        _, events = step(sched, runner)
        for ev in events:
            if ev.finish_reason:
                conv = convs[ev.seq.id.split("/")[0]]
                check_turn(conv, ev.seq)
                conv.absorb(ev.seq)
                turns += 1
                del live[conv.cid]
                if conv.turn < 5:
                    live[conv.cid] = sched.add(conv.request())
    assert turns == 30 and runner.recomputed == 0 and sched.metrics()["needless_read_tokens"] == 0


def test_one_slot_alternating_conversations_restore_from_host():
    """The issue's case: two long conversations over one slot, turns alternating, device holds one."""
    rng = random.Random(3)
    sched, runner = make_scheduler(n_pages=40, page_size=16, host_pages=400, n_slots=1, step_tokens=64)
    a, b = Conversation("a", rng, first=400), Conversation("b", rng, first=400)
    for _ in range(3):
        for conv in (a, b):
            seq = sched.add(conv.request())
            run(sched, runner)
            check_turn(conv, seq)
            conv.absorb(seq)
    recs = [r for r in sched.pop_records() if r.seq_id.endswith(("/2", "/3"))]
    assert all(r.restored > 100 for r in recs), [r.log_line() for r in recs]    # part parked, part still on device
    assert runner.recomputed == 0


def test_edited_history_reuses_exact_common_prefix():
    """An edit of an earlier turn reuses the common prefix to the token, copying a partly matched page
    (copy-on-write, from the device and, after parking, from the host)."""
    rng = random.Random(5)
    sched, runner = make_scheduler(n_pages=24, page_size=16, host_pages=200, n_slots=2)
    conv = Conversation("a", rng, first=150)
    seq = sched.add(conv.request())
    run(sched, runner)
    conv.absorb(seq)
    for k, src in ((101, "device"), (37, "device"), (150, "host")):
        if src == "host":      # push the conversation out of the device with another one
            sched.add(Request("other", toks(rng, 330, 2000, 3000), max_tokens=2))
            run(sched, runner)
        edit = [t + 1 for t in conv.history[k:k + 20]]
        before = sched.metrics()["cow_copies"]
        s = sched.add(Request(f"edit{k}", conv.history[:k] + edit, max_tokens=8))
        run(sched, runner)
        rec = s.records[0]
        assert rec.reused + rec.restored == k and rec.read == 20, rec.log_line()
        assert (rec.restored > 0) == (src == "host"), rec.log_line()
        assert sched.metrics()["cow_copies"] == before + 1
        assert s.generated == reference_generation(s.tokens[:s.n_prompt], 8)
    assert runner.recomputed == 0
    check_contents(sched, hashes=True)


def test_host_pool_full_drops_lru_and_counts_it():
    """With a small host pool, least recently used KV is dropped; results stay right, reads of dropped
    KV are counted as evicted for memory, never as needless."""
    rng = random.Random(11)
    sched, runner = make_scheduler(n_pages=30, page_size=16, host_pages=40, n_slots=2, step_tokens=64)
    convs = [Conversation(f"c{i}", rng, first=200) for i in range(5)]
    for _ in range(3):
        seqs = [(c, sched.add(c.request())) for c in convs]
        run(sched, runner)
        for conv, seq in seqs:
            check_turn(conv, seq, exact=False)
            conv.absorb(seq)
    m = sched.metrics()
    dropped = m["device_tokens_dropped"] + m["host_tokens_dropped"]
    assert dropped > 0 and m["needless_read_tokens"] == 0
    assert 0 < runner.recomputed <= dropped
    assert m["evicted_for_memory_tokens"] <= runner.recomputed
    check_contents(sched, hashes=True)


def test_lru_drops_oldest_conversation_first():
    """Eviction takes the least recently used, deepest pages first: only the oldest conversation lost
    KV (its tail), the others are whole (on the device or parked)."""
    rng = random.Random(12)
    sched, runner = make_scheduler(n_pages=20, page_size=16, host_pages=20, n_slots=1)
    convs = [Conversation(f"c{i}", rng, first=150) for i in range(4)]
    for conv in convs:
        seq = sched.add(conv.request())
        run(sched, runner)
        conv.absorb(seq)
    cached = [sched.tiers.cached_len(c.history) for c in convs]
    assert cached[0] < convs[0].computed and cached[0] % 16 == 0
    assert cached[1:] == [c.computed for c in convs[1:]]
    seq = sched.add(convs[0].request())
    run(sched, runner)
    rec = seq.records[0]
    assert rec.reused + rec.restored == cached[0] and rec.evicted_for_memory == 0 and rec.needless_read == 0


def test_cancel_keeps_computed_kv():
    rng = random.Random(13)
    sched, runner = make_scheduler(n_pages=64, page_size=16, n_slots=2, step_tokens=40)
    p = toks(rng, 300)
    a = sched.add(Request("a", p, max_tokens=50))
    for _ in range(3):
        step(sched, runner)
    assert a.status is SeqStatus.READING and a.n_computed == 120
    assert sched.cancel("a") and a.finish_reason == "cancelled" and not sched.cancel("a")
    b = sched.add(Request("b", p, max_tokens=20))
    for _ in range(12):
        step(sched, runner)
    assert b.records[0].reused == 120 and b.status is SeqStatus.DECODING
    n = b.n_computed
    sched.cancel("b")                               # mid-decode: prompt + generated are kept
    c = sched.add(Request("c", b.tokens + toks(rng, 5), max_tokens=3))
    run(sched, runner)
    assert c.records[0].reused == n and c.generated == reference_generation(c.tokens[:c.n_prompt], 3)
    w = sched.add(Request("w", toks(rng, 10), max_tokens=3))
    assert sched.cancel("w") and w.status is SeqStatus.FINISHED and not sched.has_work
    assert runner.recomputed == 0


def test_decode_never_starved_by_long_read():
    rng = random.Random(17)
    sched, runner = make_scheduler(n_pages=200, page_size=16, n_slots=4, step_tokens=64)
    short = [sched.add(Request(f"s{i}", toks(rng, 20), max_tokens=200)) for i in range(3)]
    for _ in range(3):
        step(sched, runner)
    assert all(s.status is SeqStatus.DECODING for s in short)
    long = sched.add(Request("long", toks(rng, 2000), max_tokens=5))
    n_steps = 0
    while long.status is not SeqStatus.DECODING:
        plan, _ = step(sched, runner, check=False)      # step() asserts every decoding sequence is in
        assert plan.n_decode == 3 and plan.n_read <= 64
        n_steps += 1
    assert n_steps == -(-2000 // 64)
    run(sched, runner)
    for s in short:
        assert s.generated == reference_generation(s.tokens[:20], 200)


def test_same_prompt_read_once():
    """n requests with one prompt: the first reads it, the others wait and share it (only their last
    token is recomputed, for its logits)."""
    rng = random.Random(19)
    sched, runner = make_scheduler(n_pages=100, page_size=16, n_slots=4, step_tokens=32)
    p = toks(rng, 203)
    seqs = [sched.add(Request(f"x/{i}", p, max_tokens=10)) for i in range(3)]
    run(sched, runner)
    recs = [s.records[0] for s in seqs]
    assert recs[0].read == 203
    assert all(r.reused == 202 and r.read == 1 for r in recs[1:]), [r.log_line() for r in recs]
    assert runner.n_computed == 203 + 2 + 3 * 9 and runner.recomputed == 2 + 2 * 9   # + identical decodes
    assert all(s.generated == reference_generation(p, 10) for s in seqs)


def test_shared_system_prompt_while_reading():
    """A request sharing only a prefix with a reading one waits for it, then reads only its own tail."""
    rng = random.Random(23)
    sched, runner = make_scheduler(n_pages=100, page_size=16, n_slots=4, step_tokens=32)
    system = toks(rng, 180)
    a = sched.add(Request("a", system + toks(rng, 30), max_tokens=4))
    b = sched.add(Request("b", system + toks(rng, 25), max_tokens=4))
    run(sched, runner)
    assert b.records[0].reused == 180 and b.records[0].read == 25
    assert runner.recomputed == 0 and a.generated and b.generated


def test_preemption_parks_and_resumes():
    """More decoding than the device holds: the youngest is parked (KV to the trie/host) and resumes
    without recomputing anything."""
    rng = random.Random(29)
    sched, runner = make_scheduler(n_pages=24, page_size=16, host_pages=200, n_slots=4, step_tokens=64)
    seqs = [sched.add(Request(f"p{i}", toks(rng, 60), max_tokens=120)) for i in range(4)]
    run(sched, runner)
    m = sched.metrics()
    assert m["preemptions"] > 0 and runner.recomputed == 0 and m["needless_read_tokens"] == 0
    for s in seqs:
        assert s.generated == reference_generation(s.tokens[:60], 120)
    resumed = [r for s in seqs for r in s.records if r.resumed]
    assert resumed and all(r.read <= 1 or r.reused + r.restored > 0 for r in resumed)


def test_stop_token_length_and_limits():
    rng = random.Random(31)
    p = toks(rng, 30)
    eog = reference_generation(p, 5)[2]
    sched, runner = make_scheduler(n_pages=8, page_size=16, eog_ids=[eog], max_seq_len=45)
    a = sched.add(Request("a", p, max_tokens=100))
    run(sched, runner)
    assert a.finish_reason == "stop" and a.generated == reference_generation(p, 3)
    a2 = sched.add(Request("a2", p, SamplingParams(ignore_eos=True), max_tokens=10))
    run(sched, runner)
    assert a2.finish_reason == "length" and a2.generated == reference_generation(p, 10)
    b = sched.add(Request("b", toks(rng, 30), max_tokens=100))
    run(sched, runner)
    assert b.finish_reason == "length" and len(b.tokens) == 45
    with pytest.raises(InvalidRequest):
        sched.add(Request("c", toks(rng, 45)))
    with pytest.raises(InvalidRequest):
        Request("d", [])
    with pytest.raises(ValueError):
        sched.add(Request("b2", p)) and sched.add(Request("b2", p))


def test_slots_and_finish_from_engine_loop():
    """Slots are distinct among running sequences; finish() from the loop (a stop string) works, also
    between plan and complete."""
    rng = random.Random(37)
    sched, runner = make_scheduler(n_pages=64, n_slots=3)
    seqs = [sched.add(Request(f"q{i}", toks(rng, 20), max_tokens=50)) for i in range(5)]
    plan = sched.plan_step()
    assert sorted(s.slot for s in sched.running) == [0, 1, 2] and len(sched.waiting) == 2
    sched.finish(seqs[0], "stop")                   # plan open: applied after the step's KV is written
    assert seqs[0].status is SeqStatus.READING
    events = sched.complete_step(plan, runner.forward(plan))
    assert seqs[0].finish_reason == "stop" and any(e.finish_reason == "stop" for e in events)
    run(sched, runner)
    assert all(s.status is SeqStatus.FINISHED for s in seqs)


def test_array_copier_round_trip():
    kv = make_kv(8, 4)
    host = HostPool.like(kv, max_bytes=10 * HostPool.like(kv, 0).page_bytes)
    assert host.n_pages == 10 and host.alloc(11) is None
    rng = np.random.default_rng(0)
    for a in (kv.k_pages, kv.v_pages):
        a[...] = rng.integers(-128, 127, a.shape)
    for a in (kv.k_scales, kv.v_scales):
        a[...] = rng.random(a.shape)
    orig = [a.copy() for a in (kv.k_pages, kv.k_scales, kv.v_pages, kv.v_scales)]
    cp = ArrayKVCopier(kv, host)
    cp.copy_pages_to_host([1, 5], [7, 2])
    cp.copy_pages_to_device([2, 7], [0, 3])
    cp.copy_page_prefix(6, 4, 3)
    for a, o in zip((kv.k_pages, kv.k_scales, kv.v_pages, kv.v_scales), orig):
        assert np.array_equal(a[:, 0], o[:, 5]) and np.array_equal(a[:, 3], o[:, 1])
        assert np.array_equal(a[:, 4, :3], o[:, 6, :3]) and np.array_equal(a[:, 4, 3:], o[:, 4, 3:])


def test_evicted_while_waiting_is_counted_as_evicted_for_memory():
    """A waiting request's cached prefix dropped (device and host full) before it is admitted: those
    tokens are read again and counted as evicted for memory, not as needless."""
    rng = random.Random(41)
    sched, runner = make_scheduler(n_pages=10, page_size=16, host_pages=3, n_slots=1)
    x = sched.add(Request("x", toks(rng, 100), max_tokens=20))
    run(sched, runner)
    a = sched.add(Request("a", toks(rng, 20), max_tokens=135))      # will need the whole device
    step(sched, runner)
    b = sched.add(Request("b", x.tokens + toks(rng, 10), max_tokens=2))
    assert b.cached_at_arrival == 119
    run(sched, runner)
    rec = b.records[0]
    assert rec.evicted_for_memory > 0 and rec.needless_read == 0
    assert rec.reused + rec.restored == 119 - rec.evicted_for_memory
    assert b.generated == reference_generation(b.tokens[:b.n_prompt], 2) and a.finish_reason == "length"
