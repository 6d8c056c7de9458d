"""MTP training on the GPU (`train-mtp --device cuda`): the CuPy path of strata_lite/mtp_train*.py against
the numpy path on tiny models, a short training run, checkpoints across devices, and the command end to end
on the CUDA backend. Skipped (tests/conftest.py) where CuPy sees no GPU.

Tolerances. In float64 both paths compute the same sums in other orders (cuBLAS against OpenBLAS), so the
loss and every gradient agree to 1e-9 of the largest gradient entry: a wrong index, transpose or missing
term shows there. In float32 (what training uses) each path is off the float64 result by its own rounding:
the numpy float32 path, measured on these problems, by at most 1.8e-5 of the largest gradient entry and
1.4e-7 relative in the loss (4.7e-5 and 2e-7 on models twice as wide); the bounds for CuPy's float32 are
5e-4 and 2e-6. CuPy's float32 mat-muls are plain float32 unless CUPY_TF32=1 is set (not done here) or
train-mtp's TF32 switch (its GPU default) is on: test_tf32_matmuls, with its own bounds.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite import LLM
from strata_lite.cli import main
from strata_lite.loader.mtp import load_mtp_file
from strata_lite.mtp_train import evaluate_data, write_sidecar
from strata_lite.mtp_train_data import top_k
from strata_lite.mtp_train_device import to_host, tree_to
from strata_lite.mtp_train_fit import CHECKPOINT_NAME, FitOptions, fit
import strata_lite.mtp_train_model as mtp_model
from strata_lite.mtp_train_model import FrozenHead, init_params, logits, loss_and_grads, params_from_mtp
from mtp_train_helpers import tiny_model_data, write_texts
from tiny_model import write_tiny_model

pytestmark = pytest.mark.gpu

F64_TOL = 1e-9          # of the largest gradient entry: summation order only
F32_GRAD_TOL = 5e-4     # of the largest gradient entry (numpy float32: 1.8e-5 measured)
F32_LOSS_TOL = 2e-6     # relative (numpy float32: 1.4e-7 measured)


@pytest.fixture(scope="module")
def cp():
    """cupy, through the module the training code uses (kernels/cuda/runtime.cupy)."""
    from strata_lite.mtp_train_device import device_module
    return device_module("cuda")


def _tiny(tmp_path, arch="qwen2", **kw):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, **kw)
    return LLM(str(path), backend="cpu", n_ctx=64, n_batch=64)


def _problem(llm, k, dtype, B=2, T=24):
    cfg, rng = llm.config, np.random.default_rng(1)
    p = {n: (a.astype(np.float64) + 0.05 * rng.standard_normal(a.shape)).astype(dtype)
         for n, a in init_params(cfg, llm.weights, 2.0).items()}
    tgt = np.stack([rng.permutation(cfg.n_vocab)[:k] for _ in range(B * T)]).reshape(B, T, k)
    batch = [(2.0 * rng.standard_normal((B, T, cfg.n_embd))).astype(dtype), rng.integers(0, cfg.n_vocab, (B, T)),
             tgt, rng.dirichlet(np.ones(k), (B, T)).astype(dtype)]
    return p, FrozenHead.from_model(llm.weights, dtype), batch


def _on_gpu(cp, p, frozen, batch):
    return tree_to(cp, p), frozen.to(cp), [cp.asarray(a) for a in batch]


def _grad_err(g, ref):
    scale = max(float(np.abs(r).max()) for r in ref.values())
    return max(float(np.abs(to_host(g[n]).astype(np.float64) - ref[n]).max()) for n in ref) / scale


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("chunk", [16, None])
def test_loss_and_gradients_match_numpy(cp, tmp_path, monkeypatch, arch, k, chunk):
    """chunk 16: the head's loss runs over three row chunks on the GPU too (default: one chunk)."""
    if chunk is not None:
        monkeypatch.setattr(mtp_model, "GPU_HEAD_CHUNK_ROWS", chunk)
    llm = _tiny(tmp_path, arch, n_embd=32, n_ff=64)
    cfg = llm.config
    p64, f64, b64 = _problem(llm, k, np.float64)
    loss64, g64, hits64 = loss_and_grads(cfg, p64, f64, b64)
    loss, g, hits = loss_and_grads(cfg, *_on_gpu(cp, p64, f64, b64))
    assert sorted(g) == sorted(g64) and hits == hits64
    assert all(isinstance(a, cp.ndarray) and a.dtype == np.float64 for a in g.values())
    assert abs(loss - loss64) <= F64_TOL * abs(loss64)
    assert _grad_err(g, g64) <= F64_TOL

    p32, f32, b32 = _problem(llm, k, np.float32)
    loss_np32, g_np32, _ = loss_and_grads(cfg, p32, f32, b32)
    loss32, g32, _ = loss_and_grads(cfg, *_on_gpu(cp, p32, f32, b32))
    assert all(a.dtype == np.float32 for a in g32.values())
    err_np, err_cp = _grad_err(g_np32, g64), _grad_err(g32, g64)
    print(f"{arch} top-{k}: float32 gradient error / max |gradient|: numpy {err_np:.2e}, cupy {err_cp:.2e}; "
          f"loss {abs(loss_np32 - loss64) / loss64:.1e}, {abs(loss32 - loss64) / loss64:.1e}")
    assert err_cp <= F32_GRAD_TOL and abs(loss32 - loss64) <= F32_LOSS_TOL * abs(loss64)


@pytest.mark.parametrize("arch,depth,fw", [("qwen2", 2, 0.0), ("qwen3", 2, 0.0), ("qwen2", 3, 0.0),
                                           ("qwen3", 3, 0.8)])
def test_chain_loss_and_gradients_match_numpy(cp, tmp_path, arch, depth, fw):
    """loss1 + 0.5 * loss2 (+ 0.25 * loss3: the chained passes, their mixed attention; fw > 0: each pass with
    its feature term) on the GPU against numpy, with the bounds of test_loss_and_gradients_match_numpy."""
    llm = _tiny(tmp_path, arch, n_embd=32, n_ff=64)
    cfg = llm.config
    kw = dict(chain_weight=0.5, chain_depth=depth, feature_weight=fw)
    p64, f64, b64 = _problem(llm, 1, np.float64)
    loss64, g64, _ = loss_and_grads(cfg, p64, f64, b64, **kw)
    loss, g, _ = loss_and_grads(cfg, *_on_gpu(cp, p64, f64, b64), **kw)
    assert abs(loss - loss64) <= F64_TOL * abs(loss64) and _grad_err(g, g64) <= F64_TOL
    p32, f32, b32 = _problem(llm, 1, np.float32)
    loss32, g32, _ = loss_and_grads(cfg, *_on_gpu(cp, p32, f32, b32), **kw)
    assert _grad_err(g32, g64) <= F32_GRAD_TOL and abs(loss32 - loss64) <= F32_LOSS_TOL * abs(loss64)


def test_tf32_matmuls(cp, tmp_path):
    """--tf32 (runtime.tf32_matmuls): a float32 mat-mul inside the switch carries TF32's rounding (inputs
    cut to 10-bit mantissas: ~1e-4 of the result's scale, against ~1e-6 plain), CuPy's setting is restored
    after, and the training loss and gradients stay near the float64 ones (bounds: ~4x the H100's
    measured errors, printed)."""
    from cupy._core import _routines_linalg as linalg
    from strata_lite.mtp_train_device import matmul_precision
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((256, 512)), rng.standard_normal((512, 256))
    ref = a @ b
    a32, b32 = cp.asarray(a, dtype=np.float32), cp.asarray(b, dtype=np.float32)
    before = linalg.get_compute_type(np.float32)
    with matmul_precision("cuda", True):
        tf32 = to_host(a32 @ b32)
    plain = to_host(a32 @ b32)
    assert linalg.get_compute_type(np.float32) == before
    err_tf32, err_plain = (float(np.abs(x - ref).max() / np.abs(ref).max()) for x in (tf32, plain))
    llm = _tiny(tmp_path, "qwen2", n_embd=32, n_ff=64)
    p64, f64, b64 = _problem(llm, 1, np.float64)
    loss64, g64, _ = loss_and_grads(llm.config, p64, f64, b64, chain_weight=0.5, chain_depth=3)
    p32, f32, b32_ = _problem(llm, 1, np.float32)
    with matmul_precision("cuda", True):
        loss, g, _ = loss_and_grads(llm.config, *_on_gpu(cp, p32, f32, b32_), chain_weight=0.5, chain_depth=3)
    print(f"TF32: mat-mul error {err_tf32:.1e} (plain float32 {err_plain:.1e}); training gradient error "
          f"{_grad_err(g, g64):.1e}, loss {abs(loss - loss64) / loss64:.1e}")
    assert err_plain < 1e-5 < err_tf32 < 1e-2
    assert _grad_err(g, g64) <= 2e-2 and abs(loss - loss64) <= 1e-3 * abs(loss64)


def test_top_k_matches_numpy(cp):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 1000)).astype(np.float32)
    x[:, 10] = x[:, 20] = x.max(-1) + 1          # a tie for first place: the lower id comes first
    for k in (1, 3, 8):
        ids, p = top_k(x, k)
        ids_cp, p_cp = top_k(cp.asarray(x), k)
        np.testing.assert_array_equal(to_host(ids_cp), ids)
        np.testing.assert_allclose(to_host(p_cp), p, rtol=1e-6)
    assert (ids[:, :2] == [10, 20]).all()


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_rows_on_the_gpu(cp, tmp_path, tied):
    """An untied, quantized embedding is dequantized whole for the GPU; a tied one is the head's array
    there too. Either way the rows equal the host's."""
    llm = _tiny(tmp_path, tied_output=tied)
    frozen = FrozenHead.from_model(llm.weights)
    assert (frozen.embed is frozen.head) == tied
    on_gpu = frozen.to(cp)
    assert (on_gpu.embed is on_gpu.head) == tied and isinstance(on_gpu.head, cp.ndarray)
    ids = np.random.default_rng(0).integers(0, llm.config.n_vocab, (3, 7))
    np.testing.assert_array_equal(to_host(on_gpu.embed_rows(cp.asarray(ids), np.float32)),
                                  frozen.embed_rows(ids, np.float32))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_model_data(tmp_path_factory.mktemp("train"), 4)


def _rms(data):
    return float(np.median(np.sqrt((data.hidden ** 2).mean(-1))))


def _run(xp, llm, data, opts, **kw):
    return fit(llm.config, tree_to(xp, init_params(llm.config, llm.weights, _rms(data))),
               FrozenHead.from_model(llm.weights).to(xp), data, opts, progress=False, **kw)


@pytest.mark.parametrize("topk", [1, 4])
def test_training_on_the_gpu_follows_the_cpu(cp, trained, topk):
    """The same windows in the same order, so the same run up to float32 rounding: on the CPU the float32
    and float64 runs of these 30 steps differ by at most 3.7e-6 relative in any step's loss and 4e-7 in the
    final loss over every window (measured); the bounds here are 1e-4 and 1e-3. The loss falls as on the CPU."""
    llm, data = trained
    opts = FitOptions(steps=30, lr=2e-3, warmup=3, batch=2, topk=topk)
    gpu, cpu = _run(cp, llm, data, opts), _run(np, llm, data, opts)
    assert all(isinstance(a, cp.ndarray) for a in gpu.params.values())
    np.testing.assert_allclose(gpu.losses, cpu.losses, rtol=1e-4)
    frozen = FrozenHead.from_model(llm.weights).to(cp)
    before = evaluate_data(llm.config, tree_to(cp, init_params(llm.config, llm.weights, _rms(data))), frozen, data)
    after = evaluate_data(llm.config, gpu.params, frozen, data)
    cpu_after = evaluate_data(llm.config, cpu.params, FrozenHead.from_model(llm.weights), data)
    print(f"top-{topk}: loss {before[0]:.3f} -> {after[0]:.3f} (numpy run {cpu_after[0]:.3f})")
    assert after[0] < 0.85 * before[0]
    assert abs(after[0] - cpu_after[0]) <= 1e-3 * cpu_after[0]


def test_checkpoints_resume_on_either_device(cp, trained, tmp_path):
    llm, data = trained
    opts = FitOptions(steps=8, lr=1e-3, warmup=2, batch=2, seed=3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = _run(cp, llm, data, opts)
    part = _run(cp, llm, data, opts, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=2, stop_after=5)
    assert part.step == 5
    resumed = _run(cp, llm, data, opts, checkpoint_dir=str(tmp_path / "a"))
    assert resumed.step == 8 and resumed.taken == 3
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-6)
    for name in whole.params:
        np.testing.assert_allclose(to_host(resumed.params[name]), to_host(whole.params[name]), rtol=1e-5,
                                   atol=1e-7, err_msg=name)
    # a checkpoint written by the numpy path resumes on the GPU (npz either way)
    _run(np, llm, data, opts, checkpoint_dir=str(tmp_path / "b"), stop_after=5)
    moved = _run(cp, llm, data, opts, checkpoint_dir=str(tmp_path / "b"))
    assert moved.step == 8 and moved.taken == 3 and isinstance(moved.params["attn_q"], cp.ndarray)
    np.testing.assert_allclose(moved.losses, whole.losses, rtol=1e-4)
    assert (tmp_path / "b" / CHECKPOINT_NAME).exists()


def test_sidecar_from_gpu_parameters_reloads(cp, trained, tmp_path):
    llm, data = trained
    st = _run(cp, llm, data, FitOptions(steps=4, lr=1e-3, warmup=1, batch=2))
    out = tmp_path / "m.mtp.gguf"
    write_sidecar(llm, st.params, str(out), "F16")
    mtp = load_mtp_file(str(out), llm.config)
    assert mtp.eh_proj_embed.qtype == QT.F16
    ids = np.asarray([5, 17, 200, 3, 99, 42, 7, 7, 120, 64])
    hidden = data.hidden[:1, :len(ids)]
    frozen = FrozenHead.from_model(llm.weights)
    ref = logits(llm.config, tree_to(np, st.params), frozen, hidden, ids[None])
    back = logits(llm.config, params_from_mtp(mtp), frozen, hidden, ids[None])
    assert np.abs(back - ref).max() <= 2e-2 * np.abs(ref).max()      # F16 rounding of the weights


def test_cli_trains_on_the_gpu(cp, tmp_path, capsys):
    """The whole command on the CUDA backend: the model's answers (engine), its pass over the text with the
    top-k taken on the GPU, training in CuPy, the held-out figures, the sidecar."""
    model = write_tiny_model(tmp_path / "m.gguf", n_embd=256, n_ff=512)
    texts = write_texts(tmp_path)
    out = tmp_path / "m.mtp.gguf"
    assert main(["train-mtp", "--model", str(model), "--text", *texts, "--device", "cuda", "--steps", "3",
                 "--ctx", "32", "--batch", "4", "--eval-tokens", "64", "--answers", "20", "--answer-tokens", "16",
                 "--checkpoint", str(tmp_path / "ck"), "--chain-depth", "3", "--tf32", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "train-mtp on cuda (TF32 mat-muls)" in captured.out and "held-out answers" in captured.out, captured.out
    assert "token i+4" in captured.out, captured.out
    assert "on cuda:" in captured.err
    llm = LLM(str(model), backend="cpu", n_ctx=64)
    assert load_mtp_file(str(out), llm.config).block.attn_q.qtype == QT.Q8_0
