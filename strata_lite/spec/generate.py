"""Speculative generation of one sequence for the Python API (`LLM(spec=...)`): a one-slot Scheduler over
the LLM's own KV cache, so drafting, verification, acceptance and the MTP block's KV layer are the engine's
(scheduler.py, controller.py, mtp_drafter.py), not a copy. Every call starts from an empty cache (the
scheduler's prefix trie is dropped at the end) and no host pool parks anything.

Token k of the output is sampled with the k-th uniform of the request's generator, whichever row samples
it, so greedy and seeded output equal `LLM(spec="off")`'s (docs/speculative.md)."""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..host_pool import ArrayKVCopier, HostPool
from ..kernels.sample_rows import SampleRows
from ..sampling import SamplingParams, draw_uniform, needs_counts, sample_row
from ..scheduler import Scheduler
from ..sequence import Request, SeqStatus
from .controller import SpecController


def drafted_tokens(llm, prompt_ids: list[int], max_tokens: int, params: SamplingParams):
    """Yields the generated tokens of prompt_ids (at most max_tokens >= 1, up to an end-of-generation token
    or the context), several per forward where drafts are accepted."""
    be, kv = llm.backend, llm.kv
    ctl = SpecController(llm.spec)
    if llm.mtp is not None:
        ctl.use_mtp(llm.mtp)
    host = HostPool.like(kv, 0)
    sched = Scheduler(kv, host, ArrayKVCopier(kv, host, be), n_slots=1, step_tokens=llm.n_batch,
                      eog_ids=llm.tokenizer.eog_ids, max_seq_len=llm.n_ctx, drafter=ctl,
                      kv_filler=None if llm.mtp is None else llm.mtp.fill)
    if llm.mtp is not None:
        llm.mtp.grow = sched.tiers.grow_free
    seq = sched.add(Request("generate", tuple(prompt_ids), params, max_tokens))
    counts = be.token_counts(1, llm.config.n_vocab) if needs_counts(params) else None
    if counts is None:                         # penalties count accepted tokens one by one: no drafts
        ctl.attach(seq)
    rng, uniforms = np.random.default_rng(params.seed), deque()
    try:
        while seq.status is not SeqStatus.FINISHED:
            t0 = time.perf_counter()
            plan = sched.plan_step()
            logits = llm.forward_with_hidden(plan.batch)
            m = len(plan.logit_seqs)
            while len(uniforms) < m:
                uniforms.append(draw_uniform(params, rng))
            rows = SampleRows.from_rows([sample_row(params, uniforms[i], 0) for i in range(m)])
            ids = [int(t) for t in be.sample(logits, rows, counts).ids[:m]]
            events = sched.complete_step(plan, ids)
            ctl.observe_step(plan.n_tokens_total, plan.n_read, time.perf_counter() - t0)
            for ev in events:
                uniforms.popleft()
                if counts is not None:
                    be.add_counts(counts, np.zeros(1, np.int32), np.array([ev.token], np.int32))
                yield ev.token
    finally:
        if seq.status is not SeqStatus.FINISHED:
            sched.finish(seq, "cancelled")
        ctl.finished(seq)
        sched.tiers.clear()
        if llm.mtp is not None:
            llm.mtp.grow = None
