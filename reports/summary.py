"""The report's first screen: per model and device, the answer a reader came for, in sentences generated from the
report's own tables (never typed), each linking to the section that holds its figures.

* **Fastest**: the fastest VALID in-process way at one sequence and the smallest context measured, its rate [95%
  interval] n, its multiple of ``generate``, its fraction of the roofline, first call and peak memory.
* **Batched**: each way measured at several batches, its rate (every sequence's tokens a second) at each.
* **Peers**: each peers table's own verdict sentence (``reports.tables.peers``).
* **Long context**: the fastest VALID way at the largest context measured, and its recall where measured.
* **Serving**: output tok/s and TTFT p50 at concurrency 1 and 4 per load cell (``reports.tables.load``).
* **Left out**: the cells that are not VALID (INVALID, FAILED, SKIPPED, a failed parity check), counted, with one
  line per reason.
* **The articles**: whether the published order of the articles' ways holds among those measured here, said as an
  order only when the hardware or the weights are not the article's (``same method, other hardware``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pandas as pd

from reports import method, uncertainty
from reports.like_for_like import RATE_METRICS, ways_of
from reports.tables.batch import batch_table, served_at_concurrency
from reports.tables.peers import PeerTable
from reports.verdicts import FAILED, INVALID, SKIPPED, Verdict

LONG_CONTEXT = 4096  # tokens: a decode row at this context or above speaks for long context
MOST_REASONS = 6  # reasons listed per screen; the rest are counted and left to *Verdict per cell*
LEVELS = (1, 4)  # the load levels (concurrency) the first screen quotes


@dataclass(frozen=True)
class Screen:
    """One model and device's first screen: ``title`` and its sentences (Markdown, each ending in its link)."""

    title: str
    lines: list[str]


def anchor(heading: str) -> str:
    """The link to a Markdown heading as GitHub and most renderers name it (``#decode-every-way-of-...``)."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    return f"#{slug}"


DECODE = anchor("Decode: every way of running the model")
PEERS = anchor("Peers: the servers a user would run instead")
RECALL = anchor("Long prompts and recall")
LOAD = anchor("Load: latency against throughput, several requests at a time")
VERDICTS = anchor("Verdict per cell")
COVERAGE = anchor("Coverage of the articles' tables")


def screens(
    decode: pd.DataFrame,
    cells: pd.DataFrame,
    verdicts: dict[str, Verdict],
    peers: list[PeerTable],
    load: pd.DataFrame,
    recall: pd.DataFrame,
    figures: pd.DataFrame,
) -> list[Screen]:
    """One screen per (model, device, device name) with any cell. ``decode``: the VALID decode rows with their
    derived columns (``reports.arithmetic.with_derived_columns``) and ``way_label``; ``cells``/``verdicts``: every
    cell and its verdict; ``peers``, ``load``, ``recall``: the report's tables; ``figures``: the published ones."""
    out = []
    for (model, device, name), group in cells.groupby(["model", "device", "device_name"], sort=True):
        rows = decode[(decode.model == model) & (decode.device == device) & (decode.device_name == name)]
        synthetic = bool(group.synthetic.any())
        title = f"{model} on {device}" + (f" ({name})" if name else "") + (", synthetic weights" if synthetic else "")
        lines = [
            _fastest(rows[rows.batch == 1]),
            _batched(rows),
            *[f"Peers ({t.title.split(': ', 1)[-1]}): {t.verdict} [→ peers]({PEERS})" for t in peers
              if t.model == model and t.device == device],  # fmt: skip
            _long_context(rows, recall[(recall.model == model) & (recall.device == device)]),
            _serving(load[(load.model == model) & (load.device == device)]),
            _left_out(group, verdicts),
            _articles(rows, figures, synthetic),
        ]
        out.append(Screen(title, [line for line in lines if line]))
    return out


def _in_process(rows: pd.DataFrame) -> pd.DataFrame:
    """The bare rows of engines that run in the cell's own process (no peer, no endpoint)."""
    bare = pd.Series([m.get("served") == "bare" for m in rows.method], index=rows.index, dtype=bool)
    return rows[bare & ~rows.engine.isin(method.ENDPOINT_ENGINES)]


def _describe(row: pd.Series) -> str:
    """A decode row in one clause: its label, rate [interval] n, context and N."""
    rate = uncertainty.figure(row.decode, uncertainty.decimals(2), "tok/s")
    return f"**{row.way_label}** {rate} (context {row.context}, N={int(row.max_new_tokens)})"


def _roofline(row: pd.Series) -> str:
    """The row's share of its roofline: by the sweep's read, or, where it has none (above that read, within the ones
    at its cells: ``reports.verdicts``), at the reads after its pairs."""
    if row.roofline_pct_shown != "–":
        return f"{row.roofline_pct_shown} of its roofline"
    if row.get("roofline_at_pairs_pct_shown", "–") != "–":
        return f"{row.roofline_at_pairs_pct_shown} of its roofline at its reads (none by the sweep's read)"
    return "no roofline"


def _fastest(rows: pd.DataFrame) -> str:
    ways = _in_process(rows)
    if ways.empty:
        return f"Fastest way: no in-process decode row is VALID here. [→ decode]({DECODE})"
    at = ways[ways.context == ways.context.min()]
    best = at.loc[at.decode_median.astype(float).idxmax()]
    extras = [
        f"{best.x_generate_shown} generate" if best.x_generate_shown != "–" else "no generate row to divide by",
        _roofline(best),
        f"first call {best.first_call.value:.1f} s" if best.first_call is not None else "first call not measured",
        f"peak {best.memory_peak / 1e9:.2f} GB" if pd.notna(best.memory_peak) else "peak not measured",
    ]
    return f"Fastest VALID way: {_describe(best)}: {', '.join(extras)}. [→ decode]({DECODE})"


def _batched(rows: pd.DataFrame) -> str | None:
    """Each way measured at more than one batch: its aggregate rate at each (the batch table's rows,
    ``reports.tables.batch``); None when no row here decoded more than one sequence a step."""
    table = batch_table(rows)
    if table.empty:
        return None
    parts = []
    for (way, context, n), scan in table.groupby(["way", "context", "max_new_tokens"], sort=True):
        rates = ", ".join(f"B={r.batch} {r.decode_median:.2f}" for _, r in scan.iterrows())
        best = scan.loc[scan.decode_median.astype(float).idxmax()]
        shown = best.matmul_pct_shown
        matmul = f", its products at {shown} of the bf16 matmul rate" if shown != "–" else ""
        gain = f" ({best.x_batch_1:.2f}x B=1 at B={best.batch}{matmul})" if pd.notna(best.x_batch_1) else ""
        parts.append(f"**{way}** {rates} tok/s{gain} (context {context}, N={int(n)})")
    return f"Batched decode (every sequence's tokens a second): {'; '.join(parts)}. [→ decode]({DECODE})"


def _long_context(rows: pd.DataFrame, recall: pd.DataFrame) -> str:
    long = rows[rows.context >= LONG_CONTEXT]
    if long.empty:
        return f"Long context: no VALID decode row at {LONG_CONTEXT:,} tokens or more here. [→ recall]({RECALL})"
    at = long[long.context == long.context.max()]
    best = at.loc[at.decode_median.astype(float).idxmax()]
    found = recall[(recall.engine == best.engine) & (recall.context == best.context)]
    answered = (
        f"; recall {int(found.found.fillna(False).astype(bool).sum())} of {len(found)} prompts found"
        if not found.empty
        else "; recall not measured for it"
    )
    return f"Long context: fastest VALID way at the largest context, {_describe(best)}{answered}. [→ recall]({RECALL})"


def _serving(load: pd.DataFrame) -> str:
    if load.empty:
        return f"Serving under load: not measured here (`experiment=load`). [→ load]({LOAD})"
    served = served_at_concurrency(load, list(LEVELS)).dropna(subset=[f"c{c}" for c in LEVELS])
    if served.empty:
        return f"Serving under load: no load cell ran both c1 and c4. [→ load]({LOAD})"
    listed = "; ".join(
        f"{r.way} [generator {r.generator}] {r.c1:.2f} / {r.c4:.2f} tok/s, TTFT p50 {r.ttft_c1:.2f} / {r.ttft_c4:.2f} s"
        for _, r in served.sort_values("c4", ascending=False, kind="stable").iterrows()
    )
    return f"Serving under load (output tok/s and TTFT p50 at c1 / c4, best at c4 first): {listed}. [→ load]({LOAD})"


def _left_out(cells: pd.DataFrame, verdicts: dict[str, Verdict]) -> str:
    """Every cell that does not count, by verdict, with one line per distinct reason (its cells named)."""
    reasons: dict[tuple[str, str], list[str]] = {}
    for _, cell in cells.sort_values("file").iterrows():
        verdict = verdicts[cell.file]
        if cell.experiment == "parity" and cell.status == "ok":
            if cell.parity_verdict == "pass":
                continue
            kind, why = "parity failed", f"the {cell['dtype']} check did not pass"
        elif verdict.valid:
            continue
        else:
            kind, why = verdict.verdict, _first_rule(verdict)
        name = cell.engine + (f"·{cell.weights}" if cell.weights not in (None, "dense") else "")
        reasons.setdefault((kind, why), []).append(f"{name} {cell.experiment}")
    if not reasons:
        return f"Left out: nothing; every cell is VALID and every parity check passed. [→ verdicts]({VERDICTS})"
    counts = {k: sum(len(v) for (kind, _), v in reasons.items() if kind == k)
              for k in (INVALID, FAILED, SKIPPED, "parity failed")}  # fmt: skip
    head = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    listed = [f"{kind}: {why} ({', '.join(dict.fromkeys(names))})"
              for (kind, why), names in list(reasons.items())[:MOST_REASONS]]  # fmt: skip
    more = len(reasons) - MOST_REASONS
    tail = f"; and {more} more reasons" if more > 0 else ""
    return f"Left out: {head}. " + "; ".join(listed) + f"{tail}. [→ verdicts]({VERDICTS})"


def _first_rule(verdict: Verdict) -> str:
    """A verdict's first broken rule (a FAILED or SKIPPED cell: its reason), its first line; an INVALID cell's cut
    at its figure."""
    text = verdict.broken[0].strip() if verdict.broken and verdict.broken[0].strip() else verdict.verdict
    text = text.splitlines()[0]
    return re.split(r" \(|: ", text, maxsplit=1)[0] if verdict.verdict == INVALID else text[:160]


def published_rates(figures: pd.DataFrame) -> dict[str, float]:
    """The articles' decode rate per way (``conf/way`` name), the first printed for it: its value, or the middle
    of a printed range."""
    rates: dict[str, float] = {}
    for _, fig in figures[figures.metric.isin(RATE_METRICS)].iterrows():
        value = fig.value if pd.notna(fig.value) else (fig["min"] + fig["max"]) / 2
        for way in ways_of(fig.method if isinstance(fig.method, dict) else {}) if pd.notna(value) else []:
            rates.setdefault(way, float(value))
    return rates


def _articles(rows: pd.DataFrame, figures: pd.DataFrame, synthetic: bool) -> str:
    """Whether the articles' order of their ways holds among the ways measured here: every pair of ways with a
    published rate and a VALID row here, compared by their medians."""
    published = published_rates(figures)
    measured: dict[str, Any] = {}
    for _, row in rows.sort_values("replica").iterrows():
        if isinstance(row.way, str) and row.way in published:
            measured.setdefault(row.way, row)
    hardware = "other hardware" if not _article_hardware(rows) or synthetic else "the article's hardware"
    if len(measured) < 2:
        return (f"The articles: {len(measured)} of their ways measured VALID here, no order to test "
                f"(`make reproduce` runs them by name). [→ coverage]({COVERAGE})")  # fmt: skip
    ways = sorted(measured, key=lambda w: -published[w])
    pairs = [(a, b) for i, a in enumerate(ways) for b in ways[i + 1:] if published[a] != published[b]]
    broken = [(a, b) for a, b in pairs if measured[a].decode_median <= measured[b].decode_median]
    head = f"The articles' order of the {len(ways)} ways of theirs measured here ({hardware}: an order, no ratio)"
    if not broken:
        return f"{head} holds: all {len(pairs)} pairs. [→ coverage]({COVERAGE})"
    shown = "; ".join(f"{a} ahead of {b} there ({published[a]:g} against {published[b]:g} tok/s), not here "
                      f"({measured[a].decode_median:.2f} against {measured[b].decode_median:.2f})"
                      for a, b in broken[:3])  # fmt: skip
    return f"{head} does not hold for {len(broken)} of {len(pairs)} pairs: {shown}. [→ coverage]({COVERAGE})"


def _article_hardware(rows: pd.DataFrame) -> bool:
    """Whether the rows ran on the articles' hardware (a TPU v5e-1)."""
    return bool((rows.hardware.fillna("") == "tpu-v5e-1").any())


def plain(screens_: list[Screen]) -> str:
    """The screens as terminal text: the same sentences, links and emphasis taken out."""
    lines = []
    for s in screens_:
        lines.append(s.title)
        for line in s.lines:
            text = re.sub(r" ?\[→ [^\]]+\]\([^)]*\)", "", line).replace("**", "")
            lines.append(f"  - {text}")
    return "\n".join(lines)

