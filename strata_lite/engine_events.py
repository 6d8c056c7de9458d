"""The client side of the engine: RequestHandle, the events it yields (TokenEvent per generated token, then
one DoneEvent or ErrorEvent) and the errors submit() raises.

Invariant: the concatenated TokenEvent.text of a request equals its DoneEvent.text. An
end-of-generation token gets a TokenEvent too (text "", it counts in completion_tokens).
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from .sampling import InvalidRequest


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str                                            # newly safe text (may be "")
    logprob: float | None                                # of token_id; None unless logprobs were asked
    top_logprobs: list[tuple[int, str, float]] | None    # (id, token text, logprob), best first


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: str        # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int        # prompt tokens whose KV was reused + restored at admission
    text: str                 # the full completion text


@dataclass(frozen=True)
class ErrorEvent:
    message: str


Event = TokenEvent | DoneEvent | ErrorEvent


class PromptTooLong(InvalidRequest):
    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(f"the prompt has {n_prompt_tokens} tokens; the context holds {n_ctx} (prompt + "
                         f"generated), so at most {n_ctx - 1} prompt tokens fit", param="messages")
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


class QueueFull(RuntimeError):
    def __init__(self, n_waiting: int, retry_after: int):
        super().__init__(f"{n_waiting} requests are already waiting; retry in {retry_after} s")
        self.retry_after = retry_after


class EngineNotReady(RuntimeError):
    """submit() before the model is loaded, after a failed load, or after stop()."""


class RequestHandle:
    """A submitted request's stream of events (filled by the engine thread). `alive()` says whether the
    engine thread is still running: a handle whose engine stopped without giving it a last event ends
    with an ErrorEvent instead of waiting forever."""

    POLL_S = 1.0          # how often a waiting events() looks at alive()

    def __init__(self, request, on_cancel: Callable[["RequestHandle"], None],
                 alive: Callable[[], bool] | None = None):
        self.id, self.request, self._on_cancel, self._alive = request.id, request, on_cancel, alive
        self._events: queue.Queue = queue.Queue()
        self.cancelled = False

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocks for each event; ends after DoneEvent / ErrorEvent. Raises TimeoutError when no event
        comes within `timeout` s (nothing is lost: call events() again to go on)."""
        while True:
            ev = self._next(timeout)
            yield ev
            if isinstance(ev, (DoneEvent, ErrorEvent)):
                return

    def _next(self, timeout: float | None) -> Event:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no event for {self.id} within {timeout} s")
            wait = left if self._alive is None else min(self.POLL_S, left if left is not None else self.POLL_S)
            try:
                return self._events.get(timeout=wait)
            except queue.Empty:
                pass
            if self._alive is not None and not self._alive():
                try:                          # the engine's last events may have come just before it ended
                    return self._events.get_nowait()
                except queue.Empty:
                    return ErrorEvent("the engine stopped")

    def cancel(self) -> None:
        """Thread-safe; the engine ends the sequence at its next step boundary (DoneEvent "cancelled")."""
        self._on_cancel(self)

    def _put(self, ev: Event) -> None:
        self._events.put(ev)
