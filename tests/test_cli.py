"""Cells end to end: config errors, evidence files (ok, failed, skipped), schema, resume, sweeps."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch

import runner
from decodebench import evidence, hardware
from engines import cpu_kernels
from engines.generate import GenerateEngine
from experiments.cell import Cell
from runner import run_cell
from tests.conftest import REPO


def only_file(folder: Path) -> Path:
    files = sorted(folder.rglob("*.json"))
    assert len(files) == 1, files
    return files[0]


def test_ok_cell_writes_valid_evidence(cell_cfg, tiny, tmp_path):
    record = run_cell(cell_cfg("max_new_tokens=8", "repeats=2"))
    assert record["status"] == "ok", record["reason"]
    on_disk = evidence.read(only_file(tmp_path / "runs"))
    evidence.validate(on_disk)
    m = on_disk["measurements"]
    assert m["decode_tok_s"]["n"] == len(m["decode_tok_s"]["values"]) <= 2
    warm = zip(on_disk["samples"]["warm_1_s"], on_disk["samples"]["warm_n_s"], strict=True)
    rates = [7 / (t_n - t_1) for t_1, t_n in warm if t_n > t_1]  # N-1 = 7 over each pair's own two timings
    assert m["decode_tok_s"]["values"] == rates and m["decode_tok_s"]["median"] == sum(rates) / len(rates)
    assert m["memory_peak_rss"]["counter"] and m["memory_after_load"]["unit"] == "B"
    assert len(on_disk["outputs"]["generated_ids"]) == 8
    assert on_disk["model"]["synthetic"] is True and on_disk["model"]["kind"] == "synthetic"
    assert on_disk["environment"]["packages"]["torch"]
    assert on_disk["hardware"]["bandwidth_source"] == "measured"
    around = on_disk["hardware"]["bandwidth_at_cell"]  # the machine's read before and after the cell
    assert [len(around[when]["samples"]) for when in ("before", "after")] == [hardware.CELL_READS] * 2
    stream = [cpu_kernels.STREAM_READ] if cpu_kernels.built() else []  # the project's read, where its kernels run
    taken = [on_disk["hardware"]["bandwidth_measurement"]["reductions"], around["before"]["reductions"]]
    assert [list(reductions)[3:] for reductions in taken] == [stream] * 2
    assert not list((tmp_path / "runs").rglob("*.tmp"))


def test_a_cell_reads_the_bandwidth_before_its_engine_opens_and_after_its_experiment(cell_cfg, tiny, monkeypatch):
    events, opened = [], runner.open_engine

    def read_now(device, reads):
        events.append("read")
        return {"value": float(len(events)), "unit": "GB/s"}

    monkeypatch.setattr(hardware, "read_now", read_now)
    monkeypatch.setattr(runner, "open_engine", lambda *a, **k: events.append("open") or opened(*a, **k))
    record = run_cell(cell_cfg("max_new_tokens=4", "repeats=2"))
    assert record["status"] == "ok", record["reason"]
    assert events == ["read", "open", "read", "read", "read"]  # before, the engine, after each pair, after
    around = record["hardware"]["bandwidth_at_cell"]
    assert (around["before"]["value"], around["after"]["value"]) == (1.0, 5.0)
    at_pairs = record["measurements"]["bandwidth_at_pairs_gb_s"]  # one for each rate, in its order
    assert at_pairs["values"] == [3.0, 4.0] and len(record["measurements"]["decode_tok_s"]["values"]) == 2


def test_the_reads_between_pairs_stay_out_of_the_cells_memory_peak(cell_cfg, tiny, monkeypatch):
    """Each read after a pair holds a buffer of its own (here 1 GB, touched); the cell's peak is the engine's: the
    peak before each read is kept and a new window starts after it."""
    held = 1 << 30

    def read_now(device, reads):
        buffer = torch.ones(held // 4)  # every page touched, as a streaming read's buffer is
        return {"value": float(buffer.sum() > 0), "unit": "GB/s"}

    monkeypatch.setattr(hardware, "read_now", read_now)
    record = run_cell(cell_cfg("max_new_tokens=4", "repeats=2"))
    assert record["status"] == "ok", record["reason"]
    m = record["measurements"]
    assert m["bandwidth_at_pairs_gb_s"]["values"] == [1.0, 1.0]
    assert m["memory_peak_rss"]["value"] < m["memory_with_cache"]["value"] + held / 2


@pytest.mark.parametrize("broken", [{0}, {0, 1}])
def test_a_pair_that_breaks_the_method_takes_its_read_out_with_its_rate(cell_cfg, tiny, monkeypatch, broken):
    """The read after a pair that gave no rate (T_N not above T_1) is dropped with it: the reads stay one for each
    rate, and a cell where every pair broke has neither (and still writes its evidence)."""
    reads, original, calls = iter(range(1, 100)), Cell.timed_pair, []

    def inverted(self, ids, n=None):
        t1, gen, tn = original(self, ids, n)
        calls.append(1)
        return (tn + 1.0, gen, tn) if len(calls) - 1 in broken else (t1, gen, tn)

    monkeypatch.setattr(hardware, "read_now", lambda device, reads_: {"value": float(next(reads)), "unit": "GB/s"})
    monkeypatch.setattr(Cell, "timed_pair", inverted)
    record = run_cell(cell_cfg("max_new_tokens=4", "repeats=2"))
    assert record["status"] == "ok", record["reason"]
    m = record["measurements"]
    if broken == {0, 1}:
        assert "decode_tok_s" not in m and "bandwidth_at_pairs_gb_s" not in m
    else:  # reads: 1 before the cell, 2 after the broken pair, 3 after the kept one (unless noise broke it too)
        rates = m.get("decode_tok_s", {"values": []})["values"]
        assert len(rates) <= 1 and m.get("bandwidth_at_pairs_gb_s", {"values": []})["values"] == [3.0] * len(rates)


def test_context_too_small_names_both_numbers(cell_cfg, tiny):
    record = run_cell(cell_cfg("context=20", "max_new_tokens=8"))
    assert record["status"] == "failed"
    assert "context=20" in record["reason"] and "max_new_tokens=8" in record["reason"]
    assert re.search(r"the prompt is \d+ tokens", record["reason"])


def test_a_crash_writes_failure_evidence(cell_cfg, tiny, monkeypatch):
    def boom(self, *args, **kwargs):
        raise RuntimeError("simulated crash in the decode loop")

    monkeypatch.setattr(GenerateEngine, "generate", boom)
    record = run_cell(cell_cfg("max_new_tokens=4"))
    assert record["status"] == "failed" and "simulated crash" in record["reason"]
    assert "Traceback" in record["traceback"]
    evidence.validate(record)


def test_engine_that_cannot_run_here_is_skipped_with_reason(cell_cfg, tiny, monkeypatch):
    monkeypatch.setattr(GenerateEngine, "devices", ("tpu",))
    record = run_cell(cell_cfg())
    assert record["status"] == "skipped" and "runs on tpu" in record["reason"]


def test_resume_skips_ok_cells_and_reruns_failed(cell_cfg, tiny, tmp_path, monkeypatch):
    cfg = cell_cfg("max_new_tokens=4", "repeats=1", "resume=true")
    assert run_cell(cfg)["status"] == "ok"
    path = only_file(tmp_path / "runs")
    before = path.stat().st_mtime_ns
    assert run_cell(cfg) is None and path.stat().st_mtime_ns == before
    record = evidence.read(path)
    record["status"], record["reason"] = "failed", "earlier crash"
    evidence.write_atomic(path, record)
    assert run_cell(cfg)["status"] == "ok"


def test_schema_rejects_malformed_records(cell_cfg, tiny):
    record = run_cell(cell_cfg("max_new_tokens=4", "repeats=1"))
    for breakage in (
        lambda r: r.pop("status"),
        lambda r: r.update(status="great"),
        lambda r: r["measurements"].update(decode_tok_s={"median": 3.0}),
        lambda r: r.update(status="failed", reason=None),
    ):
        broken = copy.deepcopy(record)
        breakage(broken)
        with pytest.raises(jsonschema.ValidationError):
            evidence.validate(broken)


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_a_cell_interrupted_by_ctrl_c_writes_failed_evidence_then_stops(cell_cfg, tiny, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # what Python's own SIGINT handler raises, wherever the cell is

    monkeypatch.setattr(runner, "open_engine", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_cell(cell_cfg("max_new_tokens=4"))
    record = evidence.read(only_file(tmp_path / "runs"))
    evidence.validate(record)
    assert record["status"] == "failed" and record["reason"].startswith("stopped by SIGINT (Ctrl-C) while the cell ran")
    assert "in interrupted" in record["traceback"], "the traceback says where the cell was"


def test_sigterm_in_a_cell_reaches_the_handler_before_it_after_the_evidence(cell_cfg, tiny, tmp_path, monkeypatch):
    received = []

    def sent(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # as a scheduler's SIGTERM arrives, wherever the cell is

    monkeypatch.setattr(runner, "open_engine", sent)
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: received.append(signum))  # e.g. a launcher's
    try:
        with pytest.raises(runner.Stopped):
            run_cell(cell_cfg("max_new_tokens=4"))
        assert received == [signal.SIGTERM], "the handler the process had is handed the signal, once"
        record = evidence.read(only_file(tmp_path / "runs"))
        assert record["status"] == "failed" and record["reason"].startswith("stopped by SIGTERM while the cell ran")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with runner.stop_raises():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, "a process that ignores SIGTERM still does"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_cell_sent_sigterm_while_it_runs_writes_failed_evidence_then_ends_by_the_signal(cache_dir, tiny, tmp_path):
    pid_file, hook = tmp_path / "cell.pid", "+hydra.callbacks.stall"
    proc = subprocess.Popen(
        [sys.executable, "run.py", "model=tiny", "max_new_tokens=4", "repeats=1", "device=cpu", "sweep=stopped",
         f"cache_dir={cache_dir}", f"evidence_dir={tmp_path / 'runs'}",
         f"{hook}._target_=tests.sweep_hooks.StallInCell", f"{hook}.engine=generate", f"{hook}.pid_file={pid_file}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists(), proc.communicate()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err[-3000:])  # it ended by the signal, after writing
    record = evidence.read(only_file(tmp_path / "runs"))
    evidence.validate(record)
    assert record["status"] == "failed" and record["reason"].startswith("stopped by SIGTERM while the cell ran")
    assert "in stalled" in record["traceback"], "the traceback says where the cell was"
    assert "[failed] " in err and "stopped by" in err


def test_unknown_engine_lists_the_valid_ones():
    proc = _run("engine=nope")
    assert proc.returncode != 0
    assert "Available options in 'engine'" in proc.stderr and "generate" in proc.stderr


def test_multirun_goes_on_after_a_failing_cell(cache_dir, tiny, tmp_path):
    proc = _run(
        "-m",
        "context=10,256",
        "max_new_tokens=4",
        "repeats=1",
        "device=cpu",
        "sweep=s",
        f"cache_dir={cache_dir}",
        f"evidence_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    statuses = sorted(json.loads(p.read_text())["status"] for p in (tmp_path / "s").glob("*.json"))
    assert statuses == ["failed", "ok"]
    assert "1 failed, 1 ok" in proc.stdout


def test_single_failed_cell_exits_non_zero(cache_dir, tiny, tmp_path):
    proc = _run("context=10", "device=cpu", f"cache_dir={cache_dir}", f"evidence_dir={tmp_path}", "sweep=x")
    assert proc.returncode == 1
    assert "context=10 is too small" in proc.stderr
    assert len(list((tmp_path / "x").glob("*.json"))) == 1
