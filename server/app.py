"""The OpenAI-compatible HTTP API as a WSGI app (falcon): `create_app(engine, api_key=None)`.

Endpoints: POST /v1/chat/completions, POST /v1/completions (also without the /v1 prefix), GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics, GET /slots. See docs/server.md.

The engine contract (strata_lite.engine.Engine): ready / load_error / model_id / n_ctx / tokenizer /
chat_template / submit(Request) -> handle with events() and cancel() / slots() / metrics_registry.
Events are told apart by their fields (TokenEvent has token_id, DoneEvent finish_reason, ErrorEvent
message), so the server does not import the engine and any engine with that contract can be served.
"""
from __future__ import annotations

import hmac
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import falcon

from . import openapi, schemas, sse
from .errors import (INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, UNAVAILABLE, APIError, from_engine_exception)
from .tool_calls import ToolCallParser, parse_tool_calls

log = logging.getLogger("strata_lite.server")

OPEN_PATHS = frozenset({"/health", "/v1/health"})     # answered without the API key
OWNED_BY = "strata_lite"


# ------------------------------------------------------------------------------------------ helpers

def _kind(ev: Any) -> str:
    if hasattr(ev, "token_id"):
        return "token"
    if hasattr(ev, "finish_reason"):
        return "done"
    return "error"


def _json_default(o: Any):
    if hasattr(o, "item"):            # numpy scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def _send_json(resp: falcon.Response, obj: Any, status: int = 200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = json.dumps(obj, ensure_ascii=False, default=_json_default).encode("utf-8")


def _usage(dones: list) -> dict:
    prompt = int(dones[0].prompt_tokens) if dones else 0
    completion = sum(int(d.completion_tokens) for d in dones)
    cached = int(getattr(dones[0], "cached_tokens", 0) or 0) if dones else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class InFlight:
    """Handles of requests being answered, so that shutdown can cancel them all."""

    def __init__(self):
        self._lock = threading.Lock()
        self._handles: set = set()

    def add(self, handles) -> None:
        with self._lock:
            self._handles.update(handles)

    def discard(self, handles) -> None:
        with self._lock:
            self._handles.difference_update(handles)

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles)

    def cancel_all(self) -> None:
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            try:
                h.cancel()
            except Exception:
                log.exception("cancel failed")


@dataclass
class _Result:
    tokens: list = field(default_factory=list)
    done: Any = None
    text: str = ""


@dataclass
class _ChoiceState:
    parser: ToolCallParser | None
    raw: str = ""                 # text of the TokenEvents so far
    n_calls: int = 0
    pending_lp: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------- server

class OpenAIServer:
    def __init__(self, engine, api_key: str | None = None):
        self.engine = engine
        self.api_key = api_key or None
        self.inflight = InFlight()

    # ---- state

    def require_ready(self) -> None:
        err = getattr(self.engine, "load_error", None)
        if err is not None:
            raise APIError(500, f"the model failed to load: {err}", SERVER_ERROR, code="load_error")
        if not self.engine.ready.is_set():
            raise APIError(503, "the model is loading", UNAVAILABLE, code="loading",
                           headers={"Retry-After": "5"})

    # ---- engine requests

    def submit(self, job: schemas.Job, base_id: str) -> list:
        handles = []
        try:
            for request in job.requests(base_id):
                handles.append(self.engine.submit(request))
        except Exception as e:
            for h in handles:
                h.cancel()
            mapped = from_engine_exception(e)
            if mapped is None:
                raise
            if mapped.status == 400 and (mapped.param is None or "n_ctx" in mapped.extra):
                mapped.param = "messages" if job.kind == "chat" else "prompt"   # the prompt's field here
            raise mapped from None
        self.inflight.add(handles)
        return handles

    def collect(self, handles) -> list[_Result]:
        """Wait for every choice to finish (non-streaming)."""
        results = [_Result() for _ in handles]
        try:
            for h, r in zip(handles, results):
                for ev in h.events():
                    kind = _kind(ev)
                    if kind == "token":
                        r.tokens.append(ev)
                    elif kind == "done":
                        r.done = ev
                        break
                    else:
                        raise APIError(500, f"generation failed: {ev.message}", SERVER_ERROR)
                if r.done is None:
                    raise APIError(500, "generation ended without a result", SERVER_ERROR)
                pieces = "".join(t.text or "" for t in r.tokens)
                r.text = r.done.text if getattr(r.done, "text", None) is not None else pieces
        finally:
            for h, r in zip(handles, results):
                if r.done is None:
                    h.cancel()
            self.inflight.discard(handles)
        return results

    def merged_events(self, handles) -> Iterator[tuple[int, Any]]:
        """(choice index, event) of all handles as they come, until each has ended."""
        if len(handles) == 1:
            ended = False
            for ev in handles[0].events():
                yield 0, ev
                if _kind(ev) != "token":
                    ended = True
                    break
            if not ended:
                yield 0, _Error("generation ended without a result")
            return
        q: queue.Queue = queue.Queue()

        def pump(i, h):
            try:
                for ev in h.events():
                    q.put((i, ev))
                    if _kind(ev) != "token":
                        return
                q.put((i, _Error("generation ended without a result")))
            except Exception:               # pragma: no cover - an engine bug
                log.exception("reading a request's events failed")
                q.put((i, _Error("generation failed (an internal error; the server log has the details)")))

        for i, h in enumerate(handles):
            threading.Thread(target=pump, args=(i, h), daemon=True, name=f"sse-pump-{i}").start()
        left = len(handles)
        while left:
            i, ev = q.get()
            if _kind(ev) != "token":
                left -= 1
            yield i, ev

    def streaming_body(self, events: Iterator[dict], handles, finished: set) -> sse.SSEBody:
        def on_close():
            for i, h in enumerate(handles):
                if i not in finished:
                    try:
                        h.cancel()
                    except Exception:
                        log.exception("cancel failed")
            self.inflight.discard(handles)
        return sse.SSEBody(events, on_close)

    # ---- logprobs

    def token_text(self, ev) -> str:
        for tid, text, _ in ev.top_logprobs or ():
            if tid == ev.token_id:
                return text
        try:
            return self.engine.tokenizer.decode([ev.token_id])
        except Exception:
            return ev.text or ""

    def chat_logprob(self, ev) -> dict:
        t = self.token_text(ev)
        return {"token": t, "logprob": ev.logprob, "bytes": list(t.encode("utf-8")),
                "top_logprobs": [{"token": tx, "logprob": lp, "bytes": list(tx.encode("utf-8"))}
                                 for _, tx, lp in (ev.top_logprobs or ())]}

    def completion_logprobs(self, tokens, offset: int = 0) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for ev in tokens:
            t = self.token_text(ev)
            out["tokens"].append(t)
            out["token_logprobs"].append(ev.logprob)
            out["top_logprobs"].append({tx: lp for _, tx, lp in (ev.top_logprobs or ())})
            out["text_offset"].append(offset)
            offset += len(ev.text or "")
        return out

    # ---- chat

    def chat_response(self, job, rid, created, results) -> dict:
        choices = []
        for i, r in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            finish = r.done.finish_reason
            if job.tools is not None:
                content, calls = parse_tool_calls(r.text)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [c.to_openai() for c in calls]
                    finish = "tool_calls"
            lp = None if job.logprobs is None else {"content": [self.chat_logprob(t) for t in r.tokens]}
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.engine.model_id,
                "choices": choices, "usage": _usage([r.done for r in results])}

    def chat_stream(self, job, rid, created, handles, finished: set) -> Iterator[dict]:
        model = self.engine.model_id

        def chunk(choices):
            d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": choices}
            if job.include_usage:
                d["usage"] = None
            return d

        states = [_ChoiceState(ToolCallParser() if job.tools is not None else None) for _ in handles]

        def take_lp(st):
            if job.logprobs is None or not st.pending_lp:
                return None
            lp, st.pending_lp = {"content": st.pending_lp}, []
            return lp

        def deltas(st, items):
            for kind, x in items:
                if kind == "content":
                    yield {"content": x}
                else:
                    call = x.to_openai()
                    call["index"] = st.n_calls
                    st.n_calls += 1
                    yield {"tool_calls": [call]}

        for i in range(len(handles)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        dones = [None] * len(handles)
        for i, ev in self.merged_events(handles):
            st, kind = states[i], _kind(ev)
            if kind == "error":
                yield {"error": {"message": f"generation failed: {ev.message}", "type": SERVER_ERROR,
                                 "param": None, "code": None}}
                return
            if kind == "token":
                text = ev.text or ""
                st.raw += text
                if job.logprobs is not None:
                    st.pending_lp.append(self.chat_logprob(ev))
                items = st.parser.feed(text) if st.parser else ([("content", text)] if text else [])
            else:
                finished.add(i)
                dones[i] = ev
                full = getattr(ev, "text", None)
                tail = full[len(st.raw):] if full and full.startswith(st.raw) else ""
                if st.parser:
                    items = st.parser.feed(tail) + st.parser.finish()
                else:
                    items = [("content", tail)] if tail else []
            for delta in deltas(st, items):
                yield chunk([{"index": i, "delta": delta, "logprobs": take_lp(st), "finish_reason": None}])
            if kind == "done":
                reason = "tool_calls" if st.n_calls else ev.finish_reason
                yield chunk([{"index": i, "delta": {}, "logprobs": take_lp(st), "finish_reason": reason}])
        if job.include_usage:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": _usage(dones)}

    # ---- completions

    def completion_response(self, job, rid, created, results) -> dict:
        choices = []
        for i, r in enumerate(results):
            lp = None if job.logprobs is None else self.completion_logprobs(r.tokens)
            choices.append({"index": i, "text": r.text, "logprobs": lp, "finish_reason": r.done.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": self.engine.model_id,
                "choices": choices, "usage": _usage([r.done for r in results])}

    def completion_stream(self, job, rid, created, handles, finished: set) -> Iterator[dict]:
        model = self.engine.model_id

        def chunk(choices):
            d = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
            if job.include_usage:
                d["usage"] = None
            return d

        raw = [""] * len(handles)
        offsets = [0] * len(handles)
        pending = [[] for _ in handles]
        dones = [None] * len(handles)

        def lp_of(i):
            if job.logprobs is None:
                return None
            lp = self.completion_logprobs(pending[i], offsets[i])
            offsets[i] += sum(len(t.text or "") for t in pending[i])
            pending[i] = []
            return lp

        for i, ev in self.merged_events(handles):
            kind = _kind(ev)
            if kind == "error":
                yield {"error": {"message": f"generation failed: {ev.message}", "type": SERVER_ERROR,
                                 "param": None, "code": None}}
                return
            if kind == "token":
                text = ev.text or ""
                raw[i] += text
                if job.logprobs is not None:
                    pending[i].append(ev)
                if text:
                    yield chunk([{"index": i, "text": text, "logprobs": lp_of(i), "finish_reason": None}])
                continue
            finished.add(i)
            dones[i] = ev
            full = getattr(ev, "text", None)
            tail = full[len(raw[i]):] if full and full.startswith(raw[i]) else ""
            yield chunk([{"index": i, "text": tail, "logprobs": lp_of(i) if pending[i] else None,
                          "finish_reason": ev.finish_reason}])
        if job.include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": _usage(dones)}

    # ---- one generation request

    def generate(self, req: falcon.Request, resp: falcon.Response, kind: str) -> None:
        self.require_ready()
        if req.content_length is not None and req.content_length > schemas.MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {schemas.MAX_BODY_BYTES} bytes")
        body = schemas.parse_body(req.bounded_stream.read())
        if kind == "chat":
            job = schemas.parse_chat(body, self.engine)
            rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        else:
            job = schemas.parse_completion(body, self.engine)
            rid = "cmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        handles = self.submit(job, rid)
        if not job.stream:
            results = self.collect(handles)
            make = self.chat_response if kind == "chat" else self.completion_response
            _send_json(resp, make(job, rid, created, results))
            return
        finished: set = set()
        make = self.chat_stream if kind == "chat" else self.completion_stream
        resp.status = 200
        resp.content_type = sse.CONTENT_TYPE
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")
        resp.stream = self.streaming_body(make(job, rid, created, handles, finished), handles, finished)


@dataclass
class _Error:
    message: str


# ---------------------------------------------------------------------------------------- resources

class _ChatCompletions:
    def __init__(self, s: OpenAIServer):
        self.s = s

    def on_post(self, req, resp):
        self.s.generate(req, resp, "chat")


class _Completions:
    def __init__(self, s: OpenAIServer):
        self.s = s

    def on_post(self, req, resp):
        self.s.generate(req, resp, "completion")


class _Models:
    def __init__(self, s: OpenAIServer):
        self.s = s

    def model(self) -> dict:
        e = self.s.engine
        n_ctx = int(e.n_ctx)
        return {"id": e.model_id, "object": "model", "created": int(getattr(e, "created", 0) or 0),
                "owned_by": OWNED_BY, "context_length": n_ctx, "meta": {"n_ctx": n_ctx}}

    def on_get(self, req, resp):
        _send_json(resp, {"object": "list", "data": [self.model()]})

    def on_get_one(self, req, resp, model_id):
        m = self.model()
        if model_id != m["id"]:
            raise APIError(404, f"the model {model_id!r} does not exist (this server has {m['id']!r})",
                           NOT_FOUND, "model", "model_not_found")
        _send_json(resp, m)


class _Health:
    """200 {"status": "ok", "engine": liveness} while the engine serves; 503 while the model loads, while
    a step runs past the stuck-step bound (engine_stuck) or once the engine is stopped (engine_stopped);
    500 when loading failed (load_error) or the engine thread died (engine_failed). An engine without
    health() (test fakes) is judged by ready / load_error / fatal_error alone."""

    def __init__(self, s: OpenAIServer):
        self.s = s

    @staticmethod
    def _error(resp, status: int, state: str, message: str, code: str, etype: str) -> None:
        if status == 503:
            resp.set_header("Retry-After", "5")
        _send_json(resp, {"status": state, "error": {"message": message, "type": etype, "param": None,
                                                     "code": code}}, status)

    def on_get(self, req, resp):
        e = self.s.engine
        err = getattr(e, "load_error", None)
        fatal = getattr(e, "fatal_error", None)
        live = e.health() if callable(getattr(e, "health", None)) else None
        if err is not None:
            self._error(resp, 500, "error", f"the model failed to load: {err}", "load_error", SERVER_ERROR)
        elif fatal is not None:
            self._error(resp, 500, "error", f"the engine stopped: {fatal}", "engine_failed", SERVER_ERROR)
        elif not e.ready.is_set():
            self._error(resp, 503, "loading", "the model is loading", "loading", UNAVAILABLE)
        elif live is not None and live["state"] in ("stuck", "stopped"):
            self._error(resp, 503, live["state"], live["reason"], "engine_" + live["state"], UNAVAILABLE)
        elif live is not None:
            engine = {k: v for k, v in live.items() if k not in ("state", "reason")}
            _send_json(resp, {"status": "ok", "engine": engine})
        else:
            _send_json(resp, {"status": "ok"})


class _Metrics:
    def __init__(self, s: OpenAIServer):
        self.s = s

    def on_get(self, req, resp):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        registry = getattr(self.s.engine, "metrics_registry", None)
        if registry is None:
            raise APIError(404, "this engine has no metrics", NOT_FOUND)
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = generate_latest(registry)


class _Slots:
    def __init__(self, s: OpenAIServer):
        self.s = s

    def on_get(self, req, resp):
        _send_json(resp, self.s.engine.slots())


class _WorkerInfo:
    """What a router reads from a worker (sglang-router: /server_info and /model_info when it registers
    one, /get_load for load-aware policies; the /get_ forms are its older names): engine.server_info()."""

    def __init__(self, s: OpenAIServer):
        self.s = s

    def _info(self) -> dict:
        info = getattr(self.s.engine, "server_info", None)
        if info is None:
            raise APIError(404, "this engine reports no server info", NOT_FOUND)
        return info()

    def on_get_server(self, req, resp):
        _send_json(resp, self._info())

    def on_get_model(self, req, resp):
        i = self._info()
        _send_json(resp, {k: i[k] for k in ("model_path", "served_model_name", "model_type", "is_generation",
                                            "context_length")} | {"tokenizer_path": None})

    def on_get_load(self, req, resp):
        i = self._info()
        _send_json(resp, {"load": i["running"] + i["waiting"], "num_reqs": i["running"],
                          "num_waiting_reqs": i["waiting"], "num_tokens": i["tokens"]})


# ----------------------------------------------------------------------------- auth and error handling

class _ApiKeyMiddleware:
    def __init__(self, key: str):
        self.key = key.encode("utf-8")

    def process_request(self, req, resp):
        if req.path in OPEN_PATHS or req.method == "OPTIONS":
            return
        scheme, _, token = (req.get_header("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), self.key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           INVALID_REQUEST, None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _send_error(resp, err: APIError) -> None:
    for k, v in err.headers.items():
        resp.set_header(k, v)
    _send_json(resp, err.body(), err.status)


def _handle_api_error(req, resp, ex, params):
    _send_error(resp, ex)


def _handle_http_error(req, resp, ex, params):
    status = int(ex.status_code)
    if status == 404:
        err = APIError(404, f"unknown request URL: {req.method} {req.path}", INVALID_REQUEST, None, "unknown_url")
    elif status == 405:
        err = APIError(405, f"method {req.method} is not allowed on {req.path}", INVALID_REQUEST, None,
                       "method_not_allowed")
    else:
        msg = ex.title or str(status)
        if ex.description:
            msg += f": {ex.description}"
        err = APIError(status, msg, INVALID_REQUEST if status < 500 else SERVER_ERROR)
    err.headers.update(ex.headers or {})
    _send_error(resp, err)


def _handle_exception(req, resp, ex, params):
    mapped = from_engine_exception(ex)
    if mapped is None:
        log.exception("unhandled error in %s %s", req.method, req.path)
        mapped = APIError(500, "internal server error (the server log has the details)", SERVER_ERROR)
    _send_error(resp, mapped)


def build_app(engine, api_key: str | None = None) -> tuple[falcon.App, OpenAIServer]:
    server = OpenAIServer(engine, api_key)
    app = falcon.App(middleware=[_ApiKeyMiddleware(api_key)] if api_key else [])
    app.req_options.strip_url_path_trailing_slash = True
    app.add_error_handler(Exception, _handle_exception)
    app.add_error_handler(falcon.HTTPError, _handle_http_error)
    app.add_error_handler(APIError, _handle_api_error)
    chat_r, comp_r, models_r = _ChatCompletions(server), _Completions(server), _Models(server)
    for prefix in ("/v1", ""):
        app.add_route(prefix + "/chat/completions", chat_r)
        app.add_route(prefix + "/completions", comp_r)
        app.add_route(prefix + "/models", models_r)
        app.add_route(prefix + "/models/{model_id:path}", models_r, suffix="one")
        app.add_route(prefix + "/health", _Health(server))
    app.add_route("/metrics", _Metrics(server))
    app.add_route("/slots", _Slots(server))
    info = _WorkerInfo(server)
    for name in ("server", "model"):
        app.add_route(f"/{name}_info", info, suffix=name)
        app.add_route(f"/get_{name}_info", info, suffix=name)
    app.add_route("/get_load", info, suffix="load")
    app.add_route("/openapi.json", openapi.OpenAPIDocument())
    return app, server


def create_app(engine, api_key: str | None = None) -> falcon.App:
    """The WSGI app serving `engine`; with api_key, every endpoint but /health needs
    `Authorization: Bearer <api_key>`."""
    return build_app(engine, api_key)[0]
