"""`strata-lite serve`: the argument parser, and serve() stopping cleanly on Ctrl+C (SIGINT) or SIGTERM in a
subprocess: while serving, when the process inherited SIGINT ignored (a script's background job), and
while the model is still loading (the load is not waited for)."""
import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from strata_lite.server.cli_serve import add_serve_parser, api_key_from_args, config_from_args


def parse(argv):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve"] + argv)


def test_serve_arguments(monkeypatch):
    monkeypatch.delenv("STRATA_LITE_API_KEY", raising=False)
    args = parse([])
    assert (args.host, args.port, args.http_threads) == ("127.0.0.1", 8080, None)
    assert api_key_from_args(args) is None
    cfg = config_from_args(args)
    assert (cfg.model, cfg.backend, cfg.n_ctx, cfg.parallel, cfg.kv_tokens, cfg.step_tokens, cfg.host_kv_gib,
            cfg.threads) == (None, "auto", 8192, 2, None, 256, None, None)
    args = parse(["--model", "m.gguf", "--host", "0.0.0.0", "--port", "9000", "--parallel", "4", "--ctx-size",
                  "4096", "--kv-tokens", "32768", "--step-tokens", "128", "--host-kv-gib", "2.5", "--api-key", "k",
                  "--threads", "6", "--backend", "cpu", "--max-queue", "10"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.backend, cfg.n_ctx, cfg.parallel, cfg.kv_tokens, cfg.step_tokens, cfg.host_kv_gib,
            cfg.threads, cfg.max_queue) == ("m.gguf", "cpu", 4096, 4, 32768, 128, 2.5, 6, 10)
    assert config_from_args(parse([])).stuck_step_s == 60.0
    assert config_from_args(parse(["--stuck-step-s", "5"])).stuck_step_s == 5.0
    assert [config_from_args(parse(a)).spec for a in ([], ["--spec", "off"], ["--spec", "3"])] == ["auto", "off", 3]
    assert [config_from_args(parse(a)).prompt_attention
            for a in ([], ["--prompt-attention", "f16"])] == ["exact", "f16"]
    assert (args.host, args.port, api_key_from_args(args)) == ("0.0.0.0", 9000, "k")
    monkeypatch.setenv("STRATA_LITE_API_KEY", "from-env")
    assert api_key_from_args(parse([])) == "from-env"
    assert api_key_from_args(parse(["--api-key", "flag"])) == "flag"
    assert args.func.__name__ == "cmd_serve"


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--parallel", "0"], ["--ctx-size", "x"],
                                  ["--host-kv-gib", "-1"], ["--backend", "tpu"], ["--stuck-step-s", "0"],
                                  ["--prompt-attention", "fast"],
                                  ["--spec", "0"], ["--spec", "sometimes"]])
def test_serve_bad_arguments(argv):
    with pytest.raises(SystemExit):
        parse(argv)


SCRIPT = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("fake_engine_mod", sys.argv[1])
fe = importlib.util.module_from_spec(spec); spec.loader.exec_module(fe)
from strata_lite.config import EngineConfig
from strata_lite.server.serve import serve
engines = []
def factory(config):
    e = fe.FakeEngine(n_ctx=config.n_ctx, ready=False)
    engines.append(e)
    return e
rc = serve(EngineConfig(n_ctx=1024), "127.0.0.1", int(sys.argv[2]), threads=4, engine_factory=factory)
print("EXIT", rc, engines[0].started, engines[0].stopped, flush=True)
"""


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.skipif(sys.platform == "win32", reason="sends POSIX signals to a child")
@pytest.mark.parametrize("sig, inherited", [("SIGINT", "default"), ("SIGINT", "ignored"), ("SIGTERM", "default")])
def test_serve_stops_cleanly_on_ctrl_c(sig, inherited):
    port = _free_port()
    fake = Path(__file__).with_name("fake_engine.py")
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(fake), str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         preexec_fn=_ignore_sigint if inherited == "ignored" else None)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert json.load(r) == {"status": "ok"}
                    break
            except OSError:
                assert p.poll() is None and time.monotonic() < deadline, p.stdout.read() if p.poll() else ""
                time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            assert json.load(r)["data"][0]["context_length"] == 1024
        p.send_signal(getattr(signal, sig))
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    assert "EXIT 0 True True" in out, out


LOADING_SCRIPT = r"""
import sys, threading
import strata_lite.engine as engine_mod
from strata_lite.config import EngineConfig
from strata_lite.server.serve import serve
engine_mod.load_model = lambda *a, **kw: threading.Event().wait()    # a load that never ends
rc = serve(EngineConfig(model="never-loaded.gguf", n_ctx=1024), "127.0.0.1", int(sys.argv[1]), threads=4)
print("EXIT", rc, flush=True)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="sends POSIX signals to a child")
def test_ctrl_c_during_the_model_load_does_not_wait_for_it():
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-c", LOADING_SCRIPT, str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:                           # /health: 503 loading, for as long as the load runs
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                raise AssertionError("/health said ready although the model never loads")
            except urllib.error.HTTPError as e:
                assert e.code == 503 and json.loads(e.read())["status"] == "loading"
                break
            except OSError:
                assert p.poll() is None and time.monotonic() < deadline, p.stdout.read() if p.poll() else ""
                time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "EXIT 0" in out, out


def test_watch_liveness_logs_a_stuck_step_once_and_its_end(caplog):
    import logging
    import threading
    from types import SimpleNamespace

    from strata_lite.server.serve import _watch_liveness
    ok = {"state": "ok", "reason": None}
    states = iter([ok, {"state": "stuck", "reason": "an engine step has been running for 70 s"},
                   {"state": "stuck", "reason": "an engine step has been running for 71 s"}, ok])
    stopped = threading.Event()

    def health():
        state = next(states, None)
        if state is None:
            stopped.set()
        return state or ok
    with caplog.at_level(logging.INFO, logger="strata_lite.server"):
        _watch_liveness(SimpleNamespace(health=health), stopped, poll_s=0.001)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [("ERROR", "an engine step has been running for 70 s; /health answers 503 engine_stuck "
                               "until it ends"),
                     ("WARNING", "the stuck engine step ended; /health is ok again")]
