"""Plots beside the report (matplotlib, Agg, PNG without timestamps so re-rendering is byte-stable)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

SAVE = {"dpi": 100, "metadata": {"Software": None}}


def decode_rates(decode: pd.DataFrame, out: Path) -> str | None:
    if decode.empty:
        return None
    rows = decode.sort_values(["model", "device", "decode_median"])
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    labels = list(rows.label)
    ax.barh(labels, rows.decode_median, color="#4477aa")
    median = rows.decode_median.astype(float)
    low, high = (rows[c].astype(float).fillna(median) for c in ("decode_low", "decode_high"))
    ax.errorbar(median, labels, xerr=[median - low, high - median], fmt="none",
                ecolor="black", capsize=3)  # fmt: skip
    ax.set_xlabel("decode tok/s (median, bars: 95% interval; none below two samples)")
    ax.set_title("Decode rate per engine (measured)")
    fig.tight_layout()
    fig.savefig(out, **SAVE)
    plt.close(fig)
    return out.name


def decode_vs_context(decode: pd.DataFrame, out: Path) -> str | None:
    lines = ["engine", "engine_config", "model", "device", "read_every"]  # one line per way (attend=... apart)
    multi = decode.groupby(lines).filter(lambda g: g.context.nunique() > 1)
    if multi.empty:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for (engine, config, model, device, read_every), group in multi.groupby(lines):
        group = group.sort_values("context")
        way = " ".join(p for p in config.split() if p.startswith(("attend=", "last_piece=", "weights=")))
        label = f"{engine}{' ' + way if way else ''} ({model}, {device}, r={read_every})"
        ax.plot(group.context, group.decode_median, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (cache slots)")
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title("Decode rate against context (measured)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, **SAVE)
    plt.close(fig)
    return out.name


def memory(decode: pd.DataFrame, out: Path) -> str | None:
    rows = decode.dropna(subset=["memory_after_load"])
    if rows.empty:
        return None
    rows = rows.sort_values(["model", "device", "engine", "context"])
    labels = list(rows.label)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], rows.memory_peak / 1e9, height=0.4, label="peak", color="#cc6677")
    ax.barh([i - 0.2 for i in y], rows.memory_after_load / 1e9, height=0.4, label="after load", color="#117733")
    ax.set_yticks(list(y), labels)
    ax.set_xlabel("GB (counter named in the report table)")
    ax.set_title("Memory per engine (measured)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, **SAVE)
    plt.close(fig)
    return out.name


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
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    colors = ["#cc3311" if c == "REGRESSION" else "#4477aa" for c in rows.change]
    ax.barh(list(rows.label), change, color=colors)
    ax.errorbar(change, list(rows.label), xerr=[below, above], fmt="none", ecolor="black", capsize=3)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axvline(-100 * threshold, color="#cc3311", linestyle="--", linewidth=0.8, label=f"-{threshold:.0%} threshold")
    ax.set_xlabel("B / A - 1, % (decode tok/s; bars: 95% interval)")
    ax.set_title("B against A (measured)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, **SAVE)
    plt.close(fig)
    return out.name


def profile_bars(profile: pd.DataFrame, out: Path) -> str | None:
    """One stacked bar per profile cell: each class's ms a token; a tick at the floor (all bytes at bandwidth)."""
    if profile.empty:
        return None
    cells = list(dict.fromkeys(profile.file))
    by_cell = profile.groupby("file", sort=False)
    labels = [f"{p.engine.iloc[0]} ({p.model.iloc[0]}, {p.device.iloc[0]})" for _, p in by_cell]
    classes = list(dict.fromkeys(profile["class"]))
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(cells) + 2.2))
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
    ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    fig.tight_layout()
    fig.savefig(out, **SAVE)
    plt.close(fig)
    return out.name


def load_curves(load: pd.DataFrame, out: Path) -> str | None:
    """Latency against output throughput, one line per load cell through its levels: TTFT p50 and TPOT p50
    on two panels, each with its cell's SLO as a dashed line (measured; the SLO is the user's setting)."""
    if load.empty:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for _, cell in load.groupby("file", sort=False):
        label = f"{cell.engine.iloc[0]} ({cell.model.iloc[0]}, {cell.device.iloc[0]})"
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
    fig.tight_layout()
    fig.savefig(out, **SAVE)
    plt.close(fig)
    return out.name
