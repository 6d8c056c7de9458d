#!/usr/bin/env bash
# Train an MTP head on the GPU machine in one command (docs/mtp_training.md, "On the GPU machine"): install
# the wheels brought in .whl/ (as perf/gpu_run.sh does), run `strata-lite train-mtp --device cuda` with the
# GPU defaults on $MODEL, write the sidecar to $OUT/mtp.gguf (and in 15 MiB pieces mtp.gguf.partNN, which
# come back from the machine: cat them), and print the run's summary last: training time, held-out top-1
# agreement (= first-draft acceptance under greedy decoding) on held-out stdlib code and on held-out
# answers of the model, and the wall time of the whole command.
# usage: MODEL=/path/model.gguf OUT=/tmp/out perf/train_mtp_default.sh [more train-mtp options...]
#        (env: SITE, the wheels' target, default /tmp/site; TRAIN_LIMIT, seconds, default 570)
set -u
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the GGUF file of the model}"
OUT=${OUT:-/tmp/strata-out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
# the package maps kernels/ loader/ server/ into strata_lite.* (setup.cfg); a tree of links does the same
# without pip, and Python runs from /tmp so the checkout's own strata_lite/ folder does not shadow it
ROOT=$PWD; LINKS=$(mktemp -d /tmp/sl-mtp.XXXXXX); mkdir -p "$LINKS/strata_lite"
for f in strata_lite/*; do ln -s "$ROOT/$f" "$LINKS/strata_lite/"; done
for d in kernels loader server; do ln -s "$ROOT/$d" "$LINKS/strata_lite/$d"; done
export PYTHONPATH="$SITE:$LINKS" PYTHONUNBUFFERED=1
cd /tmp
python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__,
  'numpy', numpy.__version__)"
t0=$(date +%s)
# progress bars and the load line go to the log; the summary (stdout) is printed and kept
timeout "${TRAIN_LIMIT:-570}" python3 -m strata_lite.cli train-mtp --model "$MODEL" --device cuda \
  -o "$OUT/mtp.gguf" "$@" 2> "$OUT/train_mtp.log" > "$OUT/train_mtp.txt"
rc=$?
tr '\r' '\n' < "$OUT/train_mtp.log" | grep -v -e '%|' -e '^\s*$' | tail -n 12     # without the progress bars
[ $rc -eq 0 ] || echo "train-mtp exited with status $rc (124: over TRAIN_LIMIT); log: $OUT/train_mtp.log"
if [ -f "$OUT/mtp.gguf" ]; then      # files come back from the GPU machine at <= 16 MiB each: cat the parts
  split -b 15m -d "$OUT/mtp.gguf" "$OUT/mtp.gguf.part" && sha256sum "$OUT/mtp.gguf"
fi
cat "$OUT/train_mtp.txt"
echo "whole command: $(( $(date +%s) - t0 )) s"
rm -rf "$LINKS"
exit $rc
