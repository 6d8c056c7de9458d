"""The draft vocabulary of an MTP block: the tokens its head scores (loader/mtp.py, nextn.draft_vocab).

The head of an MTP block is the model's output matrix: for a small model with a large vocabulary it is a
large part of the weight bytes (Qwen2.5-0.5B: 151,936 x 896, ~30% of a decode step's reads), and drafting
pays for it once per drafted token. Drafts only need the tokens the model writes often: the draft
vocabulary is the tokenizer's special and end-of-generation tokens plus the most frequent tokens of a text
(the training text of `train-mtp`, or `strata-lite mtp-vocab`'s), and the head keeps only their rows. A
token outside it is never drafted (the target still writes it: drafts are only proposals).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .loader.gguf_file import GGUFFile
from .loader.model_config import config_from_metadata
from .loader.mtp import choose_draft_vocab, write_draft_vocab
from .loader.tokenizer import Tokenizer
from .mtp_train_data import read_tokens, split_files, stdlib_files
from .mtp_train_defaults import DRAFT_VOCAB


def draft_vocab_of(tokenizer: Tokenizer, ids: np.ndarray, size: int) -> np.ndarray:
    """The draft vocabulary (ascending int32 ids) from token ids of a text: the special and end-of-generation
    tokens, then the most frequent ids, size in all."""
    counts = np.bincount(np.asarray(ids, np.int64), minlength=tokenizer.n_vocab)[:tokenizer.n_vocab]
    return choose_draft_vocab(counts, size, sorted(tokenizer.special_ids | tokenizer.eog_ids))


def coverage(vocab: np.ndarray, ids: np.ndarray) -> float:
    """The fraction of the token ids (a held-out text) that are in the draft vocabulary."""
    ids = np.asarray(ids)
    return float(np.isin(ids, vocab).mean()) if len(ids) else float("nan")


@dataclass
class VocabReport:
    size: int
    n_tokens: int            # tokens of text counted
    held_out_tokens: int
    held_out_coverage: float

    def summary(self) -> str:
        return (f"draft vocabulary: {self.size} tokens from {self.n_tokens} tokens of text; it holds "
                f"{self.held_out_coverage:.2%} of {self.held_out_tokens} held-out tokens")


def add_draft_vocab(model_path: str, sidecar: str, out_path: str, text_files: list[str] | None = None,
                    size: int = DRAFT_VOCAB, max_tokens: int = 2_000_000) -> VocabReport:
    """Copy the MTP sidecar to out_path with a draft vocabulary counted over text_files (default: the Python
    standard library's sources; every tenth file held out for the coverage figure, as train-mtp splits)."""
    gf = GGUFFile(model_path)
    cfg = config_from_metadata(gf.metadata, gf.path)
    tokenizer = Tokenizer.from_gguf_metadata(gf.metadata, source=gf.path)
    if not 1 <= size < cfg.n_vocab:
        raise ValueError(f"--size must be between 1 and {cfg.n_vocab - 1} (the model has {cfg.n_vocab} tokens), "
                         f"not {size}")
    files = stdlib_files() if not text_files else list(text_files)
    for f in files:
        if not os.path.isfile(f) or not os.access(f, os.R_OK):
            raise ValueError(f"{f}: not a readable file")
    train_files, held_files = split_files(files)
    ids = read_tokens(tokenizer, train_files, max_tokens)
    vocab = draft_vocab_of(tokenizer, ids, size)
    held = read_tokens(tokenizer, held_files, max(1, max_tokens // 10)) if held_files else np.zeros(0, np.int32)
    write_draft_vocab(sidecar, cfg, vocab, out_path)
    return VocabReport(len(vocab), len(ids), len(held), coverage(vocab, held))
