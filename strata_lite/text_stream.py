"""Turns generated token ids into text pieces that are safe to show: whole UTF-8 characters only,
and nothing that might turn out to be the start of a stop string."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self._bytes = bytearray()
        self.text = ""          # all complete text so far (cut at a stop string once one is found)
        self._emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the newly safe text. Sets `stopped` on a stop string."""
        self._bytes += self.tokenizer.decode_bytes([token_id])
        self.text = _valid_utf8_prefix(bytes(self._bytes))
        hold = 0
        for s in self.stop:
            at = self.text.find(s, max(0, self._emitted - len(s)))
            if at != -1:
                self.text, self.stopped = self.text[:at], True
                return self._emit(len(self.text))
            hold = max(hold, _partial_suffix(self.text, s))
        return self._emit(len(self.text) - hold)

    def finish(self) -> str:
        """Flush the held-back tail at the end of generation (invalid trailing bytes are replaced)."""
        if not self.stopped:
            self.text = bytes(self._bytes).decode("utf-8", errors="replace")
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        piece = self.text[self._emitted:upto] if upto > self._emitted else ""
        self._emitted = max(self._emitted, upto)
        return piece


def _valid_utf8_prefix(data: bytes) -> str:
    """Decode, leaving out an incomplete multi-byte character at the very end."""
    for cut in range(0, min(4, len(data)) + 1):
        try:
            return data[:len(data) - cut].decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < len(data) - 4:       # invalid in the middle: not a truncation problem
                return data.decode("utf-8", errors="replace")
    return data.decode("utf-8", errors="replace")


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
