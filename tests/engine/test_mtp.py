"""The MTP block (loader/mtp.py, models/mtp.py) on tiny models written with GGUFWriter: the main forward
ignores it, its forward matches a float64 numpy reference, it is batch-invariant like the main forward,
and bad files fail with one clear line."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite import LLM
from strata_lite.batch import Batch
from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.mtp import load_mtp
from strata_lite.models.mtp import MtpHead
from reference_model import reference_hidden, reference_mtp_logits
from tiny_model import write_tiny_model

# As tests/engine/test_api.py (docs/bounds.md): the reference rounds activations and K/V as the engine does
# and computes the rest in float64; the engine's float32 stays within 1e-4 of the logit range.
REL_TOL = 1e-4
IDS = [5, 17, 200, 3, 99, 42, 7, 7, 120, 64, 33, 8, 150]


def _close(ours, ref):
    return np.abs(np.asarray(ours, np.float64) - ref).max() <= REL_TOL * np.abs(ref).max()


@pytest.fixture(scope="module", params=[("qwen2", QT.Q8_0), ("llama", QT.Q5_0)], ids=lambda p: f"{p[0]}-{p[1].name}")
def tiny(request, tmp_path_factory):
    arch, qtype = request.param
    d = tmp_path_factory.mktemp(arch)
    kw = dict(arch=arch, qtype=qtype, n_embd=64, n_ff=256, n_heads=4, n_kv_heads=2)
    with_mtp = write_tiny_model(d / "mtp.gguf", mtp=True, **kw)
    without = write_tiny_model(d / "plain.gguf", **kw)
    llm = LLM(str(with_mtp), backend="cpu", n_ctx=256)
    return llm, with_mtp, without


def _main_hidden(llm, ids):
    batch = Batch.single(ids, 0, llm._pages)
    batch.validate(llm.kv.n_pages, llm.kv.page_size, llm.config.n_vocab)
    return llm.model.forward(batch, llm.kv, return_hidden=True)


def _mtp_run(llm, head, ids, hidden, chunks):
    """The MTP block over rows i = 0 .. len(ids) - 2 in the given chunks, with its own KV layer."""
    cfg = llm.config
    kv = llm.backend.kv_arrays(1, llm.kv.n_pages, llm.kv.page_size, cfg.n_kv_heads, cfg.head_dim)
    layer = tuple(a[0] for a in kv)
    out = []
    for lo, hi in chunks:
        b = Batch.single(ids[lo + 1:hi + 1], lo, llm._pages)
        b.validate(llm.kv.n_pages, llm.kv.page_size, cfg.n_vocab)
        out.append(head.forward(b, hidden[lo:hi], layer)[0])
    return np.concatenate(out)


def test_config_counts_the_mtp_block_apart(tiny):
    llm, _, _ = tiny
    assert llm.config.n_layers == 2 and llm.config.n_mtp_layers == 1 and len(llm.weights.layers) == 2


def test_main_forward_ignores_the_mtp_block(tiny):
    llm, _, without = tiny
    plain = LLM(str(without), backend="cpu", n_ctx=256)
    assert plain.config.n_mtp_layers == 0
    np.testing.assert_array_equal(llm.logits(IDS), plain.logits(IDS))


def test_mtp_forward_matches_float64_reference(tiny):
    llm, path, _ = tiny
    mtp = load_mtp(GGUFFile(path), llm.config)
    head = MtpHead(llm.model, mtp)
    _, hidden = _main_hidden(llm, IDS)
    assert _close(hidden, reference_hidden(llm.config, llm.weights, IDS, k_scales=llm.model.k_scales))
    ours = _mtp_run(llm, head, IDS, hidden, [(0, len(IDS) - 1)])
    ref = reference_mtp_logits(llm.config, llm.weights, mtp, IDS, hidden, k_scale=head.k_scales)
    assert ours.shape == ref.shape == (len(IDS) - 1, llm.config.n_vocab)
    assert _close(ours, ref)


def test_mtp_forward_is_the_same_in_chunks(tiny):
    """Rows fed in two steps (the cache holding the first) give the rows of one pass: bit for bit where
    the backend is batch-invariant (the int8 kernels), else within test_api's FLIP_TOL."""
    llm, path, _ = tiny
    head = MtpHead(llm.model, load_mtp(GGUFFile(path), llm.config))
    _, hidden = _main_hidden(llm, IDS)
    n = len(IDS) - 1
    one = _mtp_run(llm, head, IDS, hidden, [(0, n)])
    two = _mtp_run(llm, head, IDS, hidden, [(0, 5), (5, n)])
    if llm.backend.int8:
        np.testing.assert_array_equal(two, one)
    else:
        np.testing.assert_allclose(two, one, rtol=0, atol=0.03 * np.abs(one).max())


@pytest.mark.parametrize("n_kv_only", [4, 11], ids=["compiled-block-rows", "per-call-rows"])
def test_kv_rows_alone_are_the_rows_of_the_whole_block(tiny, n_kv_only):
    """MtpHead.block_at_rows without kept rows (a fill's rows that only need their K and V: attention and FFN
    skipped) writes the KV layer's bits of the whole block's forward, and the next row's block output after them
    is the bits of one whole pass (where the backend is batch-invariant). 4 rows: the whole block runs as the backend's one-call
    block (<= 8 tokens) while the K / V rows alone take the per-call kernels; 11: both per call."""
    llm, path, _ = tiny
    if not llm.backend.int8:
        pytest.skip("the float kernels are not batch-invariant (test_mtp_forward_is_the_same_in_chunks)")
    cfg, be = llm.config, llm.backend
    head = MtpHead(llm.model, load_mtp(GGUFFile(path), cfg))
    _, hidden = _main_hidden(llm, IDS)
    n = n_kv_only + 1

    def layer():
        return tuple(a[0] for a in be.kv_arrays(1, llm.kv.n_pages, llm.kv.page_size, cfg.n_kv_heads, cfg.head_dim))

    def rows(lo, hi):
        b = Batch.single(IDS[lo + 1:hi + 1], lo, llm._pages)
        b.validate(llm.kv.n_pages, llm.kv.page_size, cfg.n_vocab)
        return b

    whole = layer()
    want = be.to_host(head.forward(rows(0, n), hidden[:n], whole)[1])[-1]
    split = layer()
    head.block_at_rows(rows(0, n_kv_only), hidden[:n_kv_only], split, [])
    got = be.to_host(head.forward(rows(n_kv_only, n), hidden[n_kv_only:n], split)[1])[-1]
    for a, b in zip(split, whole):
        np.testing.assert_array_equal(be.to_host(a), be.to_host(b))
    np.testing.assert_array_equal(got, want)


def test_a_small_fill_through_the_one_call_block_gives_the_split_paths_bits(tiny):
    """A fill of at most 8 rows with a kept row runs the backend's one-call block on every row (transformer.
    block_at_rows); the K / V rows it stores and the kept row's output are the bits of the split path (the other
    rows' K and V alone, then the block on the kept row), which it replaces there."""
    llm, path, _ = tiny
    if not llm.backend.int8 or llm.backend.name != "cpu":
        pytest.skip("the one-call block is the CPU int8 kernels'")
    cfg, be = llm.config, llm.backend
    head = MtpHead(llm.model, load_mtp(GGUFFile(path), cfg))
    assert head.layer.compiled is not None
    _, hidden = _main_hidden(llm, IDS)
    batch = Batch.single(IDS[1:7], 0, llm._pages)
    batch.validate(llm.kv.n_pages, llm.kv.page_size, cfg.n_vocab)
    results = []
    for compiled in (head.layer.compiled, None):       # None: the split path
        layer = tuple(a[0] for a in be.kv_arrays(1, llm.kv.n_pages, llm.kv.page_size, cfg.n_kv_heads, cfg.head_dim))
        head.layer.compiled = compiled
        out = head.block_at_rows(batch, hidden[:6], layer, [5])
        results.append([be.to_host(out).copy()] + [be.to_host(a).copy() for a in layer])
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_more_than_one_mtp_block_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", extra_meta={"qwen2.nextn_predict_layers": 2})
    with pytest.raises(GGUFError, match="nextn_predict_layers' = 2"):
        LLM(str(path), backend="cpu", n_ctx=64)


def test_missing_mtp_tensor_names_it(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", mtp=True, skip_tensor="blk.2.nextn.hnorm.weight")
    llm = LLM(str(path), backend="cpu", n_ctx=64)                   # the main model loads
    with pytest.raises(GGUFError, match="blk.2.nextn.hnorm.weight"):
        load_mtp(GGUFFile(path), llm.config)


def test_no_mtp_block_is_a_clear_error(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf")
    llm = LLM(str(path), backend="cpu", n_ctx=64)
    with pytest.raises(GGUFError, match="no MTP block"):
        load_mtp(GGUFFile(path), llm.config)


def _same_weights(a, b):
    """Every array of two MtpWeights (and of their blocks) equal."""
    from dataclasses import fields
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "block":
            _same_weights(x, y)
        elif x is None or y is None:
            assert x is None and y is None, f.name
        else:
            xa = x.raw if hasattr(x, "raw") else x
            ya = y.raw if hasattr(y, "raw") else y
            assert (getattr(x, "qtype", None), getattr(x, "n_out", None)) == \
                   (getattr(y, "qtype", None), getattr(y, "n_out", None)), f.name
            np.testing.assert_array_equal(np.asarray(xa), np.asarray(ya), err_msg=f.name)


def test_sidecar_loads_as_the_embedded_block(tiny, tmp_path):
    from strata_lite.loader.mtp import load_mtp_file, write_mtp_file
    llm, path, _ = tiny
    side = tmp_path / "m.mtp.gguf"
    write_mtp_file(GGUFFile(path), llm.config, str(side))
    assert side.stat().st_size < path.stat().st_size / 2
    _same_weights(load_mtp_file(str(side), llm.config), load_mtp(GGUFFile(path), llm.config))


def test_sidecar_of_another_model_is_refused(tiny, tmp_path):
    from strata_lite.loader.mtp import load_mtp_file, write_mtp_file
    llm, _, _ = tiny
    other = write_tiny_model(tmp_path / "other.gguf", arch=llm.config.arch, n_embd=128, mtp=True)
    other_cfg = LLM(str(other), backend="cpu", n_ctx=64).config
    side = tmp_path / "other.mtp.gguf"
    write_mtp_file(GGUFFile(other), other_cfg, str(side))
    with pytest.raises(GGUFError, match="n_embd = 128, the model has 64"):
        load_mtp_file(str(side), llm.config)
