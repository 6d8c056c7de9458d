"""The disk KV tier (kv_disk.py): pages written as they are committed come back after a restart with the
same KV (the fake model checks every position's KV by a hash chain; a tiny real model gives the same
tokens and logprobs), corrupt / truncated / foreign files are skipped with a log line, the size limit
holds, and replicas with separate directories do not see each other's pages."""
import logging

import numpy as np
import pytest

from fake_engine import make_kv, FakeRunner, reference_generation, run
from strata_lite.config import EngineConfig
from strata_lite.engine import Engine
from strata_lite.engine_events import DoneEvent, TokenEvent
from strata_lite.host_pool import ArrayKVCopier, HostPool
from strata_lite.kv_disk import DiskKV
from strata_lite.scheduler import Scheduler
from strata_lite.sequence import Request
from tiny_model import write_tiny_model

P = 4


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"pretend model bytes")
    return str(path)


def _scheduler(directory, model_file, max_bytes=1 << 30, n_pages=64):
    kv = make_kv(n_pages, P)
    host = HostPool.like(kv, 0)
    staging = HostPool.like(kv, HostPool.like(kv, 0).page_bytes)
    disk = DiskKV(str(directory), max_bytes, model_file, staging, ArrayKVCopier(kv, staging))
    return Scheduler(kv, host, ArrayKVCopier(kv, host), n_slots=2, step_tokens=8, disk=disk), FakeRunner(kv), disk


def _serve(sched, runner, rid, prompt, n):
    seq = sched.add(Request(rid, tuple(prompt), max_tokens=n))
    run(sched, runner)
    assert seq.generated == reference_generation(prompt, n)
    return seq


PROMPT = list(range(100, 130))        # 30 tokens: 7 full pages of 4


def test_pages_come_back_after_a_restart(tmp_path, model_file):
    sched, runner, disk = _scheduler(tmp_path / "kv", model_file)
    first = _serve(sched, runner, "a", PROMPT, 6)
    assert disk.stats["pages_written"] == (len(PROMPT) + 6 - 1) // P      # every full page computed
    sched2, runner2, disk2 = _scheduler(tmp_path / "kv", model_file)    # a new process: empty trie and KV
    assert len(disk2.index) == disk.stats["pages_written"]
    follow = PROMPT + first.generated + [7, 8, 9]
    seq = _serve(sched2, runner2, "b", follow, 4)                       # the fake model checks every KV page
    rec = seq.records[0]
    assert rec.from_disk == disk.stats["pages_written"] * P and rec.read == len(follow) - rec.from_disk
    assert "from disk" in rec.log_line() and sched2.counters["tokens_from_disk"] == rec.from_disk


def test_corrupt_truncated_and_foreign_files_are_skipped(tmp_path, model_file, caplog):
    sched, runner, disk = _scheduler(tmp_path / "kv", model_file)
    _serve(sched, runner, "a", PROMPT, 2)
    files = sorted(disk.dir.glob("*.kvp"), key=lambda p: p.stat().st_mtime_ns)
    keys = disk.keys(PROMPT, len(files))
    third = disk.dir / f"{keys[3]}.kvp"
    data = bytearray(third.read_bytes())
    data[-40] ^= 0xFF                                        # corrupt page 3's KV (same size: found on reading)
    third.write_bytes(bytes(data))
    fifth = disk.dir / f"{keys[5]}.kvp"
    fifth.write_bytes(fifth.read_bytes()[:100])                           # truncate page 5
    (disk.dir / "0123456789abcdef0123456789abcdef.kvp").write_bytes(b"not ours")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    _scheduler(tmp_path / "kv2", str(other))[2].write("k" * 32, PROMPT, 0, 0)   # a file of another model
    for f in (tmp_path / "kv2").glob("*/*.kvp"):
        f.rename(disk.dir / f.name)
    with caplog.at_level(logging.WARNING, logger="strata_lite"):
        sched2, runner2, disk2 = _scheduler(tmp_path / "kv", model_file)
        assert "truncated" in caplog.text and "another model" in caplog.text and "not a KV page file" in caplog.text
        seq = _serve(sched2, runner2, "b", PROMPT + [1, 2], 3)
        assert "corrupt" in caplog.text
    assert seq.records[0].from_disk == 3 * P                            # pages 0-2; page 3 is read again
    assert disk2.stats["pages_corrupt"] == 1 and disk2.stats["pages_written"] >= 1   # deleted, then rewritten
    assert _scheduler(tmp_path / "kv", model_file)[2].read(keys[3], 0)               # whole again


def test_size_limit_deletes_the_least_recently_used(tmp_path, model_file):
    sched, runner, disk = _scheduler(tmp_path / "kv", model_file)
    _serve(sched, runner, "a", PROMPT, 2)
    largest = max(f.stat().st_size for f in disk.dir.glob("*.kvp"))     # sizes differ by a few header bytes
    limit = int(3.5 * largest)                                          # room for 3 pages, not 4
    sched, runner, disk = _scheduler(tmp_path / "kv3", model_file, max_bytes=limit)
    _serve(sched, runner, "a", PROMPT, 2)
    assert len(disk.index) == 3 and disk.nbytes <= limit and disk.stats["files_deleted"] >= 4
    assert len(list(disk.dir.glob("*.kvp"))) == 3
    assert set(disk.index) == set(disk.keys(PROMPT + [0] * 8, (len(PROMPT) + 1) // P)[-3:])   # the newest


def _engine(path, directory):
    eng = Engine(EngineConfig(model=path, backend="cpu", n_ctx=256, parallel=2, step_tokens=32, page_size=16,
                              host_kv_gib=0.01, kv_disk=str(directory), kv_disk_gib=1))
    eng.start()
    assert eng.wait_ready(60)
    return eng


def _generate(eng, rid, prompt):
    events = list(eng.submit(Request(rid, tuple(prompt), max_tokens=12, logprobs=3)).events(timeout=60))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return [(e.token_id, e.logprob, e.top_logprobs) for e in events if isinstance(e, TokenEvent)], done


def test_engine_restart_restores_identical_logprobs(tmp_path):
    path = str(write_tiny_model(tmp_path / "tiny-disk.gguf", arch="qwen2", n_embd=64, n_ff=128, n_heads=4,
                                n_kv_heads=2))
    prompt = [int(t) for t in np.random.default_rng(0).integers(5, 200, 150)]
    eng = _engine(path, tmp_path / "kv")
    want, done = _generate(eng, "a", prompt)
    eng.stop()
    assert done.cached_tokens == 0
    eng = _engine(path, tmp_path / "kv")                                  # restarted: empty memory, same disk
    got, done = _generate(eng, "b", prompt)
    text = eng.metrics_registry
    eng.stop()
    assert got == want and done.cached_tokens == 144                      # 9 pages of 16, the last token read
    from prometheus_client import generate_latest
    assert 'strata_prompt_tokens_total{how="disk"} 144.0' in generate_latest(text).decode()
    eng = _engine(path, tmp_path / "other")                              # another replica's directory
    _, done = _generate(eng, "c", prompt)
    eng.stop()
    assert done.cached_tokens == 0
