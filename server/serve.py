"""Run the HTTP server: `serve(config, host, port, api_key, threads)` builds the Engine, starts it (the
model loads in the background: /health answers 503 until it is ready) and serves the API with waitress
until Ctrl+C (or SIGTERM / Ctrl+Break where the platform has them).

Portable: waitress is pure Python with worker threads (no fork), and its event loop wakes at least once a
second, so KeyboardInterrupt reaches the main thread on Windows too. On the way out, the requests in
flight are cancelled, the engine is stopped and the worker threads are given a few seconds to finish.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import waitress
from waitress import wasyncore

from .app import build_app

log = logging.getLogger("strata_lite.server")


def default_http_threads(config) -> int:
    """Enough waitress workers for every running and queued request (each holds one while it waits)
    plus a few for /health, /metrics and the like."""
    return max(8, min(128, int(config.parallel) + int(config.max_queue) + 4))


class HTTPServer:
    """A waitress server whose loop runs in the calling thread until stop() (from any thread) or
    KeyboardInterrupt; `port` is the bound port (pass 0 to let the OS choose)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8080, threads: int = 8, **adjustments: Any):
        self.map: dict = {}
        self._stop = threading.Event()
        self.server = waitress.create_server(app, map=self.map, host=host, port=port, threads=threads,
                                             ident="strata_lite", **adjustments)
        self.host, self.port = self.server.effective_host, int(self.server.effective_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    def run(self, poll_s: float = 0.5) -> None:
        while self.map and not self._stop.is_set():
            wasyncore.loop(timeout=poll_s, map=self.map, count=1)

    def stop(self) -> None:
        self._stop.set()

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to `timeout` s for the worker threads, then close every socket. Call it from the
        thread that ran run(), after it returned."""
        self.server.task_dispatcher.shutdown(cancel_pending=True, timeout=timeout)
        wasyncore.close_all(self.map)


def _install_stop_signals() -> dict:
    """SIGTERM (and Ctrl+Break on Windows) raise KeyboardInterrupt like Ctrl+C, in the main thread only."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    old = {}
    if threading.current_thread() is not threading.main_thread():
        return old
    for name in ("SIGTERM", "SIGBREAK"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            old[sig] = signal.signal(sig, interrupt)
        except (ValueError, OSError):
            pass
    return old


def _restore_signals(old: dict) -> None:
    for sig, handler in old.items():
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError, TypeError):
            pass


def _watch_engine(engine, http, failed: threading.Event, poll_s: float = 0.5) -> None:
    """Log when the model is ready. A backend that cannot start (no GPU, not enough GPU memory) stops the
    server: it could never answer. Other load errors (a bad file) keep it up, /health reporting them.
    Once serving, an engine stopped by a device fault (or a bug in its loop) stops the server too, so the
    process exits 1 and a supervisor can restart it, instead of answering as if healthy."""
    from strata_lite.kernels import BackendUnavailable
    while not engine.ready.wait(poll_s):
        if engine.load_error is not None:
            if isinstance(engine.load_error, BackendUnavailable):
                log.error("cannot start: %s", engine.load_error)
                failed.set()
                http.stop()
            else:
                log.error("the model failed to load: %s (the server stays up; /health reports the error)",
                          engine.load_error)
            return
    log.info("model %s ready (n_ctx %s)", engine.model_id, engine.n_ctx)
    stopped = getattr(engine, "stopped", None)
    if not isinstance(stopped, threading.Event):        # an engine without a stop event to watch (tests)
        return
    while not stopped.wait(poll_s):
        pass
    if getattr(engine, "fatal_error", None) is not None:
        log.error("the engine stopped: %s; exiting", engine.fatal_error)
        failed.set()
        http.stop()


def serve(config, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          threads: int | None = None, *, engine_factory=None) -> int:
    """Serve `config` (an EngineConfig) on host:port until interrupted; `threads` is the number of HTTP
    worker threads (default: default_http_threads(config)). Returns 0 on a clean stop, 1 when the
    backend cannot start or the engine stopped on a device fault.
    `engine_factory(config)` replaces strata_lite.engine.Engine (tests)."""
    if engine_factory is None:
        from strata_lite.engine import Engine as engine_factory

    engine = engine_factory(config)
    app, state = build_app(engine, api_key)
    http = HTTPServer(app, host, port, threads or default_http_threads(config))   # bind before loading
    old = _install_stop_signals()
    failed = threading.Event()
    try:
        engine.start()
        threading.Thread(target=_watch_engine, args=(engine, http, failed), name="strata-engine-watch",
                         daemon=True).start()
        log.info("strata_lite serving %s on %s (model loading; GET /health says when ready)%s",
                 engine.model_id, http.url, ", API key required" if api_key else "")
        http.run()
    except KeyboardInterrupt:
        log.info("stopping")
    finally:
        try:
            state.inflight.cancel_all()
            engine.stop()
        finally:
            http.close()
            _restore_signals(old)
    return 1 if failed.is_set() else 0
