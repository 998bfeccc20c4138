"""The int4 linear benchmark table, rendered by ``bench.md.j2`` beside this file."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def bench_table(folder: Path) -> pd.DataFrame:
    """pytest-benchmark's JSON files (``make bench-int4``): one row per benchmark, median seconds and
    the dense/int4 ratio per shape on the same machine."""
    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        cpu = data.get("machine_info", {}).get("cpu", {}).get("brand_raw", "")
        for bench in data.get("benchmarks", []):
            params = bench.get("params") or {}
            shape = "x".join(map(str, params.get("shape", ())))
            rows.append(
                {
                    "file": path.name,
                    "cpu": cpu,
                    "device": bench.get("extra_info", {}).get("device", ""),
                    "linear": shape,
                    "weights": params.get("weights", ""),
                    "kernel": bench.get("extra_info", {}).get("kernel", ""),
                    "median_s": bench["stats"]["median"],
                    "rounds": bench["stats"]["rounds"],
                }
            )
    table = pd.DataFrame(rows, columns=["file", "cpu", "device", "linear", "weights", "kernel", "median_s", "rounds"])
    dense = table[table.weights == "dense"].set_index(["file", "linear"]).median_s
    table["x_dense"] = [
        dense.get((r.file, r.linear), float("nan")) / r.median_s if r.weights == "int4" else None
        for _, r in table.iterrows()
    ]
    return table
