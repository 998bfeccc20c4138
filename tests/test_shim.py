"""The laptop shim (serving/shim.py) in front of decodebench's own server on model=tiny: streamed and whole
replies passed through (a stream chunk by chunk), a client that leaves cancels the decode on the server,
an upstream killed and restarted on another port found again by the lookup command, and the server's chat
page through the shim in Debian's headless chromium. Loopback only; every wait is bounded."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from serving import browser, shim
from tests.conftest import REPO, default_sigint, served_line, spawn_serve, stop
from tests.test_serve import MODEL, START_S, chat, metrics, serving_engine, wait_until


def local_server(cache_dir: Path) -> AbstractContextManager[dict[str, Any]]:
    """decodebench's server over a tiny ring engine (backend none), built and served on an engine thread of
    its own (as serve.py does on its main thread), uvicorn on another; yields url, worker and the pacer."""
    return serving_engine(cache_dir, "ring", "engine.backend=none")


@pytest.fixture(scope="module")
def server(cache_dir, tiny):
    with local_server(cache_dir) as state, shim.running(shim.create_shim(shim.Upstream(url=state["url"]))) as local:
        state["shim"] = local
        yield state


def client_for(url: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0, timeout=timeout)


def test_replies_streamed_and_whole_pass_through_the_shim(server):
    server["paced"].pause_s = 0.0
    direct, through = client_for(server["url"]), client_for(server["shim"])
    assert [m.id for m in through.models.list()] == [MODEL]
    expected = direct.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=12)
    whole = through.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=12)
    assert whole.choices[0].message.content == expected.choices[0].message.content, "greedy, the same reply"
    ext = whole.model_extra["decodebench"]
    assert ext["decode_s"] > 0 and ext["finish"] == whole.choices[0].finish_reason
    assert whole.usage.completion_tokens == expected.usage.completion_tokens

    chunks = list(through.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=12,
                                                  stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens

    with pytest.raises(openai.NotFoundError, match="does not exist"):  # the server's 4xx and its body, as they were
        through.chat.completions.create(model="gpt-4", messages=chat("hi"))
    assert httpx.get(f"{server['shim']}/v1/engine", timeout=10).json()["engine"] == "ring"
    assert "decodebench_requests_total" in httpx.get(f"{server['shim']}/metrics", timeout=10).text

    health = httpx.get(f"{server['shim']}/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body["upstream"] == server["url"] and body["upstream_health"] == 200 and body["status"] == "ok"
    assert body["upstream_body"]["engine"] == "ring" and body["lookup"] == "fixed"


def test_a_stream_arrives_chunk_by_chunk(server):
    server["paced"].pause_s = 0.05  # 30 batches of one token: about 1.5 s of decoding
    request = {"model": MODEL, "messages": chat("Tell me a story"), "max_tokens": 30, "stream": True}
    arrived = []
    with httpx.stream("POST", f"{server['shim']}/v1/chat/completions", json=request, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrived.append((time.monotonic(), json.loads(line[6:])))
    tokens = [c for t, c in arrived if c.get("decodebench", {}).get("tokens")]
    assert len(tokens) >= 10
    first = next(t for t, c in arrived if c.get("decodebench", {}).get("tokens"))
    assert arrived[-1][0] - first > 0.4, "the chunks came as the engine made them, not all at the end"


def test_a_client_that_leaves_the_shim_cancels_the_decode(server):
    url, worker = server["url"], server["worker"]
    server["paced"].pause_s = 0.02
    before = metrics(url)["decodebench_cancels_total"]
    stream = client_for(server["shim"]).chat.completions.create(model=MODEL, messages=chat("Tell me a story"),
                                                                max_tokens=200, stream=True)  # fmt: skip
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

    # not streamed: the client gives up before the reply; the shim drops its upstream request, the server cancels
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server['shim']}/v1/chat/completions", timeout=1.0,
                   json={"model": MODEL, "messages": chat("Tell me a story"), "max_tokens": 200})  # fmt: skip
    wait_until(lambda: metrics(url)["decodebench_cancels_total"] == before + 2 and worker.idle())
    record = worker.records[-1]
    assert record.finish == "cancelled" and record.engine_tokens < 200
    assert httpx.get(f"{server['shim']}/health", timeout=10).json()["upstream_body"]["idle"]


def test_the_lookup_prints_a_url_or_a_host():
    assert shim.gcloud_lookup("qr", "us-west4-a", "p")[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "describe"]
    host = shim.Upstream(lookup=[sys.executable, "-c", "print('10.1.2.3')"], port=8123)
    assert host._run_lookup() == "http://10.1.2.3:8123"
    url = shim.Upstream(lookup=[sys.executable, "-c", "print('http://127.0.0.1:9/')"])
    assert url._run_lookup() == "http://127.0.0.1:9"
    failing = shim.Upstream(lookup=[sys.executable, "-c", "import sys; sys.exit('no such VM')"])
    with pytest.raises(shim.UpstreamLookupError, match="no such VM"):
        failing._run_lookup()


def start_serve(cache_dir: Path) -> tuple[subprocess.Popen, queue.Queue]:
    """An upstream server in a process of its own: generate, which compiles nothing (the shim is the point)."""
    return spawn_serve("engine=generate", f"model={MODEL}", "device=cpu", f"cache_dir={cache_dir}", "serve.port=0",
                       "max_new_tokens=4")  # fmt: skip


def served_url(lines: queue.Queue) -> str:
    """The address serve.py prints once it serves (bounded: each line within START_S)."""
    return served_line(lines, START_S).split(" at ")[1].split("/v1")[0]


def test_an_upstream_killed_and_restarted_elsewhere_is_looked_up_again(cache_dir, tiny, tmp_path):
    address = tmp_path / "upstream.txt"
    procs = [start_serve(cache_dir), start_serve(cache_dir)]  # the first, and the one that replaces it
    shim_proc = None
    try:
        first, second = served_url(procs[0][1]), served_url(procs[1][1])
        assert first != second
        address.write_text(first + "\n")
        lookup = f"{sys.executable} -c \"print(open('{address}').read())\""
        shim_proc = subprocess.Popen([sys.executable, "-m", "serving.shim", "--lookup-cmd", lookup, "--port", "0"],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=default_sigint)  # fmt: skip
        line = shim_proc.stdout.readline()  # the shim looks the upstream up before it prints
        assert "decodebench shim at http://127.0.0.1:" in line and f"-> {first};" in line, line
        local = line.split(" at ")[1].split("/v1")[0]
        client = client_for(local, timeout=60)
        ask = lambda: client.completions.create(model=MODEL, prompt="The ocean is", max_tokens=4)  # noqa: E731
        assert ask().usage.completion_tokens >= 1
        assert httpx.get(f"{local}/health", timeout=30).json()["lookups"] == 1

        procs[0][0].send_signal(signal.SIGKILL)  # the VM goes away
        procs[0][0].wait(30)
        with pytest.raises(openai.APIStatusError) as refused:  # looked up again: the same address, still dead
            ask()
        assert refused.value.status_code == 502 and "does not answer" in str(refused.value)
        down = httpx.get(f"{local}/health", timeout=30)
        assert down.status_code == 503 and down.json()["status"] == "upstream_down"

        address.write_text(second + "\n")  # the new VM's address, as gcloud would print it
        assert ask().usage.completion_tokens >= 1
        health = httpx.get(f"{local}/health", timeout=30).json()
        assert health["upstream"] == second and health["upstream_health"] == 200 and health["lookups"] >= 3
    finally:
        for proc, _ in procs:
            stop(proc, signal.SIGINT)
        if shim_proc is not None:
            assert stop(shim_proc, signal.SIGINT) == 0


@pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))
def test_the_chat_page_through_the_shim_streams_and_stop_cancels(server):
    from selenium.webdriver.common.by import By

    url, worker = server["url"], server["worker"]
    with browser.headless_chromium() as driver:
        driver.get(server["shim"] + "/?max_tokens=60")
        browser.wait_for(driver, lambda d: d.execute_script("return model !== null"), 30)
        assert "engine: ring" in driver.find_element(By.ID, "engine").text  # /v1/engine, through the shim
        server["paced"].pause_s = 0.0
        browser.ask(driver, "Hello")
        browser.wait_for(driver, lambda d: browser.status(d).startswith("finish"), 60)

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
    assert worker.records[-1].finish == "cancelled"
