"""MTP training (strata_lite/mtp_train*.py) on tiny models: the numpy forward is MtpHead's, every gradient
matches central finite differences in float64, training lowers the loss, the written sidecar reloads and
runs, a resumed run equals an uninterrupted one, and bad CLI input fails with one line."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite import LLM
from strata_lite.batch import Batch
from strata_lite.cli import main
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.mtp import load_mtp, load_mtp_file
from strata_lite.models.mtp import MtpHead
import strata_lite.mtp_train as mtp_train
import strata_lite.mtp_train_defaults as mtp_defaults
from strata_lite.kernels import cuda_unavailable_reason
from strata_lite.mtp_train import write_sidecar
from strata_lite.mtp_train_answers import answer_ids
from strata_lite.mtp_train_data import split_held_out, top_k
from strata_lite.mtp_train_defaults import DEFAULTS, resolve_device
from strata_lite.mtp_train_prompts import TASKS, prompts
from strata_lite.mtp_train_fit import CHECKPOINT_NAME, FitOptions, fit
from strata_lite.mtp_train_model import (FrozenHead, evaluate, init_params, logits, loss_and_grads,
                                        params_from_mtp)
import reference_model
from mtp_train_helpers import tiny_model_data, write_texts
from tiny_model import write_tiny_model

IDS = [5, 17, 200, 3, 99, 42, 7, 7, 120, 64, 33, 8, 150, 11, 90, 250, 1, 77]
# MtpHead on the CPU backend rounds activations to int8 before each mat-mul (as ggml does) and keeps K/V
# as int8; the float forward does neither (training sees float). On these random tiny models that rounding
# moves logits a lot: measured max |difference| / max |logit| 0.14, mean 0.009 (qwen2, whose k bias
# makes K smoothing matter), 0.033 and 0.004 (qwen3), 0.010 and 0.002 (llama Q5_0); the bounds leave ~2x.
# The exact check is against the float64 reference.
ENGINE_MAX_TOL, ENGINE_MEAN_TOL = 0.3, 0.02


def _tiny(tmp_path, arch="qwen2", qtype=QT.Q8_0, mtp=True, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, qtype=qtype, mtp=mtp, n_embd=n_embd,
                            n_ff=n_ff, n_heads=n_heads, n_kv_heads=n_kv_heads)
    return LLM(str(path), backend="cpu", n_ctx=64, n_batch=64), path


def _hidden(llm, ids):
    batch = Batch.single(ids, 0, llm._pages)
    batch.validate(llm.kv.n_pages, llm.kv.page_size, llm.config.n_vocab)
    return llm.backend.to_host(llm.model.forward(batch, llm.kv, return_hidden=True)[1])


def _head_logits(llm, mtp, ids, hidden):
    """MtpHead.forward over rows i = 0 .. len(ids) - 2 with a fresh KV layer."""
    cfg, head = llm.config, MtpHead(llm.model, mtp)
    kv = llm.backend.kv_arrays(1, llm.kv.n_pages, llm.kv.page_size, cfg.n_kv_heads, cfg.head_dim)
    b = Batch.single(ids[1:], 0, llm._pages)
    b.validate(llm.kv.n_pages, llm.kv.page_size, cfg.n_vocab)
    return llm.backend.to_host(head.forward(b, hidden[:-1], tuple(a[0] for a in kv))[0])


def _rel_err(ours, ref):
    return np.abs(np.asarray(ours, np.float64) - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("arch,qtype", [("qwen2", QT.Q8_0), ("llama", QT.Q5_0), ("qwen3", QT.Q8_0)])
def test_forward_matches_mtp_head(tmp_path, arch, qtype, monkeypatch):
    llm, path = _tiny(tmp_path, arch, qtype)
    mtp = load_mtp(GGUFFile(path), llm.config)
    hidden = _hidden(llm, IDS)
    engine = _head_logits(llm, mtp, IDS, hidden)
    p = params_from_mtp(mtp)
    ours = logits(llm.config, p, FrozenHead.from_model(llm.weights, mtp=mtp), hidden[None, :-1],
                  np.asarray(IDS[1:])[None])[0]
    assert ours.shape == engine.shape
    # the same function: tests/engine/reference_model.py's float64 MTP forward with its two roundings
    # (ggml's int8 activations, the int8 KV cache) switched off
    monkeypatch.setattr(reference_model, "round_like_ggml", lambda qtype, x: x)
    monkeypatch.setattr(reference_model, "_int8_roundtrip", lambda x: x)
    exact = reference_model.reference_mtp_logits(llm.config, llm.weights, mtp, IDS, hidden)
    assert _rel_err(ours, exact) <= 2e-5            # float32 rounding (measured 4e-6)
    # against MtpHead the difference is the engine's int8 rounding, large on random tiny weights
    err = np.abs(ours - engine) / np.abs(engine).max()
    print(f"{arch}: |ours - MtpHead| / max |logit|: max {err.max():.2e}, mean {err.mean():.2e}")
    assert err.max() <= ENGINE_MAX_TOL and err.mean() <= ENGINE_MEAN_TOL
    assert (ours.argmax(-1) == engine.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("k", [1, 3])
def test_gradients_match_finite_differences(tmp_path, arch, k):
    """Every parameter: the directional derivative along a random direction, and three single entries,
    against central differences in float64 (eps 1e-6: truncation ~eps^2, rounding ~1e-16/eps)."""
    llm, _ = _tiny(tmp_path, arch, mtp=False, n_embd=32, n_ff=64)
    cfg, rng = llm.config, np.random.default_rng(1)
    p = {n: a.astype(np.float64) + 0.05 * rng.standard_normal(a.shape)
         for n, a in init_params(cfg, llm.weights, 2.0).items()}
    frozen = FrozenHead.from_model(llm.weights, np.float64)
    B, T = 2, 5
    tgt = np.stack([rng.permutation(cfg.n_vocab)[:k] for _ in range(B * T)]).reshape(B, T, k)
    batch = (2.0 * rng.standard_normal((B, T, cfg.n_embd)), rng.integers(0, cfg.n_vocab, (B, T)), tgt,
             rng.dirichlet(np.ones(k), (B, T)))
    _, grads, _ = loss_and_grads(cfg, p, frozen, batch)
    assert sorted(grads) == sorted(p)
    eps = 1e-6

    def loss_at(name, d):
        q = dict(p)
        q[name] = p[name] + d
        return loss_and_grads(cfg, q, frozen, batch)[0]

    for name, a in p.items():
        g = grads[name]
        assert g.shape == a.shape and g.dtype == np.float64, name
        d = rng.standard_normal(a.shape)
        fd = (loss_at(name, eps * d) - loss_at(name, -eps * d)) / (2 * eps)
        assert abs(fd - (g * d).sum()) <= 1e-6 * max(1.0, abs(fd)), name
        for idx in rng.integers(0, a.size, 3):
            e = np.zeros(a.size)
            e[idx] = eps
            fd = (loss_at(name, e.reshape(a.shape)) - loss_at(name, -e.reshape(a.shape))) / (2 * eps)
            assert abs(fd - g.reshape(-1)[idx]) <= 1e-6 * max(1.0, abs(fd)), (name, idx)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model without an MTP block, its data (the model over a token stream) and a short run."""
    return tiny_model_data(tmp_path_factory.mktemp("train"), 4)


def _rms(data):
    return float(np.median(np.sqrt((data.hidden ** 2).mean(-1))))


def _run(llm, data, opts, **kw):
    return fit(llm.config, init_params(llm.config, llm.weights, _rms(data)), FrozenHead.from_model(llm.weights),
               data, opts, progress=False, **kw)


@pytest.mark.parametrize("topk", [1, 4])
def test_training_lowers_the_loss(trained, topk):
    """The loss against the greedy token over every window (a fixed set, unlike the steps' own losses)."""
    llm, data = trained
    frozen, every = FrozenHead.from_model(llm.weights), data.batch(np.arange(len(data)), k=1)
    st = _run(llm, data, FitOptions(steps=30, lr=2e-3, warmup=3, batch=2, topk=topk))
    assert len(st.losses) == 30 and np.all(np.isfinite(st.losses))
    before = evaluate(llm.config, init_params(llm.config, llm.weights, _rms(data)), frozen, every)[0]
    after = evaluate(llm.config, st.params, frozen, every)[0]
    print(f"top-{topk}: loss {before:.3f} -> {after:.3f}")
    assert after < 0.85 * before


def test_resume_gives_the_uninterrupted_result(trained, tmp_path):
    llm, data = trained
    opts = FitOptions(steps=8, lr=1e-3, warmup=2, batch=2, seed=3)
    whole = _run(llm, data, opts)
    part = _run(llm, data, opts, checkpoint_dir=str(tmp_path), checkpoint_every=2, stop_after=5)
    assert part.step == 5 and (tmp_path / CHECKPOINT_NAME).exists()
    resumed = _run(llm, data, opts, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    assert resumed.step == 8 and resumed.taken == 3
    np.testing.assert_array_equal(resumed.losses, whole.losses)
    for name in whole.params:
        np.testing.assert_array_equal(resumed.params[name], whole.params[name], err_msg=name)
    with pytest.raises(ValueError, match="checkpoint of another run"):
        _run(llm, data, FitOptions(steps=8, lr=1e-3, warmup=2, batch=2, seed=4), checkpoint_dir=str(tmp_path))


@pytest.mark.parametrize("out_type,tol", [("F16", 2e-2), ("Q8_0", 3e-2)])
def test_sidecar_reloads_and_runs(trained, tmp_path, out_type, tol):
    llm, data = trained
    st = _run(llm, data, FitOptions(steps=4, lr=1e-3, warmup=1, batch=2))
    out = tmp_path / "m.mtp.gguf"
    write_sidecar(llm, st.params, str(out), out_type)
    mtp = load_mtp_file(str(out), llm.config)
    assert mtp.eh_proj_embed.qtype == QT[out_type] and mtp.head is None and mtp.head_norm is None
    hidden = _hidden(llm, IDS)
    ref = _head_logits(llm, mtp, IDS, hidden)
    ours = logits(llm.config, st.params, FrozenHead.from_model(llm.weights), hidden[None, :-1],
                  np.asarray(IDS[1:])[None])[0]
    assert _rel_err(ours, ref) <= tol


def test_top_k_puts_the_greedy_token_first():
    x = np.array([[0.5, 2.0, 2.0, -1.0, 1.0]], np.float32)
    ids, p = top_k(x, 3)
    assert ids.tolist() == [[1, 2, 4]] and abs(p.sum() - 1) < 1e-6 and p[0, 0] == p[0, 1] > p[0, 2]
    assert top_k(x, 1)[0].tolist() == [[1]]
    assert top_k(x, 8)[0].tolist() == [[1, 2, 4, 0, 3]] and top_k(x, 8)[0].dtype == np.int32


def test_device_follows_the_backend(monkeypatch):
    monkeypatch.setattr(mtp_defaults, "cuda_unavailable_reason", lambda: None)          # a GPU
    assert resolve_device("auto", "auto") == ("cuda", "cuda")
    assert resolve_device("auto", "cpu") == ("cpu", "cpu")
    assert resolve_device("cpu", "auto") == ("cpu", "auto")     # the model's pass may still use the GPU
    monkeypatch.setattr(mtp_defaults, "cuda_unavailable_reason", lambda: "no GPU")
    assert resolve_device("auto", "auto") == ("cpu", "auto")
    assert resolve_device("auto", "cuda") == ("cuda", "cuda")
    assert resolve_device("cuda", "auto") == ("cuda", "cuda")
    assert resolve_device("cuda", "cpu") == ("cuda", "cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cli_options_default_by_device(tmp_path, monkeypatch, device):
    """Options left out take the device's defaults (the CPU's are the sizes documented before GPU
    training existed); given ones are kept."""
    model = write_tiny_model(tmp_path / "m.gguf")
    seen = {}
    monkeypatch.setattr(mtp_defaults, "resolve_device", lambda d, b: (device, "cpu"))
    monkeypatch.setattr(mtp_train, "train_mtp", lambda llm, out, text, opts, **kw: seen.update(kw, opts=opts) or
                        type("R", (), {"summary": lambda self: "ok"})())
    assert main(["train-mtp", "--model", str(model), "--steps", "7", "-o", str(tmp_path / "o.gguf")]) == 0
    d = DEFAULTS[device]
    assert seen["opts"].steps == 7 and seen["opts"].batch == d.batch and seen["opts"].lr == d.lr
    assert (seen["ctx"], seen["train_tokens"], seen["eval_tokens"], seen["answers"], seen["device"], seen["tf32"]) == \
        (d.ctx, d.train_tokens, d.eval_tokens, d.answers, device, device == "cuda")
    if device == "cpu":
        assert (d.steps, d.batch, d.ctx, d.train_tokens, d.eval_tokens, d.lr, d.answers) == \
            (300, 2, 256, 65536, 8192, 3e-4, 0)


@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="a GPU is here: --device cuda would train")
def test_cli_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "m.gguf")
    assert main(["train-mtp", "--model", str(model), "--device", "cuda", "-o", str(tmp_path / "o.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CuPy" in err[0]


def test_prompts_and_their_held_out_share():
    ps = prompts()
    assert len(ps) == len(set(ps)) == 4 * len(TASKS) and all(len(p) > 40 for p in ps)
    assert all(sum(t in p for p in ps[:len(TASKS)]) == 1 for t in TASKS)     # the first round: every task once
    train, held = split_held_out(ps, str)
    assert sorted(train + held) == sorted(ps) and 12 <= len(held) <= 36
    assert split_held_out(ps[:20], str)[1]          # the CLI tests' --answers 20 hold one out
    assert split_held_out(ps, str) == (train, held)
    assert split_held_out([], str) == ([], [])


def test_answers_are_the_greedy_continuations(tmp_path):
    """answer_ids (the engine, several sequences at once) gives the chat prompt and what LLM.generate
    produces for it greedily."""
    model = write_tiny_model(tmp_path / "m.gguf")
    asked = prompts()[:3]
    got = answer_ids(str(model), "cpu", asked, 8, progress=False)
    llm = LLM(str(model), backend="cpu", n_ctx=512)
    for text, ids in zip(asked, got):
        chat = llm.tokenize(llm.apply_chat_template([{"role": "user", "content": text}]), parse_special=True)
        assert ids.dtype == np.int32 and ids[:len(chat)].tolist() == chat
        assert ids[len(chat):].tolist() == llm.generate(chat, max_tokens=8).token_ids


def test_cli_trains_on_the_models_answers(tmp_path, capsys):
    """--answers: the answers join the training text, the held-out ones get their own agreement line, and
    they are kept in the checkpoint directory for a resumed run."""
    model = write_tiny_model(tmp_path / "m.gguf")
    text = tmp_path / "t.py"
    text.write_text("".join(f"def f{j}(x):\n    return x * {j}\n" for j in range(40)))
    ck = tmp_path / "ck"
    args = ["train-mtp", "--model", str(model), "--text", str(text), "--steps", "2", "--ctx", "32",
            "--answers", "20", "--answer-tokens", "8", "--checkpoint", str(ck), "-o", str(tmp_path / "o.gguf")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out answers" in out and "held-out text" not in out, out      # one file: all training
    assert len([p for p in ck.iterdir() if p.name.startswith("mtp-answers-")]) == 1
    assert main(args) == 0
    assert "resuming from" in capsys.readouterr().err


def test_cli_bad_model_is_one_line(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello\n")
    assert main(["train-mtp", "--model", str(tmp_path / "none.gguf"), "--text", str(text),
                 "-o", str(tmp_path / "o.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.gguf" in err[0]


def test_cli_unreadable_text_is_one_line(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "m.gguf")
    assert main(["train-mtp", "--model", str(model), "--text", str(tmp_path / "missing.txt"),
                 "-o", str(tmp_path / "o.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.txt: not a readable file" in err[0]
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    assert main(["train-mtp", "--model", str(model), "--text", str(bad), "-o", str(tmp_path / "o.gguf")]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "error" in ln]
    assert len(err) == 1 and "bin.txt: not UTF-8 text" in err[0]


def test_cli_trains_and_writes_a_sidecar(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "m.gguf")
    texts = write_texts(tmp_path)
    out, ck = tmp_path / "m.mtp.gguf", tmp_path / "ck"
    args = ["train-mtp", "--model", str(model), "--text", *texts, "--steps", "3", "--ctx", "32",
            "--eval-tokens", "64", "--checkpoint", str(ck), "-o", str(out)]
    assert main(args) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    llm = LLM(str(model), backend="cpu", n_ctx=64)
    assert load_mtp_file(str(out), llm.config).block.attn_q.qtype == QT.Q8_0
    assert (ck / CHECKPOINT_NAME).exists() and any(p.name.startswith("mtp-data-") for p in ck.iterdir())
    assert main(args) == 0                           # finished checkpoint: resumes at the end, writes again
    assert "resuming from" in capsys.readouterr().err
