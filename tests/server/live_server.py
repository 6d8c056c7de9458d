"""A live waitress server for the tests: build_app(engine, api_key) on a free 127.0.0.1 port."""
import contextlib
import threading

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
