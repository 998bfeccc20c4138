"""Figures a reader can decide with: intervals, the cell's own method checks, contention, provenance."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decodebench import environment, pages
from decodebench.device import resolve_device
from decodebench.evidence import Samples
from decodebench.stats import differs, median_interval, ratio_interval
from experiments.cell import Cell
from runner import run_cell
from tests.conftest import REPO

CHEAP = ("engine=generate", "experiment=decode", "max_new_tokens=3")


def test_a_two_sample_median_interval_is_the_two_samples():
    """Percentile bootstrap by hand: resampling {10, 12} twice gives medians 10, 11 or 12 with chances
    1/4, 1/2, 1/4, so the 2.5th and 97.5th percentiles are 10 and 12."""
    got = median_interval([12.0, 10.0])
    assert (got.value, got.low, got.high, got.n) == (11.0, 10.0, 12.0, 2)
    assert median_interval([7.0]).low is None, "one sample has no interval"
    assert Samples([12.0, 10.0], "tok/s").to_json()["ci95"] == [10.0, 12.0]


def test_a_ratio_interval_holds_what_a_ratio_can_be():
    """Each side's resampled median lies within its own samples, so the ratio's interval lies within
    min(top)/max(bottom) and max(top)/min(bottom); a clear doubling excludes 1, identical sides do not."""
    top, bottom = [20.0, 21.0, 22.0, 23.0, 24.0], [10.0, 10.5, 11.0, 11.5, 12.0]
    got = ratio_interval(top, bottom)
    assert got.value == pytest.approx(22.0 / 11.0)
    assert 20.0 / 12.0 <= got.low <= got.value <= got.high <= 24.0 / 10.0
    assert differs(got)
    same = ratio_interval(top, list(reversed(top)))
    assert not differs(same) and same.contains(1.0)
    with pytest.raises(ValueError, match="paired"):
        ratio_interval([1.0, 2.0], [1.0], paired=True)


def test_a_pair_whose_n_token_call_is_not_slower_gives_no_rate_and_is_named(cell_cfg, tiny, monkeypatch):
    original = Cell.timed_pair
    calls = []

    def second_pair_inverted(self, ids, n=None):
        t1, gen, tn = original(self, ids, n)
        calls.append(1)
        return (tn + 1.0, gen, tn) if len(calls) == 2 else (t1, gen, tn)  # T_1 a second above T_N

    monkeypatch.setattr(Cell, "timed_pair", second_pair_inverted)
    record = run_cell(cell_cfg(*CHEAP, "repeats=3"))
    assert record["status"] == "ok", record["reason"]
    checks = {c["rule"]: c for c in record["outputs"]["checks"]}
    broken = checks["T_N > T_1 in every pair (N=3)"]
    warm_1, warm_n = record["samples"]["warm_1_s"], record["samples"]["warm_n_s"]
    kept = [i for i in range(3) if warm_n[i] > warm_1[i]]  # a noisy machine may break another pair on its own
    assert 1 not in kept and not broken["holds"]
    assert broken["detail"].split("; ") == [
        f"T_1 = {warm_1[i]:.6f} s, T_N = {warm_n[i]:.6f} s" for i in range(3) if i not in kept
    ]
    rates = record["measurements"]["decode_tok_s"]["values"]
    assert rates == [2 / (warm_n[i] - warm_1[i]) for i in kept], "a broken pair is left out, never negative"
    assert checks["exactly N tokens in every call"]["holds"]


def test_a_cell_run_while_another_process_burns_a_core_is_contended(cell_cfg, tiny):
    burn = "import time\nend = time.time() + 120\nwhile time.time() < end: pass"  # bounded: two minutes at most
    burner = subprocess.Popen([sys.executable, "-c", burn])
    try:
        time.sleep(0.5)
        record = run_cell(cell_cfg(*CHEAP, "repeats=2"))
    finally:
        burner.kill()
        burner.wait()
    contention = record["environment"]["contention"]
    assert record["status"] == "ok", record["reason"]
    assert contention["contended"] is True and contention["other_cores"] > 0.5
    assert contention["other_cpu_s"] == pytest.approx(contention["other_cores"] * contention["wall_s"])


def test_evidence_says_enough_to_rerun_the_cell(cell_cfg, tiny, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    record = run_cell(cell_cfg(*CHEAP, "repeats=1", "replica=1"))
    env = record["environment"]
    assert env["speed_variables"]["OMP_NUM_THREADS"] == "2"
    held = env["memory_pages"]  # what run.py asks for, before torch is imported; the tests' conftest asks the same
    assert env["speed_variables"][pages.VARIABLE] == held["torch_allocator"] == pages.ON
    assert held["system"] == pages.system_mode()
    assert env["threads"]["torch_threads"] >= 1 and env["threads"]["cpu_count"] >= env["threads"]["usable_cores"]
    flags = Path("/proc/cpuinfo").read_text()
    assert ("avx2" in env["cpu_flags"]) == (" avx2" in flags)
    for package in ("numpy", "tokenizers", "safetensors", "compressed-tensors"):
        assert env["packages"][package], package
    assert env["git_dirty"] is not None and (env["git_diff_sha256_16"] is None) == (not env["git_dirty"])
    cpu = resolve_device("cpu")
    assert environment.capture(cpu)["fingerprint"] == env["fingerprint"], "the same machine, the same class"
    monkeypatch.setattr(environment, "cpu_flags", lambda: ["avx2"])
    assert environment.capture(cpu)["fingerprint"] != env["fingerprint"], "another CPU class, another fingerprint"
    assert record["config"]["replica"] == 1
    if env["stack"]["name"]:  # set up by `make setup`: the lock it installed from, by its bytes
        lock = (REPO / env["stack"]["lock"]).read_bytes()
        assert env["stack"]["lock_sha256_16"] == hashlib.sha256(lock).hexdigest()[:16]


def test_the_huge_pages_recorded_are_read_with_the_engine_loaded(cell_cfg, tiny, monkeypatch):
    """``anon_huge_kib`` is the last reading, taken after the experiment and before the engine is closed."""
    reads: list[int] = []
    monkeypatch.setattr(pages, "huge_kib", lambda: reads.append(len(reads) + 1) or len(reads))
    record = run_cell(cell_cfg(*CHEAP, "repeats=1"))
    assert record["status"] == "ok", record["reason"]
    assert record["environment"]["memory_pages"]["anon_huge_kib"] == len(reads) >= 2


def test_a_cells_code_is_what_its_process_imported_not_what_the_tree_holds_later(monkeypatch):
    at_import = environment.CODE
    assert at_import["git_sha"] and len(at_import["git_sha"]) == 40
    # the tree changes after the process imported the project (a commit, an edit): its cells still ran that code
    monkeypatch.setattr(environment, "_git", lambda *args: pytest.fail(f"git {' '.join(args)} read at cell time"))
    env = environment.capture(resolve_device("cpu"))
    assert {k: env[k] for k in at_import} == at_import


def test_an_aa_copy_is_a_cell_of_its_own(cell_cfg, tiny):
    first = run_cell(cell_cfg(*CHEAP, "repeats=1", "replica=0"))
    second = run_cell(cell_cfg(*CHEAP, "repeats=1", "replica=1"))
    assert first["cell"] != second["cell"] and first["config_hash"] != second["config_hash"]
    bad = run_cell(cell_cfg(*CHEAP, "replica=-1"))
    assert bad["status"] == "failed" and "replica=-1 must be at least 0" in bad["reason"]


def test_torch_and_jax_cells_on_one_cpu_are_one_environment_class():
    pytest.importorskip("jax")
    torch_cpu, jax_cpu = resolve_device("cpu"), resolve_device("cpu", "jax")
    assert torch_cpu.name != jax_cpu.name, "the frameworks label the same CPU differently"
    assert environment.capture(torch_cpu)["fingerprint"] == environment.capture(jax_cpu)["fingerprint"]
