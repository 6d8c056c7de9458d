"""`strata-lite` command line: generate, perplexity, quantize, imatrix, kld, synth, train-mtp, mtp-vocab, info (serve,
fleet)."""
from __future__ import annotations

import argparse
import sys
import time

from .loader.chat_template import ChatTemplateError
from .loader.errors import GGUFError
from .loader.known_models import KNOWN_MODELS, ModelNotInstalled
from .config import PROMPT_ATTENTION
from .kernels import BackendUnavailable
from .sampling import InvalidRequest

USER_ERRORS = (GGUFError, ModelNotInstalled, InvalidRequest, ChatTemplateError, BackendUnavailable, OSError, ValueError)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help=f"GGUF file or known model ({', '.join(KNOWN_MODELS)}); default: the 0.5B model")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--vram-reserve-mib", type=int, default=1024,
                   help="CUDA: GPU memory (MiB) left free when the model and KV cache are planned (default 1024)")
    p.add_argument("--prompt-attention", choices=PROMPT_ATTENTION, default="exact",
                   help="CUDA: how prompts read their keys: exact (default) or f16 (faster at depth; head_dim 64 or "
                        "128; docs/cuda.md)")


def _load(args, n_ctx: int):
    from .api import LLM
    t0 = time.perf_counter()
    llm = LLM(args.model, backend=args.backend, n_ctx=n_ctx, n_threads=args.threads,
              vram_reserve_mib=args.vram_reserve_mib, prompt_attention=args.prompt_attention)
    print(f"loaded {llm.model_path} ({llm.config.arch}, {llm.weights.nbytes / 2**20:,.0f} MiB of weights) "
          f"on {llm.backend.describe()} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
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


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def cmd_quantize(args) -> int:
    from .loader.quantize_file import quantize_file
    imatrix = None
    if args.imatrix:
        from .loader.imatrix_file import load_imatrix
        imatrix = load_imatrix(args.imatrix).weights()
        print(f"imatrix {args.imatrix}: {len(imatrix)} entries", file=sys.stderr)
    quantize_file(args.input, args.output, args.type, imatrix=imatrix, threads=args.threads, pure=args.pure,
                  llamacpp_exact=args.llamacpp_exact)
    return 0


def cmd_imatrix(args) -> int:
    import os
    from .imatrix import collect_imatrix, save_imatrix
    text = _read_text(args.text)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise ValueError(f"{args.output}: directory {out_dir} does not exist")
    llm = _load(args, args.ctx)
    t0 = time.perf_counter()
    data, ppl = collect_imatrix(llm, text, ctx=args.ctx, chunks=args.chunks, dataset=args.text)
    save_imatrix(args.output, data)
    n_tok = int(max(c.max() for c in data.counts.values()))
    print(f"imatrix: {len(data.sums)} entries from {data.chunk_count} chunks of {args.ctx} tokens ({n_tok} tokens), "
          f"PPL of the text {ppl:.4f}, {time.perf_counter() - t0:.1f} s -> {args.output}")
    return 0


def cmd_kld(args) -> int:
    from .api import LLM
    from .kld import kld
    text = _read_text(args.file)
    base = LLM(args.base, backend=args.backend, n_ctx=args.ctx, n_threads=args.threads)
    llm = _load(args, args.ctx)
    t0 = time.perf_counter()
    r = kld(base, llm, text, ctx=args.ctx)
    print(f"chunks {r.n_chunks}, scored tokens {r.n_scored}, time {time.perf_counter() - t0:.1f} s")
    print(f"PPL base = {r.ppl_base:.4f}, PPL model = {r.ppl:.4f}")
    print(f"KL mean = {r.mean_kl:.6f}, median = {r.median_kl:.6f}, p99 = {r.p99_kl:.6f}, max = {r.max_kl:.6f}")
    print(f"top-1 agreement = {r.top1:.6f}")
    return 0


def cmd_synth(args) -> int:
    from .loader.synth import synth_model
    report = synth_model(args.out, args.preset, arch=args.arch, quant=args.quant, seed=args.seed, blocks=args.blocks)
    print(report.summary())
    return 0


def cmd_train_mtp(args) -> int:
    import os
    from dataclasses import asdict
    from .mtp_train import train_mtp
    from .mtp_train_defaults import DEFAULTS, resolve_device
    from .mtp_train_device import matmul_precision
    from .mtp_train_fit import FitOptions
    for f in args.text or ():
        if not os.path.isfile(f) or not os.access(f, os.R_OK):
            raise ValueError(f"{f}: not a readable file")
    device, backend = resolve_device(args.device, args.backend)
    for name, value in asdict(DEFAULTS[device]).items():       # options not given: the device's defaults
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 1 or args.batch < 1 or args.topk < 1 or args.lr <= 0:
        raise ValueError("--steps, --batch and --topk must be >= 1 and --lr > 0")
    if not 0 <= args.chain_weight < float("inf"):
        raise ValueError(f"--chain-weight must be a finite number >= 0, not {args.chain_weight}")
    if args.chain_depth < 1:
        raise ValueError(f"--chain-depth must be >= 1, not {args.chain_depth}")
    if not 0 <= args.feature_weight < float("inf"):
        raise ValueError(f"--feature-weight must be a finite number >= 0, not {args.feature_weight}")
    matmul_precision(device, args.tf32)      # a bad --tf32 fails here, before the model loads
    from .api import LLM
    t0 = time.perf_counter()
    llm = LLM(args.model, backend=backend, n_ctx=args.ctx, n_batch=args.ctx, n_threads=args.threads,
              prompt_attention=args.prompt_attention)
    print(f"loaded {llm.model_path} ({llm.config.arch}) on {llm.backend.describe()} in "
          f"{time.perf_counter() - t0:.1f} s; training on {device}: {args.steps} steps of {args.batch} windows of "
          f"{args.ctx} tokens, lr {args.lr:g}, {args.train_tokens} text tokens, {args.answers} answers", file=sys.stderr)
    opts = FitOptions(steps=args.steps, seed=args.seed, lr=args.lr, batch=args.batch, topk=args.topk,
                      warmup=min(20, max(1, args.steps // 10)), chain_weight=args.chain_weight,
                      chain_depth=args.chain_depth, feature_weight=args.feature_weight)
    rep = train_mtp(llm, args.output, args.text, opts, ctx=args.ctx, train_tokens=args.train_tokens,
                    eval_tokens=args.eval_tokens, out_type=args.type, checkpoint_dir=args.checkpoint,
                    checkpoint_every=args.checkpoint_every, device=device, answers=args.answers,
                    answer_tokens=args.answer_tokens, draft_vocab=args.draft_vocab, tf32=args.tf32)
    print(rep.summary())
    return 0


def cmd_mtp_vocab(args) -> int:
    from .mtp_vocab import add_draft_vocab
    from .loader.known_models import resolve_model
    rep = add_draft_vocab(resolve_model(args.model), args.mtp, args.output, args.text, args.size)
    print(rep.summary())
    print(f"wrote {args.output}")
    return 0


def cmd_info(args) -> int:
    from .info import report
    print("\n".join(report()))
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

    q = sub.add_parser("quantize", help="quantize a GGUF model file (docs/quantize.md)")
    q.add_argument("input", help="input GGUF (float or quantized)")
    q.add_argument("output", help="output GGUF")
    q.add_argument("--type", required=True, help="target type: IQ3_XXS, IQ4_NL, Q8_0, Q5_0, Q4_0 (or F16, F32)")
    q.add_argument("--imatrix", default=None, help="importance matrix (GGUF imatrix or .npz)")
    q.add_argument("--pure", action="store_true", help="every matrix in the target type (no mix)")
    q.add_argument("--llamacpp-exact", action="store_true",
                   help="IQ3_XXS: write llama.cpp's exact bytes (skip our refinement pass, higher error)")
    q.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    q.set_defaults(func=cmd_quantize)

    im = sub.add_parser("imatrix", help="collect an importance matrix over a text")
    _model_args(im)
    im.add_argument("--text", "-f", required=True, help="calibration text file (UTF-8)")
    im.add_argument("--output", "-o", required=True, help="output file: GGUF imatrix, or .npz (golden layout)")
    im.add_argument("--ctx", type=int, default=512, help="chunk size in tokens")
    im.add_argument("--chunks", type=int, default=None, help="use at most this many chunks")
    im.set_defaults(func=cmd_imatrix)

    k = sub.add_parser("kld", help="KL divergence and top-1 agreement of a model against a base model")
    _model_args(k)
    k.add_argument("--base", required=True, help="base GGUF file or known model")
    k.add_argument("file", help="text file (UTF-8)")
    k.add_argument("--ctx", type=int, default=512, help="chunk size in tokens")
    k.set_defaults(func=cmd_kld)
    sy = sub.add_parser("synth", help="write a GGUF model of real shapes with random valid weights (docs/synth.md)")
    sy.add_argument("--preset", required=True, help="model shapes: qwen2.5-0.5b, qwen2.5-1.5b, llama-8b-layers")
    sy.add_argument("--arch", default=None, help="architecture: qwen2, qwen3, llama (default: the preset's)")
    sy.add_argument("--quant", default="q4_k_m",
                    help="type mix: q4_k_m, q5_k_m, iq3_xxs, or one type for every matrix: f32, f16, bf16, q8_0, "
                         "q4_0, q5_0, iq4_nl, q4_k, q5_k, q6_k, iq3_xxs-pure")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--blocks", type=int, default=None, help="number of blocks (default: the preset's)")
    sy.add_argument("--out", "-o", required=True, help="output GGUF file")
    sy.set_defaults(func=cmd_synth)
    from .mtp_train_defaults import CHAIN_DEPTH, CHAIN_WEIGHT, DRAFT_VOCAB, FEATURE_WEIGHT, default_help
    tm = sub.add_parser("train-mtp", help="train an MTP block for a model by self-distillation (docs/mtp_training.md)")
    _model_args(tm)
    tm.add_argument("--text", nargs="+", default=None,
                    help="training text files (UTF-8; every tenth is held out); default: the Python stdlib sources")
    tm.add_argument("--output", "-o", required=True, help="output sidecar GGUF (loader/mtp.py layout)")
    tm.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the training math runs: cpu (numpy) or cuda (CuPy); auto: cuda when the model's "
                         "pass runs on the CUDA backend. Options below left out take the device's default")
    tm.add_argument("--steps", type=int, default=None, help="training steps " + default_help("steps"))
    tm.add_argument("--seed", type=int, default=0)
    tm.add_argument("--lr", type=float, default=None,
                    help="peak Adam learning rate, warm-up and cosine decay " + default_help("lr"))
    tm.add_argument("--batch", type=int, default=None, help="windows of --ctx tokens per step " + default_help("batch"))
    tm.add_argument("--ctx", type=int, default=None, help="window length in tokens " + default_help("ctx"))
    tm.add_argument("--topk", type=int, default=1,
                    help="1: cross-entropy on the model's greedy token; k > 1: KL to its top-k distribution")
    tm.add_argument("--chain-weight", type=float, default=CHAIN_WEIGHT,
                    help="weight W of the chained passes' losses (the block run again on its own output, as a "
                         f"chained draft): depth D counts W^(D-1); 0: one pass (default {CHAIN_WEIGHT:g})")
    tm.add_argument("--chain-depth", type=int, default=CHAIN_DEPTH,
                    help=f"deepest chained draft trained (1: one pass; default {CHAIN_DEPTH})")
    tm.add_argument("--feature-weight", type=float, default=FEATURE_WEIGHT,
                    help="weight of each pass's feature term: its output pulled towards the model's own hidden "
                         "state one position further, which a chained draft reads in its place "
                         f"(docs/mtp_training.md; default {FEATURE_WEIGHT:g}: none)")
    tm.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                    help="float32 mat-muls of the training on the GPU's TF32 tensor cores (docs/mtp_training.md) "
                         + default_help("tf32"))
    tm.add_argument("--train-tokens", type=int, default=None,
                    help="tokens of text files the model is run over " + default_help("train_tokens"))
    tm.add_argument("--eval-tokens", type=int, default=None,
                    help="held-out tokens of text files for the agreement figure " + default_help("eval_tokens"))
    tm.add_argument("--answers", type=int, default=None,
                    help="answer the first N built-in coding prompts with the model (greedy) and add the answers "
                         "to the text, every tenth held out " + default_help("answers"))
    tm.add_argument("--answer-tokens", type=int, default=None,
                    help="longest answer in tokens " + default_help("answer_tokens"))
    tm.add_argument("--type", default="Q8_0", choices=("Q8_0", "F16"), help="matrix type of the output")
    tm.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB,
                    help="the block drafts only this many tokens, the training text's most frequent (its head "
                         "reads only their rows: docs/mtp_training.md); 0: every token")
    tm.add_argument("--checkpoint", default=None, help="directory: resume from / save checkpoints there")
    tm.add_argument("--checkpoint-every", type=int, default=25, help="steps between checkpoints")
    tm.set_defaults(func=cmd_train_mtp)
    mv = sub.add_parser("mtp-vocab", help="give an MTP sidecar a draft vocabulary counted over a text "
                                          "(docs/mtp_training.md)")
    mv.add_argument("--model", default=None, help="the model the sidecar is for (default: the default model)")
    mv.add_argument("--mtp", required=True, help="the MTP sidecar GGUF")
    mv.add_argument("--text", nargs="+", default=None,
                    help="text files to count tokens in (UTF-8; every tenth held out for the coverage figure); "
                         "default: the Python stdlib sources")
    mv.add_argument("--size", type=int, default=DRAFT_VOCAB, help="tokens in the draft vocabulary")
    mv.add_argument("--output", "-o", required=True, help="output sidecar GGUF")
    mv.set_defaults(func=cmd_mtp_vocab)
    sub.add_parser("info", help="versions, CPU extensions and kernels, GPU, model cache").set_defaults(func=cmd_info)
    from .server.cli_serve import add_serve_parser   # the CLI sits above the server (layering exemption)
    from .server.fleet import add_fleet_parser
    add_serve_parser(sub)
    add_fleet_parser(sub)
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
