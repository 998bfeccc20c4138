"""The measured recall table, rendered by ``recall.md.j2`` beside this file (the published one is
``reports.published.recall_table``)."""

from __future__ import annotations

from typing import Any

import pandas as pd

RECALL_FIELDS = ["target_tokens", "status", "reason", "prompt_tokens", "read_s", "read_tok_s", "decode_tok_s",
                 "answer_code", "found", "asked_record", "records", "true_code", "prompt_sha256"]  # fmt: skip


def recall_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per recall prompt of every ok cell (article 003, Step 11 shape)."""
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
            rows.append({**cell, **{k: item.get(k) for k in RECALL_FIELDS}})
    return pd.DataFrame(rows, columns=["file", "engine", "model", "device", "context", *RECALL_FIELDS])
