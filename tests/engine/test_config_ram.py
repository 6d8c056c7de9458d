"""available_ram_bytes() on each platform's path (Windows through a fake kernel32, so it runs on Linux CI),
the default host KV pool it sizes, the warning when it reads 0, and an engine on "Windows" parking and
restoring KV through that pool."""
import ctypes
import io
import logging
from types import SimpleNamespace

import pytest

from strata_lite import config
from strata_lite.config import HOST_KV_FRACTION, EngineConfig, MemoryStatusEx, available_ram_bytes
from strata_lite.engine import Engine
from strata_lite.engine_events import DoneEvent
from strata_lite.sampling import SamplingParams
from strata_lite.sequence import Request
from tiny_model import write_tiny_model

AVAIL = 3 * 2**30 + 12345          # a value no real machine reports, so a wrong branch cannot pass


def fake_kernel32(avail: int | None):
    """A kernel32 whose GlobalMemoryStatusEx fills MEMORYSTATUSEX like Windows does (None: the call fails)."""
    calls = []

    def global_memory_status_ex(ref):
        status = ref._obj
        calls.append(status.dwLength)
        if avail is None:
            return 0
        status.ullTotalPhys, status.ullAvailPhys, status.dwMemoryLoad = 4 * avail, avail, 75
        return 1
    return SimpleNamespace(kernel32=SimpleNamespace(GlobalMemoryStatusEx=global_memory_status_ex)), calls


@pytest.fixture
def windows(monkeypatch):
    """config sees sys.platform == "win32"; returns a function installing a fake ctypes.windll."""
    monkeypatch.setattr(config, "sys", SimpleNamespace(platform="win32"))

    def install(avail):
        windll, calls = fake_kernel32(avail)
        monkeypatch.setattr(ctypes, "windll", windll, raising=False)
        return calls
    return install


def test_memorystatusex_has_the_win32_layout():
    assert ctypes.sizeof(MemoryStatusEx) == 64
    assert MemoryStatusEx.ullAvailPhys.offset == 16


def test_windows_reads_global_memory_status_ex(windows):
    calls = windows(AVAIL)
    assert available_ram_bytes() == AVAIL
    assert calls == [64]                                  # dwLength set before the call, as Windows requires
    assert EngineConfig().host_kv_bytes() == int(HOST_KV_FRACTION * AVAIL)
    assert EngineConfig(host_kv_gib=0.5).host_kv_bytes() == 2**29


@pytest.mark.parametrize("avail", [None, "no windll"])
def test_windows_failure_gives_0_and_a_warning_naming_the_flag(windows, monkeypatch, avail, caplog):
    if avail is None:
        windows(None)                                     # GlobalMemoryStatusEx returned FALSE
    else:
        monkeypatch.delattr(ctypes, "windll", raising=False)
    assert available_ram_bytes() == 0
    with caplog.at_level(logging.WARNING, logger="strata_lite"):
        assert EngineConfig().host_kv_bytes() == 0
    [rec] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "--host-kv-gib" in rec.getMessage() and "0 bytes" in rec.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="strata_lite"):
        assert EngineConfig(host_kv_gib=1).host_kv_bytes() == 2**30
    assert not caplog.records                             # a set size needs no reading and no warning


def test_linux_reads_mem_available(monkeypatch):
    text = "MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:    2000000 kB\n"

    def fake_open(path, *a, **kw):
        assert path == "/proc/meminfo"
        return io.StringIO(text)
    monkeypatch.setattr(config, "sys", SimpleNamespace(platform="linux"))
    monkeypatch.setattr(config, "open", fake_open, raising=False)
    assert available_ram_bytes() == 2000000 * 1024


def test_sysconf_fallback_without_meminfo(monkeypatch):
    def no_meminfo(path, *a, **kw):
        raise FileNotFoundError(path)
    monkeypatch.setattr(config, "sys", SimpleNamespace(platform="darwin"))
    monkeypatch.setattr(config, "open", no_meminfo, raising=False)
    values = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(config.os, "sysconf", lambda name: values[name])
    assert available_ram_bytes() == 4096000
    monkeypatch.setattr(config.os, "sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert available_ram_bytes() == 0


# ---- end to end: the engine's default host pool on Windows holds parked KV (0 bytes would drop it)

N_CTX = 128


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("ram") / "tiny-ram.gguf"))


def _run(eng, prompt, max_tokens=2):
    events = list(eng.submit(Request(f"r{len(prompt)}-{prompt[0]}", tuple(prompt), SamplingParams(),
                                     max_tokens=max_tokens)).events(timeout=120))
    assert isinstance(events[-1], DoneEvent), events[-1]
    return events[-1]


@pytest.mark.parametrize("avail", [64 * 2**20, None])
def test_engine_on_windows_parks_kv_in_the_default_pool(windows, model_path, avail, caplog):
    """KV for one sequence: prompt B evicts A's cached prefix; with the pool sized from GlobalMemoryStatusEx
    it is parked and restored for A's next turn, with a failed reading it is dropped (and re-read)."""
    windows(avail)
    with caplog.at_level(logging.WARNING, logger="strata_lite"):
        eng = Engine(EngineConfig(model=model_path, backend="cpu", n_ctx=N_CTX, kv_tokens=N_CTX, parallel=1,
                                  page_size=16, step_tokens=64))
        eng.start()
        assert eng.wait_ready(120)
    try:
        a = [10 + i % 200 for i in range(70)]
        b = [20 + i % 150 for i in range(100)]
        _run(eng, a)
        _run(eng, b)                                      # needs the device pages A's prefix holds
        done = _run(eng, a + [7, 8])
        restored = eng.metrics_registry.get_sample_value("strata_prompt_tokens_total", {"how": "restored"})
        warned = any("--host-kv-gib" in r.getMessage() for r in caplog.records)
        if avail is None:
            assert (restored, warned) == (0, True)
        else:
            assert restored > 0 and done.cached_tokens >= 64 and not warned
    finally:
        eng.stop()
