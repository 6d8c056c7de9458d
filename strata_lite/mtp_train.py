"""`strata-lite train-mtp`: fit an MTP block to a model by self-distillation (docs/mtp_training.md).

    data    (mtp_train_data)  the frozen model over the text: last hidden states, its own top-k tokens
    answers (mtp_train_answers) optional text: the model's greedy answers to coding prompts
    model   (mtp_train_model) the block's float forward and hand-written backward, the chunked loss
    fit     (mtp_train_fit)   Adam, schedule, clipping, checkpoints
    device  (mtp_train_device) numpy on the host or CuPy on the GPU for all of the above math
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
from .mtp_train_data import MtpData, collect, read_tokens, split_files, split_held_out, stdlib_files
from .mtp_train_device import array_module, device_module, matmul_precision, to_device, to_host, tree_to
from .mtp_train_fit import FitOptions, fit
from .mtp_train_model import FrozenHead, draft_hits, evaluate, evaluate_depths, init_params
from .mtp_train_prompts import prompts
from .mtp_train_defaults import DRAFT_VOCAB
from .mtp_vocab import draft_vocab_of

OUT_TYPES = {"Q8_0": QType.Q8_0, "F16": QType.F16}
COLLECT_K = 8        # top-k targets kept per row (a cached data set serves --topk 1 .. 8 alike)


@dataclass
class TrainReport:
    out_path: str
    device: str = "cpu"
    n_train_tokens: int = 0
    n_answer_tokens: int = 0                  # of them, the model's own answers
    answers_s: float = 0.0                    # generating the answers
    collect_s: float = 0.0                    # the model's pass over all text
    train_s: float = 0.0                      # the training steps
    step_s: float = 0.0                       # mean wall time of a training step
    losses: list = field(default_factory=list)   # per step: loss1 + sum of chain_weight^(D-1) * lossD
    chain_weight: float = 0.0                 # the chained passes' loss weight (0: pass 1 alone)
    chain_depth: int = 1                      # the deepest pass trained
    tf32: bool = False                        # the GPU's float32 mat-muls on the TF32 tensor cores
    held: dict = field(default_factory=dict)  # held-out set name -> HeldOut
    draft_vocab: int = 0                      # size of the sidecar's draft vocabulary (0: none)

    def summary(self) -> str:
        first = np.mean(self.losses[:10]) if self.losses else float("nan")
        last = np.mean(self.losses[-10:]) if self.losses else float("nan")
        w, depth = self.chain_weight, self.chain_depth if self.chain_weight else 1
        loss = "loss" if depth < 2 else "loss (depth 1 + " + " + ".join(
            f"{w ** (d - 1):g} x depth {d}" for d in range(2, depth + 1)) + ")"
        where = f"{self.device}{' (TF32 mat-muls)' if self.tf32 else ''}"
        lines = [f"train-mtp on {where}: {len(self.losses)} steps in {self.train_s:.1f} s ({self.step_s:.3f} s/step), "
                 f"{loss} {first:.4f} -> {last:.4f} (mean of first/last 10)",
                 f"{self.n_train_tokens} training tokens, {self.n_answer_tokens} of them the model's answers "
                 f"(generated in {self.answers_s:.1f} s); the model's pass over all text {self.collect_s:.1f} s"]
        if self.draft_vocab:
            lines.append(f"draft vocabulary: {self.draft_vocab} tokens, the training text's most frequent")
        for name, h in self.held.items():
            lines.append(f"held-out {name} ({h.rows} rows): top-1 agreement with the model's token i+2 "
                         f"{h.before[1]:.4f} -> {h.after[1]:.4f}, loss {h.before[0]:.4f} -> {h.after[0]:.4f}")
            for d, (b, a) in enumerate(zip(h.before_chain, h.after_chain), 2):
                lines.append(f"  depth {d} (a chained draft, fed the block's output and the token i+{d}): top-1 "
                             f"agreement with the model's token i+{d + 1} {b[1]:.4f} -> {a[1]:.4f}, loss "
                             f"{b[0]:.4f} -> {a[0]:.4f}")
            if self.draft_vocab:
                lines.append(f"  drafting from the draft vocabulary (which holds {h.draft[1]:.2%} of the model's "
                             f"tokens i+2 there): top-1 agreement {h.draft[0]:.4f}")
        if not self.held:
            lines.append("held-out: none (no text file or prompt fell in the held-out tenth), so no top-1 "
                         "agreement figure")
        return "\n".join(lines + [f"wrote {self.out_path}"])


@dataclass
class HeldOut:
    data: MtpData
    rows: int
    before: tuple = (float("nan"), float("nan"))   # (loss, top-1 agreement)
    after: tuple = (float("nan"), float("nan"))
    before_chain: list = field(default_factory=list)  # the same at depths 2.. (evaluate_depths)
    after_chain: list = field(default_factory=list)
    draft: tuple = (float("nan"), float("nan"))    # (top-1 agreement within the draft vocabulary, its coverage)


def _fingerprint(*parts) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.tobytes() if isinstance(p, np.ndarray) else repr(p).encode())
    return h.hexdigest()[:16]


def _model_key(llm) -> tuple:
    st = os.stat(llm.model_path)
    return os.path.abspath(llm.model_path), st.st_size, st.st_mtime_ns


def _cached_collect(llm, ids, ctx, k, cache_dir, progress, desc) -> MtpData:
    """collect(), kept in cache_dir (keyed by model file, tokens, ctx and k) so a resumed run skips it."""
    path = None
    if cache_dir:
        key = _fingerprint(*_model_key(llm), ids, ctx, k)
        path = os.path.join(cache_dir, f"mtp-data-{desc}-{key}.npz")
        if os.path.exists(path):
            return MtpData.load(path)
    data = collect(llm, ids, ctx, k, progress, desc)
    if path:
        with written_whole(path) as tmp:
            data.save(tmp)
    return data


def _cached_answers(llm, asked: list[str], max_tokens: int, cache_dir, progress) -> list[np.ndarray]:
    """mtp_train_answers.answer_ids on llm's model and backend, kept in cache_dir (keyed by model file,
    prompts and max_tokens) so a resumed run trains on the same answers without generating them again."""
    from .mtp_train_answers import answer_ids
    path = None
    if cache_dir:
        key = _fingerprint(*_model_key(llm), asked, max_tokens)
        path = os.path.join(cache_dir, f"mtp-answers-{key}.npz")
        if os.path.exists(path):
            with np.load(path) as z:
                return np.split(z["ids"], np.cumsum(z["lengths"])[:-1])
    out = answer_ids(llm.model_path, llm.backend.name, asked, max_tokens, progress)
    if path:
        with written_whole(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, ids=np.concatenate(out), lengths=np.asarray([len(a) for a in out], np.int64))
    return out


def _mean_over(params, data: MtpData, batch: int, fn) -> list[tuple[float, float]]:
    """fn(batch arrays on the parameters' device) -> [(mean loss, top-1 hits, rows), ...] per figure; ->
    [(mean loss, top-1 agreement), ...] over every row of data, batch windows at a time."""
    xp = array_module(next(iter(params.values())))
    sums = None
    for lo in range(0, len(data), batch):
        b = [to_device(xp, a) for a in data.batch(np.arange(lo, min(lo + batch, len(data))), k=1)]
        got = [(l * n, h, n) for l, h, n in fn(b)]
        sums = got if sums is None else [tuple(map(sum, zip(s, g))) for s, g in zip(sums, got)]
    return [(l / max(n, 1), h / max(n, 1)) for l, h, n in sums]


def evaluate_data(cfg, params, frozen, data: MtpData, batch: int = 4) -> tuple[float, float]:
    """-> (mean loss against the greedy token, top-1 agreement) over every row of data, batch windows at a
    time on the parameters' device."""
    return _mean_over(params, data, batch, lambda b: [evaluate(cfg, params, frozen, b)])[0]


def evaluate_depths_data(cfg, params, frozen, data: MtpData, batch: int = 4,
                         depth: int = 2) -> list[tuple[float, float]]:
    """-> [(loss, top-1 agreement) against the model's token i + 2, the same of the passes 2..depth (chained
    drafts) against their tokens i + D + 1] over every row of data (evaluate_depths)."""
    return _mean_over(params, data, batch, lambda b: evaluate_depths(cfg, params, frozen, b, depth))


def draft_agreement(cfg, params, frozen, data: MtpData, vocab: np.ndarray, batch: int = 4) -> tuple[float, float]:
    """-> (top-1 agreement of the head cut to the draft vocabulary vocab, the fraction of the model's greedy
    tokens i + 2 that vocab holds) over every row of data: what drafting with the sidecar sees."""
    xp = array_module(next(iter(params.values())))
    ids = to_device(xp, vocab.astype(np.int64))
    cut = FrozenHead(frozen.embed, frozen.head_norm, frozen.head[ids])
    hits = rows = 0
    for lo in range(0, len(data), batch):
        b = [to_device(xp, a) for a in data.batch(np.arange(lo, min(lo + batch, len(data))), k=1)]
        h, n = draft_hits(cfg, params, cut, b, ids)
        hits, rows = hits + h, rows + n
    return hits / max(rows, 1), float(np.isin(data.tgt_ids[..., 0], vocab).mean())


def train_mtp(llm, out_path: str, text_files: list[str] | None = None, opts: FitOptions = FitOptions(),
              ctx: int = 256, train_tokens: int = 65536, eval_tokens: int = 8192, out_type: str = "Q8_0",
              checkpoint_dir: str | None = None, checkpoint_every: int = 25, progress: bool = True,
              log=None, device: str = "cpu", answers: int = 0, answer_tokens: int = 512,
              draft_vocab: int = DRAFT_VOCAB, tf32: bool = False) -> TrainReport:
    """Train an MTP block for llm (api.LLM, n_ctx >= ctx) and write it to out_path as a sidecar GGUF.
    device: where the training math runs ("cpu": numpy, "cuda": CuPy); the model's pass runs on llm's
    backend. answers: the first that many of mtp_train_prompts.prompts() are answered by the model (greedy,
    at most answer_tokens each) and the answers added to the text (every tenth prompt's held out).
    draft_vocab: the sidecar's draft vocabulary holds that many of the training text's most frequent tokens
    (mtp_vocab.py); 0, or at least the model's vocabulary: none (the head scores every token).
    tf32: the training math's float32 mat-muls on the GPU's TF32 tensor cores (device "cuda" only)."""
    log = sys.stderr if log is None else log
    if out_type.upper() not in OUT_TYPES:
        raise ValueError(f"--type must be one of {', '.join(OUT_TYPES)}, not {out_type!r}")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise ValueError(f"{out_path}: directory {out_dir} does not exist")
    if ctx < 3 or ctx > llm.n_ctx:
        raise ValueError(f"--ctx must be between 3 and the model context {llm.n_ctx}, not {ctx}")
    if answers < 0 or answer_tokens < 1:
        raise ValueError("--answers must be >= 0 and --answer-tokens >= 1")
    if draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0, not {draft_vocab}")
    xp = device_module(device)
    precision = matmul_precision(device, tf32)
    if checkpoint_dir:
        os.makedirs(checkpoint_dir, exist_ok=True)
    files = stdlib_files() if not text_files else list(text_files)
    for f in files:
        if not os.path.isfile(f) or not os.access(f, os.R_OK):
            raise ValueError(f"{f}: not a readable file")
    train_files, held_files = split_files(files)
    asked = prompts()[:answers]
    train_prompts, held_prompts = split_held_out(asked, str)
    cfg, rep = llm.config, TrainReport(out_path, device)

    t0 = time.perf_counter()
    answered = dict(zip(asked, _cached_answers(llm, asked, answer_tokens, checkpoint_dir, progress))) if asked else {}
    rep.answers_s = time.perf_counter() - t0
    train_answers = [answered[q] for q in train_prompts]
    ids = np.concatenate([*train_answers, read_tokens(llm.tokenizer, train_files, train_tokens)])
    data = _cached_collect(llm, ids, ctx, max(opts.topk, COLLECT_K), checkpoint_dir, progress, "train")
    held_sets = {"text": read_tokens(llm.tokenizer, held_files, eval_tokens) if held_files and eval_tokens >= ctx else None,
                 "answers": np.concatenate([answered[q] for q in held_prompts]) if held_prompts else None}
    for name, held_ids in held_sets.items():
        if held_ids is not None and len(held_ids) >= ctx:
            d = _cached_collect(llm, held_ids, ctx, 1, checkpoint_dir, progress, f"held-out-{name}")
            rep.held[name] = HeldOut(d, d.tgt_ids.shape[0] * d.tgt_ids.shape[1])
    rep.collect_s = time.perf_counter() - t0 - rep.answers_s
    rep.n_train_tokens = len(data) * ctx
    rep.n_answer_tokens = min(rep.n_train_tokens, sum(len(a) for a in train_answers))
    print(f"{len(data)} training windows of {ctx} tokens from {len(train_files)} files and {len(train_prompts)} "
          f"answers; held out: {', '.join(f'{len(h.data)} windows of {n}' for n, h in rep.held.items()) or 'none'} "
          f"({len(held_files)} files, {len(held_prompts)} answers)", file=log)

    rms = float(np.median(np.sqrt((data.hidden[:, :, :] ** 2).mean(-1))))
    params = tree_to(xp, init_params(cfg, llm.weights, rms))
    frozen = FrozenHead.from_model(llm.weights).to(xp)
    eval_batch, depth = max(4, opts.batch), max(2, opts.chain_depth)
    sig = {"model": os.path.abspath(llm.model_path), "model_bytes": os.path.getsize(llm.model_path),
           "data": _fingerprint(data.next_ids), "ctx": ctx, "tf32": tf32}
    vocab = draft_vocab_of(llm.tokenizer, ids, draft_vocab) if 0 < draft_vocab < cfg.n_vocab else None
    rep.draft_vocab = 0 if vocab is None else len(vocab)
    rep.tf32 = tf32
    with precision:
        for h in rep.held.values():
            h.before, *h.before_chain = evaluate_depths_data(cfg, params, frozen, h.data, eval_batch, depth)
        t1 = time.perf_counter()
        st = fit(cfg, params, frozen, data, opts, checkpoint_dir, checkpoint_every, sig, progress, log=log)
        rep.train_s = time.perf_counter() - t1
        for h in rep.held.values():
            h.after, *h.after_chain = evaluate_depths_data(cfg, st.params, frozen, h.data, eval_batch, depth)
            if vocab is not None:
                h.draft = draft_agreement(cfg, st.params, frozen, h.data, vocab, eval_batch)
    rep.losses, rep.chain_weight = [float(x) for x in st.losses], opts.chain_weight
    rep.chain_depth = opts.chain_depth
    rep.step_s = rep.train_s / max(1, st.taken)
    write_sidecar(llm, st.params, out_path, out_type, vocab)
    return rep


def write_sidecar(llm, params: dict, out_path: str, out_type: str = "Q8_0", draft_vocab=None) -> None:
    """params (MtpParams, numpy or cupy arrays) -> the sidecar GGUF of llm's model (loader/mtp.py layout),
    with draft_vocab (ascending token ids) as its draft vocabulary when given."""
    params = {k: to_host(a) for k, a in params.items()}
    arrays = {"eh_proj": np.concatenate([params["eh_embed"], params["eh_hidden"]], axis=1),
              "enorm": params["enorm"], "hnorm": params["hnorm"]}
    arrays.update((k, a) for k, a in params.items() if k not in ("eh_embed", "eh_hidden", "enorm", "hnorm"))
    write_mtp_arrays(GGUFFile(llm.model_path), llm.config, out_path, arrays, OUT_TYPES[out_type.upper()],
                     draft_vocab)
