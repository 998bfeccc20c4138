"""Plots beside the report (matplotlib, Agg, PNG without timestamps so re-rendering is byte-stable).

Every plot is laid out by matplotlib's constrained layout and saved through ``save``, which refuses a figure whose
drawn text (tick labels, titles, legends, notes) reaches past its canvas: it widens the figure until everything
fits, and raises when it cannot; the PNG is written whole or not at all. Rows are named by their short way labels
(``reports.labels``), with the legend's settings in the report.
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from decodebench.files import write_bytes_atomic  # noqa: E402
from reports.labels import SEPARATOR, footnotes  # noqa: E402

SAVE = {"dpi": 100, "metadata": {"Software": None}}
SLACK_IN = 0.01  # inches a drawn text may reach past the canvas (rounding), no more
GROW = 1.25  # how much wider (and a little taller) each try makes a figure whose text does not fit
TRIES = 5


def overflow(fig: Figure) -> float:
    """How far, in inches, the figure's drawn artists (text included) reach past its canvas on any side; 0 when
    everything is inside."""
    fig.canvas.draw()
    tight = fig.get_tightbbox(fig.canvas.get_renderer())
    width, height = fig.get_size_inches()
    return max(0.0, -tight.x0, -tight.y0, tight.x1 - width, tight.y1 - height)


def save(fig: Figure, out: Path) -> str:
    """Saves ``fig`` as ``out`` once nothing is cut off (widening it up to ``TRIES`` times); ValueError when text
    still reaches past the canvas. Returns the file's name."""
    try:
        for _ in range(TRIES):
            if overflow(fig) <= SLACK_IN:
                png = io.BytesIO()
                fig.savefig(png, format="png", **SAVE)
                write_bytes_atomic(out, png.getvalue())
                return out.name
            width, height = fig.get_size_inches()
            fig.set_size_inches(width * GROW, height * (1 + (GROW - 1) / 4))
        raise ValueError(f"{out.name}: text reaches {overflow(fig):.2f} in past the canvas after {TRIES} tries")
    finally:
        plt.close(fig)


def _names(rows: pd.DataFrame) -> list[str]:
    """Each row's name in a plot: its short way label, then only what varies among the plotted rows (model,
    device, context, N), then its environment's footnote mark."""
    marks, _ = footnotes(rows)
    parts = {c: rows[c].nunique() > 1 for c in ("model", "device", "context", "max_new_tokens")}
    names = []
    for (_, r), mark in zip(rows.iterrows(), marks, strict=True):
        bits = [r.way_label]
        bits += [str(r.model)] if parts["model"] else []
        bits += [str(r.device)] if parts["device"] else []
        bits += [f"ctx {r.context}"] if parts["context"] else []
        bits += [f"N={int(r.max_new_tokens)}"] if parts["max_new_tokens"] else []
        names.append(" · ".join(bits) + mark)
    return names


def _notes(fig: Figure, rows: pd.DataFrame) -> None:
    """The environment footnotes of ``rows`` under the figure, where they differ."""
    marks, notes = footnotes(rows)
    if any(marks):
        fig.supxlabel("\n".join(notes), fontsize="x-small", ha="left", x=0.01)


def decode_rates(decode: pd.DataFrame, out: Path) -> str | None:
    """Decode tok/s per VALID row (median, 95% interval), each with its roofline: the rate at which its bytes a
    token would stream at the measured bandwidth (``decode_median`` over ``roofline_pct``)."""
    if decode.empty:
        return None
    rows = decode.sort_values(["model", "device", "context", "decode_median"])
    names = _names(rows)
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.6), layout="constrained")
    median = rows.decode_median.astype(float)
    low, high = (rows[c].astype(float).fillna(median) for c in ("decode_low", "decode_high"))
    ax.barh(names, median, color="#4477aa", label="decode tok/s (median)")
    ax.errorbar(median, names, xerr=[median - low, high - median], fmt="none", ecolor="black", capsize=3)
    if "roofline_pct" in rows:
        roof = rows.roofline_pct.astype(float)
        ceiling = (median * 100 / roof).where(roof > 0)
        if ceiling.notna().any():
            ax.scatter(ceiling, names, marker="|", s=250, color="#cc3311", zorder=3,
                       label="roofline: bandwidth / bytes a token")  # fmt: skip
    ax.set_xlabel("decode tok/s (bars: 95% interval)")
    ax.set_title("Decode rate per way (measured)")
    ax.legend(fontsize="x-small", loc="lower right")
    _notes(fig, rows)
    return save(fig, out)


def decode_vs_context(decode: pd.DataFrame, out: Path) -> str | None:
    lines = ["way_label", "model", "device", "max_new_tokens"]  # one line per way
    multi = decode.groupby(lines).filter(lambda g: g.context.nunique() > 1)
    if multi.empty:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    several = {c: multi[c].nunique() > 1 for c in ("model", "device", "max_new_tokens")}
    for (way, model, device, n), group in multi.groupby(lines):
        group = group.sort_values("context")
        where = [str(model)] * several["model"] + [str(device)] * several["device"] + [f"N={int(n)}"] * several[
            "max_new_tokens"]  # fmt: skip
        ax.plot(group.context, group.decode_median, marker="o", label=" · ".join([way, *where]))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (cache slots)")
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title("Decode rate against context (measured)")
    ax.legend(fontsize="x-small")
    return save(fig, out)


def memory(decode: pd.DataFrame, out: Path) -> str | None:
    rows = decode.dropna(subset=["memory_after_load"])
    if rows.empty:
        return None
    rows = rows.sort_values(["model", "device", "way_label", "context"])
    names = _names(rows)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.6), layout="constrained")
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], rows.memory_peak / 1e9, height=0.4, label="peak", color="#cc6677")
    ax.barh([i - 0.2 for i in y], rows.memory_after_load / 1e9, height=0.4, label="after load", color="#117733")
    ax.set_yticks(list(y), names)
    ax.set_xlabel("GB (each row's counter: report, Memory)")
    ax.set_title("Memory per way (measured)")
    ax.legend(fontsize="x-small")
    _notes(fig, rows)
    return save(fig, out)


def comparison(table: pd.DataFrame, threshold: float, out: Path) -> str | None:
    """``reports.compare``'s rows: B/A - 1 in percent with its 95% interval, the threshold's line, regressions red."""
    rows = table[table.ratio.notna()]
    if rows.empty:
        return None
    change, below, above = [], [], []  # percent, and the interval's distance below and above it
    for r in rows.ratio:
        known = r.interval.known
        change.append(100 * (r.value - 1))
        below.append(100 * (r.value - r.interval.low) if known else 0.0)
        above.append(100 * (r.interval.high - r.value) if known else 0.0)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5), layout="constrained")
    colors = ["#cc3311" if c == "REGRESSION" else "#4477aa" for c in rows.change]
    ax.barh(list(rows.label), change, color=colors)
    ax.errorbar(change, list(rows.label), xerr=[below, above], fmt="none", ecolor="black", capsize=3)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axvline(-100 * threshold, color="#cc3311", linestyle="--", linewidth=0.8, label=f"-{threshold:.0%} threshold")
    ax.set_xlabel("B / A - 1, % (decode tok/s; bars: 95% interval)")
    ax.set_title("B against A (measured)")
    ax.legend(fontsize="small")
    return save(fig, out)


def profile_bars(profile: pd.DataFrame, out: Path) -> str | None:
    """One stacked bar per profile cell: each class's ms a token; a tick at the floor (all bytes at bandwidth)."""
    if profile.empty:
        return None
    cells = list(dict.fromkeys(profile.file))
    by_cell = profile.groupby("file", sort=False)
    labels = [f"{p.engine.iloc[0]} ({p.model.iloc[0]}, {p.device.iloc[0]})" for _, p in by_cell]
    classes = list(dict.fromkeys(profile["class"]))
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(cells) + 2.2), layout="constrained")
    left = [0.0] * len(cells)
    colours = plt.get_cmap("tab10")
    for k, name in enumerate(classes):
        widths = [float(profile[(profile.file == f) & (profile["class"] == name)].ms_per_token.sum()) for f in cells]
        ax.barh(labels, widths, left=left, label=name, color=colours(k % 10))
        left = [a + max(b, 0.0) for a, b in zip(left, widths, strict=True)]
    floors = [float(profile[profile.file == f].floor_ms.sum()) for f in cells]
    ax.scatter(floors, labels, marker="|", s=400, color="black", zorder=3, label="floor: bytes at measured bandwidth")
    ax.set_xlabel("ms a decode token (stacked by class)")
    ax.set_title("Where each millisecond of a decode step goes (measured)")
    fig.legend(fontsize="x-small", loc="outside lower center", ncol=3)
    return save(fig, out)


def load_curves(load: pd.DataFrame, out: Path) -> str | None:
    """Latency against output throughput, one line per load cell through its levels: TTFT p50 and TPOT p50
    on two panels, each with its cell's SLO as a dashed line (measured; the SLO is the user's setting)."""
    if load.empty:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for _, cell in load.groupby("file", sort=False):
        weights = cell.weights.iloc[0]
        serving = [cell.serving.iloc[0]] if cell.serving.iloc[0] else []  # max_batch and prompt_read, as the tables
        label = SEPARATOR.join([cell.engine.iloc[0], *([weights] if isinstance(weights, str) else []), *serving])
        label += f" ({cell.model.iloc[0]}, {cell.device.iloc[0]})"
        for ax, column in zip(axes, ("ttft_p50", "tpot_p50"), strict=True):
            ax.plot(cell.output_tok_s, cell[column], marker="o", label=label)
            for _, r in cell.iterrows():
                ax.annotate(r.level, (r.output_tok_s, r[column]), fontsize="x-small", xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
    for ax, slo, name in zip(axes, ("slo_ttft_s", "slo_tpot_s"), ("TTFT", "TPOT"), strict=True):
        for value in load[slo].unique():
            ax.axhline(value, linestyle="--", color="grey", linewidth=1)
            ax.annotate(f"SLO {value:g} s", (0, value), xycoords=("axes fraction", "data"), fontsize="x-small",
                        xytext=(2, 2), textcoords="offset points")  # fmt: skip
        ax.set_xlabel("output tok/s (all requests)")
        ax.set_ylabel(f"{name} p50, s")
        ax.set_title(f"{name} against throughput by load level")
    axes[0].legend(fontsize="x-small")
    return save(fig, out)
