"""Continuous batching in the server (issue 44, item 3): with ``serve.max_batch=4`` over the tiny ring, requests
sent together decode together (the batch's rows fill), each writes the tokens it writes alone (one request at a
time, ``serve.max_batch=1``), a client that leaves ends its own row only, and an engine that cannot batch is
refused by name."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from decodebench.config import ConfigError
from serving.worker import BatchWorker, Metrics, make_worker
from tests.test_serve import MODEL, metrics, serving_engine, wait_until

ROWS = 4
TOKENS = 24


def prompt(i: int) -> list[int]:
    """Prompt ``i`` as token ids, each its own length (BOS first)."""
    return [2] + [(11 * k + 5 * i) % 300 + 20 for k in range(4 + 7 * i)]


def complete(url: str, ids: list[int], stream: bool = False) -> list[int]:
    """The token ids of one completion of exactly ``TOKENS`` tokens."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": TOKENS, "ignore_eos": True, "return_token_ids": True}
    if not stream:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        return reply["choices"][0]["token_ids"]
    ids_seen: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                ids_seen += chunk["choices"][0].get("token_ids") or [] if chunk["choices"] else []
    return ids_seen


@pytest.fixture(scope="module")
def servers(cache_dir, tiny):
    """Two tiny rings in float32 (greedy ties are then out of reach of a product's summation order): one request at a
    time, and up to ``ROWS`` together."""
    settings = ("engine.backend=none", "dtype=float32")
    with (serving_engine(cache_dir, "ring", *settings) as alone,
          serving_engine(cache_dir, "ring", *settings, max_batch=ROWS) as batched):  # fmt: skip
        yield alone, batched


def test_requests_sent_together_decode_together_each_as_it_would_alone(servers):
    alone, batched = servers
    assert isinstance(batched["worker"], BatchWorker)
    expected = [complete(alone["url"], prompt(i)) for i in range(ROWS + 2)]  # one at a time
    assert all(len(e) == TOKENS for e in expected)
    with ThreadPoolExecutor(ROWS + 2) as pool:  # more requests than rows: two wait for a row to free
        got = list(pool.map(lambda i: complete(batched["url"], prompt(i), stream=i % 2 == 0), range(ROWS + 2)))
    assert got == expected
    assert batched["worker"].peak_rows > 1  # they did decode together
    assert metrics(batched["url"])["decodebench_batch_rows"] == 0  # every row freed


def test_a_client_that_leaves_ends_its_own_row_only(servers):
    _, batched = servers
    url = batched["url"]
    expected = complete(url, prompt(1))
    batched["paced"].pause_s = 0.02  # slow steps, so the others are still decoding when one client leaves
    try:
        left = threading.Event()

        def leaver() -> None:
            body = {"model": MODEL, "prompt": prompt(0), "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        break  # the first chunk, then the connection closes
            left.set()

        cancels = metrics(url).get("decodebench_cancels_total", 0.0)
        with ThreadPoolExecutor(3) as pool:
            others = [pool.submit(complete, url, prompt(1)) for _ in range(2)]
            pool.submit(leaver).result()
            assert [f.result() for f in others] == [expected, expected]
        assert left.is_set()
        wait_until(lambda: metrics(url).get("decodebench_cancels_total", 0.0) == cancels + 1)
    finally:
        batched["paced"].pause_s = 0.0


def test_an_engine_that_cannot_batch_is_refused_by_name():
    class OneAtATime:
        name, joins = "generate", False

    with pytest.raises(ConfigError, match=r"serve.max_batch=4: engine generate takes no request into a running batch"):
        make_worker(OneAtATime(), Metrics(), 1, 4)


def test_a_servers_batch_is_a_measured_setting_and_its_other_settings_are_not():
    from decodebench.evidence import config_hash

    base = {"engine": {"name": "ring"}, "experiment": {"name": "load"}, "serve": {"port": 8000, "max_batch": 1}}
    assert config_hash(base) == config_hash({**base, "serve": {"port": 9000, "max_batch": 1}})
    assert config_hash(base) != config_hash({**base, "serve": {"port": 8000, "max_batch": 4}})


def test_a_servers_batch_on_an_experiment_that_serves_nothing_is_refused_by_name(cell_cfg, tiny):
    from runner import run_cell

    record = run_cell(cell_cfg("engine=ring", "experiment=decode", "serve.max_batch=4"))
    assert record["status"] == "failed" and "serve.max_batch=4 has no effect with experiment=decode" in record["reason"]
