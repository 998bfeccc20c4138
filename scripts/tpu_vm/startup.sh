#!/usr/bin/env bash
# decodebench on a TPU VM: the startup script (instance metadata `startup-script`; the VM runs it as root
# at boot; scripts/tpu_vm/create.py puts it there). No SSH needed: each stage is written, when it ends,
# as a guest attribute (decodebench/<stage>, read with `gcloud ... get-guest-attributes`) and as a boot
# evidence file (evidence/boot.schema.json) beside the sweep's cells, then everything is copied to a bucket.
#
# Stages: code, python, torch, jax, decodebench, rust, smoke, sweep, upload.
#
# Instance metadata it reads (attributes):
#   decodebench-repo        git URL of decodebench            decodebench-ref   the commit to check out
#   decodebench-sweep       run.py's arguments for the sweep, e.g. "-m engine=generate,ring model=e2b-synthetic"
#   decodebench-sweep-name  the sweep's folder name (default boot-<UTC date>)
#   decodebench-bucket      where the evidence goes, e.g. gs://my-bucket/decodebench
#
# DECODEBENCH_DRY_RUN=1 runs it on any Linux machine: every cloud command (gcloud, gsutil, curl to the
# metadata server) is printed with a [dry-run] prefix instead of run, attributes come from
# DECODEBENCH_META_<NAME> (upper case, '-' as '_'), and everything else runs for real. Settings:
#   DECODEBENCH_WORK        the working folder (default /opt/decodebench)
#   DECODEBENCH_PYTHON      the interpreter the venv is made from (default python$PYTHON_VERSION)
#   DECODEBENCH_CODE        use this checkout instead of cloning decodebench-repo (dry run only)
#   DECODEBENCH_LAYER_VENV  dry run only: the fresh venv is layered (a .pth file) on this existing venv's
#                           packages instead of pip-installing the pinned ones, so a test takes a minute;
#                           the boot evidence says so in each install stage's detail
set -uo pipefail

# Pinned versions. jax 0.12 needs Python 3.12; jax[tpu] 0.12.0.1 and torch_tpu 0.2.0 share libtpu 0.0.50.x.
PYTHON_VERSION=3.12
TORCH_SPEC="torch==2.13.0"
TORCH_TPU_SPEC="torch_tpu==0.2.0"
JAX_SPEC="jax[tpu]==0.12.0.1"

DRY=${DECODEBENCH_DRY_RUN:-0}
MD=http://metadata.google.internal/computeMetadata/v1
WORK=${DECODEBENCH_WORK:-/opt/decodebench}
VENV=$WORK/venv
LOGS=$WORK/logs
EVIDENCE=$WORK/evidence/runs
PY=${DECODEBENCH_PYTHON:-python$PYTHON_VERSION}
BOOT_START=$(date +%s.%N)
HOST=$(hostname)
INDEX=0
CODE=${DECODEBENCH_CODE:-$WORK/decodebench}
mkdir -p "$LOGS"

if [[ $DRY != 1 && ( -n ${DECODEBENCH_CODE:-} || -n ${DECODEBENCH_LAYER_VENV:-} ) ]]; then
  echo "DECODEBENCH_CODE and DECODEBENCH_LAYER_VENV are for a dry run only (DECODEBENCH_DRY_RUN=1)" >&2
  exit 2
fi

# A cloud command: run, or printed in a dry run.
cloud() {
  if [[ $DRY == 1 ]]; then echo "[dry-run] $(printf '%q ' "$@")" >&2; else "$@"; fi
}

# meta NAME [DEFAULT]: an instance attribute (a dry run reads DECODEBENCH_META_<NAME> instead).
meta() {
  local name=$1 default=${2-} value
  if [[ $DRY == 1 ]]; then
    cloud curl -sf -H "Metadata-Flavor: Google" "$MD/instance/attributes/$name"
    local var="DECODEBENCH_META_${name^^}"
    var=${var//-/_}
    value=${!var-}
  else
    value=$(curl -sf -H "Metadata-Flavor: Google" "$MD/instance/attributes/$name") || value=""
  fi
  echo "${value:-$default}"
}

# attribute KEY VALUE: a guest attribute, readable from outside the VM without SSH.
attribute() {
  cloud curl -sf -X PUT --data "$2" -H "Metadata-Flavor: Google" "$MD/instance/guest-attributes/decodebench/$1"
}

upload() {
  cloud gsutil -m rsync -r "$EVIDENCE" "$BUCKET/runs"
}

# stage NAME FUNCTION: runs it in a subshell that stops at its first failing command (output in
# $LOGS/NAME.log), timed; writes its boot evidence and guest attribute; a failed stage uploads what there
# is and ends the boot. A stage function adds notes for its evidence with `detail TEXT`.
stage() {
  local name=$1 fn=$2 started ended rc status=ok reason="" python="" summary
  attribute stage "$name"
  echo "STAGE: $name"
  : >"$LOGS/$name.detail"
  started=$(date +%s.%N)
  (
    set -e
    STAGE=$name
    "$fn"
  ) >"$LOGS/$name.log" 2>&1
  rc=$?
  ended=$(date +%s.%N)
  if [[ $rc != 0 ]]; then
    status=failed
    reason="$name failed (status $rc); the end of $LOGS/$name.log: $(tail -n 8 "$LOGS/$name.log")"
  fi
  [[ -x $VENV/bin/python ]] && python=$VENV/bin/python
  summary=$(python3 "$BOOT_STAGE" --folder "$EVIDENCE/$SWEEP/$HOST" --sweep "$SWEEP" --host "$HOST" \
    --stage "$name" --index "$INDEX" --status "$status" --reason "$reason" --detail "$(cat "$LOGS/$name.detail")" \
    --started "$started" --ended "$ended" --boot-start "$BOOT_START" --python "$python" \
    $([[ $DRY == 1 ]] && echo --dry-run))
  echo "STAGE: $name $summary"
  attribute "$name" "$summary"
  INDEX=$((INDEX + 1))
  if [[ $status != ok ]]; then
    echo "$reason" >&2
    upload
    exit 1
  fi
}

detail() { echo "$*" >>"$LOGS/$STAGE.detail"; }

layered() { [[ $DRY == 1 && -n ${DECODEBENCH_LAYER_VENV:-} ]]; }

stage_code() {
  if [[ $DRY == 1 && -n ${DECODEBENCH_CODE:-} ]]; then
    detail "dry run: checkout $CODE used as it is, not cloned"
  else
    rm -rf "$CODE"
    git clone --quiet "$REPO_URL" "$CODE"
    git -C "$CODE" checkout --quiet "$REF"
  fi
  detail "decodebench $(git -C "$CODE" rev-parse HEAD)"
}

stage_python() {
  if ! command -v "$PY" >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq software-properties-common
    add-apt-repository -y ppa:deadsnakes/ppa
    apt-get update -qq
    apt-get install -y -qq "python$PYTHON_VERSION" "python$PYTHON_VERSION-venv" "python$PYTHON_VERSION-dev" build-essential
  fi
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  if layered; then
    local purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
    "$DECODEBENCH_LAYER_VENV/bin/python" -c "$purelib" >"$("$VENV/bin/python" -c "$purelib")/_decodebench_layer.pth"
    ln -sf "$DECODEBENCH_LAYER_VENV/bin/maturin" "$VENV/bin/maturin"
    detail "dry run: venv layered on $DECODEBENCH_LAYER_VENV's packages"
  else
    "$VENV/bin/pip" install -q --upgrade pip
  fi
}

# pip_install SPEC...: the pinned packages (a layered dry run installs nothing and says so).
pip_install() {
  if layered; then
    detail "dry run: not installed ($*): layered on $DECODEBENCH_LAYER_VENV"
  else
    "$VENV/bin/pip" install -q "$@"
  fi
}

stage_torch() { pip_install "$TORCH_SPEC" "$TORCH_TPU_SPEC"; }
stage_jax() { pip_install "$JAX_SPEC"; }
stage_decodebench() { pip_install -e "$CODE[rust]"; }

stage_rust() {
  if ! command -v cargo >/dev/null; then
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  fi
  command -v g++ >/dev/null || apt-get install -y -qq build-essential
  cd "$CODE"
  local built
  built=$("$VENV/bin/python" scripts/build_rust.py --venv "$VENV")
  detail "$built"
}

run_py() {
  cd "$CODE"
  "$VENV/bin/python" run.py "$@" "sweep=$SWEEP" host=auto "evidence_dir=$EVIDENCE" "cache_dir=$WORK/cache"
}

# The smoke cell: the Rust engine, through the shim, on this machine's device (tpu on a TPU VM).
stage_smoke() {
  local out
  out=$(run_py engine=rust model=tiny experiment=decode max_new_tokens=4 repeats=1)
  echo "$out"
  grep -q '^\[ok\]' <<<"$out" # skipped or failed is not a working engine
  detail "$(grep '^\[ok\]' <<<"$out")"
}

stage_sweep() {
  local args out
  read -ra args <<<"$SWEEP_ARGS"
  detail "run.py $SWEEP_ARGS"
  out=$(run_py "${args[@]}")
  echo "$out"
  detail "$(grep '^sweep ' <<<"$out" | tail -n 1)"
}

stage_upload() { upload; }

export PATH=$HOME/.cargo/bin:$PATH
BOOT_STAGE=$WORK/boot_stage.py
# The boot evidence writer travels with this script (create.py appends it as metadata); a dry run
# takes it from the checkout beside this script.
if [[ $DRY == 1 ]]; then
  cp "$(dirname "$(readlink -f "$0")")/boot_stage.py" "$BOOT_STAGE"
else
  meta decodebench-boot-stage >"$BOOT_STAGE"
fi
REPO_URL=$(meta decodebench-repo)
REF=$(meta decodebench-ref HEAD)
SWEEP_ARGS=$(meta decodebench-sweep "-m engine=generate,ring model=e2b-synthetic max_new_tokens=16 repeats=1")
SWEEP=$(meta decodebench-sweep-name "boot-$(date -u +%Y-%m-%d)")
BUCKET=$(meta decodebench-bucket)

for name in code python torch jax decodebench rust smoke sweep upload; do
  stage "$name" "stage_$name"
done
upload # once more: the upload stage's own evidence
attribute stage done
echo "decodebench boot done: evidence in $EVIDENCE/$SWEEP/$HOST, copied to $BUCKET/runs"
