"""The profile table (``experiment=profile``), rendered by ``profile.md.j2`` beside this file, and its stacked bar."""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.tables.cells import engine_settings

PROFILE_COLUMNS = ["file", "engine", "settings", "model", "synthetic", "device", "context", "step_ms", "bandwidth_gb_s",
                   "class", "ms_per_token", "share", "bytes_per_token", "gb_s", "floor_ms", "gap_ms",
                   "trace"]  # fmt: skip


def profile_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per class of each ok ``profile`` cell: its milliseconds a token and share of the step, the bytes it
    must read a token and the GB/s that makes, its floor (those bytes at the cell's measured bandwidth, ms) and
    its gap to the floor (ms a token above it: what the class loses against the roofline; a class that reads
    no bytes of its own loses all of its time)."""
    rows = []
    for file, data in sorted(records.items()):
        if data["status"] != "ok" or data["config"]["experiment"]["name"] != "profile":
            continue
        bandwidth = (data.get("hardware") or {}).get("bandwidth_measurement", {}).get("value")
        common = {
            "file": file,
            "engine": data["config"]["engine"]["name"],
            "settings": engine_settings(data["config"]["engine"]),
            "model": data["config"]["model"]["name"],
            "synthetic": bool(data["model"].get("synthetic")),
            "device": data["environment"].get("device_kind"),
            "context": data["config"]["context"],
            "step_ms": data["measurements"]["step_ms"]["value"],
            "bandwidth_gb_s": bandwidth,
            "trace": data["outputs"].get("trace"),
        }
        for c in data["outputs"]["classes"]:
            read = c.get("bytes_per_token")
            floor = read / bandwidth / 1e6 if read and bandwidth else 0.0  # bytes / (GB/s) -> ms
            rows.append({**common, "class": c["class"], "ms_per_token": c["ms_per_token"], "share": c["share"],
                         "bytes_per_token": read, "gb_s": c.get("gb_s"), "floor_ms": floor,
                         "gap_ms": c["ms_per_token"] - floor})  # fmt: skip
    return pd.DataFrame(rows, columns=PROFILE_COLUMNS)
