#!/usr/bin/env bash
# scripts/device_check.sh [OUT]: an accelerator's figures in one command, from a fresh clone, in about 8
# minutes on a CUDA GPU or a TPU VM: set-up (make setup), the parity sweep of every engine on model=tiny,
# the decode sweep of every engine on model=e2b-synthetic (16 new tokens, one repeat), then the report.
# Evidence and report land in one folder, OUT (default device-check/<sweep>/):
#   OUT/evidence/runs/<sweep>/...   the sweep is <UTC date>-<device kind>-<device name>
#   OUT/REPORT.md, OUT/arithmetic.txt, OUT/*.png
# To keep the figures: cp -r OUT/evidence/runs/<sweep> evidence/runs/ && git add -f evidence/runs/<sweep>;
# `make report` then renders them beside the CPU runs. It runs on a CPU too (slowly: try
# DECODEBENCH_CHECK_MODEL=tiny ENGINES=generate,static).
# Settings: DEVICE (auto), ENGINES (every registered engine), DECODEBENCH_CHECK_MODEL (e2b-synthetic),
# PYTHON (a set-up interpreter: skips make setup), DECODEBENCH_CACHE_DIR (.cache).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
START=$(date +%s)

if [[ -z ${PYTHON:-} ]]; then
  make setup
  PYTHON=.venv/bin/python
fi
DEVICE=${DEVICE:-auto}
MODEL=${DECODEBENCH_CHECK_MODEL:-e2b-synthetic}
CACHE=${DECODEBENCH_CACHE_DIR:-.cache}
ENGINES=${ENGINES:-$("$PYTHON" -c "from engines import ENGINES; print(','.join(ENGINES))")}
read -r KIND NAME < <("$PYTHON" -c "
import re
from decodebench.device import resolve_device
d = resolve_device('$DEVICE')
print(d.kind, re.sub(r'[^a-z0-9]+', '-', d.name.lower()).strip('-') or d.kind)")
SWEEP=${SWEEP:-$(date -u +%Y-%m-%d)-$KIND-$NAME}
OUT=${1:-device-check/$SWEEP}
EVIDENCE=$OUT/evidence/runs
# JAX and PyTorch cannot share a TPU in one process: such a sweep runs each cell in its own.
LAUNCHER=()
if [[ $KIND == tpu && ,$ENGINES, == *,jax,* ]]; then LAUNCHER=(hydra/launcher=isolated); fi
COMMON=("${LAUNCHER[@]}" "device=$DEVICE" "sweep=$SWEEP" "evidence_dir=$EVIDENCE" "cache_dir=$CACHE")

echo "device check: $KIND ($NAME), engines $ENGINES, sweep $SWEEP, into $OUT"
"$PYTHON" run.py -m "engine=$ENGINES" model=tiny experiment=parity "${COMMON[@]}"
"$PYTHON" run.py -m "engine=$ENGINES" "model=$MODEL" experiment=decode max_new_tokens=16 repeats=1 "${COMMON[@]}"
"$PYTHON" -m reports.render --evidence "$EVIDENCE" --report "$OUT/REPORT.md" --arithmetic "$OUT/arithmetic.txt"
echo "device check done in $(($(date +%s) - START)) s: $OUT/REPORT.md"
echo "to keep it: cp -r $EVIDENCE/$SWEEP evidence/runs/ && git add -f evidence/runs/$SWEEP"
