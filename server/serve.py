"""Run the HTTP server: `serve(config, host, port, api_key, threads)` builds the Engine, starts it (the
model loads in the background: /health answers 503 until it is ready) and serves the API with waitress
until Ctrl+C (or SIGTERM / Ctrl+Break where the platform has them).

Portable: waitress is pure Python with worker threads (no fork), and its event loop wakes at least once a
second, so KeyboardInterrupt reaches the main thread on Windows too. SIGINT gets its handler even when
the process inherited it ignored (a background job of a script starts so; Python then never raises
KeyboardInterrupt and Ctrl+C or `kill -INT` would do nothing). On the way out, the requests in flight
are cancelled, the engine is given ENGINE_STOP_S to end its step (a model load in progress is not
waited for) and the worker threads HTTP_STOP_S to finish; each wait is bounded.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import waitress
from waitress import wasyncore

from .app import build_app
from .schemas import MAX_BODY_BYTES

log = logging.getLogger("strata_lite.server")
ENGINE_STOP_S = 10.0     # for the engine thread to end its current step on the way out
HTTP_STOP_S = 5.0        # for the HTTP worker threads to finish


def default_http_threads(config) -> int:
    """Enough waitress workers for every running and queued request (each holds one while it waits)
    plus a few for /health, /metrics and the like."""
    return max(8, min(128, int(config.parallel) + int(config.max_queue) + 4))


class HTTPServer:
    """A waitress server whose loop runs in the calling thread until stop() (from any thread) or
    KeyboardInterrupt; `port` is the bound port (pass 0 to let the OS choose). waitress buffers a request
    body before the app sees it, so its limit is the app's (MAX_BODY_BYTES, not waitress's 1 GiB): a
    larger body is answered 413 by waitress itself, before it is read."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8080, threads: int = 8, **adjustments: Any):
        self.map: dict = {}
        self._stop = threading.Event()
        adjustments.setdefault("max_request_body_size", MAX_BODY_BYTES)
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

    def close(self, timeout: float = HTTP_STOP_S) -> None:
        """Wait up to `timeout` s for the worker threads, then close every socket. Call it from the
        thread that ran run(), after it returned."""
        self.server.task_dispatcher.shutdown(cancel_pending=True, timeout=timeout)
        wasyncore.close_all(self.map)


def _install_stop_signals() -> dict:
    """SIGINT (Ctrl+C), SIGTERM and Ctrl+Break on Windows raise KeyboardInterrupt, in the main thread only.
    SIGINT too: a process started with it ignored (a script's background job) would not stop on it."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    old = {}
    if threading.current_thread() is not threading.main_thread():
        return old
    for name in ("SIGINT", "SIGTERM", "SIGBREAK"):
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
    _watch_liveness(engine, stopped, poll_s)
    if getattr(engine, "fatal_error", None) is not None:
        log.error("the engine stopped: %s; exiting", engine.fatal_error)
        failed.set()
        http.stop()


def _watch_liveness(engine, stopped: threading.Event, poll_s: float) -> None:
    """Until the engine stops: log when /health turns to engine_stuck (a step past its bound) and back."""
    health = getattr(engine, "health", None)
    stuck = None
    while not stopped.wait(poll_s):
        now = health() if callable(health) else None
        reason = now["reason"] if now is not None and now["state"] == "stuck" else None
        if reason is not None and stuck is None:
            log.error("%s; /health answers 503 engine_stuck until it ends", reason)
        elif reason is None and stuck is not None:
            log.warning("the stuck engine step ended; /health is ok again")
        stuck = reason


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
            engine.stop(timeout=ENGINE_STOP_S)
        finally:
            http.close()
            _restore_signals(old)
    return 1 if failed.is_set() else 0
