"""Faults on a tiny model: a failure tied to one request ends only that request, a failed step only its
requests, failed bookkeeping none; a failure of the loop itself restarts it (KV accounting checked) or,
failing again before any step, stops the engine with fatal_error; a step that hangs shows in health();
submit racing stop and a stop during the model load never leave a caller waiting."""
import threading
import time

import pytest

from strata_lite import InvalidRequest, SamplingParams
from strata_lite import engine as engine_mod
from strata_lite import engine_loop
from strata_lite.config import EngineConfig
from strata_lite.engine import Engine, EngineNotReady
from strata_lite.engine_events import DoneEvent, ErrorEvent, RequestHandle, TokenEvent
from strata_lite.runner import ModelRunner
from strata_lite.sequence import Request
from tiny_model import write_tiny_model

N_CTX = 256
WAIT_S = 60          # generous bound on waits for what must happen (never a timing assertion)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("faults") / "tiny-faults.gguf", arch="qwen2", n_embd=64,
                                n_ff=128, n_heads=4, n_kv_heads=2))


def _engine(model_path, **kw):
    cfg = dict(model=model_path, backend="cpu", n_ctx=N_CTX, parallel=2, step_tokens=24, page_size=16,
               host_kv_gib=0.01, max_queue=8)
    cfg.update(kw)
    eng = Engine(EngineConfig(**cfg))
    eng.start()
    assert eng.wait_ready(WAIT_S)
    return eng


@pytest.fixture
def engine(model_path):
    eng = _engine(model_path)
    yield eng
    eng.stop(WAIT_S)


_ids = iter(range(10 ** 9))


def req(n_prompt=6, max_tokens=4, rid=None, **params):
    return Request(rid or f"f{next(_ids)}", tuple(range(3, 3 + n_prompt)), SamplingParams(**params),
                   max_tokens=max_tokens)


def finish(handle):
    events = list(handle.events(timeout=WAIT_S))
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[-1]


def serves(eng):
    """The engine still answers a request completely."""
    done = finish(eng.submit(req(max_tokens=3)))
    assert isinstance(done, DoneEvent) and done.completion_tokens == 3, done


def kv_clean(eng):
    """Nothing running: page and reference accounting as after a clean run."""
    return eng._sched.tiers.audit(reserved=eng._reserved_pages()) == []


class Gate:
    """Wraps runner.forward: while hold() is on, the next forward waits (inside the step) until release()."""

    def __init__(self, runner):
        self.runner, self.real = runner, runner.forward
        self._hold, self.held, self._release = threading.Event(), threading.Event(), threading.Event()
        runner.forward = self.forward

    def forward(self, batch):
        if self._hold.is_set():
            self._hold.clear()
            self.held.set()
            self._release.wait(WAIT_S)
        return self.real(batch)

    def hold(self):
        self._release.clear()
        self.held.clear()
        self._hold.set()

    def release(self):
        self._release.set()

    def close(self):
        self.release()
        self.runner.forward = self.real


def running_and_held(eng, gate, **kw):
    """A request that has produced a token and whose next step is held inside the forward."""
    h = eng.submit(req(max_tokens=40, **kw))
    it = h.events(timeout=WAIT_S)
    assert isinstance(next(it), TokenEvent)
    gate.hold()
    assert gate.held.wait(WAIT_S)
    return h, it


# per-request failures ---------------------------------------------------------------------------

def test_negative_seed_is_invalid_input_not_a_dead_engine(engine):
    with pytest.raises(InvalidRequest) as info:
        engine.submit(req(temperature=0.8, seed=-1))
    assert info.value.param == "seed"
    serves(engine)


def test_request_state_failure_ends_only_that_request(engine, monkeypatch):
    real = engine_loop.RequestState

    def request_state(handle, *a):
        if handle.id == "bad":
            raise ValueError("injected RequestState failure")
        return real(handle, *a)
    monkeypatch.setattr(engine_loop, "RequestState", request_state)
    bad, good = engine.submit(req(rid="bad")), engine.submit(req())
    msg = finish(bad).message          # the client learns it failed, not the internal exception text
    assert "internal error" in msg and "injected" not in msg
    assert isinstance(finish(good), DoneEvent)
    assert engine.restarts == 0 and kv_clean(engine)
    serves(engine)


def test_cancel_failure_ends_only_that_request(engine):
    gate, sched = Gate(engine._runner), engine._sched
    real_cancel = sched.cancel

    def cancel(seq_id):
        raise RuntimeError("injected cancel failure")
    try:
        other = engine.submit(req(max_tokens=6))
        h, _ = running_and_held(engine, gate)
        sched.cancel = cancel
        h.cancel()
        gate.release()
        last = finish(h)
    finally:
        sched.cancel = real_cancel
        gate.close()
    assert isinstance(last, ErrorEvent) and "cancel" in last.message
    assert isinstance(finish(other), DoneEvent)
    assert engine.restarts == 0 and kv_clean(engine)
    serves(engine)


def test_complete_step_failure_ends_the_steps_requests_only(engine):
    sched = engine._sched
    real = sched.complete_step
    calls = []

    def complete_step(plan, tokens):
        calls.append(plan)
        if len(calls) == 1:
            raise RuntimeError("injected complete_step failure")
        return real(plan, tokens)
    sched.complete_step = complete_step
    try:
        last = finish(engine.submit(req()))
    finally:
        sched.complete_step = real
    assert isinstance(last, ErrorEvent) and "internal error" in last.message and "injected" not in last.message
    assert engine.restarts == 0 and kv_clean(engine)
    serves(engine)


def test_failed_bookkeeping_ends_no_request(engine):
    def after_step(running):
        raise RuntimeError("injected bookkeeping failure")
    engine._activity.after_step = after_step
    try:
        serves(engine)
    finally:
        del engine._activity.after_step
    assert engine.restarts == 0


# the loop itself ------------------------------------------------------------------------------

def test_loop_failure_fails_requests_in_flight_and_restarts(engine):
    gate, activity = Gate(engine._runner), engine._activity
    failures = []

    def tick():                               # the loop calls it after every step, outside any request
        if not failures:
            failures.append(1)
            raise RuntimeError("injected loop failure")
    try:
        h, _ = running_and_held(engine, gate)
        activity.tick = tick
        gate.release()
        last = finish(h)
    finally:
        gate.close()
    assert isinstance(last, ErrorEvent) and "internal error" in last.message and "injected" not in last.message
    assert engine.restarts == 1 and engine.fatal_error is None and not engine.stopped.is_set()
    # the engine thread publishes the slots after the restart's cleanup, which may follow the error event
    deadline = time.monotonic() + WAIT_S
    while not all(s["state"] == "idle" for s in engine.slots()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kv_clean(engine) and all(s["state"] == "idle" for s in engine.slots())
    serves(engine)
    assert engine.health()["state"] == "ok"


def test_loop_failing_again_before_a_step_stops_the_engine(engine):
    gate = Gate(engine._runner)

    def tick():
        raise RuntimeError("injected persistent loop failure")
    try:
        h, _ = running_and_held(engine, gate)
        engine._activity.tick = tick
        gate.release()
        assert isinstance(finish(h), ErrorEvent)
    finally:
        gate.close()
    assert engine.stopped.wait(WAIT_S)
    assert "injected persistent loop failure" in str(engine.fatal_error)
    assert engine.restarts == 1 and engine.health()["state"] == "failed"
    with pytest.raises(EngineNotReady):
        engine.submit(req())


def test_a_stuck_step_shows_in_health_until_it_ends(model_path):
    eng = _engine(model_path, stuck_step_s=0.05)
    gate = Gate(eng._runner)
    try:
        assert eng.health()["state"] == "ok"
        h, _ = running_and_held(eng, gate)
        health = eng.health()
        while health["state"] != "stuck":      # the held step passes its bound (0.05 s or 100x the median)
            assert health["state"] == "ok" and health["step_running_s"] is not None
            assert not eng.stopped.is_set()
            time.sleep(0.05)
            health = eng.health()
        assert "engine step has been running" in health["reason"]
        gate.release()
        assert isinstance(finish(h), DoneEvent)
        assert eng.health()["state"] == "ok" and eng.health()["steps"] > 0
    finally:
        gate.close()
        eng.stop(WAIT_S)


# stopping -----------------------------------------------------------------------------------

def test_submit_racing_stop_raises_instead_of_waiting_forever(engine, monkeypatch):
    real = engine._validate

    def validate(request):                    # the engine stops between submit's first check and its lock
        real(request)
        engine.stop(WAIT_S)
        assert engine.stopped.is_set()
    monkeypatch.setattr(engine, "_validate", validate)
    with pytest.raises(EngineNotReady):
        engine.submit(req())


def test_events_end_when_the_engine_thread_is_gone():
    h = RequestHandle(req(), lambda h: None, alive=lambda: False)
    h.POLL_S = 0.01
    h._put(TokenEvent(5, "a", None, None))
    events = list(h.events())                 # the event already there first, then the engine's absence
    assert isinstance(events[0], TokenEvent) and isinstance(events[-1], ErrorEvent)
    assert "engine stopped" in events[-1].message


def test_stop_does_not_wait_for_the_model_load(model_path, monkeypatch):
    loading, go_on = threading.Event(), threading.Event()
    real = engine_mod.load_model

    def slow_load(*a, **kw):
        loading.set()
        go_on.wait(10 * WAIT_S)
        return real(*a, **kw)
    monkeypatch.setattr(engine_mod, "load_model", slow_load)
    eng = Engine(EngineConfig(model=model_path, backend="cpu", n_ctx=N_CTX, page_size=16, host_kv_gib=0.01))
    eng.start()
    assert loading.wait(WAIT_S)
    stopper = threading.Thread(target=eng.stop)        # no timeout: it must not wait for the load
    stopper.start()
    stopper.join(WAIT_S)
    stopped_while_loading = not stopper.is_alive() and not go_on.is_set()
    go_on.set()
    assert stopped_while_loading
    assert eng.stopped.wait(WAIT_S) and not eng.ready.is_set() and eng.load_error is None


# ready means ready --------------------------------------------------------------------------

def test_warm_up_runs_before_ready(model_path, monkeypatch):
    seen = []
    real = ModelRunner.warm_up

    def warm_up(self, n_prompt):
        seen.append((eng.ready.is_set(), n_prompt))
        return real(self, n_prompt)
    monkeypatch.setattr(ModelRunner, "warm_up", warm_up)
    eng = Engine(EngineConfig(model=model_path, backend="cpu", n_ctx=N_CTX, step_tokens=24, page_size=16,
                              host_kv_gib=0.01))
    eng.start()
    try:
        assert eng.wait_ready(WAIT_S)
        assert seen == [(False, 24)]
        serves(eng)
    finally:
        eng.stop(WAIT_S)


def test_warm_up_takes_every_path_and_gives_back_what_it_used(engine):
    runner = engine._runner
    batches, rows = [], []
    real_forward, real_sample = runner.forward, runner.sample
    runner.forward = lambda b: batches.append(b) or real_forward(b)
    runner.sample = lambda logits, r: rows.append(r) or real_sample(logits, r)
    free_pages, free_rows = runner.kv.n_free, list(runner._free_count_rows)
    try:
        runner.warm_up(24)
    finally:
        del runner.forward, runner.sample
    assert [list(b.positions) for b in batches] == [list(range(24)), [24, N_CTX - 1]]   # chunk; near + far decode
    assert rows[0].n_logprobs[0] > 0                                    # greedy with logprobs
    assert rows[1].temperature[0] > 0 and rows[1].top_k[0] > 0 and rows[1].count_rows[0] >= 0
    assert rows[1].presence[0] != 0 and rows[1].top_p[0] < 1 and rows[1].min_p[0] > 0
    assert runner.kv.n_free == free_pages and sorted(runner._free_count_rows) == sorted(free_rows)
    serves(engine)
