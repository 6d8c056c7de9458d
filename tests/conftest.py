import pytest


@pytest.fixture(scope="session")
def default_model_path():
    """The default model, assembled from its pip packages (the `model` extra) on first use."""
    from strata_lite.loader.known_models import resolve_model
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_llm(default_model_path):
    from strata_lite import LLM
    return LLM(default_model_path, backend="cpu", n_ctx=2048)
