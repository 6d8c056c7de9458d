"""Model loading (shared by `LLM` and the engine), the engine's ModelRunner (one forward over the paged KV
cache, the KVCopier that moves pages between the device cache and the host pool) and RequestState (what
the engine thread keeps per request to turn logit rows into tokens and text)."""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from .batch import Batch
from .config import PROMPT_ATTENTION
from .host_pool import ArrayKVCopier, HostPool
from .kv_disk import DiskKV
from .kernels import get_backend
from .kernels.sample_rows import Sampled, SampleRows
from .kv_cache import KVCache
from .loader.chat_template import ChatTemplate
from .loader.errors import GGUFError
from .loader.gguf_file import GGUFFile
from .loader.known_models import resolve_model
from .loader.model_config import config_from_metadata
from .loader.tokenizer import Tokenizer
from .loader.weights import load_weights
from .models import MODELS
from .sampling import draw_uniform, sample_row
from .spec.mtp_drafter import MtpDrafter
from .step_results import StepResults
from .text_stream import TextStream

WARM_UP_KEYS = 2048       # keys the far decode of the warm-up attends (long attention is split on the CPU)
WARM_UP_PROMPT = 128      # tokens of the warm-up's prompt chunk at most: every kernel switch by token count
                          # lies below (the GPU attention's looped mode from 65 tokens)
WARM_UP_LOGPROBS = 5      # top logprobs asked in the warm-up's sampling


@dataclass(frozen=True)
class LoadedModel:
    path: str
    config: Any              # loader ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    backend: Any
    weights: Any
    model: Any               # has forward(batch, kv) -> logits on the backend


def load_model(model: str | None = None, backend: str = "auto", n_threads: int | None = None,
               vram_reserve_mib: int = 1024, prompt_attention: str = "exact") -> LoadedModel:
    """Resolve (a path, a known model key, None = the default model), read and map a GGUF model.
    vram_reserve_mib: GPU memory kept free when planning the CUDA backend's allocations. prompt_attention:
    "exact" or "f16" (the CUDA backend's f16 prompt attention, docs/cuda.md; ValueError on another backend or
    for a head dim it does not read)."""
    if prompt_attention not in PROMPT_ATTENTION:
        raise ValueError(f"prompt_attention must be one of {PROMPT_ATTENTION}, got {prompt_attention!r}")
    path = resolve_model(model)
    gguf = GGUFFile(path)
    meta = gguf.metadata
    config = config_from_metadata(meta, path)
    if config.arch not in MODELS:
        raise GGUFError(path, f"architecture {config.arch!r} has no forward pass")
    tokenizer = Tokenizer.from_gguf_metadata(meta, source=path)
    be = get_backend(backend, n_threads, vram_reserve_mib=vram_reserve_mib)
    if prompt_attention != "exact":
        if not hasattr(be, "prompt_attention"):
            raise ValueError(f"prompt_attention={prompt_attention!r} needs the CUDA backend (this one is {be.name})")
        if config.head_dim not in be.prompt_head_dims:
            raise ValueError(f"prompt_attention={prompt_attention!r} reads head_dim "
                             f"{' or '.join(map(str, be.prompt_head_dims))}; {path} has {config.head_dim}")
        be.prompt_attention = prompt_attention
    weights = load_weights(gguf, config)
    return LoadedModel(path, config, tokenizer, chat_template_of(meta, tokenizer), be, weights,
                       MODELS[config.arch](be, config, weights))


def reads_prompt_apart(backend, batch: Batch) -> bool:
    """The backend reads prompt rows another way (`--prompt-attention f16`) and the batch has some: the captured
    steps run every row through the decode kernels, so such a step (a short prompt read beside decode tokens, all
    of them logit rows) runs eagerly."""
    return getattr(backend, "prompt_attention", "exact") != "exact" and bool(batch.prompt_runs)


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


def step_forward(backend, model, kv):
    """The decode / verify forward a step graph captures without an MTP drafter: batch -> (logits, step
    results: every row's greedy id, step_results.py)."""
    def forward(batch):
        logits = model.forward(batch, kv)
        return logits, backend.step_results(logits)
    return forward


def capture_step_graphs(backend, model, kv, mtp, n_ctx: int, scratch_page: int, max_seqs: int = 1,
                        max_tokens: int = 16):
    """The backend's captured decode / verify steps (kernels/cuda/graphs.py) for model's forward over kv at
    positions < n_ctx: each returns (logits, step results (step_results.py: every row's greedy id), ...);
    with an MTP drafter (mtp) its step_forward (also the block's KV rows and first draft tokens, then the
    hidden states and block outputs), and the drafter's own block forwards (MtpDrafter.capture); None where
    the backend does not capture. Padded rows of a graph read and write only scratch_page, a page no
    sequence ever gets. max_seqs / max_tokens: the sequences and tokens a step may have (the step graphs'
    token counts follow them; the drafter's own graphs keep the backend's default)."""
    limits = dict(max_pages=math.ceil(n_ctx / kv.page_size), max_keys=n_ctx, scratch_page=scratch_page)
    forward = step_forward(backend, model, kv) if mtp is None else mtp.step_forward()
    graphs = backend.decode_graphs(forward, **limits, max_seqs=max_seqs, max_tokens=max_tokens)
    if mtp is not None:
        mtp.capture(lambda forward, **kw: backend.decode_graphs(forward, **limits, **kw))
    return graphs


class ModelRunner:
    """Owns the device state of the engine: the KV cache (kv_tokens rounded up to pages), the host pool
    (host_bytes) and the token-count table of the presence / frequency penalties (count_rows rows, handed
    out by take_count_row). The backend's workspaces are sized for forwards of up to max_step_tokens tokens
    at positions < n_ctx, sampling up to max_seqs rows."""

    def __init__(self, loaded: LoadedModel, kv_tokens: int, page_size: int, host_bytes: int, n_ctx: int,
                 max_step_tokens: int, max_seqs: int, count_rows: int = 0, disk_dir: str | None = None,
                 disk_bytes: int = 0, mtp_weights=None):
        """mtp_weights (loader.mtp.MtpWeights): draft with the model's MTP block (spec/mtp_drafter.py): the
        KV cache gets one more layer (index n_layers) for it and every forward hands its hidden states to
        the drafter (captured graphs return them beside the logits)."""
        cfg, self.loaded = loaded.config, loaded
        self.backend, self.model = loaded.backend, loaded.model
        self.n_ctx, self.max_step_tokens, self.max_seqs = n_ctx, max_step_tokens, max_seqs
        self.n_vocab = cfg.n_vocab
        scratch = 1 if self.backend.uses_scratch_page else 0
        self.kv = KVCache(self.backend, cfg.n_layers + (mtp_weights is not None), cfg.n_kv_heads, cfg.head_dim,
                          n_pages=math.ceil(kv_tokens / page_size) + scratch, page_size=page_size)
        self.mtp = None if mtp_weights is None else MtpDrafter(self.model, mtp_weights, self.kv, cfg.n_layers)
        self.host = HostPool.like(self.kv, host_bytes)
        dev_arrays = (self.kv.k_pages, self.kv.k_scales, self.kv.v_pages, self.kv.v_scales)
        copier = self.backend.kv_copier(dev_arrays, self.host.arrays())
        self.copier = copier or TimedCopier(ArrayKVCopier(self.kv, self.host, self.backend))
        self.disk = None
        if disk_dir is not None:         # the disk tier moves pages through a one-page staging pool
            staging = HostPool.like(self.kv, HostPool.like(self.kv, 0).page_bytes)
            stage_copier = (self.backend.kv_copier(dev_arrays, staging.arrays())
                            or ArrayKVCopier(self.kv, staging, self.backend))
            self.disk = DiskKV(disk_dir, disk_bytes, loaded.path, staging, stage_copier)
        self.model.reserve(max_step_tokens, n_ctx, max_seqs)
        # decode and verify steps replayed as captured graphs where the backend captures them; padded rows
        # of a graph's token-count bucket read and write only the scratch page, which no sequence ever gets
        self.scratch_page = self.kv.alloc(1)[0] if scratch else -1
        self.graphs = capture_step_graphs(self.backend, self.model, self.kv, self.mtp, n_ctx, self.scratch_page,
                                          max_seqs, max_step_tokens)
        self.step_results = None      # StepResults of the last forward when a captured step ran it
        self.counts = self.backend.token_counts(count_rows, cfg.n_vocab) if count_rows else None
        self._free_count_rows = list(range(count_rows - 1, -1, -1))

    def forward(self, batch: Batch):
        """Device float32 logits (len(batch.logit_rows), n_vocab); ValueError for a bad batch."""
        batch.validate(self.kv.n_pages, self.kv.page_size, self.n_vocab)
        self.step_results = None
        if self.graphs is not None and self.graphs.accepts(batch) and not reads_prompt_apart(self.backend, batch):
            logits, res, *state = self.graphs.run(batch)
            self.step_results = StepResults(self.backend, logits, res, self.graphs)
            if self.mtp is not None:
                self.mtp.keep_hidden(*state, results=self.step_results)
            return logits
        if self.mtp is not None:            # the drafter fills its KV layer from every row's hidden state
            return self.mtp.target_forward(batch)
        return self.model.forward(batch, self.kv)

    def sample(self, logits, rows: SampleRows) -> Sampled:
        """Host tokens (and logprobs) for device logits, one SampleRows row per logit row. Plain greedy rows of
        a captured step take the ids the step computed (StepResults.sample: the same ids, no launch)."""
        if self.step_results is not None:
            sampled = self.step_results.sample(logits, rows)
            if sampled is not None:
                return sampled
        return self.backend.sample(logits, rows, self.counts)

    def add_counts(self, count_rows, ids) -> None:
        """Count the accepted tokens ids[i] in count row count_rows[i] (-1: none)."""
        count_rows = np.asarray(count_rows, np.int32)
        if len(count_rows) and count_rows.max() >= 0:
            self.backend.add_counts(self.counts, count_rows, np.asarray(ids, np.int32))

    def take_count_row(self) -> int:
        """A zeroed row of the count table; there is one for every request the engine may hold."""
        assert self._free_count_rows, "more requests with penalties than count rows"
        row = self._free_count_rows.pop()
        self.backend.reset_counts(self.counts, row)
        return row

    def free_count_row(self, row: int) -> None:
        self._free_count_rows.append(row)

    def warm_up_tokens(self, n_prompt: int) -> int:
        """The prompt chunk warm_up(n_prompt) computes: n_prompt (the engine's step_tokens) up to
        WARM_UP_PROMPT, within a step and the context."""
        return max(1, min(n_prompt, WARM_UP_PROMPT, self.max_step_tokens, self.n_ctx - 1))

    def warm_up(self, n_prompt: int) -> None:
        """Run every kernel a request can need once, so that Numba compiles them (or loads them from its
        cache) and NVRTC compiles the CUDA ones before the engine says ready, not in the first request:
        a prompt chunk of warm_up_tokens(n_prompt) tokens, then decodes of a sequence right after it and
        of one far into the context (WARM_UP_KEYS keys: long attention takes other kernels), in one step
        where max_seqs allows; rows sampled greedily with logprobs and with every option on (temperature,
        top-k/p, min-p, penalties). The pages written are freed after: a sequence only ever reads the
        positions it computed, so what they hold never matters."""
        P, n = self.kv.page_size, self.warm_up_tokens(n_prompt)
        far = min(self.n_ctx - 1, WARM_UP_KEYS)
        pages = self.kv.alloc(-(-(max(n, far) + 1) // P))
        count_row = self.take_count_row() if self.counts is not None else -1
        try:
            logits = self.forward(Batch.single(np.arange(n) % self.n_vocab, 0, pages[:n // P + 1], [n - 1]))
            token = int(self.sample(logits, SampleRows.from_rows([{"n_logprobs": WARM_UP_LOGPROBS}])).ids[0])
            if self.mtp is not None:
                self.mtp.warm_up(np.arange(1, n + 1) % self.n_vocab, pages[:n // P + 1])
            decodes = [n] + ([far] if far > n else [])           # positions; the far one reads zeroed pages
            steps = [decodes] if self.max_seqs >= len(decodes) else [[p] for p in decodes]
            for positions in steps:
                tables = np.zeros((len(positions), len(pages)), np.int32)
                for i, pos in enumerate(positions):
                    tables[i, :pos // P + 1] = pages[:pos // P + 1]
                k = len(positions)
                batch = Batch(np.full(k, token, np.int32), np.asarray(positions, np.int32),
                              np.arange(k, dtype=np.int32), tables, np.arange(k))
                rows = [_every_option(count_row), {}][:k]
                sampled = self.sample(self.forward(batch), SampleRows.from_rows(rows))
                self.add_counts([count_row, -1][:k], sampled.ids)
        finally:
            if count_row >= 0:
                self.free_count_row(count_row)
            self.kv.free(pages)

    @property
    def kv_usage(self) -> float:
        usable = self.kv.n_pages - (self.scratch_page >= 0)
        return 1.0 - self.kv.n_free / max(1, usable)

    @property
    def host_bytes_used(self) -> int:
        return (self.host.n_pages - self.host.n_free) * self.host.page_bytes


def _every_option(count_row: int) -> dict:
    """A SampleRows row taking every sampling path (the penalties only with a count row)."""
    penalty = 0.5 if count_row >= 0 else 0.0
    return dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, presence=penalty, frequency=penalty,
                uniform=0.5, count_rows=count_row, n_logprobs=WARM_UP_LOGPROBS)


class RequestState:
    """Engine-thread state of one request: its random generator and count row (sampling), logprobs and
    text stream (stop strings)."""

    def __init__(self, handle, seq, tokenizer, count_row: int = -1):
        self.handle, self.seq, self.request, self.tokenizer = handle, seq, handle.request, tokenizer
        self.rng = np.random.default_rng(self.request.params.seed)
        self.count_row = count_row              # row of the runner's token-count table, -1 = no penalties
        self.stream = TextStream(tokenizer, self.request.params.stop)
        self.text = ""                          # everything emitted so far
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.n_emitted = 0                      # tokens handed to the client
        self.row_logprobs: dict[int, tuple] = {}   # this step's logit row -> (logprob, top) of its token
        self._uniforms: deque[float] = deque()  # drawn for the next generated tokens, in order

    def sample_row(self, i: int = 0) -> dict:
        """The SampleRows row of the i-th token this request may generate in the step (i > 0: rows that
        verify drafted tokens). Token k of the output always gets the k-th uniform of the request's
        generator, however many rows a step verifies (unused draws wait for the next step)."""
        params, n = self.request.params, self.request.logprobs
        while len(self._uniforms) <= i:
            self._uniforms.append(draw_uniform(params, self.rng))
        return sample_row(params, self._uniforms[i], self.count_row, -1 if n is None else n)

    def took(self, sampled: Sampled, i: int) -> int:
        """The token of row i of the step's Sampled; with request.logprobs = n, also keeps its log-softmax
        (of the raw logits) and the n best (id, token text, logprob), best first, in row_logprobs[i]."""
        token = int(sampled.ids[i])
        n = self.request.logprobs
        if n is not None:
            top = [(int(t), self.tokenizer.token_text(int(t)), float(v))     # -1: fewer tokens than n
                   for t, v in zip(sampled.top_ids[i, :n], sampled.top_logprobs[i, :n]) if t >= 0]
            self.row_logprobs[i] = (float(sampled.logprob[i]), top)
        return token

    def used_uniform(self) -> None:
        """One generated token was kept (complete_step): its uniform is used up, so the next step's first row
        takes the next draw (before the token's event goes out: the engine hands a step's tokens to the
        client after it has launched the next step)."""
        if self._uniforms:
            self._uniforms.popleft()

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
