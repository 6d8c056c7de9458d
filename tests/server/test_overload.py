"""Overload: 4x the queue limit of concurrent clients against a live server with the real Engine on a tiny
model, streaming and not, with client disconnects. Every request gets a complete answer, a 503 with
Retry-After, or ends by the client's disconnect; afterwards no slot is stuck and the KV pages and trie
references are back at their idle counts (/slots, /metrics and the scheduler's metrics).

Phase 1 fills the engine exactly (parallel + max_queue long greedy streams, each seen accepted), so a burst
of clients arriving then must get 503s; phase 2 is a burst of 4x max_queue clients with seeded random modes.
"""
from __future__ import annotations

import http.client
import json
import random
import threading

import pytest

from live_server import serving
from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from tiny_model import write_tiny_model

PARALLEL, MAX_QUEUE = 2, 4
N_CLIENTS = 4 * MAX_QUEUE
SEED = 1234
TIMEOUT = 300                        # seconds a client waits for any read (generous: a busy 2-core CI box)
HOLD_TOKENS = 300                    # phase 1 streams: greedy, long enough to keep the queue full meanwhile


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("overload") / "tiny.gguf")
    engine = Engine(EngineConfig(model=str(path), backend="cpu", n_ctx=512, parallel=PARALLEL,
                                 max_queue=MAX_QUEUE, page_size=16, step_tokens=32, host_kv_gib=0.002))
    ends = {}                                 # request id -> its last event (None while it runs)
    submit = engine.submit

    def recording_submit(request):           # how every accepted request ended, in submission order
        h = submit(request)
        ends[h.id], put = None, h._put

        def record(ev):
            if not hasattr(ev, "token_id"):
                ends[h.id] = ev
            put(ev)
        h._put = record
        return h
    engine.submit = recording_submit
    engine.start()
    assert engine.wait_ready(300)
    with serving(engine) as http_server:
        yield engine, http_server.port, ends
    engine.stop(60)


def _post(port, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def _body(i: int, stream: bool, max_tokens: int, temperature: float) -> dict:
    shared = ["You are a careful assistant.", "Answer in French.", "Use short sentences."][i % 3]
    return {"messages": [{"role": "system", "content": shared}, {"role": "user", "content": f"question {i}"}],
            "max_tokens": max_tokens, "stream": stream, "temperature": temperature, "seed": SEED + i}


def _hang_up(conn, resp=None) -> None:
    """Close the socket for real: a response read without a length owns the socket (through its file), so
    closing only the connection would leave it open and the server writing into it."""
    if resp is not None:
        resp.close()
    conn.close()


def _events(resp):
    """The SSE `data:` payloads of a stream, as they come."""
    for line in resp:
        line = line.strip()
        if line.startswith(b"data: "):
            yield line[6:].decode()


def _busy(resp) -> str:
    err = json.loads(resp.read())["error"]
    assert err["code"] == "queue_full" and err["type"] and err["message"], err
    assert int(resp.getheader("Retry-After")) >= 1
    return "busy"


def _read_stream(resp, stop_after: int | None) -> str:
    """'complete' when the stream ends with a finish_reason and [DONE]; 'disconnected' after stop_after events."""
    finish, n = None, 0
    for data in _events(resp):
        if data == "[DONE]":
            assert finish in ("stop", "length"), finish
            return "complete"
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        finish = chunk["choices"][0]["finish_reason"] or finish
        n += 1
        if stop_after is not None and n >= stop_after:
            return "disconnected"
    raise AssertionError("the stream ended without [DONE]")


def _client(port, i: int, rng: random.Random) -> str:
    """One client in a seeded random mode; returns its outcome ('complete', 'busy', 'disconnected')."""
    stream, disconnect = rng.random() < 0.5, rng.random() < 0.4
    max_tokens = 200 if disconnect else rng.randint(4, 24)
    conn, resp = _post(port, _body(i, stream, max_tokens, 0.8)), None
    try:
        if disconnect and not stream:
            return "disconnected"             # gone before the answer (the request runs on: not noticed)
        resp = conn.getresponse()
        if resp.status == 503:
            return _busy(resp)
        assert resp.status == 200, (resp.status, resp.read()[:500])
        if stream:
            return _read_stream(resp, rng.randint(1, 4) if disconnect else None)
        choice = json.loads(resp.read())["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), choice
        return "complete"
    finally:
        _hang_up(conn, resp)


def _burst(port, n: int, seed: int) -> list[str]:
    out = [None] * n
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            out[i] = _client(port, i, random.Random(seed + i))
        except Exception as e:              # noqa: BLE001 - reported below with the client's number
            out[i] = f"client {i} failed: {type(e).__name__}: {e}"
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    return out


def _get(port, path: str):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 200, path
        return resp.read().decode()
    finally:
        conn.close()


def _metrics(port) -> dict[str, float]:
    out = {}
    for line in _get(port, "/metrics").splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _wait_idle(port, engine) -> list[dict]:
    """Polls /slots (0.1 s apart, up to TIMEOUT) until every slot is idle and nothing waits."""
    done = threading.Event()
    for _ in range(TIMEOUT * 10):
        slots = json.loads(_get(port, "/slots"))
        m = _metrics(port)
        if all(s["state"] == "idle" for s in slots) and m["strata_requests_running"] == 0 \
                and m["strata_requests_waiting"] == 0 and not engine._active:
            return slots
        done.wait(0.1)
    raise AssertionError(f"not idle: {slots}")


def _assert_idle(port, engine) -> None:
    slots = _wait_idle(port, engine)
    assert all(s["request_id"] is None and s["seq_len"] == 0 for s in slots), slots
    sched, kv = engine._sched, engine._runner.kv
    m = sched.metrics()
    assert m["running"] == m["waiting"] == 0
    assert m["device_pages"] == m["device_evictable_pages"], m          # no device page referenced
    assert m["device_free_pages"] + m["device_pages"] == kv.n_pages, m  # no page private to a sequence
    assert all(node.ref == 0 for node in sched.tiers.trie.nodes())
    assert _metrics(port)["strata_kv_usage_ratio"] == pytest.approx(m["device_pages"] / kv.n_pages)


def _finish_reasons(ends: dict) -> list[str]:
    """How each accepted request ended: every one did, with a DoneEvent (an ErrorEvent fails here)."""
    assert all(hasattr(ev, "finish_reason") for ev in ends.values()), ends
    return [ev.finish_reason for ev in ends.values()]


def test_overload_with_disconnects(live):
    engine, port, ends = live
    # Phase 1: parallel + max_queue greedy streams, each seen accepted (its first chunk came back): the
    # engine is full, so the burst that follows gets 503s.
    holders = []
    for i in range(PARALLEL + MAX_QUEUE):
        conn = _post(port, _body(100 + i, True, HOLD_TOKENS, 0.0))
        resp = conn.getresponse()
        assert resp.status == 200
        assert json.loads(next(_events(resp)))["choices"][0]["delta"]["role"] == "assistant"
        holders.append((conn, resp))
    first = _burst(port, N_CLIENTS, SEED)
    assert first.count("busy") >= 1 and set(first) <= {"busy", "complete", "disconnected"}, first
    for conn, resp in holders[0::2]:          # hang up at once; the others read to the end
        _hang_up(conn, resp)
    assert [_read_stream(resp, None) for _, resp in holders[1::2]] == ["complete"] * 3
    for conn, resp in holders[1::2]:
        _hang_up(conn, resp)
    _assert_idle(port, engine)
    held = _finish_reasons(ends)[:PARALLEL + MAX_QUEUE]
    assert set(held[1::2]) <= {"stop", "length"} and set(held[0::2]) <= {"stop", "length", "cancelled"}, held
    assert held[4] == "cancelled", held        # still queued (four ahead of it, two slots) when it hung up

    # Phase 2: 4x max_queue clients at once, modes from their seeds.
    second = _burst(port, N_CLIENTS, SEED + 1000)
    assert set(second) <= {"busy", "complete", "disconnected"}, second
    assert "complete" in second and "disconnected" in second, second
    _assert_idle(port, engine)
    assert set(_finish_reasons(ends)) <= {"stop", "length", "cancelled"}
    assert engine.metrics_registry.get_sample_value("strata_needless_read_tokens_total") == 0

    # Still serving: a plain request completes.
    conn = _post(port, _body(999, False, 8, 0.0))
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["choices"][0]["finish_reason"] in ("stop", "length")
    _hang_up(conn, resp)
