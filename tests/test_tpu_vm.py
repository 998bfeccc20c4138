"""The TPU VM's startup script end to end in a dry run (cloud commands echoed, everything else for real: a
fresh venv, the Rust build, the weights, a smoke cell, the Rust binding tests, a live server on model=tiny
as the service, a sweep after it, boot evidence the report renders), and the create script's commands."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from decodebench import evidence
from reports import render
from scripts.tpu_vm import create
from tests.conftest import REPO

ARTICLE = ["python", "torch", "rust", "crate", "weights", "smoke", "unit", "serving"]  # the Rust article's order
STAGES = ["code", "python", "torch", "jax", "decodebench", "rust", "crate", "weights", "smoke", "unit", "serving",
          "sweep", "upload"]  # fmt: skip
STARTUP = REPO / "scripts" / "tpu_vm" / "startup.sh"


def dry_env(work, **meta: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DECODEBENCH_DRY_RUN": "1",
        "DECODEBENCH_WORK": str(work),
        "DECODEBENCH_PYTHON": sys._base_executable,  # the project's Python, for a venv layered on its packages
        "DECODEBENCH_CODE": str(REPO),  # built already: the crate stage's cargo has nothing to compile
        "DECODEBENCH_LAYER_VENV": sys.prefix,
        "DECODEBENCH_SERVE_WAIT_S": "300",
    }
    env.update({f"DECODEBENCH_META_DECODEBENCH_{k.upper()}": v for k, v in meta.items()})
    return env


def gone(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped (it is no child of ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z"


def stop(pid: int, timeout_s: float = 30.0) -> bool:
    """SIGINT (serve.py stops cleanly), SIGKILL after ``timeout_s``; True when SIGINT was enough."""
    if gone(pid):
        return True
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return False


@pytest.mark.slow
def test_the_startup_script_boots_into_a_live_server_in_a_dry_run(tmp_path, capsys):
    work = tmp_path / "vm"
    env = dry_env(work, engine="rust", serve_args="device=cpu max_new_tokens=4",  # a dry run's model: tiny, 256
                  port="0", sweep="-m engine=generate model=tiny experiment=decode max_new_tokens=4 repeats=1",
                  sweep_name="dry", bucket="gs://example-bucket/decodebench")  # fmt: skip
    pid = None
    try:
        proc = subprocess.run(["bash", str(STARTUP)], env=env, capture_output=True, text=True, timeout=1500)
        if (work / "serve.pid").exists():
            pid = int((work / "serve.pid").read_text())
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"decodebench boot: stages {' '.join(STAGES)}" in proc.stdout
        echoed = proc.stderr
        assert "[dry-run] gsutil -m rsync -r" in echoed and "gs://example-bucket/decodebench/runs" in echoed
        for stage in STAGES:  # each stage as a guest attribute, by a metadata-server call that was only printed
            assert f"guest-attributes/decodebench/{stage}" in echoed
        assert "instance/attributes/decodebench-engine" in echoed and "instance/attributes/decodebench-sweep" in echoed

        host = socket.gethostname()
        folder = work / "evidence" / "runs" / "dry" / host
        boot = [json.loads((folder / f"boot-{i:02d}-{stage}.json").read_text()) for i, stage in enumerate(STAGES)]
        for record in boot:
            evidence.validate(record)
            assert record["status"] == "ok" and record["dry_run"] is True and record["host"] == host
        names = [b["stage"] for b in boot]
        assert [n for n in names if n in ARTICLE] == ARTICLE, "the article's stages, in its order"
        assert [b["since_boot_s"] for b in boot] == sorted(b["since_boot_s"] for b in boot)
        by = dict(zip(names, boot, strict=True))
        assert by["upload"]["versions"]["decodebench_rs"] and by["upload"]["versions"]["torch"]
        assert "rust engine built" in by["crate"]["detail"] and "decodebench_rs" in by["crate"]["detail"]
        assert "rustc" in by["rust"]["detail"]
        assert "layered on" in by["torch"]["detail"]  # not installed: the evidence says so
        assert "synthetic" in by["weights"]["detail"] and by["weights"]["measurements"]["bytes"] > 0
        assert "passed" in by["unit"]["detail"] and "tests/test_rust_engine.py" in by["unit"]["detail"]
        serving = by["serving"]
        assert serving["measurements"]["load_s"] > 0 and serving["measurements"]["warmup_s"] > 0
        assert "/health answered" in serving["detail"] and "rust / tiny on cpu" in serving["detail"]
        assert "stopped for the sweep" in by["sweep"]["detail"]
        assert (work / "venv" / "bin" / "python").exists()

        unit = (work / "decodebench-serve.service").read_text()  # what systemd would run, written all the same
        assert "Restart=on-failure" in unit and '"serve.py" "engine=rust" "model=tiny" "context=256"' in unit

        # the guest attributes the VM would have written, read as the rig's progress tool reads them
        attributes = create.boot_stages(json.loads((work / "guest-attributes.json").read_text()))
        assert [s["stage"] for s in attributes["stages"]] == STAGES and attributes["current"] == "done"
        read = ["stages", "--project", "p", "--guest-attributes-file", str(work / "guest-attributes.json")]
        assert create.main(read) == 0
        assert "serving      ok" in capsys.readouterr().out

        # the service is up (started again after the sweep), a child of no one, its pid recorded
        url = (work / "serve.url").read_text().strip()
        assert url.startswith("http://127.0.0.1:") and f"(pid {pid})" in proc.stdout
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["engine"] == "rust"

        cells = {json.loads(p.read_text())["config"]["engine"]["name"]: json.loads(p.read_text())
                 for p in folder.glob("*-tiny-*.json")}  # fmt: skip
        assert sorted(cells) == ["generate", "rust"] and all(c["status"] == "ok" for c in cells.values())

        out = render.build(folder.parents[1], REPO / "evidence" / "published", tmp_path / "R.md", tmp_path / "a.txt")
        report = out.report.read_text()
        assert f"### {host}, sweep dry — dry run" in report
        assert "| 10 | serving | ok |" in report and "from the start of *python* to the start of *serving*" in report
        assert "4 minutes 29 seconds" in report  # the published boot beside it
    finally:
        if pid is not None:
            assert stop(pid), "the server did not stop on SIGINT"


def test_the_startup_script_refuses_to_boot_into_nothing(tmp_path):
    proc = subprocess.run(["bash", str(STARTUP), "--no-serve"], env=dry_env(tmp_path / "vm"), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "no server (decodebench-serve=0) and no sweep" in proc.stderr
    assert not (tmp_path / "vm" / "evidence").exists()


def test_the_create_script_prints_a_v5e_queued_resource_with_the_startup_script(capsys):
    argv = ["--project", "my-project", "--bucket", "gs://my-bucket/db", "--repo", "https://example.org/d.git",
            "--ref", "abc123", "--sweep", "-m engine=generate,ring model=e2b-synthetic"]  # fmt: skip
    assert create.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# dry run: printed, not run"
    first = lines[1]
    assert first.startswith("gcloud alpha compute tpus queued-resources create decodebench-v5e1")
    assert "--accelerator-type v5litepod-1" in first and "--provisioning-model flex-start" in first
    assert "startup-script=" + str(REPO / "scripts" / "tpu_vm" / "startup.sh") in first
    assert "decodebench-sweep=-m engine=generate,ring model=e2b-synthetic;" in first
    assert "decodebench-serve=1;decodebench-engine=rust;decodebench-model=e2b-emb4;decodebench-context=8192;" in first
    assert any(line.startswith("gcloud compute tpus tpu-vm get-guest-attributes") for line in lines)
    assert any(line.startswith("gcloud compute tpus tpu-vm describe decodebench-v5e1") for line in lines)
    assert "make collect FROM=evidence/incoming/tpu-v5e-1-boot" in lines


@pytest.mark.parametrize(
    "argv",
    [["--bucket", "/tmp/x"], ["--no-serve"]],
    ids=["bucket-not-gcs", "no-serve-and-no-sweep"],
)
def test_the_create_script_refuses(argv):
    with pytest.raises(SystemExit):
        create.main(["--project", "p", "--repo", "r", *argv])
