"""Engine: one thread that owns the model, the KV tiers and the scheduler, and serves many requests.

Other threads only `submit()` (validated, queued FIFO), read events from their RequestHandle, and
`cancel()`. The engine thread loops: take new requests and cancellations, then one step:

    plan = sched.plan_step(); logits = runner.forward(plan.batch) (on the device);
    sampled = runner.sample(logits, one row per logit row); sched.complete_step(plan, tokens)

Every step decodes one token of every running sequence plus at most step_tokens prompt tokens.

Faults (docs/server.md, "Health and faults"): a failure inside a step ends only the requests of that
step, and a failure tied to one request (taking it in, its token, its cancel) ends only that request
(ErrorEvent); the engine keeps serving. The loop itself is supervised: an unexpected exception in it
fails the requests in flight and restarts the loop after checking the KV page and trie accounting
(dropping the prefix cache when it is wrong); a second failure before any step completes, or a device
fault, stops the engine with `fatal_error` set (/health 500, `serve` exits 1). `health()` reports the
step liveness (last step, stuck-step watchdog) to /health.
"""
from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from collections import deque
from pathlib import Path

from . import __version__
from .config import EngineConfig
from .engine_events import (DoneEvent, EngineNotReady, ErrorEvent, PromptTooLong, QueueFull, RequestHandle,
                            TokenEvent)
from .engine_loop import MAX_STEP_RATIO, StepLoop
from .kernels import DeviceFault
from .liveness import Liveness
from .loader.known_models import DEFAULT_MODEL, KNOWN_MODELS
from .metrics import ActivityLog, EngineMetrics, idle_slot
from .perplexity import log_softmax
from .runner import ModelRunner, RequestState, load_model
from .scheduler import Scheduler
from .spec import SpecController
from .spec.mtp_drafter import block_for_spec, mtp_source, use_shipped
from .sampling import InvalidRequest
from .sequence import Request

__all__ = ["Engine", "EngineConfig", "RequestHandle", "PromptTooLong", "QueueFull", "EngineNotReady", "InvalidRequest",
           "TokenEvent", "DoneEvent", "ErrorEvent", "log_softmax"]
log = logging.getLogger("strata_lite")
MAX_LOGPROBS = 20


class Engine(StepLoop):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.n_ctx = config.n_ctx
        self.model_id = _model_id(config.model)
        self.arch: str | None = None
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
        self._published = (None, 0.0)               # (who ran and waited, when): _publish
        self._out: list[tuple] = []                  # the last step's tokens, not yet handed out (_hand_out)
        self._avg_request_s: float | None = None
        self._runner = self._sched = None
        self._spec = SpecController(config.spec)
        self._active: dict[str, RequestState] = {}
        self._activity = ActivityLog(log, self.clock)
        self._liveness = Liveness(self.clock, config.stuck_step_s)
        self.restarts = 0                            # loop restarts after a failure (see _supervise)
        self._steps_at_restart = -1                  # steps completed when the loop last restarted

    # lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine was already started")
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop serving: the engine thread ends after its current step (requests left get ErrorEvent);
        waits up to `timeout` s for it (None: until it ends). A model load or warm-up in progress is not
        waited for: the thread (a daemon) ends by itself once it is done, without serving."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is None:
            self.stopped.set()
        elif self._thread is not threading.current_thread() and self.ready.is_set():
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
        if not self.ready.is_set():
            raise EngineNotReady("the engine is stopped" if self._stopping or self.stopped.is_set()
                                 else "the model is still loading")
        self._validate(request)
        handle = RequestHandle(request, self._cancel, alive=lambda: not self.stopped.is_set())
        with self._cond:                     # under the lock: the engine thread drains the inbox under it
            if self._stopping or self.stopped.is_set():
                raise EngineNotReady("the engine is stopped")
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
        seed = request.params.seed           # numpy's default_rng takes non-negative integers only
        if seed is not None and not (isinstance(seed, numbers.Integral) and seed >= 0):
            raise InvalidRequest(f"seed must be a non-negative integer, got {seed!r}", param="seed")

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
        current admission), decode_tok_s, drafted and draft_accepted (speculative decoding). A snapshot
        taken by the engine thread after each step."""
        return [dict(s) for s in self._slots]

    def server_info(self) -> dict:
        """For /server_info and /model_info (routers such as sglang-router read them when a worker
        registers) and /get_load (any thread): what this replica serves and how busy it is."""
        running, waiting = self._counts
        cfg = self.config
        return {"model_path": self.model_id, "served_model_name": self.model_id, "model_type": self.arch,
                "is_generation": True, "context_length": self.n_ctx, "max_running_requests": cfg.parallel,
                "max_queued_requests": cfg.max_queue, "backend": cfg.backend, "spec": str(cfg.spec),
                "running": running, "waiting": waiting,
                "tokens": sum(s["seq_len"] for s in self._slots), "version": __version__, "pid": os.getpid()}

    def health(self) -> dict:
        """For /health (any thread): state "loading" | "ok" | "stuck" | "stopped" | "failed", a reason
        when not ok, restarts of the loop, and the step liveness (Liveness.snapshot)."""
        stuck = self._liveness.stuck()
        if self.load_error is not None or self.fatal_error is not None:
            state, reason = "failed", str(self.load_error or self.fatal_error)
        elif self.stopped.is_set() or (self._stopping and self.ready.is_set()):
            state, reason = "stopped", "the engine is stopped"
        elif not self.ready.is_set():
            state, reason = "loading", "the model is loading"
        elif stuck is not None:
            state, reason = "stuck", stuck
        else:
            state, reason = "ok", None
        return {"state": state, "reason": reason, "restarts": self.restarts, **self._liveness.snapshot()}

    # the engine thread
    def _run(self) -> None:
        try:
            self._load()
        except BaseException as e:           # noqa: BLE001 - reported through load_error
            log.exception("loading the model failed")
            self.load_error = e
            self.stopped.set()
            return
        if self._stopping:                   # stop() came during the load: never serve
            self.stopped.set()
            return
        self.ready.set()
        try:
            self._supervise()
        except BaseException as e:           # noqa: BLE001 - a device fault, or the loop failing twice
            log.exception("the engine thread stopped")
            self.fatal_error = e
        finally:
            with self._cond:
                self._stopping = True
                handles = list(self._inbox) + [a.handle for a in self._active.values()]
                self._inbox.clear()
            for h in handles:
                h._put(ErrorEvent("the engine stopped"))
            self.stopped.set()

    def _supervise(self) -> None:
        """Run the loop until stop(). An unexpected exception in it (not one of a request or a step,
        which end only their requests) fails the requests in flight and restarts it (_restart); a
        device fault, or a failure before any step completed since the last restart, is raised."""
        while True:
            try:
                self._loop()
                return
            except DeviceFault:
                raise
            except Exception as e:           # noqa: BLE001
                self._liveness.abandon()
                if self._liveness.steps == self._steps_at_restart:
                    raise RuntimeError(f"the engine loop failed again before completing a step after a "
                                       f"restart: {type(e).__name__}: {e}") from e
                log.exception("the engine loop failed; failing the requests in flight and restarting it")
                self._restart(e)

    def _loop(self) -> None:
        while self._intake():
            if self._sched.has_work:
                self._liveness.begin()
                self._step()
                self._liveness.end()
            self._activity.tick()
        self._hand_out()

    def _restart(self, error: Exception) -> None:
        """Fail every request in flight, take every sequence out of the scheduler, then check the page
        and trie accounting (TieredKV.audit); when it is wrong, forget the prefix cache (TieredKV.clear)
        so that no page is ever owned twice. Requests still in the inbox are served after the restart."""
        self.restarts += 1
        self._steps_at_restart = self._liveness.steps
        message = "the engine failed while serving this request (an internal error; the server log has the details)"
        self._out = []
        for act in list(self._active.values()):
            act.handle._put(ErrorEvent(message))
            self._drop(act)
        sched, reserved = self._sched, self._reserved_pages()
        sched._open = None
        try:
            for seq in list(sched.running) + list(sched.waiting):
                sched.finish(seq, "error")
            problems = sched.tiers.audit(reserved=reserved)
        except Exception as e:               # noqa: BLE001 - the state was too broken to release
            problems = [f"{type(e).__name__}: {e}"]
        sched.running.clear()
        sched.waiting.clear()
        sched.by_id.clear()
        if problems:
            log.error("the KV accounting is wrong after the failure (%s): the prefix cache is dropped",
                      "; ".join(problems))
            sched.tiers.clear(reserved)
        log.warning("the engine loop restarted (restart %d); KV accounting %s", self.restarts,
                    "rebuilt" if problems else "checked")
        with self._cond:
            self._publish()

    def _load(self) -> None:
        cfg, t0 = self.config, time.perf_counter()
        loaded = load_model(cfg.model, cfg.backend, cfg.threads, cfg.vram_reserve_mib, cfg.prompt_attention)
        mtp = self._mtp_weights(loaded)
        # every request the engine may hold (running + queued, see submit) can own a penalty count row;
        # a decoding slot computes its token and up to max_draft drafted ones, each a logit row
        rows = cfg.parallel * (1 + self._spec.max_draft)
        self._runner = runner = ModelRunner(loaded, cfg.device_kv_tokens, cfg.page_size, cfg.host_kv_bytes(),
                                            n_ctx=cfg.n_ctx, max_step_tokens=cfg.step_tokens + rows,
                                            max_seqs=rows, count_rows=cfg.parallel + cfg.max_queue,
                                            disk_dir=cfg.kv_disk, disk_bytes=int(cfg.kv_disk_gib * 2**30),
                                            mtp_weights=mtp)
        self._sched = Scheduler(runner.kv, runner.host, runner.copier, n_slots=cfg.parallel,
                                step_tokens=cfg.step_tokens, eog_ids=loaded.tokenizer.eog_ids,
                                max_seq_len=cfg.n_ctx, clock=self.clock, decode_share=cfg.decode_share or None,
                                max_step_ratio=MAX_STEP_RATIO, drafter=self._spec if self._spec.enabled else None,
                                disk=runner.disk, kv_filler=None if runner.mtp is None else runner.mtp.fill)
        if runner.mtp is not None:
            runner.mtp.grow = self._sched.tiers.grow_free
            self._spec.use_mtp(runner.mtp)
        self.tokenizer, self.chat_template = loaded.tokenizer, loaded.chat_template
        self.model_id = Path(loaded.path).stem
        self.arch = loaded.config.arch
        log.info("loaded %s (%s) on %s in %.1f s; KV: %d tokens on the device (%.0f MiB), host pool %.2f GiB; "
                 "%d slots, n_ctx %d", loaded.path, loaded.config.arch, loaded.backend.describe(),
                 time.perf_counter() - t0, runner.kv.n_pages * runner.kv.page_size, runner.kv.nbytes / 2**20,
                 runner.host.nbytes / 2**30, cfg.parallel, cfg.n_ctx)
        if self._stopping:
            return
        t0 = time.perf_counter()
        log.info("warming up: compiling the kernels (or loading them from the cache) with a %d-token prompt "
                 "chunk, decode steps and sampling", runner.warm_up_tokens(cfg.step_tokens))
        runner.warm_up(cfg.step_tokens)
        log.info("warm-up done in %.1f s", time.perf_counter() - t0)

    def _mtp_weights(self, loaded):
        """The MTP block to draft with (--spec auto or mtp; --mtp FILE, the model file's own, or the one this package
        ships for it: mtp_source), or None.
        NoMtpBlock for --spec mtp without one."""
        cfg = self.config
        if not self._spec.wants_mtp:
            if cfg.mtp is not None:
                log.warning("--mtp %s is not used: --spec %s does not draft with an MTP block", cfg.mtp, cfg.spec)
            return None
        shipped = use_shipped(self._spec.mode, loaded.backend)
        weights = block_for_spec(loaded.path, loaded.config, self._spec.mode, cfg.mtp, shipped)
        if weights is not None:
            log.info("drafting with the MTP block of %s (--spec %s)",
                     mtp_source(loaded.path, loaded.config, cfg.mtp, shipped), cfg.spec)
        return weights


def _model_id(model: str | None) -> str:
    key = DEFAULT_MODEL if model is None else model
    if key in KNOWN_MODELS:
        return Path(KNOWN_MODELS[key].file_name).stem
    return Path(key).stem
