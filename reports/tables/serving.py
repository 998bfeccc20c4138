"""The serving table, rendered by ``serving.md.j2`` beside this file under the article's published row."""

from __future__ import annotations

from typing import Any

import pandas as pd

from decodebench import evidence
from reports import method
from reports.uncertainty import ratio, sampled

SERVE_COLUMNS = ["file", "engine", "model", "synthetic", "device", "context", "read_every", "requests", "tokens",
                 "finish", "read", "decode", "engine_tok", "client", "request_rate", "streams", "ttft", "client_tok",
                 "itl_p50", "itl_p90", "itl_p99", "tpot", "e2el", "bare", "served_over_bare", "ttft_served",
                 "ttft_bare", "ttft_served_over_bare", "client_over_bare", "cancel_before", "cancel_after",
                 "cancel_idle_s", "screenshot", "method"]  # fmt: skip
SAMPLED = {
    "read": "served_read_s",
    "decode": "served_decode_s",
    "engine_tok": "served_engine_tok_s",
    "client": "served_client_s",
    "ttft": "ttft_s",
    "client_tok": "client_tok_s",
    "tpot": "tpot_s",
    "e2el": "e2el_s",
    "bare": "bare_decode_tok_s",
    "ttft_served": "served_ttft_s",
    "ttft_bare": "bare_ttft_s",
}  # column -> the measurement whose samples it shows
# The server's cost over the bare engine: column -> (numerator, denominators in order of preference; evidence
# written before ``bare_served_length_tok_s`` existed compared with ``bare_decode_tok_s``).
RATIOS = {"served_over_bare": ("served_engine_tok_s", ("bare_served_length_tok_s", "bare_decode_tok_s")),
          "ttft_served_over_bare": ("served_ttft_s", ("bare_ttft_s",)),
          "client_over_bare": ("client_tok_s", ("bare_decode_tok_s",))}  # fmt: skip


def serve_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per ok ``serve`` cell: the three parts' figures, each made of samples as its median with its
    95% interval and n; the server's cost over the bare engine as ratios of medians, their intervals from
    both sides' samples; the chat page's screenshot if taken; the cell's method key (``reports.method``)."""
    rows = []
    for file, data in sorted(records.items()):
        if data["status"] != "ok" or data["config"]["experiment"]["name"] != "serve":
            continue
        r = evidence.Record.from_json(data)
        m = r.measurements
        itl = m["itl_s"].to_json() if "itl_s" in m else {}
        shot = r.outputs.get("screenshot") or {}
        finishes = sorted({row["finish"] for row in r.outputs.get("requests", [])})
        rows.append(
            {
                "file": file,
                "engine": r.config["engine"]["name"],
                "model": r.config["model"]["name"],
                "synthetic": bool(r.model.get("synthetic")),
                "device": r.environment.get("device_kind"),
                "context": r.config["context"],
                "read_every": r.outputs.get("read_every"),
                "requests": len(r.outputs.get("requests", [])),
                "tokens": r.value("served_tokens"),
                "finish": "/".join(finishes),
                **{column: sampled(_values(m, name)) for column, name in SAMPLED.items()},
                "request_rate": r.value("request_rate_req_s"),
                "streams": len(r.outputs.get("streams", [])),
                "itl_p50": itl.get("p50"),
                "itl_p90": itl.get("p90"),
                "itl_p99": itl.get("p99"),
                **{column: _ratio(m, top, bottoms) for column, (top, bottoms) in RATIOS.items()},
                "cancel_before": r.value("cancel_counter_before"),
                "cancel_after": r.value("cancel_counter_after"),
                "cancel_idle_s": r.value("cancel_idle_s"),
                "screenshot": shot.get("file") if shot.get("status") == "ok" else None,
                "method": method.of_record(r),
            }
        )
    return pd.DataFrame(rows, columns=SERVE_COLUMNS)


def _values(m: dict[str, evidence.Measurement], name: str) -> list[float] | None:
    """A measurement's samples (a single value as one sample); None when it was not measured."""
    if name not in m:
        return None
    return list(m[name].values) if isinstance(m[name], evidence.Samples) else [m[name].central]


def _ratio(m: dict[str, evidence.Measurement], top: str, bottoms: tuple[str, ...]) -> str:
    """``top`` over the first of ``bottoms`` measured, as the report prints a ratio; "–" when either is missing."""
    bottom = next((b for b in bottoms if b in m), None)
    if top not in m or bottom is None:
        return "–"
    return ratio(_values(m, top), _values(m, bottom)).text()
