"""`strata-lite serve --backend cuda` end to end with the real openai client: the Engine on the CUDA backend
(decode graphs, device sampling, the CUDA KV copier) serving a synthetic model of the Qwen2.5-0.5B shape
(`strata-lite synth`, ChatML template) on a live waitress server; and `serve --backend cuda` on a machine
that cannot run it exits non-zero with one line."""
import concurrent.futures
import subprocess
import sys
import urllib.request

import openai
import pytest

from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from live_server import serving


@pytest.fixture(scope="module")
def synth_path(tmp_path_factory):
    from strata_lite.loader.synth import synth_model
    path = tmp_path_factory.mktemp("synth") / "qwen-0.5b-shape.gguf"
    synth_model(path, "qwen2.5-0.5b", quant="q4_k_m", blocks=4, progress=False)
    return str(path)


@pytest.fixture(scope="module")
def server(synth_path):
    eng = Engine(EngineConfig(model=synth_path, backend="cuda", n_ctx=1024, parallel=2, host_kv_gib=0.25))
    eng.start()
    try:
        assert eng.wait_ready(timeout=600), f"the engine did not start: {eng.load_error}"
        with serving(eng) as http:
            yield http
    finally:
        eng.stop(timeout=60)


@pytest.mark.gpu
def test_health_and_chat_on_cuda(server):
    with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
        assert r.status == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="default", messages=msgs, max_tokens=12, temperature=0, stream=True)]
    assert "".join(pieces) == r.choices[0].message.content      # greedy: streaming gives the same text


@pytest.mark.gpu
def test_concurrent_requests_on_cuda_are_independent(server):
    """Two slots decoding together (a 2-row graph bucket) give each request the text it gets alone."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def ask(text):
        r = client.completions.create(model="default", prompt=text, max_tokens=16, temperature=0)
        return r.choices[0].text
    prompts = ["abc def ghi", "one two three four five"]
    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        together = list(ex.map(ask, prompts))
    assert together == alone


def test_serve_cuda_without_gpu_exits_nonzero(tmp_path):
    """Where CuPy sees no GPU (CI), `serve --backend cuda` stops with one line and exit code 1."""
    from strata_lite.kernels import cuda_unavailable_reason
    if cuda_unavailable_reason() is None:
        pytest.skip("a GPU is present: the CUDA backend starts here")
    from strata_lite.loader.synth import synth_model
    path = tmp_path / "m.gguf"
    synth_model(path, "qwen2.5-0.5b", quant="q8_0", blocks=1, progress=False)
    r = subprocess.run([sys.executable, "-m", "strata_lite.cli", "serve", "--backend", "cuda", "-m", str(path),
                        "--port", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "cannot start: the CUDA backend needs CuPy" in r.stderr
