"""Experiment ``serve``: the Rust article's served measurements, through decodebench's own server.

The cell's engine is loaded and called on the cell's thread, which then owns it while it serves
(``serving.worker``); uvicorn runs on a thread of its own on a free loopback port, and the
official ``openai`` client runs the method on a third:

0. bare: the ``decode`` experiment's method on this cell (``decode.warm_pairs``), at the server's
   ``read_every`` (max of the run's and 1: a server streams): ``bare_decode_tok_s`` = (N-1)/(T_N - T_1)
   per repeat pair, ``bare_phase_tok_s`` = (N-1)/decode_s from the engine's timers, N = the run's
   ``max_new_tokens`` (``experiment=serve`` sets it to the article's 100).
   The first N-token call (compile included) is the server's warm-up (``warmup_s``). Then one
   request through the server, not counted, warms its path.
1. (a) ``requests`` non-streamed requests one at a time, the run's prompt, ``max_tokens`` = N: per request
   the completion tokens and finish (usage field), the engine's read and decode seconds and
   ``engine_tok_s`` = (engine tokens - 1)/decode_s (the response's ``decodebench`` field), and the
   client's seconds around the call.
2. (b) each of ``prompts`` streamed once: TTFT (send to the first token chunk), ITL (every gap between
   consecutive tokens: a chunk of k tokens is k tokens at its arrival), TPOT = (E2EL - TTFT)/(tokens - 1),
   E2EL (send to the end of the stream), ``client_tok_s`` = (tokens - 1)/(E2EL - TTFT), tokens from the
   usage field, checked against the token counts the chunks carry. ITL percentiles are over gaps, not requests.
3. (c) cancel: a stream asking for all the cache holds is dropped after ``cancel_after`` token
   chunks; the server's cancel counter must move by exactly one and the engine go idle within
   ``idle_timeout_s`` (``/health``, ``/metrics``), else the cell fails.

Request rate and output token throughput are per part: requests (tokens) over that part's wall time.
``served_over_bare`` = median served ``engine_tok_s`` / median ``bare_served_length_tok_s``, the bare
engine's rate at the served requests' own length M (their median engine tokens: a request that stops at
EOS decodes fewer than N, so it is compared with bare calls of M tokens, measured after serving when
M differs from N), with a 95% interval from both sides' samples; ``client_over_bare`` = median streamed
``client_tok_s`` / median ``bare_decode_tok_s`` (other prompts and lengths: a rough figure, so stated);
``served_over_bare_ttft`` = median ``served_ttft_s`` (the run's prompt streamed for one token) / median
``bare_ttft_s`` (the bare warm 1-token calls on that prompt):
the server's cost over the bare engine in the same cell. A screenshot of the chat page goes beside the
evidence when a headless chromium is installed (``serving.browser``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from decodebench.config import ConfigError, ExperimentConfig, at_least, positive
from decodebench.evidence import Record, samples, scalar
from decodebench.stats import ratio_interval
from engines.base import Generation
from experiments.cell import Cell, MethodError
from experiments.common import Result
from experiments.decode import Pairs, warm_pairs
from serving import browser
from serving.listen import running
from serving.server import Served, create_app, describe_engine
from serving.worker import EngineWorker, Metrics, make_worker

T = TypeVar("T")
PERCENTILES = (50, 90, 99)
MEASURED_FINISH = ("stop", "length")
SCREENSHOT_S = 600.0  # the page's one reply of max_tokens, on the slowest engine here
SERVE_PROMPTS = [
    "Write a short paragraph about the ocean.",
    "What is a TPU? Two sentences.",
    "Name three uses of a ring buffer.",
    "Explain greedy decoding in one sentence.",
    "Write a haiku about memory bandwidth.",
    "List four planets and one fact about each.",
    "Why does a key-value cache speed up decoding?",
    "Describe a lighthouse at night.",
]


@dataclass
class ServeExperimentConfig(ExperimentConfig):
    """The Rust article's served measurements through decodebench's OpenAI-compatible server.

    (a) ``requests`` non-streamed requests one at a time with the run's prompt at ``max_new_tokens``;
    then the run's prompt streamed ``requests`` times for one token (served TTFT, against the bare warm
    1-token call: ``served_over_bare_ttft``); (b) each of ``prompts`` streamed once (time to first token,
    inter-token latency, client tok/s);
    (c) a stream dropped after ``cancel_after`` chunks must move the cancel counter by one and leave
    the engine idle within ``idle_timeout_s`` seconds, else the cell fails. ``screenshot``: a picture of
    the chat page beside the evidence when a headless chromium is installed.
    """

    requests: int = 5
    prompts: list[str] = field(default_factory=lambda: list(SERVE_PROMPTS))
    cancel_after: int = 10
    idle_timeout_s: float = 30.0
    screenshot: bool = True

    def __post_init__(self) -> None:
        at_least("experiment.", self, 1, "requests")
        at_least("experiment.", self, 2, "cancel_after", why=" chunks")
        positive("experiment.", self, "idle_timeout_s")
        if not self.prompts:
            raise ConfigError("experiment.prompts is empty: the streamed part needs one prompt or more")


def headline(record: Record) -> str:
    """The cell's one line: served and bare rates, the median TTFT and the cancel counter."""
    served, bare = record.value("served_engine_tok_s"), record.value("bare_decode_tok_s")
    engine_rate = f"{served:.2f} tok/s engine timer served" if served is not None else "no engine timer"
    bare_rate = f"{bare:.2f} tok/s" if bare is not None else "no valid pair"
    synthetic = " (synthetic weights)" if record.model.get("synthetic") else ""
    return (
        f"serve: {engine_rate}, bare {bare_rate}, TTFT median {record.value('ttft_s'):.3f} s, "
        f"cancel counter {record.value('cancel_counter_before'):g} -> {record.value('cancel_counter_after'):g}"
        f"{synthetic}"
    )


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` parsed as Prometheus text: sample name (labels dropped, values summed) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


def check_fit(cell: Cell, texts: list[str]) -> list[list[int]]:
    """Every prompt's ids, each held to the one fit rule with the run's ``max_new_tokens``."""
    all_ids = [cell.opened.encode(text) for text in texts]
    for ids in all_ids:
        cell.require_fit(len(ids))
    return all_ids


def bare(cell: Cell, ids: list[int]) -> tuple[Generation, float, Pairs]:
    """The decode experiment's method at the server's read_every: a warm-up call (the first N tokens and
    its seconds), then ``repeats`` pairs."""
    first, warmup_s = cell.timed_call(ids, cell.cfg.max_new_tokens)
    return first, warmup_s, warm_pairs(cell, ids, first.tokens)


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def one_at_a_time(
    client: Any, model: str, prompt: str, requests: int, max_tokens: int
) -> tuple[list[dict[str, Any]], float]:
    """(a): the article's five requests; each row from the response's usage and ``decodebench`` fields."""
    rows, start = [], time.perf_counter()
    for i in range(requests):
        sent = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=messages(prompt), max_tokens=max_tokens)
        client_s = time.perf_counter() - sent
        ext = r.model_extra["decodebench"]
        finish = r.choices[0].finish_reason
        if finish not in MEASURED_FINISH:
            raise MethodError(f"request {i + 1} finished {finish!r}: only stop or length are measured")
        rows.append({"request": i + 1, "tokens": r.usage.completion_tokens, "finish": finish,
                     "read_s": ext["read_s"], "decode_s": ext["decode_s"], "engine_tokens": ext["engine_tokens"],
                     "engine_tok_s": ext["engine_tok_s"], "queue_s": ext["queue_s"], "client_s": client_s})  # fmt: skip
    return rows, time.perf_counter() - start


def streamed(client: Any, model: str, text: str, max_tokens: int, read_every: int) -> dict[str, Any]:
    """(b): one streamed request, each token chunk timed on arrival."""
    sent = time.perf_counter()
    stamps, counts, finish, tokens, ext = [], [], None, None, None
    stream = client.chat.completions.create(
        model=model, messages=messages(text), max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.finish_reason is not None:
            finish, ext = choice.finish_reason, chunk.model_extra["decodebench"]
        elif choice.delta.role is None and chunk.model_extra["decodebench"]["tokens"]:  # a chunk with tokens
            stamps.append(now)
            counts.append(chunk.model_extra["decodebench"]["tokens"])
    end = time.perf_counter()
    if finish not in MEASURED_FINISH or tokens is None or not stamps:
        raise MethodError(f"the stream for {text!r} ended with finish={finish!r}, usage={tokens}, {len(stamps)} chunks")
    if sum(counts) != tokens or max(counts) > read_every:
        raise MethodError(
            f"the stream for {text!r} carried {sum(counts)} tokens in {len(counts)} chunks (at most {max(counts)} "
            f"a chunk) where its usage says {tokens} tokens at read_every={read_every}"
        )
    ttft, e2el = stamps[0] - sent, end - sent
    rate = (tokens - 1) / (e2el - ttft) if tokens > 1 else None
    return {"prompt": text, "tokens": tokens, "chunks": len(stamps), "finish": finish, "ttft_s": ttft,
            "e2el_s": e2el, "tpot_s": (e2el - ttft) / (tokens - 1) if tokens > 1 else None,
            "client_tok_s": rate, "itl_s": [float(g) for g in np.diff(np.repeat(stamps, counts))],
            "engine_tok_s": ext["engine_tok_s"], "read_s": ext["read_s"]}  # fmt: skip


def cancel(client: Any, url: str, model: str, prompt: str, room: int, exp: Any, worker: EngineWorker) -> dict[str, Any]:
    """(c): drop a stream after ``cancel_after`` token chunks; the counter moves by one, the engine idles."""
    before = scrape(url)["decodebench_cancels_total"]
    stream = client.chat.completions.create(model=model, messages=messages(prompt), max_tokens=room, stream=True)
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason is None and chunk.choices[0].delta.role is None:
            got += 1
            if got >= exp.cancel_after:
                break
    stream.close()  # the connection goes: the server sees the client leave
    dropped = time.perf_counter()
    if got < exp.cancel_after:
        raise MethodError(
            f"the cancel stream ended after {got} chunks, before experiment.cancel_after={exp.cancel_after}"
        )
    deadline = dropped + exp.idle_timeout_s
    while True:
        after = scrape(url)["decodebench_cancels_total"]
        idle = httpx.get(f"{url}/health", timeout=10).json()["idle"]
        if after >= before + 1 and idle:
            break
        if time.perf_counter() > deadline:
            raise MethodError(
                f"after the client left, the cancel counter went {before:g} -> {after:g} and the engine was "
                f"{'idle' if idle else 'busy'} {exp.idle_timeout_s} s later (needs +1 and idle)"
            )
        time.sleep(0.02)
    idle_s = time.perf_counter() - dropped
    record = worker.records[-1]
    if after != before + 1 or record.finish != "cancelled":
        raise MethodError(f"cancel counter {before:g} -> {after:g}, last request finished {record.finish!r}")
    return {"chunks_before_drop": got, "max_tokens": room, "counter_before": before, "counter_after": after,
            "idle_s": idle_s, "engine_tokens": record.engine_tokens, "sent_tokens": record.completion_tokens,
            "finish": record.finish}  # fmt: skip


def screenshot(cell: Cell, url: str) -> dict[str, Any]:
    """The chat page after one reply, beside the evidence (``<sweep>/chat-...png``), or why not."""
    cfg = cell.cfg
    if not cfg.experiment.screenshot:
        return {"status": "skipped", "reason": "experiment.screenshot=false"}
    reason = browser.missing()
    if reason:
        return {"status": "skipped", "reason": reason}
    name = f"{cfg.sweep}/chat-{cfg.engine.name}-{cfg.model.name}-ctx{cfg.context}.png"
    page = f"{url}/?max_tokens={cfg.max_new_tokens}"
    try:
        browser.chat_screenshot(page, cfg.prompt, Path(cfg.evidence_dir) / name, timeout_s=SCREENSHOT_S)
    except Exception as exc:  # a picture is not a measurement: the cell keeps its figures, the reason is kept
        return {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return {"status": "ok", "file": name}


def clients(cell: Cell, url: str, model: str, worker: EngineWorker, room: int) -> dict[str, Any]:
    """The three parts with the official client, on the client thread."""
    from openai import OpenAI

    cfg, exp, n = cell.cfg, cell.cfg.experiment, cell.cfg.max_new_tokens
    client = OpenAI(base_url=f"{url}/v1", api_key="decodebench", max_retries=0, timeout=600)
    client.chat.completions.create(model=model, messages=messages(cfg.prompt), max_tokens=n)  # warm
    rows, wall_a = one_at_a_time(client, model, cfg.prompt, exp.requests, n)
    first = [streamed(client, model, cfg.prompt, 1, worker.read_every)["ttft_s"] for _ in range(exp.requests)]
    start = time.perf_counter()
    streams = [streamed(client, model, text, n, worker.read_every) for text in exp.prompts]
    wall_b = time.perf_counter() - start
    cancelled = cancel(client, url, model, cfg.prompt, room, exp, worker)
    return {"requests": rows, "wall_a": wall_a, "first_token_s": first, "streams": streams, "wall_b": wall_b,
            "cancel": cancelled, "screenshot": screenshot(cell, url)}  # fmt: skip


def serve_while(
    cell: Cell, warmup_s: float | None, read_every: int, clients: Callable[[str, str, EngineWorker], T]
) -> tuple[T, Served, EngineWorker]:
    """The cell's loaded engine behind decodebench's server on a free loopback port, for as long as
    ``clients(url, model id, worker)`` runs on a client thread; this thread built the engine, so it is the
    one that serves. Returns what ``clients`` returned, what the server said of the engine, and the worker."""
    served = describe_engine(cell.opened, cell.cfg.model.name, cell.load_s, warmup_s, read_every)
    serve = cell.cfg.serve
    worker = make_worker(cell.engine, Metrics(), read_every, serve.max_batch, serve.prompt_read)
    with running(create_app(served, worker, cell.opened)) as url, ThreadPoolExecutor(1, "decodebench-client") as pool:
        parts = pool.submit(clients, url, served.model_id, worker)
        worker.serve_until(parts.done)
        return parts.result(), served, worker


def median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def run(cell: Cell, result: Result | None = None) -> Result:
    cfg, exp = cell.cfg, cell.cfg.experiment
    result = result or Result()
    ids, *_ = check_fit(cell, [cfg.prompt, *exp.prompts])
    cell.load()
    engine = cell.engine
    read_every = max(cfg.read_every, 1)
    with engine.reading_every(read_every):
        first, warmup_s, base = bare(cell, ids)
    out, served, worker = serve_while(
        cell, warmup_s, read_every, lambda url, model, worker: clients(cell, url, model, worker, cfg.context - len(ids))
    )

    rows, streams = out["requests"], out["streams"]
    served_n = int(statistics.median(r["engine_tokens"] for r in rows))
    at_length = base
    if served_n != base.n and served_n >= 2:  # the bare engine at the served requests' own length
        with engine.reading_every(read_every):
            at_length = warm_pairs(cell, ids, first.tokens[:served_n], served_n)
    result.outputs["checks"] = [base.check(), at_length.check()] if at_length is not base else [base.check()]
    gaps = [g for s in streams for g in s["itl_s"]]
    m = result.measurements
    m.update(
        load_s=scalar(cell.load_s, "s"),
        warmup_s=scalar(warmup_s, "s", method="first generate(N) at the server's read_every, compile included"),
        served_tokens=samples([r["tokens"] for r in rows], "tok", source="usage.completion_tokens"),
        served_client_s=samples([r["client_s"] for r in rows], "s", method="client wall clock around create()"),
        request_rate_req_s=scalar(len(rows) / out["wall_a"], "req/s", method="(a) requests / wall seconds"),
        output_tok_s=scalar(sum(r["tokens"] for r in rows) / out["wall_a"], "tok/s", method="(a) tokens / wall s"),
        stream_request_rate_req_s=scalar(len(streams) / out["wall_b"], "req/s", method="(b) requests / wall s"),
        stream_output_tok_s=scalar(sum(s["tokens"] for s in streams) / out["wall_b"], "tok/s", method="(b)"),
        ttft_s=samples([s["ttft_s"] for s in streams], "s", method="send to first token chunk, client"),
        served_ttft_s=samples(
            out["first_token_s"], "s", method="the run's prompt streamed for 1 token: send to its chunk, client"
        ),
        bare_ttft_s=samples(base.warm_1, "s", method="warm 1-token call on the run's prompt, device.sync() around it"),
        e2el_s=samples([s["e2el_s"] for s in streams], "s", method="send to end of stream, client"),
        cancel_counter_before=scalar(out["cancel"]["counter_before"], "count"),
        cancel_counter_after=scalar(out["cancel"]["counter_after"], "count"),
        cancel_idle_s=scalar(out["cancel"]["idle_s"], "s", method="client drop to cancel counted and engine idle"),
        prompt_tokens=scalar(len(ids), "tok"),
        max_new_tokens=scalar(cfg.max_new_tokens, "tok"),
    )
    optional = {
        "bare_decode_tok_s": (base.rates, "tok/s", {"formula": "(N-1)/(T_N-T_1)", "read_every": read_every}),
        "bare_served_length_tok_s": (
            at_length.rates,
            "tok/s",
            {
                "formula": "(M-1)/(T_M-T_1), M = median served engine tokens",
                "tokens": served_n,
                "read_every": read_every,
            },
        ),  # fmt: skip
        "bare_phase_tok_s": (
            [(base.n - 1) / g.decode_s for g in base.calls if g.decode_s],
            "tok/s",
            {"formula": "(N-1)/decode_s, engine timers"},
        ),  # fmt: skip
        "served_read_s": ([r["read_s"] for r in rows], "s", {"method": "engine timer, response's decodebench field"}),
        "served_decode_s": ([r["decode_s"] for r in rows], "s", {"method": "engine timer"}),
        "served_engine_tok_s": ([r["engine_tok_s"] for r in rows], "tok/s", {"formula": "(tokens-1)/decode_s"}),
        "tpot_s": ([s["tpot_s"] for s in streams], "s", {"formula": "(E2EL-TTFT)/(tokens-1)"}),
        "client_tok_s": ([s["client_tok_s"] for s in streams], "tok/s", {"formula": "(tokens-1)/(E2EL-TTFT)"}),
    }
    if gaps:  # one-chunk streams have no gaps
        itl = "gaps between consecutive tokens, a chunk of k tokens counted as k tokens at its arrival"
        m["itl_s"] = samples(gaps, "s", method=itl, **percentiles(gaps))
    for name, (values, unit, extra) in optional.items():
        kept = [v for v in values if v is not None]
        if kept:  # an engine that cannot split a call has no engine timers
            m[name] = samples(kept, unit, **extra)
    ratios = (("served_over_bare", "served_engine_tok_s", "bare_served_length_tok_s", "the same length"),
              ("served_over_bare_ttft", "served_ttft_s", "bare_ttft_s", "the same prompt, one token"),
              ("client_over_bare", "client_tok_s", "bare_decode_tok_s", "other prompts and lengths"))  # fmt: skip
    for name, numerator, denominator, compared in ratios:
        if numerator in m and denominator in m:
            ratio = ratio_interval(m[numerator].values, m[denominator].values)
            m[name] = scalar(ratio.value, "x", formula=f"median {numerator} / median {denominator}", compares=compared,
                             ci95=[ratio.low, ratio.high], n=ratio.n)  # fmt: skip
    result.samples.update({name: list(v.values) for name, v in m.items() if hasattr(v, "values")})
    result.outputs.update(
        prompt_ids=ids,
        read_every=read_every,
        requests=rows,
        streams=[{k: v for k, v in s.items() if k != "itl_s"} for s in streams],
        cancel=out["cancel"],
        server_records=[r.to_json() for r in worker.records],
        engine_info=served.info,
        screenshot=out["screenshot"],
        warm="one bare warm-up call and one request through the server before anything is counted",
    )
    result.timers.update(
        bare_decode_tok_s="(N-1)/(warm_n_s - warm_1_s) at the server's read_every, device.sync() around each call",
        bare_served_length_tok_s="as bare_decode_tok_s with N = the served requests' median engine tokens",
        served_engine_tok_s="(engine tokens - 1)/decode_s, the engine's own timer inside the server",
        ttft_s="client: create() to the first token chunk's arrival",
        served_ttft_s="client: create() to the one token's chunk, the run's prompt",
        bare_ttft_s="warm_1_s of the bare pairs: the prompt read and the first token",
        itl_s="client: gaps between consecutive tokens (a chunk of k tokens: k tokens at its arrival)",
        e2el_s="client: create() to the end of the stream",
    )
    return result
