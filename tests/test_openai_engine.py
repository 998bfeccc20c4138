"""engine=openai: an OpenAI-compatible endpoint measured as an engine, here the project's own server (a tiny
ring, started by the test), by the same experiments as the in-process engines."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from decodebench.environment import Contention
from engines.openai_engine import OpenAIEngine, OpenAIEngineConfig
from experiments.parity import compare_top
from runner import run_cell
from tests.conftest import check_streaming, held_pairs, opened
from tests.test_serve import serving_engine

SECRET = "sk-decodebench-test-secret"


@pytest.fixture(scope="module")
def endpoint(cache_dir, tiny):
    with serving_engine(cache_dir, "ring", "engine.backend=none") as state:
        yield state


def test_a_decode_cell_through_the_endpoint_writes_the_engines_own_tokens(cell_cfg, endpoint, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_TEST_KEY", SECRET)
    url = f"{endpoint['url']}/v1"
    common = ("experiment=decode", "max_new_tokens=8", "repeats=2")
    key = "engine.api_key_env=DECODEBENCH_TEST_KEY"
    record = run_cell(cell_cfg("engine=openai", f"engine.url={url}", key, *common))
    assert record["status"] == "ok", record["reason"]
    bare = run_cell(cell_cfg("engine=ring", "engine.backend=none", *common))  # the served engine, in process
    assert record["outputs"]["generated_ids"] == bare["outputs"]["generated_ids"]
    timed = record["samples"]
    assert len(timed["warm_1_s"]) == 2, "repeats=2: two pairs timed"
    rates = record["measurements"].get("decode_tok_s", {"n": 0})  # no rate when both pairs broke T_N > T_1
    assert rates["n"] == held_pairs(timed["warm_1_s"], timed["warm_n_s"])
    engine = record["engine"]
    assert engine["model_id"] == endpoint["served"].model_id and engine["models"][0]["id"] == engine["model_id"]
    assert engine["version"]["path"] == "/v1/engine" and engine["version"]["answer"]["engine"] == "ring"
    assert engine["api_key_env"] == "DECODEBENCH_TEST_KEY" and SECRET not in json.dumps(record)


def test_streamed_calls_hand_over_each_chunks_ids_and_stop_when_told(cache_dir, endpoint):
    engine = opened(f"cache_dir={cache_dir}", f"engine.url={endpoint['url']}/v1", "engine=openai").load()
    check_streaming(engine, [2, 10, 11, 12])
    with pytest.raises(RuntimeError, match="returned text without token_ids"):  # a server without vLLM's field
        engine._ids(SimpleNamespace(model_extra={}, text="the tide"))


def test_parity_reads_the_endpoints_top_logprobs_by_id_and_a_silent_url_fails(cell_cfg, endpoint):
    url = f"{endpoint['url']}/v1"
    parity = run_cell(
        cell_cfg("engine=openai", f"engine.url={url}", "experiment=parity-bf16", "max_new_tokens=6", "context=256")
    )
    assert parity["status"] == "ok", parity["reason"]
    out = parity["outputs"]["prompt"]
    assert out["topk"] == 5 and out["engine_ids"] == out["reference_ids"] and out["first_difference"] is None
    assert out["top1_same"] == 6 and parity["measurements"]["parity_topk_kl_max"]["value"] < 1e-3
    assert (
        parity["outputs"]["verdict"] == "pass"
        and "top-5" in parity["measurements"]["parity_topk_kl_mean"]["definition"]
    )
    nobody = run_cell(cell_cfg("engine=openai", "engine.url=http://127.0.0.1:9/v1", "experiment=decode"))
    assert nobody["status"] == "failed"  # the user named this endpoint: nothing there is a failure, not a skip
    assert nobody["reason"].startswith("engine.url=http://127.0.0.1:9/v1: no OpenAI-compatible endpoint answers")


def test_an_endpoint_on_this_machine_works_on_the_cells_cpu_not_as_contention():
    """The processes listening on a loopback endpoint's port count as the cell's own CPU: a listener that burns
    a core is contention to a plain cell and the cell's own work to one measuring that endpoint."""
    listen_and_burn = ("import socket, time\nsock = socket.socket()\nsock.bind(('127.0.0.1', 0))\nsock.listen()\n"
                       "print(sock.getsockname()[1], flush=True)\nend = time.time() + 60\n"
                       "while time.time() < end: pass")  # fmt: skip
    burner = subprocess.Popen([sys.executable, "-c", listen_and_burn], stdout=subprocess.PIPE, text=True)
    try:
        port = int(burner.stdout.readline())

        def endpoint(host: str) -> OpenAIEngineConfig:
            return OpenAIEngineConfig(name="openai", url=f"http://{host}:{port}/v1")

        pids = OpenAIEngine.local_processes(endpoint("127.0.0.1"))
        assert pids == [burner.pid] and OpenAIEngine.local_processes(endpoint("example.com")) == []
        mine, plain = Contention(own_processes=pids), Contention()
        time.sleep(2.0)
        measured, other = mine.measure(), plain.measure()
    finally:
        burner.kill()
        burner.wait()
    (counted,) = measured["own_processes"]
    assert counted["pid"] == burner.pid and counted["cpu_s"] > 0.5
    assert measured["other_cpu_s"] < other["other_cpu_s"] - 0.5 * counted["cpu_s"]


@pytest.mark.slow
def test_a_load_on_an_endpoint_is_driven_where_it_is_served(cell_cfg, endpoint, monkeypatch):
    url = f"{endpoint['url']}/v1"
    load = ("experiment=load", "experiment.concurrency=[2]", "experiment.requests=3", "experiment.warmup_requests=1",
            "experiment.prompt_tokens=24", "max_new_tokens=8", "repeats=2")  # fmt: skip
    record = run_cell(cell_cfg("engine=openai", f"engine.url={url}", *load))
    assert record["status"] == "ok", record["reason"]
    (level,) = record["outputs"]["levels"]
    assert f"--url {endpoint['url']} " in level["command"], "AIPerf drives the endpoint itself, not a new server"
    assert level["requests"] == level["server"]["requests"] == 3, "the endpoint is decodebench's: its own counts"
    assert record["outputs"]["engine_info"]["url"] == url
    monkeypatch.setenv("DECODEBENCH_TEST_KEY", SECRET)
    keyed = run_cell(cell_cfg("engine=openai", f"engine.url={url}", "engine.api_key_env=DECODEBENCH_TEST_KEY", *load))
    assert keyed["status"] == "failed" and "not handed an API key" in keyed["reason"]


def test_a_top_k_kl_renormalizes_both_sides_over_the_engines_ids():
    """By hand: the reference gives ids 0 and 1 probabilities 0.4 and 0.2 (2/3 and 1/3 over the two), the
    engine 0.3 and 0.3 (1/2 each): KL = 2/3 ln(4/3) + 1/3 ln(2/3) = 0.0566 nats; the same top-1 (id 0)."""
    reference = torch.log(torch.tensor([[0.4, 0.2, 0.3, 0.1]]))
    bounds = SimpleNamespace(all_tokens=True, kl_mean=1e-3, kl_max=1e-3)
    got = compare_top([0], reference, [0], [{0: math.log(0.3), 1: math.log(0.3)}], bounds)
    assert got["topk_kl_max"] == pytest.approx(2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3))
    assert got["verdict"] == "fail" and got["top1_same"] == 1 and got["first_difference"] is None
    same = compare_top([0], reference, [0], [{0: math.log(0.4), 1: math.log(0.2)}], bounds)
    assert same["topk_kl_max"] == pytest.approx(0.0, abs=1e-12) and same["verdict"] == "pass"


@pytest.mark.slow
def test_recall_and_serve_cells_run_through_the_endpoint(cell_cfg, endpoint):
    url = f"{endpoint['url']}/v1"
    recall = run_cell(cell_cfg("engine=openai", f"engine.url={url}", "experiment=recall", "max_new_tokens=8",
                               "context=256"))  # fmt: skip
    assert recall["status"] == "ok", recall["reason"]
    (ran,) = [r for r in recall["outputs"]["recall"] if r["status"] == "ok"]
    assert ran["prompt_tokens"] <= 256 - 8
    assert ran["method"].startswith("generate(1) for read_s"), "an endpoint's call does not split its phases"
    assert recall["measurements"][f"recall_{ran['target_tokens']}_read_tok_s"]["n"] == ran["repeats"]
    serve = run_cell(cell_cfg("engine=openai", f"engine.url={url}", "experiment=serve", "max_new_tokens=12",
                              "context=256", "experiment.requests=2", "experiment.prompts=[Describe a lighthouse.]",
                              "experiment.cancel_after=3", "experiment.screenshot=false"))  # fmt: skip
    assert serve["status"] == "ok", serve["reason"]
    assert serve["measurements"]["served_tokens"]["values"] == [12, 12]
    assert serve["outputs"]["cancel"]["counter_after"] == serve["outputs"]["cancel"]["counter_before"] + 1
