"""`strata-lite synth`: files of the real presets' shapes (few blocks) load, have the mix's types and run
a CPU forward with sane logits; block statistics, the vocabulary, the CLI's errors."""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, GGUFReader

from strata_lite.cli import main
from strata_lite.kernels.cpu.dequant import dequantize
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.quant_policy import plan_types
from strata_lite.loader.synth import PRESETS, Preset, plan_mix, synth_model, tensor_specs
from strata_lite.loader.synth_blocks import GENERATED_QTYPES, random_matrix
from strata_lite.loader.synth_vocab import synth_vocab
from strata_lite.loader.tokenizer import Tokenizer

# (preset, mix) -> blocks written; qwen2 gets 2 blocks (the forward must cross a block boundary)
CASES = {("qwen2.5-0.5b", "q4_k_m"): 2, ("qwen2.5-0.5b", "iq3_xxs"): 2, ("qwen2.5-1.5b", "iq3_xxs"): 2,
         ("llama-8b-layers", "q4_k_m"): 1, ("llama-8b-layers", "iq3_xxs"): 1, ("llama-8b-layers", "q5_k_m"): 1}

# Expected types, written out by hand from llama.cpp's rules (not from synth's code). Qwen2.5-0.5B's
# 896-wide rows cannot hold 256-weight K-quant blocks: Q4_K falls back to Q5_0, Q6_K (and the output) to
# Q8_0. Q4_K_M's use_more_bits(i, n) for n = 2 picks layer 1, for n = 1 layer 0.
EXPECTED = {
    ("qwen2.5-0.5b", "q4_k_m"): {"token_embd": QT.Q5_0, "output": QT.Q8_0, "0.attn_v": QT.Q5_0,
                                 "1.attn_v": QT.Q8_0, "0.ffn_down": QT.Q4_K, "1.ffn_down": QT.Q6_K,
                                 "attn_q": QT.Q5_0, "attn_k": QT.Q5_0, "attn_output": QT.Q5_0,
                                 "ffn_gate": QT.Q5_0, "ffn_up": QT.Q5_0},
    ("qwen2.5-0.5b", "iq3_xxs"): {"token_embd": QT.IQ4_NL, "output": QT.Q5_0, "attn_v": QT.Q5_0,
                                  "ffn_down": QT.IQ4_NL, "attn_q": QT.IQ4_NL, "attn_k": QT.IQ4_NL,
                                  "attn_output": QT.IQ4_NL, "ffn_gate": QT.IQ4_NL, "ffn_up": QT.IQ4_NL},
    ("qwen2.5-1.5b", "iq3_xxs"): {"token_embd": QT.IQ3_XXS, "output": QT.Q5_0, "attn_v": QT.Q5_0,     # 1536-wide
                                  "ffn_down": QT.IQ3_XXS, "attn_q": QT.IQ3_XXS, "attn_k": QT.IQ3_XXS,  # rows: no
                                  "attn_output": QT.IQ3_XXS, "ffn_gate": QT.IQ3_XXS, "ffn_up": QT.IQ3_XXS},  # fallback
    ("llama-8b-layers", "q4_k_m"): {"token_embd": QT.Q4_K, "output": QT.Q6_K, "attn_v": QT.Q6_K,
                                    "ffn_down": QT.Q6_K, "attn_q": QT.Q4_K, "attn_k": QT.Q4_K,
                                    "attn_output": QT.Q4_K, "ffn_gate": QT.Q4_K, "ffn_up": QT.Q4_K},
    ("llama-8b-layers", "q5_k_m"): {"token_embd": QT.Q5_K, "output": QT.Q6_K, "attn_v": QT.Q6_K,
                                    "ffn_down": QT.Q6_K, "attn_q": QT.Q5_K, "attn_k": QT.Q5_K,
                                    "attn_output": QT.Q5_K, "ffn_gate": QT.Q5_K, "ffn_up": QT.Q5_K},
    ("llama-8b-layers", "iq3_xxs"): {"token_embd": QT.IQ3_XXS, "output": QT.Q5_0, "attn_v": QT.Q5_0,
                                     "ffn_down": QT.IQ3_XXS, "attn_q": QT.IQ3_XXS, "attn_k": QT.IQ3_XXS,
                                     "attn_output": QT.IQ3_XXS, "ffn_gate": QT.IQ3_XXS, "ffn_up": QT.IQ3_XXS},
}

# small shapes with 256-multiple rows (every type fits) for the pure types and the vocabulary tests
TINY = Preset("tiny", "qwen2", n_layers=2, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, head_dim=64,
              n_vocab=1000, rope_freq_base=1e6, rms_eps=1e-6, n_ctx_train=2048)


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["synth", *map(str, argv)])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def preset_files(tmp_path_factory):
    """The preset/mix files (CASES), written through the CLI: {(preset, mix): (path, stdout)}."""
    d = tmp_path_factory.mktemp("synth")
    files = {}
    for (preset, mix), blocks in CASES.items():
        path = d / f"{preset}-{mix}.gguf"
        rc, out, _ = _cli("--preset", preset, "--quant", mix, "--blocks", blocks, "--seed", 7, "--out", path)
        assert rc == 0
        files[preset, mix] = path, out
    return files


def _expected_type(case, name: str) -> QT:
    want = EXPECTED[case]
    short = name.removesuffix(".weight")
    layer_key = short.removeprefix("blk.")             # "0.attn_v"
    return want.get(layer_key) or want[layer_key.split(".", 1)[-1]]


@pytest.mark.parametrize("case", list(CASES))
def test_preset_file(preset_files, case):
    """Loads (every shape checked against the config), has the mix's types, runs a CPU forward."""
    from strata_lite.api import LLM
    path, out = preset_files[case]
    p = PRESETS[case[0]]
    llm = LLM(str(path), backend="cpu", n_ctx=64)
    cfg, w = llm.config, llm.weights
    assert (cfg.arch, cfg.n_layers, cfg.n_embd, cfg.n_ff) == (p.arch, CASES[case], p.n_embd, p.n_ff)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_vocab) == (p.n_heads, p.n_kv_heads, p.head_dim, p.n_vocab)
    assert (cfg.rope_freq_base, cfg.qkv_bias) == (p.rope_freq_base, p.arch == "qwen2")
    assert cfg.rms_eps == pytest.approx(p.rms_eps)
    assert w.output is not w.token_embd
    matrices = [w.token_embd, w.output] + [getattr(lw, m) for lw in w.layers for m in
                                           ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    types = {m.name: m.qtype for m in matrices}
    assert types == {name: _expected_type(case, name) for name in types}
    if case[1] == "iq3_xxs":           # exactly the types `strata-lite quantize --type IQ3_XXS` picks
        shapes = {s.name: s.shape for s in tensor_specs(replace(p, n_layers=CASES[case]), p.arch)}
        assert {n: c.qtype for n, c in plan_types(shapes, QT.IQ3_XXS).items() if n in types} == types
    # the CLI's summary: file size and type counts
    assert f"{os.path.getsize(path):,} bytes" in out
    counts = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()[1:] if line.split()[0] != "file"}
    assert sum(c for t, c in counts.items() if t != "F32") == len(matrices)
    ids = llm.tokenize("hello world, the quick brown fox jumps over the lazy dog")
    _check_logits(llm.logits(ids), len(ids), p.n_vocab)      # logits: (n_tokens, n_vocab) float32


def _check_logits(logits: np.ndarray, n_tokens: int, n_vocab: int) -> None:
    assert logits.shape == (n_tokens, n_vocab)
    assert np.isfinite(logits).all()
    # unit-RMS final activations through a std 1/sqrt(n_embd) output matrix: logits of std ~1 per row
    std = logits.std(axis=1)
    assert (std > 0.3).all() and (std < 3.0).all(), std
    assert len(set(logits.argmax(axis=1).tolist())) > n_tokens // 2    # positions disagree: not degenerate


def test_full_preset_plans():
    """Type counts of the full models (no file): Q4_K_M's use_more_bits picks layers 0, 3, 6, 7 of 8."""
    llama = PRESETS["llama-8b-layers"]
    plan = plan_mix(tensor_specs(llama, "llama"), "q4_k_m", llama.n_layers)
    q6 = sorted(n for n, t in plan.items() if t == QT.Q6_K)
    assert q6 == sorted(["output.weight"] + [f"blk.{i}.{m}.weight" for i in (0, 3, 6, 7)
                                             for m in ("attn_v", "ffn_down")])
    assert all(t == QT.F32 for n, t in plan.items() if not n.endswith(".weight") or "norm" in n)
    qwen = PRESETS["qwen2.5-0.5b"]
    specs = tensor_specs(qwen, "qwen2")
    assert len(specs) == 2 + 1 + 24 * 12       # token_embd, output_norm, output; 12 per block with biases
    pure = plan_mix(specs, "q4_k", qwen.n_layers)
    assert pure["blk.5.ffn_down.weight"] == QT.Q4_K           # 4864 = 19 * 256
    assert pure["blk.5.ffn_up.weight"] == QT.Q5_0             # 896 rows: llama.cpp's Q4_K fallback
    assert plan_mix(specs, "q6_k", qwen.n_layers)["blk.5.attn_q.weight"] == QT.Q8_0


@pytest.mark.parametrize("mix,qtype,arch", [("f16", QT.F16, "qwen3"), ("q8_0", QT.Q8_0, "llama"),
                                            ("q4_k", QT.Q4_K, "qwen2"), ("q6_k", QT.Q6_K, "qwen2"),
                                            ("iq3_xxs-pure", QT.IQ3_XXS, "qwen2"), ("f32", QT.F32, "qwen2"),
                                            ("bf16", QT.BF16, "llama"), ("q4_0", QT.Q4_0, "qwen2"),
                                            ("q5_0", QT.Q5_0, "llama"), ("iq4_nl", QT.IQ4_NL, "qwen2")])
def test_pure_types_forward(tmp_path, mix, qtype, arch):
    path = tmp_path / f"tiny-{mix}.gguf"
    report = synth_model(path, TINY, arch=arch, quant=mix, progress=False)
    gf = GGUFFile(path)
    assert gf.metadata["general.architecture"] == arch
    assert {i.qtype for i in gf.tensors.values() if len(i.shape) == 2} == {qtype}
    vectors = sum(len(i.shape) == 1 for i in gf.tensors.values()) if qtype == QT.F32 else 0   # norms, biases
    assert report.by_type[qtype.name][0] == 2 + 7 * TINY.n_layers + vectors
    from strata_lite.api import LLM
    llm = LLM(str(path), backend="cpu", n_ctx=64)
    ids = llm.tokenize("the quick brown fox jumps over the lazy dog")
    _check_logits(llm.logits(ids), len(ids), TINY.n_vocab)


@pytest.mark.parametrize("qtype", sorted(GENERATED_QTYPES))
@pytest.mark.parametrize("n_in", [256, 4864])
def test_random_matrix_statistics(qtype, n_in):
    """Dequantized weights: finite, mean ~0, std 1/sqrt(n_in) within a few percent."""
    raw = random_matrix(np.random.default_rng(3), qtype, 384, n_in)
    w = dequantize(qtype, raw, n_in).astype(np.float64)
    assert np.isfinite(w).all()
    assert w.std() * np.sqrt(n_in) == pytest.approx(1.0, rel=0.06)
    assert abs(w.mean()) < 0.02 * w.std()


def test_vocab_and_tokenizer(tmp_path):
    vocab = synth_vocab(TINY.n_vocab, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert len(vocab.tokens) == len(set(vocab.tokens)) == TINY.n_vocab
    assert len(vocab.merges) == TINY.n_vocab - 256 - 3
    path = tmp_path / "tiny.gguf"
    synth_model(path, TINY, quant="q8_0", progress=False)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata, str(path))
    text = "hello world, Grüße! 123"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())                    # merged tokens are used
    assert tok.token_text(tok.eos_id) == "<|im_end|>" and tok.token_text(tok.bos_id) == "<|endoftext|>"
    assert tok.encode("<|im_start|>user", parse_special=True)[0] == TINY.n_vocab - 2


def test_file_is_valid_for_gguf_py_and_deterministic(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.gguf", "b.gguf", "c.gguf"))
    synth_model(a, TINY, arch="llama", quant="q4_k_m", seed=5, progress=False)
    synth_model(b, TINY, arch="llama", quant="q4_k_m", seed=5, progress=False)
    synth_model(c, TINY, arch="llama", quant="q4_k_m", seed=6, progress=False)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    r = GGUFReader(a)
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["tokenizer.ggml.tokens"].contents()[-1] == "<|im_end|>"
    ours = GGUFFile(a)
    for t in r.tensors:              # gguf-py finds the same tensors at the same offsets
        info = ours.tensors[t.name]
        assert (t.tensor_type, tuple(int(x) for x in t.shape), t.data_offset) == (info.qtype, info.shape, info.offset)


@pytest.mark.parametrize("args,message", [
    (["--preset", "gpt-5"], "unknown preset 'gpt-5'"),
    (["--preset", "qwen2.5-0.5b", "--quant", "q3_k"], "unknown quantization mix 'q3_k'"),
    (["--preset", "qwen2.5-0.5b", "--arch", "mamba"], "unknown architecture 'mamba'"),
    (["--preset", "qwen2.5-0.5b", "--blocks", "0"], "--blocks must be at least 1"),
    (["--preset", "qwen2.5-0.5b", "--seed", "-1"], "--seed must be in"),
])
def test_cli_bad_arguments(tmp_path, args, message):
    rc, out, err = _cli(*args, "--out", tmp_path / "x.gguf")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("strata-lite: error: ") and message in err
    assert not list(tmp_path.iterdir())


def test_cli_missing_directory(tmp_path):
    rc, _, err = _cli("--preset", "qwen2.5-0.5b", "--out", tmp_path / "nope" / "x.gguf")
    assert rc == 2 and "does not exist" in err and err.count("\n") == 1
