"""The real `openai` client against a live waitress server (127.0.0.1, a free port) serving the default model
(Qwen2.5-Coder-0.5B-Instruct Q4_K_M) with the real Engine on the CPU. Always runs (no env var, no skip):
generations are short and greedy so the module takes a few minutes on 2 cores.

One engine and one server for the module; a second server (API key "k") on the same engine for the 401s.
The engine's submit() is wrapped to record each request's last event (DoneEvent / ErrorEvent), so the
tests can see how a request ended (e.g. "cancelled" after a client disconnect).

About tool calls: in this GGUF the special tokens <tool_call> / </tool_call> (151657 / 151658) have the
same untrained embedding as the other unused specials, so the model never samples them (rank ~119k at
temperature 0) and, with Qwen's own tool prompt, answers with bare JSON. TOOL_SYSTEM makes it spell
`<tool_call>` with ordinary tokens ('<', 'tool', '_call', '>{"'), write the call's JSON and end with
<|im_end|>, leaving the block unclosed, which the server accepts (a block cut off at the end that parses
is a call). After the tool's result the model only echoes JSON (it cannot read its own untrained
<tool_call> tokens in the history), so the follow-up is checked as a plain answer, not for its wording.
"""
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.engine_events import DoneEvent, ErrorEvent
from strata_lite.server import chat as server_chat
from live_server import serving

API_KEY = "k"
N_CTX = 2048
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}]
# Written with spaces inside the brackets: "<tool_call>" in a prompt would be parsed as the untrained
# special token (see the module docstring). Greedy margins of the answer: >= 1.5 nats at every token.
TOOL_SYSTEM = ('You are a weather bot. Reply with a single XML element (without the spaces inside the brackets): '
               '< tool_call >{"name": ..., "arguments": {...}}')
WEATHER_Q = {"role": "user", "content": "What is the weather in Paris?"}


# ---------------------------------------------------------------------------------------------- fixtures

class _Recorder:
    """Wraps engine.submit (on the instance) to keep every request's id, in order, and its last event."""

    def __init__(self, engine):
        self.ids: list[str] = []
        self.last: dict[str, object] = {}
        self._lock = threading.Lock()
        submit = engine.submit

        def recording_submit(request):
            handle = submit(request)
            put = handle._put

            def rec(ev):
                if isinstance(ev, (DoneEvent, ErrorEvent)):
                    with self._lock:
                        self.last[handle.id] = ev
                put(ev)
            handle._put = rec
            with self._lock:
                self.ids.append(handle.id)
            return handle
        engine.submit = recording_submit


@pytest.fixture(scope="module")
def engine(default_model_path, test_backend):
    eng = Engine(EngineConfig(model=default_model_path, backend=test_backend, n_ctx=N_CTX, parallel=2,
                                   kv_tokens=N_CTX, host_kv_gib=0.5))
    eng.recorder = _Recorder(eng)
    eng.start()
    try:
        assert eng.wait_ready(timeout=900), "the model did not load in 15 minutes"
        yield eng
    finally:
        eng.stop(timeout=60)


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine) as http:
        yield http


@pytest.fixture(scope="module")
def keyed_server(engine):
    with serving(engine, api_key=API_KEY) as http:
        yield http


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


# ----------------------------------------------------------------------------------------------- helpers

def _get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _post_raw(server, path: str, body: bytes, headers=None):
    req = urllib.request.Request(server.url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metrics(server) -> dict[str, float]:
    status, _, body = _get(server.url + "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _slots(server) -> list[dict]:
    status, _, body = _get(server.url + "/slots")
    assert status == 200
    return json.loads(body)


def _prompt_len(engine, messages, tools=None) -> int:
    msgs = server_chat.normalize_messages(messages)
    return len(server_chat.prompt_ids(engine, server_chat.render_prompt(engine, msgs, tools)))


def _check_usage(u, max_tokens: int, finish_reason: str, prompt_tokens: int | None = None):
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= max_tokens
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens      # the last one is always read
    if finish_reason == "length":
        assert u.completion_tokens == max_tokens
    if prompt_tokens is not None:
        assert u.prompt_tokens == prompt_tokens


def _wait_idle(server, timeout=30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        slots = _slots(server)
        if all(s["state"] == "idle" and s["request_id"] is None for s in slots) or time.monotonic() > deadline:
            return slots
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------- 7. endpoints

def test_models_health_metrics_slots(server, client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model_id] == ["qwen2.5-coder-0.5b-instruct-q4_k_m"]
    m = client.models.retrieve(engine.model_id)
    assert m.object == "model" and m.owned_by and m.context_length == N_CTX and m.meta == {"n_ctx": N_CTX}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"

    for path in ("/health", "/v1/health"):
        status, _, body = _get(server.url + path)
        health = json.loads(body)
        assert (status, health["status"]) == (200, "ok") and health["engine"]["restarts"] == 0
        assert health["engine"]["stuck_after_s"] >= 60.0

    status, headers, body = _get(server.url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    for name in ("strata_requests_running", "strata_requests_waiting", "strata_kv_usage_ratio",
                 "strata_prompt_tokens_total", "strata_needless_read_tokens_total", "strata_generated_tokens_total",
                 "strata_time_to_first_token_seconds", "strata_step_seconds"):
        assert re.search(rf"^{name}(_bucket|_count|_sum)?[{{ ]", text, re.M), name

    slots = _slots(server)
    assert [s["slot"] for s in slots] == [0, 1]
    for s in slots:
        assert set(s) >= {"slot", "state", "request_id", "seq_len", "reused", "restored", "read", "decode_tok_s"}
        assert s["state"] in ("idle", "reading", "decoding")

    status, _, body = _get(server.url + "/v1/no-such-path")
    assert status == 404 and json.loads(body)["error"]["code"] == "unknown_url"


# --------------------------------------------------------------------------------------- 1, 2. chat

CHAT_MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]


def test_chat(client, engine):
    r = client.chat.completions.create(model="whatever", messages=CHAT_MSGS, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == engine.model_id and r.id.startswith("chatcmpl-")
    [c] = r.choices
    assert c.index == 0 and c.message.role == "assistant" and not c.message.tool_calls
    assert isinstance(c.message.content, str) and c.message.content.strip()
    assert c.finish_reason in ("stop", "length")
    _check_usage(r.usage, 12, c.finish_reason, _prompt_len(engine, CHAT_MSGS))
    # the same request again: the whole prompt but its last token comes from the cache, same answer
    again = client.chat.completions.create(model="m", messages=CHAT_MSGS, max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == c.message.content


def test_chat_stream_matches_non_stream(client, engine):
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    kw = dict(model="m", messages=msgs, max_tokens=16, temperature=0)
    # warm-up: afterwards both requests below read all but the prompt's last token from the cache, so
    # they compute the same logits (a full prefill and a cached prefix differ by float rounding, which
    # can flip a greedy near tie)
    client.chat.completions.create(**kw)
    r = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    body, last = chunks[:-1], chunks[-1]
    assert all(len(ch.choices) == 1 and ch.usage is None for ch in body)
    assert body[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in body)
    reasons = [ch.choices[0].finish_reason for ch in body if ch.choices[0].finish_reason]
    assert reasons == [body[-1].choices[0].finish_reason] == [r.choices[0].finish_reason]
    assert text == r.choices[0].message.content and text
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)
    _check_usage(last.usage, 16, reasons[0], _prompt_len(engine, msgs))
    assert last.usage.prompt_tokens_details.cached_tokens == last.usage.prompt_tokens - 1


# ---------------------------------------------------------------------------------------- 3. tool calls

def test_tool_calls(client, engine):
    msgs = [{"role": "system", "content": TOOL_SYSTEM}, WEATHER_Q]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=32, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    [call] = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert c.message.content is None
    _check_usage(r.usage, 32, "stop", _prompt_len(engine, msgs, TOOLS))

    # streamed: the call comes as one tool_calls delta, then finish_reason "tool_calls"
    calls, reasons, content = {}, [], ""
    for ch in client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=32, temperature=0,
                                             stream=True):
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        if ch.choices[0].finish_reason:
            reasons.append(ch.choices[0].finish_reason)
    assert reasons == ["tool_calls"] and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}

    # the tool's result goes back (the assistant turn with arguments as a JSON string): a normal answer
    msgs += [c.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "sunny"}'}]
    r2 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=24, temperature=0)
    c2 = r2.choices[0]
    assert c2.finish_reason in ("stop", "length") and not c2.message.tool_calls
    assert c2.message.content and c2.message.content.strip()
    _check_usage(r2.usage, 24, c2.finish_reason, _prompt_len(engine, msgs, TOOLS))
    # the first turn's prompt was cached; with an MTP block (the default model's shipped one drafts under
    # --spec auto on the CPU) a placement keeps one token less: its block row needs the main model's hidden
    # state at the last cached position, which is not cached (spec/mtp_drafter.py, TieredKV reread_last)
    reread = 1 if engine._runner.mtp is not None else 0
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - reread


# --------------------------------------------------------------------------------------------- 4. errors

def test_malformed_json(server):
    for body in (b'{"model": "m", "messages": [', b"not json at all", b"\xff\xfe{}"):
        status, err = _post_raw(server, "/v1/chat/completions", body)
        assert status == 400, (body, err)
        e = err["error"]
        assert e["type"] == "invalid_request_error" and "JSON" in e["message"] and set(e) >= {"param", "code"}
    status, err = _post_raw(server, "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in err["error"]["message"]
    status, err = _post_raw(server, "/v1/chat/completions", b"")
    assert status == 400


@pytest.mark.parametrize("extra, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"top_p": [1]}, "top_p"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 5}, "stop"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"content": "x"}]}, "messages[1].role"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"top_p": 0}, "top_p"),
])
def test_bad_field_is_400_naming_it(client, extra, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    assert e.value.type == "invalid_request_error" and param.split("[")[0].split(".")[0] in e.value.message


def test_prompt_beyond_context(client, server, engine):
    msgs = [{"role": "user", "content": "hello " * (N_CTX + 50)}]
    n = _prompt_len(engine, msgs)
    assert n > N_CTX
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (n, N_CTX)
    # exactly n_ctx tokens is too long too (a generated token must fit); the raw error object
    status, body = _post_raw(server, "/v1/completions", json.dumps({"prompt": list(range(1000, 1000 + N_CTX)),
                                                                    "max_tokens": 1}).encode())
    assert status == 400
    assert (body["error"]["n_prompt_tokens"], body["error"]["n_ctx"]) == (N_CTX, N_CTX)
    assert body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "prompt"


def test_api_key(keyed_server, engine):
    url = keyed_server.url + "/v1"
    for key in (None, "wrong", API_KEY + "x"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        status, headers_out, body = _get(url + "/models", headers)
        assert status == 401, key
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_api_key" and headers_out["WWW-Authenticate"] == "Bearer"
    bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for path in ("/metrics", "/slots"):
        assert _get(keyed_server.url + path)[0] == 401
    assert _get(keyed_server.url + "/health")[0] == 200                 # open
    good = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=300)
    assert [m.id for m in good.models.list().data] == [engine.model_id]
    r = good.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                     temperature=0)
    assert r.usage.completion_tokens >= 1


# ------------------------------------------------------------------------------------ 5. client disconnect

def test_client_disconnect_cancels(server, client, engine):
    rec = engine.recorder
    n_before = len(rec.ids)
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 200, "temperature": 0,
                       "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(head + body)
        got = b""
        # the first SSE events: the role chunk (sent at once), then the first generated token's chunk
        while got.partition(b"\r\n\r\n")[2].count(b"}\n\n") < 2:      # (chunked transfer encoding)
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
        [rid] = rec.ids[n_before:]
        assert rid not in rec.last
        busy = [sl for sl in _slots(server) if sl["request_id"] == rid]
        assert len(busy) == 1 and busy[0]["state"] == "decoding", busy
    t_closed = time.monotonic()
    deadline = t_closed + 15
    while rid not in rec.last and time.monotonic() < deadline:
        time.sleep(0.05)
    done = rec.last.get(rid)
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled", done
    assert done.completion_tokens < 200
    slots = _wait_idle(server, timeout=5)
    assert all(sl["state"] == "idle" and sl["request_id"] is None for sl in slots), slots
    assert time.monotonic() - t_closed < 15
    m = _metrics(server)
    assert m["strata_requests_running"] == 0 and m["strata_requests_waiting"] == 0
    # the server goes on serving
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


# --------------------------------------------------------------------- 6. multi-turn, more conversations than slots

def _system_prompt(topic: str, style: str) -> str:
    return (f"You are an assistant that only talks about {topic}. " + f"Answer in a {style} tone. " * 3 +
            f"Keep every answer short: one sentence about {topic}, never more. Do not use lists, headings or code. "
            f"If the user asks about anything else, steer the conversation back to {topic} politely. "
            f"Remember what the user said earlier in the conversation about {topic} and refer to it when useful.")


def test_multi_turn_more_conversations_than_slots(client, server, engine):
    convs = {
        "cats": [{"role": "system", "content": _system_prompt("cats", "cheerful")}],
        "trains": [{"role": "system", "content": _system_prompt("steam trains", "formal")}],
        "bread": [{"role": "system", "content": _system_prompt("baking bread", "friendly")}],
    }
    for msgs in convs.values():
        assert 90 <= _prompt_len(engine, msgs) <= 160
    questions = ["Tell me one fact.", "Why is that?", "Say it again in other words."]
    history: dict[str, list] = {k: [] for k in convs}          # per turn: (prompt_tokens, cached_tokens)
    needless0 = _metrics(server)["strata_needless_read_tokens_total"]
    errors = []

    def turn(name: str, i: int):
        msgs = convs[name]
        msgs.append({"role": "user", "content": f"{questions[i]}"})
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0)
        c = r.choices[0]
        _check_usage(r.usage, 16, c.finish_reason)
        msgs.append({"role": "assistant", "content": c.message.content})
        history[name].append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))

    def in_thread(name, i):
        try:
            turn(name, i)
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append((name, i, e))

    for name in ["cats", "trains", "bread"]:             # turn 1, interleaved
        turn(name, 0)
    for name in ["bread", "trains", "cats"]:             # turn 2, reversed
        turn(name, 1)
    # a prompt that needs nearly all the device KV (kv_tokens = n_ctx): the conversations' KV is parked
    # in the host pool, so turn 3 has to restore it
    restored0 = _metrics(server)['strata_prompt_tokens_total{how="restored"}']
    filler = client.completions.create(model="m", prompt=list(range(1000, 1000 + N_CTX - 150)), max_tokens=1,
                                       temperature=0)
    assert filler.usage.prompt_tokens_details.cached_tokens == 0
    threads = [threading.Thread(target=in_thread, args=(name, 2)) for name in ["trains", "cats", "bread"]]
    for t in threads:                                    # turn 3, concurrently: 3 conversations, 2 slots
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors

    for name, turns in history.items():
        assert len(turns) == 3
        for (prev_prompt, _), (prompt, cached) in zip(turns, turns[1:]):
            assert prompt > prev_prompt
            assert cached >= prev_prompt, (name, turns)      # the whole previous prompt came from the cache
    m = _metrics(server)
    assert m["strata_needless_read_tokens_total"] == needless0 == 0
    assert m['strata_prompt_tokens_total{how="restored"}'] > restored0        # the host tier was used
    assert _wait_idle(server)[0]["state"] == "idle"


def test_no_needless_reads_in_module(server):
    """Last: nothing in the whole module read a token whose KV was cached at admission."""
    m = _metrics(server)
    assert m["strata_needless_read_tokens_total"] == 0
    assert m['strata_prompt_tokens_total{how="reused"}'] > 0
