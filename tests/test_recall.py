"""Recall prompts are stable and exact in size; the experiment records answers and clear skips."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from experiments import recall_prompts
from experiments.recall import parse_code
from reports import render
from runner import run_cell
from tests.conftest import REPO


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(str(tiny.w4a16))


@pytest.mark.parametrize("target", [64, 4096])
def test_prompts_are_deterministic_and_fill_the_target(tokenizer, target):
    a = recall_prompts.build(tokenizer, target, seed=0)
    b = recall_prompts.build(tokenizer, target, seed=0)
    assert a == b and a.prompt_sha256 == b.prompt_sha256
    assert a.prompt_tokens <= target < recall_prompts.build(tokenizer, target + 200, seed=0).prompt_tokens + 200
    assert a.asked_record == max(1, a.records // 4)
    assert a.true_code == recall_prompts.codes(0, a.records)[a.asked_record - 1]
    assert recall_prompts.build(tokenizer, target, seed=1).prompt_sha256 != a.prompt_sha256
    assert f"Record {a.asked_record:04d}: code {a.true_code}." in tokenizer.decode(list(a.ids))


def test_parse_code():
    assert parse_code("The code is 583091.") == "583091"
    assert parse_code("1234567 then 012345") == "012345"
    assert parse_code("no digits") is None


def test_ring_records_every_prompt_that_fits_and_compiled_skips_past_its_window(cell_cfg, tiny, tmp_path):
    ring = run_cell(
        cell_cfg(
            "engine=ring",
            "engine.backend=eager",
            "engine.attend=exact",
            "experiment=recall",
            "context=4352",
            "max_new_tokens=8",
            "engine.piece=256",
        )
    )
    assert ring["status"] == "ok", ring["reason"]
    by_target = {o["target_tokens"]: o for o in ring["outputs"]["recall"]}
    assert by_target[64]["status"] == by_target[4096]["status"] == "ok"
    assert by_target[4096]["prompt_tokens"] > 4000 and by_target[4096]["read_tok_s"] > 0
    assert "does not fit context=4352" in by_target[32768]["reason"]
    assert {"answer_code", "found", "true_code", "prompt_sha256", "generator_version"} <= set(by_target[64])
    # the first call (on the 64-token prompt) compiled one piece and one step for 256 slots; the long prompt's timed
    # call met larger slot counts first (attend=exact: the program made dynamic in them at the second) and compiled
    # every other program the cell holds
    assert ring["engine"]["graph_breaks"] == 0 and by_target[64]["programs_compiled"] == 0
    assert by_target[4096]["programs_compiled"] == ring["engine"]["graphs"] - 2 > 0
    assert len(ring["engine"]["buckets"]) > 2
    compiled = run_cell(
        cell_cfg("engine=compiled", "engine.backend=eager", "experiment=recall", "context=4352", "max_new_tokens=8")
    )
    long = {o["target_tokens"]: o for o in compiled["outputs"]["recall"]}[4096]
    assert long["status"] == "skipped" and "sliding_window=128" in long["reason"]
    out = render.build(tmp_path / "runs", REPO / "evidence" / "published", tmp_path / "R.md", tmp_path / "a.txt")
    rows = [line for line in out.report.read_text().splitlines() if line.startswith("| ring | tiny | cpu | 4352 |")]
    compiled_column = "| engine | model | device | context | prompt tokens | read s | read tok/s | compiled |"
    assert compiled_column in out.report.read_text() and len(rows) == 2
    assert [row.split(" | ")[7] for row in rows] == ["0", str(by_target[4096]["programs_compiled"])]


def test_context_above_the_model_is_a_clear_error(cell_cfg, tiny):
    record = run_cell(cell_cfg("context=200000"))
    assert record["status"] == "failed" and "max_position_embeddings=131072" in record["reason"]
