"""Tool calls in generated text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
Hermes/Qwen format) become OpenAI tool_calls (id, type "function", function.name, function.arguments as a
JSON string).

`ToolCallParser` works on a stream of text pieces: text outside the blocks is passed through (text that
might be the start of `<tool_call>` is held back until it is decided), text inside a block is held until
the block closes and then comes out as one tool call. `parse_tool_calls` runs the same parser over a
whole completion, so streamed and non-streamed answers agree. A block whose body is not a JSON object
with a string "name" is given back as ordinary text. Whitespace around tool calls is dropped, as is
leading and trailing whitespace of the content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str      # a JSON string, as OpenAI sends it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call_body(body: str) -> ToolCall | None:
    """The tool call in one block's body, or None if it is not `{"name": str, "arguments": ...}`."""
    try:
        obj = json.loads(body.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(new_call_id(), obj["name"], arguments)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallParser:
    """feed(text) / finish() -> a list of ("content", str) and ("tool_call", ToolCall) items, in order."""

    def __init__(self):
        self._buf = ""            # undecided text (outside a block: a possible start of OPEN; inside: the body)
        self._in_call = False
        self._ws = ""             # whitespace held back: dropped if a tool call or the end follows
        self._started = False     # some content was emitted
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self._buf += text
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at == -1:
                    keep = _partial_suffix(self._buf, OPEN)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(self._buf[:at], out)
                self._buf, self._in_call = self._buf[at + len(OPEN):], True
            else:
                at = self._buf.find(CLOSE)
                if at == -1:
                    return out
                body, self._buf, self._in_call = self._buf[:at], self._buf[at + len(CLOSE):], False
                self._block(body, OPEN + body + CLOSE, out)

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if self._in_call:                 # cut off (max_tokens, a stop string): keep it if it parses
            self._block(self._buf, OPEN + self._buf, out)
        else:
            self._content(self._buf, out)
        self._buf, self._in_call, self._ws = "", False, ""
        return out

    def _block(self, body: str, raw: str, out: list) -> None:
        call = parse_call_body(body)
        if call is None:
            self._content(raw, out)
        else:
            self._ws = ""
            self.calls.append(call)
            out.append(("tool_call", call))

    def _content(self, text: str, out: list) -> None:
        text = self._ws + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self._started = True
            out.append(("content", body))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole completion; content is None when it is empty and there are calls."""
    parser = ToolCallParser()
    items = parser.feed(text) + parser.finish()
    content = "".join(x for kind, x in items if kind == "content")
    calls = [x for kind, x in items if kind == "tool_call"]
    return (content if content or not calls else None), calls
