"""The HTTP API (strata_lite.server.app) through falcon.testing against the fake engine."""
import json

import pytest
from falcon import testing

from strata_lite.server.app import create_app
from strata_lite.server.tool_calls import ToolCallParser, parse_tool_calls
from strata_server_fake_engine import FakeEngine

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine):
    return testing.TestClient(create_app(engine))


def chat_body(**kw):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return body


def sse_events(result):
    """The JSON objects of an SSE body; asserts it ends with [DONE] and nothing follows."""
    assert result.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in result.text.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]"
    out = []
    for b in blocks[:-1]:
        assert b.startswith("data: ")
        out.append(json.loads(b[len("data: "):]))
    return out


def assert_error(result, status, param=None, type_="invalid_request_error"):
    assert result.status_code == status, result.text
    err = result.json["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    assert err["type"] == type_
    assert err["param"] == param
    return err


# ------------------------------------------------------------------------------------------ chat

def test_chat_completion(client, engine):
    r = client.simulate_post(CHAT, json=chat_body(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]))
    assert r.status_code == 200
    body = r.json
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    [choice] = body["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "Hello from the fake engine."},
                      "logprobs": None, "finish_reason": "stop"}
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert engine.prompts == [prompt]
    req = engine.submitted[0]
    assert list(req.prompt_ids) == engine.tokenizer.encode(prompt)
    u = body["usage"]
    assert u["prompt_tokens"] == len(req.prompt_ids) and u["completion_tokens"] == 27
    assert u["total_tokens"] == u["prompt_tokens"] + 27
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}


def test_cached_tokens_reported(client, engine):
    first = client.simulate_post(CHAT, json=chat_body()).json["usage"]
    second = client.simulate_post(CHAT, json=chat_body()).json["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == second["prompt_tokens"]


def test_chat_message_shapes(client, engine):
    msgs = [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "thanks"},
    ]
    r = client.simulate_post(CHAT, json=chat_body(messages=msgs))
    assert r.status_code == 200, r.text
    p = engine.prompts[0]
    assert p.startswith("<|im_start|>system\nsys<|im_end|>\n")
    assert "part one\npart two" in p
    # arguments were parsed to a dict, and the template wrote them with tojson
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in p
    assert "<|im_start|>tool\nsunny<|im_end|>" in p


def test_sampling_params_reach_the_request(client, engine):
    r = client.simulate_post(CHAT, json=chat_body(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=123, presence_penalty=0.5,
        frequency_penalty=-0.5, stop=["a", "b"], max_tokens=17, ignore_eos=True))
    assert r.status_code == 200, r.text
    req = engine.submitted[-1]
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 40, 0.05, 123)
    assert (p.presence_penalty, p.frequency_penalty, p.stop, p.ignore_eos) == (0.5, -0.5, ("a", "b"), True)
    assert req.max_tokens == 17 and req.logprobs is None
    client.simulate_post(CHAT, json=chat_body(max_completion_tokens=5, stop="x"))
    assert engine.submitted[-1].max_tokens == 5 and engine.submitted[-1].params.stop == ("x",)
    assert not engine.submitted[-1].params.ignore_eos
    client.simulate_post(CHAT, json=chat_body())      # default: the rest of the context
    req = engine.submitted[-1]
    assert req.max_tokens == engine.n_ctx - len(req.prompt_ids)


def test_stop_and_length(client, engine):
    r = client.simulate_post(CHAT, json=chat_body(stop=[" fake"]))
    assert r.json["choices"][0]["message"]["content"] == "Hello from the"
    assert r.json["choices"][0]["finish_reason"] == "stop"
    r = client.simulate_post(CHAT, json=chat_body(max_tokens=5))
    assert r.json["choices"][0]["message"]["content"] == "Hello"
    assert r.json["choices"][0]["finish_reason"] == "length"
    assert r.json["usage"]["completion_tokens"] == 5


def test_n_choices_share_the_prompt(client, engine):
    r = client.simulate_post(CHAT, json=chat_body(n=3, seed=7, temperature=1.0))
    assert r.status_code == 200
    choices = r.json["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len(engine.submitted) == 3
    assert len({r.prompt_ids for r in engine.submitted}) == 1
    assert len({r.id for r in engine.submitted}) == 3
    assert [r.params.seed for r in engine.submitted] == [7, 8, 9]
    assert r.json["usage"]["completion_tokens"] == 3 * 27


def test_chat_stream(client, engine):
    r = client.simulate_post(CHAT, json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200
    events = sse_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "Hello from the fake engine."
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 27
    assert engine.cancelled == []


def test_chat_stream_without_usage(client):
    events = sse_events(client.simulate_post(CHAT, json=chat_body(stream=True)))
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_n(client):
    events = sse_events(client.simulate_post(CHAT, json=chat_body(stream=True, n=2, max_tokens=5)))
    texts, reasons = {0: "", 1: ""}, {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    assert texts == {0: "Hello", 1: "Hello"} and reasons == {0: "length", 1: "length"}


def test_chat_logprobs(client, engine):
    r = client.simulate_post(CHAT, json=chat_body(logprobs=True, top_logprobs=2, max_tokens=3))
    assert r.status_code == 200
    assert engine.submitted[-1].logprobs == 2
    content = r.json["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e", "l"]
    assert content[0]["logprob"] == -0.25 and content[0]["bytes"] == [ord("H")]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["H", "?"]
    client.simulate_post(CHAT, json=chat_body(logprobs=True))
    assert engine.submitted[-1].logprobs == 0
    events = sse_events(client.simulate_post(CHAT, json=chat_body(stream=True, logprobs=True, max_tokens=4)))
    toks = [t["token"] for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["content"]]
    assert toks == ["H", "e", "l", "l"]


# ------------------------------------------------------------------------------------ tool calls

def test_tool_call_response(client, engine):
    engine.responder = lambda prompt, req: "Let me check.\n" + CALL_TEXT
    r = client.simulate_post(CHAT, json=chat_body(tools=[WEATHER_TOOL]))
    assert r.status_code == 200, r.text
    assert '"name": "get_weather"' in engine.prompts[0]        # tools reached the template
    choice = r.json["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check."
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "°C"}


def test_tool_choice_none_hides_tools(client, engine):
    engine.responder = lambda prompt, req: CALL_TEXT
    r = client.simulate_post(CHAT, json=chat_body(tools=[WEATHER_TOOL], tool_choice="none"))
    assert "get_weather" not in engine.prompts[0]
    msg = r.json["choices"][0]["message"]
    assert msg["content"] == CALL_TEXT and "tool_calls" not in msg
    assert r.json["choices"][0]["finish_reason"] == "stop"
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.simulate_post(CHAT, json=chat_body(tools=[WEATHER_TOOL], tool_choice=choice))
        assert r.json["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_call_stream(client, engine):
    engine.responder = lambda prompt, req: "Checking" + CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Oslo")
    events = sse_events(client.simulate_post(CHAT, json=chat_body(tools=[WEATHER_TOOL], stream=True)))
    content, calls, reasons = "", {}, []
    for e in events:
        d = e["choices"][0]["delta"]
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.get("id") or c["id"]
            c["name"] += tc["function"].get("name") or ""
            c["arguments"] += tc["function"].get("arguments") or ""
        if e["choices"][0]["finish_reason"]:
            reasons.append(e["choices"][0]["finish_reason"])
    assert content == "Checking" and "<tool" not in content
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_weather"]
    assert [json.loads(calls[i]["arguments"])["city"] for i in sorted(calls)] == ["Paris", "Oslo"]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert reasons == ["tool_calls"]


def test_tool_call_parser_any_split():
    text = "Sure <b>x</b>. <tool_call>\n" + '{"name": "f", "arguments": {"a": [1, "</tool"]}}' + "\n</tool_call>\n" \
           + "<tool_call>not json</tool_call> tail <tool_c"
    whole = parse_tool_calls(text)
    assert whole[0] == "Sure <b>x</b>.\n<tool_call>not json</tool_call> tail <tool_c"
    assert [(c.name, json.loads(c.arguments)) for c in whole[1]] == [("f", {"a": [1, "</tool"]})]
    for cut in range(len(text) + 1):
        for step in (1, 3):
            p = ToolCallParser()
            pieces = [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]
            items = [x for piece in pieces for x in p.feed(piece)] + p.finish()
            assert "".join(x for k, x in items if k == "content") == whole[0]
            assert [(x.name, x.arguments) for k, x in items if k == "tool_call"] == \
                [(c.name, c.arguments) for c in whole[1]]


def test_tool_call_parser_edges():
    assert parse_tool_calls("plain text") == ("plain text", [])
    content, [call] = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}')   # cut off, still valid
    assert content is None and json.loads(call.arguments) == {"x": 1}
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "argu')
    assert calls == [] and content == '<tool_call>{"name": "f", "argu'
    _, [call] = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert json.loads(call.arguments) == {"y": 2}
    p = ToolCallParser()
    assert p.feed("abc <tool_") == [("content", "abc")]       # held back: might be a tool call


# ----------------------------------------------------------------------------------- completions

def test_completion_prompt_forms(client, engine):
    ids = engine.tokenizer.encode("Once")
    for prompt in ("Once", ids, ["Once"], [ids]):
        r = client.simulate_post(COMP, json={"model": "m", "prompt": prompt, "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert list(engine.submitted[-1].prompt_ids) == ids
        body = r.json
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}]
        assert body["usage"]["prompt_tokens"] == len(ids)


def test_completion_stream_and_logprobs(client, engine):
    r = client.simulate_post(COMP, json={"prompt": "Once", "stream": True, "max_tokens": 4, "logprobs": 1,
                                         "stream_options": {"include_usage": True}})
    events = sse_events(r)
    assert engine.submitted[-1].logprobs == 1
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Hell"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    toks = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
            for t in e["choices"][0]["logprobs"]["tokens"]]
    assert toks == list("Hell")
    assert events[-1]["usage"]["completion_tokens"] == 4
    r = client.simulate_post(COMP, json={"prompt": "Once", "max_tokens": 3, "logprobs": 2})
    lp = r.json["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e", "l"] and lp["token_logprobs"] == [-0.25] * 3
    assert lp["top_logprobs"][0] == {"H": -0.25, "?": -2.0} and lp["text_offset"] == [0, 1, 2]


# -------------------------------------------------------------------------------------- errors

BAD_CHAT = [
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens="10"), "max_tokens"),
    (dict(max_completion_tokens=-2), "max_completion_tokens"),
    (dict(n=0), "n"),
    (dict(n=True), "n"),
    (dict(seed="x"), "seed"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop=["a", 1]), "stop"),
    (dict(stream="yes"), "stream"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(stream=True, stream_options={"include_usage": "y"}), "stream_options.include_usage"),
    (dict(logprobs="yes"), "logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logit_bias={"1": 5}), "logit_bias"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(model=5), "model"),
    (dict(messages="hi"), "messages"),
    (dict(messages=[]), "messages"),
    (dict(messages=["hi"]), "messages[0]"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": "x"}, {"content": "x"}]), "messages[1].role"),
    (dict(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (dict(messages=[{"role": "user"}]), "messages[0].content"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls"),
    (dict(tools="x"), "tools"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name"),
    (dict(tools=[WEATHER_TOOL], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
]


@pytest.mark.parametrize("change,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_fields(client, engine, change, param):
    assert_error(client.simulate_post(CHAT, json=chat_body(**change)), 400, param)
    assert engine.submitted == []


BAD_COMPLETION = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "temperature": 500}, "temperature"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETION, ids=[p for _, p in BAD_COMPLETION])
def test_bad_completion_fields(client, engine, body, param):
    assert_error(client.simulate_post(COMP, json=body), 400, param)
    assert engine.submitted == []


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'"text"', b"\xff\xfe{"])
def test_malformed_body(client, raw):
    assert_error(client.simulate_post(CHAT, body=raw, headers={"Content-Type": "application/json"}), 400)


def test_prompt_too_long(engine):
    engine.n_ctx = 40
    client = testing.TestClient(create_app(engine))
    # the template's markup makes it too long: counted exactly (the fake has one token per character)
    err = assert_error(client.simulate_post(CHAT, json=chat_body(messages=[{"role": "user", "content": "x" * 10}])),
                       400, "messages")
    assert err["code"] == "context_length_exceeded"
    assert err["n_ctx"] == 40 and err["n_prompt_tokens"] > 40
    err = assert_error(client.simulate_post(COMP, json={"prompt": "y" * 39}), 400, "prompt")
    assert err["n_prompt_tokens"] == 40
    # the content alone cannot fit: refused before rendering or tokenizing, with the bound in the message
    for url, body, param in ((CHAT, chat_body(messages=[{"role": "user", "content": "x" * 50}]), "messages"),
                             (COMP, {"prompt": "y" * 50}, "prompt")):
        err = assert_error(client.simulate_post(url, json=body), 400, param)
        assert err["code"] == "context_length_exceeded" and err["n_ctx"] == 40
        assert "at least 50 tokens" in err["message"] and err["n_prompt_tokens"] == 50    # a lower bound
    err = assert_error(client.simulate_post(COMP, json={"prompt": list(range(100, 140))}), 400, "prompt")
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (40, 40)
    assert engine.submitted == [] and engine.prompts == []


def test_queue_full(client, engine):
    engine.queue_full = True
    r = client.simulate_post(CHAT, json=chat_body())
    assert_error(r, 503, None, "unavailable_error")
    assert r.headers["retry-after"] == "3"
    r = client.simulate_post(CHAT, json=chat_body(stream=True))      # before the stream starts: a status
    assert_error(r, 503, None, "unavailable_error")


def test_queue_full_part_way_cancels_the_rest(engine):
    engine.max_queue, engine.token_delay = 2, 0.05
    client = testing.TestClient(create_app(engine))
    r = client.simulate_post(CHAT, json=chat_body(n=3))
    assert r.status_code == 503
    assert len(engine.submitted) == 2
    assert sorted(engine.cancelled) == sorted(req.id for req in engine.submitted)


def test_generation_error(client, engine):
    engine.responder = lambda prompt, req: RuntimeError("the device fell over")
    err = assert_error(client.simulate_post(CHAT, json=chat_body()), 500, None, "server_error")
    assert "the device fell over" in err["message"]
    events = sse_events(client.simulate_post(CHAT, json=chat_body(stream=True)))
    assert "the device fell over" in events[-1]["error"]["message"]


def test_unexpected_exception_is_500_and_serving_continues(client, engine):
    def boom():
        raise KeyError("surprise")
    engine.slots = boom
    err = assert_error(client.simulate_get("/slots"), 500, None, "server_error")
    assert "KeyError" not in err["message"] and "surprise" not in err["message"]   # no internal text
    assert client.simulate_post(CHAT, json=chat_body()).status_code == 200


def test_unknown_route_and_method(client):
    err = assert_error(client.simulate_get("/v1/nothing"), 404)
    assert err["code"] == "unknown_url"
    r = client.simulate_get(CHAT)
    assert_error(r, 405)
    assert "POST" in r.headers["allow"]


def test_no_chat_template(client, engine):
    engine.chat_template = None
    assert_error(client.simulate_post(CHAT, json=chat_body()), 400, "messages")
    assert client.simulate_post(COMP, json={"prompt": "x"}).status_code == 200


def test_chat_template_error_is_400(client, engine):
    engine.chat_template.render = lambda *a, **k: (_ for _ in ()).throw(
        type("ChatTemplateError", (ValueError,), {})("chat template error: only alternating roles"))
    err = assert_error(client.simulate_post(CHAT, json=chat_body()), 400, "messages")
    assert "alternating" in err["message"]


# ----------------------------------------------------------------------------- auth, info routes

def test_api_key(engine):
    client = testing.TestClient(create_app(engine, api_key="sekret"))
    err = assert_error(client.simulate_post(CHAT, json=chat_body()), 401)
    assert err["code"] == "invalid_api_key"
    assert_error(client.simulate_post(CHAT, json=chat_body(), headers={"Authorization": "Bearer nope"}), 401)
    assert_error(client.simulate_get("/v1/models", headers={"Authorization": "Basic sekret"}), 401)
    assert_error(client.simulate_get("/metrics"), 401)
    ok = {"Authorization": "Bearer sekret"}
    assert client.simulate_post(CHAT, json=chat_body(), headers=ok).status_code == 200
    assert client.simulate_get("/v1/models", headers=ok).status_code == 200
    assert client.simulate_get("/health").status_code == 200       # open, for load balancers


def test_health(client, engine):
    assert client.simulate_get("/health").json == {"status": "ok"}
    engine.ready.clear()
    r = client.simulate_get("/health")
    assert r.status_code == 503 and r.json["status"] == "loading"
    assert_error(client.simulate_post(CHAT, json=chat_body()), 503, None, "unavailable_error")
    engine.load_error = OSError("model.gguf: no such file")
    r = client.simulate_get("/health")
    assert r.status_code == 500 and "no such file" in r.json["error"]["message"]
    assert_error(client.simulate_post(COMP, json={"prompt": "x"}), 500, None, "server_error")


def test_models(client, engine):
    r = client.simulate_get("/v1/models")
    assert r.status_code == 200
    [m] = r.json["data"]
    assert r.json["object"] == "list"
    assert m["id"] == "fake-model" and m["object"] == "model" and m["owned_by"]
    assert m["context_length"] == engine.n_ctx == m["meta"]["n_ctx"]
    assert client.simulate_get("/v1/models/fake-model").json["id"] == "fake-model"
    assert_error(client.simulate_get("/v1/models/other"), 404, "model", "not_found_error")
    assert client.simulate_get("/models").status_code == 200


def test_metrics_and_slots(client):
    client.simulate_post(CHAT, json=chat_body())
    r = client.simulate_get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "strata_lite_requests_total 1.0" in r.text
    r = client.simulate_get("/slots")
    assert r.status_code == 200 and isinstance(r.json, list) and r.json[0]["id"] == 0
