"""AIPerf (NVIDIA's load generator for OpenAI-compatible servers) as the load experiment's client.

AIPerf lives in its own virtual environment (``make setup`` installs ``locks/aiperf.txt`` into
``.venv-aiperf``), so its pins (Transformers, numpy, pandas) never touch the project's; it is driven
through its command line and read back through its JSON export ``profile_export_aiperf.json``: the client
side, per metric ``avg``/``p50``/``p90``/``p99``/``min``/``max`` in the metric's display unit (milliseconds
for latencies). It runs without warm-up requests and without scraping the server (the load experiment warms
the server up and reads its ``/metrics`` itself, before and after each run, so the server's figures cover
exactly AIPerf's requests).

``level_command`` builds one load level's run; ``read_level`` turns its export into one record in
seconds and tokens. AIPerf's names against the ones used here (vLLM's and the serving notes'):
``time_to_first_token`` is TTFT, ``inter_token_latency`` ((E2EL - TTFT) / (tokens - 1) per request) is
TPOT, ``inter_chunk_latency`` (every gap between consecutive stream chunks) is ITL, ``request_latency`` is
E2EL.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / ".venv-aiperf" / "bin" / "aiperf"
CLIENT_EXPORT = "profile_export_aiperf.json"
# AIPerf metric -> the name it has here (latencies: milliseconds there, seconds here)
LATENCIES = {"time_to_first_token": "ttft_s", "inter_token_latency": "tpot_s", "inter_chunk_latency": "itl_s",
             "request_latency": "e2el_s"}  # fmt: skip
STATS = ("avg", "p50", "p90", "p99", "min", "max")
# The fewest processes AIPerf will run with, and no probing for GPU telemetry: it shares the engine's cores.
QUIET = ("--workers-max", "1", "--record-processors", "1", "--no-gpu-telemetry", "--no-server-metrics")


class ToolError(RuntimeError):
    """AIPerf wrote an export this module cannot read as a complete level."""


@dataclass(frozen=True)
class Level:
    """One load level: closed-loop ``concurrency`` (that many requests always in flight) or open-loop
    ``rate`` (requests a second, Poisson arrivals)."""

    mode: str  # "concurrency" or "rate"
    value: float

    @property
    def name(self) -> str:
        return f"c{self.value:g}" if self.mode == "concurrency" else f"r{self.value:g}"

    def args(self) -> list[str]:
        if self.mode == "concurrency":
            return ["--concurrency", str(int(self.value))]
        return ["--request-rate", f"{self.value:g}", "--arrival-pattern", "poisson"]


@dataclass(frozen=True)
class Workload:
    """What every level sends: ``requests`` requests, each asking for exactly ``output_tokens``
    (``ignore_eos``); prompts from ``input_file`` (JSONL, ``{"text": ...}`` a line,
    sent as chat user turns) or, without one, AIPerf's synthetic prompts of ``prompt_tokens`` tokens (the
    completions endpoint: token soup is no user turn). SLOs in seconds, for AIPerf's goodput."""

    requests: int
    output_tokens: int
    prompt_tokens: int
    input_file: Path | None
    slo_ttft_s: float
    slo_tpot_s: float
    seed: int


def missing() -> str | None:
    """Why AIPerf cannot run here, or None."""
    if not TOOL.exists():
        return f"AIPerf is not installed at {TOOL.relative_to(ROOT)} (`make setup` installs it from locks/aiperf.txt)"
    return None


def environment(work_dir: Path) -> dict[str, str]:
    """The environment AIPerf runs in: this one, with its temporary files (a memory-mapped dataset and
    socket folders it leaves in the system's temporary folder) under ``work_dir``, removed with it. Unix
    socket paths are short (108 bytes), so ``work_dir`` must be too: a folder in the system's own."""
    return {**os.environ, "TMPDIR": str(work_dir)}


def level_command(url: str, model: str, tokenizer: Path, level: Level, work: Workload, out: Path) -> list[str]:
    """``aiperf profile`` for one level against ``url`` (the server's base URL, no ``/v1``)."""
    if work.input_file is not None:
        prompts = ["--endpoint-type", "chat", "--input-file", str(work.input_file), "--custom-dataset-type",
                   "single_turn"]  # fmt: skip
    else:
        prompts = ["--endpoint-type", "completions", "--synthetic-input-tokens-mean", str(work.prompt_tokens),
                   "--synthetic-input-tokens-stddev", "0"]  # fmt: skip
    goodput = f"time_to_first_token:{work.slo_ttft_s * 1e3:g} inter_token_latency:{work.slo_tpot_s * 1e3:g}"
    return [str(TOOL), "profile", "--model", model, "--url", url, "--streaming", "--tokenizer", str(tokenizer),
            *prompts, "--output-tokens-mean", str(work.output_tokens), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count", *level.args(),
            "--request-count", str(work.requests),
            "--goodput", goodput, "--random-seed", str(work.seed), "--ui-type", "none",
            *QUIET, "--artifact-dir", str(out)]  # fmt: skip


def _seconds(block: dict[str, Any]) -> dict[str, float]:
    if block.get("unit") != "ms":
        raise ToolError(f"a latency in {block.get('unit')!r}, expected ms")
    return {k: block[k] / 1e3 for k in STATS if k in block}


def read_level(out: Path) -> dict[str, Any]:
    """One level's client figures from AIPerf's export in ``out``: counts, rates, latencies in seconds and
    goodput; ``prompt_cache_read_tokens``: the prompt tokens the server said it took from a cache of its own over
    the level's requests (``usage.prompt_tokens_details.cached_tokens``; None from a server that says nothing)."""
    try:
        client = json.loads((out / CLIENT_EXPORT).read_text())
    except (OSError, ValueError) as exc:
        raise ToolError(f"AIPerf's export in {out} could not be read: {exc}") from exc
    if not client.get("is_complete") or client.get("was_cancelled"):
        raise ToolError(f"AIPerf's run in {out} did not complete (is_complete={client.get('is_complete')}, "
                        f"was_cancelled={client.get('was_cancelled')})")  # fmt: skip

    def value(name: str) -> float | None:
        return client[name]["avg"] if name in client else None

    errors = sum(int(e.get("count", 1)) for e in client.get("error_summary") or [])
    tokens = client.get("usage_completion_tokens", {})
    return {
        "aiperf_version": client.get("aiperf_version"),
        "requests": int(value("request_count") or 0),
        "errors": errors,
        "duration_s": value("benchmark_duration"),
        "request_rate_req_s": value("request_throughput"),
        "output_tok_s": value("output_token_throughput"),
        "goodput_req_s": value("goodput"),
        "good_requests": value("good_request_count"),
        "effective_concurrency": value("effective_concurrency"),
        "output_tokens": {k: tokens[k] for k in ("min", "max") if k in tokens},
        "prompt_tokens": client.get("usage_prompt_tokens", {}).get("avg"),
        "prompt_cache_read_tokens": client.get("total_usage_prompt_cache_read_tokens", {}).get("avg"),
        **{ours: _seconds(client[theirs]) for theirs, ours in LATENCIES.items() if theirs in client},
    }
