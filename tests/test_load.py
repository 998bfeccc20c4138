"""experiment=load: AIPerf at several load levels against the cell's engine behind decodebench's server."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from decodebench.config import ConfigError
from decodebench.device import resolve_device
from experiments.cell import Cell, MethodError
from experiments.load import LoadExperimentConfig, fresh_prompts_check, held_to_method, level_texts, text_prompts
from reports.tables.load import load_table
from runner import run_cell, typed_config
from serving import aiperf
from tests.conftest import make_cfg, opened


@pytest.mark.slow
def test_ttft_at_concurrency_4_exceeds_ttft_at_1_by_the_queueing_the_server_reports(cell_cfg, tiny, tmp_path,
                                                                                   monkeypatch, request):  # fmt: skip
    # the system's temporary folder for this test (short: AIPerf's sockets live there): AIPerf leaves nothing
    scratch = Path(tempfile.mkdtemp(prefix="db-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    record = run_cell(cell_cfg("engine=generate", "experiment=load", "experiment.concurrency=[1,4]",
                               "experiment.requests=8", "experiment.prompt_tokens=24", "max_new_tokens=8"))  # fmt: skip
    assert record["status"] == "ok", record["reason"]
    one, four = record["outputs"]["levels"]
    assert (one["level"], four["level"]) == ("c1", "c4")
    for level in (one, four):
        assert level["requests"] == level["server"]["requests"] == 8 and level["errors"] == 0
        assert level["output_tokens"] == {"min": 8, "max": 8}
        assert level["ttft_s"]["p50"] <= level["ttft_s"]["p90"] <= level["ttft_s"]["p99"] <= level["ttft_s"]["max"]
    queue_one, queue_four = (level["server"]["queue_s"]["sum"] / 8 for level in (one, four))
    assert four["ttft_s"]["avg"] > one["ttft_s"]["avg"]
    # one engine, one request at a time: with 4 in flight a request waits for the others, and that wait,
    # as the server's /metrics counts it, is what its first token costs beyond the same request alone
    assert four["ttft_s"]["avg"] - one["ttft_s"]["avg"] == pytest.approx(queue_four - queue_one, rel=0.25, abs=0.05)
    assert queue_four > 4 * queue_one
    table = load_table({"cell.json": record})
    assert list(table.level) == ["c1", "c4"] and list(table.queue_mean) == [queue_one, queue_four]
    (evidence,) = (tmp_path / "runs" / "test").glob("*.json")  # AIPerf's exports beside it, named by it
    kept = tmp_path / "runs" / record["outputs"]["exports"]
    assert kept.name == evidence.name.removesuffix(".json") + ".aiperf"
    assert all((kept / level / aiperf.CLIENT_EXPORT).is_file() for level in ("c1", "c4"))
    assert not list(scratch.iterdir()), "AIPerf's temporary files go with the level's own folder"
    placement = record["outputs"]["placement"]  # experiment.generator_cpus=auto
    assert set(placement["server_cpus"]) | set(placement["generator_cpus"] or ()) == os.sched_getaffinity(0)
    if len(os.sched_getaffinity(0)) > 1:  # AIPerf on a core of its own, the server on the rest
        assert placement["generator_cpus"] and not set(placement["generator_cpus"]) & set(placement["server_cpus"])
        assert "shared" not in set(table.generator)
    if os.sched_getaffinity(0) == {0, 1}:  # two single-thread cores, as CI's: the last one is AIPerf's
        assert placement == {**placement, "generator_cpus": [1], "server_cpus": [0]}
        assert set(table.generator) == {"CPU 1 (server 0)"}


def figures(requests: int = 8, tokens: tuple[int, int] = (8, 8), counted: int = 8) -> dict:
    return {"requests": requests, "errors": 0, "output_tokens": {"min": tokens[0], "max": tokens[1]},
            "server": {"queue_s": {"count": counted, "sum": 1.0}}}  # fmt: skip


def test_a_level_is_held_to_exactly_n_tokens_and_to_the_requests_the_server_counted():
    held_to_method("c1", figures(), 8)
    with pytest.raises(MethodError, match="got 7-8 tokens each, not exactly 8"):
        held_to_method("c1", figures(tokens=(7, 8)), 8)
    with pytest.raises(MethodError, match="counted 9 requests .* AIPerf completed 8"):
        held_to_method("c4", figures(counted=9), 8)
    with pytest.raises(MethodError, match="completed no request"):
        held_to_method("r2", figures(requests=0, counted=0), 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"concurrency": [], "rate": []}, "no load level"),
        ({"concurrency": [0]}, "at least 1 request in flight"),
        ({"rate": [-1.0]}, "positive request rate"),
        ({"prompts": "prompts.txt"}, "a path to a .jsonl file"),
        ({"requests": 0}, "experiment.requests=0"),
        ({"prompts": "prompts.jsonl", "prompt_tokens": 32}, "has no effect on the prompts of prompts.jsonl"),
    ],
)
def test_load_settings_that_cannot_run_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        LoadExperimentConfig(name="load", **overrides)


def cell_for(*overrides: str) -> Cell:
    run = typed_config(make_cfg("device=cpu", *overrides))
    return Cell(run, resolve_device("cpu", "torch"), opened("engine=generate", *overrides))


def test_recall_and_jsonl_prompts_are_held_to_the_fit_rule(tiny, cache_dir, tmp_path):
    base = (f"cache_dir={cache_dir}", "engine=generate", "experiment=load", "max_new_tokens=8")
    recall = text_prompts(cell_for(*base, "experiment.prompts=recall", "experiment.prompt_tokens=120"), 3)
    assert len(set(recall)) == 3, "a new seed per request"
    lines = tmp_path / "prompts.jsonl"
    lines.write_text(json.dumps({"text": "Name three uses of a ring buffer."}) + "\n")
    assert text_prompts(cell_for(*base, f"experiment.prompts={lines}"), 5) == ["Name three uses of a ring buffer."]
    lines.write_text(json.dumps({"text": "word " * 400}) + "\n")
    with pytest.raises(ConfigError, match="context"):
        text_prompts(cell_for(*base, f"experiment.prompts={lines}"), 5)
    lines.write_text(json.dumps({"prompt": "no text field"}) + "\n")
    with pytest.raises(ConfigError, match="text field"):
        text_prompts(cell_for(*base, f"experiment.prompts={lines}"), 5)


def test_each_level_sends_prompts_of_its_own():
    """The recall prompts: the warm-up's and each level's their own share; a JSONL file's lines at every level."""
    exp = LoadExperimentConfig(name="load", prompts="recall", concurrency=[1, 4], requests=3, warmup_requests=2)
    texts = [f"prompt {i}" for i in range(2 + 3 * 2)]
    shares = [level_texts(texts, exp, index) for index in (-1, 0, 1)]
    assert shares == [texts[:2], texts[2:5], texts[5:8]]
    lines = LoadExperimentConfig(name="load", prompts="mine.jsonl")
    assert level_texts(["a", "b"], lines, 1) == ["a", "b"] and level_texts(None, exp, 0) is None


def test_a_level_whose_prompts_came_from_the_servers_cache_breaks_the_check():
    levels = [{"level": "c1", "prompt_cache_read_tokens": 0.0}, {"level": "c2", "prompt_cache_read_tokens": None}]
    assert fresh_prompts_check(levels)["holds"] is True
    levels.append({"level": "c4", "prompt_cache_read_tokens": 480.0})  # llama.cpp's c4 with c1's prompts again
    check = fresh_prompts_check(levels)
    assert check["holds"] is False and check["detail"] == "taken from the cache: c4: 480 tokens"
    row = load_table({"cell.json": level_record(480.0)}).iloc[0]
    assert row.prompt_cached == 60.0, "tokens a request took from the cache, on average"


def level_record(cached: float | None) -> dict:
    """A load cell of one c4 level of 8 requests whose server took ``cached`` prompt tokens from its cache."""
    latency = {"avg": 0.5, "p50": 0.5, "p90": 0.6, "p99": 0.7}
    level = {"level": "c4", "mode": "concurrency", "value": 4, "requests": 8, "errors": 0, "prompt_tokens": 65.0,
             "prompt_cache_read_tokens": cached, "output_tokens": {"min": 16, "max": 16}, "request_rate_req_s": 1.0,
             "output_tok_s": 16.0, "ttft_s": latency, "tpot_s": latency, "itl_s": latency, "e2el_s": latency,
             "server": None, "ttft_less_queue_s": None, "goodput_req_s": 1.0, "good_requests": 8}  # fmt: skip
    return {"status": "ok", "config": {"experiment": {"name": "load"}, "engine": {"name": "llamacpp", "quant": "q4_0"},
                                       "model": {"name": "tiny"}},
            "model": {"synthetic": True}, "environment": {"device_kind": "cpu"},
            "outputs": {"levels": [level], "placement": None, "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
                        "exports": "x"}}  # fmt: skip
