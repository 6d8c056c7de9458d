import pytest


@pytest.fixture(scope="module")
def cp():
    """The cupy module (imported only by GPU tests, so CPU-only machines never need it)."""
    import cupy
    return cupy
