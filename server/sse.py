"""Server-sent events: `data: {json}\\n\\n` lines ending with `data: [DONE]`, and the WSGI body that
produces them and tells the engine when the client is gone."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("strata_lite.server")

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream; charset=utf-8"


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class SSEBody:
    """A WSGI response body over an iterator of JSON objects: each becomes one `data:` event, then
    `data: [DONE]`. The WSGI server calls close() when the body ends, when a write fails because the
    client disconnected (waitress raises ClientDisconnected on the write and closes the app iterator),
    or when it is shutting down; close() closes the iterator (GeneratorExit inside it) and then calls
    `on_close` (which cancels the engine requests), even if iteration never started."""

    def __init__(self, events: Iterator[Any], on_close: Callable[[], None] | None = None):
        self._events = events
        self._on_close = on_close
        self._done = False
        self._closed = False

    def __iter__(self) -> "SSEBody":
        return self

    def __next__(self) -> bytes:
        if self._done or self._closed:
            raise StopIteration
        try:
            obj = next(self._events)
        except StopIteration:
            self._done = True
            return DONE
        except Exception:            # headers are sent: report it in the stream, then end it
            log.exception("error while streaming a response")
            self._done = True
            return event({"error": {"message": "internal error (the server log has the details)",
                                    "type": "server_error", "param": None, "code": None}}) + DONE
        return event(obj)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._events, "close", None)
            if close is not None:
                close()
        finally:
            if self._on_close is not None:
                self._on_close()
