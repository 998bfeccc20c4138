"""The serving table, rendered by ``serving.md.j2`` beside this file under the article's published row."""

from __future__ import annotations

from typing import Any

import pandas as pd

from decodebench import evidence

SERVE_COLUMNS = ["file", "engine", "model", "synthetic", "device", "context", "read_every", "requests", "tokens",
                 "finish", "read_s", "decode_s", "engine_tok_s", "engine_tok_s_min", "engine_tok_s_max", "client_s",
                 "request_rate", "streams", "ttft_min", "ttft_median", "ttft_max", "client_tok_s_min",
                 "client_tok_s_max", "itl_p50", "itl_p90", "itl_p99", "tpot", "e2el", "bare_tok_s",
                 "served_over_bare", "client_over_bare", "cancel_before", "cancel_after", "cancel_idle_s",
                 "screenshot"]  # fmt: skip


def serve_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per ok ``serve`` cell: the three parts' figures as the experiment wrote them (medians of
    its samples, min and max), the bare engine beside them, and the chat page's screenshot if taken."""
    rows = []
    for file, data in sorted(records.items()):
        if data["status"] != "ok" or data["config"]["experiment"]["name"] != "serve":
            continue
        r = evidence.Record.from_json(data)
        m = r.measurements
        spread = {name: (m[name].to_json()["min"], m[name].to_json()["max"]) if name in m else (None, None)
                  for name in ("served_engine_tok_s", "ttft_s", "client_tok_s")}  # fmt: skip
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
                "read_s": r.value("served_read_s"),
                "decode_s": r.value("served_decode_s"),
                "engine_tok_s": r.value("served_engine_tok_s"),
                "engine_tok_s_min": spread["served_engine_tok_s"][0],
                "engine_tok_s_max": spread["served_engine_tok_s"][1],
                "client_s": r.value("served_client_s"),
                "request_rate": r.value("request_rate_req_s"),
                "streams": len(r.outputs.get("streams", [])),
                "ttft_min": spread["ttft_s"][0],
                "ttft_median": r.value("ttft_s"),
                "ttft_max": spread["ttft_s"][1],
                "client_tok_s_min": spread["client_tok_s"][0],
                "client_tok_s_max": spread["client_tok_s"][1],
                "itl_p50": itl.get("p50"),
                "itl_p90": itl.get("p90"),
                "itl_p99": itl.get("p99"),
                "tpot": r.value("tpot_s"),
                "e2el": r.value("e2el_s"),
                "bare_tok_s": r.value("bare_decode_tok_s"),
                "served_over_bare": r.value("served_over_bare"),
                "client_over_bare": r.value("client_over_bare"),
                "cancel_before": r.value("cancel_counter_before"),
                "cancel_after": r.value("cancel_counter_after"),
                "cancel_idle_s": r.value("cancel_idle_s"),
                "screenshot": shot.get("file") if shot.get("status") == "ok" else None,
            }
        )
    return pd.DataFrame(rows, columns=SERVE_COLUMNS)
