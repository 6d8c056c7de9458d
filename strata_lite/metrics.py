"""Prometheus metrics of one engine, in its own CollectorRegistry (no global state)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.running = Gauge("strata_requests_running", "Sequences holding a slot", registry=r)
        self.waiting = Gauge("strata_requests_waiting", "Requests queued for a slot", registry=r)
        self.kv_usage = Gauge("strata_kv_usage_ratio", "Device KV pages in use (incl. cached prefixes), 0-1",
                              registry=r)
        self.host_kv_bytes = Gauge("strata_host_kv_bytes", "Bytes of KV parked in the host pool", registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens at admission, by where their KV came "
                                     "from", ["how"], registry=r)
        for how in ("reused", "restored", "disk", "read"):
            self.prompt_tokens.labels(how=how)
        self.needless_read = Counter("strata_needless_read_tokens", "Prompt tokens read although the prefix trie "
                                     "held their KV (device or host) at admission: the trie's own walk before "
                                     "placement minus what placement reused or restored", registry=r)
        self.evicted_read = Counter("strata_evicted_read_tokens", "Tokens re-read because their KV was evicted "
                                    "for memory", registry=r)
        self.generated = Counter("strata_generated_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY, registry=r)
        self.inter_token = Histogram("strata_inter_token_seconds", "Between consecutive tokens of a sequence",
                                     buckets=_TOKEN, registry=r)
        self.step = Histogram("strata_step_seconds", "One engine step (plan, forward, sampling)",
                              buckets=_TOKEN + (10.0, 30.0), registry=r)
        self.spec_draft = Counter("strata_spec_draft_tokens", "Drafted tokens verified", registry=r)
        self.spec_accepted = Counter("strata_spec_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.spec_steps = Counter("strata_spec_steps", "Sequence-steps that verified a draft", registry=r)
        self.spec_length = Histogram("strata_spec_accepted_length", "Drafted tokens accepted per verified draft",
                                     buckets=tuple(range(0, 17)), registry=r)

    def drafted(self, n_drafted: int, n_accepted: int) -> None:
        """One sequence verified n_drafted drafted tokens in a step and accepted n_accepted of them."""
        self.spec_draft.inc(n_drafted)
        self.spec_accepted.inc(n_accepted)
        self.spec_steps.inc()
        self.spec_length.observe(n_accepted)

    def admitted(self, rec) -> None:
        """One AdmissionRecord (new turn or resumed after preemption)."""
        self.prompt_tokens.labels(how="reused").inc(rec.reused)
        self.prompt_tokens.labels(how="restored").inc(rec.restored)
        self.prompt_tokens.labels(how="disk").inc(rec.from_disk)
        self.prompt_tokens.labels(how="read").inc(rec.read)
        self.needless_read.inc(rec.needless_read)
        self.evicted_read.inc(rec.evicted_for_memory)

    def gauges(self, running: int, waiting: int, kv_usage: float, host_bytes: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.host_kv_bytes.set(host_bytes)


class ActivityLog:
    """The engine's log lines: one per admission (when its read finishes), restores, progress of long
    reads (every progress_s) and decode speed per slot (every decode_s while decoding)."""

    def __init__(self, log, clock, progress_s: float = 5.0, decode_s: float = 10.0):
        self.log, self.clock, self.progress_s, self.decode_s = log, clock, progress_s, decode_s
        self.reading: dict[str, list] = {}        # seq id -> [AdmissionRecord, last progress line time]
        self.window: dict[int, list] = {}         # slot -> [tokens, request id]
        self.window_start = clock()

    def admitted(self, rec, restore_s: float) -> None:
        if rec.restored:
            self.log.info("%s: restored %d tokens from host in %.2f s", rec.seq_id, rec.restored, restore_s)
        self.reading[rec.seq_id] = [rec, rec.t_admitted]

    def forget(self, seq_id: str) -> None:
        self.reading.pop(seq_id, None)

    def after_step(self, running) -> None:
        now = self.clock()
        for seq in running:
            entry = self.reading.get(seq.id)
            if entry is None:
                continue
            rec, last = entry
            if rec.t_read_done is not None:
                del self.reading[seq.id]
                self.log.info("%s in %.1f s", rec.log_line(), rec.read_s)
            elif now - last >= self.progress_s:
                entry[1] = now
                self.log.info("%s: reading the prompt: %s of %s tokens, %.0f s so far", seq.id,
                              f"{seq.n_computed:,}", f"{len(seq.tokens):,}", now - rec.t_admitted)
        done = [k for k, (rec, _) in self.reading.items() if rec.t_read_done is not None]
        for k in done:
            rec = self.reading.pop(k)[0]
            self.log.info("%s in %.1f s", rec.log_line(), rec.read_s)

    def token(self, slot: int, seq_id: str) -> None:
        w = self.window.setdefault(slot, [0, seq_id])
        w[0], w[1] = w[0] + 1, seq_id

    def tick(self) -> None:
        now = self.clock()
        dt = now - self.window_start
        if dt < self.decode_s:
            return
        if self.window:
            parts = [f"slot {s} {n / dt:.1f} tok/s ({rid})" for s, (n, rid) in sorted(self.window.items())]
            self.log.info("decoding: %s", ", ".join(parts))
        self.window, self.window_start = {}, now


def idle_slot(i: int) -> dict:
    return dict(slot=i, state="idle", request_id=None, seq_len=0, reused=0, restored=0, read=0, decode_tok_s=0.0,
                drafted=0, draft_accepted=0)


def slot_snapshot(n_slots: int, running, states: dict) -> list[dict]:
    """engine.slots(): per slot its state, sequence length, the current admission's KV sources, the
    decode speed of its request (states: request id -> RequestState) and its drafted / accepted tokens."""
    slots = [idle_slot(i) for i in range(n_slots)]
    for seq in running:
        rec, st = seq.records[-1], states.get(seq.id)
        slots[seq.slot].update(state=seq.status.value, request_id=seq.id, seq_len=len(seq.tokens),
                               reused=rec.reused, restored=rec.restored, read=rec.read,
                               decode_tok_s=round(st.decode_tok_s, 2) if st else 0.0,
                               drafted=seq.spec.drafted if seq.spec else 0,
                               draft_accepted=seq.spec.accepted if seq.spec else 0)
    return slots
