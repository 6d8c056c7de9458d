"""Fuzzing the request schemas: hypothesis JSON bodies for /v1/chat/completions and /v1/completions
(well-formed requests with one field of every JSON type, random objects, raw bytes) through the falcon
test client with the fake engine. Every answer is 200, 400 or 503; every error has OpenAI's shape
({"error": {"message", "type", "param", "code"}}) and no internal exception text.

hypothesis rather than atheris (see tests/loader/test_fuzz_gguf.py's docstring), seeded
(derandomize=True). tests/server/test_schemathesis.py covers the OpenAPI document's view of the same
endpoints against a live server; this file goes through schemas.py directly and faster.
"""
from __future__ import annotations

import json
import re

import pytest
from falcon import testing
from hypothesis import HealthCheck, given, settings, strategies as st

from strata_lite.server.app import create_app
from strata_server_fake_engine import FakeEngine

FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
INTERNAL = re.compile(r"Traceback|File \"|Exception\b|\.py\b")        # JSON errors do name "line 1 column 2"
SCALAR = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12)
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3),
                    max_leaves=10)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | JSON,
     "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                        "text": st.text(max_size=10)})) | JSON},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
              st.fixed_dictionaries({"name": st.text(max_size=8), "arguments": st.text(max_size=20) | JSON})}),
              max_size=2) | JSON, "name": JSON, "tool_call_id": JSON})
COMMON = {"model": JSON, "max_tokens": st.integers(-3, 40) | JSON, "max_completion_tokens": JSON,
          "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-1, 2) | JSON, "top_k": JSON,
          "min_p": JSON, "n": st.integers(-1, 200) | JSON, "stream": st.booleans() | JSON,
          "stream_options": st.fixed_dictionaries({"include_usage": JSON}) | JSON, "seed": JSON,
          "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6) | JSON,
          "presence_penalty": JSON, "frequency_penalty": JSON, "logit_bias": JSON,
          "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}) | JSON}
CHAT_BODY = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4) | JSON}, optional={
    **COMMON, "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                                st.fixed_dictionaries({"name": st.text(max_size=8), "parameters": JSON})}),
                                max_size=2) | JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON, "parallel_tool_calls": JSON,
    "logprobs": st.booleans() | JSON, "top_logprobs": st.integers(-1, 25) | JSON})
COMPLETION_BODY = st.fixed_dictionaries(
    {"prompt": st.text(max_size=40) | st.lists(st.integers(-2, 0x120000), max_size=8) | JSON},
    optional={**COMMON, "suffix": JSON, "echo": JSON, "best_of": JSON, "logprobs": JSON})


@pytest.fixture(scope="module")
def client():
    engine = FakeEngine(n_ctx=4096, max_queue=64)
    engine.responder = lambda prompt, request: "ok"
    return testing.TestClient(create_app(engine))


def check(client, url: str, raw: bytes) -> None:
    r = client.simulate_post(url, body=raw, headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400, 503), (r.status_code, r.text[:500])
    if r.status_code == 200:
        return
    err = r.json["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert not INTERNAL.search(err["message"]), err["message"]


@FUZZ
@given(body=CHAT_BODY)
def test_chat_bodies(client, body):
    check(client, "/v1/chat/completions", json.dumps(body).encode())


@FUZZ
@given(body=COMPLETION_BODY)
def test_completion_bodies(client, body):
    check(client, "/v1/completions", json.dumps(body).encode())


@settings(FUZZ, max_examples=60)
@given(url=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       raw=st.one_of(st.binary(max_size=80), JSON.map(lambda x: json.dumps(x).encode()),
                     st.text(max_size=40).map(lambda t: t.encode("utf-8"))))
def test_raw_bodies(client, url, raw):
    check(client, url, raw)
