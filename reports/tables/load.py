"""The load table (one row per level of every ``load`` cell), rendered by ``load.md.j2`` beside this file."""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.tables.cells import engine_settings

LOAD_COLUMNS = ["file", "engine", "engine_config", "weights", "max_batch", "serving", "generator", "model", "synthetic",
                "device", "level", "mode", "value", "requests", "errors", "prompt_tokens", "prompt_cached",
                "output_tokens", "request_rate", "output_tok_s", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50",
                "tpot_p99", "itl_p50", "itl_p99", "e2el_p50", "e2el_p99", "queue_mean", "ttft_mean", "ttft_less_queue",
                "engine_tok_s", "engine_over_bare", "goodput", "good_requests", "slo_ttft_s", "slo_tpot_s",
                "exports"]  # fmt: skip


def load_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per level of each ok ``load`` cell: the engine and how it holds its linears (``weights``), AIPerf's
    client figures (seconds) and the server's own
    queue seconds over the same requests, with the cell's SLOs and where its exports are kept."""
    rows = []
    for file, data in sorted(records.items()):
        if data["status"] != "ok" or data["config"]["experiment"]["name"] != "load":
            continue
        out = data["outputs"]
        for level in out["levels"]:
            server = level["server"]
            rows.append(
                {
                    "file": file,
                    "engine": data["config"]["engine"]["name"],
                    "engine_config": engine_settings(data["config"]["engine"]),
                    "weights": _weights(data["config"]["engine"]),
                    "max_batch": int((data["config"].get("serve") or {}).get("max_batch", 1)),
                    "serving": serving(data["config"].get("serve") or {}),
                    "generator": generator(out.get("placement")),
                    "model": data["config"]["model"]["name"],
                    "synthetic": bool(data["model"].get("synthetic")),
                    "device": data["environment"].get("device_kind"),
                    "level": level["level"],
                    "mode": level["mode"],
                    "value": level["value"],
                    "requests": level["requests"],
                    "errors": level["errors"],
                    "prompt_tokens": level["prompt_tokens"],
                    "prompt_cached": _cached_per_request(level),
                    "output_tokens": level["output_tokens"].get("max"),
                    "request_rate": level["request_rate_req_s"],
                    "output_tok_s": level["output_tok_s"],
                    **{
                        f"{name}_{p}": level[f"{name}_s"].get(p) if f"{name}_s" in level else None
                        for name in ("ttft", "tpot", "itl", "e2el")
                        for p in ("p50", "p90", "p99")
                    },  # fmt: skip
                    "queue_mean": server["queue_s"]["sum"] / server["queue_s"]["count"] if server else None,
                    "ttft_mean": level["ttft_s"]["avg"],
                    "ttft_less_queue": level["ttft_less_queue_s"],
                    "engine_tok_s": level.get("engine_tok_s"),
                    "engine_over_bare": level.get("engine_over_bare"),
                    "goodput": level["goodput_req_s"],
                    "good_requests": level["good_requests"],
                    "slo_ttft_s": out["slo"]["ttft_s"],
                    "slo_tpot_s": out["slo"]["tpot_s"],
                    "exports": f"{out['exports']}/{level['level']}",
                }
            )
    return pd.DataFrame(rows, columns=LOAD_COLUMNS)


def serving(serve: dict[str, Any]) -> str:
    """How the server decoded its requests, where not one at a time: ``max_batch 4`` (continuous batching), and
    ``prompt read in pieces`` where a joining prompt was read a piece between steps (``serve.prompt_read``)."""
    if int(serve.get("max_batch", 1)) <= 1:
        return ""
    pieces = ", prompt read in pieces" if serve.get("prompt_read", "whole") == "pieces" else ""
    return f"max_batch {serve['max_batch']}{pieces}"


def generator(placement: dict[str, Any] | None) -> str:
    """Where the load generator ran: ``CPU 1 (server 0)`` on CPUs of its own, ``shared`` beside the server (every
    load cell before ``experiment.generator_cpus``)."""
    if not placement or not placement["generator_cpus"]:
        return "shared"
    cpus = ",".join(map(str, placement["generator_cpus"]))
    return f"CPU {cpus} (server {','.join(map(str, placement['server_cpus']))})"


def _cached_per_request(level: dict[str, Any]) -> float | None:
    """Prompt tokens a request of the level took from the server's cache, on average (None: the server said
    nothing, or evidence from before the level recorded it)."""
    total = level.get("prompt_cache_read_tokens")
    return total / level["requests"] if total is not None and level["requests"] else None


def _weights(engine: dict[str, Any]) -> str | None:
    """How the served engine holds its linears, where its settings say (``weights``, a peer's ``quant``)."""
    return engine.get("weights") or engine.get("quant")
