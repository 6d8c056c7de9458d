"""`strata-lite fleet`: N `strata-lite serve` replicas behind sglang-router, on one port, supervised.

    strata-lite fleet --replicas 2 --threads-per-replica 8 --port 8080 -- --model M.gguf --parallel 2
    strata-lite fleet --replicas 2 --gpus 0,1 --policy cache_aware -- --ctx-size 32768

Replica i listens on 127.0.0.1:(port + 1 + i) (`--replica-host` to change the address), the router's
Prometheus metrics on port + replicas + 1 (its default port would collide between fleets), with one GPU each
(`--gpus`: CUDA_VISIBLE_DEVICES, `--backend cuda`) or `--threads-per-replica` CPU threads (default: the
cores divided among the replicas, `--backend cpu`). Everything after `--` goes to every replica's
`strata-lite serve` (checked before anything starts). The router (sglang-router's `launch_router`, a Rust
gateway: cache-aware routing, health checks, retries, circuit breakers) starts once every replica is
healthy and listens on --host:--port; it checks the replicas' /health every --health-interval-s seconds,
so a replica that dies leaves its rotation and comes back when the fleet has restarted it. Ctrl+C (or
SIGTERM) stops the router and the replicas. docs/fleet.md has the design and a hand-started example.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

log = logging.getLogger("strata_lite.fleet")
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
RESTART_WINDOW_S = 60.0      # a replica that dies this many times within the window waits before restarting
RESTART_BURST = 3
RESTART_PAUSE_S = 10.0
FORBIDDEN_SERVE_ARGS = ("--port", "--host", "--backend", "--threads", "-t", "--api-key")


class FleetError(RuntimeError):
    """A fleet that cannot start (one line for the user)."""


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict
    url: str | None = None        # a replica's base URL
    proc: subprocess.Popen | None = None
    deaths: list[float] = field(default_factory=list)
    restart_at: float = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env)
        log.info("%s started (pid %d)", self.name, self.proc.pid)

    def stop(self, timeout: float = 10.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def add_fleet_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("fleet", help="replicas of `serve` behind sglang-router (docs/fleet.md)",
                              description=__doc__.split("\n")[0])
    p.add_argument("--replicas", "-n", type=int, required=True, help="number of replicas (>= 1)")
    p.add_argument("--gpus", default=None, help="comma-separated GPU ids, one per replica (CUDA backend)")
    p.add_argument("--threads-per-replica", type=int, default=None,
                   help="CPU threads of each CPU replica (default: the cores divided among the replicas)")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES, help="routing policy (default cache_aware)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the router's port; replicas take the next ones")
    p.add_argument("--replica-host", default="127.0.0.1", help="the address replicas listen on")
    p.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' to the router (replicas, on loopback, take none)")
    p.add_argument("--health-interval-s", type=int, default=2, help="router health checks (default every 2 s)")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="wait this long for every replica")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `strata-lite serve` options")
    p.set_defaults(func=cmd_fleet)
    return p


def cmd_fleet(args) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        fleet = Fleet.from_args(args)
    except FleetError as e:
        print(f"strata-lite fleet: {e}", file=sys.stderr)
        return 2
    return fleet.run()


def _router_available() -> str | None:
    """None if sglang-router is installed, else what to do (one line)."""
    if importlib.util.find_spec("sglang_router") is None:
        return ("sglang-router is not installed; install it with: pip install \"strata_lite[fleet]\" (where pip "
                "finds no sglang-router wheel for this platform, run the replicas with `strata-lite serve` and "
                "the router on another machine, docs/fleet.md)")
    return None


class Fleet:
    def __init__(self, replicas: list[Child], router: Child, router_url: str, api_key: str | None,
                 start_timeout_s: float):
        self.replicas, self.router, self.router_url = replicas, router, router_url
        self.api_key, self.start_timeout_s = api_key, start_timeout_s
        self._stop = False

    @classmethod
    def from_args(cls, args) -> "Fleet":
        if args.replicas < 1:
            raise FleetError("--replicas must be >= 1")
        why = _router_available()
        if why:
            raise FleetError(why)
        serve_args = list(args.serve_args)
        if serve_args and serve_args[0] == "--":
            serve_args = serve_args[1:]
        bad = [a for a in serve_args if a.split("=")[0] in FORBIDDEN_SERVE_ARGS]
        if bad:
            raise FleetError(f"{bad[0]} is set by the fleet itself (use the fleet's own options, see --help)")
        _check_serve_args(serve_args)
        gpus = [g.strip() for g in args.gpus.split(",")] if args.gpus else None
        if gpus is not None and len(gpus) != args.replicas:
            raise FleetError(f"--gpus lists {len(gpus)} GPUs for {args.replicas} replicas (one GPU per replica)")
        threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // args.replicas)
        replicas = []
        for i in range(args.replicas):
            port = args.port + 1 + i
            argv = [sys.executable, "-m", "strata_lite.cli", "serve", "--host", args.replica_host,
                    "--port", str(port)] + _own_disk_dir(serve_args, i)
            env = dict(os.environ)
            if gpus is not None:
                argv += ["--backend", "cuda"]
                env["CUDA_VISIBLE_DEVICES"] = gpus[i]
            else:
                argv += ["--backend", "cpu", "--threads", str(threads)]
            replicas.append(Child(f"replica {i} (port {port})", argv, env, url=f"http://{args.replica_host}:{port}"))
        router_argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host,
                       "--port", str(args.port), "--policy", args.policy,
                       "--worker-urls", *[r.url for r in replicas],
                       "--health-check-interval-secs", str(args.health_interval_s),
                       "--health-failure-threshold", "1", "--health-success-threshold", "1",
                       "--prometheus-host", args.host, "--prometheus-port", str(args.port + args.replicas + 1),
                       "--log-level", "warn"]
        if args.api_key:                  # the router checks clients' keys; it forwards requests without one
            router_argv += ["--api-key", args.api_key]
            if args.replica_host not in ("127.0.0.1", "localhost", "::1"):
                log.warning("--api-key guards the router only: replicas on %s answer without a key",
                            args.replica_host)
        router = Child("router", router_argv, dict(os.environ))
        return cls(replicas, router, f"http://{args.host}:{args.port}", args.api_key, args.start_timeout_s)

    # lifecycle
    def run(self) -> int:
        def on_signal(signum, frame):
            self._stop = True
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for r in self.replicas:
                r.start()
            if not self._wait_healthy():
                return 1
            self.router.start()
            log.info("fleet ready: %d replicas behind %s", len(self.replicas), self.router_url)
            while not self._stop:
                self._supervise()
                time.sleep(0.5)
            log.info("stopping the fleet")
            return 0
        finally:
            self.stop()
            for s, h in old.items():
                signal.signal(s, h)

    def stop(self) -> None:
        self.router.stop()
        for r in self.replicas:
            r.stop()

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        pending = list(self.replicas)
        while pending and not self._stop:
            for r in list(pending):
                if r.proc.poll() is not None:
                    log.error("%s exited with status %s while starting; stopping the fleet", r.name,
                              r.proc.returncode)
                    return False
                if _healthy(r.url):
                    log.info("%s is healthy", r.name)
                    pending.remove(r)
            if time.monotonic() > deadline:
                log.error("%s not healthy after %.0f s; stopping the fleet", ", ".join(r.name for r in pending),
                          self.start_timeout_s)
                return False
            time.sleep(0.5)
        return not self._stop

    def _supervise(self) -> None:
        """Restart a replica (or the router) that exited; a replica that keeps dying waits a while."""
        now = time.monotonic()
        for child in self.replicas + [self.router]:
            if child.proc.poll() is None:
                continue
            if child.restart_at == 0.0:
                child.deaths = [t for t in child.deaths if now - t < RESTART_WINDOW_S] + [now]
                pause = RESTART_PAUSE_S if len(child.deaths) >= RESTART_BURST else 0.0
                child.restart_at = now + pause
                log.warning("%s exited with status %s; restarting it%s", child.name, child.proc.returncode,
                            f" in {pause:.0f} s (it died {len(child.deaths)} times in {RESTART_WINDOW_S:.0f} s)"
                            if pause else "")
            if now >= child.restart_at:
                child.restart_at = 0.0
                child.start()


def _own_disk_dir(serve_args: list[str], i: int) -> list[str]:
    """serve_args with `--kv-disk DIR` made DIR/replica-i: replicas never share a disk tier directory."""
    out, it = [], iter(serve_args)
    for a in it:
        if a == "--kv-disk":
            out += [a, os.path.join(next(it, ""), f"replica-{i}")]
        elif a.startswith("--kv-disk="):
            out.append(f"--kv-disk={os.path.join(a.split('=', 1)[1], f'replica-{i}')}")
        else:
            out.append(a)
    return out


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _check_serve_args(serve_args: list[str]) -> None:
    """Parse the replicas' serve options now, so a typo fails before any process starts."""
    from .cli_serve import add_serve_parser
    parser = argparse.ArgumentParser(prog="strata-lite fleet ... --", add_help=False)
    add_serve_parser(parser.add_subparsers(dest="command"))
    try:
        parser.parse_args(["serve", "--port", "1"] + serve_args)
    except SystemExit as e:
        raise FleetError(f"the serve options after -- are not valid: {' '.join(serve_args)}") from e
