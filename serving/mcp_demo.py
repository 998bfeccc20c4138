"""``python -m serving.mcp_demo [--base-url http://127.0.0.1:8015]``: the demo MCP server (stdio, the official
``mcp`` SDK's FastMCP), the Rust article's ``torchtpu-rs-demo``: five tools, all through the shim
(``serving.shim``) to whichever decodebench server is up.

* ``ask`` — one question, not streamed: the reply, then the article's footer (checkpoint, finish reason,
  prompt + completion tokens, prompt read seconds, decode tok/s on the server's device, round-trip seconds
  from here); every figure but the round trip is the server's own, from the response's ``decodebench`` field
  and ``usage``.
* ``stream`` — the same, streamed: each chunk is a progress notification (when the caller asked for them),
  and the footer adds the first token's seconds and the rate this client saw.
* ``engine_info`` — the server's ``/v1/engine``: engine, checkpoint, device, versions, load and warm-up.
* ``endpoint_status`` — the shim's view: its address, the upstream's and what the upstream's /health said.
* ``serving_metrics`` — the server's Prometheus counters: requests by finish reason, cancels, tokens,
  in flight, queue depth, read / decode / queue seconds.

Register it with Claude Code: ``claude mcp add decodebench-demo -- .venv/bin/python -m serving.mcp_demo``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import httpx
from mcp.server.fastmcp import Context, FastMCP
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

BASE_URL = os.environ.get("DECODEBENCH_SHIM", "http://127.0.0.1:8015")
TIMEOUT_S = 600.0  # a decode on the TPU may take minutes at long lengths
INFO_TIMEOUT_S = 30.0


def checkpoint_name(info: dict[str, Any]) -> str:
    """The checkpoint as the article names it: its hub id, else the model with its synthetic key or path."""
    ckpt = info.get("checkpoint") or {}
    if ckpt.get("hub_id"):
        return ckpt["hub_id"]
    if ckpt.get("synthetic"):
        return f"{info.get('model')} (synthetic {ckpt.get('key', '')})".replace(" )", ")")
    return ckpt.get("path") or str(info.get("model"))


def device_name(info: dict[str, Any]) -> str:
    kind = (info.get("device") or {}).get("kind") or "device"
    return kind.upper() if kind in ("tpu", "cpu", "cuda") else kind


def figure(value: float | None, fmt: str, unit: str) -> str:
    return "n/a" if value is None else f"{value:{fmt}} {unit}"


def footer(info: dict[str, Any], ext: dict[str, Any], usage: dict[str, Any], round_trip_s: float) -> str:
    """``checkpoint · finish stop · 17 prompt + 55 completion tokens · prompt read 0.088 s · decode 12.2 tok/s
    on the TPU · 4.59 s round trip from here``"""
    return " · ".join([
        checkpoint_name(info),
        f"finish {ext.get('finish')}",
        f"{usage.get('prompt_tokens')} prompt + {usage.get('completion_tokens')} completion tokens",
        f"prompt read {figure(ext.get('read_s'), '.3f', 's')}",
        f"decode {figure(ext.get('engine_tok_s'), '.1f', 'tok/s')} on the {device_name(info)}",
        f"{round_trip_s:.2f} s round trip from here",
    ])  # fmt: skip


def prometheus(text: str) -> dict[str, Any]:
    """The server's counters by name (samples summed over labels), requests split by finish reason, and each
    seconds histogram as count, sum and mean."""
    out: dict[str, Any] = {"requests_by_finish": {}, "rejected_by_status": {}}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("decodebench_")
        for sample in family.samples:
            if family.type == "histogram":
                if sample.name.endswith(("_count", "_sum")):
                    entry = out.setdefault(name, {})
                    key = sample.name.rsplit("_", 1)[1]
                    entry[key] = entry.get(key, 0.0) + sample.value
            elif sample.name.endswith("_created"):
                continue
            elif name == "requests":
                finish = sample.labels.get("finish", "?")
                out["requests_by_finish"][finish] = out["requests_by_finish"].get(finish, 0) + int(sample.value)
            elif name == "rejected":
                status = sample.labels.get("status", "?")
                out["rejected_by_status"][status] = out["rejected_by_status"].get(status, 0) + int(sample.value)
            else:
                out[name] = out.get(name, 0.0) + sample.value
    for entry in out.values():
        if isinstance(entry, dict) and "count" in entry:
            entry["mean"] = entry["sum"] / entry["count"] if entry["count"] else None
    out["requests"] = sum(out["requests_by_finish"].values())
    return out


def build(base_url: str = BASE_URL, timeout_s: float = TIMEOUT_S) -> FastMCP:
    base = base_url.rstrip("/")
    mcp = FastMCP("decodebench-demo", instructions=f"decodebench's served model through the shim at {base}")

    def client() -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{base}/v1", api_key="decodebench", max_retries=0, timeout=timeout_s)

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=INFO_TIMEOUT_S) as http:
            return await http.get(f"{base}{path}")

    async def engine_document() -> dict[str, Any]:
        response = await get("/v1/engine")
        response.raise_for_status()
        return response.json()

    @mcp.tool()
    async def ask(prompt: str, max_tokens: int = 100) -> str:
        """Ask the served model one question (greedy, not streamed). Returns the reply, then a footer with the
        server's own figures: checkpoint, finish reason, tokens, prompt read seconds, decode tok/s."""
        info = await engine_document()
        started = time.perf_counter()
        async with client() as openai:
            reply = await openai.chat.completions.create(model=info["model"], max_tokens=max_tokens,
                                                         messages=[{"role": "user", "content": prompt}])  # fmt: skip
        round_trip = time.perf_counter() - started
        ext = (reply.model_extra or {}).get("decodebench") or {}
        usage = reply.usage.model_dump() if reply.usage else {}
        return f"{reply.choices[0].message.content}\n\n---\n{footer(info, ext, usage, round_trip)}"

    @mcp.tool()
    async def stream(prompt: str, ctx: Context, max_tokens: int = 100) -> str:
        """Ask the served model one question, streamed: each chunk is reported as progress as it arrives.
        Returns the reply and the footer, with the first token's seconds and the rate this client saw."""
        info = await engine_document()
        text, chunks, ext, usage = "", 0, {}, {}
        first = None
        started = time.perf_counter()
        async with client() as openai:
            events = await openai.chat.completions.create(
                model=info["model"], max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}],
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            async for chunk in events:
                extra = (chunk.model_extra or {}).get("decodebench") or {}
                if "finish" in extra:
                    ext = extra
                if chunk.usage:
                    usage = chunk.usage.model_dump()
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta:
                    first = first if first is not None else time.perf_counter() - started
                    text += delta
                    chunks += 1
                    await ctx.report_progress(chunks, max_tokens, delta)
        round_trip = time.perf_counter() - started
        tokens = usage.get("completion_tokens") or 0
        seen = (tokens - 1) / (round_trip - first) if first is not None and tokens > 1 and round_trip > first else None
        client_side = (f"first token {figure(first, '.3f', 's')} · {chunks} chunks · "
                       f"{figure(seen, '.1f', 'tok/s')} as this client saw them")  # fmt: skip
        return f"{text}\n\n---\n{footer(info, ext, usage, round_trip)} · {client_side}"

    @mcp.tool()
    async def engine_info() -> dict[str, Any]:
        """What the server has loaded and how: engine, checkpoint, device, versions, load and warm-up seconds,
        context, cache layout (its /v1/engine)."""
        info = await engine_document()
        summary = (f"{info.get('engine')} / {checkpoint_name(info)} on the {device_name(info)}, context "
                   f"{info.get('context')}; load {figure(info.get('load_s'), '.2f', 's')}, warm-up "
                   f"{figure(info.get('warmup_s'), '.2f', 's')}")  # fmt: skip
        return {"summary": summary, **info}

    @mcp.tool()
    async def endpoint_status() -> str:
        """The shim's view of the server: the local address, the upstream it passes to, what the upstream's
        /health answered, and how the shim finds it."""
        try:
            response = await get("/health")
        except httpx.HTTPError as exc:
            return f"🔴 nothing answers at {base} ({type(exc).__name__}: {exc}); start the shim: make shim"
        body = response.json()
        if "shim" not in body:  # a decodebench server itself, no shim in between
            light = "🟢" if response.status_code == 200 else "🔴"
            return f"{light} {base}/v1 is a decodebench server (no shim) - /health: {response.status_code}"
        light = "🟢" if body.get("upstream_health") == 200 else "🔴"
        line = [f"{light} local {base}/v1 → {body.get('upstream') or 'no upstream'}",
                f"upstream /health: {body.get('upstream_health') or 'no answer'}", body.get("lookup", "")]  # fmt: skip
        if body.get("error"):
            line.append(body["error"])
        return " - ".join(part for part in line if part)

    @mcp.tool()
    async def serving_metrics() -> dict[str, Any]:
        """The server's counters (its /metrics): requests by finish reason, cancels, prompt and completion
        tokens, in flight, queue depth, and read / decode / queue seconds (count, sum, mean)."""
        response = await get("/metrics")
        response.raise_for_status()
        return prometheus(response.text)

    return mcp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=BASE_URL, help="the shim (or a server): default $DECODEBENCH_SHIM "
                        "or http://127.0.0.1:8015")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds a reply may take")
    args = parser.parse_args(argv)
    build(args.base_url, args.timeout).run("stdio")


if __name__ == "__main__":
    main()
