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

from decodebench import exit_status
from decodebench.config import ConfigError
from runner import validate_sweep_engines
from tests.conftest import REPO

CELL = ("model=tiny", "experiment=decode", "max_new_tokens=4", "repeats=1", "device=cpu", "sweep=iso")


def sweep(cache_dir: Path, evidence_dir: Path, *extra: str) -> subprocess.Popen:
    args = ["-m", "hydra/launcher=isolated", "engine=static,generate", *CELL, f"cache_dir={cache_dir}"]  # killed first
    return subprocess.Popen(
        [sys.executable, "run.py", *args, f"evidence_dir={evidence_dir}", *extra],
        cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "7"},  # the cells must see the sweep's GPUs, not submitit's none
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
    assert seen["cuda_visible_devices"] == "7"
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]

    cells = statuses(tmp_path / "runs" / "iso")
    assert cells["generate"]["status"] == "ok"
    killed = cells["static"]
    assert killed["status"] == "failed"
    assert "killed by SIGKILL (signal 9)" in killed["reason"] and "exit status -9" in killed["reason"]
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


def test_the_exit_status_wrapper_records_how_its_child_ended(tmp_path, monkeypatch):
    status = tmp_path / "status.json"
    assert exit_status.run(status, [sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert exit_status.read(status) == 3
    killer = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert exit_status.run(status, [sys.executable, "-c", killer]) == -9
    assert "killed by SIGKILL (signal 9)" in exit_status.describe(exit_status.read(status))
    monkeypatch.setenv("Y", "set in the parent")
    sees_x = "import os, sys; sys.exit(0 if os.environ.get('X') == '1' and 'Y' not in os.environ else 4)"
    assert exit_status.run(status, [sys.executable, "-c", sees_x], {"X": "1", "Y": None}) == 0
    assert "exited with status 3" in exit_status.describe(3)
    assert exit_status.read(tmp_path / "missing.json") is None


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


def test_a_timed_out_cell_is_not_requeued(tmp_path):
    """submitit requeues a timed-out job whose callable resubmits itself from ``checkpoint``; ours returns
    None, so submitit's own check gives a reason not to requeue (and the cell is recorded failed)."""
    import submitit
    from submitit.core.job_environment import _checkpoint

    from hydra_plugins.decodebench_launcher.isolated import IsolatedLauncher

    launcher = IsolatedLauncher.__new__(IsolatedLauncher)
    delayed = submitit.helpers.DelayedSubmission(launcher, ["engine=generate"], "hydra.sweep.dir", 0, "job", {})
    assert _checkpoint(delayed, tmp_path / "submitted.pkl", countdown=3) == "checkpoint function returned None"
    assert not (tmp_path / "submitted.pkl").exists(), "nothing was dumped for a requeue"
