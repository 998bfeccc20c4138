"""The measured recall table, rendered by ``recall.md.j2`` beside this file (the published one is
``reports.published.recall_table``).

Each outcome's decode rate is in the column of its own method (the outcome's ``method`` string), so no
column mixes two definitions: stepping engines time the decode inside one call with their phase timers,
(N-1)/decode_s; the others take (N-1)/(T_N - T_1) from a 1-token and an N-token call.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.uncertainty import sampled

RECALL_FIELDS = ["target_tokens", "status", "reason", "prompt_tokens", "read_s", "read_tok_s", "answer_code", "found",
                 "asked_record", "records", "true_code", "prompt_sha256", "method", "programs_compiled"]  # fmt: skip
# The rate columns, each with the formula a method string must name to be in it.
RATE_METHODS = {"decode_timer": "(N-1)/decode_s", "decode_pair": "(N-1)/(T_N - T_1)"}


def rate_column(method: str | None) -> str | None:
    """The column an outcome's decode rate belongs in, by the formula its method names; None when the
    method is not recorded or names neither."""
    return next((column for column, formula in RATE_METHODS.items() if formula in (method or "")), None)


def recall_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per recall prompt of every ok cell (article 003, Step 11 shape); the prompt read (``read`` s,
    ``read_rate`` tok/s, its repeats in ``read_values``) and the decode rate, in ``decode_timer`` or
    ``decode_pair`` by its method, each the median of the cell's repeats with its 95% interval and n."""
    rows = []
    for file, r in sorted(records.items()):
        for item in r["outputs"].get("recall", []) if r["status"] == "ok" else []:
            cell = {
                "file": file,
                "engine": r["config"]["engine"]["name"],
                "model": r["config"]["model"]["name"],
                "device": r["environment"].get("device_kind"),
                "context": r["config"]["context"],
            }
            rate = sampled(_samples(r, item, "decode_tok_s"))
            reads = _samples(r, item, "read_tok_s")
            column = rate_column(item.get("method"))
            measured = {
                **{c: rate if c == column else None for c in RATE_METHODS},
                "read": sampled(
                    [item["prompt_tokens"] / v for v in reads] if reads and item.get("prompt_tokens") else None
                ),
                "read_rate": sampled(reads),
                "read_values": reads,
            }
            rows.append({**cell, **{k: item.get(k) for k in RECALL_FIELDS}, **measured})
    columns = ["file", "engine", "model", "device", "context", *RECALL_FIELDS, *RATE_METHODS, "read", "read_rate",
               "read_values"]  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


def _samples(record: dict[str, Any], item: dict[str, Any], name: str) -> list[float] | None:
    """The repeats behind an outcome's ``name`` (``recall_<target>_<name>`` samples), or the outcome's own
    single value where the evidence kept no samples; None when neither was recorded."""
    values = record["measurements"].get(f"recall_{item['target_tokens']}_{name}", {}).get("values")
    return values or ([item[name]] if item.get(name) is not None else None)
