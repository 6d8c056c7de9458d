"""The real `openai` client against a real waitress server on 127.0.0.1 (a free port, a background thread).

The engine is the `engine` fixture: the fake engine by default; with STRATA_LITE_SERVER_TEST_ENGINE=real
the real strata_lite Engine (default model, CPU unless STRATA_LITE_TEST_BACKEND says otherwise).
Tests that script the engine's output or watch its cancels use the `fake` fixture and are skipped with
the real engine.
"""
import json
import os
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from live_server import serving
from strata_server_fake_engine import FakeEngine, default_responder

API_KEY = "sk-test-key"
REAL = os.environ.get("STRATA_LITE_SERVER_TEST_ENGINE", "fake") == "real"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def engine(test_backend):
    if not REAL:
        yield FakeEngine()
        return
    from strata_lite.config import EngineConfig
    from strata_lite.engine import Engine
    eng = Engine(EngineConfig(backend=test_backend, n_ctx=2048,
                              parallel=2))
    eng.start()
    assert eng.wait_ready(timeout=900)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine, api_key=API_KEY) as http:
        yield http


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


@pytest.fixture
def fake(engine):
    if not isinstance(engine, FakeEngine):
        pytest.skip("scripts the fake engine")
    yield engine
    engine.responder, engine.queue_full, engine.token_delay = default_responder, False, 0.0


def test_health_needs_no_key(server):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200 and json.load(r)["status"] == "ok"


def test_wrong_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_models(client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model_id]
    m = client.models.retrieve(engine.model_id)
    assert m.owned_by and m.context_length == engine.n_ctx
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat(client, engine):
    r = client.chat.completions.create(model=engine.model_id, max_tokens=8, temperature=0,
                                       messages=[{"role": "system", "content": "You are terse."},
                                                 {"role": "user", "content": "Say hello."}])
    assert r.object == "chat.completion" and r.model == engine.model_id
    [c] = r.choices
    assert isinstance(c.message.content, str) and c.message.content
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_with_usage(client, engine):
    stream = client.chat.completions.create(model=engine.model_id, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Count to three."}])
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text and reasons in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    again = client.chat.completions.create(model=engine.model_id, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Count to three."}])
    assert again.choices[0].message.content == text          # greedy: the same text streamed or not
    if isinstance(engine, FakeEngine):                         # (the real cache reuses whole pages only)
        assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completions(client, engine):
    r = client.completions.create(model=engine.model_id, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 6
    pieces = list(client.completions.create(model=engine.model_id, prompt="Once upon a time", max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == r.choices[0].text


def test_n_choices(client, engine):
    r = client.chat.completions.create(model=engine.model_id, max_tokens=4, n=2, temperature=0.8, seed=1,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_logprobs(client, engine):
    r = client.chat.completions.create(model=engine.model_id, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, messages=[{"role": "user", "content": "Hi"}])
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)


def test_bad_requests(client, engine):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=engine.model_id, temperature=-1,
                                       messages=[{"role": "user", "content": "x"}])
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=engine.model_id, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.param == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=engine.model_id, prompt="x", stop=["a", "b", "c", "d", "e"])
    assert e.value.param == "stop"


def test_prompt_too_long(client, engine):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=engine.model_id, prompt="hello " * (engine.n_ctx + 10), max_tokens=1)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == engine.n_ctx
    assert err["n_prompt_tokens"] >= engine.n_ctx


# ------------------------------------------------------------------------------- fake engine only

def test_tool_calls(client, fake):
    fake.responder = lambda prompt, req: ('I will look.\n<tool_call>\n{"name": "get_weather", '
                                          '"arguments": {"city": "Paris"}}\n</tool_call>')
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will look."
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    # the assistant turn goes back with arguments as a JSON string; the template gets a dict
    msgs += [c.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    fake.responder = default_responder
    r2 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert r2.choices[0].finish_reason == "stop"
    assert '"arguments": {"city": "Paris"}}</tool_call>' in fake.prompts[-1]

    fake.responder = lambda prompt, req: ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                          '\n</tool_call>')
    calls = {}
    for ch in client.chat.completions.create(model="m", messages=msgs[:1], tools=TOOLS, stream=True):
        for tc in ch.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(tc.index, ["", ""])
            slot[0] += tc.function.name or ""
            slot[1] += tc.function.arguments or ""
        last = ch.choices[0].finish_reason
    assert last == "tool_calls"
    assert calls == {0: ["get_weather", '{"city": "Oslo"}']}


def test_queue_full_is_503_with_retry_after(client, fake):
    fake.queue_full = True
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "3"


def test_error_then_keeps_serving(client, fake):
    fake.responder = lambda prompt, req: RuntimeError("kernel launch failed")
    with pytest.raises(openai.InternalServerError, match="kernel launch failed"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.APIError, match="kernel launch failed"):
        list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True))
    fake.responder = default_responder
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]).choices


def test_client_disconnect_cancels(server, fake):
    fake.token_delay = 0.005
    fake.responder = lambda prompt, req: "x" * 100_000
    fake.cancel_event.clear()
    n_before = len(fake.submitted)
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 100_000,
                       "messages": [{"role": "user", "content": "go on forever"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + body)
        got = b""
        while b"\r\n\r\n" not in got or b"data: " not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    assert got.startswith(b"HTTP/1.1 200")
    assert fake.cancel_event.wait(10), "the server did not cancel the request of a client that left"
    [req] = fake.submitted[n_before:]
    assert fake.cancelled[-1] == req.id
    deadline = time.monotonic() + 10
    while req.id in fake.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert req.id not in fake.active                         # the generation stopped
    assert client_alive(server)


def client_alive(server) -> bool:
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        return r.status == 200
