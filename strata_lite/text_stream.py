"""Turns generated token ids into text pieces that are safe to show: whole UTF-8 characters only,
and nothing that might turn out to be the start of a stop string.

Work per token is O(new text x number of stop strings), whatever the length of the output: each token's
bytes go through an incremental UTF-8 decoder (an incomplete character at the end is held; invalid
bytes become U+FFFD), and each stop string has a KMP automaton whose state is the longest prefix of the
stop string that ends the text so far. That state is also how much text is held back: text that may be
the start of a stop string is not emitted until it is decided. The text is cut before the first stop
string to be completed (of several completed by the same character, the longest).
"""
from __future__ import annotations

import codecs


class _StopMatcher:
    """Knuth-Morris-Pratt over a stream: `state` = length of the longest prefix of `stop` that is a
    suffix of the text fed so far."""

    def __init__(self, stop: str):
        self.stop, self.state = stop, 0
        self.fail = [0] * len(stop)             # fail[k]: longest proper border of stop[:k + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, text: str) -> int:
        """Advance over text; the index in text just after the stop string's end, or -1 if not found."""
        stop, fail, k = self.stop, self.fail, self.state
        for i, c in enumerate(text):
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
                if k == len(stop):
                    self.state = k
                    return i + 1
        self.state = k
        return -1


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._matchers = [_StopMatcher(s) for s in self.stop]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False   # a token with bytes was seen (SentencePiece strips the first one's space)
        self._emitted: list[str] = []           # text given out so far
        self._held = ""                         # decoded text not given out yet (a possible stop start)
        self.stopped = False

    @property
    def text(self) -> str:
        """All decoded text so far (cut at a stop string once one is found)."""
        return "".join(self._emitted) + self._held

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the newly safe text. Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        data = self.tokenizer.decode_bytes([token_id], strip_space_prefix=not self._started)
        self._started = self._started or bool(data)
        new = self._decoder.decode(data)
        base, held = len(self._held), self._held + new
        ends = [(m.feed(new), m.stop) for m in self._matchers]
        found = [(end, s) for end, s in ends if end >= 0]
        if found:
            end, s = min(found, key=lambda f: (f[0], -len(f[1])))    # first to end; the longest of those
            self._held, self.stopped = "", True
            return self._emit(held[:base + end - len(s)])
        hold = max((m.state for m in self._matchers), default=0)
        cut = len(held) - hold
        self._held = held[cut:]
        return self._emit(held[:cut])

    def finish(self) -> str:
        """Flush the held-back tail at the end of generation (invalid trailing bytes are replaced)."""
        if self.stopped:
            return ""
        tail, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return self._emit(tail)

    def _emit(self, piece: str) -> str:
        if piece:
            self._emitted.append(piece)
        return piece
