"""Importance matrix (strata_lite.imatrix) against a numpy recomputation of the activations, imatrix file
round trips (GGUF and the golden npz layout), and the KL divergence tool on tiny models."""
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import reference_model as ref
from strata_lite import LLM
from strata_lite.cli import main
from strata_lite.imatrix import collect_imatrix
from strata_lite.kld import kld
from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.imatrix_file import load_imatrix, save_imatrix
from strata_lite.loader.quantize_file import quantize_file
from tiny_model import write_tiny_model

GOLDEN_NPZ = Path(__file__).resolve().parent.parent / "data" / "imatrix_argparse20.npz"   # llama.cpp golden set
TEXT = ("def heappush(heap, item):\n    heap.append(item)\n    _siftdown(heap, 0, len(heap)-1)\n\n"
        "hello world, hello tiny model; the llo and lo merges help a little. " * 3)
CTX = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("im") / "m.gguf", qtype=QT.Q8_0, n_embd=64, n_ff=128)
    return LLM(str(path), backend="cpu", n_ctx=64)


def reference_activations(cfg, weights, ids, k_scales):
    """{weight name: float64 activations entering it} for one chunk, from reference_model's float64 forward
    (same steps as reference_logits, int8 K/V as the engine's cache)."""
    acts = {}
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = ref._mat(weights.token_embd)[np.asarray(ids)]
    group = cfg.n_heads // cfg.n_kv_heads
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for li, lw in enumerate(weights.layers):
        h = ref._rmsnorm(x, lw.attn_norm, cfg.rms_eps)
        for w in (lw.attn_q, lw.attn_k, lw.attn_v):
            acts[w.name] = h
        q = (ref._mm(h, lw.attn_q) + lw.attn_q_bias).reshape(n, cfg.n_heads, cfg.head_dim)
        k = (ref._mm(h, lw.attn_k) + lw.attn_k_bias).reshape(n, cfg.n_kv_heads, cfg.head_dim)
        v = (ref._mm(h, lw.attn_v) + lw.attn_v_bias).reshape(n, cfg.n_kv_heads, cfg.head_dim)
        q = ref._rope(q, pos, cfg.rope_freq_base, cfg.n_rot, cfg.rope_neox)
        k = ref._rope(k, pos, cfg.rope_freq_base, cfg.n_rot, cfg.rope_neox)
        k, v = ref._int8_roundtrip(k / k_scales[li]) * k_scales[li], ref._int8_roundtrip(v)
        out = np.empty_like(q)
        for hd in range(cfg.n_heads):
            s = q[:, hd] @ k[:, hd // group].T / np.sqrt(cfg.head_dim) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, hd] = (p / p.sum(-1, keepdims=True)) @ v[:, hd // group]
        a = out.reshape(n, -1)
        acts[lw.attn_output.name] = a
        x = x + ref._mm(a, lw.attn_output)
        h = ref._rmsnorm(x, lw.ffn_norm, cfg.rms_eps)
        acts[lw.ffn_gate.name] = acts[lw.ffn_up.name] = h
        g, u = ref._mm(h, lw.ffn_gate), ref._mm(h, lw.ffn_up)
        act = g / (1 + np.exp(-g)) * u
        acts[lw.ffn_down.name] = act
        x = x + ref._mm(act, lw.ffn_down)
    acts[weights.output.name] = ref._rmsnorm(x, weights.output_norm, cfg.rms_eps)
    return acts


def test_imatrix_matches_numpy(tiny):
    data, ppl = collect_imatrix(tiny, TEXT, ctx=CTX, chunks=3, progress=False)
    ids = tiny.tokenize(TEXT, add_special=False)
    assert len(ids) >= 3 * CTX and np.isfinite(ppl)
    sums = {}
    for c in range(3):
        acts = reference_activations(tiny.config, tiny.weights, ids[c * CTX:(c + 1) * CTX], tiny.model.k_scales)
        for name, a in acts.items():
            sums[name] = sums.get(name, 0.0) + (a * a).sum(axis=0)
    expected = {name: s / (3 * CTX) for name, s in sums.items()}
    got = data.weights()
    assert set(got) == set(expected) and len(got) == 2 * 7 + 1         # 7 matrices per layer + output
    for name, e in expected.items():
        assert data.counts[name].tolist() == [3 * CTX]
        assert got[name].shape == e.shape and got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], e, rtol=2e-3, atol=1e-6 * e.max(), err_msg=name)
    assert data.chunk_count == 3 and data.chunk_size == CTX


def test_imatrix_file_round_trips(tiny, tmp_path):
    data, _ = collect_imatrix(tiny, TEXT, ctx=CTX, chunks=2, progress=False, dataset="calib.txt")
    save_imatrix(tmp_path / "im.gguf", data)
    gf = GGUFFile(tmp_path / "im.gguf")
    assert gf.metadata["general.type"] == "imatrix" and "general.architecture" not in gf.metadata
    assert gf.metadata["imatrix.datasets"] == ["calib.txt"]
    assert gf.metadata["imatrix.chunk_count"] == 2 and gf.metadata["imatrix.chunk_size"] == CTX
    name = "blk.1.ffn_down.weight"
    assert gf.tensors[name + ".in_sum2"].shape == (128, 1) and gf.tensors[name + ".counts"].shape == (1, 1)
    for path in (tmp_path / "im.gguf", tmp_path / "im.npz"):
        if path.suffix == ".npz":
            save_imatrix(path, data)
        back = load_imatrix(path)
        assert set(back.sums) == set(data.sums)
        for k, w in data.weights().items():
            np.testing.assert_allclose(back.weights()[k], w, rtol=1e-6)
            assert back.counts[k].tolist() == data.counts[k].tolist()
    z = np.load(tmp_path / "im.npz")
    assert z["__count__" + name] == 2 * CTX and z[name].dtype == np.float32


def test_golden_npz_layout_loads():
    w = load_imatrix(GOLDEN_NPZ).weights()
    assert len(w) == 169 and w["blk.0.ffn_down.weight"].shape == (4864,)
    z = np.load(GOLDEN_NPZ)
    assert np.array_equal(w["output.weight"], z["output.weight"])


def test_bad_imatrix_files(tmp_path):
    (tmp_path / "junk.dat").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(GGUFError, match="junk.dat: not an imatrix file"):
        load_imatrix(tmp_path / "junk.dat")
    model = write_tiny_model(tmp_path / "model.gguf")
    with pytest.raises(GGUFError, match="general.type is None"):
        load_imatrix(model)


def test_kld_self_is_zero_and_quantized_is_not(tiny, tmp_path):
    same = LLM(tiny.model_path, backend="cpu", n_ctx=64)
    r = kld(tiny, same, TEXT, ctx=CTX, progress=False)
    n_chunks = len(tiny.tokenize(TEXT, add_special=False)) // CTX
    assert r.n_chunks == n_chunks and r.n_scored == n_chunks * CTX // 2
    assert r.mean_kl == r.max_kl == r.p99_kl == 0.0 and r.top1 == 1.0
    assert r.ppl == r.ppl_base and np.isfinite(r.ppl)
    from strata_lite.perplexity import perplexity
    assert r.ppl_base == pytest.approx(perplexity(tiny, TEXT, ctx=CTX, progress=False).ppl, rel=1e-12)
    q4 = quantize_file(tiny.model_path, tmp_path / "q4.gguf", "Q4_0", progress=False).out_path
    [rq] = kld(tiny, [LLM(str(q4), backend="cpu", n_ctx=64)], TEXT, ctx=CTX, progress=False)
    assert rq.mean_kl > 0 and rq.max_kl >= rq.p99_kl >= rq.median_kl >= 0 and 0 <= rq.top1 <= 1
    assert rq.ppl_base == r.ppl_base


def test_cli_imatrix_quantize_kld(tiny, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text(TEXT, encoding="utf-8")
    im = tmp_path / "im.gguf"
    assert main(["imatrix", "-m", tiny.model_path, "--text", str(text), "-o", str(im), "--ctx", str(CTX),
                 "--chunks", "2", "--backend", "cpu"]) == 0
    assert "15 entries from 2 chunks" in capsys.readouterr().out
    out = tmp_path / "iq4.gguf"
    assert main(["quantize", tiny.model_path, str(out), "--type", "IQ4_NL", "--imatrix", str(im)]) == 0
    assert "14 tensors with importance weights" in capsys.readouterr().err   # every blk matrix (output: Q8_0)
    assert main(["kld", "--base", tiny.model_path, "-m", str(out), str(text), "--ctx", str(CTX),
                 "--backend", "cpu"]) == 0
    o = capsys.readouterr().out
    assert "KL mean = " in o and "top-1 agreement = " in o
    assert main(["imatrix", "-m", tiny.model_path, "--text", str(tmp_path / "none.txt"), "-o", str(im)]) == 2
    assert "none.txt" in capsys.readouterr().err
    assert main(["kld", "--base", str(tmp_path / "nobase.gguf"), "-m", tiny.model_path, str(text)]) == 2
    assert "nobase.gguf: no such file" in capsys.readouterr().err
