"""The decode table, rendered by ``decode.md.j2`` beside this file (its JAX rows also by
``templates/jax.md.j2``; plotted by ``reports.plots``): one row per measurement group (``cells.GROUP``:
settings, prompt, environment fingerprint and A/A replica), the raw decode samples of its VALID cells
pooled, never averaged: their median with its 95% interval and n (``decode``), min and max, and each
sweep's own in ``by_sweep``; beside them the other figures an article prints for a way (the streamed rate
measured inside the cell, warm 1- and N-token call seconds, N over the warm N-token call, memory with the
cache) and the group's method key (``reports.method``). A group without a VALID cell is still a row
(``verdict`` INVALID, pooled over all its cells, so that ``reports.compare`` can show it); the report's
headline shows VALID rows only and names every cell it left out (``left_out``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import pandas as pd

from decodebench.evidence import DECODE_EXPERIMENTS
from reports.labels import footnotes, short_labels
from reports.tables.cells import GROUP
from reports.uncertainty import sampled
from reports.verdicts import INVALID, VALID, Verdict

DECODE_COLUMNS = ["decode", "decode_values", "bandwidth_at_pairs_values", "decode_median", "decode_low", "decode_high",
                  "decode_min", "decode_max", "n", "phase", "phase_median", "first_call", "first_call_s", "load",
                  "load_s", "files", "sweeps", "by_sweep", "verdict", "left_out", "weight_bytes", "cache_bytes",
                  "memory_after_load", "memory_peak", "memory_counter", "graphs", "graph_breaks", "price_usd_per_hour",
                  "price_note", "bandwidth_gb_s", "bandwidth_note", "bandwidth_source", "peak_tflops", "peak_source",
                  "hardware", "tables", "weights", "product_bytes", "streamed", "streamed_values", "warm_1", "warm_n",
                  "n_over_warm_n", "memory_with_cache", "method", "settings_without_effect"]  # fmt: skip


def decode_table(cells: pd.DataFrame, verdicts: dict[str, Verdict]) -> pd.DataFrame:
    """One row per measurement group of ok decode cells: the samples of its VALID cells pooled (of all its
    cells when none is VALID); ``verdicts``: every cell's, by file (``reports.verdicts.judge``)."""
    ok = cells[(cells.status == "ok") & cells.experiment.isin(DECODE_EXPERIMENTS)]
    rows = []
    for key, group in ok.groupby(GROUP, sort=True, dropna=False):
        group = group.sort_values("file")
        valid = group[[verdicts[f].valid for f in group.file]]
        used = valid if not valid.empty else group
        values = _pooled(used.decode_values)
        decode = sampled(values)
        phase = sampled(_pooled(used.phase_values))
        first_call, load = sampled(used.first_call_s.dropna().tolist()), sampled(used.load_s.dropna().tolist())
        streamed, warm_n, n = _pooled(used.streamed_values), _pooled(used.warm_n_values), _n_of(used)
        last = used.iloc[-1]
        price, price_note = _agreed(used, "price_usd_per_hour", "USD/h")
        bandwidth, bandwidth_note = _bandwidth(used)
        rows.append(
            {
                **dict(zip(GROUP, key, strict=True)),
                "decode": decode,
                "decode_values": values,
                "bandwidth_at_pairs_values": _reads_at_pairs(used),
                "decode_median": None if decode is None else decode.value,
                "decode_low": None if decode is None else decode.low,
                "decode_high": None if decode is None else decode.high,
                "decode_min": min(values, default=None),
                "decode_max": max(values, default=None),
                "n": len(values),
                "phase": phase,
                "phase_median": None if phase is None else phase.value,
                "first_call": first_call,
                "first_call_s": None if first_call is None else first_call.value,
                "load": load,
                "load_s": None if load is None else load.value,
                "files": list(used.file),
                "sweeps": sorted(set(used.sweep)),
                "by_sweep": {sweep: _run(run) for sweep, run in used.groupby("sweep", sort=True)},
                "verdict": VALID if not valid.empty else INVALID,
                "left_out": [verdicts[f] for f in group.file if not verdicts[f].valid],
                "weight_bytes": last.weight_bytes,
                "cache_bytes": last.cache_bytes,
                "memory_after_load": last.memory_after_load,
                "memory_peak": last.memory_peak,
                "memory_counter": last.memory_counter,
                "graphs": last.graphs,
                "graph_breaks": last.graph_breaks,
                "price_usd_per_hour": price,
                "price_note": price_note,
                "bandwidth_gb_s": bandwidth,
                "bandwidth_note": bandwidth_note,
                "bandwidth_source": ", ".join(sorted({str(s) for s in used.bandwidth_source.dropna()})) or None,
                "peak_tflops": _agreed(used, "peak_tflops", "TFLOP/s")[0],
                "peak_source": ", ".join(sorted({str(s) for s in used.peak_source.dropna()})) or None,
                "hardware": ", ".join(sorted({str(h) for h in used.hardware.dropna()})) or None,
                "tables": last.tables,
                "weights": last.weights,
                "product_bytes": last.product_bytes,
                "streamed": sampled(streamed),
                "streamed_values": streamed,
                "warm_1": sampled(_pooled(used.warm_1_values)),
                "warm_n": sampled(warm_n),
                "n_over_warm_n": sampled([n / t for t in warm_n]) if n else None,
                "memory_with_cache": last.memory_with_cache,
                "method": last.method,
                "settings_without_effect": last.settings_without_effect,
            }
        )
    if not rows:  # no decode cell: the columns still exist, so templates can filter the empty table
        return pd.DataFrame(columns=[*GROUP, *DECODE_COLUMNS, "key", "label", "way_label"])
    table = pd.DataFrame(rows)
    table["key"] = table.apply(_key, axis=1)
    table["label"] = table.apply(_label, axis=1)
    table["way_label"] = short_labels(table)
    return table


def _n_of(cells: pd.DataFrame) -> float | None:
    """N of a group's cells (they share it); None in evidence that did not record it."""
    n = cells.max_new_tokens.iloc[-1]
    return None if pd.isna(n) else n


def _pooled(lists: pd.Series) -> list[float]:
    return [v for vs in lists for v in vs]


def _reads_at_pairs(cells: pd.DataFrame) -> list[float]:
    """The streaming reads after the pairs of a row's files, pooled in the order of its decode samples, one for each;
    none unless every file recorded one for each of its samples."""
    aligned = all(len(reads) == len(rates) for reads, rates in zip(cells.bandwidth_at_pairs_values,
                                                                   cells.decode_values, strict=True))  # fmt: skip
    return _pooled(cells.bandwidth_at_pairs_values) if aligned else []


def _run(cells: pd.DataFrame) -> dict[str, Any]:
    """One sweep's part of a row: its pooled samples, their median with its interval, and its files."""
    values = _pooled(cells.decode_values)
    return {"values": values, "interval": sampled(values), "files": list(cells.file)}


def _agreed(cells: pd.DataFrame, column: str, unit: str) -> tuple[Any, str | None]:
    """The value every file of a row records in ``column`` (None when none does), or None and a note
    naming each file's value when they disagree: a figure derived from it would be one file's, not the row's."""
    recorded = cells[cells[column].notna()]
    values = sorted(set(recorded[column]))
    if len(values) <= 1:
        return (values[0] if values else None), None
    each = ", ".join(f"{v:g} {unit} in `{f}`" for f, v in zip(recorded.file, recorded[column], strict=True))
    return None, f"the row's files record different {column} ({each}): no single value to use"


def _bandwidth(cells: pd.DataFrame) -> tuple[float | None, str | None]:
    """The row's memory bandwidth in GB/s: the one its files record, or, when each sweep measured its own,
    their median, said in a note with every file's value."""
    value, note = _agreed(cells, "bandwidth_gb_s", "GB/s")
    if note is None:
        return value, None
    median = statistics.median(cells.bandwidth_gb_s.dropna())
    return median, note.replace("no single value to use", f"their median {median:.4g} GB/s is used")


def _key(row: pd.Series) -> str:
    """The row's name in arithmetic.txt keys (with the engine before it): settings, prompt tokens (P), the
    code (where the evidence names its commit), environment fingerprint (env) and, for an A/A copy, its
    replica."""
    engine = f"/{row.engine_config.replace(' ', ',')}" if row.engine_config else ""
    replica = f"/replica={row.replica}" if row.replica else ""
    batch = f"/B={int(row.batch)}" if row.batch > 1 else ""
    prompt = "" if pd.isna(row.prompt_tokens) else f"/P={int(row.prompt_tokens)}"
    way = f"/way={row.way}" if isinstance(row.way, str) else ""
    code = f"/code={row.code}" if row.code else ""
    return (
        f"{row.model}/{row.checkpoint}/{row.device}/ctx{row.context}{prompt}/{row['dtype']}/N={_count(row.max_new_tokens)}"
        f"{batch}/read_every={row.read_every}{engine}{way}{code}/env={row.fingerprint}{replica}"
    )


def _count(value: Any) -> Any:
    """A token count read back as a float (its column holds None for cells without it) as the integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _label(row: pd.Series) -> str:
    """The row's name for a reader (plots)."""
    stream = f", read_every={row.read_every}" if row.read_every else ""
    backend = next((p for p in row.engine_config.split() if p.startswith("backend=")), "")
    backend = f", {backend}" if backend else ""
    replica = f", replica {row.replica}" if row.replica else ""
    way = f", way {row.way}" if isinstance(row.way, str) else ""
    batch = f", batch {int(row.batch)}" if row.batch > 1 else ""
    where = f"{row.model}, {row.device}, ctx {row.context}, N={_count(row.max_new_tokens)}{batch}"
    code = f" @ {row.code}" if row.code else ""
    return f"{row.engine} ({where}{stream}{backend}{way}{replica}, env {row.fingerprint}{code})"


@dataclass(frozen=True)
class Headline:
    """One model and device's headline decode table: its ``title``, its VALID ``rows`` (each with its footnote
    ``mark``) and the ``notes`` naming each mark's environment and code."""

    title: str
    rows: pd.DataFrame
    notes: list[str]


HEADLINE_ORDER = ["context", "max_new_tokens", "decode_median"]


def headline_tables(decode: pd.DataFrame) -> list[Headline]:
    """The VALID rows of ``decode`` as one table per model, device and device name, by context and N, fastest
    first; environment and code as footnotes (``reports.labels.footnotes``)."""
    tables = []
    for (model, device, name), rows in decode.groupby(["model", "device", "device_name"], sort=True):
        rows = rows.sort_values(HEADLINE_ORDER, ascending=[True, True, False])
        marks, notes = footnotes(rows)
        synthetic = ", synthetic weights" if rows.synthetic.any() else ""
        title = f"{model} on {device}" + (f" ({name})" if name else "") + synthetic
        tables.append(Headline(title, rows.assign(mark=marks), notes))
    return tables


def left_out(table: pd.DataFrame) -> pd.DataFrame:
    """What the headline left out of ``table`` (a decode table): each row with no VALID cell (``whole``) and
    each VALID row that left some of its files out (``partial_files``), with those files' verdicts."""
    rows = [
        {
            "label": row.label,
            "engine": row.engine,
            "priced": row.price_usd_per_hour is not None and not pd.isna(row.price_usd_per_hour),
            "whole": row.verdict != VALID,
            "partial_files": 0 if row.verdict != VALID else len(row.left_out),
            "verdicts": row.left_out,
        }
        for _, row in table.iterrows()
        if row.left_out
    ]
    return pd.DataFrame(rows, columns=["label", "engine", "priced", "whole", "partial_files", "verdicts"])
