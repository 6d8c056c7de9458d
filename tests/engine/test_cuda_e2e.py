"""End to end on the GPU: the CUDA backend against the CPU backend on synthetic models of the two benchmark
shapes (`strata-lite synth`: the Qwen2.5-0.5B shape and 8 blocks of the Llama-8B shape), the decode graphs
against the eager forward, and greedy generation (the engine and server on the GPU:
tests/server/test_cuda_server.py).

Bars: mean KL(cpu || cuda) <= 0.01 over every position of a prompt, and argmax agreement >= 99% at the
positions where the CPU's top-1/top-2 margin is >= 0.25 logits (the rule the golden test applies against
llama.cpp). Both backends round activations the same way (ggml's Q8_0 / Q8_K) and differ only in float
summation order, but that 1e-7-relative difference moves an activation across a rounding boundary now and
then, which shifts that token's logits by up to ~4% of their range on these random-weight models (measured
on the H200: max |diff| / max |logit| 0.035-0.040, mean KL 5.6e-4 to 6.3e-4). Random weights give flat
distributions (top-2 margins of ~0.1 logits), so over all positions the argmax agrees at only ~90%
(0.895-0.910 measured); the margin rule keeps the positions a real difference would flip.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

N_TOK = 200
MODELS = [("qwen2.5-0.5b", "q4_k_m"), ("llama-8b-layers", "q4_k_m"), ("llama-8b-layers", "iq3_xxs")]


@pytest.fixture(scope="module", params=MODELS, ids=["-".join(m) for m in MODELS])
def synth_path(request, tmp_path_factory):
    from strata_lite.loader.synth import synth_model
    preset, mix = request.param
    path = tmp_path_factory.mktemp("synth") / f"{preset}-{mix}.gguf"
    synth_model(path, preset, quant=mix, progress=False)
    return str(path)


def _prompt(n_vocab, n=N_TOK, seed=0):
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def _kl(p_logits, q_logits):
    """Mean over rows of KL(softmax p || softmax q), float64."""
    p = p_logits.astype(np.float64)
    q = q_logits.astype(np.float64)
    lp = p - p.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq = q - q.max(1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    return float((np.exp(lp) * (lp - lq)).sum(1).mean())


def _assert_within_bars(ref, got, label):
    """The module docstring's bars for logits got against ref (n, n_vocab): argmax agreement >= 99% where ref's
    top-1/top-2 margin is >= 0.25 (at least 20 such positions), mean KL <= 0.01."""
    same = ref.argmax(1) == got.argmax(1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= 0.25
    kl = _kl(ref, got)
    rel = float(np.abs(ref - got).max() / np.abs(ref).max())
    print(f"{label}: argmax agreement {same.mean():.4f} overall, {same[clear].mean():.4f} at the "
          f"{clear.sum()} positions with margin >= 0.25; mean KL {kl:.2e}, max |diff| / max |logit| {rel:.2e}")
    assert clear.sum() >= 20
    assert same[clear].mean() >= 0.99
    assert kl <= 0.01


def test_cuda_logits_match_cpu(synth_path):
    from strata_lite import LLM
    cpu = LLM(synth_path, backend="cpu", n_ctx=256, n_batch=64)
    ids = _prompt(cpu.config.n_vocab)
    ref = cpu.logits(ids)
    del cpu
    gpu = LLM(synth_path, backend="cuda", n_ctx=256, n_batch=64)
    got = gpu.logits(ids)
    assert np.isfinite(got).all()
    _assert_within_bars(ref, got, synth_path)


def test_f16_prompt_attention_reads_prompts_as_the_exact_kernels_do(synth_path):
    """The backend's f16 prompt attention (attention_f16.py: `--prompt-attention f16`) against the exact kernels
    on the same prompt, read in 64-token chunks (the later ones at depth): the bars of the CPU comparison above,
    and a decode step replaying its graph after the f16 reads (graphs keep the exact kernels)."""
    from strata_lite import LLM
    from strata_lite.batch import Batch
    gpu = LLM(synth_path, backend="cuda", n_ctx=256, n_batch=64)
    ids = _prompt(gpu.config.n_vocab)
    ref = gpu.logits(ids)
    gpu.backend.prompt_attention = "f16"
    try:
        got = gpu.logits(ids)
        step = gpu.backend.to_host(gpu.forward(Batch.single(ids[:1], len(ids), gpu._pages, [0])))
    finally:
        gpu.backend.prompt_attention = "exact"
    assert np.isfinite(got).all() and np.isfinite(step).all()
    _assert_within_bars(ref, got, f"{synth_path}: f16 prompt attention")


def test_f16_prompt_reads_keep_their_bits_however_the_plan_chunks_them(synth_path):
    """`--prompt-attention f16` with the rows the step plan marks as prompt reads (Batch.decode_rows): a 200-token
    prompt read in one chunk, in 64-token chunks (the last one 8 tokens, under Batch.SHORT_RUN) and, its last 10
    tokens, beside two decode tokens in a mixed step: every prompt token's logits the same bits."""
    from strata_lite.batch import Batch
    from strata_lite.runner import ModelRunner, load_model
    loaded = load_model(synth_path, backend="cuda")
    runner = ModelRunner(loaded, kv_tokens=1024, page_size=64, host_bytes=0, n_ctx=512,
                         max_step_tokens=N_TOK, max_seqs=4)
    be = runner.backend
    be.prompt_attention = "f16"
    ids = _prompt(loaded.config.n_vocab, seed=5)
    pages, a, b = runner.kv.alloc(4), runner.kv.alloc(2), runner.kv.alloc(2)

    def read(tokens, start, table):                     # a plan's batch of one prompt read: decode_rows 0
        n = len(tokens)
        return Batch(np.asarray(tokens, np.int32), np.arange(start, start + n, dtype=np.int32), np.zeros(n, np.int32),
                     np.asarray([table], np.int32), np.arange(n, dtype=np.int32), decode_rows=0)
    whole = be.to_host(runner.forward(read(ids, 0, pages)))
    chunked = np.concatenate([be.to_host(runner.forward(read(ids[i:i + 64], i, pages))) for i in range(0, N_TOK, 64)])
    np.testing.assert_array_equal(chunked, whole)
    runner.forward(read(ids[:100], 0, a))
    runner.forward(read(ids[:60], 0, b))
    runner.forward(read(ids[:190], 0, pages))
    tables = np.zeros((3, 4), np.int32)
    tables[0], tables[1, :2], tables[2, :2] = pages, a, b
    step = Batch(np.concatenate([[ids[100], ids[60]], ids[190:]]).astype(np.int32),
                 np.concatenate([[100, 60], np.arange(190, 200)]).astype(np.int32),
                 np.array([1, 2] + [0] * 10, np.int32), tables, np.arange(12, dtype=np.int32), decode_rows=2)
    assert step.prompt_runs == ((2, 12, 0, 200),) and runner.graphs.accepts(step)    # a graph's shape: run eagerly
    got = be.to_host(runner.forward(step))
    assert runner.step_results is None
    np.testing.assert_array_equal(got[2:], whole[190:])


def test_prompt_chunks_and_decode_graphs_are_batch_invariant(synth_path):
    """A token's logits are the same bits whether it is read in a 200-token prompt chunk, in a 64-token
    chunk, or decoded alone through a captured graph next to padded rows (every kernel computes each token
    with a fixed order of its own). On sm_90 and newer the graphs are captured with programmatic dependent
    launches (kernels/cuda/pdl.py), so this also checks that they leave the bits alone."""
    import cupy as cp
    from strata_lite.batch import Batch
    from strata_lite.runner import ModelRunner, load_model
    loaded = load_model(synth_path, backend="cuda")
    runner = ModelRunner(loaded, kv_tokens=1024, page_size=64, host_bytes=0, n_ctx=512,
                         max_step_tokens=N_TOK, max_seqs=4)
    assert runner.graphs is not None
    if int(cp.cuda.Device().compute_capability) >= 90:
        assert runner.graphs.programmatic, runner.graphs.programmatic_error
    be = runner.backend
    ids = _prompt(loaded.config.n_vocab, seed=1)
    pages = runner.kv.alloc(4)
    whole = be.to_host(runner.forward(Batch.single(ids, 0, pages)))                   # one chunk of 200
    chunked = np.concatenate([be.to_host(runner.forward(Batch.single(ids[i:i + 64], i, pages)))
                              for i in range(0, N_TOK, 64)])                           # 64-token chunks
    np.testing.assert_array_equal(whole, chunked)
    runner.forward(Batch.single(ids[:-1], 0, pages, logit_rows=[]))                   # cache = all but the last
    one = Batch.single(ids[-1:], N_TOK - 1, pages)
    assert runner.graphs.accepts(one)
    decoded = be.to_host(runner.forward(one))                                          # graph, bucket 1
    np.testing.assert_array_equal(decoded[0], whole[-1])
    # the same token as row 2 of a 3-token decode step (bucket 4, one padded row), beside two others
    other = runner.kv.alloc(8)
    runner.forward(Batch.single(ids[:100], 0, other[:4], logit_rows=[]))
    runner.forward(Batch.single(ids[:50], 0, other[4:], logit_rows=[]))
    tables = np.stack([np.asarray(pages, np.int32), np.asarray(other[:4], np.int32), np.asarray(other[4:], np.int32)])
    step = Batch(np.array([ids[100], ids[50], ids[-1]], np.int32), np.array([100, 50, N_TOK - 1], np.int32),
                 np.array([1, 2, 0], np.int32), tables, np.arange(3))
    assert runner.graphs.accepts(step)
    three = be.to_host(runner.forward(step))
    np.testing.assert_array_equal(three[2], whole[-1])


def test_a_mixed_step_gives_its_decode_tokens_and_its_chunk_their_own_bits(synth_path):
    """A mixed step (two decode tokens, then a 100-token prompt chunk of a third sequence: more tokens than the
    attention workspace splits, so the decode tokens' attention runs split-parallel apart and the chunk's tiled)
    gives the decode tokens the bits of a decode step of their own (a captured graph) and the chunk the bits of
    its forward alone."""
    from strata_lite.batch import Batch
    from strata_lite.runner import ModelRunner, load_model
    loaded = load_model(synth_path, backend="cuda")
    runner = ModelRunner(loaded, kv_tokens=1024, page_size=64, host_bytes=0, n_ctx=512,
                         max_step_tokens=N_TOK, max_seqs=4)
    be = runner.backend
    ids = _prompt(loaded.config.n_vocab, seed=3)
    a, b, alone, mixed = runner.kv.alloc(4), runner.kv.alloc(2), runner.kv.alloc(2), runner.kv.alloc(2)
    runner.forward(Batch.single(ids[:150], 0, a, logit_rows=[]))
    runner.forward(Batch.single(ids[:60], 0, b, logit_rows=[]))
    tables = np.zeros((3, 4), np.int32)
    tables[0], tables[1, :2], tables[2, :2] = a, b, mixed
    decode = Batch(np.array([ids[150], ids[60]], np.int32), np.array([150, 60], np.int32),
                   np.array([0, 1], np.int32), tables[:2], np.arange(2))
    assert runner.graphs.accepts(decode)
    want_decode = be.to_host(runner.forward(decode))
    chunk = ids[100:200]
    want_chunk = be.to_host(runner.forward(Batch.single(chunk, 0, alone)))
    step = Batch(np.concatenate([decode.token_ids, chunk]),
                 np.concatenate([decode.positions, np.arange(100, dtype=np.int32)]),
                 np.array([0, 1] + [2] * 100, np.int32), tables, np.arange(102))
    assert step.short_run_rows == 2 and not runner.graphs.accepts(step)
    got = be.to_host(runner.forward(step))
    np.testing.assert_array_equal(got[:2], want_decode)
    np.testing.assert_array_equal(got[2:], want_chunk)


def test_decode_steps_of_many_sequences_replay_bucket_32_with_the_bits_of_prompt_chunks(synth_path):
    """20 sequences decoding together replay the 32-token graph (captured for an engine of 32 sequences:
    graphs.step_buckets) beside 12 padded rows, through the small-token kernels (Q4_K / Q5_K) and mmq's
    narrow variant on the wide matrices (qmatmul.small_variant); each token gets the bits of the last row of
    its own prompt read as one chunk (20-58 tokens: the same kernels' other choices)."""
    from strata_lite.batch import Batch
    from strata_lite.runner import ModelRunner, load_model
    loaded = load_model(synth_path, backend="cuda")
    runner = ModelRunner(loaded, kv_tokens=64 * 48, page_size=64, host_bytes=0, n_ctx=128, max_step_tokens=64,
                         max_seqs=32)
    assert runner.graphs.buckets[-1] == 32
    be, n_seq = runner.backend, 20
    refs, tables, ids, pos = [], [], [], []
    for i in range(n_seq):
        toks = _prompt(loaded.config.n_vocab, n=20 + 2 * i, seed=10 + i)
        pages = runner.kv.alloc(2)
        refs.append(be.to_host(runner.forward(Batch.single(toks, 0, pages)))[-1])
        tables.append(np.asarray(pages, np.int32))
        ids.append(toks[-1])
        pos.append(len(toks) - 1)
    step = Batch(np.array(ids, np.int32), np.array(pos, np.int32), np.arange(n_seq, dtype=np.int32),
                 np.stack(tables), np.arange(n_seq))
    assert runner.graphs.accepts(step) and runner.graphs.bucket(step)[0] == 32
    got = be.to_host(runner.forward(step))
    for i in range(n_seq):
        np.testing.assert_array_equal(got[i], refs[i], err_msg=f"sequence {i}")


def test_verify_steps_replay_graphs_with_the_bits_of_prompt_chunks(synth_path):
    """A speculative verify step (a sequence's pending token and two drafts, beside another sequence's one
    token) is replayed from a graph, and each token's logits are the bits of its prompt-chunk row."""
    from strata_lite.batch import Batch
    from strata_lite.runner import ModelRunner, load_model
    loaded = load_model(synth_path, backend="cuda")
    runner = ModelRunner(loaded, kv_tokens=1024, page_size=64, host_bytes=0, n_ctx=512,
                         max_step_tokens=N_TOK, max_seqs=4)
    be = runner.backend
    ids = _prompt(loaded.config.n_vocab, seed=5)
    pages = runner.kv.alloc(4)
    whole = be.to_host(runner.forward(Batch.single(ids, 0, pages)))
    a, b = runner.kv.alloc(4), runner.kv.alloc(4)
    runner.forward(Batch.single(ids[:100], 0, a, logit_rows=[]))
    runner.forward(Batch.single(ids[:50], 0, b, logit_rows=[]))
    tables = np.stack([np.asarray(a, np.int32), np.asarray(b, np.int32)])
    step = Batch(np.array([ids[100], ids[101], ids[102], ids[50]], np.int32), np.array([100, 101, 102, 50], np.int32),
                 np.array([0, 0, 0, 1], np.int32), tables, np.arange(4))
    assert runner.graphs.accepts(step) and runner.graphs.bucket(step)[0] == 4
    got = be.to_host(runner.forward(step))
    np.testing.assert_array_equal(got[:3], whole[100:103])
    np.testing.assert_array_equal(got[3], whole[50])


def test_graphs_return_the_hidden_states_an_mtp_drafter_reads(synth_path):
    """Graphs of a forward that returns (logits, last hidden states), the first two outputs of the runner's
    capture for an MTP drafter (MtpDrafter.step_forward; its block rows: tests/engine/test_mtp_cuda.py),
    replay both with the bits of the eager forward (a verify-shaped step)."""
    from strata_lite.batch import Batch
    from strata_lite.kernels.cuda.graphs import StepGraphs
    from strata_lite.runner import ModelRunner, load_model
    loaded = load_model(synth_path, backend="cuda")
    runner = ModelRunner(loaded, kv_tokens=1024, page_size=64, host_bytes=0, n_ctx=512,
                         max_step_tokens=N_TOK, max_seqs=4)
    be, kv = runner.backend, runner.kv
    graphs = StepGraphs(lambda b: runner.model.forward(b, kv, all_hidden=True), max_pages=8, max_keys=512,
                        scratch_page=runner.scratch_page, buckets=(4,))
    ids = _prompt(loaded.config.n_vocab, seed=7)
    a = kv.alloc(4)
    runner.forward(Batch.single(ids[:60], 0, a, logit_rows=[]))
    step = Batch.single(ids[60:63], 60, a)
    want_logits, want_hidden = (be.to_host(t) for t in runner.model.forward(step, kv, all_hidden=True))
    assert graphs.accepts(step)
    got_logits, got_hidden = (be.to_host(t) for t in graphs.run(step))
    np.testing.assert_array_equal(got_logits, want_logits)
    np.testing.assert_array_equal(got_hidden, want_hidden)


def test_decode_graphs_per_key_bucket_give_the_same_bits(synth_path, monkeypatch):
    """Graphs captured for fewer keys than the context (key buckets 128 and 512 here) give a token the bits
    of its prompt-chunk row, whichever bucket replays it."""
    from strata_lite.batch import Batch
    from strata_lite.kernels.cuda import graphs
    from strata_lite.runner import ModelRunner, load_model
    monkeypatch.setattr(graphs, "KEY_BUCKET_MIN", 128)
    loaded = load_model(synth_path, backend="cuda")
    runner = ModelRunner(loaded, kv_tokens=1024, page_size=64, host_bytes=0, n_ctx=512,
                         max_step_tokens=N_TOK, max_seqs=4)
    assert runner.graphs.key_buckets == (128, 512)
    be = runner.backend
    ids = _prompt(loaded.config.n_vocab, seed=3)
    pages = runner.kv.alloc(4)
    whole = be.to_host(runner.forward(Batch.single(ids, 0, pages)))
    for pos, keys in ((100, 128), (127, 128), (128, 512), (199, 512)):
        one = Batch.single(ids[pos:pos + 1], pos, pages)
        assert runner.graphs.accepts(one) and runner.graphs.bucket(one) == (1, keys)
        np.testing.assert_array_equal(be.to_host(runner.forward(one))[0], whole[pos])


def test_generate_greedy_on_cuda_equals_its_teacher_forced_argmax(synth_path):
    """LLM.generate on the CUDA backend (decode steps replayed from graphs, device sampling): every greedy
    token is the argmax of the same backend's logits for the whole sequence read as one prompt (exact: a
    token's logits do not depend on the step that computed it). How close those logits are to the CPU's:
    test_cuda_logits_match_cpu (comparing greedy tokens with the CPU's instead fails on these random-weight
    models whenever a rounding flip moves a near-tied argmax: flips shift logits by up to ~4% of their
    range, see the top)."""
    from strata_lite import LLM
    prompt = [int(t) for t in _prompt(1000, n=24, seed=2)]
    llm = LLM(synth_path, backend="cuda", n_ctx=128)
    replays = []
    run = llm.graphs.run
    llm.graphs.run = lambda batch: replays.append(len(batch.token_ids)) or run(batch)
    out = list(llm.generate(prompt, max_tokens=16, temperature=0.0).token_ids)
    llm.graphs.run = run
    assert out and replays == [1] * (len(out) - 1)            # every decode step replayed a graph
    logits = llm.logits(prompt + out)[len(prompt) - 1:-1]
    assert out == [int(t) for t in logits.argmax(1)]
