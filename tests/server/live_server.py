"""A live waitress server for the tests: build_app(engine, api_key) on a free 127.0.0.1 port; helpers for
tests and benchmarks that start servers as processes (a free run of ports, waiting for them to come up)."""
import contextlib
import socket
import threading
import time

from strata_lite.server.app import build_app
from strata_lite.server.serve import HTTPServer


@contextlib.contextmanager
def serving(engine, api_key=None):
    """Runs the app in a thread; yields the HTTPServer (its .port); stopped on exit."""
    app, state = build_app(engine, api_key=api_key)
    http = HTTPServer(app, "127.0.0.1", 0, threads=16)

    def run():
        try:
            http.run(poll_s=0.1)
        finally:
            state.inflight.cancel_all()
            http.close(timeout=5)

    t = threading.Thread(target=run, name=f"test-waitress-{http.port}", daemon=True)
    t.start()
    try:
        yield http
    finally:
        http.stop()
        t.join(30)


def free_port_run(n: int) -> int:
    """A port p with p .. p + n free on 127.0.0.1 (a fleet's router, replicas and metrics port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free run of ports")


def wait_until(pred, timeout: float, what: str) -> None:
    """Poll pred() (exceptions count as not yet) until it is true; TimeoutError naming `what` after timeout s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception:        # noqa: BLE001 - not up yet
            pass
        time.sleep(0.25)
    raise TimeoutError(f"timed out waiting for {what}")
