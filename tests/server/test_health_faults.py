"""/health over HTTP with the real engine on a tiny model: liveness numbers while it serves, 503
engine_stuck while a step hangs, 500 engine_failed once its loop has died (an exception injected into
the loop itself, not a request's path); and waitress refusing a body over the app's cap before reading it."""
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from live_server import serving
from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.engine_events import ErrorEvent, TokenEvent
from strata_lite.sampling import SamplingParams
from strata_lite.sequence import Request
from strata_lite.server.schemas import MAX_BODY_BYTES
from tiny_model import write_tiny_model

WAIT_S = 60


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("health") / "tiny-health.gguf", arch="qwen2", n_embd=64,
                                n_ff=128, n_heads=4, n_kv_heads=2))


@pytest.fixture
def engine(model_path):
    eng = Engine(EngineConfig(model=model_path, backend="cpu", n_ctx=128, parallel=2, page_size=16,
                              host_kv_gib=0.01, stuck_step_s=0.05))
    eng.start()
    assert eng.wait_ready(WAIT_S)
    yield eng
    eng.stop(WAIT_S)


def health(http):
    try:
        with urllib.request.urlopen(http.url + "/health", timeout=WAIT_S) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class HeldForward:
    """The engine's next forward waits inside its step until released."""

    def __init__(self, runner):
        self.runner, self.real = runner, runner.forward
        self.held, self.release = threading.Event(), threading.Event()
        runner.forward = self.forward

    def forward(self, batch):
        self.held.set()
        self.release.wait(WAIT_S)
        return self.real(batch)

    def close(self):
        self.release.set()
        self.runner.forward = self.real


def test_health_reports_liveness_and_a_stuck_step(engine):
    with serving(engine) as http:
        status, body = health(http)
        assert status == 200 and body["status"] == "ok"
        assert set(body["engine"]) >= {"steps", "last_step_age_s", "step_running_s", "median_step_s",
                                       "stuck_after_s", "restarts"}
        held = HeldForward(engine._runner)
        try:
            h = engine.submit(Request("stuck", (3, 4, 5), SamplingParams(), max_tokens=2))
            assert held.held.wait(WAIT_S)
            status, body = health(http)
            while status == 200:              # until the held step passes its bound
                time.sleep(0.05)
                status, body = health(http)
            assert status == 503 and body["error"]["code"] == "engine_stuck", body
            assert "engine step has been running" in body["error"]["message"]
        finally:
            held.close()
        list(h.events(timeout=WAIT_S))
        status, body = health(http)
        assert status == 200 and body["engine"]["steps"] >= 1 and body["engine"]["step_running_s"] is None


def test_health_fails_when_the_loop_dies(engine):
    held = HeldForward(engine._runner)

    def tick():                               # the loop calls it between steps, outside any request
        raise RuntimeError("injected loop failure")
    with serving(engine) as http:
        try:
            h = engine.submit(Request("doomed", (3, 4, 5), SamplingParams(), max_tokens=50))
            assert held.held.wait(WAIT_S)
            engine._activity.tick = tick
        finally:
            held.close()
        events = list(h.events(timeout=WAIT_S))
        assert isinstance(events[-1], ErrorEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
        assert engine.stopped.wait(WAIT_S)
        status, body = health(http)
        assert status == 500 and body["error"]["code"] == "engine_failed"
        assert "injected loop failure" in body["error"]["message"]


def test_waitress_refuses_a_body_over_the_cap_before_reading_it(engine):
    with serving(engine) as http, socket.create_connection(("127.0.0.1", http.port), timeout=WAIT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n{" % (MAX_BODY_BYTES + 1))     # one byte of the body sent
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert http.server.adj.max_request_body_size == MAX_BODY_BYTES
