"""The article's why-tables: ``modes`` (no model), ``diagnose`` (Transformers' loading path), the compiled
step with compressed-tensors' wrappers on, and their report sections.

Compiles use the ``eager`` TorchDynamo backend (graph capture without code generation) and tiny sizes,
so the program and break counts are real while the tests stay fast.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import runner
from decodebench import evidence
from reports import article_tables, published, render
from runner import run_cell
from tests.conftest import REPO

PUBLISHED = REPO / "evidence" / "published"
HEADINGS = (
    "## Modes on a matrix-multiply stack",
    "### Shapes decide the compile count",
    "## Loading the repack through Transformers",
    "### The compiled step with the wrappers on",
)
SMALL_MODES = (
    "experiment=modes",
    "experiment.backend=eager",
    "experiment.gflop=0.001",
    "experiment.layers=2",
    "experiment.steps=2",
    "experiment.lengths=[3,5,9,20]",
    "experiment.bucket=16",
    "experiment.probe_width=16",
    "experiment.read_steps=2",
    "repeats=1",
)


@pytest.fixture(scope="module")
def cells(tmp_path_factory, cache_dir, tiny) -> dict[str, dict]:
    """One modes cell, one diagnose cell on tiny, and the compiled step with the wrappers on and off."""
    from tests.conftest import make_cfg

    runs = tmp_path_factory.mktemp("why")
    common = [f"cache_dir={cache_dir}", f"evidence_dir={runs}", "sweep=w", "device=cpu"]
    compiled = ["engine=compiled", "engine.backend=eager", "experiment=decode", "max_new_tokens=4", "repeats=1"]
    out = {
        "modes": run_cell(make_cfg(*common, *SMALL_MODES)),
        "diagnose": run_cell(make_cfg(*common, "experiment=diagnose")),
        "wrappers_on": run_cell(make_cfg(*common, *compiled, "engine.remove_wrappers=false")),
        "wrappers_off": run_cell(make_cfg(*common, *compiled)),
    }
    out["dir"] = runs
    return out


def ok(record: dict) -> dict:
    assert record["status"] == "ok", record["reason"]
    return record


def test_modes_cell_reads_no_model_and_writes_valid_evidence(cells):
    record = ok(cells["modes"])
    path = next(Path(cells["dir"]).rglob("modes-*.json"))
    evidence.validate(evidence.read(path))
    assert record["model"] == {"synthetic": False, "kind": "none"} and record["engine"] == {}
    assert path.name.startswith("modes-bfloat16-"), "no engine, model or context in the name of a model-free cell"
    modes = {m["mode"]: m for m in record["outputs"]["modes"]}
    assert modes["eager"]["status"] == modes["compile"]["status"] == "ok"
    assert modes["fuse"]["status"] == "skipped" and "needs a TPU" in modes["fuse"]["reason"]
    m = record["measurements"]
    assert m["modes_work_gflop"]["size"] == 128 and m["modes_work_gflop"]["layers"] == 2
    assert m["modes_eager_step_ms"]["n"] == 2 and m["modes_compile_tflop_s"]["value"] > 0
    assert m["modes_compile_checksum"]["value"] == pytest.approx(m["modes_eager_checksum"]["value"], rel=1e-2)


def test_modes_never_prepares_an_engine(cell_cfg, monkeypatch):
    def refuse(*args):
        raise AssertionError("modes must not look for a checkpoint")

    monkeypatch.setattr(runner, "open_engine", refuse)
    ok(run_cell(cell_cfg(*SMALL_MODES, "experiment.lengths=[3]", "model=e2b-synthetic")))


def test_bucketing_compiles_fewer_programs_than_raw_lengths(cells):
    record = ok(cells["modes"])
    probe = record["outputs"]["compile_count"]
    assert probe["raw"]["graphs"] == 4, "a program per distinct length"
    assert probe["bucketed"]["graphs"] == 2 < probe["raw"]["graphs"]
    assert probe["bucketed"]["lengths"] == [16, 16, 16, 32]
    assert record["measurements"]["compile_max_difference"]["value"] < 0.05  # the same rows, padding aside
    assert record["measurements"]["host_read_ratio"]["mode"] == "eager"


def header_count(folder: Path) -> int:
    """Tensors named in a checkpoint's safetensors headers, read by hand (8-byte length, then JSON)."""
    count = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            count += len(set(json.loads(f.read(length))) - {"__metadata__"})
    return count


def test_diagnose_claims_hold_on_tiny(cells, tiny):
    record = ok(cells["diagnose"])
    claims = {c["key"]: c for c in record["outputs"]["claims"]}
    m = {k: v.get("value") for k, v in record["measurements"].items()}
    assert m["tensors_stored"] == header_count(tiny.w4a16)  # counted another way than the experiment's safe_open
    assert claims["names"]["measured"] == [0, m["tensors_stored"]] and claims["names"]["holds"]
    assert m["packed_weights_after_load"] > 0 and m["packed_weights_after_forward_1"] == 0
    assert claims["packed_after_load"]["holds"] and claims["packed_after_forward_1"]["holds"]
    assert m["wrapped_modules"] > 0 and m["wrapped_modules_after_remove_dispatch"] == 0
    assert claims["wrapped"]["holds"] and claims["wrapped_after_remove_dispatch"]["holds"]
    assert claims["first_break"]["holds"], claims["first_break"]["measured"]
    assert claims["sliding_slots"]["measured"] == 128 and claims["full_slots"]["measured"] == 4352
    assert claims["device_map"]["holds"] and claims["to_device"]["holds"]  # a CPU has nowhere else to put them
    assert record["model"]["synthetic"] is True and record["model"]["key"].startswith("tiny-")


def test_compiled_with_the_wrappers_on_counts_graphs_and_breaks(cells):
    on, off = ok(cells["wrappers_on"]), ok(cells["wrappers_off"])
    assert on["engine"]["graphs"] > 1 and on["engine"]["graph_breaks"] > 0
    assert on["engine"]["wrapped_modules_at_end"] > 0
    assert off["engine"]["graphs"] == 1 and off["engine"]["graph_breaks"] == 0
    assert on["outputs"]["generated_ids"] == off["outputs"]["generated_ids"]
    # engine.one_row=auto leaves the article's Transformers path as it is, and decides the decodebench-loaded one by
    # measurement (its linears through mv or the packed rows where that read faster here)
    assert (on["engine"]["one_row"], on["engine"]["one_row_linears"], on["engine"]["one_row_choice"]) == (
        "linear", 0, None)  # fmt: skip
    assert on["engine"]["settings_without_effect"] == ["int4_limbs", "one_row"]  # evidence: neither names this way
    assert off["engine"]["settings_without_effect"] == ["int4_limbs"]
    chose = off["engine"]["one_row_choice"]
    assert chose["how"] != "set" and off["engine"]["one_row"] == chose["one_row"]
    assert (off["engine"]["one_row_linears"] > 0) == (chose["one_row"] != "linear")


def test_wrappers_on_cannot_keep_weights_4bit(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=table4", "engine.remove_wrappers=false", "experiment=decode"))
    assert record["status"] == "failed" and "remove_wrappers=false" in record["reason"]


@pytest.mark.parametrize("bad", ["experiment.lengths=[]", "experiment.bucket=0", "experiment.gflop=-1"])
def test_bad_modes_sizes_fail_with_the_value(cell_cfg, bad):
    record = run_cell(cell_cfg(*SMALL_MODES, bad))
    assert record["status"] == "failed" and bad.split("=")[0] in record["reason"]


def test_report_sets_each_table_beside_the_article(cells, tmp_path):
    out = render.build(Path(cells["dir"]), PUBLISHED, tmp_path / "REPORT.md", tmp_path / "arithmetic.txt")
    report = out.report.read_text()
    for heading in HEADINGS:
        assert heading in report
    assert "| raw: programs compiled | 4 | 4 |" in report and "| bucketed: programs compiled | 2 | 2 |" in report
    assert "| eager: step ms (median) | 2.91 |" in report
    stored = cells["diagnose"]["measurements"]["tensors_stored"]["value"]  # tiny's own count, beside the article's
    step3 = "| Step 3 | tensor names matched as stored / with the key mapping |"
    assert f"{step3} 0 / {stored} | 0 / {stored} | yes | 0 / 540 |" in report
    assert "6.4 to 6.6 tok/s, 24 / 60" in report and "### tiny on cpu:" in report


def test_every_article_figure_the_tables_cite_exists():
    printed = article_tables.Printed(published.load(PUBLISHED))
    ids = [i for row in article_tables.modes_rows() + article_tables.compile_rows() for i in row.published]
    ids += [i for _, figure_ids in article_tables.CLAIM_FIGURES.values() for i in figure_ids]
    ids += [i for _, i in article_tables.MEMORY.values() if i]
    assert all(printed.one(i) for i in ids)
