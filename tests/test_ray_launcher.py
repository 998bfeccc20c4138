"""Hydra's Ray launcher (conf/hydra/launcher/ray.yaml) runs a two-cell sweep on a Ray instance this test
starts on the loopback interface, each cell writing into its host's folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

# One machine, loopback only: Ray's own switch for a single-node instance binds it to 127.0.0.1; no usage report.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head() -> Iterator[str]:
    """A Ray head on 127.0.0.1 offering one decodebench_host, stopped (with its processes) at the end."""
    ray = Path(sys.executable).with_name("ray")
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    log = (temp / "head.log").open("w")
    head = subprocess.Popen(
        [
            str(ray),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            '--resources={"decodebench_host": 1}',
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],  # fmt: skip
        env={**os.environ, **RAY_ENV},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops every process it started
        head.wait(timeout=120)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_two_cell_sweep_runs_on_ray(ray_head, cache_dir, tiny, tmp_path):
    args = [
        "-m", "hydra/launcher=ray", f"hydra.launcher.ray.init.address={ray_head}", "host=auto",
        "engine=generate,static", "model=tiny", "experiment=decode", "max_new_tokens=4", "repeats=1",
        "device=cpu", "sweep=ray", f"cache_dir={cache_dir}", f"evidence_dir={tmp_path / 'runs'}",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "run.py", *args],
        cwd=REPO,
        env={**os.environ, **RAY_ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    host = socket.gethostname()
    files = sorted((tmp_path / "runs" / "ray" / host).glob("*.json"))
    records = [json.loads(p.read_text()) for p in files]
    assert sorted(r["config"]["engine"]["name"] for r in records) == ["generate", "static"]
    assert all(r["status"] == "ok" and r["environment"]["host"] == host for r in records), records
    assert "sweep " in proc.stdout and "2 ok" in proc.stdout
