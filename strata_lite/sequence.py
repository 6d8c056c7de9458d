"""Request (what a client asked, immutable) -> Sequence (its state in the engine, owned by the scheduler)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .sampling import InvalidRequest, SamplingParams


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    logprobs: int | None = None          # top-n logprobs wanted per token (the engine loop's business)
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if not self.prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be >= 1", param="max_tokens")


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # queued (new, or parked for memory: its KV is in the trie)
    READING = "reading"      # computing the KV of its tokens, a budget of them per step
    DECODING = "decoding"    # one token per step
    FINISHED = "finished"


@dataclass
class AdmissionRecord:
    """One admission (a new turn, or a parked sequence coming back): where its prompt's KV came from."""
    seq_id: str
    n_prompt: int            # tokens the sequence holds at admission (prompt, plus generated if resumed)
    reused: int              # KV already on the device (shared pages, or copied within the device)
    restored: int            # KV copied host -> device
    read: int                # tokens computed by the model (at least one: the last, for its logits)
    needless_read: int       # read although the trie held their KV (device or host) before placement
    evicted_for_memory: int  # cached at arrival but dropped (host pool full) before admission
    resumed: bool = False
    from_disk: int = 0       # KV read from the disk tier (kv_disk.py)
    slot: int = -1
    t_arrival: float = 0.0
    t_admitted: float = 0.0
    t_read_done: float | None = None     # when the last prompt token was computed (first token sampled)

    @property
    def wait_s(self) -> float:
        return self.t_admitted - self.t_arrival

    @property
    def read_s(self) -> float | None:
        return None if self.t_read_done is None else self.t_read_done - self.t_admitted

    def log_line(self) -> str:
        disk = f" + {self.from_disk} from disk" if self.from_disk else ""
        line = (f"{self.seq_id}: prompt {self.n_prompt} tokens = {self.reused} reused + {self.restored} restored"
                f"{disk} + {self.read} read")
        if self.needless_read or self.evicted_for_memory:
            line += f" ({self.needless_read} needless, {self.evicted_for_memory} evicted for memory)"
        return line + (" [resumed]" if self.resumed else "")


class Sequence:
    """Mutable state of one request. tokens = prompt + generated; the KV of tokens[:n_computed] is in
    `pages` (device page ids in position order); pages[:node.end // page_size] belong to the prefix trie
    (shared, read-only), the rest to this sequence. `node` is the trie node the sequence holds locked."""

    def __init__(self, request: Request):
        self.request = request
        self.id = request.id
        self.tokens: list[int] = list(request.prompt_ids)
        self.n_prompt = len(self.tokens)
        self.status = SeqStatus.WAITING
        self.n_computed = 0
        self.pages: list[int] = []
        self.node = None
        self.n_shared_pages = 0          # node.end // page_size: pages[:this] never change while `pages` is the
                                         # same list object (kv_tiers.py replaces the list when it moves them)
        self._page_row = None            # (pages list, int32 buffer, entries converted, n_shared_pages then)
        self.slot = -1
        self.finish_reason: str | None = None
        self.records: list[AdmissionRecord] = []
        self.cached_at_arrival = 0
        self.pending_finish: str | None = None
        self.spec: Any = None            # drafting state (spec/controller.SeqSpec); None: never drafts

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def n_pending(self) -> int:
        """Tokens whose KV is still to compute (1 while decoding: the last sampled token)."""
        return len(self.tokens) - self.n_computed

    def page_row(self) -> np.ndarray:
        """`pages` as an int32 array (a view of a buffer this sequence reuses: valid until the next call).
        Entries below n_shared_pages as it was at the last call, and converted then, cannot have changed
        since (n_shared_pages only grows while the list object stays), so only the rest is converted again:
        a step's page table does not cost a conversion of every page of a long context (~15 µs per 800
        pages) per sequence and step."""
        pages, cache = self.pages, self._page_row
        n = len(pages)
        if cache is not None and cache[0] is pages:
            _, buf, done, shared_then = cache
            start = min(done, shared_then, n)
            if n > len(buf):
                buf = np.concatenate([buf[:start], np.empty(2 * n - start, np.int32)])
        else:
            start, buf = 0, np.empty(max(16, 2 * n), np.int32)
        buf[start:n] = pages[start:]
        self._page_row = (pages, buf, n, self.n_shared_pages)
        return buf[:n]

    @property
    def is_running(self) -> bool:
        return self.status in (SeqStatus.READING, SeqStatus.DECODING)

    def __repr__(self) -> str:
        return f"Sequence({self.id!r}, {self.status.name}, {self.n_computed}/{len(self.tokens)} computed)"
