"""The server (serving/, serve.py) over a tiny ring engine, driven by the official openai client:
every endpoint streamed and not, bad input, cancel on disconnect, one engine thread, Prometheus
text, the chat page in Debian's headless chromium, the CLI, and the engines' streaming hook."""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from decodebench import evidence
from decodebench.config import PromptRead
from engines.open import OpenEngine
from reports import render
from runner import run_cell
from serving import browser
from serving.defaults import serving_settings
from serving.listen import running
from serving.server import create_app, describe_engine
from serving.worker import Metrics, make_worker
from tests.conftest import REPO, make_cfg, opened, served_line, spawn_serve, stop

MODEL = "tiny"
START_S = 240  # a server's load and warm-up on this machine's shared cores


class Paced:
    """The engine with a pause after each streamed batch (or each step of a batch), so a test can act while it
    decodes."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.pause_s = engine, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, ids: list[int], n: int, *, on_tokens: Any = None, **kwargs: Any) -> Any:
        def paced(batch: list[int]) -> bool:
            time.sleep(self.pause_s)
            return on_tokens(batch)

        return self.engine.generate(ids, n, on_tokens=paced if on_tokens else None, **kwargs)

    def step_rows(self) -> Any:
        """A batch's step (the server's continuous batching), after the pause."""
        time.sleep(self.pause_s)
        return self.engine.step_rows()


def load(cache_dir, engine: str, read_every: int = 1, *extra: str) -> OpenEngine:
    """The engine opened through the one factory and loaded, reading tokens every ``read_every``."""
    engine = opened(f"cache_dir={cache_dir}", f"engine={engine}", f"read_every={read_every}", *extra)
    engine.load()
    return engine


@contextmanager
def serving_engine(
    cache_dir, engine: str, *extra: str, max_batch: int = 1, prompt_read: str = "whole"
) -> Iterator[dict[str, Any]]:
    """An engine (read every token) built, warmed and served on its own thread (``max_batch`` requests decoding
    together, a joining prompt read as ``prompt_read`` says); the app on another; both stopped whatever the caller
    raised. Yields ``url``, ``worker``, ``paced`` (the pacer), ``opened`` and ``served``."""
    ready, stop, state = threading.Event(), threading.Event(), {}

    def engine_thread() -> None:
        built = load(cache_dir, engine, 1, *extra)
        built.engine.generate([2, 3, 4], 3)  # warm-up
        paced = Paced(built.engine)
        state.update(
            opened=built,
            paced=paced,
            served=describe_engine(built, MODEL, 0.0, 0.0, 1),
            worker=make_worker(paced, Metrics(), 1, max_batch, PromptRead(prompt_read)),
        )
        ready.set()
        state["worker"].serve_until(stop.is_set)

    thread = threading.Thread(target=engine_thread, name="test-engine", daemon=True)
    thread.start()
    try:
        assert ready.wait(START_S), "the engine thread did not start"
        with running(create_app(state["served"], state["worker"], state["opened"])) as url:
            state["url"] = url
            yield state
    finally:
        stop.set()
        thread.join(30)


@pytest.fixture(scope="module")
def server(cache_dir, tiny):
    """A ring engine (backend none: serving is the point, not its programs) built, warmed and served on its own
    thread; the app on another."""
    with serving_engine(cache_dir, "ring", "engine.backend=none") as state:
        yield state


@pytest.fixture
def client(server):
    server["paced"].pause_s = 0.0
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="test", max_retries=0, timeout=120)


def metrics(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_every_endpoint_with_the_openai_client(server, client):
    url = server["url"]
    assert [m.id for m in client.models.list()] == [MODEL]
    whole = client.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=12)
    ext = whole.model_extra["decodebench"]
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens == (12 if whole.choices[0].finish_reason == "length" else ext["engine_tokens"])
    assert ext["read_s"] > 0 and ext["decode_s"] > 0 and ext["thread"] == "test-engine"
    assert ext["engine_tok_s"] == pytest.approx((ext["engine_tokens"] - 1) / ext["decode_s"])
    assert whole.system_fingerprint == "decodebench-ring-greedy"

    chunks = list(client.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content, "greedy: streamed and whole replies are the same"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    plain = client.completions.create(model=MODEL, prompt="The ocean is", max_tokens=6)
    assert plain.usage.completion_tokens <= 6 and plain.model_extra["decodebench"]["decode_s"] > 0
    pieces = list(client.completions.create(model=MODEL, prompt="The ocean is", max_tokens=6, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text

    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["engine"] == "ring" and health["idle"]
    engine = httpx.get(f"{url}/v1/engine").json()
    assert engine["engine"] == "ring" and engine["owner_thread"] == "test-engine"
    assert engine["checkpoint"]["synthetic"] is True and engine["versions"]["torch"]
    assert engine["layout"]["read_every"] == 1 and engine["context"] == 256
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and 'id="stop"' in page.text


@pytest.mark.parametrize(
    "body, status, code",
    [
        ("{not json", 400, "invalid_json"),
        ({"model": MODEL, "messages": []}, 400, "invalid_value"),
        ({"model": MODEL, "messages": chat("hi"), "max_tokens": 0}, 400, "invalid_value"),
        ({"model": MODEL, "messages": chat("word " * 400), "max_tokens": 4}, 400, "context_length_exceeded"),
        ({"model": MODEL, "messages": chat("hi"), "max_tokens": 10_000}, 400, "context_length_exceeded"),
        ({"model": "gpt-4", "messages": chat("hi")}, 404, "model_not_found"),
    ],
    ids=["malformed-json", "empty-messages", "max-tokens-0", "prompt-too-long", "budget-too-long", "unknown-model"],
)
def test_bad_input_is_a_4xx_and_the_server_goes_on(server, body, status, code):
    url = server["url"]
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{url}/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert metrics(url)["decodebench_rejected_total"] >= 1


def test_the_openai_client_reads_the_error_bodies(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=chat("hi"))
    with pytest.raises(openai.BadRequestError, match="cache holds 256 tokens"):
        client.completions.create(model=MODEL, prompt="word " * 400)


def test_a_client_that_leaves_cancels_its_decode(server, client):
    url, worker = server["url"], server["worker"]
    server["paced"].pause_s = 0.02
    before = metrics(url)["decodebench_cancels_total"]
    stream = client.chat.completions.create(model=MODEL, messages=chat("Tell me a story"), max_tokens=200, stream=True)
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.role is None:
            got += 1
            if got == 10:
                break
    stream.close()
    wait_until(lambda: metrics(url)["decodebench_cancels_total"] == before + 1 and worker.idle())
    record = worker.records[-1]
    assert record.finish == "cancelled" and 10 <= record.engine_tokens < 200
    assert httpx.get(f"{url}/health").json()["idle"]


def test_one_thread_owns_the_engine_and_requests_wait_their_turn(server, client):
    worker = server["worker"]
    server["paced"].pause_s = 0.01
    done: dict[str, Any] = {}

    def ask(name: str) -> None:
        done[name] = client.chat.completions.create(model=MODEL, messages=chat(f"Question {name}"), max_tokens=20)

    first = threading.Thread(target=ask, args=("one",))
    first.start()
    wait_until(lambda: worker.busy)
    second = threading.Thread(target=ask, args=("two",))
    second.start()
    wait_until(lambda: metrics(server["url"])["decodebench_queue_depth"] == 1)
    first.join(60)
    second.join(60)
    assert set(done) == {"one", "two"}
    a, b = list(worker.records)[-2:]
    assert a.id == done["one"].id.removeprefix("chatcmpl-") and b.id == done["two"].id.removeprefix("chatcmpl-")
    assert a.thread == b.thread == "test-engine" and b.started >= a.ended, "one decode at a time, in order"
    assert b.queue_s > 0


def test_metrics_parse_as_prometheus_text(server, client):
    client.chat.completions.create(model=MODEL, messages=chat("Count"), max_tokens=4)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server['url']}/metrics").text)}
    for name in ("decodebench_requests", "decodebench_cancels", "decodebench_prompt_tokens", "decodebench_in_flight",
                 "decodebench_queue_depth", "decodebench_read_seconds", "decodebench_decode_seconds"):  # fmt: skip
        assert name in families, name
    assert families["decodebench_read_seconds"].type == "histogram"
    count = next(s.value for s in families["decodebench_decode_seconds"].samples if s.name.endswith("_count"))
    finished = sum(s.value for s in families["decodebench_requests"].samples if s.name.endswith("_total"))
    assert count == finished >= 1
    assert next(s.value for s in families["decodebench_in_flight"].samples) == 0


@pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))
def test_chat_page_streams_carries_the_conversation_and_stop_cancels(server):
    url, worker = server["url"], server["worker"]
    from selenium.webdriver.common.by import By

    with browser.headless_chromium() as driver:
        driver.get(url + "/?max_tokens=60")  # two turns fit the tiny model's 256-token cache
        browser.wait_for(driver, lambda d: d.execute_script("return model !== null"), 30)
        server["paced"].pause_s = 0.0
        browser.ask(driver, "Hello")
        browser.wait_for(driver, lambda d: browser.status(d).startswith("finish"), 60)
        first_prompt = worker.records[-1].prompt_tokens

        server["paced"].pause_s = 0.08
        before = metrics(url)["decodebench_cancels_total"]
        browser.ask(driver, "Tell me more")
        reply = lambda d: d.find_elements(By.CLASS_NAME, "assistant")[-1].text  # noqa: E731
        browser.wait_for(driver, lambda d: len(reply(d)) > 0, 30)
        seen = len(reply(driver))
        browser.wait_for(driver, lambda d: len(reply(d)) > seen, 30)  # tokens keep streaming in
        driver.find_element(By.ID, "stop").click()
        browser.wait_for(driver, lambda d: browser.status(d) == "stopped", 30)
    wait_until(lambda: metrics(url)["decodebench_cancels_total"] == before + 1 and worker.idle())
    record = worker.records[-1]
    assert record.finish == "cancelled" and record.prompt_tokens > first_prompt, "the second turn carries the first"


def test_the_cli_serves_until_interrupted(cache_dir, tiny):
    """Ctrl-C stops it (exit 0); started with SIGINT ignored (``nohup``, a background job of a script), as the
    README says, SIGINT leaves it serving and SIGTERM stops it the same way."""
    args = ("engine=ring", "engine.backend=none", f"cache_dir={cache_dir}", "device=cpu", "serve.port=0",
            "max_new_tokens=4")  # fmt: skip
    proc, lines = spawn_serve(*args)
    ignoring, ignoring_lines = spawn_serve(*args, sigint=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        line = served_line(lines)
        url = line.split(" at ")[1].split("/v1")[0]
        assert url.startswith("http://127.0.0.1:")
        health = httpx.get(f"{url}/health", timeout=10).json()
        info = httpx.get(f"{url}/v1/engine").json()
        assert health["engine"] == "ring" and info["warmup_s"] > 0
        assert (info["layout"]["attend"], info["layout"]["last_piece"]) == ("exact", "exact"), "the server's defaults"
        assert "serving defaults engine.last_piece=exact engine.attend=exact" in line
        assert stop(proc, signal.SIGINT) == 0
        other = served_line(ignoring_lines).split(" at ")[1].split("/v1")[0]
        ignoring.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert ignoring.poll() is None and httpx.get(f"{other}/health", timeout=10).status_code == 200
        assert stop(ignoring, signal.SIGTERM) == 0
    finally:
        stop(proc)
        stop(ignoring)


@pytest.mark.parametrize("engine", ["generate", "ring", "rust", "jax"])
def test_the_streaming_hook_hands_over_batches_and_stops(cache_dir, tiny, engine):
    if engine in ("rust", "jax"):
        pytest.importorskip({"rust": "decodebench_rs", "jax": "jax"}[engine])
    every = 1 if engine == "generate" else 3  # generate hands over each token: it refuses read_every=3 by name
    built = load(cache_dir, engine, every, *(("engine.backend=none",) if engine == "ring" else ())).engine
    ids = [2, 10, 11, 12]
    bare = built.generate(ids, 10).tokens
    batches: list[list[int]] = []
    assert built.generate(ids, 10, on_tokens=lambda b: batches.append(b) is None).tokens == bare
    sizes = {"generate": [1] * 10, "rust": [3, 3, 3, 1]}.get(engine, [1, 3, 3, 3])  # stepping: first token at once
    assert [len(b) for b in batches] == sizes
    assert sum(batches, []) == bare

    batches.clear()
    gen = built.generate(ids, 10, on_tokens=lambda b: batches.append(b) is None and len(batches) < 2)
    handed = sum(batches, [])
    assert handed == bare[: sum(sizes[:2])], "nothing is handed over after a false return"
    extra = 1 if engine == "generate" else 0  # generate checks its stopping criterion one token later
    assert gen.tokens == bare[: len(handed) + extra]


def test_a_serve_cell_writes_all_three_parts_and_the_report_shows_them(cell_cfg, tiny, tmp_path):
    prompts = "experiment.prompts=['Hello','Why is the sky blue']"
    cfg = cell_cfg("engine=ring", "engine.backend=none", "experiment=serve", "experiment.requests=2",
                   "max_new_tokens=12", prompts, "repeats=1")  # fmt: skip
    record = run_cell(cfg)
    assert record["status"] == "ok", record["reason"]
    evidence.validate(record)
    m, out = record["measurements"], record["outputs"]
    assert m["served_engine_tok_s"]["n"] == 2 and m["served_read_s"]["n"] == 2 and m["ttft_s"]["n"] == 2
    assert m["itl_s"]["n"] >= 2 and m["itl_s"]["p50"] <= m["itl_s"]["p99"]
    assert m["cancel_counter_after"]["value"] == m["cancel_counter_before"]["value"] + 1
    assert out["cancel"]["finish"] == "cancelled" and out["cancel"]["chunks_before_drop"] == 10
    served_length = statistics.median(r["engine_tokens"] for r in out["requests"])
    assert m["bare_served_length_tok_s"]["tokens"] == served_length, "bare measured at the served length"
    client_rows = statistics.median(r["engine_tok_s"] for r in out["requests"])  # the responses' own fields
    bare_at_length = m["bare_served_length_tok_s"]["median"]
    assert m["served_over_bare"]["value"] == pytest.approx(client_rows / bare_at_length)
    assert m["bare_decode_tok_s"]["n"] == 1
    assert m["served_ttft_s"]["n"] == 2 and m["bare_ttft_s"]["n"] == 1  # requests=2, repeats=1
    assert m["served_over_bare_ttft"]["value"] == pytest.approx(
        statistics.median(m["served_ttft_s"]["values"]) / m["bare_ttft_s"]["values"][0]
    )
    assert [r["finish"] for r in out["requests"]] == [r["finish"] for r in out["requests"][:1]] * 2, "greedy"
    assert {s["finish"] for s in out["streams"]} <= {"stop", "length"} and len(out["streams"]) == 2
    assert out["engine_info"]["engine"] == "ring" and out["engine_info"]["load_s"] == m["load_s"]["value"]
    shot = out["screenshot"]
    if browser.missing() is None:
        assert shot["status"] == "ok" and (tmp_path / "runs" / shot["file"]).is_file()
    else:
        assert shot["status"] == "skipped" and shot["reason"] == browser.missing()

    report = tmp_path / "report" / "REPORT.md"
    render.build(tmp_path / "runs", REPO / "evidence" / "published", report, tmp_path / "arithmetic.txt")
    text = report.read_text()
    assert "## Serving" in text and "| published (article 000) | rust |" in text and "TTFT served / bare" in text
    assert "12.20 (12.13 to 12.50)" in text and "0.175 to 0.256" in text and "1 → 2 after 10 chunks" in text
    assert f"`runs/test/{record['cell']}.json` | ring |" in text
    if shot["status"] == "ok":
        assert (report.parent / "chat.png").is_file() and "![chat page](chat.png)" in text


def test_the_servers_defaults_apply_where_the_engine_has_them_and_nothing_sets_them():
    ring, rust = make_cfg("engine=ring").engine, make_cfg("engine=rust").engine
    assert serving_settings(ring, [], None, "cpu") == {"engine.last_piece": "exact", "engine.attend": "exact"}
    assert serving_settings(ring, [], None, "tpu") == {"engine.last_piece": "exact", "engine.attend": "filled"}
    assert serving_settings(ring, ["engine.attend=cache"], None, "cpu") == {"engine.last_piece": "exact"}
    assert serving_settings(ring, [], "nb05/ring-33k", "cpu") == {}, "a way is served as the article ran it"
    assert serving_settings(rust, [], None, "cpu") == {"engine.last_piece": "exact"}  # it has no engine.attend
