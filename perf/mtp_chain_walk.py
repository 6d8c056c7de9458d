"""How many chained MTP drafts a head can have accepted, from its training forward alone (teacher-forced), beside
what the engine accepts with it.

For a model and an MTP sidecar (default: the model's own block, or the one shipped for the default model), the
first --code held-out coding prompts of train-mtp (perf/eval_mtp.py) are answered greedily (LLM.generate, the
CPU backend); over each prompt and its answer the block's passes run as training runs them
(mtp_train_model.trunk_fwd / chain_fwd, float32, on the model's own last hidden states: pass D's row i drafts
the token at i + D + 1 from the true tokens before it), each pass's argmax through the head (cut to the sidecar's
draft vocabulary) is compared with the model's greedy token, and a walk over the answer accepts at each step
the leading depths that are right, at most K, then moves past them and the model's own token: the accepted
drafts a step that greedy decoding with `--spec mtp:K` would see if the engine's chain were the training
forward. Printed: each depth's agreement along the answers, the share of steps that accept at least d drafts
and, per K, the walk's mean accepted a step; with --engine also the engine's own (`--spec mtp:K`, one slot,
the same prompts and tokens: eval_mtp.run_mode), so the two can be compared (docs/mtp_training.md, "Where
chained drafts stop").

usage: python perf/mtp_chain_walk.py [--model M] [--mtp SIDECAR] [--code 6] [--max-tokens 128] [--ks 1,2,3]
           [--engine] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import numpy as np

from strata_lite.api import LLM
from strata_lite.mtp_train_data import collect
from strata_lite.mtp_train_math import rmsnorm_fwd
from strata_lite.mtp_train_model import FrozenHead, chain_fwd, params_from_mtp, trunk_fwd, trunk_kv
from strata_lite.spec.mtp_drafter import mtp_weights

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_mtp import held_out_code, run_mode, summary  # noqa: E402  (perf/ is not a package)


def walk(hits, start: int, end: int, k: int) -> list[int]:
    """hits[d][r] (bool arrays, d = 0..depth-1): depth d + 1's draft from row r (position r + d, drafting the
    token at r + d + 2) is the model's token. The text holds tokens 0..end; decoding from `start` (the first
    generated token, the step's pending token: its drafts come from row start - 1) -> the accepted drafts of each
    step: the leading right depths at row m - 1, at most k, while m + k <= end (the step's tokens exist)."""
    out, m = [], start
    while m + k <= end:
        a = 0
        while a < k and m - 1 < len(hits[a]) and hits[a][m - 1]:
            a += 1
        out.append(a)
        m += a + 1
    return out


class ChainHead:
    """An MTP block's training forward (float32) and its head cut to the draft vocabulary."""

    def __init__(self, llm, mtp):
        self.cfg, self.p = llm.config, params_from_mtp(mtp)
        self.frozen = FrozenHead.from_model(llm.weights, mtp=mtp)
        self.vocab = mtp.draft_vocab
        self.head = self.frozen.head if self.vocab is None else self.frozen.head[self.vocab]

    def picks(self, x) -> np.ndarray:
        xn, _ = rmsnorm_fwd(x.reshape(-1, x.shape[-1]), self.frozen.head_norm, self.cfg.rms_eps)
        j = (xn @ self.head.T).argmax(-1)
        return j if self.vocab is None else self.vocab[j]

    def hits(self, hidden, next_ids, greedy, depth: int) -> list[np.ndarray]:
        """hidden (T, n_embd): the model's last hidden states at positions 0..T-1; next_ids (T,) the text's
        tokens 1..T; greedy (T,): the model's greedy token at positions 2..T + 1 -> per depth d + 1 the rows r
        whose draft (of the token at r + d + 2) equals greedy[r + d] (mtp_train_data.collect's arrays)."""
        h, nxt = hidden[None].astype(np.float32), np.asarray(next_ids, np.int64)[None]
        x, cache = trunk_fwd(self.cfg, self.p, self.frozen, h, nxt)
        kvs, out = [trunk_kv(cache)], []
        for d in range(depth):
            if d:
                x, cache = chain_fwd(self.cfg, self.p, self.frozen, x, kvs, nxt)
                kvs.append(trunk_kv(cache))
            pick = self.picks(x)
            out.append(pick == greedy[d:d + len(pick)])
        return out


def answer_hits(llm, head: ChainHead, prompt: list[int], max_tokens: int, depth: int):
    """-> (generated tokens, per-depth hits over prompt + answer, the index of the first generated token)."""
    gen = list(llm.generate(prompt, max_tokens=max_tokens).token_ids)
    full = np.asarray(list(prompt) + gen, np.int32)
    data = collect(llm, full, len(full), 1, progress=False)       # the model's pass, as train-mtp runs it
    return gen, head.hits(data.hidden[0], data.next_ids[0], data.tgt_ids[0, :, 0], depth), len(prompt)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path or known model key (default: the default model)")
    ap.add_argument("--mtp", default=None, help="sidecar GGUF (default: the model's own block or the shipped one)")
    ap.add_argument("--code", type=int, default=6, help="held-out code prompts (default 6)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3", help="draft widths K to walk (default 1,2,3)")
    ap.add_argument("--engine", action="store_true", help="also decode with --spec mtp:K for each K (one slot)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if not ks or min(ks) < 1:
        ap.error("--ks: widths >= 1")
    llm = LLM(args.model, backend="cpu", n_ctx=2048, n_threads=args.threads)
    mtp = mtp_weights(llm.model_path, llm.config, args.mtp, True)
    if mtp is None:
        ap.error(f"{llm.model_path} has no MTP block and none is shipped for it: give --mtp")
    head, depth = ChainHead(llm, mtp), max(ks)
    texts = held_out_code(args.code)
    answers, per_depth, walks = [], [[] for _ in range(depth)], {k: [] for k in ks}
    for text in texts:
        prompt = llm.tokenize(llm.apply_chat_template([{"role": "user", "content": text}]),
                              add_special=True, parse_special=True)
        gen, hits, start = answer_hits(llm, head, prompt, args.max_tokens, depth)
        answers.append(gen)
        for d in range(depth):
            per_depth[d].append(hits[d][start - 1:])
        for k in ks:
            walks[k] += walk(hits, start, start + len(gen) - 1, k)
    res = dict(agreement=[float(np.concatenate(h).mean()) for h in per_depth],
               walk={k: float(np.mean(w)) if w else None for k, w in walks.items()},
               reach={k: [float(np.mean([a >= d for a in w])) for d in range(1, k + 1)] for k, w in walks.items() if w})
    print(f"teacher-forced chains: {llm.model_path}, MTP {args.mtp or 'own/shipped'}; {len(texts)} held-out code "
          f"prompts, {sum(len(a) for a in answers)} greedy tokens")
    print("agreement along the answers by depth: "
          + ", ".join(f"{d + 1}: {a:.3f}" for d, a in enumerate(res["agreement"])))
    engine = {}
    if args.engine:
        eargs = SimpleNamespace(model=args.model, backend="cpu", n_ctx=2048, threads=args.threads,
                                max_tokens=args.max_tokens, mtp=args.mtp)
        for k in ks:
            runs = run_mode(eargs, f"mtp:{k}", {"code": texts})["code"]
            if [r["tokens"] for r in runs] != answers:
                raise SystemExit(f"FAIL: --spec mtp:{k} decoded other tokens than LLM.generate")
            engine[k] = summary(runs)["acc_per_step"]
        res["engine"] = engine
    print(f"{'K':>2} {'walk acc/step':>13} {'engine acc/step':>15}  steps accepting >= 1, 2, ... drafts (walk)")
    for k in ks:
        e = engine.get(k)
        print(f"{k:>2} {res['walk'][k]:>13.3f} {'-' if e is None else format(e, '.3f'):>15}  "
              + " ".join(f"{r:.3f}" for r in res["reach"].get(k, [])))
    return res


if __name__ == "__main__":
    main()
