"""The engine thread's work between two looks at the inbox (a mixin of Engine, engine-thread only):
take new requests and cancels in (_intake), run one step (_step: plan, forward, sample, complete),
and end each request as its outcome says (_on_token, _finish, _fail).

A failure is kept to what it concerns: one request's (taking it in, its token, its cancel) ends that
request; a step's (forward, sampling, complete_step) ends the step's requests, then the KV accounting is
checked; bookkeeping (metrics, logs, /slots) is logged and ends nobody's request. What escapes is a
failure of the loop itself, for Engine._supervise.
"""
from __future__ import annotations

import logging
import time

from .engine_events import DoneEvent, ErrorEvent, RequestHandle, TokenEvent
from .kernels import DeviceFault
from .kernels.sample_rows import SampleRows
from .metrics import slot_snapshot
from .runner import RequestState
from .sampling import InvalidRequest, needs_counts
from .sequence import SeqStatus

log = logging.getLogger("strata_lite")
MAX_STEP_RATIO = 3.0     # with the time budget on, no step takes longer than this many decode-only steps
                         # (or what the fixed cost of a step that reads takes, where that is more)
PUBLISH_S = 0.05         # /slots and the gauges: refreshed when who runs or waits, or in which state, changes,
                         # else at most this often


class StepLoop:
    def _intake(self) -> bool:
        """New requests into the scheduler and cancellations applied; waits while idle. False: stop."""
        with self._cond:
            if not self._inbox and not self._cancels and not self._sched.has_work and not self._stopping:
                self._cond.wait(1.0)
            if self._stopping:
                return False
            cancels, self._cancels = self._cancels, []
            while self._inbox:
                self._take(self._inbox.popleft())
            for h in cancels:
                act = self._active.get(h.id)
                if act is None:
                    continue
                try:
                    self._sched.cancel(h.id)
                    self._finish(act, "cancelled")
                except Exception:       # noqa: BLE001 - ends this request only
                    log.exception("%s: cancelling failed", h.id)
                    self._fail(act, "cancelling the request failed (an internal error; the server log has the details)")
            self._publish(force=False)
        return True

    def _take(self, h: RequestHandle) -> None:
        """(Under self._cond.) One new request into the scheduler; a request that cannot be taken (bad
        input the checks missed, a bug) ends alone with an ErrorEvent."""
        if h.cancelled:
            self._ids.discard(h.id)
            h._put(DoneEvent("cancelled", len(h.request.prompt_ids), 0, 0, ""))
            return
        seq, row = None, -1
        try:
            seq = self._sched.add(h.request)
            row = self._runner.take_count_row() if needs_counts(h.request.params) else -1
            if row < 0:                      # penalties count tokens as they are accepted: no drafting
                self._spec.attach(seq)
            self._active[h.id] = RequestState(h, seq, self.tokenizer, row)
        except Exception as e:               # noqa: BLE001
            if not isinstance(e, InvalidRequest):
                log.exception("%s: taking the request in failed", h.id)
            if row >= 0:
                self._runner.free_count_row(row)
            if seq is not None:
                self._sched.finish(seq, "error")
            self._ids.discard(h.id)
            h._put(ErrorEvent(str(e) if isinstance(e, InvalidRequest) else "the request could not be taken in (an internal error; the server log has the details)"))

    def _step(self) -> None:
        t0, restore0 = time.perf_counter(), self._runner.copier.restore_s
        try:
            plan = self._sched.plan_step()
        except Exception as e:               # noqa: BLE001
            self._raise_if_device_fault(e)
            log.exception("planning a step failed")
            self._hand_out()
            for seq in list(self._sched.running) + list(self._sched.waiting):
                self._fail(self._active[seq.id], "the engine failed to schedule this request (an internal error; the server log has the details)")
            return
        records = self._sched.pop_records()
        for rec in records:
            self.metrics.admitted(rec)
            self._activity.admitted(rec, self._runner.copier.restore_s - restore0)
        if records:                          # /slots and the gauges show admitted requests while they read
            with self._cond:
                self._publish()
        if plan is None:
            self._hand_out()
            self._unplaceable()
            return
        try:
            logits = self._runner.forward(plan.batch)
        except Exception as e:               # noqa: BLE001
            self._hand_out()
            self._step_failed(e, plan)
            return
        self._hand_out()                     # the previous step's tokens, while the device computes this one
        try:
            tokens, failed = self._sample_step(plan, logits)
            # a step that samples nothing (prompt chunks only) would otherwise return before the device ran
            # it, and its time would be charged to the next step (the scheduler's cost model and the
            # decode-share budget learn from these times)
            self._runner.backend.synchronize()
            events = self._sched.complete_step(plan, tokens)
        except Exception as e:               # noqa: BLE001
            self._step_failed(e, plan)
            return
        slot_of = {seq.id: seq.slot for seq in plan.logit_seqs}   # complete_step frees the slots of finished ones
        out = []
        for ev in events:
            act = self._active.get(ev.seq.id)
            if act is None or act.seq is not ev.seq:
                continue                     # ended by an earlier token of this step (a stop string)
            if ev.seq.id in failed:
                self._fail(act, failed[ev.seq.id])
                continue
            act.used_uniform()
            out.append((act, ev.token, ev.finish_reason, slot_of.get(ev.seq.id, ev.seq.slot),
                        act.row_logprobs.get(ev.row, (None, None))))
        self._out = out
        self._count_drafts()
        try:
            self._after_step(plan, time.perf_counter() - t0, self._runner.copier.restore_s - restore0)
        except Exception:                    # noqa: BLE001 - metrics and logs only: nobody's request ends
            log.exception("the bookkeeping after a step failed (metrics and /slots may lag)")
        if not (self._sched.has_work and self._runner.backend.queues_work):
            self._hand_out()                 # nothing to overlap (the CPU computes a forward in the call)

    def _step_failed(self, e: Exception, plan) -> None:
        self._raise_if_device_fault(e)
        log.exception("a step failed")
        self._abort_plan(plan, "the step failed (an internal error; the server log has the details)")

    def _hand_out(self) -> None:
        """The last completed step's tokens to their clients (token events, text, stop strings, metrics;
        _on_token). On a backend that queues work (Backend.queues_work: CUDA) _step calls it right after
        launching the next step's forward, so that this host work, and the wake-up of the threads that
        stream the tokens, overlap the device's work instead of delaying the next launch; elsewhere at the
        end of the step; and whenever no forward follows (idle, nothing placeable, a failure). A stop string
        found here ends its request; the step already launched then computed one token more for it, which
        is not handed out (its KV is kept with the sequence's other tokens)."""
        out, self._out = self._out, []
        for act, token, reason, slot, logprobs in out:
            if self._active.get(act.handle.id) is not act:
                continue                     # ended meanwhile (a stop string, a cancel, a failure)
            try:
                self._on_token(act, token, reason, slot, logprobs)
            except Exception:           # noqa: BLE001
                log.exception("%s: handling its token failed", act.handle.id)
                self._fail(act, "handling the token failed (an internal error; the server log has the details)")

    def _after_step(self, plan, took: float, restore_s: float) -> None:
        self._activity.after_step(self._sched.running)
        td, expected = self._sched.t_decode, self._sched.expected_step_s(plan)
        if plan.n_decode and td and took > 1.5 * max(MAX_STEP_RATIO * td, expected):
            log.info("slow step: %.0f ms (%d decodes + %d prompt tokens; decode step %.0f ms, expected %.0f ms)",
                     took * 1e3, plan.n_decode, plan.n_read, td * 1e3, expected * 1e3)
        self._sched.observe_step(plan, took - restore_s)
        self._spec.observe_step(plan.n_tokens_total, plan.n_read, took - restore_s)
        self.metrics.step.observe(took)
        with self._cond:
            self._publish(force=False)

    def _sample_step(self, plan, logits) -> tuple[list[int], dict[str, str]]:
        """One backend sampling call for every logit row (a sequence verifying a draft has one per drafted
        token and one more), then each request takes its tokens (and logprobs); a request failing there
        gets token 0 (appended but never computed: the KV stays clean) and an error message in the
        returned dict. The taken tokens are counted for the penalties (whose requests never draft). A
        sequence whose request ended while the step ran (a stop string found at _hand_out) takes its
        greedy token, which complete_step keeps with the sequence and nobody hands out."""
        acts = [self._active.get(seq.id) for seq in plan.logit_seqs]
        if not acts:
            return [], {}
        local: dict[int, int] = {}
        rows = []
        for act in acts:
            if act is None:
                rows.append({})
                continue
            i = local.get(id(act), 0)
            local[id(act)] = i + 1
            if i == 0:
                act.row_logprobs.clear()
            rows.append(act.sample_row(i))
        sampled = self._runner.sample(logits, SampleRows.from_rows(rows))
        tokens, failed = [], {}
        for i, act in enumerate(acts):
            if act is None:
                tokens.append(int(sampled.ids[i]))
                continue
            try:
                tokens.append(self._sample(act, sampled, i))
            except Exception:           # noqa: BLE001
                log.exception("%s: sampling failed", act.handle.id)
                failed[act.handle.id] = "sampling failed (an internal error; the server log has the details)"
                tokens.append(0)
        self._runner.add_counts([-1 if a is None or a.handle.id in failed else a.count_row for a in acts], tokens)
        return tokens, failed

    def _count_drafts(self) -> None:
        """Metrics of the drafts verified in the step."""
        for n_drafted, n_accepted in self._spec.pop_outcomes():
            self.metrics.drafted(n_drafted, n_accepted)

    def _sample(self, act: RequestState, sampled, i: int) -> int:
        return act.took(sampled, i)

    def _on_token(self, act: RequestState, token: int, reason: str | None, slot: int,
                  logprobs: tuple = (None, None)) -> None:
        now, seq = self.clock(), act.seq
        if act.t_first is None:
            act.t_first = now
            self.metrics.ttft.observe(now - act.request.arrival)
        else:
            self.metrics.inter_token.observe(now - act.t_last)
        act.t_last = now
        self.metrics.generated.inc()
        self._activity.token(slot, seq.id)
        piece = act.push(token, finishing=reason is not None)
        if act.stopped:                      # a stop string (the text is cut before it)
            if reason is None:
                self._sched.finish(seq, "stop")
            reason = "stop"
        logprob, top = logprobs
        act.n_emitted += 1
        act.handle._put(TokenEvent(token, piece, logprob, top))
        if reason is not None:
            self._finish(act, reason)

    def _finish(self, act: RequestState, reason: str) -> None:
        recs = act.seq.records
        cached = recs[0].reused + recs[0].restored + recs[0].from_disk if recs else 0
        act.handle._put(DoneEvent(reason, len(act.request.prompt_ids), act.n_emitted, cached, act.text))
        if act.seq.spec is not None and act.seq.spec.steps:
            log.info("%s: %s", act.handle.id, act.seq.spec.log_text())
        took = self.clock() - act.request.arrival
        self._avg_request_s = took if self._avg_request_s is None else 0.8 * self._avg_request_s + 0.2 * took
        self._drop(act)

    def _fail(self, act: RequestState, message: str) -> None:
        """End one request with an ErrorEvent. If the scheduler cannot let go of its sequence, that is
        logged; the next step then meets a sequence without a request, a loop failure (_supervise)."""
        try:
            if act.seq.status is not SeqStatus.FINISHED:
                self._sched.finish(act.seq, "error")
        except Exception:                    # noqa: BLE001
            log.exception("%s: ending its sequence failed", act.handle.id)
        act.handle._put(ErrorEvent(message))
        self._drop(act)

    def _drop(self, act: RequestState) -> None:
        if self._active.pop(act.handle.id, None) is act and act.count_row >= 0:
            self._runner.free_count_row(act.count_row)
        self._spec.finished(act.seq)
        self._activity.forget(act.handle.id)
        with self._cond:
            self._ids.discard(act.handle.id)

    def _raise_if_device_fault(self, e: Exception) -> None:
        """A device fault ends the engine (every request fails, /health reports it, `serve` exits 1)."""
        if self._runner.backend.is_fault(e):
            raise DeviceFault(f"the {self._runner.backend.name} device failed: {e}") from e

    def _abort_plan(self, plan, message: str) -> None:
        """The forward, sampling or complete_step failed: its sequences end with an error, their KV up
        to n_computed (unchanged unless complete_step got that far: then the KV was written) goes to
        the trie. The page accounting is checked then: when it is wrong, the loop's supervisor
        restarts it. TODO: a Scheduler.abort_step(plan) instead of clearing its open plan here."""
        self._sched._open = None
        for seq in plan.seqs:
            act = self._active.get(seq.id)
            if act is not None:
                self._fail(act, message)
            elif seq.status is not SeqStatus.FINISHED:     # its request ended while the step ran (_hand_out)
                self._sched.finish(seq, seq.pending_finish or "error")
        problems = self._sched.tiers.audit(self._sched.running, self._reserved_pages())
        if problems:
            raise RuntimeError(f"the KV accounting is wrong after a failed step: {'; '.join(problems)}")

    def _reserved_pages(self) -> list[int]:
        """Device pages outside the scheduler's accounting (the runner's scratch page)."""
        return [p for p in (self._runner.scratch_page,) if p >= 0]

    def _unplaceable(self) -> None:
        """Nothing could be planned: with nobody running, the head of the queue cannot be placed."""
        if not self._sched.running and self._sched.waiting:
            seq = self._sched.waiting[0]
            self._fail(self._active[seq.id], "the request does not fit in the KV cache")
        else:
            time.sleep(0.001)

    def _publish(self, force: bool = True) -> None:
        """(Under self._cond.) Counts for submit's queue check, gauges and the slot snapshot. Without force,
        only when the running or waiting sequences or their states (reading, decoding) changed or PUBLISH_S
        passed since the last time: a decode step takes ~1 ms on a GPU, and the slot snapshot alone cost ~10 µs
        of it (sequence lengths and decode rates in /slots and the KV gauges lag by PUBLISH_S at most)."""
        s, r = self._sched, self._runner
        key, now = (tuple((q.id, q.status) for q in s.running), len(s.waiting)), time.monotonic()
        if not force and key == self._published[0] and now - self._published[1] < PUBLISH_S:
            return
        self._published = (key, now)
        self._counts = (len(s.running), len(s.waiting))
        self.metrics.gauges(len(s.running), len(s.waiting), r.kv_usage, r.host_bytes_used)
        self._slots = slot_snapshot(self.config.parallel, s.running, self._active)
