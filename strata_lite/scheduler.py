"""Scheduler: admits requests where their KV is cached, and plans engine steps that decode one token of
every decoding sequence plus at most `step_tokens` prompt tokens of reading sequences in one forward.

Engine-thread only (no locks). The loop that drives it:

    plan = sched.plan_step()                      # None when there is nothing to compute
    logits = runner.forward(plan.batch)           # rows = plan.logit_seqs
    tokens = [sample(seq, row) for seq, row in zip(plan.logit_seqs, logits)]
    for ev in sched.complete_step(plan, tokens):  # ev.seq, ev.token, ev.finish_reason
        ...stream ev.token; on a stop string: sched.finish(ev.seq, "stop")

With a drafter (spec/controller.py), a decoding sequence may also verify drafted tokens in the same
forward: its rows then give one logit row per token, complete_step accepts the drafted tokens the model
agrees with (tokens[j] == draft[i], the sampled token itself deciding: docs/speculative.md) and emits
them plus the model's own next token; the KV of rejected positions is simply not counted (n_computed)
and pages past the accepted tokens go back to the free list.

KV placement, eviction and parking are TieredKV's (kv_tiers.py); docs/scheduler.md has the design.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from .kv_tiers import TieredKV
from .prefix_trie import common_prefix
from .sampling import InvalidRequest
from .sequence import AdmissionRecord, Request, Sequence, SeqStatus
from .step_plan import StepEvent, StepPlan, build_plan


class Scheduler:
    def __init__(self, kv, host, copier, n_slots: int = 4, step_tokens: int = 256, eog_ids=(),
                 max_seq_len: int | None = None, clock=time.monotonic, keep_records: int = 4096,
                 decode_share: float | None = None, max_step_ratio: float = 3.0, drafter=None, disk=None,
                 kv_filler=None):
        """kv_filler: called as kv_filler(plan) in complete_step once the step's tokens are accepted and
        before its pages are committed, to write KV that depends on them (the MTP drafter's layer, whose
        row at i depends on the token at i + 1: TieredKV then re-reads the last cached token)."""
        if n_slots < 1 or step_tokens < 1:
            raise ValueError("n_slots and step_tokens must be >= 1")
        if decode_share is not None and not (0 < decode_share < 1 and max_step_ratio > 1):
            raise ValueError("decode_share must be in (0, 1) and max_step_ratio > 1")
        self.tiers = TieredKV(kv, host, copier, disk, reread_last=kv_filler is not None)
        self.kv_filler = kv_filler
        self.n_slots, self.step_tokens, self.eog_ids = n_slots, step_tokens, frozenset(eog_ids)
        self.capacity = kv.n_pages * kv.page_size          # tokens one sequence alone can hold
        self.max_seq_len = min(max_seq_len or self.capacity, self.capacity)
        self.clock = clock
        self.drafter = drafter               # drafts(seqs, limits) / observe(seq, n_drafted, n_accepted), or None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []                   # in admission order (oldest first)
        self.by_id: dict[str, Sequence] = {}
        self.records: deque[AdmissionRecord] = deque(maxlen=keep_records)
        self._open: StepPlan | None = None
        self.counters = dict(admissions=0, tokens_reused=0, tokens_restored=0, tokens_from_disk=0, tokens_read=0,
                             needless_read_tokens=0, evicted_for_memory_tokens=0, preemptions=0, steps=0,
                             decode_tokens=0, drafted_tokens=0, prompt_tokens_computed=0)
        # Time budget for reads while sequences decode (off when decode_share is None): the engine reports
        # every step's seconds (observe_step); decoders keep decode_share of their decode-only speed and
        # no step takes more than max_step_ratio decode-only steps, unless the fixed cost of a step that
        # reads is more than that (a GPU's eager forward: _read_cost). Without decoders: step_tokens only.
        self.decode_share, self.max_step_ratio = decode_share, max_step_ratio
        self.t_decode: float | None = None       # EMA, seconds of a decode-only step
        self._reads: deque = deque(maxlen=self.READ_FIT)   # (prompt tokens, extra seconds) of mixed steps
        self._cost = None                        # (_read_cost's result,) for the reads above; None: not fitted
        self.read_credit = 0.0                   # seconds of read time the decoders can still give

    # requests in and out
    def add(self, request: Request | Sequence) -> Sequence:
        seq = request if isinstance(request, Sequence) else Sequence(request)
        if seq.id in self.by_id:
            raise ValueError(f"sequence id {seq.id!r} is already scheduled")
        if len(seq.tokens) >= self.max_seq_len:
            raise InvalidRequest(f"the prompt has {len(seq.tokens)} tokens; at most {self.max_seq_len - 1} "
                                 "fit in the KV cache", param="prompt")
        seq.cached_at_arrival = self.tiers.cached_len(seq.tokens, self.running)
        self.by_id[seq.id] = seq
        self.waiting.append(seq)
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence; its computed KV (prompt + generated) stays in the prefix trie."""
        if seq.status is SeqStatus.FINISHED:
            return
        if self._open is not None and seq in self._open.seqs:
            seq.pending_finish = reason           # applied by complete_step, after the KV is written
            return
        if seq.is_running:
            self.tiers.release(seq)
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason, seq.slot = SeqStatus.FINISHED, reason, -1
        self.by_id.pop(seq.id, None)

    def cancel(self, seq_id: str) -> bool:
        seq = self.by_id.get(seq_id)
        if seq is None:
            return False
        self.finish(seq, "cancelled")
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # one step
    def plan_step(self) -> StepPlan | None:
        """Admit what fits, then plan one forward: a token of every decoding sequence first, then prompt
        chunks of reading sequences (oldest first) up to step_tokens. None when nothing can run."""
        assert self._open is None, "complete_step() the previous plan first"
        self._admit()
        work: dict[Sequence, int] = {}
        for seq in [s for s in self.running if s.status is SeqStatus.DECODING]:
            if seq.is_running and self._fit(seq, 1, work):
                work[seq] = 1
        n_decode, budget = len(work), self.step_tokens
        drafts = self._drafts(list(work)) if self.drafter is not None and work else {}
        for seq, draft in drafts.items():
            work[seq] = 1 + len(draft)
        if n_decode and self.decode_share is not None and any(s.status is SeqStatus.READING for s in self.running):
            budget = min(budget, self._read_budget())
        for seq in [s for s in self.running if s.status is SeqStatus.READING]:
            if budget <= 0:
                break
            if seq.is_running:                    # not preempted meanwhile
                n = self._fit(seq, min(seq.n_pending, budget), work)
                if n:
                    work[seq] = n
                    budget -= n
        if not work:
            return None
        self._open = build_plan(work, n_decode, drafts)
        return self._open

    def _drafts(self, decoding: list[Sequence]) -> dict[Sequence, list[int]]:
        """The drafter's tokens for decoding sequences, each within its token limits (max_tokens and the
        context: the model's own token after the draft must still fit) and the KV pages free now (drafts
        never evict cached prefixes)."""
        limits = {}
        for seq in decoding:
            left = min(seq.request.max_tokens - seq.n_generated, self.max_seq_len - len(seq.tokens)) - 1
            if left >= 1:
                limits[seq] = left
        drafts = {}
        for seq, draft in self.drafter.drafts(decoding, limits).items():
            k = min(len(draft), limits.get(seq, 0))
            k = self.tiers.grow_free(seq, 1 + k) - 1 if k else 0
            if k >= 1:
                drafts[seq] = list(draft[:k])
        return drafts

    def complete_step(self, plan: StepPlan, tokens) -> list[StepEvent]:
        """tokens[j]: the token sampled from logit row j (plan.logit_seqs[j])."""
        assert plan is self._open, "not the open plan"
        self._open = None
        events, j, now = [], 0, self.clock()
        for seq, n in zip(plan.seqs, plan.n_tokens):
            draft = plan.drafts.get(seq)
            if draft is not None:
                j = self._accept(seq, draft, tokens, j, events)
            else:
                seq.n_computed += n
                if seq.n_computed == len(seq.tokens):
                    token = int(tokens[j])
                    seq.tokens.append(token)
                    if seq.status is SeqStatus.READING:
                        seq.status = SeqStatus.DECODING
                        seq.records[-1].t_read_done = now
                    events.append(StepEvent(seq, token, seq.pending_finish or self._stop_reason(seq, token), j))
                    j += 1
        if self.kv_filler is not None:
            self.kv_filler(plan)
        for seq in plan.seqs:
            self.tiers.commit(seq)
        self.counters["steps"] += 1
        self.counters["decode_tokens"] += plan.n_decode
        self.counters["drafted_tokens"] += plan.n_drafted
        self.counters["prompt_tokens_computed"] += plan.n_read
        for seq in plan.seqs:
            if seq.pending_finish:
                self.finish(seq, seq.pending_finish)
        for ev in events:
            if ev.finish_reason:
                self.finish(ev.seq, ev.finish_reason)
        return events

    def _accept(self, seq: Sequence, draft: list[int], tokens, j: int, events: list) -> int:
        """Verify seq's draft against the tokens of its logit rows j .. j + len(draft): emit row i's token
        while every earlier row's token equalled its drafted token (the first that differs is emitted too,
        as is the last row's when the whole draft is accepted), stopping at a finishing token. The KV of the
        pending token and of the accepted drafted tokens is kept (n_computed), rejected positions are
        dropped with the pages past them. Returns the next logit row."""
        n_emitted = accepted = 0
        for i in range(len(draft) + 1):
            token = int(tokens[j + i])
            seq.tokens.append(token)
            n_emitted += 1
            hit = i < len(draft) and token == draft[i]
            accepted += hit
            reason = seq.pending_finish or self._stop_reason(seq, token)
            events.append(StepEvent(seq, token, reason, j + i))
            if reason or not hit:
                break
        seq.n_computed += n_emitted
        self.tiers.trim(seq)
        self.drafter.observe(seq, len(draft), accepted)
        return j + len(draft) + 1

    # time budget
    PROBE_TOKENS = 4          # prompt tokens of the first mixed step, before their cost is known
    EMA = 0.2
    READ_FIT = 8              # mixed steps the read-cost fit looks back on

    def _read_budget(self) -> int:
        """Prompt tokens allowed next to the decodes. None until a decode-only step was timed; then probes
        (PROBE_TOKENS, then twice that once the decoders got the first probe's time back) until the
        extra time of a mixed step is known as fixed + per-token cost (_read_cost); then the tokens the
        read credit pays for, once it pays for at least `_read_chunk` of them (none before: a fixed
        cost is best paid for many tokens at once)."""
        if self.t_decode is None:
            return 0
        cost = self._read_cost()
        if cost is None:
            if not self._reads:
                return self.PROBE_TOKENS
            return min(self.step_tokens, 2 * self._reads[-1][0]) if self.read_credit >= 0 else 0
        fixed, per_token = cost
        chunk = self._read_chunk(cost)
        if self.read_credit < (fixed + per_token * chunk) * (1 - 1e-9):     # (the credit's cap is that cost)
            return 0
        return min(self.step_tokens, max(chunk, int((self.read_credit - fixed) / per_token)))

    def _read_cost(self) -> tuple[float, float] | None:
        """(fixed, per-token) seconds that a mixed step adds to a decode-only step: the least-squares line
        through the last READ_FIT mixed steps' (prompt tokens, extra seconds), None until two of them
        read different token counts. A CPU's cost is per token; a GPU's mixed step is an eager forward
        (no captured graph) whose launches cost ~10 ms whatever the token count, against ~1 ms for a
        decode step: priced per token, one token would cost more than any step may add, and the reader
        would wait for the decoders to finish."""
        if self._cost is None:             # fitted again only after a step that read (observe_step)
            self._cost = (self._fit_reads(),)
        return self._cost[0]

    def _fit_reads(self) -> tuple[float, float] | None:
        if len({n for n, _ in self._reads}) < 2:
            return None
        n = np.array([r[0] for r in self._reads], np.float64)
        t = np.array([r[1] for r in self._reads], np.float64)
        per_token, fixed = np.polyfit(n, t, 1)
        if fixed < 0:                      # no fixed part within the noise: all of it per token
            fixed, per_token = 0.0, t.sum() / n.sum()
        return float(fixed), max(float(per_token), 1e-9)

    def _read_chunk(self, cost) -> int:
        """The fewest prompt tokens worth a mixed step: enough that the per-token cost reaches the fixed one
        (1 when there is none), at most what the readers still need and step_tokens."""
        fixed, per_token = cost
        pending = sum(s.n_pending for s in self.running if s.status is SeqStatus.READING)
        return max(1, min(int(fixed / per_token), pending, self.step_tokens))

    def expected_step_s(self, plan: StepPlan) -> float:
        """What the time budget expects the step to take: a decode-only step plus its prompt tokens' cost
        (_read_cost; 0 while unknown)."""
        cost = self._read_cost() if plan.n_read else None
        return (self.t_decode or 0.0) + (cost[0] + cost[1] * plan.n_read if cost else 0.0)

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """The engine's measure of one step (forward and sampling); feeds the time budget. The read credit
        grows by decode_share's due each step with decoders and pays for the mixed steps' extra time; it
        holds at most max_step_ratio - 1 decode steps, or a _read_chunk's cost where that is more (else
        a fixed cost above the bound would never be paid: on a GPU a step reading a chunk then takes longer
        than the bound, once every few dozen steps)."""
        if self.decode_share is None or not plan.n_decode:
            return
        ema = lambda old, x: x if old is None else old + self.EMA * (x - old)    # noqa: E731
        if not plan.n_read:
            self.t_decode = ema(self.t_decode, seconds)
            extra = 0.0
        elif self.t_decode is None:
            return
        else:
            extra = max(0.0, seconds - self.t_decode)
            self._reads.append((plan.n_read, extra))
            self._cost = None
        cap = (self.max_step_ratio - 1) * self.t_decode
        cost = self._read_cost()
        if cost is not None:
            cap = max(cap, cost[0] + cost[1] * self._read_chunk(cost))
        self.read_credit = min(cap, self.read_credit + self.t_decode * (1 / self.decode_share - 1) - extra)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eog_ids and not seq.request.params.ignore_eos:
            return "stop"
        if seq.n_generated >= seq.request.max_tokens or len(seq.tokens) >= self.max_seq_len:
            return "length"
        return None

    # admission
    def _admit(self) -> None:
        i = 0
        while len(self.running) < self.n_slots and i < len(self.waiting):
            seq = self.waiting[i]
            if self._reader_ahead(seq):
                i += 1                            # wait for the reader instead of reading it twice
                continue
            reserve = self._reserve() if self.running else None
            held = self.tiers.trie.held_len(seq.tokens)    # before placement evicts anything
            placed = self.tiers.place(seq, self.running, reserve)
            if placed is None:
                break                             # memory: admit in order, don't let others pass
            del self.waiting[i]
            self._start(seq, placed, held)

    def _reader_ahead(self, seq: Sequence) -> bool:
        """A running sequence is still reading tokens that are a prefix of seq's."""
        for r in self.running:
            if r.status is SeqStatus.READING:
                n = min(len(r.tokens), len(seq.tokens) - 1)
                if n > r.n_computed and common_prefix(r.tokens, 0, seq.tokens, 0, n) > r.n_computed:
                    return True
        return False

    def _reserve(self) -> int:
        """Device pages the running sequences still need for their tokens plus one more."""
        P = self.tiers.P
        return sum(max(0, -(-(len(s.tokens) + 1) // P) - len(s.pages)) for s in self.running)

    def _start(self, seq: Sequence, placed, held: int) -> None:
        """held: prompt tokens the trie held before placement (its own walk, not placement's match), so
        needless_read counts what placement failed to reuse or restore; the last token is always read."""
        n, cap = len(seq.tokens), len(seq.tokens) - 1
        cached = min(placed.cached, cap)
        rec = AdmissionRecord(
            seq.id, n, placed.reused, placed.restored, n - placed.reused - placed.restored - placed.from_disk,
            needless_read=max(0, self.tiers.usable(held, cap) - placed.reused - placed.restored),
            evicted_for_memory=max(0, min(seq.cached_at_arrival, cap) - cached),
            resumed=bool(seq.records), from_disk=placed.from_disk, slot=self._free_slot(),
            t_arrival=seq.request.arrival, t_admitted=self.clock())
        seq.records.append(rec)
        self.records.append(rec)
        seq.status, seq.slot = SeqStatus.READING, rec.slot
        self.running.append(seq)
        c = self.counters
        c["admissions"] += 1
        c["tokens_reused"] += rec.reused
        c["tokens_restored"] += rec.restored
        c["tokens_from_disk"] += rec.from_disk
        c["tokens_read"] += rec.read
        c["needless_read_tokens"] += rec.needless_read
        c["evicted_for_memory_tokens"] += rec.evicted_for_memory

    def _free_slot(self) -> int:
        used = {s.slot for s in self.running}
        return next(i for i in range(self.n_slots) if i not in used)

    # memory pressure
    def _fit(self, seq: Sequence, want: int, work: dict) -> int:
        """Pages for `want` more tokens of seq (fewer if memory is short); when none fit, park the
        youngest running sequence (seq itself if it is the youngest) and retry."""
        while True:
            n = self.tiers.grow(seq, want)
            if n >= 1:
                return n
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                raise MemoryError(f"{seq.id}: the KV cache cannot hold one more token of a lone sequence")
            self._park(victim)
            work.pop(victim, None)
            if victim is seq:
                return 0

    def _park(self, seq: Sequence) -> None:
        """Preempt: the sequence's KV goes to the trie (then host, as memory needs); it waits first in line."""
        self.tiers.release(seq)
        self.running.remove(seq)
        seq.cached_at_arrival, seq.n_computed = seq.n_computed, 0
        seq.status, seq.slot = SeqStatus.WAITING, -1
        self.waiting.insert(0, seq)
        self.counters["preemptions"] += 1

    # observability
    def pop_records(self) -> list[AdmissionRecord]:
        out = list(self.records)
        self.records.clear()
        return out

    def metrics(self) -> dict:
        m = dict(self.counters)
        m.update(self.tiers.stats)
        m.update({f"{k}_pages": v for k, v in self.tiers.trie.page_counts().items()})
        m.update(running=len(self.running), waiting=len(self.waiting), device_free_pages=self.tiers.kv.n_free,
                 host_free_pages=self.tiers.host.n_free)
        return m
