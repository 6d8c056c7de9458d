"""SamplingParams (validated user input) and the per-row parameters they give the backend's sampler
(kernels/sample_rows.py has the semantics; the backend samples all rows of a step in one call)."""
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
    ignore_eos: bool = False     # go on past end-of-generation tokens, to max_tokens (benchmarks at fixed lengths)

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


def needs_counts(params: SamplingParams) -> bool:
    """Whether the request needs a row of the token-count table (presence / frequency penalties)."""
    return bool(params.presence_penalty or params.frequency_penalty)


def draw_uniform(params: SamplingParams, rng: np.random.Generator) -> float:
    """The uniform of a sampled token: drawn from the request's generator only when it samples
    (temperature > 0), one per generated token, so a seed gives the same tokens however they are batched."""
    return rng.random() if params.temperature > 0 else 0.0


def sample_row(params: SamplingParams, uniform: float, count_row: int = -1, n_logprobs: int = -1) -> dict:
    """One SampleRows row (SampleRows.from_rows) for a token, with its uniform (draw_uniform)."""
    return dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                presence=params.presence_penalty, frequency=params.frequency_penalty, uniform=uniform,
                count_rows=count_row if needs_counts(params) else -1, n_logprobs=n_logprobs)
