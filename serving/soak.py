"""``python -m serving.soak [--requests N] [--clients C] [--tokens T] [serve.py overrides ...]``: decodebench's server
soaked. It starts ``serve.py`` with the overrides in a process group of its own, sends ``--requests`` requests from
``--clients`` clients at once, and stops it whatever happens.

The requests cycle through four kinds: ``whole`` (a completion, not streamed), ``streamed`` (a chat completion,
streamed with usage), ``cancelled`` (streamed, the connection closed after the first chunk) and ``bad`` (a body that
is not JSON, or a field the server does not know). Each asks for exactly ``--tokens`` tokens (``ignore_eos``).

The contract, checked (exit 1 when any part breaks, the summary names which):

* every request is answered: a finished one with exactly ``--tokens`` tokens (its usage), a refused one with 429
  (the queue full, ``serve.max_queue``), a bad one with 400; nothing else, no error in transport;
* the server's own counters (``/metrics``) equal the clients' counts: requests it finished (cancelled included)
  against the requests it accepted, 429s and 400s against the refusals the clients saw;
* its resident memory (``VmRSS`` of the server process, after a warm-up round of the same mix) within
  ``--rss-tolerance`` (5 %) of where it started, and its open file descriptors back to their count before.

The summary is one JSON object on stdout: requests by kind and outcome, the counters, RSS and descriptors before
and after, seconds, and ``holds`` with each broken rule.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
KINDS = ("whole", "streamed", "cancelled", "bad")
START_S = 600  # serve.py's load and warm-up, at most
STOP_S = 30  # SIGTERM, then SIGKILL after this
SETTLE_S = 30  # the server's own bookkeeping after the last answer (in flight back to 0), at most
REQUEST_S = 300  # one request, at most: longer is a hang


def status_value(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` figure in bytes (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def counters(url: str) -> dict[str, float]:
    """The server's counters by sample name and labels (``decodebench_rejected_total{status=429}``)."""
    out: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] += sample.value
    return out


def total(counts: dict[str, float], name: str, **labels: str) -> float:
    """The sum of a counter's samples whose labels include ``labels``."""
    want = [f"{k}={v}" for k, v in labels.items()]
    return sum(v for k, v in counts.items() if k.split("{")[0] == name and all(w in k for w in want))


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int) -> tuple[str, str]:
    """Request ``i``: its kind and outcome (``ok``, ``refused``, ``bad``, ``cancelled``, or what went wrong)."""
    kind = KINDS[i % len(KINDS)]
    ask = {"model": model, "max_tokens": tokens, "ignore_eos": True}
    try:
        if kind == "bad":
            body = b"{not json" if i % 8 == 3 else json.dumps({**ask, "prompt": "x", "no_such_field": 1}).encode()
            r = await client.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
            return kind, "bad" if r.status_code == 400 and "error" in r.json() else f"status {r.status_code}"
        if kind == "whole":
            r = await client.post(f"{url}/v1/completions", json={**ask, "prompt": f"soak request {i}"})
            if r.status_code != 200:
                return kind, "refused" if r.status_code == 429 else f"status {r.status_code}"
            got = r.json()["usage"]["completion_tokens"]
            return kind, "ok" if got == tokens else f"{got} tokens, not {tokens}"
        body = {**ask, "messages": [{"role": "user", "content": f"soak request {i}"}], "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return kind, "refused" if r.status_code == 429 else f"status {r.status_code}"
            used = None
            async for line in r.aiter_lines():
                if kind == "cancelled" and line.startswith("data: "):
                    return kind, "cancelled"  # leaving the block closes the connection mid-stream
                if line.startswith("data: {"):
                    used = json.loads(line[6:]).get("usage") or used
            got = (used or {}).get("completion_tokens")
            return kind, "ok" if got == tokens else f"{got} tokens, not {tokens}"
    except httpx.HTTPError as exc:
        return kind, f"{type(exc).__name__}: {exc}"


async def round_of(url: str, model: str, requests: int, clients: int, tokens: int) -> collections.Counter:
    """``requests`` requests from ``clients`` clients at once; outcomes counted by (kind, outcome)."""
    outcomes: collections.Counter = collections.Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=REQUEST_S, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                outcomes[await one(client, url, model, queue.get_nowait(), tokens)] += 1

        await asyncio.gather(*(worker() for _ in range(clients)))
    return outcomes


def settle(url: str) -> None:
    """Waits until the server has nothing in flight (its bookkeeping after the last answer), at most ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    while total(counters(url), "decodebench_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)


def judge(outcomes: collections.Counter, before: dict[str, float], after: dict[str, float], rss: tuple[int, int],
          fds: tuple[int, int], tolerance: float) -> list[str]:  # fmt: skip
    """Each broken rule of the contract, in words (none: it holds)."""
    broken = [f"{n} {kind} requests: {outcome}" for (kind, outcome), n in outcomes.items()
              if outcome not in ("ok", "refused", "bad", "cancelled")]  # fmt: skip
    finished = sum(n for (kind, outcome), n in outcomes.items() if outcome in ("ok", "cancelled"))
    refused = sum(n for (_, outcome), n in outcomes.items() if outcome == "refused")
    bad = sum(n for (_, outcome), n in outcomes.items() if outcome == "bad")
    served = total(after, "decodebench_requests_total") - total(before, "decodebench_requests_total")
    for name, server, clients in (("requests finished", served, finished),
                                  ("429 refusals", total(after, "decodebench_rejected_total", status="429")
                                   - total(before, "decodebench_rejected_total", status="429"), refused),
                                  ("400 refusals", total(after, "decodebench_rejected_total", status="400")
                                   - total(before, "decodebench_rejected_total", status="400"), bad)):  # fmt: skip
        if server != clients:
            broken.append(f"{name}: the server counted {server:g}, the clients {clients}")
    if rss[1] > rss[0] * (1 + tolerance):
        broken.append(f"resident memory grew {rss[1] / rss[0] - 1:.1%} (from {rss[0]:,} to {rss[1]:,} B), "
                      f"more than {tolerance:.0%}")  # fmt: skip
    if fds[1] != fds[0]:
        broken.append(f"open file descriptors {fds[0]} before, {fds[1]} after")
    return broken


def start(overrides: list[str]) -> tuple[subprocess.Popen[str], str]:
    """``serve.py`` (port 0) in a process group of its own; its process and base URL once it serves."""
    proc = subprocess.Popen([sys.executable, "serve.py", "serve.port=0", *overrides], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout or []:
            lines.append(line)
            if "decodebench serving" in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(START_S) or proc.poll() is not None:
        stop(proc)
        raise RuntimeError(f"serve.py did not serve within {START_S} s:\n{''.join(lines[-20:])}")
    line = next(line for line in lines if "decodebench serving" in line)
    return proc, line.split(" at ")[1].split("/v1")[0]


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the server's group, SIGKILL after ``STOP_S``; waited for."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def soak(overrides: list[str], requests: int, clients: int, tokens: int, tolerance: float) -> dict[str, Any]:
    proc, url = start(overrides)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = asyncio.run(round_of(url, model, min(requests, 4 * clients), clients, tokens))  # allocator and pools
        settle(url)
        rss0, fds0, before = status_value(proc.pid, "VmRSS"), descriptors(proc.pid), counters(url)
        began = time.monotonic()
        outcomes = asyncio.run(round_of(url, model, requests, clients, tokens))
        seconds = time.monotonic() - began
        settle(url)
        rss1, fds1, after = status_value(proc.pid, "VmRSS"), descriptors(proc.pid), counters(url)
    finally:
        stop(proc)
    broken = judge(outcomes, before, after, (rss0, rss1), (fds0, fds1), tolerance)
    broken += [f"warm-up: {n} {kind} requests: {outcome}" for (kind, outcome), n in warm.items()
               if outcome not in ("ok", "refused", "bad", "cancelled")]  # fmt: skip
    return {
        "requests": requests,
        "clients": clients,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "outcomes": {f"{kind} {outcome}": n for (kind, outcome), n in sorted(outcomes.items())},
        "server_counts": {k: after[k] - before.get(k, 0.0) for k in sorted(after)
                          if k.startswith(("decodebench_requests_total", "decodebench_rejected_total",
                                           "decodebench_cancels_total"))},  # fmt: skip
        "rss_bytes": [rss0, rss1],
        "open_fds": [fds0, fds1],
        "holds": not broken,
        "broken": broken,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rss-tolerance", type=float, default=0.05)
    parser.add_argument("overrides", nargs="*", help="serve.py overrides (engine=ring model=tiny serve.max_queue=8)")
    args = parser.parse_args(argv)
    summary = soak(args.overrides, args.requests, args.clients, args.tokens, args.rss_tolerance)
    print(json.dumps(summary, indent=2))
    return 0 if summary["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
