"""perf/bench_gpu.py's command line (and perf/step_kernels.py's, and eval_mtp.py's GPU flag): what it refuses
before it needs a GPU, and how it names contexts."""
import os
import subprocess
import sys

import pytest

PERF = os.path.join(os.path.dirname(__file__), "..", "perf")
sys.path.insert(0, PERF)
import bench_gpu  # noqa: E402  (perf/ is not a package)


@pytest.mark.parametrize("contexts", ["100", "512,abc", "4096,", "0"])
def test_contexts_that_are_not_whole_pages_are_refused_before_the_gpu(contexts):
    run = subprocess.run([sys.executable, os.path.join(PERF, "bench_gpu.py"), "--batched", "--contexts", contexts],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "--contexts takes comma-separated multiples of 64" in run.stderr and repr(contexts) in run.stderr


def test_context_labels():
    assert [bench_gpu.ctx_label(c) for c in (512, 4096, 32768, 1536)] == ["512", "4K", "32K", "1536"]


@pytest.mark.parametrize("flag,value", [("--iq3-groups", "on"), ("--build", "iq3_groups")])
def test_unknown_choices_are_refused_before_the_gpu(flag, value):
    """--iq3-groups takes auto / off; the group loop is no build of its own (qmatmul.IQ3_GROUPS), so --build
    names only qmatmul.BUILDS' A/B builds."""
    run = subprocess.run([sys.executable, os.path.join(PERF, "bench_gpu.py"), "--batched", flag, value],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "invalid choice" in run.stderr and repr(value) in run.stderr


def test_step_kernels_step_needs_a_model_before_the_gpu():
    """perf/step_kernels.py step (one sequence's step graph for ncu) names the missing --model in one line."""
    run = subprocess.run([sys.executable, os.path.join(PERF, "step_kernels.py"), "step", "--tokens", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "step needs --model" in run.stderr


def test_eval_mtp_two_token_rule_needs_cuda():
    """perf/eval_mtp.py --two-token-one-row-max picks CUDA kernels: refused with the CPU backend, in one line."""
    run = subprocess.run([sys.executable, os.path.join(PERF, "eval_mtp.py"), "--two-token-one-row-max", "2048"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "needs --backend cuda" in run.stderr
