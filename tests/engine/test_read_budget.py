"""The scheduler's time budget on prompt reads (decode_share) with step costs shaped like a CPU's (per prompt
token) and like a GPU's (a mixed step is an eager forward: a fixed ~10 decode steps whatever its tokens):
the decoder keeps its share of decode-only speed, the reader is never starved, and on the CPU no step
exceeds max_step_ratio decode steps."""
import random

import pytest

from fake_engine import make_scheduler, step
from strata_lite.sequence import Request, SeqStatus


def toks(rng, n):
    return [rng.randrange(0, 1000) for _ in range(n)]


def read_beside_a_decoder(t_decode, fixed, per_token, n_prompt, max_steps=5000):
    """Seconds of every step while a prompt of n_prompt tokens is read beside one decoding sequence
    (step cost: t_decode, plus fixed + per_token x tokens when it reads)."""
    rng = random.Random(3)
    sched, runner = make_scheduler(n_pages=300, page_size=16, n_slots=2, step_tokens=256, decode_share=0.8,
                                   max_step_ratio=3.0)
    sched.add(Request("decoder", toks(rng, 20), max_tokens=100_000))
    for _ in range(5):
        plan, _ = step(sched, runner, check=False)
        sched.observe_step(plan, t_decode + (fixed + per_token * plan.n_read if plan.n_read else 0.0))
    reader = sched.add(Request("reader", toks(rng, n_prompt), max_tokens=2))
    times = []
    while reader.status is not SeqStatus.DECODING:
        assert len(times) < max_steps, f"the read stalled: {reader.n_computed} of {n_prompt} tokens"
        plan, _ = step(sched, runner, check=False)
        assert plan.n_decode == 1
        times.append(t_decode + (fixed + per_token * plan.n_read if plan.n_read else 0.0))
        sched.observe_step(plan, times[-1])
    return times


@pytest.mark.parametrize("fixed", [0.0, 0.5e-3])
def test_cpu_like_costs_keep_the_share_and_the_step_bound(fixed):
    t_decode = 15e-3
    times = read_beside_a_decoder(t_decode, fixed, 2e-3, n_prompt=300)
    share = len(times) * t_decode / sum(times)       # the decoder's speed against decode-only steps
    assert share >= 0.78, share
    assert max(times) <= 3.0 * t_decode * 1.01, max(times)
    assert len(times) < 300 * 2e-3 / (t_decode * 0.25) * 1.3 + 20     # the read goes as fast as the share lets it


def test_gpu_like_fixed_cost_reads_in_chunks_instead_of_starving():
    """Priced per token, a 10 ms mixed step beside 1 ms decode steps made one token cost more than any step
    may add: the reader waited for the decoder to finish. Now it reads chunks of up to step_tokens as the
    credit pays for them: the decoder keeps ~80 %, the read of 600 tokens takes a few hundred steps."""
    t_decode, fixed, per_token = 1e-3, 10e-3, 0.03e-3
    times = read_beside_a_decoder(t_decode, fixed, per_token, n_prompt=600)
    share = len(times) * t_decode / sum(times)
    assert share >= 0.75, share
    reads = [t for t in times if t > t_decode]
    assert len(reads) <= 2 + 3 + 1        # two probes, then chunks of up to 256 tokens
    assert len(times) < 500, len(times)
