"""Continuous batching in the server (issue 44, item 3): with ``serve.max_batch=4`` over the tiny ring, requests
sent together decode together (the batch's rows fill), each writes the tokens it writes alone (one request at a
time, ``serve.max_batch=1``), a client that leaves ends its own row only, and an engine that cannot batch is
refused by name."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from decodebench.config import ConfigError, PromptRead, ServeConfig
from serving.text import StopRule
from serving.worker import BatchWorker, Job, Metrics, make_worker
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
    """Three tiny rings in float32 (greedy ties are then out of reach of a product's summation order): one request at
    a time, up to ``ROWS`` together, and up to ``ROWS`` together with a joining prompt read 8 tokens between steps."""
    settings = ("engine.backend=none", "dtype=float32")
    with (serving_engine(cache_dir, "ring", *settings) as alone,
          serving_engine(cache_dir, "ring", *settings, max_batch=ROWS) as batched,
          serving_engine(cache_dir, "ring", *settings, "engine.piece=8", max_batch=ROWS,
                         prompt_read="pieces") as pieces):  # fmt: skip
        yield alone, batched, pieces


@pytest.mark.parametrize("read", ["whole", "pieces"])
def test_requests_sent_together_decode_together_each_as_it_would_alone(servers, read):
    alone, batched, pieces = servers
    server = batched if read == "whole" else pieces
    assert isinstance(server["worker"], BatchWorker) and server["worker"].prompt_read == read
    expected = [complete(alone["url"], prompt(i)) for i in range(ROWS + 2)]  # one at a time
    assert all(len(e) == TOKENS for e in expected)
    with ThreadPoolExecutor(ROWS + 2) as pool:  # more requests than rows: two wait for a row to free
        got = list(pool.map(lambda i: complete(server["url"], prompt(i), stream=i % 2 == 0), range(ROWS + 2)))
    assert got == expected
    assert server["worker"].peak_rows > 1  # they did decode together
    assert metrics(server["url"])["decodebench_batch_rows"] == 0  # every row freed


def test_a_client_that_leaves_ends_its_own_row_only(servers):
    _, batched, _ = servers
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


class Recorder:
    """A stand-in engine whose rows join: a prompt read two ids a piece; what it runs, in order, in ``log``."""

    name, joins = "recorder", True

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gone_as_read: tuple[int, threading.Event] | None = None  # set as that row's last piece is read

    def open_rows(self, rows: int, warm: bool = False) -> None:
        self.rows = rows

    def admitting(self, row: int, ids: list[int]) -> Iterator[torch.Tensor | None]:
        for k in range(0, len(ids), 2):
            self.log.append(f"piece {row}")
            if k + 2 < len(ids):
                yield None
        if self.gone_as_read is not None and self.gone_as_read[0] == row:
            self.gone_as_read[1].set()
        yield torch.tensor([[7]])

    def step_rows(self) -> torch.Tensor:
        self.log.append("step")
        return torch.full((self.rows, 1), 7)

    def release(self, row: int) -> None:
        self.log.append(f"release {row}")


def two_jobs(read: str, leave: str | None = None) -> tuple[list[str], dict[str, tuple[int, str]]]:
    """Job A (2 ids: one piece, 4 tokens) decodes on a 2-row worker; job B (6 ids: three pieces, 2 tokens) joins after
    A's first step (``leave``: B's client goes once its first piece is read, ``between``, or as its last is, ``last``).
    What the engine ran, in order, and each job's tokens and finish."""
    engine, loop = Recorder(), asyncio.new_event_loop()
    worker = make_worker(engine, Metrics(), 1, 2, PromptRead(read))
    rule = StopRule(frozenset(), ignore_eos=True)
    first, second = Job([2, 3], 4, "completions", loop, rule), Job([2, 3, 4, 5, 6, 7], 2, "completions", loop, rule)
    worker.submit(first)
    if leave == "last":
        engine.gone_as_read = (1, second.cancel)  # B's row
    rounds = []

    def done() -> bool:
        rounds.append(1)
        if engine.log.count("step") == 1 and not second.submitted:
            worker.submit(second)
        if leave == "between" and engine.log.count("piece 1") == 1:
            second.cancel.set()
        return len(worker.records) == 2 or len(rounds) > 50

    try:
        worker.serve_until(done, poll_s=0.001)
    finally:
        loop.close()
    names = {first.id: "A", second.id: "B"}
    return engine.log, {names[r.id]: (r.completion_tokens, r.finish) for r in worker.records}


@pytest.mark.parametrize(("read", "order"), [
    ("whole", ["piece 0", "step", "piece 1", "piece 1", "piece 1", "step", "release 1", "step", "release 0"]),
    ("pieces", ["piece 0", "step", "piece 1", "step", "piece 1", "step", "release 0", "piece 1", "step", "release 1"]),
])  # fmt: skip
def test_a_joining_prompt_is_read_whole_or_a_piece_between_steps(read, order):
    """Read whole, A's steps wait for all of B's pieces; read in pieces, A steps between them (and ends before B has
    its first token). A step makes a token for each row that holds a job."""
    assert two_jobs(read) == (order, {"A": (4, "length"), "B": (2, "length")})


def test_a_client_gone_while_its_prompt_is_read_ends_that_read_only():
    log, finished = two_jobs("pieces", leave="between")
    assert log == ["piece 0", "step", "piece 1", "step", "step", "release 0"]  # B never takes a row
    assert finished == {"A": (4, "length"), "B": (0, "cancelled")}
    log, finished = two_jobs("pieces", leave="last")  # the engine gave B its row: freed at once, never stepped
    assert log == ["piece 0", "step", "piece 1", "step", "piece 1", "step", "release 0", "piece 1", "release 1"]
    assert finished == {"A": (4, "length"), "B": (0, "cancelled")}


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
    four = {**base, "serve": {"max_batch": 4, "prompt_read": "whole"}}
    assert config_hash(four) == config_hash({**base, "serve": {"max_batch": 4}})
    assert config_hash(four) != config_hash({**base, "serve": {"max_batch": 4, "prompt_read": "pieces"}})
    with pytest.raises(ConfigError, match="serve.prompt_read=pieces has no effect with serve.max_batch=1"):
        ServeConfig(prompt_read=PromptRead.pieces)


def test_a_servers_batch_on_an_experiment_that_serves_nothing_is_refused_by_name(cell_cfg, tiny):
    from runner import run_cell

    record = run_cell(cell_cfg("engine=ring", "experiment=decode", "serve.max_batch=4"))
    assert record["status"] == "failed" and "serve.max_batch=4 has no effect with experiment=decode" in record["reason"]
