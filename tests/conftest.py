import os
import shutil

import pytest


def _gpu_visible() -> bool:
    """A CUDA GPU that CuPy can use (CI machines have neither)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAVE_GPU = _gpu_visible()
if not HAVE_GPU:
    # Numba CUDA kernels run in numba-cuda's simulator when no GPU is visible; this must be set before
    # numba.cuda is first imported (nothing in the CPU code imports it).
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
HAVE_NVCC = shutil.which("nvcc") is not None


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped (and reported as skipped) where CuPy sees no GPU."""
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CuPy found none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path():
    """The default model, assembled from its pip packages (the `model` extra) on first use."""
    from strata_lite.loader.known_models import resolve_model
    return resolve_model(None)


# The backend the default-model tests (goldens, engine, server) run on: the CPU unless
# STRATA_LITE_TEST_BACKEND says otherwise (perf/gpu_run.sh runs them again with "cuda" on the GPU machine).
TEST_BACKEND = os.environ.get("STRATA_LITE_TEST_BACKEND", "cpu")


@pytest.fixture(scope="session")
def test_backend():
    return TEST_BACKEND


@pytest.fixture(scope="session")
def default_llm(default_model_path):
    from strata_lite import LLM
    return LLM(default_model_path, backend=TEST_BACKEND, n_ctx=2048)
