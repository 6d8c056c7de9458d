"""`strata-lite fleet`: two CPU replicas of a tiny model behind the real sglang-router, on loopback. Chat
and streaming through the router, /v1/models through it, a replica killed mid-run is restarted while
the router routes around it, and Ctrl+C (SIGTERM) stops everything."""
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from live_server import free_port_run, wait_until
from tiny_model import write_tiny_model

pytest.importorskip("sglang_router", reason="sglang-router has no wheel for this platform")
openai = pytest.importorskip("openai")


def _get(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("fleet") / "tiny-fleet.gguf", arch="qwen2", n_embd=64,
                             n_ff=128, n_heads=4, n_kv_heads=2)
    port = free_port_run(3)
    proc = subprocess.Popen([sys.executable, "-m", "strata_lite.cli", "fleet", "-n", "2", "--threads-per-replica", "1",
                             "--policy", "round_robin", "--port", str(port), "--health-interval-s", "1",
                             "--", "--model", str(model), "--parallel", "2", "--ctx-size", "256",
                             "--host-kv-gib", "0.01", "--max-queue", "8"])
    router = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get(router + "/v1/models")[0] == 200, 300, "the router")
        yield proc, router, [f"http://127.0.0.1:{port + 1 + i}" for i in range(2)]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def _client(router):
    return openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_stream_and_models_through_the_router(fleet):
    _, router, replicas = fleet
    client = _client(router)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-fleet"]
    r = client.chat.completions.create(model="tiny-fleet", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny-fleet", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    for url in replicas:                     # what the router read when it registered them
        status, info = _get(url + "/server_info")
        assert status == 200 and info["served_model_name"] == "tiny-fleet" and info["context_length"] == 256
        assert info["max_running_requests"] == 2 and _get(url + "/model_info")[1]["model_path"] == "tiny-fleet"
        assert set(_get(url + "/get_load")[1]) >= {"load", "num_reqs", "num_waiting_reqs"}


def _generated(url) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
        text = r.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("strata_generated_tokens_total")))


def test_a_killed_replica_is_restarted_and_routed_around(fleet):
    proc, router, replicas = fleet
    client = _client(router)
    pid = _get(replicas[0] + "/server_info")[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    for i in range(6):                       # none was in flight on it: none may fail
        r = client.chat.completions.create(model="tiny-fleet", messages=[{"role": "user", "content": f"turn {i}"}],
                                           max_tokens=4, temperature=0)
        assert r.choices[0].message.content is not None
    wait_until(lambda: _get(replicas[0] + "/server_info")[1]["pid"] != pid, 180, "the restarted replica")
    before = _generated(replicas[0])

    def served_again():
        client.chat.completions.create(model="tiny-fleet", messages=[{"role": "user", "content": "again"}],
                                       max_tokens=2, temperature=0)
        return _generated(replicas[0]) > before
    wait_until(served_again, 60, "the router to route to the restarted replica")
    assert proc.poll() is None


def test_sigterm_stops_router_and_replicas(fleet):
    proc, router, replicas = fleet
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    for url in [router] + replicas:
        with pytest.raises(OSError):
            _get(url + "/health", timeout=1)


def test_api_key_is_checked_by_the_router(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-keyed.gguf", arch="qwen2", n_embd=64, n_ff=128, n_heads=4,
                             n_kv_heads=2)
    port = free_port_run(3)
    proc = subprocess.Popen([sys.executable, "-m", "strata_lite.cli", "fleet", "-n", "2", "--threads-per-replica", "1",
                             "--port", str(port), "--api-key", "sekrit", "--", "--model", str(model),
                             "--ctx-size", "256", "--host-kv-gib", "0.01"])
    router = f"http://127.0.0.1:{port}"
    try:
        keyed = openai.OpenAI(base_url=router + "/v1", api_key="sekrit", max_retries=0, timeout=60)
        wait_until(lambda: keyed.models.list().data, 300, "the keyed router")
        r = keyed.chat.completions.create(model="tiny-keyed", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3)
        assert r.usage.completion_tokens >= 1
        for key in ("wrong", "none"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=router + "/v1", api_key=key, max_retries=0, timeout=60).chat.completions.create(
                    model="tiny-keyed", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
