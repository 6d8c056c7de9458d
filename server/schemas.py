"""Request bodies of /v1/chat/completions and /v1/completions (OpenAI field names) -> a validated `Job`
(the prompt's token ids plus what to generate). Every bad field is an APIError 400 naming it.

Unknown fields are ignored (clients send many); fields we cannot honour (logit_bias, suffix, echo,
response_format other than text, best_of other than n) are rejected rather than silently dropped.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from strata_lite.sampling import InvalidRequest, SamplingParams
from strata_lite.sequence import Request

from . import chat
from .errors import APIError, bad_request

MAX_BODY_BYTES = 64 * 2**20
MAX_N = 128               # and at most the engine's parallel + max_queue (each choice is one queued request)
MAX_STOP = 4              # as OpenAI
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Job:
    kind: str                              # "chat" or "completion"
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None            # top-n per token when logprobs are wanted (0 = just the token's)
    tools: list[dict] | None = None        # tools given to the template: parse tool calls from the output
    prompt_text: str | None = None

    def requests(self, base_id: str) -> list[Request]:
        """One engine Request per choice; with a seed, choice i samples with seed + i."""
        out = []
        for i in range(self.n):
            params = self.params
            if params.seed is not None and i:
                params = replace(params, seed=(params.seed + i) % 2**64)
            out.append(Request(f"{base_id}-{i}", tuple(self.prompt_ids), params=params,
                               max_tokens=self.max_tokens, logprobs=self.logprobs))
        return out


# ---------------------------------------------------------------------------------------------- body

def parse_body(raw: bytes) -> dict:
    if not raw or not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as e:                 # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise bad_request("the JSON in the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {chat._json_type(body)}")
    for key, value in body.items():
        if _has_surrogate(key) or _has_surrogate(value):
            raise bad_request("the request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                              "without its pair), which is not Unicode text", None if _has_surrogate(key) else key)
    return body


def _has_surrogate(x: Any) -> bool:
    """Whether any string in x (keys too) holds a lone surrogate, which no text encoding can carry."""
    return any(_SURROGATE.search(s) for s in chat.json_strings(x))


# ----------------------------------------------------------------------------------------- field types

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def get_int(body: dict, key: str, default=None, lo: int | None = None, hi: int | None = None) -> int | None:
    x = body.get(key)
    if x is None:
        return default
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if not _is_int(x):
        raise bad_request(f"{key} must be an integer, not {chat._json_type(x)}", key)
    if lo is not None and x < lo:
        raise bad_request(f"{key} must be >= {lo}, got {x}", key)
    if hi is not None and x > hi:
        raise bad_request(f"{key} must be <= {hi}, got {x}", key)
    return x


def get_number(body: dict, key: str, default: float) -> float:
    x = body.get(key)
    if x is None:
        return default
    if not _is_number(x):
        raise bad_request(f"{key} must be a number, not {chat._json_type(x)}", key)
    if not math.isfinite(x):
        raise bad_request(f"{key} must be a finite number", key)
    return float(x)


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    x = body.get(key)
    if x is None:
        return default
    if not isinstance(x, bool):
        raise bad_request(f"{key} must be a boolean, not {chat._json_type(x)}", key)
    return x


def get_stop(body: dict) -> tuple[str, ...]:
    x = body.get("stop")
    if x is None:
        return ()
    if isinstance(x, str):
        x = [x]
    if not isinstance(x, list):
        raise bad_request(f"stop must be a string or an array of strings, not {chat._json_type(x)}", "stop")
    if len(x) > MAX_STOP:
        raise bad_request(f"stop has {len(x)} strings, at most {MAX_STOP} are allowed", "stop")
    for s in x:
        if not isinstance(s, str):
            raise bad_request(f"stop must be a string or an array of strings, found {chat._json_type(s)}", "stop")
    for s in x:
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(f"a stop string has {len(s)} characters, at most {MAX_STOP_CHARS} are allowed",
                              "stop")
    return tuple(s for s in x if s)


# ------------------------------------------------------------------------------------------- common

def max_choices(engine) -> int:
    """The most choices one request may ask for: every choice is one engine request, and the engine
    holds at most parallel + max_queue of them (more would always get 503 queue_full)."""
    cfg = getattr(engine, "config", None)
    if cfg is None:
        return MAX_N
    return max(1, min(MAX_N, int(cfg.parallel) + int(cfg.max_queue)))


def get_n(body: dict, engine) -> int:
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    cap = max_choices(engine)
    if n > cap:
        raise bad_request(f"n = {n} is more than this server can hold at once: each choice is one request and "
                          f"it holds at most {cap} (--parallel + --max-queue)", "n")
    return n


def _common(body: dict, engine, default_temperature: float = 1.0) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    for key in ("logit_bias",):
        v = body.get(key)
        if v not in (None, {}):
            raise bad_request(f"{key} is not supported", key)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad_request("response_format must be an object with a 'type'", "response_format")
        if rf["type"] != "text":
            raise bad_request(f"response_format type {rf['type']!r} is not supported (only 'text')",
                              "response_format")
    n = get_n(body, engine)
    stream = get_bool(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        x = so.get("include_usage")
        if x is not None and not isinstance(x, bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage")
        include_usage = bool(x) and stream
    seed = get_int(body, "seed")
    try:
        params = SamplingParams(
            temperature=get_number(body, "temperature", default_temperature),
            top_k=get_int(body, "top_k", 0),
            top_p=get_number(body, "top_p", 1.0),
            min_p=get_number(body, "min_p", 0.0),
            seed=None if seed is None else seed % 2**64,
            presence_penalty=get_number(body, "presence_penalty", 0.0),
            frequency_penalty=get_number(body, "frequency_penalty", 0.0),
            stop=get_stop(body),
            ignore_eos=get_bool(body, "ignore_eos"),
        )
    except InvalidRequest as e:
        raise APIError(400, str(e), param=e.param) from None
    max_tokens = get_int(body, "max_tokens", None, lo=1)         # both are checked; the newer name wins
    max_completion = get_int(body, "max_completion_tokens", None, lo=1)
    if max_completion is not None:
        max_tokens = max_completion
    return dict(params=params, n=n, stream=stream, include_usage=include_usage, max_tokens=max_tokens)


def _finish(kind: str, ids: list[int], c: dict, engine, logprobs, tools=None, prompt_text=None) -> Job:
    if not ids:
        raise bad_request("the prompt is empty", "messages" if kind == "chat" else "prompt")
    n_ctx = int(getattr(engine, "n_ctx", 0) or 0)
    max_tokens = c["max_tokens"]
    if n_ctx:
        room = max(1, n_ctx - len(ids))      # the engine rejects a prompt that does not fit (PromptTooLong)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
    elif max_tokens is None:
        max_tokens = 256
    return Job(kind, ids, c["params"], max_tokens, c["n"], c["stream"], c["include_usage"], logprobs, tools,
               prompt_text)


# --------------------------------------------------------------------------------------------- chat

def parse_chat(body: dict, engine) -> Job:
    c = _common(body, engine)
    if "messages" not in body:
        raise bad_request("messages is required", "messages")
    chat.check_sizes(engine, body.get("messages"), body.get("tools"))
    messages = chat.normalize_messages(body.get("messages"))
    tools = chat.normalize_tools(body.get("tools"), body.get("tool_choice"))
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    want = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    prompt = chat.render_prompt(engine, messages, tools)
    ids = chat.prompt_ids(engine, prompt)
    return _finish("chat", ids, c, engine, (top or 0) if want else None, tools, prompt.text)


# --------------------------------------------------------------------------------------- completions

def _check_ids(ids: list, engine, where: str) -> list[int]:
    n_vocab = getattr(engine.tokenizer, "n_vocab", None)
    for k, t in enumerate(ids):
        if not _is_int(t):
            raise bad_request(f"{where}[{k}] must be a token id (integer), not {chat._json_type(t)}", "prompt")
        if t < 0 or (n_vocab is not None and t >= n_vocab):
            raise bad_request(f"{where}[{k}] = {t} is not a token id of this model"
                              + (f" (0..{n_vocab - 1})" if n_vocab is not None else ""), "prompt")
    return list(ids)


def parse_completion(body: dict, engine) -> Job:
    c = _common(body, engine)
    if body.get("suffix") not in (None, ""):
        raise bad_request("suffix is not supported", "suffix")
    if get_bool(body, "echo"):
        raise bad_request("echo is not supported", "echo")
    best_of = get_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != c["n"]:
        raise bad_request("best_of other than n is not supported", "best_of")
    lp = body.get("logprobs")
    if isinstance(lp, bool):             # some clients send true/false here as in chat
        logprobs = 0 if lp else None
    else:
        logprobs = get_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt")
    p = body["prompt"]
    text = None
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                          # a batch of one prompt
    if isinstance(p, str):
        text = p
        if len(p) > chat.MAX_CHARS:
            raise bad_request(f"prompt has {len(p)} characters, at most {chat.MAX_CHARS} are allowed", "prompt")
        chat.check_fits(engine, len(p), "prompt")
        ids = list(engine.tokenizer.encode(p, add_special=True, parse_special=True)) if p else []
    elif isinstance(p, list):
        if p and all(isinstance(x, str) for x in p):
            raise bad_request("prompt: only one prompt per request is supported (use n for several choices)",
                              "prompt")
        n_ctx = int(getattr(engine, "n_ctx", 0) or 0)
        if n_ctx and len(p) >= n_ctx:              # before looking at every id
            raise APIError(400, f"the prompt has {len(p)} tokens, the context holds {n_ctx} (and a generated "
                           "token must fit)", param="prompt", code="context_length_exceeded",
                           extra={"n_prompt_tokens": len(p), "n_ctx": n_ctx})
        ids = _check_ids(p, engine, "prompt")
    else:
        raise bad_request(f"prompt must be a string or an array of token ids, not {chat._json_type(p)}", "prompt")
    return _finish("completion", ids, c, engine, logprobs, None, text)
