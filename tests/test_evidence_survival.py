"""Evidence that survives the machine (issue 46, item 4): two sweeps writing one folder at once, the disk full while
a cell writes, a read-only evidence folder, and the report renderer killed mid-write.

The disk-full and read-only cases mount a small tmpfs in a user and mount namespace of their own (``unshare -rm``:
no privilege needed where the kernel allows unprivileged user namespaces); where it does not, they are skipped
with the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tests.test_report import PUBLISHED, cell_record, write

RUN = [sys.executable, "run.py"]
QUICK = ["device=cpu", "max_new_tokens=4", "repeats=1"]


def _in_own_mounts(script: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """``script`` (sh) as root of a user and mount namespace of its own, from the repository."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine: cannot mount a tmpfs without privilege")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses an unprivileged user namespace: {probe.stderr.strip()}")
    return subprocess.run(["unshare", "-rm", "sh", "-ec", script], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip


def test_two_sweeps_writing_one_folder_at_once_both_finish_and_lose_nothing(cache_dir, tiny, tmp_path):
    runs = tmp_path / "runs"
    common = [*RUN, "-m", *QUICK, "sweep=shared", f"cache_dir={cache_dir}", f"evidence_dir={runs}"]
    procs = [subprocess.Popen([*common, "context=10,256", f"prompt={word}"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for word in ("Hello", "Goodbye")]  # fmt: skip
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in outs]
    files = sorted((runs / "shared").glob("*.json"))
    records = [json.loads(f.read_text()) for f in files]  # each whole: a torn file would not parse
    assert len(files) == 4 and sorted(r["status"] for r in records) == ["failed", "failed", "ok", "ok"]
    assert {r["config"]["prompt"] for r in records} == {"Hello", "Goodbye"}
    assert not list((runs / "shared").glob(".*.tmp"))  # no half-written temporary file left behind


def test_a_full_disk_fails_the_cell_naming_the_disk_and_keeps_earlier_evidence(cache_dir, tiny, tmp_path):
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    run, args = f"{sys.executable} run.py", f"device=cpu sweep=s cache_dir={cache_dir} evidence_dir={disk}"
    proc = _in_own_mounts(textwrap.dedent(f"""
        mount -t tmpfs -o size=256k tmpfs {disk}
        {run} {args} context=10 >/dev/null 2>&1 || true
        mkdir {kept} && cp {disk}/s/*.json {kept}/
        head -c 1m /dev/zero > {disk}/filler 2>/dev/null || true
        set +e
        {run} -m {args} context=11,12
        echo "rc=$?"
        cmp {disk}/s/$(ls {kept}) {kept}/$(ls {kept}) && echo intact
        ls {disk}/s
    """))
    (earlier,) = kept.glob("*.json")
    assert json.loads(earlier.read_text())["status"] == "failed"  # the first cell's evidence, written with room
    assert "rc=0" in proc.stdout, proc.stderr[-2000:]  # the sweep went on past both cells
    assert "intact" in proc.stdout  # the earlier file is byte for byte what it was
    lines = [line for line in proc.stderr.splitlines() if "its evidence could not be written" in line]
    assert len(lines) == 2, proc.stderr[-2000:]
    assert all("No space left on device" in line and f"the disk mounted at {disk}" in line for line in lines)
    assert proc.stdout.split("intact")[1].split() == [earlier.name]  # no temporary file left on the full disk


def test_a_read_only_evidence_folder_is_refused_before_any_cell_runs(cache_dir, tiny, tmp_path):
    disk = tmp_path / "ro"
    disk.mkdir()
    proc = _in_own_mounts(textwrap.dedent(f"""
        mount -t tmpfs -o size=64k tmpfs {disk}
        mount -o remount,ro {disk}
        set +e
        {sys.executable} run.py -m context=256,512 device=cpu sweep=s cache_dir={cache_dir} evidence_dir={disk}
        echo "rc=$?"
    """))
    assert "rc=2" in proc.stdout, proc.stderr[-2000:]
    assert f"[refused] nothing run: the evidence folder {disk}/s cannot be written (Read-only file system)" in (
        proc.stderr)  # fmt: skip
    assert "[failed]" not in proc.stderr and "[ok]" not in proc.stdout  # no cell ran


def test_a_renderer_killed_mid_write_leaves_the_previous_report_whole(tmp_path):
    write(tmp_path / "runs", cell_record("ring", experiment="parity"), cell_record("ring"))
    out = tmp_path / "out"
    args = ["--evidence", str(tmp_path / "runs"), "--published", str(PUBLISHED), "--report", str(out / "REPORT.md"),
            "--arithmetic", str(out / "arithmetic.txt")]  # fmt: skip
    first = subprocess.run([sys.executable, "-m", "reports.render", *args], cwd=REPO, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write(tmp_path / "runs", cell_record("generate", experiment="parity"), cell_record("generate", (9.0, 9.5)))
    # The second render dies by SIGKILL in the middle of its first file: half the bytes on the disk, then killed.
    killer = textwrap.dedent(f"""
        import os, signal, sys
        from decodebench import files
        def half_then_killed(fd):
            os.ftruncate(fd, os.fstat(fd).st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        files.os.fsync = half_then_killed
        from reports import render
        sys.exit(render.main({args!r}))
    """)
    second = subprocess.run([sys.executable, "-c", killer], cwd=REPO, capture_output=True, text=True)
    assert second.returncode == -9, second.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".tmp")} == before
