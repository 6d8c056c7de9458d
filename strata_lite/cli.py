"""`strata-lite` command line: generate, perplexity."""
from __future__ import annotations

import argparse
import sys
import time

from .loader.chat_template import ChatTemplateError
from .loader.errors import GGUFError
from .loader.known_models import KNOWN_MODELS, ModelNotInstalled
from .kernels import BackendUnavailable
from .sampling import InvalidRequest

USER_ERRORS = (GGUFError, ModelNotInstalled, InvalidRequest, ChatTemplateError, BackendUnavailable, OSError, ValueError)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help=f"GGUF file or known model ({', '.join(KNOWN_MODELS)}); default: the 0.5B model")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")


def _load(args, n_ctx: int):
    from .api import LLM
    t0 = time.perf_counter()
    llm = LLM(args.model, backend=args.backend, n_ctx=n_ctx, n_threads=args.threads)
    print(f"loaded {llm.model_path} ({llm.config.arch}, {llm.weights.nbytes / 2**20:,.0f} MiB of weights) "
          f"on {llm.backend.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return llm


def cmd_generate(args) -> int:
    llm = _load(args, args.ctx_size)
    prompt = args.prompt
    if args.chat:
        prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
    gen = llm.stream(prompt, max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                     min_p=args.min_p, seed=args.seed)
    t0 = time.perf_counter()
    for piece in gen:
        sys.stdout.write(piece)
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    out = gen.output
    print(f"\n[{len(out.token_ids)} tokens in {dt:.2f} s, {len(out.token_ids) / dt:.1f} tok/s incl. prompt of "
          f"{out.n_prompt_tokens}; finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_perplexity(args) -> int:
    from .perplexity import perplexity
    try:
        text = open(args.file, encoding="utf-8").read()
    except UnicodeDecodeError:
        raise ValueError(f"{args.file}: not UTF-8 text") from None
    llm = _load(args, args.ctx)
    t0 = time.perf_counter()
    r = perplexity(llm, text, ctx=args.ctx)
    print(f"chunks {r.n_chunks}, scored tokens {r.n_scored}, mean NLL {r.mean_nll:.6f}, "
          f"time {time.perf_counter() - t0:.1f} s")
    print(f"PPL = {r.ppl:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata-lite", description="LLM inference for quantized GGUF models")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streamed as it is produced")
    _model_args(g)
    g.add_argument("--prompt", "-p", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--n-predict", "-n", type=int, default=256)
    g.add_argument("--temp", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ctx-size", "-c", type=int, default=4096)
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("perplexity", help="perplexity of a text file (llama-perplexity's method)")
    _model_args(p)
    p.add_argument("file")
    p.add_argument("--ctx", type=int, default=512, help="chunk size in tokens")
    p.set_defaults(func=cmd_perplexity)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"strata-lite: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
