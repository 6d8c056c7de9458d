"""Training data for the MTP block: the frozen model's last hidden states and its own next tokens.

Text files are tokenized (no special tokens) in a fixed order (by CRC32 of their path, so a token cap
samples across the whole set rather than the first names alphabetically), concatenated and cut into
windows of ctx tokens. Each window runs through the model from an empty cache on the engine's backend
(Transformer.forward with return_hidden); window row i (i = 0 .. ctx - 2) of the MTP data is
    hidden h[i] (n_embd,) float32,  next id t[i+1],  targets: the model's top-k ids after t[..i+1]
    (the greedy token i + 2 first) and their probabilities renormalized over those k.
A file of every tenth CRC value is held out (never trained on) and serves the agreement measurement; the
same rule splits the prompts whose answers are training text (mtp_train_answers).
The model's pass runs on the engine's backend; its top-k is taken there too (on the GPU for CUDA: only
the k ids and probabilities per row, not the logits, are copied to the host).
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from .batch import Batch
from .mtp_train_device import array_module

SKIP_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")


def stdlib_files() -> list[str]:
    """The Python standard library's .py sources (its test suites and site-packages left out)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """-> (training files, held-out files), each in CRC32 order of the absolute path; one file alone is
    all training."""
    return split_held_out(sorted(set(files)), lambda f: os.path.abspath(f))


def split_held_out(items: list[str], key) -> tuple[list[str], list[str]]:
    """-> (training items, held-out items) in CRC32 order of key(item): those whose CRC32 is 0 mod 10 are
    held out, unless that is none or all of them (then everything is training)."""
    crc = {x: zlib.crc32(key(x).encode()) for x in items}
    items = sorted(items, key=lambda x: (crc[x], x))
    held = [x for x in items if crc[x] % 10 == 0]
    if not held or len(held) == len(items):
        return items, []
    return [x for x in items if crc[x] % 10], held


def read_tokens(tokenizer, files: list[str], max_tokens: int) -> np.ndarray:
    """int32 token ids of the files (loader.tokenizer.Tokenizer), concatenated, at most max_tokens."""
    ids: list[int] = []
    for f in files:
        if len(ids) >= max_tokens:
            break
        try:
            with open(f, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError:
            raise ValueError(f"{f}: not UTF-8 text") from None
        ids += tokenizer.encode(text, add_special=False, parse_special=False)
    return np.asarray(ids[:max_tokens], dtype=np.int32)


@dataclass
class MtpData:
    hidden: np.ndarray      # (n_windows, T, n_embd) float32, T = ctx - 1
    next_ids: np.ndarray    # (n_windows, T) int32: t[i+1]
    tgt_ids: np.ndarray     # (n_windows, T, k) int32: the model's top-k after t[..i+1], greedy first
    tgt_p: np.ndarray       # (n_windows, T, k) float32, rows sum to 1

    def __len__(self) -> int:
        return len(self.hidden)

    def batch(self, rows, k: int | None = None):
        """(hidden, next_ids, tgt_ids, tgt_p) of windows `rows`; k: targets cut to the top k (renormalized)."""
        ids, p = self.tgt_ids[rows], self.tgt_p[rows]
        if k is not None and k < ids.shape[-1]:
            ids, p = ids[..., :k], p[..., :k] / p[..., :k].sum(-1, keepdims=True)
        return self.hidden[rows], self.next_ids[rows], ids, p

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            np.savez(f, hidden=self.hidden, next_ids=self.next_ids, tgt_ids=self.tgt_ids, tgt_p=self.tgt_p)

    @classmethod
    def load(cls, path: str) -> "MtpData":
        with np.load(path) as z:
            return cls(z["hidden"], z["next_ids"], z["tgt_ids"], z["tgt_p"])


def collect(llm, ids: np.ndarray, ctx: int, k: int, progress: bool = True, desc: str = "model") -> MtpData:
    """Run the frozen model over windows of ctx tokens of ids (a partial last window is dropped)."""
    n_win = len(ids) // ctx
    if n_win == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}")
    cfg, T = llm.config, ctx - 1
    data = MtpData(np.empty((n_win, T, cfg.n_embd), np.float32), np.empty((n_win, T), np.int32),
                   np.empty((n_win, T, k), np.int32), np.empty((n_win, T, k), np.float32))
    for w in tqdm(range(n_win), desc=desc, unit="window", disable=not progress):
        win = ids[w * ctx:(w + 1) * ctx]
        batch = Batch.single(win, 0, llm._pages)
        batch.validate(llm.kv.n_pages, llm.kv.page_size, cfg.n_vocab)
        logits, hidden = llm.model.forward(batch, llm.kv, return_hidden=True)   # on the backend's device
        ids_k, p_k = top_k(logits[1:], k)
        data.hidden[w] = llm.backend.to_host(hidden[:T])
        data.next_ids[w] = win[1:]
        data.tgt_ids[w], data.tgt_p[w] = llm.backend.to_host(ids_k), llm.backend.to_host(p_k)
    return data


def top_k(logits, k: int):
    """logits (n, n_vocab), numpy or cupy -> (ids (n, k) int32 by descending logit, their softmax
    probabilities renormalized over the k, float32), of the same module. Ties go to the lower id, as argmax
    picks the first; k > n_vocab gives n_vocab columns."""
    xp = array_module(logits)
    n, k = logits.shape[0], min(k, logits.shape[-1])
    if k == 1:
        return logits.argmax(-1).astype(xp.int32)[:, None], xp.ones((n, 1), xp.float32)
    z, rows = logits.copy(), xp.arange(n)
    ids, vals = xp.empty((n, k), xp.int32), xp.empty((n, k), logits.dtype)
    for j in range(k):            # k whole-row argmax passes (k <= 8 here): no sort, same on numpy and cupy
        ids[:, j] = z.argmax(-1)
        vals[:, j] = z[rows, ids[:, j]]
        z[rows, ids[:, j]] = -np.inf
    p = xp.exp(vals - vals[:, :1])
    return ids, (p / p.sum(-1, keepdims=True)).astype(xp.float32)
