"""Decode and verify steps captured as CUDA graphs, one per token-count bucket, replayed with one launch
from Python.

A step that fits has logits for every token and up to the largest bucket's tokens: a decode step (one
token per sequence) or a speculative verify step (a sequence's pending token and its drafts, beside other
sequences' tokens). Its inputs are copied into static device buffers of the bucket (the smallest bucket
>= the number of tokens): token ids, positions, and one page-table row per token (a sequence's row
repeated for each of its tokens: every token reads and writes the cache through its own row, and within a
step a sequence's tokens are stored before attention reads them, as in an eager forward); rows past the
real tokens are padding that reads and writes only the scratch page, whose contents nobody reads. Attention is captured for a number of keys (its grid: one CTA per 128-key split of that
many), and CTAs past a token's own keys exit at once, so one graph serves every position below it; each
token-count bucket is captured for a few key counts (key_buckets: 4096, x4, ..., the context length) and a
step replays the smallest that holds its longest sequence, so short contexts do not launch the long
context's empty CTAs. A token's result does not depend on the grid (attention.cu), so every choice gives
the same bits. Each graph allocates its intermediates from a private CuPy memory pool during capture; the pool
lives as long as the graph and nothing else allocates from it, so replays write to the addresses that were
captured. The forward is run once eagerly in that pool before capture, so the capture itself allocates
nothing new (kernels compiled, pool blocks cached). On sm_90 and newer the capture launches every kernel
with programmatic dependent launch (pdl.py: a kernel is scheduled while the one before it finishes and
waits for it inside; the same bits), which hides most of each launch's latency in a replay; a driver that
refuses it is noted in `programmatic` and the graphs are captured with ordinary launches.
"""
from __future__ import annotations

import numpy as np

from .runtime import cupy, programmatic_launches, programmatic_supported


class _StaticBatch:
    """The Batch shape the model reads, over static device buffers (bucket size b). token_ids, positions and
    page_tables are views of one device int32 buffer, so a step's inputs cross in one host-to-device copy."""

    # Batch.short_run_rows: a captured step holds decode and verify tokens only, and its attention runs them
    # all split-parallel (at most the workspace's split_tokens), so nothing is computed apart
    short_run_rows = 0

    def __init__(self, cp, b: int, max_pages: int, max_keys: int, scratch_page: int, logits: bool = True,
                 row_inputs: tuple = ()):
        self._host = np.zeros(2 * b + b * max_pages, np.int32)       # ids | positions | page tables
        self._host_tables = self._host[2 * b:].reshape(b, max_pages)
        self._host_tables[:] = scratch_page
        self._dev = cp.asarray(self._host)
        self.token_ids = self._dev[:b]
        self.positions = self._dev[b:2 * b]
        self.page_tables = self._dev[2 * b:].reshape(b, max_pages)
        self.token_seq = cp.arange(b, dtype=cp.int32)               # token i reads page-table row i
        self.logit_rows = cp.arange(b if logits else 0, dtype=cp.int32)
        self.inputs = tuple(cp.zeros((b, w), cp.float32) for w in row_inputs)   # per-token float rows
        self.max_pos = max_keys
        self.b = b
        self.scratch_page = scratch_page

    def pack(self, batch) -> np.ndarray:
        """The static buffer's contents for a host decode Batch of n <= b tokens (a host array that the next
        call overwrites): its ids, positions and each token's page-table row; rows past n point at the scratch
        page."""
        n, b = len(batch.token_ids), self.b
        h, ht = self._host, self._host_tables
        h[:2 * b] = 0
        h[:n] = batch.token_ids
        h[b:b + n] = batch.positions
        ht[:] = self.scratch_page
        rows = batch.page_tables[batch.token_seq]                   # (n, width) the pages of each token
        ht[:n, :rows.shape[1]] = rows
        return h

    def fill(self, cp, batch, inputs=()) -> None:
        """Copy a host decode Batch of n <= b tokens in (pack), and the device rows `inputs` (each (n, width))
        into the first n rows of self.inputs."""
        self._dev.set(self.pack(batch))                             # pageable source: done when it returns
        n = len(batch.token_ids)
        for dst, src in zip(self.inputs, inputs):
            dst[:n] = src                                           # device to device, queued before the replay


KEY_BUCKET_MIN = 4096      # the smallest key count a graph is captured for


BASE_BUCKETS = (1, 2, 4, 8, 16)
MAX_BUCKET = 64


def step_buckets(max_seqs: int, max_tokens: int) -> tuple:
    """Token-count buckets captured for an engine whose decode / verify steps have up to max_seqs rows (slots x (1 +
    drafts): the runner's max_seqs) and whose steps take at most max_tokens tokens (CudaBackend.decode_graphs):
    BASE_BUCKETS, then 32 and 64 where steps may have that many rows (without a graph, 32 sequences of the 0.5B
    shape decoded at 2,581-2,744 tok/s against 7,535-7,568 for 16 in one, perf/kernel_notes.md); none above
    max_tokens (the workspaces) or MAX_BUCKET (larger steps run eagerly, as prompt chunks do)."""
    out, b = list(BASE_BUCKETS), BASE_BUCKETS[-1]
    while b < min(int(max_seqs), MAX_BUCKET) and 2 * b <= int(max_tokens):
        b *= 2
        out.append(b)
    return tuple(out)


def key_buckets(max_keys: int) -> tuple:
    """Key counts graphs are captured for: KEY_BUCKET_MIN, 4x that, ... below max_keys, then max_keys."""
    out, k = [], KEY_BUCKET_MIN
    while k < max_keys:
        out.append(k)
        k *= 4
    return tuple(out) + (int(max_keys),)


class StepGraphs:
    """forward(batch, *inputs) -> logits (device, (n, n_vocab)), or a tuple of device arrays with one row per
    token (logits and the last hidden states, for an MTP drafter), is the model's forward over the engine's
    KV cache; run() returns the same shape of result.

    logits=False captures a forward that computes no logits (batches with no logit rows: an MTP drafter's
    KV-row fill). row_inputs: widths of per-token float32 device inputs the forward reads beside the batch
    (an MTP block's hidden states), passed to forward as static arrays of (bucket, width) and copied in by
    run(batch, *arrays)."""

    def __init__(self, forward, max_pages: int, max_keys: int, scratch_page: int, buckets=BASE_BUCKETS,
                 programmatic: bool | None = None, logits: bool = True, row_inputs: tuple = ()):
        self.cp = cp = cupy()
        # programmatic dependent launches in the captures: None = where the device supports them
        self.programmatic = (programmatic_supported(cp.cuda.Device().id) if programmatic is None
                             else bool(programmatic))
        self.programmatic_error = None
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self.key_buckets = key_buckets(int(max_keys))
        self.max_pages = int(max_pages)
        self.logits = bool(logits)
        self.replays = 0           # replays so far: a step's output views hold its values while this is unchanged
        self._graphs = {}
        stream = cp.cuda.get_current_stream()
        if stream.ptr == 0:
            raise RuntimeError("graph capture needs a non-default stream (CudaBackend sets one)")
        for b in self.buckets:
            for keys in self.key_buckets:
                static = _StaticBatch(cp, b, self.max_pages, keys, int(scratch_page), self.logits,
                                      tuple(row_inputs))
                pool = cp.cuda.MemoryPool()
                with cp.cuda.using_allocator(pool.malloc):
                    forward(static, *static.inputs)                 # warm-up: compile, fill the pool
                    stream.synchronize()
                    try:
                        graph, outputs = self._capture(stream, forward, static, self.programmatic)
                    except RuntimeError as e:                       # cuLaunchKernelEx refused
                        if not self.programmatic:
                            raise
                        self.programmatic, self.programmatic_error = False, str(e)
                        graph, outputs = self._capture(stream, forward, static, False)
                graph.upload(stream)
                self._graphs[b, keys] = (graph, static, outputs, pool)

    @staticmethod
    def _capture(stream, forward, static, programmatic: bool):
        stream.begin_capture()
        try:
            with programmatic_launches(programmatic):
                outputs = forward(static, *static.inputs)
        finally:
            graph = stream.end_capture()
        return graph, outputs

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def accepts(self, batch) -> bool:
        """A step that fits: logits for every token (none with logits=False), in bucket range (decode or
        verify, module docstring)."""
        n = len(batch.token_ids)
        if n == 0 or n > self.buckets[-1] or len(batch.logit_rows) != (n if self.logits else 0):
            return False
        if batch.page_tables.shape[1] > self.max_pages or batch.max_pos > self.key_buckets[-1]:
            return False
        return not self.logits or batch.logit_rows.tolist() == list(range(n))     # a few rows: no numpy call

    def bucket(self, batch) -> tuple:
        """(tokens, keys) of the graph that replays a Batch that `accepts`."""
        n = len(batch.token_ids)
        return (next(b for b in self.buckets if b >= n), next(k for k in self.key_buckets if k >= batch.max_pos))

    def run_chain(self, batches, hidden, vocab=None):
        """An autoregressive chain of replays with no host round trip between them (an MTP draft chain), for
        a graph set whose forward returns (logits, block output) and reads one row input (the hidden state).
        batches: host Batches that `accepts`, replay j's rows the first n_j of replay j - 1's (n_j not
        increasing); hidden: device (n_0, width) row input of replay 0. Replay j > 0 takes as its token ids
        the greedy argmax of replay j - 1's logits (through vocab, a device int32 column -> token id map,
        when given) and as its row input replay j - 1's block output; batches[j]'s own token ids are used
        for j = 0 only, its positions and page tables for every j. All replays use the graph of the largest
        (tokens, keys) bucket (the same bits as any other: module docstring); the inputs of every replay go
        to the device in one copy, and the argmaxes come back in one.
        -> host (columns (k, n_0) int64, probabilities (k, n_0) float64): row i of replay j is the argmax
        column of its logits and its softmax probability (sampling.argmax_prob_rows); entries past n_j are
        0."""
        from .sampling import argmax_prob_rows
        cp = self.cp
        n0 = len(batches[0].token_ids)
        key = (next(b for b in self.buckets if b >= n0),
               next(k for k in self.key_buckets if k >= max(bt.max_pos for bt in batches)))
        graph, static, (logits, out), _ = self._graphs[key]
        packed = cp.asarray(np.stack([static.pack(bt).copy() for bt in batches]))   # (k, static length)
        res = cp.zeros((len(batches), n0, 2), cp.float32)          # (column bits, probability) per replay, row
        res_ids = res.view(cp.int32)[..., 0]
        stream = cp.cuda.get_current_stream()
        row_input = static.inputs[0]
        self.replays += len(batches)
        for j, bt in enumerate(batches):
            n = len(bt.token_ids)
            static._dev[...] = packed[j]
            if j:
                ids = res_ids[j - 1, :n]
                static.token_ids[:n] = ids if vocab is None else vocab[ids]
                row_input[:n] = out[:n]                             # before this replay overwrites out
            else:
                row_input[:n] = hidden
            graph.launch(stream)
            argmax_prob_rows(logits[:n], res[j, :n])
        host = res.get()
        return host[..., 0].view(np.int32).astype(np.int64), host[..., 1].astype(np.float64)

    def run(self, batch, *inputs):
        """Replay the bucket's graph for a host Batch that `accepts` (inputs: one device (n, width) array per
        row_inputs width); -> logits (n, n_vocab) device view (or the forward's tuple, each array's first n
        rows). The views hold until the next replay of the bucket."""
        n = len(batch.token_ids)
        graph, static, outputs, _ = self._graphs[self.bucket(batch)]
        self.replays += 1
        static.fill(self.cp, batch, inputs)
        graph.launch(self.cp.cuda.get_current_stream())
        if isinstance(outputs, tuple):
            return tuple(o if o.shape[0] == n else o[:n] for o in outputs)
        return outputs if outputs.shape[0] == n else outputs[:n]
