"""experiment=profile: each class present per token, its bytes from the model's own buffers, the raw trace
beside the evidence."""

from __future__ import annotations

import gzip
import json

import pytest

from experiments.profile import CLASSES, WEIGHT_KINDS
from reports import render
from reports.tables.profile import profile_table
from runner import run_cell
from tests.conftest import REPO, opened


@pytest.mark.parametrize("engine", ["ring", "rust"])
def test_a_profile_names_every_class_with_the_bytes_it_reads(cell_cfg, tiny, cache_dir, tmp_path, engine):
    if engine == "rust":
        pytest.importorskip("decodebench_rs", reason="the rust engine is not built (make setup)")
    settings = ("engine.backend=eager",) if engine == "ring" else ()
    record = run_cell(cell_cfg(f"engine={engine}", *settings, "experiment=profile", "max_new_tokens=4", "repeats=2"))
    assert record["status"] == "ok", record["reason"]
    classes = {c["class"]: c for c in record["outputs"]["classes"]}
    assert list(classes) == list(CLASSES)
    step = record["measurements"]["step_ms"]["value"]
    assert sum(c["ms_per_token"] for c in classes.values()) == pytest.approx(step)

    model = opened(f"cache_dir={cache_dir}", f"engine={engine}").load().model  # the same checkpoint, reloaded
    for kind, ends in WEIGHT_KINDS.items():  # every linear of the kind, by name, its weight's bytes
        held = sum(m.weight.nbytes for n, m in model.named_modules() if n.rpartition(".")[2] in ends)
        assert classes[kind]["bytes_per_token"] == held, kind

    trace = tmp_path / "runs" / record["outputs"]["trace"]
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert not trace.is_relative_to(REPO / "evidence" / "published")

    table = profile_table({record["cell"]: record})  # the report's table: the classes add up to the step
    assert list(table["class"]) == list(CLASSES) and table.ms_per_token.sum() == pytest.approx(step)
    bandwidth = record["hardware"]["bandwidth_measurement"]["value"]
    mlp, measured = table.set_index("class").loc["weights: MLP"], classes["weights: MLP"]
    # the floor another way: the class's time scaled by the GB/s it reached over the machine's
    assert mlp.floor_ms == pytest.approx(measured["ms_per_token"] * measured["gb_s"] / bandwidth)
    out = render.build(tmp_path / "runs", REPO / "evidence" / "published", tmp_path / "r" / "R.md", tmp_path / "a.txt")
    text = out.report.read_text()
    assert "## Where each millisecond of a decode step goes" in text and "| weights: MLP |" in text
    assert (tmp_path / "r" / "profile.png").is_file() and "![where each millisecond goes](profile.png)" in text


def test_an_engine_that_does_not_step_is_skipped(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=generate", "experiment=profile"))
    assert record["status"] == "skipped" and "needs an engine that steps" in record["reason"]
