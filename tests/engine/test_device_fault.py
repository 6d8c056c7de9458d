"""A device fault (a sticky CUDA error on the GPU) ends the engine: the requests in flight fail, the
engine thread stops with `fatal_error` set, /health answers 500 and `serve` exits 1. The fault is made
by a backend whose forward raises an error that its `is_fault` recognises, on the CPU."""
import json
import threading
import urllib.error
import urllib.request

import pytest

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.engine_events import ErrorEvent
from strata_lite.sequence import Request
from strata_lite.sampling import SamplingParams
from tiny_model import write_tiny_model


class FakeCudaError(RuntimeError):
    """Stands for cupy's CUDARuntimeError (an illegal address, sticky for the context)."""


@pytest.fixture
def faulting_engine(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", arch="qwen2", n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2)
    eng = Engine(EngineConfig(model=str(path), backend="cpu", n_ctx=64, parallel=2, page_size=16,
                              host_kv_gib=0.01))
    eng.start()
    assert eng.wait_ready(60)
    runner = eng._runner
    runner.backend.is_fault = lambda e: isinstance(e, FakeCudaError)

    def forward(batch):
        raise FakeCudaError("an illegal memory access was encountered")
    runner.forward = forward
    yield eng
    eng.stop()


def _events(handle, timeout=30):
    return list(handle.events(timeout=timeout))


def test_device_fault_stops_the_engine_and_fails_the_request(faulting_engine):
    eng = faulting_engine
    h = eng.submit(Request("r1", (1, 2, 3), SamplingParams(), max_tokens=4))
    last = _events(h)[-1]
    assert isinstance(last, ErrorEvent)
    assert eng.stopped.wait(30)
    assert "illegal memory access" in str(eng.fatal_error)


def test_health_reports_a_stopped_engine(faulting_engine):
    from strata_lite.server.app import build_app
    from strata_lite.server.serve import HTTPServer
    eng = faulting_engine
    app, _ = build_app(eng, None)
    http = HTTPServer(app, "127.0.0.1", 0, threads=4)
    t = threading.Thread(target=http.run, kwargs={"poll_s": 0.1}, daemon=True)
    t.start()
    try:
        h = eng.submit(Request("r2", (1, 2, 3), SamplingParams(), max_tokens=4))
        _events(h)
        assert eng.stopped.wait(30)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(http.url + "/health", timeout=30)
        assert info.value.code == 500
        assert json.loads(info.value.read())["error"]["code"] == "engine_failed"
    finally:
        http.stop()
        t.join(10)
        http.close()
