"""The decode table, rendered by ``decode.md.j2`` beside this file (its JAX rows also by
``templates/jax.md.j2``; plotted by ``reports.plots``): repeats pooled as median of raw samples, min,
max and n, with each sweep's own median in ``by_sweep``."""

from __future__ import annotations

import statistics

import pandas as pd

from reports.tables.cells import GROUP

DECODE_EXPERIMENTS = ("decode", "default")  # experiments whose files carry decode_tok_s samples
DECODE_COLUMNS = ["decode_median", "decode_min", "decode_max", "n", "phase_median", "files", "sweeps", "first_call_s",
                  "load_s", "weight_bytes", "cache_bytes", "memory_after_load", "memory_peak", "memory_counter",
                  "graphs", "graph_breaks", "prompt_tokens", "price_usd_per_hour", "bandwidth_gb_s",
                  "bandwidth_source", "hardware", "tables", "weights"]  # fmt: skip


def decode_table(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per measurement group: raw decode samples pooled over its ok files (never averaged)."""
    ok = cells[(cells.status == "ok") & cells.experiment.isin(DECODE_EXPERIMENTS)]
    rows = []
    for key, group in ok.groupby(GROUP, sort=True, dropna=False):
        values = [v for vs in group.decode_values for v in vs]
        phase = [v for vs in group.phase_values for v in vs]
        last = group.sort_values("file").iloc[-1]
        rows.append(
            {
                **dict(zip(GROUP, key, strict=True)),
                "decode_median": statistics.median(values),
                "decode_min": min(values),
                "decode_max": max(values),
                "n": len(values),
                "phase_median": statistics.median(phase) if phase else None,
                "files": list(group.file),
                "sweeps": sorted(set(group.sweep)),
                "by_sweep": {
                    sweep: {
                        "median": statistics.median([v for vs in cells.decode_values for v in vs]),
                        "n": sum(len(vs) for vs in cells.decode_values),
                        "files": list(cells.file),
                    }
                    for sweep, cells in group.groupby("sweep", sort=True)
                },
                "first_call_s": statistics.median(group.first_call_s),
                "load_s": statistics.median(group.load_s),
                "weight_bytes": last.weight_bytes,
                "cache_bytes": last.cache_bytes,
                "memory_after_load": last.memory_after_load,
                "memory_peak": last.memory_peak,
                "memory_counter": last.memory_counter,
                "graphs": last.graphs,
                "graph_breaks": last.graph_breaks,
                "prompt_tokens": last.prompt_tokens,
                "price_usd_per_hour": last.price_usd_per_hour,
                "bandwidth_gb_s": last.bandwidth_gb_s,
                "bandwidth_source": last.bandwidth_source,
                "hardware": last.hardware,
                "tables": last.tables,
                "weights": last.weights,
            }
        )
    if not rows:  # no decode cell: the columns still exist, so templates can filter the empty table
        return pd.DataFrame(columns=[*GROUP, *DECODE_COLUMNS, "key", "label"])
    table = pd.DataFrame(rows)
    table["key"] = table.apply(_key, axis=1)
    table["label"] = table.apply(_label, axis=1)
    return table


def _key(row: pd.Series) -> str:
    """The row's name in arithmetic.txt keys (with the engine before it)."""
    engine = f"/{row.engine_config.replace(' ', ',')}" if row.engine_config else ""
    return (
        f"{row.model}/{row.checkpoint}/{row.device}/ctx{row.context}/{row['dtype']}/N={row.max_new_tokens}"
        f"/read_every={row.read_every}{engine}"
    )


def _label(row: pd.Series) -> str:
    """The row's name for a reader (plots)."""
    stream = f", read_every={row.read_every}" if row.read_every else ""
    backend = next((p for p in row.engine_config.split() if p.startswith("backend=")), "")
    backend = f", {backend}" if backend else ""
    return f"{row.engine} ({row.model}, {row.device}, ctx {row.context}, N={row.max_new_tokens}{stream}{backend})"
