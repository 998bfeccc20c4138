"""The batch table (``batch.md.j2`` beside this file): each way measured at more than one batch (``experiment.batch``),
a row per B with its aggregate rate, per-sequence rate, gain over its own B=1, memory, roofline, matmul ceiling and
cost; and the peers served at the same concurrency (``experiment=load``) beside them."""

from __future__ import annotations

import pandas as pd

from reports.labels import SEPARATOR, footnotes, short_labels
from reports.tables.cells import GROUP
from reports.verdicts import VALID

SCAN = [key for key in GROUP if key != "batch"]  # a way's rows at each B: one measurement group but for B
BATCH_COLUMNS = ["way", "model", "device", "context", "max_new_tokens", "batch", "decode", "decode_median",
                 "per_sequence", "x_batch_1", "memory_peak", "roofline_pct_shown", "matmul_pct_shown",
                 "usd_per_mtok_shown", "verdict"]  # fmt: skip


def without_batch(label: str) -> str:
    """A way's short label less its ``B=`` part: the way that the rows of one batch scan share."""
    return SEPARATOR.join(part for part in label.split(SEPARATOR) if not part.startswith("B="))


def batch_table(derived: pd.DataFrame) -> pd.DataFrame:
    """One row per (way, B) of every decode row whose way was measured at more than one batch (the rows of one
    measurement group but for B: one environment and code, marked as the decode table marks them, with
    ``attrs["footnotes"]`` saying which), VALID or not (its
    verdict beside it: a peer whose parity fails is still the figure a reader compares with): the median aggregate
    rate with its interval (``decode``: every sequence's tokens a second), the per-sequence rate (aggregate / B: each
    sequence's (N-1)/(T_N - T_1)), ``x_batch_1`` the aggregate over the same way's at B=1 (None without one), peak
    memory, and the roofline, the share of the bf16 matmul rate its products reach and USD/Mtok the arithmetic derived
    for the row (VALID rows only)."""
    if derived.empty or not (derived.batch > 1).any():
        return pd.DataFrame(columns=BATCH_COLUMNS)
    rows = []
    scans = [way.sort_values("batch") for _, way in derived.groupby(SCAN, sort=True, dropna=False)
             if (way.batch > 1).any()]  # fmt: skip
    scanned = pd.concat(scans)
    row_marks, notes = footnotes(scanned)
    marks = dict(zip(scanned.index, row_marks, strict=True))
    for way in scans:
        one = way[way.batch == 1].decode_median
        for i, r in way.iterrows():
            rows.append({"way": without_batch(r.way_label) + marks[i], "model": r.model, "device": r.device,
                         "context": r.context, "max_new_tokens": r.max_new_tokens, "batch": int(r.batch),
                         "decode": r.decode, "decode_median": r.decode_median,
                         "per_sequence": r.decode_median / r.batch,
                         "x_batch_1": r.decode_median / one.iloc[0] if not one.empty else None,
                         "memory_peak": r.memory_peak,
                         "roofline_pct_shown": r.roofline_pct_shown if r.verdict == VALID else "–",
                         "matmul_pct_shown": r.matmul_pct_shown if r.verdict == VALID else "–",
                         "usd_per_mtok_shown": r.usd_per_mtok_shown if r.verdict == VALID else "–",
                         "verdict": r.verdict if r.verdict == VALID else _why(r)})  # fmt: skip
    table = pd.DataFrame(rows, columns=BATCH_COLUMNS)
    table.attrs["footnotes"] = notes  # each mark's environment and code
    return table


def _why(row: pd.Series) -> str:
    """An INVALID row's verdict with its first reason, cut short (the verdict table has them in full)."""
    reasons = [v.text() for v in row.left_out] if isinstance(row.left_out, list) else []
    return (reasons[0] if reasons else str(row.verdict))[:90]


def served_at_concurrency(load: pd.DataFrame, levels: list[int]) -> pd.DataFrame:
    """Each load cell's output tok/s and TTFT p50 at concurrency ``levels`` (the batches measured): one row per
    served way (engine, its weights, ``max_batch``, where the generator ran), a ``c<N>`` and ``ttft_c<N>`` column
    per level (None where that cell ran no such level)."""
    columns = ["way", "model", "generator", "file"] + [f"{p}{c}" for c in levels for p in ("c", "ttft_c")]
    closed = load[load["mode"] == "concurrency"] if not load.empty else load
    if closed.empty or not levels:
        return pd.DataFrame(columns=columns)
    firsts = closed.groupby("file", sort=True).head(1).assign(read_every=0, way=None, replica=0, batch=1)
    labels = dict(zip(firsts.file, short_labels(firsts.reset_index(drop=True)), strict=True))
    rows = []
    for file, cell in closed.groupby("file", sort=True):
        first = cell.iloc[0]
        way = labels[file] + (f" ({first.serving})" if first.serving else "")
        at = cell.set_index("level")
        row = {"way": way, "model": first.model, "generator": first.generator, "file": file}
        for c in levels:
            level = f"c{c}"  # a closed-loop level's name (serving.aiperf.Level)
            row[f"c{c}"] = at.at[level, "output_tok_s"] if level in at.index else None
            row[f"ttft_c{c}"] = at.at[level, "ttft_p50"] if level in at.index else None
        rows.append(row)
    return pd.DataFrame(rows, columns=columns).sort_values(["model", "way", "generator"], ignore_index=True)
