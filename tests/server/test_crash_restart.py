"""Crash and restart: `python -m strata_lite.cli serve` on a tiny model is killed hard (SIGKILL; on Windows
TerminateProcess) in the middle of a streamed answer, started again on the same model, cache dir and port,
and serves again: /health ok, every slot idle, the same greedy completion as before the crash, and the model
file and the cache dir unchanged."""
import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tiny_model import write_tiny_model

START_TIMEOUT_S = 300           # the first start may compile the CPU kernels (Numba) on a slow machine
GREEDY = {"prompt": "hello hello", "max_tokens": 12, "temperature": 0}
LONG = {"prompt": "lo he llo", "max_tokens": 1900, "temperature": 0, "stream": True}   # runs for seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model, port, cache, log):
    env = dict(os.environ, STRATA_LITE_CACHE=str(cache))
    cmd = [sys.executable, "-m", "strata_lite.cli", "serve", "--model", str(model), "--backend", "cpu",
           "--port", str(port), "--ctx-size", "2048", "--parallel", "2", "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _get(port, path, timeout=10):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.load(r)


def _post(port, path, body, timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _wait_healthy(p, port, log_path):
    """Polls /health (connection refused, then 503 loading) until 200; the process must stay alive."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if _get(port, "/health", timeout=5)["status"] == "ok":
                return
        except (urllib.error.HTTPError, OSError):
            pass
        assert p.poll() is None, f"the server exited with {p.returncode}:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"not healthy after {START_TIMEOUT_S} s:\n{log_path.read_text()}"
        time.sleep(0.5)


def _greedy(port) -> str:
    with _post(port, "/v1/completions", GREEDY) as r:
        return json.load(r)["choices"][0]["text"]


def _kill_hard(p) -> None:
    if hasattr(signal, "SIGKILL"):
        os.kill(p.pid, signal.SIGKILL)
    else:
        p.kill()                     # Windows: TerminateProcess, no handler runs either
    p.wait(timeout=60)


def _rest(stream) -> bytes:
    """What the server sent before it died: the body up to EOF, a cut chunk or a reset connection."""
    try:
        return stream.read()
    except http.client.IncompleteRead as e:
        return e.partial
    except OSError:
        return b""


def _tree_digest(root) -> dict:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


def test_killed_mid_stream_then_restarted_serves_the_same(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-crash.gguf")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "marker.txt").write_text("kept")
    before = {"model": hashlib.sha256(model.read_bytes()).hexdigest(), "cache": _tree_digest(cache)}
    port = _free_port()
    procs = []
    try:
        log1 = tmp_path / "serve1.log"
        with log1.open("w") as f:
            procs.append(p := _start(model, port, cache, f))
        _wait_healthy(p, port, log1)
        want = _greedy(port)
        assert want                                        # a non-empty answer to compare after the restart
        stream = _post(port, "/v1/completions", LONG, timeout=60)
        first = stream.readline()                          # the first SSE event: the answer is under way
        assert first.startswith(b"data: ") and b"[DONE]" not in first
        _kill_hard(p)
        assert p.returncode == (-signal.SIGKILL if hasattr(signal, "SIGKILL") else 1)
        assert b"[DONE]" not in _rest(stream), "the stream had ended before the kill"

        log2 = tmp_path / "serve2.log"
        with log2.open("w") as f:
            procs.append(p := _start(model, port, cache, f))
        _wait_healthy(p, port, log2)
        assert _greedy(port) == want
        assert all(s["state"] == "idle" for s in _get(port, "/slots"))
        with _post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 4}) as r:
            assert json.load(r)["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait(timeout=60)
    assert {"model": hashlib.sha256(model.read_bytes()).hexdigest(), "cache": _tree_digest(cache)} == before
