"""The int4 linear benchmark table, rendered by ``bench.md.j2`` beside this file."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd

from decodebench.stats import Interval, ratio_interval
from reports.uncertainty import decimals, figure, ratio, sampled, scaled, shown

FLOOR = "16x64"  # tests/bench_int4.py's FLOOR: one tile of outputs, what a call costs before it reads anything
NO_ROUNDS = "no interval: the JSON keeps no rounds; pytest-benchmark keeps them with --benchmark-save-data"


def bench_table(folder: Path) -> pd.DataFrame:
    """pytest-benchmark's JSON files (``make bench-int4``): one row per benchmark, median seconds and
    the dense/int4 ratio per shape on the same machine, and where the file records the bytes a call reads
    (``extra_info["bytes"]``) the GB/s the kernel reaches alone (bytes over the median, 1e9 bytes a GB), and where it
    records the machine's streaming read just after the benchmark (``extra_info["read_gb_s"]``) that GB/s as a share of
    it (``of_read``); where it records rounds alternating a pass over the weights with the streaming read
    (``extra_info["read_pairs"]``) ``of_read`` is the median of the passes' GB/s over the median of the reads', its 95%
    interval from the rounds taken in pairs (``of_read_shown``, in percent), and ``read_gb_s`` the reads' median. The
    same kernel's median on the ``FLOOR`` weight (a call that reads next to nothing) is each row's
    ``floor_s``, and ``past_floor_gb_s`` the bytes over the median less that floor: the rate once a call has started.
    Where the JSON keeps every round (``stats.data``, seconds) the median has its 95% interval and n
    (``median_ms``, milliseconds) and the ratio its interval from both benchmarks' rounds (``x_dense_shown``). Only
    memory rows get the ratio: a cache row holds as many outputs as fit its kind's bytes, a different weight per kind.

    Each benchmark is from ``memory`` or from ``cache`` (``residence``; a file without the parameter timed from memory
    only). A memory row carries the same kernel's GB/s on the same shape from the caches (``cache_gb_s``: what its
    arithmetic allows) and what bounds it (``bound``): ``kernel`` where that is below the streaming read (its own work,
    arithmetic or calls, cannot go at the machine's read rate even with the memory out of the way), else ``memory``;
    ``–`` without both."""
    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        cpu = data.get("machine_info", {}).get("cpu", {}).get("brand_raw", "")
        for bench in data.get("benchmarks", []):
            params = bench.get("params") or {}
            shape = "x".join(map(str, params.get("shape", ())))
            rounds = bench["stats"].get("data")
            residence = params.get("residence", "memory")
            info = bench.get("extra_info", {})
            paired = _paired(info.get("read_pairs"))
            rows.append(
                {
                    "file": path.name,
                    "cpu": cpu,
                    "device": info.get("device", ""),
                    "linear": shape,
                    "weights": params.get("weights", ""),
                    "residence": residence,
                    "kernel": info.get("kernel", ""),
                    "threads": info.get("threads", "–"),
                    "median_s": bench["stats"]["median"],
                    "median_ms": shown(sampled([1000 * s for s in rounds]), 3)
                    if rounds
                    else f"{1000 * bench['stats']['median']:.3f}",
                    "rounds": bench["stats"]["rounds"],
                    "bytes": info.get("bytes", float("nan")),
                    "gb_s": info.get("bytes", float("nan")) / bench["stats"]["median"] / 1e9,
                    "read_gb_s": paired[1] if paired else info.get("read_gb_s", float("nan")),
                    "paired_of_read": paired[0] if paired else None,
                    "data": rounds,
                }
            )
    columns = ["file", "cpu", "device", "linear", "weights", "residence", "kernel", "threads", "median_s", "median_ms",
               "rounds", "bytes", "gb_s", "read_gb_s", "paired_of_read", "data"]  # fmt: skip
    table = pd.DataFrame(rows, columns=columns)
    table["of_read"] = [r.paired_of_read.value if r.paired_of_read else r.gb_s / r.read_gb_s
                        for _, r in table.iterrows()]  # fmt: skip
    table["of_read_shown"] = [_of_read_shown(r) for _, r in table.iterrows()]
    floor = table[table.linear == FLOOR].set_index(["file", "weights", "residence"]).median_s
    table["floor_s"] = [floor.get((r.file, r.weights, r.residence), float("nan")) for _, r in table.iterrows()]
    past = table.median_s - table.floor_s
    table["past_floor_gb_s"] = (table.bytes / past / 1e9).where((table.linear != FLOOR) & (past > 0))
    # memory rows only: a cache row holds as many outputs as fit its kind's bytes, so the kinds time different weights
    dense = table[(table.weights == "dense") & (table.residence == "memory")].set_index(["file", "linear"])
    table["x_dense"] = [
        dense.median_s.get((r.file, r.linear), float("nan")) / r.median_s if _compared(r) else None
        for _, r in table.iterrows()
    ]
    table["x_dense_shown"] = [_x_dense(r, dense) for _, r in table.iterrows()]
    cached = table[table.residence == "cache"].set_index(["file", "linear", "weights"]).gb_s
    table["cache_gb_s"] = [
        cached.get((r.file, r.linear, r.weights), float("nan")) if r.residence == "memory" else float("nan")
        for _, r in table.iterrows()
    ]
    table["bound"] = [_bound(r.cache_gb_s, r.read_gb_s) for _, r in table.iterrows()]
    return table


def _paired(pairs: list[dict[str, float]] | None) -> tuple[Interval, float] | None:
    """A pass's share of the streaming read from rounds of both (median over median, the rounds resampled in pairs)
    and the reads' median in GB/s; None without rounds."""
    if not pairs:
        return None
    reads = [p["read_gb_s"] for p in pairs]
    return ratio_interval([p["kernel_gb_s"] for p in pairs], reads, paired=True), statistics.median(reads)


def _of_read_shown(row: pd.Series) -> str:
    """``of read`` in percent: with its interval and n where the rounds were paired with the read, else the GB/s over
    the read after the benchmark, ``–`` without both."""
    if row.paired_of_read:
        return figure(scaled(row.paired_of_read, lambda share: 100 * share), decimals(0), "%")
    return "–" if pd.isna(row.of_read) else f"{100 * row.of_read:.0f} %"


def _bound(cache_gb_s: float, read_gb_s: float) -> str:
    """``kernel`` where a kernel's GB/s from the caches is below the machine's streaming read, ``memory`` where
    it is not, ``–`` without both figures."""
    if pd.isna(cache_gb_s) or pd.isna(read_gb_s):
        return "–"
    return "kernel" if cache_gb_s < read_gb_s else "memory"


def _compared(row: pd.Series) -> bool:
    """Whether a row gets an x dense: a kernel other than ``F.linear``, timed from memory on the whole weight."""
    return row.weights != "dense" and row.residence == "memory"


def _x_dense(row: pd.Series, dense: pd.DataFrame) -> str:
    """The dense (``F.linear``) median over this row's (int4, or ``torch.mv``), both from memory: with its interval
    from both benchmarks' rounds where both kept them."""
    if not _compared(row) or (row.file, row.linear) not in dense.index:
        return "–"
    peer = dense.loc[(row.file, row.linear)]
    if row.data and peer.data:
        return ratio(peer.data, row.data).text()
    return f"{peer.median_s / row.median_s:.2f}x ({NO_ROUNDS})"
