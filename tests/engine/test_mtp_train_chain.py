"""Chained MTP training (depths 2 and 3): the mixed attention against a float64 loop over positions, the
gradient of loss1 + w * loss2 (+ w^2 * loss3; each pass's inputs from the earlier passes held constant)
against central finite differences, chain weight 0 as the one-pass loss and gradients bit for bit, a short
run lowering the depth-2 loss, and the held-out depth lines of the command."""
import math

import numpy as np
import pytest

from strata_lite import LLM
from strata_lite.cli import main
from strata_lite.mtp_train_fit import FitOptions, fit
from strata_lite.mtp_train_math import attention_fwd, mixed_attention_bwd, mixed_attention_fwd
from strata_lite.mtp_train_model import (FrozenHead, chain_fwd, chain_loss_and_grads, depth1_loss_and_grads,
                                        evaluate, evaluate_depths, init_params, loss_and_grads, trunk_fwd,
                                        trunk_kv)
from mtp_train_helpers import tiny_model_data, write_texts
from tiny_model import write_tiny_model


def _mixed_reference(q, k, v, k_ctx, v_ctx, chain=()):
    """Row t of each sequence and query head h: softmax over the scores of context rows 0..t, row t of each
    chain pair and its own key, the weighted sum of those values; kv head h // (Hq / Hkv). float64, one
    position at a time."""
    B, T, Hq, d = q.shape
    g = Hq // k.shape[2]
    out = np.zeros((B, T, Hq, d))
    for b in range(B):
        for t in range(T):
            for h in range(Hq):
                keys = np.concatenate([k_ctx[b, :t + 1, h // g], *(kc[b, t:t + 1, h // g] for kc, _ in chain),
                                       k[b, t:t + 1, h // g]])
                vals = np.concatenate([v_ctx[b, :t + 1, h // g], *(vc[b, t:t + 1, h // g] for _, vc in chain),
                                       v[b, t:t + 1, h // g]])
                s = keys @ q[b, t, h] / math.sqrt(d)
                w = np.exp(s - s.max())
                out[b, t, h] = (w / w.sum()) @ vals
    return out


def _qkv(rng, B=2, T=6, Hq=4, Hkv=2, d=8):
    return (rng.standard_normal((B, T, Hq, d)), *(rng.standard_normal((B, T, Hkv, d)) for _ in range(4)))


def test_mixed_attention_matches_a_loop_over_positions():
    q, k, v, kc, vc = _qkv(np.random.default_rng(0))
    out, _ = mixed_attention_fwd(q, k, v, kc, vc)
    np.testing.assert_allclose(out, _mixed_reference(q, k, v, kc, vc), rtol=1e-12, atol=1e-12)
    # float32 in, float32 out (training's dtype), within its rounding
    out32, _ = mixed_attention_fwd(*(a.astype(np.float32) for a in (q, k, v, kc, vc)))
    assert out32.dtype == np.float32 and np.abs(out32 - out).max() <= 1e-5


def test_mixed_attention_with_chain_rows_matches_a_loop_over_positions():
    """Depth 3 and 4: one and two row-aligned (k, v) pairs of earlier drafts between context and own key."""
    rng = np.random.default_rng(4)
    q, k, v, kc, vc = _qkv(rng)
    for n in (1, 2):
        chain = tuple(tuple(rng.standard_normal(k.shape) for _ in range(2)) for _ in range(n))
        out, _ = mixed_attention_fwd(q, k, v, kc, vc, chain)
        np.testing.assert_allclose(out, _mixed_reference(q, k, v, kc, vc, chain), rtol=1e-12, atol=1e-12)


def test_mixed_attention_with_the_rows_own_kv_as_context_is_causal_attention():
    """Context row t+1 standing in for row t's own key: the causal attention of those rows, shifted."""
    q, k, v, _, _ = _qkv(np.random.default_rng(1))
    causal, _ = attention_fwd(q, k, v)
    mixed, _ = mixed_attention_fwd(q[:, 1:], k[:, 1:], v[:, 1:], k[:, :-1], v[:, :-1])
    np.testing.assert_allclose(mixed, causal[:, 1:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_chain", [0, 2])
def test_mixed_attention_backward_matches_finite_differences(n_chain):
    """dq, dk, dv of sum(out * r) along random directions; the context and the chain's rows get no gradient
    (constants)."""
    rng = np.random.default_rng(2)
    q, k, v, kc, vc = _qkv(rng)
    chain = tuple(tuple(rng.standard_normal(k.shape) for _ in range(2)) for _ in range(n_chain))
    r = rng.standard_normal(q.shape)
    _, cache = mixed_attention_fwd(q, k, v, kc, vc, chain)
    grads = mixed_attention_bwd(r, cache)
    eps = 1e-6
    for i, g in enumerate(grads):
        d = rng.standard_normal(g.shape)
        args = [q, k, v]
        args[i] = args[i] + eps * d
        plus = (mixed_attention_fwd(*args, kc, vc, chain)[0] * r).sum()
        args[i] = args[i] - 2 * eps * d
        minus = (mixed_attention_fwd(*args, kc, vc, chain)[0] * r).sum()
        fd = (plus - minus) / (2 * eps)
        assert g.shape == args[i].shape and abs(fd - (g * d).sum()) <= 1e-7 * max(1.0, abs(fd)), i


def _problem(tmp_path, arch, k=1):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, mtp=False, n_embd=32, n_ff=64)
    llm = LLM(str(path), backend="cpu", n_ctx=64, n_batch=64)
    cfg, rng = llm.config, np.random.default_rng(1)
    p = {n: a.astype(np.float64) + 0.05 * rng.standard_normal(a.shape)
         for n, a in init_params(cfg, llm.weights, 2.0).items()}
    B, T = 2, 5
    tgt = np.stack([rng.permutation(cfg.n_vocab)[:k] for _ in range(B * T)]).reshape(B, T, k)
    batch = (2.0 * rng.standard_normal((B, T, cfg.n_embd)), rng.integers(0, cfg.n_vocab, (B, T)), tgt,
             rng.dirichlet(np.ones(k), (B, T)))
    return cfg, p, FrozenHead.from_model(llm.weights, np.float64), batch


def test_chain_rows_are_the_block_on_its_own_output(tmp_path):
    """Depth-2 row t (position t + 1) equals a plain forward of the rows 0..t of pass 1 followed by one row
    (hidden x1[t], token next_ids[t + 1]) whose attention sees pass 1's keys of rows 0..t: i.e. pass 1 run
    on t + 2 rows whose last row's hidden state and token are replaced, read at its last row."""
    cfg, p, frozen, (hidden, next_ids, _, _) = _problem(tmp_path, "qwen3")
    x1, cache = trunk_fwd(cfg, p, frozen, hidden, next_ids)
    x2, _ = chain_fwd(cfg, p, frozen, x1, [trunk_kv(cache)], next_ids)
    assert x2.shape == (hidden.shape[0], hidden.shape[1] - 1, hidden.shape[2])
    for t in range(x2.shape[1]):
        h, ids = hidden[:, :t + 2].copy(), next_ids[:, :t + 2].copy()
        h[:, t + 1] = x1[:, t]
        # a causal pass over these rows lets rows 0..t see each other exactly as pass 1 did (causality),
        # and the last row sees them and itself: the chained draft's attention
        full, _ = trunk_fwd(cfg, p, frozen, h, ids)
        np.testing.assert_allclose(x2[:, t], full[:, t + 1], rtol=1e-10, atol=1e-10)


def test_depth3_rows_are_the_block_on_the_second_drafts_output(tmp_path):
    """Depth-3 row t (position t + 2) equals the last row of a causal forward of pass 1's rows 0..t, then
    the depth-2 row (hidden x1[t], token next_ids[t + 1]), then a row with hidden x2[t] and token
    next_ids[t + 2]: it sees pass 1's rows 0..t, the second draft's row and itself, as a third chained
    draft does at inference."""
    cfg, p, frozen, (hidden, next_ids, _, _) = _problem(tmp_path, "qwen2")
    x1, cache1 = trunk_fwd(cfg, p, frozen, hidden, next_ids)
    x2, cache2 = chain_fwd(cfg, p, frozen, x1, [trunk_kv(cache1)], next_ids)
    x3, _ = chain_fwd(cfg, p, frozen, x2, [trunk_kv(cache1), trunk_kv(cache2)], next_ids)
    assert x3.shape == (hidden.shape[0], hidden.shape[1] - 2, hidden.shape[2])
    for t in range(x3.shape[1]):
        h, ids = hidden[:, :t + 3].copy(), next_ids[:, :t + 3].copy()
        h[:, t + 1], h[:, t + 2] = x1[:, t], x2[:, t]
        full, _ = trunk_fwd(cfg, p, frozen, h, ids)
        np.testing.assert_allclose(full[:, t + 1], x2[:, t], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(x3[:, t], full[:, t + 2], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch,k,depth,fw", [("qwen2", 1, 2, 0.0), ("qwen3", 3, 2, 0.0), ("llama", 1, 2, 0.0),
                                              ("qwen2", 1, 3, 0.0), ("qwen3", 3, 3, 0.0), ("qwen2", 1, 2, 0.8),
                                              ("qwen3", 3, 3, 0.8)])
def test_chain_gradients_match_finite_differences(tmp_path, arch, k, depth, fw):
    """The gradient of loss1 + w * loss2 (+ w^2 * loss3), each pass's inputs (the earlier passes' outputs
    and keys/values) fixed at the unperturbed parameters' values (the stop-gradient objective), against
    central differences in float64: a random direction per tensor and two entries each. fw > 0: every
    pass's loss with its feature term of that weight."""
    cfg, p, frozen, batch = _problem(tmp_path, arch, k)
    w = 0.7
    loss, grads, _ = loss_and_grads(cfg, p, frozen, batch, chain_weight=w, chain_depth=depth, feature_weight=fw)
    _, _, _, x, kv = depth1_loss_and_grads(cfg, p, frozen, batch)
    consts = [(x, [kv])]
    for _ in range(3, depth + 1):
        _, _, _, x, kv2 = chain_loss_and_grads(cfg, p, frozen, batch, x, consts[-1][1])
        consts.append((x, consts[-1][1] + [kv2]))
    assert sorted(grads) == sorted(p)
    rng, eps = np.random.default_rng(3), 1e-6

    def total(q):
        return depth1_loss_and_grads(cfg, q, frozen, batch, fw)[0] + sum(
            w ** (d + 1) * chain_loss_and_grads(cfg, q, frozen, batch, xc, kvs, fw)[0]
            for d, (xc, kvs) in enumerate(consts))

    assert abs(total(p) - loss) <= 1e-12 * abs(loss)

    def fd(name, d):
        return (total(dict(p, **{name: p[name] + d})) - total(dict(p, **{name: p[name] - d}))) / (2 * eps)

    for name, a in p.items():
        g = grads[name]
        assert g.shape == a.shape and g.dtype == np.float64, name
        d = rng.standard_normal(a.shape)
        f = fd(name, eps * d)
        assert abs(f - (g * d).sum()) <= 1e-6 * max(1.0, abs(f)), name
        for idx in rng.integers(0, a.size, 2):
            e = np.zeros(a.size)
            e[idx] = eps
            f = fd(name, e.reshape(a.shape))
            assert abs(f - g.reshape(-1)[idx]) <= 1e-6 * max(1.0, abs(f)), (name, idx)


def test_chain_weight_zero_is_the_one_pass_result(tmp_path):
    """float32, as training runs: the same loss, hits and gradients, bit for bit."""
    cfg, p64, frozen64, batch64 = _problem(tmp_path, "qwen2", k=3)
    p = {n: a.astype(np.float32) for n, a in p64.items()}
    frozen = FrozenHead(frozen64.embed, frozen64.head_norm.astype(np.float32), frozen64.head.astype(np.float32))
    batch = (batch64[0].astype(np.float32), batch64[1], batch64[2], batch64[3].astype(np.float32))
    loss0, g0, hits0 = loss_and_grads(cfg, p, frozen, batch, chain_weight=0.0)
    loss1, g1, hits1, _, _ = depth1_loss_and_grads(cfg, p, frozen, batch)
    assert loss0 == loss1 and hits0 == hits1 and sorted(g0) == sorted(g1)
    for name in g1:
        np.testing.assert_array_equal(g0[name], g1[name], err_msg=name)
    loss_c, g_c, _ = loss_and_grads(cfg, p, frozen, batch, chain_weight=0.5)
    assert loss_c > loss0 and any(not np.array_equal(g_c[n], g0[n]) for n in g0)
    assert loss_and_grads(cfg, p, frozen, batch, chain_weight=0.5, chain_depth=1)[0] == loss0
    assert loss_and_grads(cfg, p, frozen, batch, chain_weight=0.5, chain_depth=3)[0] > loss_c


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_model_data(tmp_path_factory.mktemp("chain"), 1)


def test_training_with_the_chain_lowers_the_depth2_loss(data):
    """30 steps: the depth-2 loss over every window falls, and by more than a one-pass run's does; the
    depth-1 figures of evaluate_depths are evaluate's."""
    llm, d = data
    cfg, frozen, every = llm.config, FrozenHead.from_model(llm.weights), d.batch(np.arange(len(d)), k=1)
    rms = float(np.median(np.sqrt((d.hidden ** 2).mean(-1))))

    def run(w):
        opts = FitOptions(steps=30, lr=2e-3, warmup=3, batch=2, chain_weight=w)
        return fit(cfg, init_params(cfg, llm.weights, rms), frozen, d, opts, progress=False).params

    trained = run(0.5)
    before, chained, one_pass = (evaluate_depths(cfg, q, frozen, every)
                                 for q in (init_params(cfg, llm.weights, rms), trained, run(0.0)))
    assert chained[0] == evaluate(cfg, trained, frozen, every)
    assert chained[1][2] == len(d) * (d.next_ids.shape[1] - 1)
    print(f"depth-2 loss {before[1][0]:.3f} -> {chained[1][0]:.3f} (one-pass run {one_pass[1][0]:.3f}); "
          f"depth-1 {before[0][0]:.3f} -> {chained[0][0]:.3f} (one-pass run {one_pass[0][0]:.3f})")
    assert chained[1][0] < 0.85 * before[1][0]
    assert chained[1][0] < one_pass[1][0]


def test_training_depth3_lowers_the_depth3_loss(data):
    """30 steps with the third pass (weight 0.25) against 30 with two: the depth-3 loss over every window
    ends lower (measured on the tiny model: 18.53 -> 17.60; depth 2 17.16 -> 16.94, depth 1 16.92 ->
    16.91)."""
    llm, d = data
    cfg, frozen, every = llm.config, FrozenHead.from_model(llm.weights), d.batch(np.arange(len(d)), k=1)
    rms = float(np.median(np.sqrt((d.hidden ** 2).mean(-1))))

    def run(depth):
        opts = FitOptions(steps=30, lr=2e-3, warmup=3, batch=2, chain_weight=0.5, chain_depth=depth)
        return evaluate_depths(cfg, fit(cfg, init_params(cfg, llm.weights, rms), frozen, d, opts,
                                        progress=False).params, frozen, every, 3)

    two, three = run(2), run(3)
    assert three[2][2] == len(d) * (d.next_ids.shape[1] - 2)
    print(f"depth-3 loss {two[2][0]:.3f} -> {three[2][0]:.3f}")
    assert three[2][0] < 0.98 * two[2][0]


def test_cli_chain_weight(tmp_path, capsys):
    """--chain-weight reaches the options and the held-out report prints the depth-2 agreement; a negative
    weight is one line and exit status 2."""
    model = write_tiny_model(tmp_path / "m.gguf")
    texts = write_texts(tmp_path)
    args = ["train-mtp", "--model", str(model), "--text", *texts, "--steps", "2", "--ctx", "32",
            "--eval-tokens", "64", "--draft-vocab", "0", "-o", str(tmp_path / "o.gguf")]
    assert main(args + ["--chain-weight", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "depth 1 + 0.25 x depth 2" in out and "agreement with the model's token i+3" in out, out
    assert main(args + ["--chain-weight", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chain-weight" in err[0]
    assert main(args + ["--chain-depth", "3"]) == 0
    out = capsys.readouterr().out
    assert "depth 1 + 0.5 x depth 2 + 0.25 x depth 3" in out and "agreement with the model's token i+4" in out, out
    for bad, name in ((["--chain-depth", "0"], "--chain-depth"), (["--tf32", "--device", "cpu"], "--tf32")):
        assert main(args + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and name in err[0], err
