"""The CPU's one-call decoder block (kernels/cpu/decode_block.py) and its work-sharing form
(kernels/cpu/decode_block_shared.py, STRATA_LITE_DECODE_BLOCK=shared) against the per-call path they replace for
steps of up to MAX_TOK tokens: logits bit for bit, for every matrix route (4-row interleaved, nibble
repackings, own blocks, F16 / BF16 / F32 rows; serial and parallel mat-vecs), q/k/v fused or split, with biases,
q/k norms and K smoothing, one sequence or several in a step, a key range split over threads, and the shared
block's workers run one after another. And which blocks it takes: none where a matrix has no int8 or float
mat-vec kernel (STRATA_LITE_INT8=0), where the attention q.k path is not the float one, or where
STRATA_LITE_DECODE_BLOCK=0."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite import LLM
from strata_lite.batch import Batch
from strata_lite.kernels.cpu import repack as rp
from strata_lite.kernels.cpu.backend import CpuBackend
from strata_lite.kernels.cpu.decode_block import MAX_TOK
from tiny_model import write_tiny_model

pytestmark = pytest.mark.skipif(not CpuBackend().int8, reason="the int8 kernels need AVX2 (this CPU has none)")

K_SHAPES = dict(n_embd=256, n_heads=4, n_kv_heads=2, n_ff=512)     # rows of 256: K-quants and IQ3_XXS
CASES = {
    "q8_0 rows4": dict(qtype=QT.Q8_0),
    "q5_0 rows4, v in q8_0 (q+k and v)": dict(qtype=QT.Q5_0, qtype_of={"attn_v": QT.Q8_0}),
    "q4_k, down q6_k": dict(qtype=QT.Q4_K, qtype_of={"ffn_down": QT.Q6_K}, **K_SHAPES),
    # ffn_down rows of 16 Q6_K blocks (3,456 bytes): one row a call at one token (nibble_int8.ONE_ROW_MIN_BYTES)
    "q4_k, down q6_k, long rows": dict(qtype=QT.Q4_K, qtype_of={"ffn_down": QT.Q6_K}, **{**K_SHAPES, "n_ff": 4096}),
    "iq3_xxs, q5_k": dict(qtype=QT.IQ3_XXS, qtype_of={"ffn_down": QT.Q5_K, "attn_output": QT.Q5_K}, **K_SHAPES),
    "qwen3 (q/k norms), iq4_nl": dict(arch="qwen3", qtype=QT.IQ4_NL),
    "llama (no biases), q4_0": dict(arch="llama", qtype=QT.Q4_0),
}


def _layers(llm):
    return llm.model.layers


def _logits_both_ways(llm, batch):
    """(one-call logits, per-call logits) of the same batch; the step stores the same K/V either way."""
    fused = np.array(llm.model.forward(batch, llm.kv))
    saved = [layer.compiled for layer in _layers(llm)]
    try:
        for layer in _layers(llm):
            layer.compiled = None
        per_call = np.array(llm.model.forward(batch, llm.kv))
    finally:
        for layer, c in zip(_layers(llm), saved):
            layer.compiled = c
    return fused, per_call


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("decode_block")
    paths = {}
    for name, kw in CASES.items():
        paths[name] = d / (name.split()[0].replace("(", "") + f"-{len(paths)}.gguf")
        write_tiny_model(paths[name], n_layers=2, seed=len(paths), **kw)
    return paths


def test_its_steps_are_mat_vec_sized():
    """The per-call path takes the prompt GEMMs from their MIN_TOK on; the block calls the mat-vec kernels."""
    from strata_lite.kernels.cpu import nibble_gemm, q8_0_gemm, rows4_gemm
    assert MAX_TOK < min(nibble_gemm.MIN_TOK, q8_0_gemm.MIN_TOK, rows4_gemm.MIN_TOK)


MODES = {"serial mat-vecs": (True, "1"), "parallel mat-vecs": (False, "1"), "shared": (False, "shared")}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_one_call_block_gives_the_per_call_bits(models, case, mode, monkeypatch):
    small, block = MODES[mode]
    monkeypatch.setattr(rp, "SMALL_BYTES", 1 << 30 if small else 0)     # serial / parallel mat-vecs
    monkeypatch.setenv("STRATA_LITE_DECODE_BLOCK", block)
    llm = LLM(str(models[case]), backend="cpu", n_ctx=256)
    assert all(layer.compiled is not None for layer in _layers(llm))
    ids = np.random.default_rng(4).integers(0, llm.config.n_vocab, 200).astype(np.int32)
    llm.eval(ids[:150], 0, [149])                                      # a prompt (per-call path: > MAX_TOK)
    pos = 150
    for n in (1, 3, MAX_TOK, 1):
        fused, per_call = _logits_both_ways(llm, Batch.single(ids[pos:pos + n], pos, llm._pages))
        np.testing.assert_array_equal(fused, per_call)
        pos += n


@pytest.mark.parametrize("block", ["1", "shared"])
def test_several_sequences_in_one_step(models, block, monkeypatch):
    """A decode step of two sequences at different positions (the engine's batched decode)."""
    monkeypatch.setenv("STRATA_LITE_DECODE_BLOCK", block)
    llm = LLM(str(models["q5_0 rows4, v in q8_0 (q+k and v)"]), backend="cpu", n_ctx=256)
    half = len(llm._pages) // 2
    tables = np.asarray([llm._pages[:half], llm._pages[half:2 * half]], np.int32)
    rng = np.random.default_rng(5)
    lens = (90, 37)
    for s, n in enumerate(lens):
        ids = rng.integers(0, llm.config.n_vocab, n).astype(np.int32)
        llm.model.forward(Batch(ids, np.arange(n, dtype=np.int32), np.full(n, s, np.int32), tables, [n - 1]),
                          llm.kv)
    step = Batch(rng.integers(0, llm.config.n_vocab, 3).astype(np.int32), np.array([90, 37, 38], np.int32),
                 np.array([0, 1, 1], np.int32), tables, [0, 1, 2])
    step.validate(llm.kv.n_pages, llm.kv.page_size, llm.config.n_vocab)
    fused, per_call = _logits_both_ways(llm, step)
    np.testing.assert_array_equal(fused, per_call)


@pytest.mark.parametrize("block", ["1", "shared"])
def test_own_block_matrices(models, block, monkeypatch):
    """Q5_0 / Q8_0 matrices kept in their own blocks (as matrices of row counts that are not a multiple of 4)."""
    monkeypatch.setenv("STRATA_LITE_DECODE_BLOCK", block)
    for qtype in (QT.Q5_0, QT.Q8_0):
        monkeypatch.delitem(rp._INT8_LAYOUT_OF, qtype)
    llm = LLM(str(models["q5_0 rows4, v in q8_0 (q+k and v)"]), backend="cpu", n_ctx=256)
    assert llm.model.layers[0].qk.layout == rp.GGML and llm.model.layers[0].compiled is not None
    ids = np.random.default_rng(6).integers(0, llm.config.n_vocab, 60).astype(np.int32)
    llm.eval(ids[:50], 0, [49])
    for pos, n in ((50, 1), (51, 5)):
        fused, per_call = _logits_both_ways(llm, Batch.single(ids[pos:pos + n], pos, llm._pages))
        np.testing.assert_array_equal(fused, per_call)


@pytest.mark.parametrize("block", ["1", "shared"])
def test_keys_split_over_threads(tmp_path, block, monkeypatch):
    """One KV head and one token: fewer attention items than threads, so past 512 keys the keys are split and the
    splits merged (attention._plan), in the block as on the per-call path."""
    monkeypatch.setenv("STRATA_LITE_DECODE_BLOCK", block)
    path = write_tiny_model(tmp_path / "kv1.gguf", n_heads=4, n_kv_heads=1, seed=11)
    llm = LLM(str(path), backend="cpu", n_ctx=1024, n_threads=2)
    ids = np.random.default_rng(8).integers(0, llm.config.n_vocab, 700).astype(np.int32)
    llm.eval(ids[:600], 0, [599])
    fused, per_call = _logits_both_ways(llm, Batch.single(ids[600:601], 600, llm._pages))
    np.testing.assert_array_equal(fused, per_call)


def test_shared_block_workers_one_after_another(models, monkeypatch):
    """The shared block with two workers that Numba runs one after the other on one thread (as an OS may when
    the machine is busy): the first does every chunk, the second finds them taken; no wait is left hanging and
    the bits are the per-call path's."""
    import numba
    from strata_lite.kernels.cpu import decode_block
    monkeypatch.setenv("STRATA_LITE_DECODE_BLOCK", "shared")
    llm = LLM(str(models["q4_k, down q6_k"]), backend="cpu", n_ctx=256, n_threads=2)
    ids = np.random.default_rng(9).integers(0, llm.config.n_vocab, 40).astype(np.int32)
    llm.eval(ids[:30], 0, [29])
    before = numba.get_num_threads()
    monkeypatch.setattr(decode_block.numba, "get_num_threads", lambda: 2)   # the block's n_threads
    numba.set_num_threads(1)                                                # the region's threads
    try:
        for pos, n in ((30, 1), (31, 4)):
            fused, per_call = _logits_both_ways(llm, Batch.single(ids[pos:pos + n], pos, llm._pages))
            np.testing.assert_array_equal(fused, per_call)
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("qtype,other", [(QT.F16, QT.Q8_0), (QT.BF16, QT.F16), (QT.F32, QT.Q8_0), (QT.F32, QT.F16)],
                         ids=["f16, v q8_0", "bf16, down f16", "f32, v q8_0", "f32, down f16"])
def test_half_blocks_give_the_per_call_bits(tmp_path, qtype, other, monkeypatch):
    """F16 / BF16 / F32 matrices (half_matvec's kernel) in the one-call block, beside an int8 one or each other;
    the shared block leaves such blocks on the per-call path."""
    path = tmp_path / "half.gguf"
    write_tiny_model(path, qtype=qtype, qtype_of={"attn_v" if other == QT.Q8_0 else "ffn_down": other})
    llm = LLM(str(path), backend="cpu", n_ctx=256)
    assert all(layer.compiled is not None for layer in _layers(llm))
    ids = np.random.default_rng(6).integers(0, llm.config.n_vocab, 160).astype(np.int32)
    llm.eval(ids[:150], 0, [149])
    pos = 150
    for n in (1, MAX_TOK, 1):
        fused, per_call = _logits_both_ways(llm, Batch.single(ids[pos:pos + n], pos, llm._pages))
        assert np.isfinite(fused).all()
        np.testing.assert_array_equal(fused, per_call)
        pos += n
    monkeypatch.setenv("STRATA_LITE_DECODE_BLOCK", "shared")
    assert all(layer.compiled is None for layer in _layers(LLM(str(path), backend="cpu", n_ctx=64)))


def test_blocks_it_does_not_take(models, monkeypatch):
    monkeypatch.setenv("STRATA_LITE_INT8", "0")    # the float kernels: no int8 or half mat-vec reads the rows
    llm = LLM(str(models["q8_0 rows4"]), backend="cpu", n_ctx=64)
    assert all(layer.compiled is None for layer in _layers(llm))
    monkeypatch.delenv("STRATA_LITE_INT8")
    path = str(models["q4_k, down q6_k"])          # head_dim 64: the int8 q.k path applies
    monkeypatch.setenv("STRATA_LITE_ATTN_QK", "int8")
    assert all(layer.compiled is None for layer in _layers(LLM(path, backend="cpu", n_ctx=64)))
    monkeypatch.delenv("STRATA_LITE_ATTN_QK")
    monkeypatch.setenv("STRATA_LITE_DECODE_BLOCK", "0")
    llm = LLM(path, backend="cpu", n_ctx=64)
    assert all(layer.compiled is None for layer in _layers(llm))
    assert np.isfinite(llm.eval([1, 2, 3], 0, [2])).all()


def test_the_mtp_block_takes_it_too(tmp_path):
    from strata_lite.loader.gguf_file import GGUFFile
    from strata_lite.loader.mtp import load_mtp
    from strata_lite.models.mtp import MtpHead
    path = write_tiny_model(tmp_path / "mtp.gguf", mtp=True, n_ff=256)
    llm = LLM(str(path), backend="cpu", n_ctx=128)
    head = MtpHead(llm.model, load_mtp(GGUFFile(path), llm.config))
    assert head.layer.compiled is not None
    cfg = llm.config
    layer = tuple(a[0] for a in llm.backend.kv_arrays(1, llm.kv.n_pages, llm.kv.page_size, cfg.n_kv_heads,
                                                      cfg.head_dim))
    ids = np.array([5, 17, 200, 3, 99], np.int32)
    hidden = np.random.default_rng(7).standard_normal((4, cfg.n_embd)).astype(np.float32)
    batch = Batch.single(ids[1:], 0, llm._pages)
    fused = head.forward(batch, hidden, layer)
    compiled, head.layer.compiled = head.layer.compiled, None
    per_call = head.forward(batch, hidden, layer)
    head.layer.compiled = compiled
    for a, b in zip(fused, per_call):
        np.testing.assert_array_equal(a, b)
