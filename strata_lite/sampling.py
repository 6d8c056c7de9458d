"""SamplingParams and the sampler: host-side numpy over one row of logits."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class InvalidRequest(ValueError):
    """Bad user input; `param` names the field (becomes HTTP 400 / a CLI message)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy (ties -> lowest id)
    top_k: int = 0               # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        checks = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be between 0 and 100"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequest(f"{name} {why}, got {getattr(self, name)!r}", param=name)


class Sampler:
    """Picks the next token of one sequence; owns its random generator and token counts."""

    def __init__(self, params: SamplingParams, n_vocab: int):
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self.counts = np.zeros(n_vocab, dtype=np.int32) if (params.presence_penalty or params.frequency_penalty) else None

    def __call__(self, logits: np.ndarray) -> int:
        """logits: (n_vocab,) float32 -> token id."""
        p = self.p
        if self.counts is not None:
            logits = logits - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0)
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < len(z):
            idx = np.argpartition(-z, p.top_k - 1)[:p.top_k]
        else:
            idx = np.arange(len(z))
        idx = idx[np.argsort(-z[idx], kind="stable")]        # descending
        probs = np.exp(z[idx] - z[idx[0]])
        probs /= probs.sum()
        keep = len(idx)
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(idx[self.rng.choice(keep, p=probs)])

    def accept(self, token: int) -> None:
        if self.counts is not None:
            self.counts[token] += 1
