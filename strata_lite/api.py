"""The public Python API: `LLM` loads a GGUF model and computes logits or generates text.

One LLM owns one KV cache holding one sequence; every call starts from an empty cache. With `spec` other
than "off", generate() drafts and verifies as the engine does (spec/generate.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .batch import Batch
from .kernels.sample_rows import SampleRows
from .kv_cache import KVCache
from .runner import capture_step_graphs, load_model, reads_prompt_apart
from .sampling import InvalidRequest, SamplingParams, draw_uniform, needs_counts, sample_row
from .spec.controller import SpecController, parse_spec, split_spec
from .spec.generate import drafted_tokens
from .spec.mtp_drafter import MtpDrafter, block_for_spec, use_shipped
from .step_results import StepResults
from .text_stream import TextStream

PAGE_SIZE = 64


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: list[int]     # generated ids; an end-of-generation token, if hit, is the last one
    text: str                # without end-of-generation tokens and stop strings
    finish_reason: str       # "stop" (end-of-generation token or stop string) | "length"
    n_prompt_tokens: int


class LLM:
    def __init__(self, model: str | None = None, backend: str = "auto", n_ctx: int = 4096,
                 n_threads: int | None = None, n_batch: int = 512, vram_reserve_mib: int = 1024,
                 spec: str | int = "off", mtp: str | None = None, prompt_attention: str = "exact"):
        """spec: speculative decoding in generate()/stream(), as `serve --spec`: "off" (default: one token per
        forward), "auto", "suffix", "mtp", N or "mtp:N" (docs/speculative.md); mtp: a sidecar GGUF with the
        model's MTP block (else the model file's own, or the default model's shipped one:
        mtp_drafter.use_shipped). NoMtpBlock (a ValueError) for spec "mtp" or "mtp:N" without one.
        prompt_attention: as `serve --prompt-attention` ("exact" or, on the CUDA backend, "f16")."""
        self.spec = parse_spec(spec)
        loaded = load_model(model, backend, n_threads, vram_reserve_mib, prompt_attention)
        self.model_path, self.config, self.tokenizer = loaded.path, loaded.config, loaded.tokenizer
        self.chat_template, self.backend = loaded.chat_template, loaded.backend
        self.weights, self.model = loaded.weights, loaded.model
        self.n_ctx, self.n_batch = int(n_ctx), int(n_batch)
        if self.n_ctx < 1 or self.n_batch < 1:
            raise ValueError("n_ctx and n_batch must be positive")
        cfg = self.config
        mode = split_spec(self.spec)[0]
        mtp_w = block_for_spec(loaded.path, cfg, mode, mtp, use_shipped(mode, self.backend))
        scratch = 1 if self.backend.uses_scratch_page else 0      # for padded rows of captured steps
        self.kv = KVCache(self.backend, cfg.n_layers + (mtp_w is not None), cfg.n_kv_heads, cfg.head_dim,
                          n_pages=math.ceil(self.n_ctx / PAGE_SIZE) + scratch, page_size=PAGE_SIZE)
        scratch_page = self.kv.alloc(1)[0] if scratch else -1
        # the single sequence owns every other page, in order (drafting's scheduler allocates its own)
        self._pages = [p for p in range(self.kv.n_pages) if p != scratch_page]
        self.mtp = None if mtp_w is None else MtpDrafter(self.model, mtp_w, self.kv, cfg.n_layers)
        rows = 1 + SpecController(self.spec).max_draft        # logit rows of a verifying forward
        self.model.reserve(max(self.n_batch, rows), self.n_ctx, rows)
        # decode (and verify) steps replayed as captured graphs where the backend captures them
        self.graphs = capture_step_graphs(self.backend, self.model, self.kv, self.mtp, self.n_ctx, scratch_page)

    # text <-> ids
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids, special: bool = False) -> str:
        return self.tokenizer.decode(ids, special=special)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise InvalidRequest(f"{self.model_path} has no 'tokenizer.chat_template'", param="messages")
        return self.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    # compute
    def logits(self, ids) -> np.ndarray:
        """float32 (len(ids), n_vocab): the next-token logits after every position, from an empty cache."""
        ids = self._check_ids(ids)
        return self.eval(ids, 0, np.arange(len(ids)))

    def eval(self, ids, start_pos: int, logit_rows) -> np.ndarray:
        """Run ids[i] at position start_pos + i (chunks of n_batch); the KV before start_pos is reused.
        Returns float32 host logits for the given rows of ids (indices into ids, ascending)."""
        ids, logit_rows = np.asarray(ids, dtype=np.int32), np.asarray(logit_rows, dtype=np.int64)
        out = np.empty((len(logit_rows), self.config.n_vocab), dtype=np.float32)
        for lo in range(0, len(ids), self.n_batch):
            hi = min(lo + self.n_batch, len(ids))
            sel = (logit_rows >= lo) & (logit_rows < hi)
            batch = Batch.single(ids[lo:hi], start_pos + lo, self._pages, logit_rows[sel] - lo)
            out[sel] = self.backend.to_host(self.forward(batch))
        return out

    def forward(self, batch: Batch, observer=None):
        """Device logits of one validated batch over this LLM's KV cache (observer: Transformer.forward). A
        decode step replays a captured graph where there is one (the same bits; a view valid until the next
        forward)."""
        batch.validate(self.kv.n_pages, self.kv.page_size, self.config.n_vocab)
        if (observer is None and self.mtp is None and self.graphs is not None and self.graphs.accepts(batch)
                and not reads_prompt_apart(self.backend, batch)):
            return self.graphs.run(batch)[0]
        return self.model.forward(batch, self.kv, observer=observer)

    def forward_with_hidden(self, batch: Batch):
        """forward(), handing the hidden states to the MTP drafter when there is one (spec/generate.py)."""
        batch.validate(self.kv.n_pages, self.kv.page_size, self.config.n_vocab)
        if self.mtp is None:
            return self.forward(batch)
        if self.graphs is not None and self.graphs.accepts(batch) and not reads_prompt_apart(self.backend, batch):
            logits, res, *state = self.graphs.run(batch)
            self.mtp.keep_hidden(*state, results=StepResults(self.backend, logits, res, self.graphs))
            return logits
        return self.mtp.target_forward(batch)

    def _last_logits(self, ids, start_pos: int):
        """Device logits (1, n_vocab) after the last of ids, run at start_pos.. in chunks of n_batch."""
        for lo in range(0, len(ids), self.n_batch):
            hi = min(lo + self.n_batch, len(ids))
            logits = self.forward(Batch.single(ids[lo:hi], start_pos + lo, self._pages,
                                               [hi - lo - 1] if hi == len(ids) else []))
        return logits

    def generate(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int | None = None, stop=None) -> GenerationOutput:
        stream = self.stream(prompt, max_tokens, temperature, top_k, top_p, min_p, seed, stop)
        for _ in stream:
            pass
        return stream.output

    def stream(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0, seed: int | None = None, stop=None) -> "Generation":
        """An iterator over text pieces as they are produced; `.output` holds the result at the end."""
        ids = self._check_ids(self.tokenize(prompt, add_special=True, parse_special=True)
                              if isinstance(prompt, str) else prompt)
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be >= 1", param="max_tokens")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        params = SamplingParams(temperature, top_k, top_p, min_p, seed, stop=stops)
        return Generation(self, ids, max_tokens, params)

    def _check_ids(self, ids) -> list[int]:
        ids = [int(t) for t in ids]
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(ids) > self.n_ctx:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens, more than n_ctx = {self.n_ctx}", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.config.n_vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{self.config.n_vocab - 1})",
                                 param="prompt")
        return ids


class Generation:
    """Iterates over text pieces; one token per step, each decoded over the cached KV."""

    def __init__(self, llm: LLM, prompt_ids: list[int], max_tokens: int, params: SamplingParams):
        self.llm, self.prompt_ids, self.params = llm, prompt_ids, params
        self.max_tokens = min(max_tokens, llm.n_ctx - len(prompt_ids))
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str]:
        llm, tok = self.llm, self.llm.tokenizer
        text = TextStream(tok, self.params.stop)
        generated, finish = [], "length"
        if llm.spec == "off" or self.max_tokens < 1:
            tokens = self._tokens()
        else:
            tokens = drafted_tokens(llm, self.prompt_ids, self.max_tokens, self.params)
        try:
            for token in tokens:
                generated.append(token)
                if token in tok.eog_ids:
                    finish = "stop"
                    break
                piece = text.push(token)
                if piece:
                    yield piece
                if text.stopped:
                    finish = "stop"
                    break
        finally:
            tokens.close()
        tail = text.finish()
        if tail:
            yield tail
        self.output = GenerationOutput(generated, text.text, finish, len(self.prompt_ids))

    def _tokens(self) -> Iterator[int]:
        """Generated tokens, one forward each (the next one only computed when asked for)."""
        llm, be = self.llm, self.llm.backend
        rng = np.random.default_rng(self.params.seed)
        counts = be.token_counts(1, llm.config.n_vocab) if needs_counts(self.params) else None
        logits = llm._last_logits(self.prompt_ids, 0)
        for step in range(max(self.max_tokens, 0)):
            rows = SampleRows.from_rows([sample_row(self.params, draw_uniform(self.params, rng), count_row=0)])
            token = int(be.sample(logits, rows, counts).ids[0])
            if counts is not None:
                be.add_counts(counts, rows.count_rows, np.array([token], np.int32))
            yield token
            if step + 1 < self.max_tokens:
                logits = llm._last_logits([token], len(self.prompt_ids) + step)
