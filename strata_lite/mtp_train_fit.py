"""The optimization loop of MTP training: Adam, warm-up + cosine learning rate, global-norm gradient
clipping, a tqdm bar with the loss, and resumable npz checkpoints (written whole).

Deterministic for a seed: the windows of step s are fixed by (seed, s) alone (epoch e visits the windows
in the order of default_rng([seed, e]).permutation, numpy on the host whatever the device), so a run
resumed from a checkpoint takes exactly the steps an uninterrupted run takes, and the CPU and GPU runs of a
seed train on the same windows in the same order.

The arrays live where the parameters do (numpy, or cupy: mtp_train_device): each step's windows are copied
to that device explicitly, the loss and gradient norm come back as one number each per step (logging and
the finite-loss check), checkpoints are numpy npz either way (a checkpoint resumes on either device).
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from .loader.atomic_file import written_whole
from .mtp_train_defaults import CHAIN_DEPTH, CHAIN_WEIGHT, FEATURE_WEIGHT
from .mtp_train_device import array_module, to_device, to_host, tree_to
from .mtp_train_model import loss_and_grads

CHECKPOINT_NAME = "mtp-train.npz"


@dataclass(frozen=True)
class FitOptions:
    steps: int = 300
    seed: int = 0
    lr: float = 3e-4
    warmup: int = 20              # steps of linear warm-up; then cosine decay to lr * min_lr_frac
    min_lr_frac: float = 0.1
    batch: int = 2                # windows per step
    clip: float = 1.0             # global gradient norm limit
    topk: int = 1                 # 1: cross-entropy on the greedy token; k > 1: soft targets (KL to top-k)
    chain_weight: float = CHAIN_WEIGHT   # loss1 + sum of chain_weight^(D-1) * lossD (chained passes); 0: pass 1
    chain_depth: int = CHAIN_DEPTH       # the deepest chained pass D trained (1: pass 1 alone)
    feature_weight: float = FEATURE_WEIGHT   # each pass's output pulled towards the model's state (0: no)
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step + 1) / max(1, self.warmup))
        t = step / max(1, self.steps - 1)
        return self.lr * warm * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def step_windows(opts: FitOptions, n_windows: int, step: int) -> np.ndarray:
    """The window indices of one step (a function of seed and step only)."""
    out = []
    for j in range(step * opts.batch, (step + 1) * opts.batch):
        epoch, pos = divmod(j, n_windows)
        out.append(np.random.default_rng([opts.seed, epoch]).permutation(n_windows)[pos])
    return np.asarray(out)


@dataclass
class FitState:
    params: dict
    m: dict
    v: dict
    step: int = 0
    losses: list | None = None      # mean loss of every step taken
    taken: int = 0                  # steps taken by the last fit() call (the rest came from a checkpoint)

    @classmethod
    def fresh(cls, params: dict) -> "FitState":
        return cls(params, {k: array_module(a).zeros_like(a) for k, a in params.items()},
                   {k: array_module(a).zeros_like(a) for k, a in params.items()}, 0, [])

    def to(self, xp) -> "FitState":
        """The state with parameters and moments on xp's device."""
        return FitState(tree_to(xp, self.params), tree_to(xp, self.m), tree_to(xp, self.v), self.step,
                        self.losses, self.taken)


def adam_step(opts: FitOptions, st: FitState, grads: dict) -> float:
    """Clip the gradients to opts.clip (global norm) and take one Adam step; -> the norm before clipping
    (summed in float64 on the device; one number copied back)."""
    xp = array_module(next(iter(grads.values())))
    norm = math.sqrt(float(sum((g.astype(np.float64) ** 2).sum() for g in grads.values())))
    scale = min(1.0, opts.clip / norm) if norm > 0 else 1.0
    lr, t = opts.lr_at(st.step), st.step + 1
    c1, c2 = 1 - opts.beta1 ** t, 1 - opts.beta2 ** t
    for k, p in st.params.items():
        g = grads[k] * scale
        st.m[k] *= opts.beta1
        st.m[k] += (1 - opts.beta1) * g
        st.v[k] *= opts.beta2
        st.v[k] += (1 - opts.beta2) * g * g
        p -= (lr / c1) * st.m[k] / (xp.sqrt(st.v[k] / c2) + opts.adam_eps)
    st.step = t
    return norm


def save_checkpoint(path: str, st: FitState, signature: dict) -> None:
    arrays = {f"{kind}/{k}": to_host(a) for kind, d in (("p", st.params), ("m", st.m), ("v", st.v))
              for k, a in d.items()}
    with written_whole(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, step=np.int64(st.step), losses=np.asarray(st.losses, np.float64),
                     signature=np.frombuffer(json.dumps(signature, sort_keys=True).encode(), np.uint8), **arrays)


def load_checkpoint(path: str, signature: dict) -> FitState:
    """The state saved at path; ValueError (one line) when it belongs to another run."""
    try:
        with np.load(path) as npz:
            z = {name: npz[name] for name in npz.files}
        saved = json.loads(z["signature"].tobytes().decode())
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a readable MTP training checkpoint ({e}); remove it to start over") from None
    want = json.loads(json.dumps(signature, sort_keys=True))
    for key in sorted(set(saved) | set(want)):
        if saved.get(key) != want.get(key):
            raise ValueError(f"{path}: checkpoint of another run ({key} = {saved.get(key)!r}, this run has "
                             f"{want.get(key)!r}); remove it or use another --checkpoint directory")
    d = {"p": {}, "m": {}, "v": {}}
    for name in z:
        if "/" in name:
            kind, k = name.split("/", 1)
            d[kind][k] = z[name]
    return FitState(d["p"], d["m"], d["v"], int(z["step"]), list(z["losses"]))


def fit(cfg, params: dict, frozen, data, opts: FitOptions, checkpoint_dir: str | None = None,
        checkpoint_every: int = 25, signature: dict | None = None, progress: bool = True,
        stop_after: int | None = None, log=None) -> FitState:
    """Train params (a dict of float arrays, updated in place unless a checkpoint is resumed) on data
    (mtp_train_data.MtpData) for opts.steps steps. checkpoint_dir: resume from its checkpoint when present
    (and of this run: same signature, options and parameter shapes), save every checkpoint_every steps and
    at the end. stop_after: return after that many steps of this call (tests: an interrupted run).
    The device is the parameters' (numpy or cupy arrays; frozen and the returned state on the same one)."""
    log = sys.stderr if log is None else log
    xp = array_module(next(iter(params.values())))
    sig = dict(signature or {}, options=asdict(opts), shapes={k: list(a.shape) for k, a in params.items()})
    path = os.path.join(checkpoint_dir, CHECKPOINT_NAME) if checkpoint_dir else None
    st = FitState.fresh(params)
    if path and os.path.exists(path):
        st = load_checkpoint(path, sig).to(xp)
        print(f"resuming from {path} at step {st.step}", file=log)
    end = opts.steps if stop_after is None else min(opts.steps, st.step + stop_after)
    with tqdm(total=opts.steps, initial=st.step, desc="train-mtp", unit="step", disable=not progress,
              file=log) as bar:
        while st.step < end:
            batch = [to_device(xp, a) for a in data.batch(step_windows(opts, len(data), st.step), opts.topk)]
            loss, grads, _ = loss_and_grads(cfg, st.params, frozen, batch, opts.chain_weight, opts.chain_depth,
                                            opts.feature_weight)
            if not math.isfinite(loss):
                raise ValueError(f"the loss is {loss} at step {st.step}; try a lower --lr")
            norm = adam_step(opts, st, grads)
            st.losses.append(loss)
            st.taken += 1
            bar.set_postfix(loss=f"{loss:.4f}", avg10=f"{np.mean(st.losses[-10:]):.4f}", gnorm=f"{norm:.2f}",
                            refresh=False)
            bar.update(1)
            if path and (st.step % checkpoint_every == 0 or st.step == end):
                save_checkpoint(path, st, sig)
    return st
