"""The isolated launcher: each cell in its own process; a cell killed from outside leaves failed
evidence naming the signal, the sweep goes on, and resume reruns only that cell."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decodebench.config import ConfigError
from hydra_plugins.decodebench_launcher.isolated import IsolatedLauncher, cell_context
from runner import validate_sweep_engines
from tests.conftest import REPO

CELL = ("model=tiny", "experiment=decode", "max_new_tokens=4", "repeats=1", "device=cpu", "sweep=iso")


def sweep(cache_dir: Path, evidence_dir: Path, *extra: str) -> subprocess.Popen:
    args = ["-m", "hydra/launcher=isolated", "engine=static,generate", *CELL, f"cache_dir={cache_dir}"]  # killed first
    return subprocess.Popen(
        [sys.executable, "run.py", *args, f"evidence_dir={evidence_dir}", *extra],
        cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "7"},  # the cells must see the sweep's GPUs
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def statuses(folder: Path) -> dict[str, dict]:
    return {
        json.loads(p.read_text())["config"]["engine"]["name"]: json.loads(p.read_text()) for p in folder.glob("*.json")
    }


@pytest.mark.slow
def test_a_killed_cell_is_failed_evidence_and_resume_reruns_only_it(cache_dir, tiny, tmp_path):
    pid_file = tmp_path / "static.pid"
    hook = "+hydra.callbacks.kill"
    proc = sweep(
        cache_dir,
        tmp_path / "runs",
        f"{hook}._target_=tests.sweep_hooks.WaitToBeKilled",
        f"{hook}.engine=static",
        f"{hook}.pid_file={pid_file}",
    )
    deadline = time.monotonic() + 300
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.exists(), proc.communicate()
    seen = json.loads(pid_file.read_text())
    pid = seen["pid"]
    assert pid not in (proc.pid, os.getpid())  # the cell runs in a process of its own
    assert seen["ppid"] != proc.pid, "off a TPU a cell is forked by the fork server, not started by the sweep"
    assert seen["cuda_visible_devices"] == "7"
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]

    cells = statuses(tmp_path / "runs" / "iso")
    assert cells["generate"]["status"] == "ok"
    killed = cells["static"]
    assert killed["status"] == "failed"
    assert "killed by SIGKILL (signal 9)" in killed["reason"] and "exit status -9" in killed["reason"]
    assert "before it wrote its evidence" in killed["reason"], "the launcher wrote it: the cell never ran"
    assert "1 failed, 1 ok" in out

    ok_file = next((tmp_path / "runs" / "iso").glob("generate-*.json"))
    before = ok_file.stat().st_mtime_ns
    proc = sweep(cache_dir, tmp_path / "runs", "resume=true")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert f"[resumed] {ok_file}" in out and ok_file.stat().st_mtime_ns == before
    assert {k: v["status"] for k, v in statuses(tmp_path / "runs" / "iso").items()} == {
        "generate": "ok",
        "static": "ok",
    }


def test_a_tpu_sweep_mixing_jax_and_pytorch_needs_the_isolated_launcher():
    with pytest.raises(ConfigError, match="hydra/launcher=isolated"):
        validate_sweep_engines(["generate", "jax"], "tpu", "basic")
    validate_sweep_engines(["generate", "jax"], "tpu", "isolated")
    validate_sweep_engines(["generate", "jax"], "cpu", "basic")
    validate_sweep_engines(["jax"], "tpu", "basic")


def test_the_sweep_is_refused_before_any_cell_runs(tmp_path):
    args = ["-m", "engine=generate,jax", "device=tpu", f"evidence_dir={tmp_path}", "sweep=mixed"]
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "[refused] engine=generate,jax on a TPU mixes JAX (jax) with PyTorch engines (generate)" in proc.stderr
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.slow
def test_a_cell_past_its_time_is_stopped_and_recorded_failed_and_the_sweep_goes_on(cache_dir, tiny, tmp_path):
    hook = "+hydra.callbacks.stall"
    proc = sweep(
        cache_dir,
        tmp_path / "runs",
        "hydra.launcher.timeout_min=0.25",  # 15 s from each cell's start, the other's too; the stalled one waits 120 s
        f"{hook}._target_=tests.sweep_hooks.StallInCell",  # SIGTERM reaches it inside run_cell
        f"{hook}.engine=static",
        f"{hook}.pid_file={tmp_path / 'static.pid'}",
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    cells = statuses(tmp_path / "runs" / "iso")
    assert cells["generate"]["status"] == "ok", "the sweep went on"
    stalled = cells["static"]
    assert stalled["status"] == "failed"
    assert "ran past hydra.launcher.timeout_min=0.25 and was stopped" in stalled["reason"]
    assert "killed by SIGTERM (signal 15)" in stalled["reason"] and "exit status -15" in stalled["reason"]
    assert (tmp_path / "static.pid").exists(), "its time starts when it runs, not with the fork server's imports"
    # the cell wrote its own file, with where it was; the launcher kept it and said how its process ended
    assert "; in the cell: stopped by SIGTERM while the cell ran" in stalled["reason"]
    assert "in stalled" in stalled["traceback"] and "time.sleep" in stalled["traceback"]


@pytest.mark.slow
def test_sigterm_to_the_sweep_stops_its_running_cell_and_no_cell_after_it_runs(cache_dir, tiny, tmp_path):
    pid_file = tmp_path / "static.pid"
    hook = "+hydra.callbacks.stall"
    stall = (f"{hook}._target_=tests.sweep_hooks.StallInCell", f"{hook}.engine=static", f"{hook}.pid_file={pid_file}")
    proc = sweep(cache_dir, tmp_path / "runs", *stall)
    deadline = time.monotonic() + 300
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.exists(), proc.communicate()
    cell = json.loads(pid_file.read_text())["pid"]
    proc.send_signal(signal.SIGTERM)  # the sweep's process only, as `kill` or a job scheduler sends it
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "the sweep was stopped by SIGTERM" in err
    assert not Path(f"/proc/{cell}").exists() or "zombie" in Path(f"/proc/{cell}/status").read_text(), "a cell lives on"
    cells = statuses(tmp_path / "runs" / "iso")
    assert set(cells) == {"static"}, "no cell runs after the sweep was stopped"
    stopped = cells["static"]
    assert stopped["status"] == "failed" and "stopped by SIGTERM while the cell ran" in stopped["reason"]


def test_each_cell_is_a_fork_of_a_clean_interpreter_and_a_fresh_one_on_a_tpu():
    assert cell_context(tpu=True).get_start_method() == "spawn"
    assert cell_context(tpu=False).get_start_method() == "forkserver"


@pytest.mark.parametrize("minutes", [0, -1])
def test_a_timeout_that_would_stop_every_cell_is_refused_by_name(minutes):
    with pytest.raises(ValueError, match=f"hydra.launcher.timeout_min={minutes} must be a positive"):
        IsolatedLauncher(timeout_min=minutes)
