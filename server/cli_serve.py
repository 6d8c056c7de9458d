"""`strata-lite serve`: the OpenAI-compatible HTTP server. Hook it into strata_lite/cli.py with
`add_serve_parser(sub)` in build_parser(); it sets `func`, so main() runs it like the other commands."""
from __future__ import annotations

import argparse
import logging
import os

API_KEY_ENV = "STRATA_LITE_API_KEY"


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _nonneg_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return x


def _positive_float(text: str) -> float:
    x = _nonneg_float(text)
    if x == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return x


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {n}")
    return n


def _spec(text: str):
    from strata_lite.spec import parse_spec
    try:
        return parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from strata_lite.config import PROMPT_ATTENTION
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (docs/server.md)",
                              description="Serve the model over an OpenAI-compatible HTTP API: /v1/chat/completions, "
                                          "/v1/completions, /v1/models, /health, /metrics, /slots.")
    p.add_argument("--model", "-m", default=None, help="GGUF file or known model; default: the 0.5B model")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=_port, default=8080, help="port (default 8080)")
    p.add_argument("--parallel", "-np", type=_positive_int, default=2,
                   help="slots: requests generated at the same time (default 2)")
    p.add_argument("--ctx-size", "-c", type=_positive_int, default=8192,
                   help="context per request, prompt + generated tokens (default 8192)")
    p.add_argument("--kv-tokens", type=_positive_int, default=None,
                   help="device KV cache capacity in tokens (default ctx-size x parallel)")
    p.add_argument("--step-tokens", type=_positive_int, default=256,
                   help="prompt tokens computed per engine step, next to the decodes (default 256)")
    p.add_argument("--decode-share", type=_nonneg_float, default=0.8,
                   help="while prompts are read, decoding requests keep this share of their speed "
                        "(default 0.8; 0 = no time budget, only --step-tokens)")
    p.add_argument("--host-kv-gib", type=_nonneg_float, default=None,
                   help="host RAM for parked KV, GiB (default: a quarter of the available RAM)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for a slot; more get 503 with Retry-After (default 64)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                        f"(default: ${API_KEY_ENV} if set)")
    p.add_argument("--threads", "-t", type=_positive_int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--vram-reserve-mib", type=int, default=1024,
                   help="CUDA: GPU memory (MiB) left free when weights, KV cache and workspaces are planned "
                        "at start-up (default 1024)")
    p.add_argument("--prompt-attention", choices=PROMPT_ATTENTION, default="exact",
                   help="CUDA: how prompt chunks read their keys: exact (the decode kernels' bits, default) or f16 "
                        "(a flash attention over an f16 copy of the keys, ~3x faster after 32K tokens, each "
                        "output within f16 rounding of the exact one; head_dim 64 or 128; docs/cuda.md)")
    p.add_argument("--http-threads", type=_positive_int, default=None,
                   help="HTTP worker threads (default: parallel + max-queue + 4, at least 8, at most 128)")
    p.add_argument("--stuck-step-s", type=_positive_float, default=60.0,
                   help="/health answers 503 engine_stuck while an engine step runs longer than this many seconds "
                        "or 100x the median step, whichever is longer (default 60)")
    p.add_argument("--kv-disk", default=None, metavar="DIR",
                   help="keep every computed prefix page in files under DIR too: a restart or a crash loses no "
                        "cached conversation, and prefixes evicted from RAM come back by reading them "
                        "(docs/scheduler.md, 'Disk tier')")
    p.add_argument("--kv-disk-gib", type=_positive_float, default=20.0,
                   help="size limit of --kv-disk; least recently used pages are deleted beyond it (default 20)")
    p.add_argument("--spec", type=_spec, default="auto", metavar="auto|mtp|suffix|off|N|mtp:N",
                   help="speculative decoding: auto (default: drafts from the conversation itself, or from the "
                        "model's MTP block when it has one, whichever promises more per step; draft widths from "
                        "measured acceptance and step cost), mtp (the MTP block only), suffix (the conversation "
                        "only), off, up to N drafted tokens per step from the conversation (N), or up to N from "
                        "the MTP block every step, whatever they cost (mtp:N) (docs/speculative.md)")
    p.add_argument("--mtp", default=None, metavar="FILE",
                   help="GGUF file holding the model's MTP block (a sidecar written for this model); a model "
                        "file that embeds one, and the default model (whose block ships with the package), "
                        "need no flag (docs/speculative.md, 'MTP drafting')")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=cmd_serve)
    return p


def config_from_args(args):
    from strata_lite.config import EngineConfig
    return EngineConfig(model=args.model, backend=args.backend, n_ctx=args.ctx_size, parallel=args.parallel,
                        kv_tokens=args.kv_tokens, step_tokens=args.step_tokens, decode_share=args.decode_share, host_kv_gib=args.host_kv_gib,
                        max_queue=args.max_queue, threads=args.threads,
                        vram_reserve_mib=args.vram_reserve_mib, stuck_step_s=args.stuck_step_s, spec=args.spec,
                        kv_disk=args.kv_disk, kv_disk_gib=args.kv_disk_gib, mtp=args.mtp,
                        prompt_attention=args.prompt_attention)


def api_key_from_args(args) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def cmd_serve(args) -> int:
    from strata_lite.spec.controller import split_spec
    from strata_lite.spec.mtp_drafter import check_mtp_available
    from .serve import serve
    config = config_from_args(args)
    # --spec mtp without an MTP block, or an --mtp file for another model: one line before anything starts
    check_mtp_available(config.model, split_spec(config.spec)[0], config.mtp)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(config, host=args.host, port=args.port, api_key=api_key_from_args(args),
                 threads=args.http_threads)
