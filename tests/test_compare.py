"""`make compare A=... B=...` (``python -m reports.compare``): two synthetic sweeps row by row; it fails on a
planted regression and on nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from reports import compare
from tests.test_report import cell_record, write

ENGINES = ("generate", "static", "compiled", "ring")
BASE = {"generate": 10.0, "static": 20.0, "compiled": 40.0, "ring": 50.0}  # tok/s
JITTER = (-0.01, -0.004, 0.0, 0.003, 0.008, 0.012)  # six repeats within about 1% of the rate


def sweep(folder: Path, name: str, scale: dict[str, float], **fields) -> Path:
    """A sweep of every engine's decode cell at ``BASE x scale`` (six jittered samples) with its parity check."""
    records = []
    for engine in ENGINES:
        rate = BASE[engine] * scale.get(engine, 1.0)
        records += [
            cell_record(engine, experiment="parity", sweep=name, **fields),
            cell_record(engine, tuple(rate * (1 + j) for j in JITTER), sweep=name, **fields),
        ]
    write(folder, *records)
    return folder / name


def run(a: Path, b: Path, out: Path, *extra: str) -> int:
    return compare.main([str(a), str(b), "--out", str(out), "--parity-from", str(out.parent), *extra])


def test_the_planted_regression_is_found_and_nothing_else(tmp_path, capsys):
    a = sweep(tmp_path / "runs", "a", {})
    noise = {"generate": 1.03, "static": 0.97, "compiled": 1.02}  # a few % either way: below the 5% threshold
    b = sweep(tmp_path / "runs", "b", {**noise, "ring": 0.80}, torch="2.14.0", git_sha="b" * 40)
    out = tmp_path / "out" / "compare.md"
    assert run(a, b, out) == 1
    result = compare.compare(a, b, 0.05)
    assert list(result.regressions.engine) == ["ring"]
    ring = result.regressions.iloc[0]
    assert ring.ratio.value == pytest.approx(0.80) and ring.ratio.interval.high < 0.95
    changes = dict(zip(result.table.engine, result.table.change, strict=True))
    assert changes == {"generate": "within the 5% threshold", "static": "within the 5% threshold",
                       "compiled": "within the 5% threshold", "ring": "REGRESSION"}  # fmt: skip
    assert set(result.table.environment) == {f"git sha {'a' * 12} → {'b' * 12}; torch 2.13.0 → 2.14.0"}
    text = out.read_text()
    assert "| **REGRESSION** |" in text and "**1 regression**" in text and text in capsys.readouterr().out
    assert out.with_suffix(".png").is_file()


def test_two_copies_of_one_sweep_compare_clean(tmp_path):
    a = sweep(tmp_path / "runs", "a", {})
    b = sweep(tmp_path / "runs", "b", {})
    out = tmp_path / "out" / "compare.md"
    assert run(a, b, out) == 0
    assert "No regression." in out.read_text()
    assert set(compare.compare(a, b, 0.05).table.change) == {"no measurable difference"}


def test_a_slowdown_within_the_aa_noise_floor_is_not_a_regression(tmp_path):
    """B's ring is 7% slower (beyond the 5% threshold, its interval excluding 1), but A's own two copies of
    the ring cell differ by 8%: within the noise floor."""
    a = sweep(tmp_path / "runs", "a", {}, replica=0)
    copy = cell_record("ring", tuple(0.92 * BASE["ring"] * (1 + j) for j in JITTER), sweep="a", replica=1)
    write(tmp_path / "runs", copy)
    b = sweep(tmp_path / "runs", "b", {"ring": 0.93}, replica=0)
    out = tmp_path / "out" / "compare.md"
    assert run(a, b, out) == 0
    ring = compare.compare(a, b, 0.05).table.set_index(["engine", "replica"]).loc[("ring", 0)]
    assert ring.ratio.differs and ring.ratio.value < 0.95 and ring.change == "within the noise floor"


def test_an_invalid_side_is_shown_but_never_judged(tmp_path):
    a = sweep(tmp_path / "runs", "a", {})
    contended = {"contended": True, "other_cores": 1.5, "threshold_cores": 0.25}
    b = sweep(tmp_path / "runs", "b", {"ring": 0.5}, contention=contended)
    assert run(a, b, tmp_path / "out" / "compare.md") == 0
    table = compare.compare(a, b, 0.05).table.set_index("engine")
    assert table.loc["ring"].change == "not judged: B not VALID"
    assert table.loc["ring"].verdict_b.startswith("INVALID: contended: other processes kept 1.50 cores")


def test_a_sweep_name_is_looked_up_under_the_runs_folder(tmp_path):
    runs = tmp_path / "runs"
    sweep(runs, "a", {})
    assert compare.folder_of("a", runs) == runs / "a"
    with pytest.raises(ValueError, match="neither a folder nor a sweep"):
        compare.folder_of("nope", runs)
    assert compare.threshold_of("5%") == pytest.approx(0.05) and compare.threshold_of("0.1") == pytest.approx(0.1)
