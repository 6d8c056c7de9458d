"""Liveness of the engine thread, written by it around every step and read by /health from HTTP threads.

A step that runs longer than max(stuck_min_s, STUCK_FACTOR x the median of recent steps) counts as
stuck: /health turns 503 (engine_stuck) until the step ends. The median comes from the last
WINDOW steps, so one long prompt chunk does not move the bound, and a slow model (seconds per step)
gets a bound to match. The engine thread only assigns floats and ints here; readers take one
consistent-enough snapshot without a lock (each field is read once).
"""
from __future__ import annotations

import statistics
from collections import deque

STUCK_FACTOR = 100.0
WINDOW = 128


class Liveness:
    def __init__(self, clock, stuck_min_s: float = 60.0):
        self.clock, self.stuck_min_s = clock, stuck_min_s
        self.steps = 0                            # steps completed
        self.step_started: float | None = None    # clock() when the running step began; None between steps
        self.last_step_end: float | None = None   # clock() when the last step ended
        self.median_s: float | None = None        # median of the last WINDOW step times
        self._times: deque[float] = deque(maxlen=WINDOW)   # engine thread only

    # engine thread
    def begin(self) -> None:
        self.step_started = self.clock()

    def end(self) -> None:
        now = self.clock()
        self._times.append(now - self.step_started)
        self.median_s = statistics.median(self._times)
        self.steps += 1
        self.last_step_end, self.step_started = now, None

    def abandon(self) -> None:
        """The running step failed (the loop's supervisor handles it): it is not running any more."""
        self.step_started = None

    # any thread
    def bound_s(self) -> float:
        median = self.median_s
        return self.stuck_min_s if median is None else max(self.stuck_min_s, STUCK_FACTOR * median)

    def stuck(self) -> str | None:
        """Why the engine counts as stuck (a step running past the bound), or None."""
        started = self.step_started
        if started is None:
            return None
        running, bound = self.clock() - started, self.bound_s()
        if running <= bound:
            return None
        return (f"an engine step has been running for {running:.0f} s, longer than the {bound:.0f} s bound "
                f"(max of {self.stuck_min_s:g} s and {STUCK_FACTOR:g}x the median step)")

    def snapshot(self) -> dict:
        """Numbers for /health: steps, seconds since the last step ended, of the running step, the
        median step and the stuck bound (None where not known yet)."""
        now, started, last, median = self.clock(), self.step_started, self.last_step_end, self.median_s
        return {"steps": self.steps,
                "last_step_age_s": None if last is None else round(now - last, 3),
                "step_running_s": None if started is None else round(now - started, 3),
                "median_step_s": None if median is None else round(median, 6),
                "stuck_after_s": round(self.bound_s(), 3)}
