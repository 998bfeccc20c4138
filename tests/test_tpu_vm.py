"""The TPU VM's startup script end to end in a dry run (cloud commands echoed, everything else for real:
a fresh venv, the Rust build, a smoke cell, a sweep on model=tiny, boot evidence the report renders), and
the create script's commands."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from decodebench import evidence
from reports import render
from scripts.tpu_vm import create
from tests.conftest import REPO

STAGES = ["code", "python", "torch", "jax", "decodebench", "rust", "smoke", "sweep", "upload"]


@pytest.mark.slow
def test_the_startup_script_boots_in_a_dry_run(tmp_path):
    env = {
        **os.environ,
        "DECODEBENCH_DRY_RUN": "1",
        "DECODEBENCH_WORK": str(tmp_path / "vm"),
        "DECODEBENCH_PYTHON": sys._base_executable,  # the project's Python, for a venv layered on its packages
        "DECODEBENCH_CODE": str(REPO),  # built already: the Rust stage's cargo has nothing to compile
        "DECODEBENCH_LAYER_VENV": sys.prefix,
        "DECODEBENCH_META_DECODEBENCH_SWEEP": "-m engine=generate,static model=tiny experiment=decode "
        "max_new_tokens=4 repeats=1",
        "DECODEBENCH_META_DECODEBENCH_SWEEP_NAME": "dry",
        "DECODEBENCH_META_DECODEBENCH_BUCKET": "gs://example-bucket/decodebench",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "tpu_vm" / "startup.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    echoed = proc.stderr
    assert "[dry-run] gsutil -m rsync -r" in echoed and "gs://example-bucket/decodebench/runs" in echoed
    for stage in STAGES:  # each stage as a guest attribute, by a metadata-server call that was only printed
        assert f"guest-attributes/decodebench/{stage}" in echoed
    assert "instance/attributes/decodebench-sweep" in echoed

    host = socket.gethostname()
    folder = tmp_path / "vm" / "evidence" / "runs" / "dry" / host
    boot = [json.loads((folder / f"boot-{i:02d}-{stage}.json").read_text()) for i, stage in enumerate(STAGES)]
    for record in boot:
        evidence.validate(record)
        assert record["status"] == "ok" and record["dry_run"] is True and record["host"] == host
    assert [b["since_boot_s"] for b in boot] == sorted(b["since_boot_s"] for b in boot)
    assert boot[-1]["versions"]["decodebench_rs"] and boot[-1]["versions"]["torch"]
    assert "rust engine built" in boot[STAGES.index("rust")]["detail"]
    assert "layered on" in boot[STAGES.index("torch")]["detail"]  # not installed: the evidence says so
    assert (tmp_path / "vm" / "venv" / "bin" / "python").exists()

    cells = {json.loads(p.read_text())["config"]["engine"]["name"]: json.loads(p.read_text()) for p in
             folder.glob("*-tiny-*.json")}  # fmt: skip
    assert sorted(cells) == ["generate", "rust", "static"]
    assert all(c["status"] == "ok" for c in cells.values())

    out = render.build(folder.parents[1], REPO / "evidence" / "published", tmp_path / "R.md", tmp_path / "a.txt")
    report = out.report.read_text()
    assert f"### {host}, sweep dry — dry run" in report
    assert "| 5 | rust | ok |" in report and "from the start of *python* to the end of *smoke*" in report
    assert "4 minutes 29 seconds" in report  # the published boot beside it
    assert f"| dry | 1 | {host} | 3 | 3 | 0 | 0 |" in report


def test_the_create_script_prints_a_v5e_queued_resource_with_the_startup_script(capsys):
    argv = ["--project", "my-project", "--bucket", "gs://my-bucket/db", "--repo", "https://example.org/d.git",
            "--ref", "abc123", "--sweep", "-m engine=generate,ring model=e2b-synthetic"]  # fmt: skip
    assert create.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    first = lines[0]
    assert first.startswith("gcloud alpha compute tpus queued-resources create decodebench-v5e1")
    assert "--accelerator-type v5litepod-1" in first and "--provisioning-model flex-start" in first
    assert "startup-script=" + str(REPO / "scripts" / "tpu_vm" / "startup.sh") in first
    assert "decodebench-sweep=-m engine=generate,ring model=e2b-synthetic;" in first
    assert any(line.startswith("gcloud compute tpus tpu-vm get-guest-attributes") for line in lines)
    assert "make collect FROM=evidence/incoming/tpu-v5e-1-boot" in lines


def test_the_create_script_refuses_a_bucket_that_is_not_gcs():
    with pytest.raises(SystemExit):
        create.main(["--project", "p", "--bucket", "/tmp/x", "--repo", "r"])
