"""The OpenAPI 3.0 document of the HTTP API, served at GET /openapi.json.

Hand-written from what server/schemas.py and server/chat.py accept (docs/server.md in JSON Schema):
the ranges here are the ones they enforce, so a generator (schemathesis, tests/server/test_schemathesis.py)
can send values on both sides of each bound and expect 2xx inside and an OpenAI-shaped 400 outside.
Fields the server treats as absent when null are `nullable`. Unknown fields are ignored by the server,
so objects stay open (no `additionalProperties: false`). Only the /v1 paths are listed; the same
routes answer without the prefix.
"""
from __future__ import annotations

import json

import falcon

from . import schemas

OPENAPI_VERSION = "3.0.3"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _int(lo: int | None = None, hi: int | None = None, nullable: bool = True) -> dict:
    s: dict = {"type": "integer", "nullable": nullable}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _num(lo: float, hi: float, exclusive_lo: bool = False) -> dict:
    return {"type": "number", "nullable": True, "minimum": lo, "maximum": hi, "exclusiveMinimum": exclusive_lo}


_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}
_CONTENT = {"oneOf": [{"type": "string"}, _TEXT_PARTS]}

_FUNCTION_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string", "nullable": True},
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1},
        "arguments": {"type": "string", "description": "a JSON object, as a string (empty = {})"}}}}}


def _message(roles: list[str], content: dict, extra: dict | None = None, required=("role", "content")) -> dict:
    props = {"role": {"type": "string", "enum": roles}, "content": content,
             "name": {"type": "string", "nullable": True}}
    props.update(extra or {})
    return {"type": "object", "required": list(required), "properties": props}


# One variant per role family, told apart by the `role` enum (chat.normalize_messages).
_MESSAGE = {"oneOf": [
    _message(["system", "developer", "user"], _CONTENT),
    _message(["assistant"], {**_CONTENT, "nullable": True},
             {"tool_calls": {"type": "array", "nullable": True, "items": _FUNCTION_CALL}}, required=("role",)),
    _message(["tool"], _CONTENT, {"tool_call_id": {"type": "string", "nullable": True}}),
]}

_TOOL = {"type": "object", "required": ["function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "parameters": {"type": "object", "nullable": True, "description": "a JSON Schema object"}}}}}

_COMMON = {
    "model": {"type": "string", "nullable": True, "description": "ignored: one model is served"},
    "max_tokens": _int(1), "max_completion_tokens": _int(1),
    "temperature": _num(0, 100), "top_p": _num(0, 1, exclusive_lo=True), "top_k": _int(0),
    "min_p": _num(0, 1), "seed": _int(), "presence_penalty": _num(-2, 2), "frequency_penalty": _num(-2, 2),
    "stop": {"nullable": True, "oneOf": [
        {"type": "string", "maxLength": schemas.MAX_STOP_CHARS},
        {"type": "array", "maxItems": schemas.MAX_STOP,
         "items": {"type": "string", "maxLength": schemas.MAX_STOP_CHARS}}]},
    "ignore_eos": {"type": "boolean", "nullable": True,
                   "description": "go on past end-of-generation tokens to max_tokens (as vLLM and llama.cpp's server)"},
    "n": _int(1, schemas.MAX_N),
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {"type": "object", "nullable": True, "properties": {
        "include_usage": {"type": "boolean", "nullable": True}}},
    "response_format": {"type": "object", "nullable": True, "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text"]}}},
    "logit_bias": {"type": "object", "nullable": True, "maxProperties": 0},
}

_CHAT_REQUEST = {"type": "object", "required": ["messages"], "properties": {
    **_COMMON,
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "tools": {"type": "array", "nullable": True, "items": _TOOL},
    "tool_choice": {"nullable": True, "oneOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": "boolean", "nullable": True},
    "logprobs": {"type": "boolean", "nullable": True},
    "top_logprobs": {**_int(0, schemas.MAX_TOP_LOGPROBS), "description": "needs logprobs: true"},
}}

_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_COMPLETION_REQUEST = {"type": "object", "required": ["prompt"], "properties": {
    **_COMMON,
    "prompt": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                         {"type": "array", "minItems": 1, "maxItems": 1,
                          "items": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]}}]},
    "logprobs": {"nullable": True, "oneOf": [{"type": "boolean"}, _int(0, schemas.MAX_TOP_LOGPROBS, False)]},
    "echo": {"type": "boolean", "nullable": True, "enum": [False, None]},
    "suffix": {"type": "string", "nullable": True, "enum": ["", None]},
    "best_of": {**_int(1), "description": "must equal n"},
}}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": "string", "nullable": True},
        "code": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "integer"}]}}}}}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}

_FINISH = {"type": "string", "nullable": True, "enum": ["stop", "length", "tool_calls", "cancelled", None]}


def _completion_object(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": [obj]}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": choice}, "usage": _USAGE}}


_CHAT_COMPLETION = _completion_object("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "finish_reason": _FINISH,
        "logprobs": {"type": "object", "nullable": True},
        "message": {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["assistant"]}, "content": {"type": "string", "nullable": True},
            "tool_calls": {"type": "array", "items": _FUNCTION_CALL}}}}})

_TEXT_COMPLETION = _completion_object("text_completion", {
    "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
        "logprobs": {"type": "object", "nullable": True}}})

_MODEL = {"type": "object", "required": ["id", "object", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "context_length": {"type": "integer"}}}

_HEALTH = {"type": "object", "required": ["status"], "properties": {
    "status": {"type": "string"}, "error": _ERROR["properties"]["error"]}}

_SLOT = {"type": "object", "required": ["state"], "properties": {
    "state": {"type": "string"}, "request_id": {"type": "string", "nullable": True},
    "drafted": {"type": "integer", "description": "drafted tokens its request verified (speculative decoding)"},
    "draft_accepted": {"type": "integer", "description": "of them, accepted"}}}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {"default": _json(_ref("Error"), "an error (400 bad field, 401 API key, 404, 413, 503 busy or "
                                           "loading with Retry-After, 500)")}
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer", "minimum": 1}, "description": "seconds"}}


def _chunk(obj: str) -> dict:
    """One streamed chunk; the last one (include_usage) has `choices: []` and the usage."""
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": [obj]}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": {**_USAGE, "nullable": True},
        "choices": {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"],
                                               "properties": {"index": {"type": "integer"},
                                                              "finish_reason": _FINISH}}}}}


def _sse_event(chunk: dict) -> dict:
    """An SSE event (OpenAPI 3.0: the schema describes each event): `data:` is a JSON chunk, an error
    found after the stream started, or the closing `[DONE]`."""
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"type": "string", "enum": ["[DONE]"]},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [chunk, _ERROR]}}]}}}


def _generation(summary: str, request: str, answer: str, chunk: str) -> dict:
    ok = _json(_ref(answer), "the completion (application/json), or with stream: true an SSE stream of "
                             "chunks ending with `data: [DONE]`")
    ok["content"]["text/event-stream"] = {"schema": _sse_event(_chunk(chunk))}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": _ref(request)}}},
        "responses": {"200": ok, "503": {**_json(_ref("Error"), "the queue is full or the model is loading"),
                                          "headers": _RETRY_AFTER}, **_ERRORS}}}


def _get(summary: str, ok: dict, **extra) -> dict:
    return {"get": {"summary": summary, "responses": {"200": ok, **_ERRORS}, **extra}}


def document() -> dict:
    """The OpenAPI document (its nested schemas are shared module constants: do not mutate)."""
    health_503 = {**_json(_ref("Health"), "loading"), "headers": _RETRY_AFTER}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "strata_lite", "version": "1",
                 "description": "OpenAI-compatible API of strata_lite (docs/server.md). With --api-key every "
                                "endpoint but /health needs `Authorization: Bearer KEY`."},
        "paths": {
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest", "ChatCompletion",
                                                 "chat.completion.chunk"),
            "/v1/completions": _generation("Text completion", "CompletionRequest", "TextCompletion",
                                            "text_completion"),
            "/v1/models": _get("The served model", _json({"type": "object", "required": ["object", "data"],
                                                          "properties": {"object": {"type": "string"},
                                                                         "data": {"type": "array",
                                                                                  "items": _ref("Model")}}})),
            "/v1/models/{model_id}": _get("One model by id (404 for any other id)", _json(_ref("Model")),
                                          parameters=[{"name": "model_id", "in": "path", "required": True,
                                                       "schema": {"type": "string"}}]),
            "/health": {"get": {"summary": "Liveness and readiness (no API key needed)", "security": [],
                                "responses": {"200": _json(_ref("Health")), "503": health_503,
                                              "500": _json(_ref("Health"), "the model failed to load or the "
                                                                           "engine stopped")}}},
            "/metrics": _get("Prometheus metrics of the engine", {"description": "Prometheus text",
                                                                  "content": {"text/plain": {"schema": {
                                                                      "type": "string"}}}}),
            "/slots": _get("Per slot: state and current request", _json({"type": "array", "items": _ref("Slot")})),
            "/server_info": _get("What this replica serves and its load (read by routers)", _json({"type": "object"})),
            "/model_info": _get("The served model (read by routers)", _json({"type": "object"})),
            "/get_load": _get("Requests running and waiting (read by load-aware routers)", _json({"type": "object"})),
            "/openapi.json": _get("This document", _json({"type": "object"})),
        },
        "components": {
            "schemas": {"ChatCompletionRequest": _CHAT_REQUEST, "CompletionRequest": _COMPLETION_REQUEST,
                        "ChatCompletion": _CHAT_COMPLETION, "TextCompletion": _TEXT_COMPLETION,
                        "Model": _MODEL, "Error": _ERROR, "Health": _HEALTH, "Slot": _SLOT},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }


class OpenAPIDocument:
    """GET /openapi.json (serialized once)."""

    def __init__(self):
        self.data = json.dumps(document()).encode("utf-8")

    def on_get(self, req, resp):
        resp.content_type = falcon.MEDIA_JSON
        resp.data = self.data
