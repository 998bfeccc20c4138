"""scripts/device_check.sh on this CPU with the small model and two engines: parity and decode sweeps,
evidence and report in one folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_device_check_leaves_evidence_and_report_in_one_folder(cache_dir, tiny, tmp_path):
    settings = {"PYTHON": sys.executable, "DEVICE": "cpu", "ENGINES": "generate,static", "SWEEP": "check-cpu",
                "DECODEBENCH_CHECK_MODEL": "tiny", "DECODEBENCH_CACHE_DIR": str(cache_dir)}  # fmt: skip
    env = {**os.environ, **settings}
    out = tmp_path / "check"
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "device_check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in (out / "evidence" / "runs" / "check-cpu").glob("*.json")]
    cells = sorted((r["config"]["experiment"]["name"], r["config"]["engine"]["name"], r["status"]) for r in records)
    assert cells == [("decode", "generate", "ok"), ("decode", "static", "ok"),
                     ("parity", "generate", "ok"), ("parity", "static", "ok")]  # fmt: skip
    report = (out / "REPORT.md").read_text()
    assert "| check-cpu | 1 |" in report and "## Parity with Transformers" in report
    assert f"cp -r {out}/evidence/runs/check-cpu evidence/runs/" in proc.stdout
