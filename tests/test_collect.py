"""`make collect`: evidence from many hosts merged into one tree (new, identical, conflicting files), and
the report's count of hosts per sweep and its warning for a cell with two different files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reports import render
from reports.tables import cells
from runner import run_cell
from scripts.collect import collect, main
from tests.conftest import REPO, make_cfg


@pytest.fixture(scope="module")
def cell_file(tmp_path_factory, cache_dir, tiny) -> Path:
    """One real cell's evidence file (sweep r), written the one-machine way (no host folder)."""
    runs = tmp_path_factory.mktemp("evidence")
    overrides = ("engine=generate", "experiment=decode", "max_new_tokens=4", "repeats=1", "device=cpu", "sweep=r")
    assert run_cell(make_cfg(f"cache_dir={cache_dir}", f"evidence_dir={runs}", *overrides))["status"] == "ok"
    return next((runs / "r").glob("*.json"))


def as_host(src: Path, dst: Path, host: str, utc: str | None = None) -> Path:
    """A copy of ``src`` as host ``host`` would have written it (``utc``: another run of the same cell)."""
    record = json.loads(src.read_text())
    record["environment"]["host"] = host
    if utc:
        record["environment"]["utc_time"] = utc
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return dst


def test_files_from_two_hosts_merge_into_host_folders(cell_file, tmp_path):
    bucket = tmp_path / "bucket"
    a = as_host(cell_file, bucket / "vm-a" / "r" / cell_file.name, "vm-a")
    b = as_host(cell_file, bucket / "vm-b" / "r" / cell_file.name, "vm-b")
    done = collect(bucket, tmp_path / "runs")
    assert sorted(done.copied) == [a, b] and not done.conflicting
    assert (tmp_path / "runs" / "r" / "vm-a" / cell_file.name).read_bytes() == a.read_bytes()
    assert (tmp_path / "runs" / "r" / "vm-b" / cell_file.name).read_bytes() == b.read_bytes()


def test_identical_bytes_are_one_file(cell_file, tmp_path):
    bucket = tmp_path / "bucket"
    a = as_host(cell_file, bucket / "vm-a" / "r" / cell_file.name, "vm-a")
    shutil.copy(a, bucket / "copy-of-a.json")  # the same file reached twice (e.g. a local copy and the bucket)
    first = collect(bucket, tmp_path / "runs")
    assert len(first.copied) == 1 and len(first.identical) == 1
    again = collect(bucket, tmp_path / "runs")
    assert not again.copied and len(again.identical) == 2 and not again.conflicting
    assert len(list((tmp_path / "runs").rglob("*.json"))) == 1


def test_different_bytes_for_one_cell_are_both_kept_and_the_report_warns(cell_file, tmp_path):
    bucket = tmp_path / "bucket"
    first = as_host(cell_file, bucket / "one" / cell_file.name, "vm-a")
    rerun = as_host(cell_file, bucket / "two" / cell_file.name, "vm-a", utc="2030-01-01T00:00:00Z")
    as_host(cell_file, bucket / "three" / cell_file.name, "vm-b")
    done = collect(bucket, tmp_path / "runs")
    assert len(done.copied) == 2 and len(done.conflicting) == 1
    (src, kept), = done.conflicting  # fmt: skip
    assert src in (first, rerun) and kept.parent == tmp_path / "runs" / "r" / "vm-a" and kept.name != cell_file.name
    assert f"conflict: {src} kept as {kept}" in done.summary()
    assert collect(bucket, tmp_path / "runs").conflicting == []  # collecting again adds nothing

    ev = cells.load(tmp_path / "runs", REPO)
    assert len(ev.cells) == 3
    (warning,) = [w for w in ev.warnings if "different evidence files" in w]
    assert warning.startswith(f"sweep r: cell {cell_file.stem} has 3 different evidence files (hosts vm-a, vm-b)")
    report = render.build(tmp_path / "runs", REPO / "evidence" / "published", tmp_path / "R.md", tmp_path / "a.txt")
    text = report.report.read_text()
    assert "| r | 2 | vm-a, vm-b | 3 | 3 | 0 | 0 |" in text
    assert warning in text


def test_what_is_not_evidence_is_ignored_with_the_reason(cell_file, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    (bucket / "notes.json").write_text('{"a": 1}')
    (bucket / "broken.json").write_text("{ not json")
    record = json.loads(cell_file.read_text())
    record["sweep"] = "../escape"
    (bucket / "escape.json").write_text(json.dumps(record))
    done = collect(bucket, tmp_path / "runs")
    assert not done.copied and len(done.ignored) == 3
    assert any("notes.json: not an evidence file" in why for why in done.ignored)
    assert any("escape.json: sweep='../escape' is not a folder name" in why for why in done.ignored)
    assert not (tmp_path / "runs").exists()


def test_a_copy_under_the_evidence_folder_is_read_once(cell_file, tmp_path):
    runs = tmp_path / "runs"
    original = as_host(cell_file, runs / "r" / cell_file.name, "vm-a")
    (runs / "r" / "vm-a").mkdir()
    shutil.copy(original, runs / "r" / "vm-a" / cell_file.name)
    assert len(cells.load(runs, REPO).cells) == 1


def test_the_command_line_refuses_a_missing_folder(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_host_puts_evidence_in_a_folder_per_machine_and_resume_looks_in_all(cell_cfg, tiny, tmp_path):
    cell = ("engine=generate", "experiment=decode", "max_new_tokens=4", "repeats=1")
    record = run_cell(cell_cfg(*cell, "host=vm-a"))
    assert record["status"] == "ok"
    (path,) = (tmp_path / "runs" / "test" / "vm-a").glob("*.json")
    assert path.stem == record["cell"] and record["environment"]["host"]
    assert run_cell(cell_cfg(*cell, "host=vm-b", "resume=true")) is None  # vm-a already finished it
    assert run_cell(cell_cfg(*cell, "resume=true")) is None
    assert run_cell(cell_cfg(*cell, "host=../up"))["reason"].startswith("host='../up' is not a folder name")
