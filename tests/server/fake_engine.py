"""A fake engine with the strata_lite.engine.Engine contract, for the HTTP server's tests.

One token per character (id = ord(c) + OFFSET, BOS = 1, EOS = 2). The completion of a request is
`engine.responder(prompt_text, request)` (a string, or an exception instance to produce an ErrorEvent),
cut at the first stop string ("stop") or after max_tokens characters ("length"); tokens come from a
thread per request, `token_delay` seconds apart. cached_tokens is the longest common prefix with an
earlier prompt. Every cancel() is recorded (`cancelled`, `cancel_event`). Events, errors and the handle
are the engine's own (strata_lite.engine_events).

Loaded in tests/server/conftest.py under the module name `strata_server_fake_engine` (tests/engine has
its own fake_engine.py).
"""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter

from strata_lite.engine_events import (DoneEvent, EngineNotReady, ErrorEvent, PromptTooLong, QueueFull,
                                       RequestHandle, TokenEvent)
from strata_lite.loader.chat_template import ChatTemplate

OFFSET = 16
BOS, EOS = 1, 2
MODEL_ID = "fake-model"

# Our own small ChatML-style template: tools listed as JSON in a system turn, tool calls written with
# `tojson` of the arguments (so arguments that are still a JSON string would be caught).
TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
{%- if not (tools and loop.first and m.role == 'system') %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in m.tool_calls or [] %}
{%- if tc.function.arguments is string %}{{ raise_exception('tool call arguments must be a mapping') }}{% endif %}
<tool_call>{"name": {{ tc.function.name | tojson }}, "arguments": {{ tc.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class FakeTokenizer:
    n_vocab = 0x110000 + OFFSET
    eog_ids = frozenset({EOS})

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return ([BOS] if add_special else []) + [ord(c) + OFFSET for c in text]

    def decode(self, ids, special: bool = False) -> str:
        return "".join(chr(i - OFFSET) for i in ids if i >= OFFSET)


def default_responder(prompt: str, request) -> str:
    return "Hello from the fake engine."


class FakeHandle(RequestHandle):
    """The engine's RequestHandle; cancel() is recorded by the fake engine and seen by its thread."""

    def __init__(self, engine: "FakeEngine", request):
        super().__init__(request, engine._cancel)
        self.cancel_seen = threading.Event()


class FakeEngine:
    def __init__(self, n_ctx: int = 4096, max_queue: int = 64, token_delay: float = 0.0, ready: bool = True):
        self.model_id = MODEL_ID
        self.n_ctx = n_ctx
        self.max_queue = max_queue
        self.token_delay = token_delay
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.load_error: Exception | None = None
        self.tokenizer = FakeTokenizer()
        self.chat_template = ChatTemplate(TEMPLATE, bos_token="", eos_token="<|im_end|>")
        self.responder = default_responder
        self.queue_full = False                # force QueueFull
        self.submitted: list = []              # Requests, in order
        self.prompts: list[str] = []           # their prompt texts
        self.cancelled: list[str] = []         # ids cancel() was called on
        self.cancel_event = threading.Event()
        self.active: dict[str, FakeHandle] = {}
        self._seen: list[tuple[int, ...]] = []
        self._lock = threading.Lock()
        self.metrics_registry = CollectorRegistry()
        self._requests_total = Counter("strata_lite_requests", "Requests submitted", registry=self.metrics_registry)
        self.started = self.stopped = False

    def start(self):
        self.started = True
        self.ready.set()

    def stop(self, timeout=None):
        self.stopped = True
        for h in list(self.active.values()):
            h.cancel()

    def slots(self) -> list[dict]:
        with self._lock:
            busy = list(self.active)
        return [{"id": i, "state": "busy" if i < len(busy) else "idle",
                 "request_id": busy[i] if i < len(busy) else None} for i in range(2)]

    def _cancel(self, handle: FakeHandle) -> None:
        with self._lock:
            if handle.cancelled:
                return
            handle.cancelled = True
            self.cancelled.append(handle.id)
        handle.cancel_seen.set()
        self.cancel_event.set()

    def submit(self, request) -> FakeHandle:
        if not self.ready.is_set() or self.stopped:
            raise EngineNotReady("the model is still loading" if not self.stopped else "the engine is stopped")
        n_prompt = len(request.prompt_ids)
        if n_prompt >= self.n_ctx:
            raise PromptTooLong(n_prompt, self.n_ctx)
        with self._lock:
            if self.queue_full or len(self.active) >= self.max_queue:
                raise QueueFull(len(self.active), retry_after=3)
            cached = max((_common_prefix(p, request.prompt_ids) for p in self._seen), default=0)
            self._seen.append(request.prompt_ids)
            handle = FakeHandle(self, request)
            self.active[request.id] = handle
            self.submitted.append(request)
            prompt = self.tokenizer.decode(request.prompt_ids)
            self.prompts.append(prompt)
        self._requests_total.inc()
        threading.Thread(target=self._run, args=(handle, prompt, cached), daemon=True).start()
        return handle

    def _run(self, handle: FakeHandle, prompt: str, cached: int):
        req, q = handle.request, handle
        try:
            out = self.responder(prompt, req)
            if isinstance(out, BaseException):
                q._put(ErrorEvent(str(out)))
                return
            finish = "stop"
            for s in req.params.stop:
                at = out.find(s)
                if at != -1:
                    out = out[:at]
            if len(out) > req.max_tokens:
                out, finish = out[:req.max_tokens], "length"
            n = 0
            for c in out:
                if handle.cancel_seen.is_set():
                    finish = "cancelled"
                    break
                if self.token_delay:
                    time.sleep(self.token_delay)
                tid = ord(c) + OFFSET
                lp = top = None
                if req.logprobs is not None:
                    lp = -0.25
                    alts = [(tid, c, lp), (ord("?") + OFFSET, "?", -2.0), (ord("!") + OFFSET, "!", -3.0)]
                    top = alts[:req.logprobs]
                q._put(TokenEvent(tid, c, lp, top))
                n += 1
            q._put(DoneEvent(finish, len(req.prompt_ids), n, cached, out[:n]))
        finally:
            with self._lock:
                self.active.pop(req.id, None)


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
