#!/usr/bin/env bash
# One command for the GPU machine (no network there): install the wheels brought in .whl/ (made here with
# ../shared/device/get-wheels.sh, see docs/cuda.md), run the GPU tests, then the GPU benchmark; the table last.
# usage: perf/gpu_run.sh [pytest args...]   (test paths relative to the checkout run instead of all of tests/;
#        other args go to pytest as given, e.g. -k "tiled or graph")   (env: SKIP_TESTS=1, SKIP_BENCH=1, BENCH_ARGS="--quick",
#        MODEL_TESTS=1: also the default model's goldens, drafting and server suites on the CUDA backend; the
#        model must already be in $STRATA_LITE_CACHE, see docs/cuda.md "On the GPU machine"; KERNEL_SUITE=1:
#        also the pytest-benchmark kernel suite perf/bench_gpu_kernels.py, its JSON in $OUT; HOST_CPU=1: also the
#        host CPU's kernel choice, 512-bit prompt tiles and thread scaling (perf/bench_gemm_lanes.py,
#        perf/bench_threads.py; logs in $OUT), the machine's CPU being one of the CPU figures' machines; HOST_IK=DIR:
#        also strata_lite against ik_llama.cpp's llama-bench in DIR on the README table's files, see below)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/strata-out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}   # the wheels' target (/dev/shm/site stays between commands while the machine is held)
if [ -d .whl ]; then
  # pip refuses two versions of one package (a wheel left from an earlier get-wheels.sh): name them instead
  dup=$(ls .whl/*.whl | sed 's|.*/||; s|-.*||' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
  [ -z "$dup" ] || { echo "two or more wheels of: $dup (in .whl/; keep one version of each)"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
# the package maps kernels/ loader/ server/ into strata_lite.* (setup.cfg); a tree of links does the same
# without pip. Python then runs from /tmp, so the checkout's own strata_lite/ folder does not shadow it.
ROOT=$PWD; rm -rf /tmp/sl; mkdir -p /tmp/sl/strata_lite
for f in strata_lite/*; do ln -s "$ROOT/$f" /tmp/sl/strata_lite/; done
for d in kernels loader server; do ln -s "$ROOT/$d" /tmp/sl/strata_lite/$d; done
export PYTHONPATH="$SITE":/tmp/sl
# pytest runs from /tmp (below): test paths given relative to the checkout become absolute, and replace tests/
targets=(); args=()
for a in "$@"; do
  if [[ -n "$a" && "$a" != -* && -e "$ROOT/${a%%::*}" ]]; then targets+=("$ROOT/$a"); else args+=("$a"); fi
done
[ ${#targets[@]} -gt 0 ] || targets=("$ROOT/tests")
cd /tmp
export PYTHONUNBUFFERED=1
# a package the machine lacks fails here in one line, not as every test's collection error
if ! python3 -c "import strata_lite" 2> "$OUT/import.log"; then
  echo "strata_lite does not import on this machine: $(tail -n 1 "$OUT/import.log")"
  echo "(bring the missing package's wheel in .whl/: docs/cuda.md, \"Tests\")"
  exit 1
fi
python3 - <<'PY'
import cupy, numba, numpy
print("cupy", cupy.__version__, "numba", numba.__version__, "numpy", numpy.__version__,
      cupy.cuda.runtime.getDeviceProperties(0)["name"])
PY
# each phase under its own time limit (seconds), so one that hangs cannot take the other's turn
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_LIMIT:-1800}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "${targets[@]}" ${args[@]+"${args[@]}"} \
    > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -n 40
fi
if [ -n "${MODEL_TESTS:-}" ]; then
  STRATA_LITE_TEST_BACKEND=cuda STRATA_LITE_SERVER_TEST_ENGINE=real timeout "${MODEL_TEST_LIMIT:-900}" \
    python3 -m pytest -q -p no:cacheprovider -rfE "$ROOT/tests/engine/test_golden_llamacpp.py" \
      "$ROOT/tests/engine/test_spec_default_model.py" "$ROOT/tests/server/test_real_model.py" \
      "$ROOT/tests/server/test_openai_client.py" > "$OUT/model_tests.log" 2>&1
  mrc=$?; [ $rc -eq 0 ] && rc=$mrc
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/model_tests.log" | tail -n 40
fi
if [ -n "${KERNEL_SUITE:-}" ]; then
  timeout "${KERNEL_SUITE_LIMIT:-900}" python3 -m pytest -q -p no:cacheprovider "$ROOT/perf/bench_gpu_kernels.py" \
    --benchmark-only --benchmark-json "$OUT/bench_gpu_kernels.json" > "$OUT/bench_gpu_kernels.log" 2>&1
  krc=$?; [ $rc -eq 0 ] && rc=$krc
  tail -n 30 "$OUT/bench_gpu_kernels.log"
fi
if [ -n "${HOST_CPU:-}" ]; then
  lscpu > "$OUT/lscpu.txt" 2>&1
  timeout "${HOST_CPU_LIMIT:-400}" python3 "$ROOT/perf/bench_gemm_lanes.py" --threads 2 16 --rounds 5 \
    > "$OUT/bench_gemm_lanes.log" 2>&1
  timeout "${HOST_CPU_LIMIT:-400}" python3 "$ROOT/perf/bench_threads.py" --threads 2,4,8,16 --waits default \
    --rounds 3 --json "$OUT/bench_threads.json" > "$OUT/bench_threads.log" 2>&1
  tail -n 12 "$OUT/bench_gemm_lanes.log" "$OUT/bench_threads.log"
fi
if [ -n "${HOST_IK:-}" ]; then
  # HOST_IK=DIR: ik_llama.cpp's llama-bench (and its shared libraries) in DIR, relative to the checkout, built by the
  # user for this host's CPU; the three files of the README's ik_llama.cpp table made here by `strata-lite synth`
  # (random weights in the real files' types and shapes: the default model's Q4_K_M mix, untied output included),
  # then perf/bench_e2e.py against it (HOST_IK_RUNS runs, default 3, in HOST_IK_ROUNDS rounds that alternate the
  # engines, default 1) at each of HOST_IK_THREADS (default "2 16"); logs in $OUT
  ikdir="$ROOT/$HOST_IK"; export LD_LIBRARY_PATH="$ikdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  syn=/dev/shm/ik-files; mkdir -p "$syn"
  for spec in "qwen2.5-0.5b q4_k_m" "qwen2.5-0.5b iq3_xxs" "qwen2.5-1.5b iq3_xxs"; do
    set -- $spec; f="$syn/$1-$2.gguf"
    [ -s "$f" ] || python3 -m strata_lite.cli synth --preset "$1" --quant "$2" --out "$f" > /dev/null 2>&1
  done
  for th in ${HOST_IK_THREADS:-2 16}; do
    for f in "$syn"/*.gguf; do
      timeout "${HOST_IK_LIMIT:-300}" python3 "$ROOT/perf/bench_e2e.py" --runs "${HOST_IK_RUNS:-3}" --rounds "${HOST_IK_ROUNDS:-1}" \
        --threads "$th" --model "$f" \
        --ik-bench "$ikdir/llama-bench" --ik-flags "" --ik-flags "-rtr 1 -fa 0" \
        > "$OUT/ik_$(basename "$f" .gguf)_t$th.log" 2>&1
      echo "== $(basename "$f"), $th threads"; tail -n 8 "$OUT/ik_$(basename "$f" .gguf)_t$th.log"
    done
  done
  lscpu > "$OUT/lscpu.txt" 2>&1
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_LIMIT:-1200}" python3 "$ROOT/perf/bench_gpu.py" ${BENCH_ARGS:-} --json "$OUT/bench_gpu.json" \
    > "$OUT/bench_gpu.log" 2>&1
  tail -n 30 "$OUT/bench_gpu.log"
fi
exit $rc
