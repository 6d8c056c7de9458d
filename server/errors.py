"""OpenAI-shaped errors: every failure the server answers is `{"error": {"message", "type", "param", "code"}}`.

`APIError` is raised anywhere in the server; `from_engine_exception` maps what the engine raises
(InvalidRequest and its PromptTooLong, QueueFull, EngineNotReady, a chat template error) to one.
"""
from __future__ import annotations

from typing import Any

from strata_lite.sampling import InvalidRequest

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "unavailable_error"


class APIError(Exception):
    """An HTTP error answered as the OpenAI nested error body. `extra` adds keys to the error object
    (e.g. n_prompt_tokens / n_ctx); `headers` are added to the response (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | int | None = None, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def from_engine_exception(exc: BaseException) -> APIError | None:
    """The APIError for an exception the engine raises on purpose, or None for anything else (a bug: 500).

    Matched by shape rather than by importing strata_lite.engine: PromptTooLong is an InvalidRequest with
    n_prompt_tokens and n_ctx, QueueFull a RuntimeError with retry_after."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        n_prompt, n_ctx = getattr(exc, "n_prompt_tokens", None), getattr(exc, "n_ctx", None)
        if n_prompt is not None and n_ctx is not None:
            return APIError(400, str(exc), INVALID_REQUEST, exc.param, "context_length_exceeded",
                            extra={"n_prompt_tokens": int(n_prompt), "n_ctx": int(n_ctx)})
        return APIError(400, str(exc), INVALID_REQUEST, exc.param)
    if type(exc).__name__ == "QueueFull" or (isinstance(exc, RuntimeError) and hasattr(exc, "retry_after")):
        retry = max(1, int(getattr(exc, "retry_after", 1) or 1))
        return APIError(503, str(exc) or "the server is busy: the request queue is full", UNAVAILABLE,
                        None, "queue_full", headers={"Retry-After": str(retry)})
    if type(exc).__name__ == "EngineNotReady":
        return APIError(503, str(exc) or "the engine is not ready", UNAVAILABLE, None, "not_ready",
                        headers={"Retry-After": "5"})
    if type(exc).__name__ == "ChatTemplateError":
        return APIError(400, str(exc), INVALID_REQUEST, "messages", "chat_template_error")
    return None
