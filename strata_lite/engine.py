"""Engine: one thread that owns the model, the KV tiers and the scheduler, and serves many requests.

Other threads only `submit()` (validated, queued FIFO), read events from their RequestHandle, and
`cancel()`. The engine thread loops: take new requests and cancellations, then one step:

    plan = sched.plan_step(); logits = runner.forward(plan.batch) (on the device);
    sampled = runner.sample(logits, one row per logit row); sched.complete_step(plan, tokens)

Every step decodes one token of every running sequence plus at most step_tokens prompt tokens.
A failure inside a step ends only the requests of that step (ErrorEvent); the engine keeps serving.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from pathlib import Path

from .config import EngineConfig
from .engine_events import (DoneEvent, EngineNotReady, ErrorEvent, PromptTooLong, QueueFull, RequestHandle,
                            TokenEvent)
from .kernels import DeviceFault
from .kernels.sample_rows import SampleRows
from .loader.known_models import DEFAULT_MODEL, KNOWN_MODELS
from .metrics import ActivityLog, EngineMetrics, idle_slot, slot_snapshot
from .perplexity import log_softmax
from .runner import ModelRunner, RequestState, load_model
from .scheduler import Scheduler
from .sampling import InvalidRequest, needs_counts
from .sequence import Request, SeqStatus

__all__ = ["Engine", "EngineConfig", "RequestHandle", "PromptTooLong", "QueueFull", "EngineNotReady", "InvalidRequest",
           "TokenEvent", "DoneEvent", "ErrorEvent", "log_softmax"]
log = logging.getLogger("strata_lite")
MAX_LOGPROBS = 20
MAX_STEP_RATIO = 3.0     # with the time budget on, no step takes longer than this many decode-only steps


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.n_ctx = config.n_ctx
        self.model_id = _model_id(config.model)
        self.ready, self.stopped = threading.Event(), threading.Event()
        self.load_error: Exception | None = None
        self.fatal_error: BaseException | None = None     # what stopped the engine thread, if anything did
        self.tokenizer = self.chat_template = None
        self.metrics = EngineMetrics()
        self.metrics_registry = self.metrics.registry
        self.clock = time.monotonic
        self._cond = threading.Condition()
        self._inbox: deque[RequestHandle] = deque()
        self._cancels: list[RequestHandle] = []
        self._ids: set[str] = set()                 # requests in the inbox or the scheduler
        self._counts = (0, 0)                       # (running, waiting in the scheduler), published
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._slots: list[dict] = [idle_slot(i) for i in range(config.parallel)]
        self._avg_request_s: float | None = None
        self._runner = self._sched = None
        self._active: dict[str, RequestState] = {}
        self._activity = ActivityLog(log, self.clock)

    # lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine was already started")
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is None:
            self.stopped.set()
        elif self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the model; raises the load error if loading failed. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready.is_set() and not self.stopped.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.ready.wait(0.1 if left is None else min(0.1, left))
        if self.load_error is not None:
            raise self.load_error
        return self.ready.is_set()

    # requests (any thread)
    def submit(self, request: Request) -> RequestHandle:
        if not self.ready.is_set() or self._stopping or self.stopped.is_set():
            raise EngineNotReady("the model is still loading" if not self.stopped.is_set() and not self._stopping
                                 else "the engine is stopped")
        self._validate(request)
        handle = RequestHandle(request, self._cancel)
        with self._cond:
            if request.id in self._ids:
                raise InvalidRequest(f"request id {request.id!r} is already being served", param="id")
            running, waiting = self._counts
            behind = len(self._inbox) + waiting + running + 1 - self.config.parallel
            if behind > self.config.max_queue:
                raise QueueFull(max(0, behind - 1), self._retry_after(behind))
            self._ids.add(request.id)
            self._inbox.append(handle)
            self._cond.notify_all()
        return handle

    def _validate(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n >= self.n_ctx:
            raise PromptTooLong(n, self.n_ctx)
        n_vocab = self._runner.n_vocab
        bad = next((t for t in request.prompt_ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})", param="prompt")
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {request.logprobs}",
                                 param="logprobs")

    def _retry_after(self, behind: int) -> int:
        per = self._avg_request_s if self._avg_request_s is not None else 5.0
        return int(min(600, max(1, math.ceil(per * behind / self.config.parallel))))

    def _cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            if not handle.cancelled:
                handle.cancelled = True
                self._cancels.append(handle)
                self._cond.notify_all()

    def slots(self) -> list[dict]:
        """Per slot: slot, state (idle|reading|decoding), request_id, seq_len, reused, restored, read (of the
        current admission), decode_tok_s. A snapshot taken by the engine thread after each step."""
        return [dict(s) for s in self._slots]

    # the engine thread
    def _run(self) -> None:
        try:
            self._load()
        except BaseException as e:           # noqa: BLE001 - reported through load_error
            log.exception("loading the model failed")
            self.load_error = e
            self.stopped.set()
            return
        self.ready.set()
        try:
            while self._intake():
                if self._sched.has_work:
                    self._step()
                self._activity.tick()
        except BaseException as e:           # noqa: BLE001 - a bug in the loop itself or a device fault
            log.exception("the engine thread failed")
            self.fatal_error = e
        finally:
            with self._cond:
                self._stopping = True
                handles = list(self._inbox) + [a.handle for a in self._active.values()]
                self._inbox.clear()
            for h in handles:
                h._put(ErrorEvent("the engine stopped"))
            self.stopped.set()

    def _load(self) -> None:
        cfg, t0 = self.config, time.perf_counter()
        loaded = load_model(cfg.model, cfg.backend, cfg.threads, cfg.vram_reserve_mib)
        # every request the engine may hold (running + queued, see submit) can own a penalty count row
        self._runner = runner = ModelRunner(loaded, cfg.device_kv_tokens, cfg.page_size, cfg.host_kv_bytes(),
                                            n_ctx=cfg.n_ctx, max_step_tokens=cfg.step_tokens + cfg.parallel,
                                            max_seqs=cfg.parallel, count_rows=cfg.parallel + cfg.max_queue)
        self._sched = Scheduler(runner.kv, runner.host, runner.copier, n_slots=cfg.parallel,
                                step_tokens=cfg.step_tokens, eog_ids=loaded.tokenizer.eog_ids,
                                max_seq_len=cfg.n_ctx, clock=self.clock, decode_share=cfg.decode_share or None,
                                max_step_ratio=MAX_STEP_RATIO)
        self.tokenizer, self.chat_template = loaded.tokenizer, loaded.chat_template
        self.model_id = Path(loaded.path).stem
        log.info("loaded %s (%s) on %s in %.1f s; KV: %d tokens on the device (%.0f MiB), host pool %.2f GiB; "
                 "%d slots, n_ctx %d", loaded.path, loaded.config.arch, loaded.backend.describe(),
                 time.perf_counter() - t0, runner.kv.n_pages * runner.kv.page_size, runner.kv.nbytes / 2**20,
                 runner.host.nbytes / 2**30, cfg.parallel, cfg.n_ctx)

    def _intake(self) -> bool:
        """New requests into the scheduler and cancellations applied; waits while idle. False: stop."""
        with self._cond:
            if not self._inbox and not self._cancels and not self._sched.has_work and not self._stopping:
                self._cond.wait(1.0)
            if self._stopping:
                return False
            cancels, self._cancels = self._cancels, []
            while self._inbox:
                h = self._inbox.popleft()
                if h.cancelled:
                    self._ids.discard(h.id)
                    h._put(DoneEvent("cancelled", len(h.request.prompt_ids), 0, 0, ""))
                    continue
                try:
                    seq = self._sched.add(h.request)
                except InvalidRequest as e:
                    self._ids.discard(h.id)
                    h._put(ErrorEvent(str(e)))
                    continue
                row = self._runner.take_count_row() if needs_counts(h.request.params) else -1
                self._active[h.id] = RequestState(h, seq, self.tokenizer, row)
            for h in cancels:
                act = self._active.get(h.id)
                if act is not None:
                    self._sched.cancel(h.id)
                    self._finish(act, "cancelled")
            self._publish()
        return True

    def _step(self) -> None:
        t0, restore0 = time.perf_counter(), self._runner.copier.restore_s
        try:
            plan = self._sched.plan_step()
        except Exception as e:               # noqa: BLE001
            log.exception("planning a step failed")
            for seq in list(self._sched.running):
                self._fail(self._active[seq.id], f"the engine failed to schedule this request: {e}")
            return
        records = self._sched.pop_records()
        for rec in records:
            self.metrics.admitted(rec)
            self._activity.admitted(rec, self._runner.copier.restore_s - restore0)
        if records:                          # /slots and the gauges show admitted requests while they read
            with self._cond:
                self._publish()
        if plan is None:
            self._unplaceable()
            return
        try:
            logits = self._runner.forward(plan.batch)
        except Exception as e:               # noqa: BLE001
            self._raise_if_device_fault(e)
            log.exception("the forward pass failed")
            self._abort_plan(plan, f"the forward pass failed: {e}")
            return
        try:
            tokens, failed = self._sample_step(plan, logits)
        except Exception as e:               # noqa: BLE001
            self._raise_if_device_fault(e)
            log.exception("sampling failed")
            self._abort_plan(plan, f"sampling failed: {e}")
            return
        slot_of = {seq.id: seq.slot for seq in plan.logit_seqs}   # complete_step frees the slots of finished ones
        for ev in self._sched.complete_step(plan, tokens):
            act = self._active[ev.seq.id]
            try:
                if ev.seq.id in failed:
                    raise RuntimeError(failed[ev.seq.id])
                self._on_token(act, ev.token, ev.finish_reason, slot_of.get(ev.seq.id, ev.seq.slot))
            except Exception as e:           # noqa: BLE001
                if ev.seq.id not in failed:
                    log.exception("%s: handling its token failed", ev.seq.id)
                self._fail(act, str(e))
        self._activity.after_step(self._sched.running)
        took = time.perf_counter() - t0
        td = self._sched.t_decode
        if plan.n_decode and td and took > 1.5 * MAX_STEP_RATIO * td:
            log.info("slow step: %.0f ms (%d decodes + %d prompt tokens; decode step %.0f ms, %.1f ms/prompt token)",
                     took * 1e3, plan.n_decode, plan.n_read, td * 1e3, (self._sched.t_read_token or 0) * 1e3)
        self._sched.observe_step(plan, took - (self._runner.copier.restore_s - restore0))
        self.metrics.step.observe(took)
        with self._cond:
            self._publish()

    def _sample_step(self, plan, logits) -> tuple[list[int], dict[str, str]]:
        """One backend sampling call for every logit row, then each request takes its token (and logprobs);
        a request failing there gets token 0 (appended but never computed: the KV stays clean) and an
        error message in the returned dict. The taken tokens are counted for the penalties."""
        acts = [self._active[seq.id] for seq in plan.logit_seqs]
        if not acts:
            return [], {}
        sampled = self._runner.sample(logits, SampleRows.from_rows([a.sample_row() for a in acts]))
        tokens, failed = [], {}
        for i, act in enumerate(acts):
            try:
                tokens.append(self._sample(act, sampled, i))
            except Exception as e:           # noqa: BLE001
                log.exception("%s: sampling failed", act.handle.id)
                failed[act.handle.id] = f"sampling failed: {e}"
                tokens.append(0)
        self._runner.add_counts([-1 if a.handle.id in failed else a.count_row for a in acts], tokens)
        return tokens, failed

    def _sample(self, act: RequestState, sampled, i: int) -> int:
        return act.took(sampled, i)

    def _on_token(self, act: RequestState, token: int, reason: str | None, slot: int) -> None:
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
        logprob, top = act.logprobs
        act.handle._put(TokenEvent(token, piece, logprob, top))
        if reason is not None:
            self._finish(act, reason)

    def _finish(self, act: RequestState, reason: str) -> None:
        recs = act.seq.records
        cached = recs[0].reused + recs[0].restored if recs else 0
        act.handle._put(DoneEvent(reason, len(act.request.prompt_ids), act.seq.n_generated, cached, act.text))
        took = self.clock() - act.request.arrival
        self._avg_request_s = took if self._avg_request_s is None else 0.8 * self._avg_request_s + 0.2 * took
        self._drop(act)

    def _fail(self, act: RequestState, message: str) -> None:
        if act.seq.status is not SeqStatus.FINISHED:
            self._sched.finish(act.seq, "error")
        act.handle._put(ErrorEvent(message))
        self._drop(act)

    def _drop(self, act: RequestState) -> None:
        if self._active.pop(act.handle.id, None) is act and act.count_row >= 0:
            self._runner.free_count_row(act.count_row)
        self._activity.forget(act.handle.id)
        with self._cond:
            self._ids.discard(act.handle.id)

    def _raise_if_device_fault(self, e: Exception) -> None:
        """A device fault ends the engine (every request fails, /health reports it, `serve` exits 1)."""
        if self._runner.backend.is_fault(e):
            raise DeviceFault(f"the {self._runner.backend.name} device failed: {e}") from e

    def _abort_plan(self, plan, message: str) -> None:
        """The forward failed: nothing of the plan counts (n_computed unchanged, so no KV written in this
        step is ever read); its sequences end with an error, their earlier KV stays in the trie.
        TODO: a Scheduler.abort_step(plan) instead of clearing its open plan here."""
        self._sched._open = None
        for seq in plan.seqs:
            self._fail(self._active[seq.id], message)

    def _unplaceable(self) -> None:
        """Nothing could be planned: with nobody running, the head of the queue cannot be placed."""
        if not self._sched.running and self._sched.waiting:
            seq = self._sched.waiting[0]
            self._fail(self._active[seq.id], "the request does not fit in the KV cache")
        else:
            time.sleep(0.001)

    def _publish(self) -> None:
        """(Under self._cond.) Counts for submit's queue check, gauges and the slot snapshot."""
        s, r = self._sched, self._runner
        self._counts = (len(s.running), len(s.waiting))
        self.metrics.gauges(len(s.running), len(s.waiting), r.kv_usage, r.host_bytes_used)
        self._slots = slot_snapshot(self.config.parallel, s.running, self._active)


def _model_id(model: str | None) -> str:
    key = DEFAULT_MODEL if model is None else model
    if key in KNOWN_MODELS:
        return Path(KNOWN_MODELS[key].file_name).stem
    return Path(key).stem
