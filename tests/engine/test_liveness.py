"""Liveness with a fake clock: the stuck-step bound is max(stuck_min_s, 100x the median step), a running
step past it is stuck, the numbers /health shows."""
from strata_lite.liveness import STUCK_FACTOR, Liveness


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_bound_follows_the_median_step_and_a_running_step_past_it_is_stuck():
    clock = Clock()
    live = Liveness(clock, stuck_min_s=60.0)
    assert live.bound_s() == 60.0 and live.stuck() is None
    snap = live.snapshot()
    assert snap["steps"] == 0 and snap["last_step_age_s"] is None and snap["median_step_s"] is None
    for took in (1.0, 2.0, 0.5, 3.0, 2.0):    # median 2 s: bound 200 s
        live.begin()
        clock.t += took
        live.end()
    assert live.median_s == 2.0 and live.bound_s() == STUCK_FACTOR * 2.0
    live.begin()
    clock.t += 200.0
    assert live.stuck() is None                # at the bound: not yet
    assert live.snapshot()["step_running_s"] == 200.0
    clock.t += 1.0
    assert "running for 201 s" in live.stuck() and "200 s bound" in live.stuck()
    live.end()                                 # the step ended after all
    assert live.stuck() is None and live.snapshot()["step_running_s"] is None and live.steps == 6


def test_fast_steps_keep_the_floor_and_an_abandoned_step_is_not_running():
    clock = Clock()
    live = Liveness(clock, stuck_min_s=60.0)
    live.begin()
    clock.t += 0.001
    live.end()
    assert live.bound_s() == 60.0
    live.begin()
    clock.t += 61.0
    assert live.stuck() is not None
    live.abandon()                             # the supervisor took over the failed step
    assert live.stuck() is None and live.steps == 1
    clock.t += 5.0
    assert live.snapshot()["last_step_age_s"] == 66.0
