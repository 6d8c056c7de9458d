"""schemathesis against a live server (waitress in a thread, the fake engine), driven by GET /openapi.json.

Every operation gets valid and invalid bodies generated from the document (hypothesis, fixed seed,
bounded examples so the run stays near a minute): no 500, every error in OpenAI's shape, responses as
the document says, schema-invalid input refused with a 4xx; afterwards the server still answers and no
request is left running. The server runs with an API key, so every call also passes the auth middleware
and schemathesis' auth checks send some without it.
"""
from __future__ import annotations

import json
import threading

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import CheckContext  # noqa: E402
from schemathesis.core.failures import Failure  # noqa: E402

from strata_lite.config import EngineConfig  # noqa: E402
from strata_lite.engine import Engine  # noqa: E402
from strata_server_fake_engine import FakeEngine  # noqa: E402
from tiny_model import write_tiny_model  # noqa: E402

from live_server import serving  # noqa: E402

KEY = "schemathesis-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_EXAMPLES = 40


def _tiny_engine(tmp_path):
    """The real Engine on a tiny model, small context (every generation stays short)."""
    path = write_tiny_model(tmp_path / "tiny.gguf")
    engine = Engine(EngineConfig(model=str(path), backend="cpu", n_ctx=96, parallel=2, max_queue=4,
                                 page_size=16, host_kv_gib=0.002))
    engine.start()
    assert engine.wait_ready(300)
    return engine


@pytest.fixture(scope="module", params=["fake", "tiny"])
def live(request, tmp_path_factory):
    """The fake engine (fast: most examples), then the real Engine on a tiny model (a few examples)."""
    engine = FakeEngine(n_ctx=4096, max_queue=64) if request.param == "fake" \
        else _tiny_engine(tmp_path_factory.mktemp("st"))
    with serving(engine, api_key=KEY) as http:
        yield engine, f"http://127.0.0.1:{http.port}", MAX_EXAMPLES if request.param == "fake" else 8
    engine.stop()


@pytest.fixture(scope="module")
def api_schema(live):
    _, base, examples = live
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=AUTH)
    schema.config.update(base_url=base)
    schema.config.generation.update(max_examples=examples)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


class ErrorShape(Failure):
    def __init__(self, message: str):
        super().__init__(operation="", title="Error not in OpenAI's shape", message=message, code="error_shape")


@schemathesis.check
def openai_error_shape(ctx: CheckContext, response, case) -> bool | None:
    """Every 4xx/5xx body is {"error": {"message": str, "type": str, "param": str|null, "code": ...}}."""
    if response.status_code < 400:
        return None
    try:
        err = json.loads(response.content)["error"]
        ok = (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
              and (err["param"] is None or isinstance(err["param"], str)) and "code" in err)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ErrorShape(f"{response.status_code}: {response.content[:300]!r}")
    if response.status_code == 503 and not response.headers.get("Retry-After"):
        raise ErrorShape("503 without Retry-After")
    return True


@schema.parametrize()
@settings(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_api(case):
    response = case.call(headers=AUTH, timeout=60)
    case.validate_response(response, additional_checks=[openai_error_shape],
                           excluded_checks=[schemathesis.checks.positive_data_acceptance],
                           headers=AUTH)


def test_still_serving_afterwards(live):
    engine, base, _ = live
    r = requests.post(f"{base}/v1/chat/completions", headers=AUTH, timeout=300,
                      json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert requests.get(f"{base}/health", timeout=30).json()["status"] == "ok"
    idle = threading.Event()
    for _ in range(3000):                     # polls /slots, 0.1 s apart, up to 300 s
        slots = requests.get(f"{base}/slots", headers=AUTH, timeout=30).json()
        if all(s["state"] == "idle" for s in slots):
            break
        idle.wait(0.1)
    assert all(s["state"] == "idle" for s in slots), f"requests left running: {slots}"


def test_document_lists_every_route(live):
    _, base, _ = live
    doc = requests.get(f"{base}/openapi.json", headers=AUTH, timeout=30).json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}", "/health",
            "/metrics", "/slots", "/openapi.json"} <= set(doc["paths"])
