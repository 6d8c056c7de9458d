"""What a captured decode / verify step computes beside its logits, brought to the host in one copy.

A step graph (kernels/cuda/graphs.py, captured by runner.capture_step_graphs) ends with the greedy argmax of
every logit row and, with an MTP drafter, the block's head over every row and its argmax
(Backend.step_results / draft_results): one device (n, 3) float32 array. The engine's sampling takes the
greedy ids from it when every row is plain greedy (no extra launch), and the drafter takes each sequence's
first draft token from it (no head launched after the step, no second wait): both read the same host copy,
made once, when the first of them asks.
"""
from __future__ import annotations

import numpy as np

from .kernels.sample_rows import Sampled, SampleRows


class StepResults:
    """logits: the step's device logits view (the object the runner handed out); dev: its (n, 3) float32
    results (column 0 greedy id bits, 1 draft column bits, 2 draft probability); graphs: the StepGraphs that
    replayed the step (its output views hold the step's values until its next replay: current())."""

    def __init__(self, backend, logits, dev, graphs):
        self.backend, self.logits, self.dev = backend, logits, dev
        self._graphs, self._replay = graphs, graphs.replays
        self._host = None

    def current(self) -> bool:
        """Whether the step's device outputs (logits, hidden states, block outputs) still hold its values: no
        replay of its graphs since."""
        return self._graphs.replays == self._replay

    def host(self) -> np.ndarray:
        """(n, 3) float32 host copy (made on the first call: it waits for the step)."""
        if self._host is None:
            self._host = np.ascontiguousarray(self.backend.to_host(self.dev))
        return self._host

    def greedy_ids(self) -> np.ndarray:
        """(n,) int64: each row's greedy token (the lowest id of its largest logit)."""
        return self.host()[:, 0].view(np.int32).astype(np.int64)

    def drafts(self) -> tuple[np.ndarray, np.ndarray]:
        """(columns (n,) int64, probabilities (n,) float64): each row's draft head argmax column (a draft
        vocabulary's column: MtpHead.token_ids maps it) and its softmax probability."""
        h = self.host()
        return h[:, 1].view(np.int32).astype(np.int64), h[:, 2].astype(np.float64)

    def sample(self, logits, rows: SampleRows) -> Sampled | None:
        """The Sampled for these logits when the step's greedy ids answer it (the same logits object, every
        row plain greedy: SampleRows.plain_greedy); None otherwise."""
        if logits is not self.logits or len(rows) != logits.shape[0] or not rows.plain_greedy():
            return None
        out = Sampled.empty(len(rows), 0)
        out.ids[:] = self.greedy_ids()
        return out
