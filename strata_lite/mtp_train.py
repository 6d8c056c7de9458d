"""`strata-lite train-mtp`: fit an MTP block to a model by self-distillation (docs/mtp_training.md).

    data    (mtp_train_data)  the frozen model over the text: last hidden states, its own top-k tokens
    model   (mtp_train_model) the block's float forward and hand-written backward, the chunked loss
    fit     (mtp_train_fit)   Adam, schedule, clipping, checkpoints
    output  loader.mtp.write_mtp_arrays: the sidecar GGUF that load_mtp_file reads
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as QType

from .loader.atomic_file import written_whole
from .loader.gguf_file import GGUFFile
from .loader.mtp import write_mtp_arrays
from .mtp_train_data import MtpData, collect, read_tokens, split_files, stdlib_files
from .mtp_train_fit import FitOptions, fit
from .mtp_train_model import FrozenHead, evaluate, init_params

OUT_TYPES = {"Q8_0": QType.Q8_0, "F16": QType.F16}
COLLECT_K = 8        # top-k targets kept per row (a cached data set serves --topk 1 .. 8 alike)


@dataclass
class TrainReport:
    out_path: str
    n_train_tokens: int = 0
    n_eval_rows: int = 0
    collect_s: float = 0.0
    step_s: float = 0.0                       # mean wall time of a training step
    losses: list = field(default_factory=list)
    eval_before: tuple = (float("nan"), float("nan"))   # (loss, top-1 agreement) on held-out rows
    eval_after: tuple = (float("nan"), float("nan"))

    def summary(self) -> str:
        first = np.mean(self.losses[:10]) if self.losses else float("nan")
        last = np.mean(self.losses[-10:]) if self.losses else float("nan")
        return (f"train-mtp: {len(self.losses)} steps, {self.step_s:.2f} s/step, loss {first:.4f} -> {last:.4f} "
                f"(mean of first/last 10); model pass over {self.n_train_tokens} tokens {self.collect_s:.0f} s\n"
                f"held-out ({self.n_eval_rows} rows): top-1 agreement with the model's token i+2 "
                f"{self.eval_before[1]:.4f} -> {self.eval_after[1]:.4f}, loss {self.eval_before[0]:.4f} -> "
                f"{self.eval_after[0]:.4f}\nwrote {self.out_path}")


def _fingerprint(*parts) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.tobytes() if isinstance(p, np.ndarray) else repr(p).encode())
    return h.hexdigest()[:16]


def _cached_collect(llm, ids, ctx, k, cache_dir, progress, desc) -> MtpData:
    """collect(), kept in cache_dir (keyed by model file, tokens, ctx and k) so a resumed run skips it."""
    path = None
    if cache_dir:
        st = os.stat(llm.model_path)
        key = _fingerprint(os.path.abspath(llm.model_path), st.st_size, st.st_mtime_ns, ids, ctx, k)
        path = os.path.join(cache_dir, f"mtp-data-{desc}-{key}.npz")
        if os.path.exists(path):
            return MtpData.load(path)
    data = collect(llm, ids, ctx, k, progress, desc)
    if path:
        with written_whole(path) as tmp:
            data.save(tmp)
    return data


def evaluate_data(cfg, params, frozen, data: MtpData, batch: int = 4) -> tuple[float, float]:
    """-> (mean loss against the greedy token, top-1 agreement) over every row of data."""
    loss = hits = rows = 0.0
    for lo in range(0, len(data), batch):
        b = data.batch(np.arange(lo, min(lo + batch, len(data))), k=1)
        l, h, n = evaluate(cfg, params, frozen, b)
        loss, hits, rows = loss + l * n, hits + h, rows + n
    return loss / max(rows, 1), hits / max(rows, 1)


def train_mtp(llm, out_path: str, text_files: list[str] | None = None, opts: FitOptions = FitOptions(),
              ctx: int = 256, train_tokens: int = 65536, eval_tokens: int = 8192, out_type: str = "Q8_0",
              checkpoint_dir: str | None = None, checkpoint_every: int = 25, progress: bool = True,
              log=None) -> TrainReport:
    """Train an MTP block for llm (api.LLM, n_ctx >= ctx) and write it to out_path as a sidecar GGUF."""
    log = sys.stderr if log is None else log
    if out_type.upper() not in OUT_TYPES:
        raise ValueError(f"--type must be one of {', '.join(OUT_TYPES)}, not {out_type!r}")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise ValueError(f"{out_path}: directory {out_dir} does not exist")
    if ctx < 3 or ctx > llm.n_ctx:
        raise ValueError(f"--ctx must be between 3 and the model context {llm.n_ctx}, not {ctx}")
    if checkpoint_dir:
        os.makedirs(checkpoint_dir, exist_ok=True)
    files = stdlib_files() if not text_files else list(text_files)
    for f in files:
        if not os.path.isfile(f) or not os.access(f, os.R_OK):
            raise ValueError(f"{f}: not a readable file")
    train_files, held_files = split_files(files)
    cfg, rep = llm.config, TrainReport(out_path)

    t0 = time.perf_counter()
    ids = read_tokens(llm, train_files, train_tokens)
    data = _cached_collect(llm, ids, ctx, max(opts.topk, COLLECT_K), checkpoint_dir, progress, "train")
    held = None
    if held_files and eval_tokens >= ctx:
        held = _cached_collect(llm, read_tokens(llm, held_files, eval_tokens), ctx, 1, checkpoint_dir,
                               progress, "held-out")
    rep.collect_s, rep.n_train_tokens = time.perf_counter() - t0, len(data) * ctx
    print(f"{len(data)} training windows of {ctx} tokens from {len(train_files)} files, "
          f"{0 if held is None else len(held)} held-out windows from {len(held_files)} files", file=log)

    rms = float(np.median(np.sqrt((data.hidden[:, :, :] ** 2).mean(-1))))
    params = init_params(cfg, llm.weights, rms)
    frozen = FrozenHead.from_model(llm.weights)
    if held is not None:
        rep.eval_before = evaluate_data(cfg, params, frozen, held)
        rep.n_eval_rows = held.tgt_ids.shape[0] * held.tgt_ids.shape[1]
    sig = {"model": os.path.abspath(llm.model_path), "model_bytes": os.path.getsize(llm.model_path),
           "data": _fingerprint(data.next_ids), "ctx": ctx}
    t1 = time.perf_counter()
    st = fit(cfg, params, frozen, data, opts, checkpoint_dir, checkpoint_every, sig, progress, log=log)
    rep.losses = [float(x) for x in st.losses]
    rep.step_s = (time.perf_counter() - t1) / max(1, st.taken)
    if held is not None:
        rep.eval_after = evaluate_data(cfg, st.params, frozen, held)
    write_sidecar(llm, st.params, out_path, out_type)
    return rep


def write_sidecar(llm, params: dict, out_path: str, out_type: str = "Q8_0") -> None:
    """params (MtpParams) -> the sidecar GGUF of llm's model (loader/mtp.py layout)."""
    arrays = {"eh_proj": np.concatenate([params["eh_embed"], params["eh_hidden"]], axis=1),
              "enorm": params["enorm"], "hnorm": params["hnorm"]}
    arrays.update((k, a) for k, a in params.items() if k not in ("eh_embed", "eh_hidden", "enorm", "hnorm"))
    write_mtp_arrays(GGUFFile(llm.model_path), llm.config, out_path, arrays, OUT_TYPES[out_type.upper()])
