#!/usr/bin/env bash
# decodebench on a TPU VM: the startup script (instance metadata `startup-script`; the VM runs it as root
# at boot; scripts/tpu_vm/create.py puts it there). It boots the machine into decodebench's OpenAI-compatible
# server, as the Rust article's rig does, and can run a sweep after the server starts or instead of it.
# No SSH needed: each stage is written, when it ends, as a guest attribute (decodebench/<stage>, read with
# `gcloud ... get-guest-attributes` or `python -m scripts.tpu_vm.create stages`) and as a boot evidence file
# (evidence/boot.schema.json) beside the sweep's cells; with a bucket, everything is copied there.
#
# Stages, in order; the Rust article's eight (python torch rust crate weights smoke unit serving) keep its
# order, with decodebench's own around them:
#   code         check out the pinned commit                               (decodebench's)
#   python       the interpreter and a fresh venv
#   torch        torch and torch_tpu
#   jax          jax[tpu] on the same libtpu                               (decodebench's: the JAX engine)
#   decodebench  decodebench itself with its rust and serve extras, and pytest (decodebench's)
#   rust         the Rust toolchain and a C++ compiler
#   crate        the Rust engine built against the installed torch (scripts/build_rust.py)
#   weights      the checkpoint the server reads: downloaded by hub id (huggingface_hub), timed; a
#                synthetic model is built by the project's own code (scripts/tpu_vm/weights.py)
#   smoke        one Rust cell on this machine's device
#   unit         the Rust binding tests (tests/test_rust_engine.py)
#   serving      serve.py under systemd (Restart=on-failure); ends when /health answers, with the
#                server's own load and warm-up seconds from /v1/engine as the stage's measurements
#   sweep        only when asked: run.py with the given arguments (the server is stopped for it, since
#                one process owns a TPU chip, and started again after it)
#   upload       the evidence to the bucket (with none, it stays on the machine)
#
# Instance metadata it reads (attributes); `--sweep ARGS` and `--no-serve` on the command line win:
#   decodebench-repo, decodebench-ref   the git URL and commit to check out
#   decodebench-serve                   1 (default): boot into the server; 0: no server
#   decodebench-engine, -model, -context  serve.py's engine, model and context (rust, e2b-emb4, 8192;
#                                       a dry run: rust, tiny, 256)
#   decodebench-serve-args              more serve.py overrides (e.g. engine.mode=fuse)
#   decodebench-host, decodebench-port  where the server listens (0.0.0.0 and 8000; a dry run: 127.0.0.1)
#   decodebench-sweep                   run.py's arguments for a sweep (default: none)
#   decodebench-sweep-name              the evidence folder's name (default boot-<UTC date>)
#   decodebench-bucket                  where the evidence goes, e.g. gs://my-bucket/decodebench (default: none)
#
# DECODEBENCH_DRY_RUN=1 runs it on any Linux machine: every cloud command (gcloud, gsutil, curl to the
# metadata server) is printed with a [dry-run] prefix instead of run, attributes come from
# DECODEBENCH_META_<NAME> (upper case, '-' as '_'), the guest attributes it would write go to
# $DECODEBENCH_WORK/guest-attributes.json (in `gcloud --format json`'s shape), systemd is left alone (the
# unit is written beside the work folder and its systemctl commands printed; the server runs as a child
# process in a session of its own, its pid in $DECODEBENCH_WORK/serve.pid), and everything else runs for
# real. Settings:
#   DECODEBENCH_WORK        the working folder (default /opt/decodebench)
#   DECODEBENCH_PYTHON      the interpreter the venv is made from (default python$PYTHON_VERSION)
#   DECODEBENCH_CODE        use this checkout instead of cloning decodebench-repo (dry run only)
#   DECODEBENCH_LAYER_VENV  dry run only: the fresh venv is layered (a .pth file) on this existing venv's
#                           packages instead of pip-installing the pinned ones, so a test takes minutes;
#                           the boot evidence says so in each install stage's detail
#   DECODEBENCH_SERVE_WAIT_S  how long the serving stage waits for /health (default 1200)
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
SERVE_WAIT_S=${DECODEBENCH_SERVE_WAIT_S:-1200}
SERVICE=decodebench-serve
BOOT_START=$(date +%s.%N)
HOST=$(hostname)
INDEX=0
CODE=${DECODEBENCH_CODE:-$WORK/decodebench}
export HF_HOME=$WORK/hf # the weights stage downloads here and the server reads from here
mkdir -p "$LOGS"

if [[ $DRY != 1 && ( -n ${DECODEBENCH_CODE:-} || -n ${DECODEBENCH_LAYER_VENV:-} ) ]]; then
  echo "DECODEBENCH_CODE and DECODEBENCH_LAYER_VENV are for a dry run only (DECODEBENCH_DRY_RUN=1)" >&2
  exit 2
fi

ARG_SWEEP="" ARG_SWEEP_SET=0 ARG_NO_SERVE=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --sweep) ARG_SWEEP=${2-}; ARG_SWEEP_SET=1; shift 2 ;;
    --no-serve) ARG_NO_SERVE=1; shift ;;
    *) echo "startup.sh: unknown argument $1 (known: --sweep ARGS, --no-serve)" >&2; exit 2 ;;
  esac
done

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

# attribute KEY VALUE: a guest attribute, readable from outside the VM without SSH. A dry run also keeps
# them in guest-attributes.json, as `gcloud compute tpus tpu-vm get-guest-attributes --format json` prints them.
attribute() {
  cloud curl -sf -X PUT --data "$2" -H "Metadata-Flavor: Google" "$MD/instance/guest-attributes/decodebench/$1"
  if [[ $DRY == 1 ]]; then
    python3 -c 'import json, os, sys
path, key, value = sys.argv[1:]
kept = [a for a in (json.load(open(path)) if os.path.exists(path) else []) if a["key"] != key]
json.dump(kept + [{"namespace": "decodebench", "key": key, "value": value}], open(path, "w"), indent=1)' \
      "$WORK/guest-attributes.json" "$1" "$2"
  fi
}

upload() {
  if [[ -n $BUCKET ]]; then cloud gsutil -m rsync -r "$EVIDENCE" "$BUCKET/runs"; fi
}

# stage NAME FUNCTION: runs it in a subshell that stops at its first failing command (output in
# $LOGS/NAME.log), timed; writes its boot evidence and guest attribute; a failed stage uploads what there
# is and ends the boot. A stage function adds notes for its evidence with `detail TEXT` and figures with
# `measure KEY NUMBER`.
stage() {
  local name=$1 fn=$2 started ended rc status=ok reason="" python="" summary measured=()
  attribute stage "$name"
  echo "STAGE: $name"
  : >"$LOGS/$name.detail"
  : >"$LOGS/$name.measure"
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
  while read -r line; do [[ -n $line ]] && measured+=(--measurement "$line"); done <"$LOGS/$name.measure"
  summary=$(python3 "$BOOT_STAGE" --folder "$EVIDENCE/$SWEEP/$HOST" --sweep "$SWEEP" --host "$HOST" \
    --stage "$name" --index "$INDEX" --status "$status" --reason "$reason" --detail "$(cat "$LOGS/$name.detail")" \
    --started "$started" --ended "$ended" --boot-start "$BOOT_START" --python "$python" "${measured[@]}" \
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
# measure KEY VALUE: a figure for the stage's evidence (a value that is not a number is left out)
measure() { [[ $2 =~ ^[0-9.eE+-]+$ ]] && echo "$1=$2" >>"$LOGS/$STAGE.measure"; return 0; }
# json_get KEY: one field of the JSON document on stdin's last line
json_get() { python3 -c 'import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])[sys.argv[1]])' "$1"; }

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
    local purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])' layer
    layer=$("$DECODEBENCH_LAYER_VENV/bin/python" -c "$purelib")  # a site dir: its own .pth files count too
    echo "import site; site.addsitedir('$layer')" >"$("$VENV/bin/python" -c "$purelib")/_decodebench_layer.pth"
    ln -sf "$DECODEBENCH_LAYER_VENV/bin/maturin" "$VENV/bin/maturin"
    detail "dry run: venv layered on $DECODEBENCH_LAYER_VENV's packages"
  else
    "$VENV/bin/pip" install -q --upgrade pip
  fi
  detail "$("$VENV/bin/python" --version)"
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
stage_decodebench() { pip_install -e "$CODE[rust,serve]" pytest; }

# The toolchain only (the article's `rust`); the crate is the next stage.
stage_rust() {
  if ! command -v cargo >/dev/null; then
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  fi
  command -v g++ >/dev/null || apt-get install -y -qq build-essential
  detail "$(rustc --version); $(g++ --version | head -n 1)"
}

stage_crate() {
  cd "$CODE"
  local built
  if layered; then  # the layer's interpreter: a new venv's path would make cargo rebuild pyo3 and the crate
    built=$("$DECODEBENCH_LAYER_VENV/bin/python" scripts/build_rust.py --venv "$DECODEBENCH_LAYER_VENV")
    detail "dry run: built into $DECODEBENCH_LAYER_VENV, which the venv is layered on"
  else
    built=$("$VENV/bin/python" scripts/build_rust.py --venv "$VENV")
  fi
  detail "$built"
  detail "$("$VENV/bin/python" -c 'import decodebench_rs; print("decodebench_rs", decodebench_rs.BUILD)')"
}

stage_weights() {
  cd "$CODE"
  local out
  out=$("$VENV/bin/python" -m scripts.tpu_vm.weights "${SERVE_OVERRIDES[@]}")
  echo "$out"
  local what seconds bytes
  what=$(json_get hub_id <<<"$out")
  [[ $what == None ]] && what="$(json_get model <<<"$out") (synthetic, built by decodebench.synthetic)"
  seconds=$(json_get seconds <<<"$out")
  bytes=$(json_get bytes <<<"$out")
  detail "$what: $(json_get files <<<"$out") files, $bytes bytes in $seconds s, at $(json_get path <<<"$out")"
  measure fetch_s "$seconds"
  measure bytes "$bytes"
}

run_py() {
  cd "$CODE"
  "$VENV/bin/python" run.py "$@" "sweep=$SWEEP" host=auto "evidence_dir=$EVIDENCE" "cache_dir=$WORK/cache"
}

# The smoke cell: the Rust engine, through its C++ shim over ATen, on this machine's device (tpu on a TPU VM).
stage_smoke() {
  local out
  out=$(run_py engine=rust model=tiny experiment=decode max_new_tokens=4 repeats=1)
  echo "$out"
  grep -q '^\[ok\]' <<<"$out" # skipped or failed is not a working engine
  detail "$(grep '^\[ok\]' <<<"$out")"
}

# The Rust binding tests on this machine (CI=1: a crate that does not import fails, never skips).
stage_unit() {
  cd "$CODE"
  local out rc=0
  out=$(env -u PYTEST_ADDOPTS -u PYTEST_XDIST_WORKER -u PYTEST_XDIST_TESTRUNUID CI=1 \
    "$VENV/bin/python" -m pytest -p no:cacheprovider --basetemp "$WORK/pytest" tests/test_rust_engine.py 2>&1) || rc=$?
  echo "$out"
  [[ $rc == 0 ]] || return "$rc"
  detail "tests/test_rust_engine.py: $(grep -E '[0-9]+ passed' <<<"$out" | tail -n 1)"
}

use_systemd() { [[ $DRY != 1 && -d /run/systemd/system ]]; }

# unit_word WORD: one ExecStart word, quoted for systemd (which expands % and $ itself).
unit_word() {
  local w=$1
  w=${w//\\/\\\\}
  w=${w//\"/\\\"}
  w=${w//%/%%}
  w=${w//\$/\$\$}
  printf '"%s" ' "$w"
}

# The systemd unit: serve.py with the configured engine, model and context, restarted when it fails.
write_unit() {
  local word exec=""
  for word in "$VENV/bin/python" serve.py "${SERVE_OVERRIDES[@]}" "serve.host=$SERVE_HOST" "serve.port=$PORT"; do
    exec+=$(unit_word "$word")
  done
  cat >"$WORK/$SERVICE.service" <<EOF
[Unit]
Description=decodebench OpenAI-compatible server ($ENGINE / $MODEL, context $CONTEXT) on port $PORT
After=network-online.target
Wants=network-online.target

[Service]
WorkingDirectory=$CODE
Environment="HF_HOME=$HF_HOME" "PATH=$PATH"
ExecStart=$exec
Restart=on-failure
RestartSec=5
KillSignal=SIGINT
TimeoutStopSec=30
StandardOutput=append:$LOGS/serve.out
StandardError=append:$LOGS/serve.out

[Install]
WantedBy=multi-user.target
EOF
}

# service_start: the server, under systemd or (dry run, or no systemd) as a child in a session of its own;
# its pid in $WORK/serve.pid either way.
service_start() {
  : >"$LOGS/serve.out"
  if use_systemd; then
    install -m 644 "$WORK/$SERVICE.service" "/etc/systemd/system/$SERVICE.service"
    systemctl daemon-reload
    systemctl enable --now "$SERVICE"
    systemctl show -p MainPID --value "$SERVICE" >"$WORK/serve.pid"
  else
    echo "[dry-run] systemctl enable --now $SERVICE (unit: $WORK/$SERVICE.service); started as a child instead" >&2
    cd "$CODE"
    # setsid: a session of its own, as a service; env --default-signal=INT: a background job of a
    # non-interactive shell starts with SIGINT ignored, and serve.py stops cleanly on SIGINT
    setsid env --default-signal=INT "$VENV/bin/python" serve.py "${SERVE_OVERRIDES[@]}" "serve.host=$SERVE_HOST" "serve.port=$PORT" \
      >>"$LOGS/serve.out" 2>&1 </dev/null &
    echo $! >"$WORK/serve.pid"
  fi
}

service_running() {
  if use_systemd; then systemctl is-active --quiet "$SERVICE"; else
    [[ -s $WORK/serve.pid ]] && kill -0 "$(cat "$WORK/serve.pid")" 2>/dev/null
  fi
}

# service_stop: SIGINT (serve.py stops cleanly), SIGKILL after 30 s.
service_stop() {
  if use_systemd; then systemctl stop "$SERVICE"; return; fi
  local pid
  pid=$(cat "$WORK/serve.pid")
  kill -INT "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null || true
}

# await_server: until /health answers (bounded); the stage's figures from /v1/engine.
await_server() {
  local out pid=()
  use_systemd || pid=(--pid "$(cat "$WORK/serve.pid")")
  out=$("$VENV/bin/python" "$CODE/scripts/tpu_vm/await_server.py" --log "$LOGS/serve.out" \
    --timeout "$SERVE_WAIT_S" "${pid[@]}")
  echo "$out"
  SERVE_URL=$(json_get url <<<"$out")
  echo "$SERVE_URL" >"$WORK/serve.url"
  measure load_s "$(json_get load_s <<<"$out")"
  measure warmup_s "$(json_get warmup_s <<<"$out")"
  measure health_wait_s "$(json_get waited_s <<<"$out")"
  detail "$(json_get engine <<<"$out") / $(json_get model <<<"$out") on $(json_get device <<<"$out") at $SERVE_URL" \
    "(pid $(cat "$WORK/serve.pid")); /health answered; load $(json_get load_s <<<"$out") s," \
    "warm-up $(json_get warmup_s <<<"$out") s (from /v1/engine)"
}

stage_serving() {
  write_unit
  if use_systemd; then detail "systemd unit /etc/systemd/system/$SERVICE.service"; else
    detail "no systemd here$([[ $DRY == 1 ]] && echo ' (dry run)'): the unit is written to $WORK/$SERVICE.service and serve.py runs as a child"
  fi
  service_start
  await_server
}

stage_sweep() {
  local args out rc=0 restart=0
  if service_running; then
    service_stop
    restart=1
    detail "the server was stopped for the sweep (one process owns a TPU chip) and started again after it"
  fi
  read -ra args <<<"$SWEEP_ARGS"
  detail "run.py $SWEEP_ARGS"
  out=$(run_py "${args[@]}") || rc=$?
  echo "$out"
  detail "$(grep '^sweep ' <<<"$out" | tail -n 1)"
  if [[ $restart == 1 ]]; then
    service_start
    await_server
  fi
  return "$rc"
}

stage_upload() {
  if [[ -n $BUCKET ]]; then
    upload
    detail "gsutil rsync to $BUCKET/runs$([[ $DRY == 1 ]] && echo ' (printed, not run: dry run)')"
  else
    detail "no bucket: the evidence stays in $EVIDENCE"
  fi
}

export PATH=$HOME/.cargo/bin:$PATH
BOOT_STAGE=$WORK/boot_stage.py
# The boot evidence writer travels with this script (create.py appends it as metadata); a dry run
# takes it from the checkout beside this script.
if [[ $DRY == 1 ]]; then
  cp "$(dirname "$(readlink -f "$0")")/boot_stage.py" "$BOOT_STAGE"
  rm -f "$WORK/guest-attributes.json"
else
  meta decodebench-boot-stage >"$BOOT_STAGE"
fi
REPO_URL=$(meta decodebench-repo)
REF=$(meta decodebench-ref HEAD)
SERVE=$(meta decodebench-serve 1)
ENGINE=$(meta decodebench-engine rust)
# A dry run defaults to the synthetic tiny model (its weights stage builds it; a hub model is downloaded for
# real when named), a TPU VM to the article's checkpoint and cache.
MODEL=$(meta decodebench-model "$([[ $DRY == 1 ]] && echo tiny || echo e2b-emb4)")
CONTEXT=$(meta decodebench-context "$([[ $DRY == 1 ]] && echo 256 || echo 8192)")
SERVE_ARGS=$(meta decodebench-serve-args)
SERVE_HOST=$(meta decodebench-host "$([[ $DRY == 1 ]] && echo 127.0.0.1 || echo 0.0.0.0)")
PORT=$(meta decodebench-port 8000)
SWEEP_ARGS=$(meta decodebench-sweep)
SWEEP=$(meta decodebench-sweep-name "boot-$(date -u +%Y-%m-%d)")
BUCKET=$(meta decodebench-bucket)
[[ $ARG_SWEEP_SET == 1 ]] && SWEEP_ARGS=$ARG_SWEEP
[[ $ARG_NO_SERVE == 1 ]] && SERVE=0
# serve.py's (and the weights stage's) overrides: engine, model, context, the extra ones, the cache.
read -ra SERVE_EXTRA <<<"$SERVE_ARGS"
SERVE_OVERRIDES=("engine=$ENGINE" "model=$MODEL" "context=$CONTEXT" "${SERVE_EXTRA[@]}" "cache_dir=$WORK/cache")
if [[ $SERVE != 1 && -z $SWEEP_ARGS ]]; then
  echo "startup.sh: no server (decodebench-serve=0) and no sweep: nothing to boot into" >&2
  exit 2
fi

STAGES=(code python torch jax decodebench rust crate weights smoke unit)
[[ $SERVE == 1 ]] && STAGES+=(serving)
[[ -n $SWEEP_ARGS ]] && STAGES+=(sweep)
STAGES+=(upload)
echo "decodebench boot: stages ${STAGES[*]}"
for name in "${STAGES[@]}"; do
  stage "$name" "stage_$name"
done
upload # once more: the upload stage's own evidence
attribute stage done
if [[ $SERVE == 1 ]]; then
  echo "decodebench boot done: serving at $(cat "$WORK/serve.url")/v1 (pid $(cat "$WORK/serve.pid")); evidence in $EVIDENCE/$SWEEP/$HOST"
else
  echo "decodebench boot done: evidence in $EVIDENCE/$SWEEP/$HOST${BUCKET:+, copied to $BUCKET/runs}"
fi
