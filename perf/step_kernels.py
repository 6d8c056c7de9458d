"""A few launches of the kernels of one decode step of many sequences (8B-layer shapes), for a profiler.

Run under Nsight Compute on the GPU machine, one kernel family at a time, e.g.

    ncu --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:'^(mm|attn)' -c 3 \
        python perf/step_kernels.py glu

Each name launches its kernel `--reps` times on random valid weights, activations rounded beforehand (timing
is the profiler's business):
  glu       Q4_K gate+up 4096 -> 2 x 14336 (the small-token kernel at 9-63 tokens)
  q4k_down  Q4_K 14336 -> 4096
  q6k_down  Q6_K 14336 -> 4096 (dp4a)
  iq3_glu   IQ3_XXS gate+up 4096 -> 2 x 14336 (dp4a)
  attn      attention of --tokens sequences over 4,096 int8 keys each (32 / 8 heads of 128)
  attn32k   attention of one sequence over 32,768 keys
  step      the decode step graph of one sequence's --tokens tokens (a pending token and its drafts, at
            position 1,000) of --model, replayed --reps times between cudaProfilerStart / Stop, so that
            `ncu --profile-from-start off --metrics gpu__time_duration.sum --csv` lists that step's kernels
            and nothing of the model's load or the graphs' capture (what a verified draft token costs, kernel
            by kernel: ncu runs the kernels one at a time, so the sum is above a replay's time)
perf/kernel_notes.md ("Decode of many sequences, continued") has what it showed on an H200.
"""
from __future__ import annotations

import argparse

import bench_gpu    # perf/: the benchmark's inputs (gemm_inputs, attention_call)

KINDS = ("glu", "q4k_down", "q6k_down", "iq3_glu", "attn", "attn32k", "step")


def matmul(cp, qtype, n_out, n_in, n_tok, glu, reps):
    from strata_lite.kernels.cuda import qmatmul as qm
    ws, xq, xd = bench_gpu.gemm_inputs(cp, qm, qtype, n_out, n_in, n_tok)
    out = cp.empty((n_tok, n_out // 2 if glu else n_out), cp.float32)
    tiles = qm.ActBuffers(n_tok, n_in, tiles=True)
    for _ in range(reps):
        qm.matmul_prequantized(ws[0], xq, xd, out, glu=glu, tiles=tiles)
    cp.cuda.runtime.deviceSynchronize()


def attention(cp, n_keys, n_seq, reps):
    call, _ = bench_gpu.attention_call(cp, n_keys, n_seq)
    for _ in range(reps):
        call()
    cp.cuda.runtime.deviceSynchronize()


def step(cp, model_path, n_tok, reps):
    from strata_lite.runner import ModelRunner, load_model
    runner = ModelRunner(load_model(model_path, backend="cuda"), kv_tokens=4096 + 512, page_size=64, host_bytes=0,
                         n_ctx=4096, max_step_tokens=64, max_seqs=4)
    if n_tok not in runner.graphs.buckets:
        raise SystemExit(f"step_kernels: no step graph of {n_tok} tokens (buckets {sorted(runner.graphs.buckets)})")
    graph = bench_gpu.one_sequence_step_graph(cp, runner, n_tok)
    stream = cp.cuda.get_current_stream()
    graph.launch(stream)                           # first replay outside the profiled range
    stream.synchronize()
    cp.cuda.profiler.start()
    for _ in range(reps):
        graph.launch(stream)
    stream.synchronize()
    cp.cuda.profiler.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kinds", nargs="+", choices=KINDS)
    ap.add_argument("--tokens", type=int, default=16, help="tokens (sequences) of the step")
    ap.add_argument("--reps", type=int, default=2, help="launches of each kernel")
    ap.add_argument("--model", default=None, help="step: the GGUF file")
    args = ap.parse_args(argv)
    if "step" in args.kinds and not args.model:
        ap.error("step needs --model")
    from strata_lite.kernels.cuda.runtime import BackendUnavailable, cupy
    try:
        cp = cupy()
    except BackendUnavailable as e:
        print(f"step_kernels: {e}")
        return 2
    n = args.tokens
    for kind in args.kinds:
        if kind == "glu":
            matmul(cp, "Q4_K", 2 * 14336, 4096, n, True, args.reps)
        elif kind == "q4k_down":
            matmul(cp, "Q4_K", 4096, 14336, n, False, args.reps)
        elif kind == "q6k_down":
            matmul(cp, "Q6_K", 4096, 14336, n, False, args.reps)
        elif kind == "iq3_glu":
            matmul(cp, "IQ3_XXS", 2 * 14336, 4096, n, True, args.reps)
        elif kind == "attn":
            attention(cp, 4096, n, args.reps)
        elif kind == "step":
            step(cp, args.model, n, args.reps)
        else:
            attention(cp, 32768, 1, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
