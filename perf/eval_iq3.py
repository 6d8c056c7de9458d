"""Evaluate our IQ3_XXS quantizations of a real model against llama.cpp's (golden READMEs).

    python perf/eval_iq3.py [--model KEY|PATH] [--out DIR] [--variants mix-im,mix,pure-im,pure]
                            [--golden-imatrix] [--threads N]

Steps (every product is kept in --out and reused on a second run unless --redo):
1. imatrix: our own, from the first 20 x 512 tokens of CPython's Lib/argparse.py (the local stdlib copy;
   the golden sets used 3.11.7's, sha256 dc1eba8a...), each chunk from an empty cache; compared with the
   golden imatrix (llama.cpp's) when present. --golden-imatrix quantizes with the golden one instead.
2. quantize the base (Q4_K_M) model: our IQ3_XXS mix and --pure, each with and without the imatrix;
   records file size and quantization time.
3. heapq.py (golden text): PPL of every file, KL(base || file) over the 2,816 scored positions, top-1.
4. one table, with llama.cpp's figures for the same model from the golden reference JSON.

Models: "qwen2.5-coder-0.5b-instruct-q4_k_m" (default) or "qwen2.5-coder-1.5b-instruct-q4_k_m"
(pip install -e ".[model-1-5b]"). Run time on the 2-core machine: see docs/quantize.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("STRATA_GOLDEN", "/work/shared/golden"))
GOLDEN_DIR = {"qwen2.5-coder-0.5b-instruct-q4_k_m": GOLDEN / "qwen2.5-coder-0.5b-instruct-q4_k_m",
              "qwen2.5-coder-1.5b-instruct-q4_k_m": GOLDEN / "qwen2.5-coder-1.5b-instruct"}
VARIANTS = {"mix-im": (False, True), "mix": (False, False), "pure-im": (True, True), "pure": (True, False)}


def golden_rows(gdir: Path) -> tuple[list[dict], float | None]:
    """llama.cpp's rows for the table and the base model's PPL, from the golden JSON files."""
    rows, base_ppl = [], None
    ref = gdir / "iq3_xxs_reference.json"
    if not ref.is_file():
        return rows, base_ppl
    d = json.loads(ref.read_text())
    base_ppl = d.get("q4_k_m_ppl") or (d.get("q4_k_m") or {}).get("ppl")
    for name, v in d.get("variants", {}).items():
        kl = v.get("kl_vs_q4_k_m") or {}
        secs = None
        rc_line = (v.get("quantize_log") or {}).get("rc_line", "")
        if "secs" in rc_line:
            secs = float(rc_line.split("secs")[1].split()[0])
        rows.append(dict(name=f"llama.cpp {name}", bytes=v.get("size_bytes"), secs=secs,
                         ppl=(v.get("perplexity") or {}).get("ppl"), mean_kl=kl.get("mean_kl"),
                         median_kl=kl.get("median_kl"), p99_kl=kl.get("p99_kl"), max_kl=kl.get("max_kl"),
                         top1=kl.get("top1_agreement")))
    return rows, base_ppl


def imatrix_agreement(ours: dict, golden: dict) -> str:
    common = sorted(set(ours) & set(golden))
    if not common:
        return "no common entries"
    rel = [np.abs(ours[k] - golden[k]).sum() / np.abs(golden[k]).sum() for k in common]
    corr = [np.corrcoef(np.log(ours[k] + 1e-12), np.log(golden[k] + 1e-12))[0, 1] for k in common]
    return (f"{len(common)} common entries (ours {len(ours)}, golden {len(golden)}): relative L1 difference "
            f"median {np.median(rel):.4f}, max {np.max(rel):.4f}; log-correlation min {np.min(corr):.5f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--out", default=None, help="work directory (default: /tmp/strata_iq3_<model>)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--golden-imatrix", action="store_true", help="quantize with the golden (llama.cpp) imatrix")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--text", default=None, help="PPL/KL text (default: the golden heapq.py)")
    ap.add_argument("--redo", action="store_true", help="recompute products already in --out")
    args = ap.parse_args(argv)

    from strata_lite import LLM
    from strata_lite.imatrix import collect_imatrix, load_imatrix, save_imatrix
    from strata_lite.kld import kld
    from strata_lite.loader.known_models import resolve_model
    from strata_lite.loader.quantize_file import quantize_file

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad} (known: {', '.join(VARIANTS)})")
    key = args.model if args.model in GOLDEN_DIR else Path(args.model).stem
    gdir = GOLDEN_DIR.get(args.model, GOLDEN / "none")
    out = Path(args.out or f"/tmp/strata_iq3_{key}")
    out.mkdir(parents=True, exist_ok=True)
    base_path = resolve_model(args.model)
    text_path = Path(args.text) if args.text else (gdir / "heapq.py" if (gdir / "heapq.py").is_file()
                                                   else ROOT / "tests" / "data" / "heapq.py")
    text = text_path.read_text(encoding="utf-8")
    log = open(out / "eval.log", "a")

    def say(msg):
        print(msg, flush=True)
        print(msg, file=log, flush=True)

    say(f"== eval_iq3 {time.strftime('%Y-%m-%d %H:%M:%S')} model {base_path} variants {variants}")

    # 1. imatrix
    im_weights = None
    if any(VARIANTS[v][1] for v in variants):
        golden_npz = gdir / "imatrix_argparse20.npz"
        im_path = out / f"imatrix_argparse{args.chunks}.gguf"
        if args.golden_imatrix:
            im_weights = load_imatrix(golden_npz).weights()
            say(f"imatrix: golden {golden_npz} ({len(im_weights)} entries)")
        else:
            if args.redo or not im_path.is_file():
                calib = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
                llm = LLM(base_path, backend="cpu", n_ctx=args.ctx, n_threads=args.threads)
                t0 = time.perf_counter()
                data, ppl = collect_imatrix(llm, calib.read_text(encoding="utf-8"), ctx=args.ctx,
                                            chunks=args.chunks, dataset=str(calib))
                save_imatrix(im_path, data)
                say(f"imatrix: {len(data.sums)} entries, {data.chunk_count} chunks of {args.ctx} from {calib}, "
                    f"PPL {ppl:.4f}, {time.perf_counter() - t0:.0f} s -> {im_path}")
                del llm
            im_weights = load_imatrix(im_path).weights()
            if golden_npz.is_file():
                say("imatrix vs golden: " + imatrix_agreement(im_weights, load_imatrix(golden_npz).weights()))

    # 2. quantize
    files, rows = {}, {}
    for v in variants:
        pure, use_im = VARIANTS[v]
        tag = v + ("-goldenim" if use_im and args.golden_imatrix else "")
        path = out / f"{key}-iq3_xxs-{tag}.gguf"
        meta = path.with_suffix(".json")
        if args.redo or not (path.is_file() and meta.is_file()):
            rep = quantize_file(base_path, path, "IQ3_XXS", imatrix=im_weights if use_im else None,
                                threads=args.threads, pure=pure)
            meta.write_text(json.dumps({"secs": rep.seconds, "by_type": rep.by_type}))
            say(f"quantized {tag}: {rep.nbytes:,} bytes in {rep.seconds:.0f} s; " +
                ", ".join(f"{t} x{c[0]}" for t, c in rep.by_type.items()))
        files[tag] = path
        rows[tag] = dict(name=f"strata {tag}", bytes=path.stat().st_size, secs=json.loads(meta.read_text())["secs"])

    # 3. PPL, KL, top-1 (the base runs once; all files are evaluated chunk by chunk beside it)
    base = LLM(base_path, backend="cpu", n_ctx=args.ctx, n_threads=args.threads)
    llms = [LLM(str(p), backend="cpu", n_ctx=args.ctx, n_threads=args.threads) for p in files.values()]
    t0 = time.perf_counter()
    results = kld(base, llms, text, ctx=args.ctx)
    say(f"PPL/KL of {len(llms)} files over {results[0].n_scored} positions: {time.perf_counter() - t0:.0f} s")
    for tag, r in zip(files, results):
        rows[tag].update(ppl=r.ppl, mean_kl=r.mean_kl, median_kl=r.median_kl, p99_kl=r.p99_kl, max_kl=r.max_kl,
                         top1=r.top1)
    base_row = dict(name="base (Q4_K_M), ours", bytes=os.path.getsize(base_path), secs=None, ppl=results[0].ppl_base,
                    mean_kl=0.0, median_kl=0.0, p99_kl=0.0, max_kl=0.0, top1=1.0)

    # 4. table
    gold, gold_base_ppl = golden_rows(gdir)
    table = [base_row] + list(rows.values()) + gold
    if gold_base_ppl:
        table.insert(1, dict(name="base (Q4_K_M), llama.cpp", bytes=base_row["bytes"], ppl=gold_base_ppl))

    def f(x, spec):
        return "—" if x is None else format(x, spec)
    header = (f"| {'file':<34} | {'bytes':>13} | {'quant s':>7} | {'PPL':>7} | {'mean KL':>8} | {'median KL':>9} | "
              f"{'p99 KL':>7} | {'max KL':>7} | {'top-1':>6} |")
    say(header)
    say("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in table:
        say(f"| {r['name']:<34} | {f(r.get('bytes'), ',d'):>13} | {f(r.get('secs'), '.0f'):>7} | "
            f"{f(r.get('ppl'), '.4f'):>7} | {f(r.get('mean_kl'), '.4f'):>8} | {f(r.get('median_kl'), '.4f'):>9} | "
            f"{f(r.get('p99_kl'), '.3f'):>7} | {f(r.get('max_kl'), '.3f'):>7} | {f(r.get('top1'), '.4f'):>6} |")
    (out / "results.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
