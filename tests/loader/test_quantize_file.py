"""Whole-file quantization (strata_lite.loader.quantize_file) on tiny models: metadata and tokenizer kept
with their GGUF types, tensor types as the policy says, dequantized weights close to the source,
clear errors."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite.cli import main
from strata_lite.kernels.cpu.dequant import dequantize
from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.quant_policy import FILE_TYPE, UnsupportedTarget, plan_types, tensor_type
from strata_lite.loader.quantize import quantize_rows
from strata_lite.loader.quantize_file import quantize_file
from tiny_model import write_tiny_model

TARGETS = ["IQ3_XXS", "IQ4_NL", "Q8_0", "Q5_0", "Q4_0"]
# relative RMSE bound of (dequantized output - dequantized source) per output type, on the tiny
# models' random weights (Q8_0 source blocks: uniform int8 values); measured maxima in comments
REL_RMSE = {QT.IQ3_XXS: 0.30, QT.IQ4_NL: 0.15, QT.Q4_0: 0.15, QT.Q5_0: 0.08, QT.Q8_0: 0.01, QT.F16: 1e-3,
            QT.F32: 0.0}
ADDED_KEYS = {"general.file_type", "general.quantization_version", "quantize.imatrix.entries_count"}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny qwen2 model whose rows are multiples of 256 (IQ3_XXS fits everywhere), Q8_0 source."""
    return write_tiny_model(tmp_path_factory.mktemp("src") / "tiny.gguf", qtype=QT.Q8_0, n_embd=256, n_ff=512,
                            n_heads=4, n_kv_heads=2, extra_meta={"general.file_type": 7})


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """Rows of 64 (no IQ3_XXS block fits) except ffn_down (256)."""
    return write_tiny_model(tmp_path_factory.mktemp("narrow") / "narrow.gguf", qtype=QT.Q8_0,
                            n_embd=64, n_ff=256)


def _values_equal(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b)) and np.asarray(a).dtype == np.asarray(b).dtype
    return a == b and type(a) is type(b)


def _check_metadata_kept(src_gf, out_gf, target):
    src_keys = list(src_gf.metadata)
    assert [k for k in out_gf.metadata if k not in ADDED_KEYS or k in src_gf.metadata] == src_keys
    for key in src_keys:
        assert out_gf.field_types[key] == src_gf.field_types[key], key
        if key == "general.file_type":
            assert out_gf.metadata[key] == FILE_TYPE[QT[target]]
        else:
            assert _values_equal(src_gf.metadata[key], out_gf.metadata[key]), key


def _rel_rmse(gf_a, gf_b, name):
    a, b = gf_a.tensors[name], gf_b.tensors[name]
    x = dequantize(a.qtype, np.asarray(gf_a.rows(name)), a.shape[0]).astype(np.float64)
    y = dequantize(b.qtype, np.asarray(gf_b.rows(name)), b.shape[0]).astype(np.float64)
    return np.sqrt(np.mean((x - y) ** 2) / np.mean(x ** 2))


@pytest.mark.parametrize("pure", [False, True], ids=["mix", "pure"])
@pytest.mark.parametrize("target", TARGETS)
def test_quantize_each_target(src, tmp_path, target, pure):
    out = tmp_path / f"{target}.gguf"
    report = quantize_file(src, out, target, pure=pure, progress=False)
    a, b = GGUFFile(src), GGUFFile(out)
    _check_metadata_kept(a, b, target)
    assert list(b.tensors) == list(a.tensors)
    plan = plan_types({name: info.shape for name, info in a.tensors.items()}, QT[target], pure)
    for name, info in a.tensors.items():
        got = b.tensors[name]
        assert got.shape == info.shape
        assert got.qtype == plan[name].qtype == report.tensor_types[name].qtype
        if len(info.shape) == 1:
            assert got.qtype == QT.F32
            assert np.array_equal(b.array(name), a.array(name))
        else:
            assert _rel_rmse(a, b, name) <= REL_RMSE[got.qtype], (name, got.qtype.name)
    assert report.nbytes == out.stat().st_size
    assert sum(v[1] for v in report.by_type.values()) == sum(t.nbytes for t in b.tensors.values())


def test_iq3_xxs_mix_policy(src, narrow, tmp_path):
    b = GGUFFile(quantize_file(src, tmp_path / "mix.gguf", "IQ3_XXS", progress=False).out_path)
    types = {n: t.qtype for n, t in b.tensors.items()}
    for i in range(2):
        p = f"blk.{i}."
        for m in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            assert types[p + m + ".weight"] == QT.IQ3_XXS
        assert types[p + "attn_v.weight"] == QT.Q5_0
        assert types[p + "attn_norm.weight"] == types[p + "attn_q.bias"] == QT.F32
    assert types["token_embd.weight"] == QT.IQ3_XXS and types["output.weight"] == QT.Q5_0
    # rows of 64: IQ3_XXS impossible -> IQ4_NL, except ffn_down (rows of 256) in --pure
    n = GGUFFile(quantize_file(narrow, tmp_path / "narrow.gguf", "IQ3_XXS", pure=True, progress=False).out_path)
    assert n.tensors["blk.0.ffn_gate.weight"].qtype == QT.IQ4_NL
    assert n.tensors["blk.0.ffn_down.weight"].qtype == QT.IQ3_XXS
    assert n.tensors["output.weight"].qtype == QT.IQ4_NL
    # the mix raises ffn_down to its layer's ffn_gate/ffn_up type; the output matrix is Q5_0 anyway
    report = quantize_file(narrow, tmp_path / "narrow_mix.gguf", "IQ3_XXS", progress=False)
    m = GGUFFile(report.out_path)
    assert m.tensors["blk.0.ffn_gate.weight"].qtype == m.tensors["blk.0.ffn_down.weight"].qtype == QT.IQ4_NL
    assert report.tensor_types["blk.0.ffn_down.weight"].rule == "ffn_down>=ffn_up"
    assert "ffn_down>=ffn_up x2" in report.summary()
    assert m.tensors["output.weight"].qtype == QT.Q5_0
    assert tensor_type("blk.0.ffn_up.weight", (48, 16), QT.IQ3_XXS).qtype == QT.F16   # not even 32-blocks
    assert tensor_type("token_embd.weight", (256, 300), QT.IQ3_XXS, has_output=False).qtype == QT.Q5_0  # tied
    # unlike llama.cpp (Q8_0), an output matrix whose rows are not 256-blocks is Q5_0 too
    assert tensor_type("output.weight", (896, 300), QT.IQ3_XXS).qtype == QT.Q5_0
    assert tensor_type("blk.3.attn_v.weight", (896, 128), QT.IQ3_XXS).qtype == QT.Q5_0


def test_float_source_and_model_runs(src, tmp_path):
    """Q8_0 -> F32 is exact; F32 -> IQ3_XXS loads and gives logits close to the source model's."""
    from strata_lite import LLM
    f32 = quantize_file(src, tmp_path / "f32.gguf", "F32", progress=False).out_path
    a, b = GGUFFile(src), GGUFFile(f32)
    assert all(t.qtype == QT.F32 for t in b.tensors.values())
    assert _rel_rmse(a, b, "blk.1.ffn_down.weight") == 0.0
    base = LLM(str(src), backend="cpu", n_ctx=64)
    text = "hello world, hello tiny model"
    la = base.logits(base.tokenize(text))
    # random weights are chaotic: IQ3_XXS (rel. error ~0.25 per matrix) only has to run; Q8_0 must track
    # (measured corr 0.965: requantizing moves block scales, and the int8 rounding of activations
    # amplifies that through the random layers; an unrelated model gives ~0)
    for target, min_corr in (("IQ3_XXS", -1.0), ("Q8_0", 0.9)):
        path = quantize_file(f32, tmp_path / f"{target}.gguf", target, progress=False).out_path
        q = LLM(str(path), backend="cpu", n_ctx=64)
        assert q.tokenize(text) == base.tokenize(text)
        assert q.detokenize(q.tokenize(text)) == text
        lb = q.logits(q.tokenize(text))
        assert np.isfinite(lb).all()
        assert np.corrcoef(la.ravel(), lb.ravel())[0, 1] > min_corr


def test_imatrix_is_used(src, tmp_path):
    a = GGUFFile(src)
    rng = np.random.default_rng(1)
    im = {n: rng.uniform(0.01, 10.0, size=t.shape[0]).astype(np.float32)
          for n, t in a.tensors.items() if n.startswith("blk.") and len(t.shape) == 2}
    r0 = quantize_file(src, tmp_path / "plain.gguf", "IQ3_XXS", progress=False)
    r1 = quantize_file(src, tmp_path / "im.gguf", "IQ3_XXS", imatrix=im, progress=False)
    assert r0.imatrix_used == 0 and r1.imatrix_used == 14     # 12 IQ3_XXS + 2 Q5_0 (attn_v) block matrices
    p, q = GGUFFile(r0.out_path), GGUFFile(r1.out_path)
    assert q.metadata["quantize.imatrix.entries_count"] == len(im)
    name = "blk.0.ffn_up.weight"
    assert not np.array_equal(np.asarray(p.rows(name)), np.asarray(q.rows(name)))
    x = dequantize(QT.Q8_0, np.asarray(a.rows(name)), 256).astype(np.float64)

    def werr(gf):
        y = dequantize(QT.IQ3_XXS, np.asarray(gf.rows(name)), 256)
        return float((im[name] * (x - y) ** 2).sum())
    assert werr(q) < werr(p)           # importance-weighted error is what the imatrix lowers
    bad = dict(im)
    bad[name] = np.ones(100, np.float32)
    with pytest.raises(GGUFError, match="ffn_up.weight.*imatrix entry has 100"):
        quantize_file(src, tmp_path / "bad.gguf", "IQ3_XXS", imatrix=bad, progress=False)


def test_errors(src, tmp_path):
    with pytest.raises(UnsupportedTarget, match="Q2_K.*supported: IQ3_XXS"):
        quantize_file(src, tmp_path / "x.gguf", "Q2_K", progress=False)
    with pytest.raises(GGUFError, match="missing.gguf: no such file"):
        quantize_file(tmp_path / "missing.gguf", tmp_path / "x.gguf", "IQ3_XXS", progress=False)
    with pytest.raises(GGUFError, match="must differ"):
        quantize_file(src, src, "Q8_0", progress=False)
    q2k = write_tiny_model(tmp_path / "q2k.gguf", qtype=QT.Q2_K, n_embd=256, n_ff=256)
    with pytest.raises(GGUFError, match=r"q2k.gguf: tensor 'token_embd.weight' cannot be read.*Q2_K"):
        quantize_file(q2k, tmp_path / "x.gguf", "IQ3_XXS", progress=False)
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob("*.partial"))


def test_cli_quantize(src, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["quantize", str(src), str(out), "--type", "q4_0", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "Q4_0" in err and "bits/weight" in err and "total" in err
    assert "rules: target x" in err and "output x1" in err
    assert GGUFFile(out).tensors["blk.0.ffn_up.weight"].qtype == QT.Q4_0
    assert main(["quantize", str(tmp_path / "nope.gguf"), str(out), "--type", "IQ3_XXS"]) == 2
    assert "strata-lite: error:" in capsys.readouterr().err
    assert main(["quantize", str(src), str(out), "--type", "IQ2_S"]) == 2
    assert "unsupported quantization type 'IQ2_S'" in capsys.readouterr().err
    assert main(["quantize", str(src), str(out), "--type", "IQ3_XXS", "--imatrix", str(tmp_path / "no.dat")]) == 2
    assert "no.dat: no such file" in capsys.readouterr().err


def test_cli_llamacpp_exact_skips_the_iq3_xxs_refinement(src, tmp_path):
    """--llamacpp-exact writes quantize_rows(..., llamacpp_exact=True) bytes (llama.cpp's, see the
    fixture tests); the default refines them, which lowers the weighted error of every matrix."""
    exact, refined = tmp_path / "exact.gguf", tmp_path / "refined.gguf"
    assert main(["quantize", str(src), str(exact), "--type", "IQ3_XXS", "--pure", "--llamacpp-exact"]) == 0
    assert main(["quantize", str(src), str(refined), "--type", "IQ3_XXS", "--pure"]) == 0
    a, e, r = GGUFFile(src), GGUFFile(exact), GGUFFile(refined)
    name = "blk.0.ffn_up.weight"
    x = dequantize(QT.Q8_0, np.asarray(a.rows(name)), 256)
    np.testing.assert_array_equal(np.asarray(e.rows(name)),
                                  quantize_rows(QT.IQ3_XXS, x, None, llamacpp_exact=True))
    x64 = x.astype(np.float64)      # rows of 256 = one block: the pass's no-imatrix weight per block
    w = np.sqrt(2 * (x64 ** 2).mean(axis=1, keepdims=True) + x64 ** 2)

    def werr(gf):
        y = dequantize(QT.IQ3_XXS, np.asarray(gf.rows(name)), 256)
        return float((w * (x - y) ** 2).sum())
    assert werr(r) < werr(e)
