"""The profile table (``experiment=profile``), rendered by ``profile.md.j2`` beside this file, and its stacked bar."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from reports.tables.cells import engine_settings

PROFILE_COLUMNS = ["file", "engine", "settings", "model", "synthetic", "device", "context", "step_ms", "bandwidth_gb_s",
                   "class", "ms_per_token", "share", "bytes_per_token", "gb_s", "floor_ms", "gap_ms",
                   "trace", "operators_ms", "profiled_step_ms", "operators_over_profiled_step", "decode_file",
                   "decode_step_ms", "decode_step_min_ms", "decode_step_max_ms"]  # fmt: skip


def _method(data: dict[str, Any]) -> str:
    """A cell's sweep and whole config but its experiment: a profile cell and the decode cell it is set beside."""
    cfg = {k: v for k, v in data["config"].items() if k != "experiment"}
    return json.dumps([data.get("sweep"), cfg], sort_keys=True)


def decode_steps(records: dict[str, dict[str, Any]]) -> dict[str, tuple[str, float, float, float]]:
    """Ok ``decode`` cells by ``_method``: (file, median step ms, fastest and slowest pair's step ms), the step
    being 1000 / ``decode_tok_s`` (the same warm pairs a profile cell's unprofiled step comes from). A cell all
    of whose pairs broke the method has no rate (its check says so) and no step here."""
    steps = {}
    for file, data in sorted(records.items()):
        if data["status"] == "ok" and data["config"]["experiment"]["name"] == "decode":
            rate = data["measurements"].get("decode_tok_s")
            if rate is None:
                continue
            steps[_method(data)] = (file, 1e3 / rate["median"], 1e3 / rate["max"], 1e3 / rate["min"])
    return steps


def profile_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per class of each ok ``profile`` cell: its milliseconds a token and share of the step, the bytes it
    must read a token and the GB/s that makes, its floor (those bytes at the cell's measured bandwidth, ms) and
    its gap to the floor (ms a token above it: what the class loses against the roofline; a class that reads
    no bytes of its own loses all of its time). Beside each cell, its profiled operators' sum and the step of the
    decode cell of the same sweep and settings (``decode_steps``), where there is one."""
    rows = []
    decode = decode_steps(records)
    for file, data in sorted(records.items()):
        if data["status"] != "ok" or data["config"]["experiment"]["name"] != "profile":
            continue
        measured = data["measurements"]
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
            "operators_ms": data["measurements"]["profiled_operators_ms"]["value"],
            "profiled_step_ms": (measured.get("profiled_step_ms") or {}).get("median"),
            "operators_over_profiled_step": (measured.get("operators_over_profiled_step") or {}).get("value"),
        }
        steps = decode.get(_method(data))
        if steps:
            names = ("decode_file", "decode_step_ms", "decode_step_min_ms", "decode_step_max_ms")
            common.update(zip(names, steps, strict=True))
        for c in data["outputs"]["classes"]:
            read = c.get("bytes_per_token")
            floor = read / bandwidth / 1e6 if read and bandwidth else 0.0  # bytes / (GB/s) -> ms
            rows.append({**common, "class": c["class"], "ms_per_token": c["ms_per_token"], "share": c["share"],
                         "bytes_per_token": read, "gb_s": c.get("gb_s"), "floor_ms": floor,
                         "gap_ms": c["ms_per_token"] - floor})  # fmt: skip
    return pd.DataFrame(rows, columns=PROFILE_COLUMNS)
