"""The engine thread on a tiny model: batched serving gives what LLM gives alone, the KV of a previous turn
is reused, and cancellation, stop strings, limits, logprobs, metrics and errors behave."""
import logging
import threading
import time

import numpy as np
import pytest

from strata_lite import LLM, InvalidRequest, SamplingParams
from strata_lite.config import EngineConfig
from strata_lite.engine import Engine, PromptTooLong, QueueFull, log_softmax
from strata_lite.engine_events import DoneEvent, ErrorEvent, TokenEvent
from strata_lite.sequence import Request
from tiny_model import write_tiny_model

N_CTX = 256
# float32 summation order differs between one sequence alone and a batch (BLAS vs fused kernels, chunking),
# which may flip an int8 KV rounding: logits agree to ~1e-6 of their spread, test_api allows 2e-3.
LOGIT_TOL = 2e-3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("eng") / "tiny-engine.gguf", arch="qwen2", n_embd=64,
                                n_ff=128, n_heads=4, n_kv_heads=2))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, backend="cpu", n_ctx=N_CTX)


def _engine(model_path, **kw):
    cfg = dict(model=model_path, backend="cpu", n_ctx=N_CTX, parallel=3, step_tokens=24, page_size=16,
               host_kv_gib=0.01, max_queue=16)
    cfg.update(kw)
    eng = Engine(EngineConfig(**cfg))
    eng.start()
    assert eng.wait_ready(60)
    return eng


@pytest.fixture(scope="module", params=[False, True], ids=["hand-out-in-step", "hand-out-overlapped"])
def engine(model_path, request):
    """The engine as the CPU backend runs it (a step's tokens handed out at its end) and as a backend that
    queues work runs it (handed out after the next step's forward is launched: Backend.queues_work, CUDA's
    way), so every behaviour below is checked both ways on the CPU."""
    eng = _engine(model_path)
    eng._runner.backend.queues_work = request.param
    yield eng
    eng.stop()
    assert eng.stopped.is_set()


_ids = iter(range(10 ** 9))


def req(prompt, max_tokens=8, **kw):
    params = {k: kw.pop(k) for k in list(kw) if k in SamplingParams.__dataclass_fields__}
    return Request(f"r{next(_ids)}", tuple(prompt), SamplingParams(**params), max_tokens=max_tokens, **kw)


def collect(handle, timeout=60):
    events = list(handle.events(timeout=timeout))
    assert isinstance(events[-1], (DoneEvent, ErrorEvent)) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def run(engine, prompt, **kw):
    toks, done = collect(engine.submit(req(prompt, **kw)))
    assert isinstance(done, DoneEvent), done
    assert "".join(t.text for t in toks) == done.text and done.completion_tokens == len(toks)
    return [t.token_id for t in toks], done


def assert_same_greedy(llm, prompt, got, want):
    """Equal token chains, or the first difference sits at a near-tie of the single-sequence logits."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            row = llm.logits(list(prompt) + list(want[:i]))[-1]
            gap = float(row[b] - row[a])
            assert gap <= LOGIT_TOL * np.abs(row).max(), f"token {i}: {a} != {b}, logit gap {gap}"
            return
    assert len(got) == len(want)


def wait_idle(engine, timeout=10):
    deadline = time.monotonic() + timeout
    while any(s["state"] != "idle" for s in engine.slots()):
        assert time.monotonic() < deadline, engine.slots()
        time.sleep(0.01)


def prompt_of(i, n):
    return [(7 * i + 13 * j + 3) % 250 for j in range(n)]


def test_concurrent_submits_match_llm_generate(engine, llm):
    prompts = [prompt_of(i, n) for i, n in enumerate((5, 17, 40, 9, 33, 2))]
    results = {}

    def client(i):
        results[i] = run(engine, prompts[i], max_tokens=10)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        ids, done = results[i]
        want = llm.generate(p, max_tokens=10)
        assert_same_greedy(llm, p, ids, want.token_ids)
        assert done.prompt_tokens == len(p) and done.finish_reason == want.finish_reason
    wait_idle(engine)


def test_seeded_sampling_matches_llm_generate(engine, llm):
    """Token k of a seeded request takes the k-th uniform of its generator whenever its event goes out
    (RequestState.used_uniform): the same tokens as LLM.generate with the seed, two requests at once."""
    prompts = [prompt_of(3, 12), prompt_of(4, 7)]
    results = {}

    def client(i):
        results[i] = run(engine, prompts[i], max_tokens=16, temperature=0.9, top_k=40, seed=100 + i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, p in enumerate(prompts):
        want = llm.generate(p, max_tokens=16, temperature=0.9, top_k=40, seed=100 + i)
        assert results[i][0] == want.token_ids


def test_second_turn_reuses_the_first_turns_kv(engine, llm):
    p1 = prompt_of(50, 37)
    ids1, done1 = run(engine, p1, max_tokens=9)
    assert done1.cached_tokens == 0
    p2 = p1 + ids1 + prompt_of(51, 6)
    ids2, done2 = run(engine, p2, max_tokens=5)
    assert done2.cached_tokens == len(p1) + len(ids1) - 1      # the last sampled token has no KV yet
    assert_same_greedy(llm, p2, ids2, llm.generate(p2, max_tokens=5).token_ids)


def _long_runner(llm, n):
    """A prompt whose greedy continuation runs n tokens without an end-of-generation token."""
    for i in range(100, 140):
        p = prompt_of(i, 8)
        if llm.generate(p, max_tokens=n).finish_reason == "length":
            return p
    raise AssertionError(f"no prompt of the tiny model runs {n} tokens without an end-of-generation token")


def test_cancel_mid_generation_frees_the_slot_and_keeps_kv(engine, llm):
    p = _long_runner(llm, 200)
    h = engine.submit(req(p, max_tokens=200))
    it = h.events(timeout=30)
    got = [next(it).token_id for _ in range(3)]
    assert any(s["request_id"] == h.id for s in engine.slots())
    h.cancel()
    rest = list(it)
    done = rest[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
    got += [e.token_id for e in rest[:-1]]
    assert 3 <= done.completion_tokens == len(got) < 200
    wait_idle(engine)
    ids, done2 = run(engine, p + got, max_tokens=3)              # the cancelled turn's KV was kept
    assert done2.cached_tokens == len(p) + len(got) - 1 and done2.completion_tokens == 3


def test_cancel_before_admission(model_path, llm):
    eng = _engine(model_path, parallel=1)
    try:
        p = _long_runner(llm, 100)
        a = eng.submit(req(p, max_tokens=100))
        b = eng.submit(req(p, max_tokens=5))
        b.cancel()
        _, done_b = collect(b)
        a.cancel()
        _, done_a = collect(a)
        assert done_b.finish_reason == done_a.finish_reason == "cancelled"
        ids, done = run(eng, prompt_of(3, 5), max_tokens=4)
        assert done.finish_reason in ("length", "stop")
    finally:
        eng.stop()


def test_stop_string(engine, llm):
    p = _long_runner(llm, 24)
    full = llm.generate(p, max_tokens=24)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    want = llm.generate(p, max_tokens=24, stop=[stop])
    assert want.finish_reason == "stop"
    restarts = engine.restarts
    _, done = run(engine, p, max_tokens=24, stop=(stop,))
    assert done.finish_reason == "stop" and done.text == want.text and stop not in done.text
    deadline = time.monotonic() + 30                 # the step in flight when the stop was found ends cleanly
    while engine._sched.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.restarts == restarts and not engine._sched.running


def test_max_tokens_and_n_ctx_limit(engine, llm):
    p = _long_runner(llm, 7)
    ids, done = run(engine, p, max_tokens=7)
    assert done.finish_reason == "length" and len(ids) == 7
    long = prompt_of(7, N_CTX - 3)
    ids, done = run(engine, long, max_tokens=50)
    assert done.finish_reason in ("length", "stop") and len(long) + len(ids) <= N_CTX
    if done.finish_reason == "length":
        assert len(long) + len(ids) == N_CTX


def test_prompt_too_long_and_bad_requests(engine):
    with pytest.raises(PromptTooLong) as e:
        engine.submit(req(prompt_of(1, N_CTX)))
    assert e.value.n_prompt_tokens == N_CTX and e.value.n_ctx == N_CTX and isinstance(e.value, InvalidRequest)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.submit(req([1, 10 ** 6]))
    with pytest.raises(InvalidRequest, match="logprobs"):
        engine.submit(req([1, 2], logprobs=21))


def test_queue_full(model_path, llm):
    eng = _engine(model_path, parallel=1, max_queue=1)
    try:
        p = _long_runner(llm, 100)
        a = eng.submit(req(p, max_tokens=100))
        b = eng.submit(req(p, max_tokens=100))
        with pytest.raises(QueueFull) as e:
            eng.submit(req(p, max_tokens=5))
        assert e.value.retry_after >= 1
        for h in (b, a):
            h.cancel()
            assert collect(h)[1].finish_reason == "cancelled"
    finally:
        eng.stop()


def test_logprobs(engine, llm):
    p = prompt_of(9, 11)
    toks, done = collect(engine.submit(req(p, max_tokens=4, logprobs=5)))
    ctx = list(p)
    for ev in toks:
        lp = log_softmax(llm.logits(ctx)[-1])
        assert abs(ev.logprob - lp[ev.token_id]) <= LOGIT_TOL * 10
        assert len(ev.top_logprobs) == 5
        assert ev.top_logprobs[0][0] == ev.token_id                     # greedy: the best one
        vals = [v for _, _, v in ev.top_logprobs]
        assert vals == sorted(vals, reverse=True)
        for tid, text, v in ev.top_logprobs:
            assert text == llm.tokenizer.token_text(tid) and abs(v - lp[tid]) <= LOGIT_TOL * 10
        ctx.append(ev.token_id)
    assert abs(np.exp(log_softmax(np.array([1.0, 2.0, 3.0], np.float32))).sum() - 1) < 1e-12
    toks, _ = collect(engine.submit(req(p, max_tokens=2, logprobs=0)))
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in toks)
    toks, _ = collect(engine.submit(req(p, max_tokens=2)))
    assert all(e.logprob is None and e.top_logprobs is None for e in toks)


def test_penalties_follow_the_generated_tokens(engine, llm):
    """Greedy with presence / frequency penalties = argmax of logits - 2 count - 2 (count > 0) over the
    tokens generated so far (not the prompt's); count rows go back to the pool when requests end."""
    free = len(engine._runner._free_count_rows)
    p = prompt_of(97, 10)                          # its plain greedy chain repeats a token three times
    plain = llm.generate(p, max_tokens=8).token_ids
    ids, _ = run(engine, p, max_tokens=8, frequency_penalty=2.0, presence_penalty=2.0)
    assert ids != plain
    counts, ctx = np.zeros(llm.config.n_vocab), list(p)
    for t in ids:
        row = llm.logits(ctx)[-1] - 2.0 * counts - 2.0 * (counts > 0)
        best = int(np.argmax(row))
        assert t == best or row[best] - row[t] <= LOGIT_TOL * np.abs(row).max()
        counts[t] += 1
        ctx.append(t)
    wait_idle(engine)
    assert len(engine._runner._free_count_rows) == free


def test_metrics_move(engine, caplog):
    caplog.set_level(logging.INFO, logger="strata_lite")
    reg = engine.metrics_registry

    def value(name, **labels):
        return reg.get_sample_value(name, labels) or 0.0

    before = {k: value(*k) if isinstance(k, tuple) else value(k) for k in
              ("strata_generated_tokens_total", "strata_time_to_first_token_seconds_count",
               "strata_step_seconds_count", "strata_inter_token_seconds_count")}
    read0 = value("strata_prompt_tokens_total", how="read")
    reused0 = value("strata_prompt_tokens_total", how="reused")
    p = prompt_of(60, 40)
    ids, _ = run(engine, p, max_tokens=4)
    run(engine, p + ids, max_tokens=2)
    assert value("strata_generated_tokens_total") == before["strata_generated_tokens_total"] + len(ids) + 2
    assert value("strata_time_to_first_token_seconds_count") == before["strata_time_to_first_token_seconds_count"] + 2
    assert value("strata_inter_token_seconds_count") > before["strata_inter_token_seconds_count"]
    assert value("strata_step_seconds_count") > before["strata_step_seconds_count"]
    assert value("strata_prompt_tokens_total", how="read") >= read0 + 40
    assert value("strata_prompt_tokens_total", how="reused") >= reused0 + 40
    assert value("strata_needless_read_tokens_total") == 0
    wait_idle(engine)
    assert value("strata_requests_running") == 0 and value("strata_requests_waiting") == 0
    assert 0 < value("strata_kv_usage_ratio") <= 1
    assert any("prompt 40 tokens = 0 reused + 0 restored + 40 read in" in r.getMessage() for r in caplog.records)


def test_forward_error_fails_the_step_not_the_engine(engine, llm):
    runner = engine._runner
    real = runner.forward
    calls = []

    def broken(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(batch)

    runner.forward = broken
    try:
        toks, ev = collect(engine.submit(req(prompt_of(70, 5), max_tokens=6)))
    finally:
        runner.forward = real
    # the client learns the step failed, not the internal exception text
    assert isinstance(ev, ErrorEvent) and "internal error" in ev.message and "injected" not in ev.message
    assert len(toks) == 1
    p = prompt_of(71, 9)
    ids, done = run(engine, p, max_tokens=5)
    assert_same_greedy(llm, p, ids, llm.generate(p, max_tokens=5).token_ids)
    wait_idle(engine)


def test_sampling_error_fails_one_request(engine, llm):
    real = engine._sample

    def sample(act, sampled, i):          # a request's own part of the step's one sampling call
        if act.request.id == "bad":
            raise ValueError("injected")
        return real(act, sampled, i)

    engine._sample = sample
    try:
        bad = engine.submit(Request("bad", tuple(prompt_of(80, 12)), max_tokens=5))
        p = prompt_of(81, 12)
        good = engine.submit(req(p, max_tokens=5))
        _, ev = collect(bad)
        toks, done = collect(good)
    finally:
        del engine._sample
    assert isinstance(ev, ErrorEvent) and "internal error" in ev.message and "injected" not in ev.message
    assert isinstance(done, DoneEvent)
    assert_same_greedy(llm, p, [t.token_id for t in toks], llm.generate(p, max_tokens=5).token_ids)
    wait_idle(engine)
    run(engine, prompt_of(80, 12), max_tokens=2)                 # its id is free again, its KV fine


def test_memory_pressure_parks_and_restores(model_path, llm):
    """KV for one sequence only: sequences are parked to the host and restored, tokens unchanged."""
    # token budget only: reads must overlap the first sequence's decode for memory to run short
    eng = _engine(model_path, kv_tokens=N_CTX, step_tokens=32, decode_share=None)
    try:
        prompts = [prompt_of(200 + i, n) for i, n in enumerate((50, 70, 90))]
        handles = [eng.submit(req(p, max_tokens=30)) for p in prompts]
        outs = []
        for p, h in zip(prompts, handles):
            toks, done = collect(h)
            ids = [t.token_id for t in toks]
            assert_same_greedy(llm, p, ids, llm.generate(p, max_tokens=30).token_ids)
            outs.append(ids)
        p2 = prompts[0] + outs[0] + [5, 6]
        _, done = run(eng, p2, max_tokens=2)
        assert done.cached_tokens == len(prompts[0]) + len(outs[0]) - 1
        assert eng._sched.metrics()["preemptions"] >= 1
        assert eng.metrics_registry.get_sample_value("strata_prompt_tokens_total", {"how": "restored"}) > 0
        assert eng.metrics_registry.get_sample_value("strata_needless_read_tokens_total") == 0
    finally:
        eng.stop()


def test_f16_prompt_attention_needs_the_cuda_backend(model_path):
    """`--prompt-attention f16` is the CUDA backend's; on the CPU the engine does not start and says why."""
    with pytest.raises(ValueError, match="prompt_attention"):
        EngineConfig(model=model_path, backend="cpu", prompt_attention="fast")
    eng = Engine(EngineConfig(model=model_path, backend="cpu", n_ctx=64, prompt_attention="f16"))
    eng.start()
    with pytest.raises(Exception):
        eng.wait_ready(60)
    assert "needs the CUDA backend" in str(eng.load_error) and not eng.ready.is_set()
    with pytest.raises(ValueError, match="needs the CUDA backend"):
        LLM(model_path, backend="cpu", n_ctx=64, prompt_attention="f16")
    with pytest.raises(ValueError, match="prompt_attention"):
        LLM(model_path, backend="cpu", n_ctx=64, prompt_attention="fast")


def test_f16_prompt_attention_refuses_a_head_dim_it_does_not_read(model_path, monkeypatch):
    """A backend with the f16 path (stood in for by the CPU backend given its attributes) refuses a model whose
    head dim the path does not read (the tiny model's 16) before the weights load, in one line."""
    from strata_lite import runner
    from strata_lite.kernels.cpu.backend import CpuBackend

    def backend(*args, **kw):
        be = CpuBackend()
        be.prompt_attention, be.prompt_head_dims = "exact", (64, 128)
        return be
    monkeypatch.setattr(runner, "get_backend", backend)
    with pytest.raises(ValueError, match=r"reads head_dim 64 or 128; .*tiny-engine.gguf has 16$"):
        runner.load_model(model_path, backend="cpu", prompt_attention="f16")


def test_load_error_is_reported(tmp_path):
    from strata_lite.engine import EngineNotReady
    eng = Engine(EngineConfig(model=str(tmp_path / "missing.gguf"), backend="cpu", n_ctx=64))
    assert eng.model_id == "missing"
    with pytest.raises(EngineNotReady):
        eng.submit(req([1, 2]))
    eng.start()
    with pytest.raises(Exception):
        eng.wait_ready(30)
    assert eng.load_error is not None and eng.stopped.is_set() and not eng.ready.is_set()
    with pytest.raises(EngineNotReady):
        eng.submit(req([1, 2]))


def test_config_validation():
    with pytest.raises(ValueError, match="kv_tokens"):
        EngineConfig(n_ctx=1024, kv_tokens=512)
    with pytest.raises(ValueError, match="parallel"):
        EngineConfig(parallel=0)
    c = EngineConfig(n_ctx=1000, parallel=3, page_size=64)
    assert c.device_kv_tokens == 3008 and c.host_kv_bytes() > 0
    assert EngineConfig(host_kv_gib=0.5).host_kv_bytes() == 2**29


def test_activity_log_lines():
    from types import SimpleNamespace
    from strata_lite.metrics import ActivityLog
    from strata_lite.sequence import AdmissionRecord
    lines, now = [], [100.0]
    logger = SimpleNamespace(info=lambda fmt, *a: lines.append(fmt % a))
    act = ActivityLog(logger, lambda: now[0])
    rec = AdmissionRecord("a", 54569, 0, 2048, 52521, 0, 0, t_admitted=100.0)
    act.admitted(rec, 0.46)
    seq = SimpleNamespace(id="a", n_computed=16384, tokens=[0] * 54569)
    now[0] = 123.0
    act.after_step([seq])
    act.token(0, "a")
    now[0] = 130.0
    rec.t_read_done = 130.0
    act.after_step([seq])
    act.tick()
    assert lines == ["a: restored 2048 tokens from host in 0.46 s",
                     "a: reading the prompt: 16,384 of 54,569 tokens, 23 s so far",
                     "a: prompt 54569 tokens = 0 reused + 2048 restored + 52521 read in 30.0 s",
                     "decoding: slot 0 0.0 tok/s (a)"]
