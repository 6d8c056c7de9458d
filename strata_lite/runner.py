"""Model loading (shared by `LLM` and the engine), the engine's ModelRunner (one forward over the paged KV
cache, the KVCopier that moves pages between the device cache and the host pool) and RequestState (what
the engine thread keeps per request to turn logit rows into tokens and text)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .batch import Batch
from .host_pool import ArrayKVCopier, HostPool
from .kernels import get_backend
from .kv_cache import KVCache
from .loader.chat_template import ChatTemplate
from .loader.errors import GGUFError
from .loader.gguf_file import GGUFFile
from .loader.known_models import resolve_model
from .loader.model_config import config_from_metadata
from .loader.tokenizer import Tokenizer
from .loader.weights import load_weights
from .models import MODELS
from .sampling import Sampler
from .text_stream import TextStream


@dataclass(frozen=True)
class LoadedModel:
    path: str
    config: Any              # loader ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    backend: Any
    weights: Any
    model: Any               # has forward(batch, kv) -> logits on the backend


def load_model(model: str | None = None, backend: str = "auto", n_threads: int | None = None) -> LoadedModel:
    """Resolve (a path, a known model key, None = the default model), read and map a GGUF model."""
    path = resolve_model(model)
    gguf = GGUFFile(path)
    meta = gguf.metadata
    config = config_from_metadata(meta, path)
    if config.arch not in MODELS:
        raise GGUFError(path, f"architecture {config.arch!r} has no forward pass")
    tokenizer = Tokenizer.from_gguf_metadata(meta, source=path)
    be = get_backend(backend, n_threads)
    weights = load_weights(gguf, config)
    return LoadedModel(path, config, tokenizer, chat_template_of(meta, tokenizer), be, weights,
                       MODELS[config.arch](be, config, weights))


def chat_template_of(meta: dict, tokenizer) -> ChatTemplate | None:
    source = meta.get("tokenizer.chat_template")
    if not source:
        return None

    def token(key):
        tid = meta.get(key)
        return tokenizer.token_text(tid) if tid is not None and 0 <= tid < tokenizer.n_vocab else ""

    return ChatTemplate(source, bos_token=token("tokenizer.ggml.bos_token_id"),
                        eos_token=token("tokenizer.ggml.eos_token_id"))


class TimedCopier:
    """A KVCopier that times its host -> device copies (for the "restored ... in s" log line)."""

    def __init__(self, inner):
        self.inner = inner
        self.restore_s = 0.0

    def copy_pages_to_host(self, dev_pages, host_pages) -> None:
        self.inner.copy_pages_to_host(dev_pages, host_pages)

    def copy_pages_to_device(self, host_pages, dev_pages) -> None:
        t0 = time.perf_counter()
        self.inner.copy_pages_to_device(host_pages, dev_pages)
        self.restore_s += time.perf_counter() - t0

    def copy_page_prefix(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        self.inner.copy_page_prefix(src_page, dst_page, n_tokens)


class ModelRunner:
    """Owns the device KV cache (kv_tokens rounded up to pages) and the host pool (host_bytes)."""

    def __init__(self, loaded: LoadedModel, kv_tokens: int, page_size: int, host_bytes: int):
        cfg, self.loaded = loaded.config, loaded
        self.backend, self.model = loaded.backend, loaded.model
        self.n_vocab = cfg.n_vocab
        self.kv = KVCache(self.backend, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                          n_pages=math.ceil(kv_tokens / page_size), page_size=page_size)
        self.host = HostPool.like(self.kv, host_bytes)
        self.copier = TimedCopier(ArrayKVCopier(self.kv, self.host, self.backend))

    def forward(self, batch: Batch) -> np.ndarray:
        """float32 host logits, one row per batch.logit_rows entry."""
        if not len(batch.logit_rows):
            self.model.forward(batch, self.kv)
            return np.empty((0, self.n_vocab), np.float32)
        return np.asarray(self.backend.to_host(self.model.forward(batch, self.kv)), dtype=np.float32)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv.n_free / max(1, self.kv.n_pages)

    @property
    def host_bytes_used(self) -> int:
        return (self.host.n_pages - self.host.n_free) * self.host.page_bytes


class RequestState:
    """Engine-thread state of one request: its sampler, logprobs and text stream (stop strings)."""

    def __init__(self, handle, seq, tokenizer, n_vocab: int):
        self.handle, self.seq, self.request, self.tokenizer = handle, seq, handle.request, tokenizer
        self.sampler = Sampler(self.request.params, n_vocab)
        self.stream = TextStream(tokenizer, self.request.params.stop)
        self.text = ""                          # everything emitted so far
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.logprobs: tuple = (None, None)     # (logprob, top) of the token sampled last

    def sample(self, row: np.ndarray) -> int:
        """The next token from one row of raw logits; with request.logprobs = n, also its log-softmax
        (float64, of the raw logits) and the n best (id, token text, logprob), best first."""
        token = self.sampler(row)
        self.sampler.accept(token)
        n = self.request.logprobs
        if n is None:
            self.logprobs = (None, None)
            return token
        lp = log_softmax(row)
        top = []
        if n:
            ids = np.argpartition(-lp, n - 1)[:n] if n < len(lp) else np.arange(len(lp))
            ids = sorted(ids.tolist(), key=lambda i: (-lp[i], i))
            top = [(i, self.tokenizer.token_text(i), float(lp[i])) for i in ids]
        self.logprobs = (float(lp[token]), top)
        return token

    def push(self, token: int, finishing: bool) -> str:
        """Newly safe text after token (end-of-generation tokens add none); the held-back tail too when
        finishing or when a stop string was found (`stopped`)."""
        piece = "" if token in self.tokenizer.eog_ids else self.stream.push(token)
        if finishing or self.stream.stopped:
            piece += self.stream.finish()
        self.text += piece
        return piece

    @property
    def stopped(self) -> bool:
        return self.stream.stopped

    @property
    def decode_tok_s(self) -> float:
        n = self.seq.n_generated - 1
        return n / (self.t_last - self.t_first) if n > 0 and self.t_last > self.t_first else 0.0


def log_softmax(row) -> np.ndarray:
    z = np.asarray(row, np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())
