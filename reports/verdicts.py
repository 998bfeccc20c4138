"""A verdict for every cell, MLPerf-style, from its evidence alone (and the parity cells beside it).

* ``FAILED`` / ``SKIPPED``: the cell's own status, with its reason.
* ``INVALID``: an ok cell that breaks a rule; every broken rule is named with its figure.
* ``VALID``: an ok cell that breaks none. What could not be checked (old evidence) is a note, not a rule.

Rules for every ok cell:

(a) every check the cell recorded about itself holds (``outputs.checks``: ``{"rule", "holds", "detail"}``,
    e.g. "exactly N tokens in every call", "T_N > T_1 in every pair"; evidence without checks has none);
(b) not contended: ``environment.contention.contended`` is not true (other processes kept more than
    ``threshold_cores`` busy while it ran); absent: "contention not recorded", unknown, not invalid. A cell
    whose every timer says "not timed" (``parity``, ``diagnose``) measures no time: contention cannot
    touch its figures and is not held against it.

And for a decode-rate cell (experiment ``decode`` or ``default``):

(c) speed at parity: a parity cell of the same engine, engine settings, checkpoint and dtype passed
    (``outputs.verdict == "pass"``), in the same sweep, else in another one (named with its file);
(d) the rate is below the bandwidth ceiling: bytes read per token (``reports.arithmetic.token_bytes``) x
    the median rate must not exceed the measured memory bandwidth (``hardware.memory_bandwidth_gb_s``);
(e) it has a rate: at least one decode_tok_s sample.

A note, not a rule: where the machine's streaming read before or after a cell (``hardware.bandwidth_at_cell``) lies
more than ``BANDWIDTH_MOVED`` from the sweep's figure that its roofline divides by, the note gives the three figures: on
a shared host the bandwidth moves, and a cell's roofline share and its ratio to cells run at another time move with it.
Another: where the sweep's read was taken while other processes kept the cores busy (``hardware.bandwidth_measurement.
contention``, ``decodebench.hardware.uncontended_read``: it is taken again first, a few times), the note says how busy:
that figure may understate the machine's read, and every roofline share of the sweep overstate.

Headline tables pool only VALID cells (``reports.tables.decode``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import pandas as pd

from decodebench.evidence import DECODE_EXPERIMENTS
from reports.arithmetic import token_bytes

VALID, INVALID, FAILED, SKIPPED = "VALID", "INVALID", "FAILED", "SKIPPED"
NO_PARITY = "no parity check for this engine, checkpoint, dtype, settings and CPU kernels"
# What a parity cell must share with a decode cell: the way, checkpoint and dtype, and the project's CPU kernels'
# sources where they ran (None where they did not, or in evidence written before the digest was recorded).
PARITY_KEY = ["engine", "engine_config", "checkpoint", "dtype", "cpu_kernel_source"]
UNTIMED = "not timed"  # what an experiment that times nothing records as its timers (parity, diagnose)
BANDWIDTH_MOVED = 0.2  # a cell's read this far from the sweep's figure (either way) gets a note
Finding = tuple[str | None, str | None]  # a rule's outcome: (what breaks it, with its figure; a note), either None


@dataclass(frozen=True)
class Verdict:
    """One cell's verdict: ``broken`` names each rule it breaks with its figure (a FAILED or SKIPPED cell: its
    reason); ``notes`` what was not checkable and where its parity came from."""

    file: str
    verdict: str
    broken: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def valid(self) -> bool:
        return self.verdict == VALID

    def text(self) -> str:
        """``INVALID: rule; rule`` or ``VALID`` (notes are printed beside, not here)."""
        return f"{self.verdict}: {'; '.join(self.broken)}" if self.broken else self.verdict


def judge(
    cells: pd.DataFrame, records: dict[str, dict[str, Any]], parity_pool: pd.DataFrame | None = None
) -> dict[str, Verdict]:
    """Every cell's verdict by file. ``parity_pool``: the cells searched for a passing parity check (default
    ``cells``; ``reports.compare`` passes both sides and the repository's evidence)."""
    pool = cells if parity_pool is None else parity_pool
    checked = pool[(pool.status == "ok") & (pool.experiment == "parity")]
    return {row.file: _judge(row, records.get(row.file, {}), checked) for _, row in cells.iterrows()}


def _judge(cell: pd.Series, record: dict[str, Any], checked: pd.DataFrame) -> Verdict:
    if cell.status != "ok":
        return Verdict(cell.file, FAILED if cell.status == "failed" else SKIPPED, (cell.reason or "",))
    timers = record.get("timers") or {}
    timed = not timers or any(text != UNTIMED for text in timers.values())
    findings = [*_checks(cell), _contention(cell.contention) if timed else (None, None)]
    if cell.experiment == "parity" and cell.parity_verdict == "fail":  # a parity check that failed is no pass
        findings.append((f"parity failed ({cell.parity_bounds})", None))
    if cell.experiment in DECODE_EXPERIMENTS:
        findings += [_parity(cell, checked), _ceiling(cell, record.get("model") or {}), _bandwidth_moved(cell),
                     _sweep_read_contended(cell)]
    broken = tuple(b for b, _ in findings if b)
    return Verdict(cell.file, INVALID if broken else VALID, broken, tuple(n for _, n in findings if n))


def _checks(cell: pd.Series) -> list[Finding]:
    """Rule (a): each recorded check that does not hold, as ``rule: detail``."""
    return [(f"{c['rule']}: {c.get('detail') or 'does not hold'}", None) for c in cell.checks or [] if not c["holds"]]


def _contention(block: Any) -> Finding:
    """Rule (b): broken when the cell recorded itself contended; a note when it could not tell."""
    if not isinstance(block, dict):
        return None, "contention not recorded"
    if block.get("contended") is None:
        return None, "contention not measurable here (recorded as unknown)"
    if not block["contended"]:
        return None, None
    load = block.get("load_avg") or block.get("load_avg_end")
    load_text = f"; load average {', '.join(f'{v:.2f}' for v in load)}" if load else ""
    return (f"contended: other processes kept {block.get('other_cores', float('nan')):.2f} cores busy on average "
            f"(threshold {block.get('threshold_cores', float('nan')):.2f}{load_text})"), None  # fmt: skip


def _parity(cell: pd.Series, checked: pd.DataFrame) -> Finding:
    """Rule (c): a note naming the passing parity check (the same sweep's first); broken when none passed,
    naming a check of the same engine, settings, checkpoint, dtype and CPU kernels that failed."""
    matching = checked
    for column in PARITY_KEY:
        value = cell.get(column)
        matching = matching[matching[column].isna() if pd.isna(value) else matching[column] == value]
    same = matching[matching.parity_verdict == "pass"]
    if same.empty:
        failed = matching.sort_values("file")
        if not failed.empty:
            return f"its parity check failed ({failed.iloc[-1].parity_bounds}: `{failed.iloc[-1].file}`)", None
        return NO_PARITY, None
    here = same[same.sweep == cell.sweep]
    found = (here if not here.empty else same).sort_values("file").iloc[-1]
    where = "in the same sweep" if not here.empty else f"in sweep {found.sweep} (`{found.file}`)"
    device = "" if found.device == cell.device else f", on {found.device} (this cell ran on {cell.device})"
    return None, f"parity passed {where}: {found.parity_bounds}{device}"


def reads_at(cell: pd.Series) -> dict[str, float]:
    """The machine's reads the cell's evidence records, GB/s by what they are: the sweep's (its roofline's
    denominator), the ones before and after the cell, the largest of those after its pairs."""
    reads = {"the sweep's read": cell.bandwidth_gb_s}
    around = cell.get("bandwidth_at_cell")
    if isinstance(around, dict):
        reads.update({f"the read {when} the cell": around[when]["value"] for when in ("before", "after")})
    pairs = cell.get("bandwidth_at_pairs_values")
    if isinstance(pairs, list) and pairs:
        reads["the largest read after its pairs"] = max(pairs)
    return {name: value for name, value in reads.items() if value is not None and not pd.isna(value)}


def _ceiling(cell: pd.Series, model: dict[str, Any]) -> Finding:
    """Rules (d) and (e): broken when the cell has no rate, or bytes per token x its median rate exceeds the largest
    read the machine gave at the cell (``reads_at``: the rate and that read named); a note when the evidence cannot
    tell, or when the rate is above the sweep's read but within the cell's own (the host read faster while it ran:
    the roofline by the sweep's read is left out, ``reports.arithmetic.roofline``)."""
    if not cell.decode_values:
        return "no decode_tok_s sample: every warm pair broke the method", None
    bandwidth = cell.bandwidth_gb_s
    batch = int(cell.get("batch", 1) or 1)  # a step of B sequences reads the linears once for B tokens
    read = token_bytes(model, cell["dtype"], cell.prompt_tokens, cell.max_new_tokens, cell.weights, batch,
                       cell.get("product_bytes"))  # fmt: skip
    if read is None or bandwidth is None or pd.isna(bandwidth):
        return None, "bandwidth ceiling not checked: " + (
            "no bandwidth recorded" if read else "no layer layout recorded"
        )
    rate = statistics.median(cell.decode_values)
    need = read.total * rate / 1e9
    if need <= bandwidth:
        return None, None
    largest, ceiling = max(reads_at(cell).items(), key=lambda named: named[1])
    if need <= ceiling:
        return None, (f"{read.total:,.0f} B/token x {rate:.4g} tok/s = {need:.4g} GB/s, above the sweep's read "
                      f"({bandwidth:.4g} GB/s) but within {largest} ({ceiling:.4g}): the machine read faster while "
                      "the cell ran; no roofline share by the sweep's read")  # fmt: skip
    return (f"rate above the bandwidth ceiling: {read.total:,.0f} B/token x {rate:.4g} tok/s = {need:.4g} GB/s "
            f"> measured bandwidth {bandwidth:.4g} GB/s ({cell.bandwidth_source})"
            + ("" if largest == "the sweep's read" else f", and > {largest}, {ceiling:.4g} GB/s")), None  # fmt: skip


def _bandwidth_moved(cell: pd.Series) -> Finding:
    """The note on a cell whose read before or after it lies more than ``BANDWIDTH_MOVED`` from the sweep's figure."""
    around, sweep = cell.get("bandwidth_at_cell"), cell.bandwidth_gb_s
    if not isinstance(around, dict) or sweep is None or pd.isna(sweep):
        return None, None
    reads = {when: around[when]["value"] for when in ("before", "after")}
    if all(abs(read / sweep - 1) <= BANDWIDTH_MOVED for read in reads.values()):
        return None, None
    return None, (f"the machine's read bandwidth moved: {reads['before']:.3g} GB/s before this cell and "
                  f"{reads['after']:.3g} after, the sweep's figure {sweep:.3g} (its roofline share and ratios to "
                  "cells of other times move with it)")  # fmt: skip


def _sweep_read_contended(cell: pd.Series) -> Finding:
    """The note on a cell whose sweep's read, its roofline's denominator, was taken while other processes kept more
    than the threshold of cores busy."""
    contention = cell.get("bandwidth_contention")
    if not isinstance(contention, dict) or not contention.get("contended"):
        return None, None
    busy, threshold = contention["other_cores"], contention["threshold_cores"]
    return None, (f"the sweep's read ({cell.bandwidth_gb_s:.3g} GB/s) was taken while other processes kept {busy:.2f} "
                  f"cores busy on average (threshold {threshold:.2f}): it may understate the machine's read, and the "
                  "roofline share overstate")  # fmt: skip


def table(cells: pd.DataFrame, verdicts: dict[str, Verdict]) -> pd.DataFrame:
    """The verdict table: one row per cell, by file."""
    rows = [
        {
            "verdict": verdicts[c.file].verdict,
            "engine": c.engine,
            "model": c.model,
            "experiment": c.experiment,
            "device": c.device,
            "context": c.context,
            "dtype": c["dtype"],
            "fingerprint": c.fingerprint,
            "replica": c.replica,
            "why": "; ".join(verdicts[c.file].broken) or "–",
            "notes": "; ".join(verdicts[c.file].notes) or "–",
            "file": c.file,
        }
        for _, c in cells.sort_values("file").iterrows()
    ]
    columns = ["verdict", "engine", "model", "experiment", "device", "context", "dtype", "fingerprint", "replica",
               "why", "notes", "file"]  # fmt: skip
    return pd.DataFrame(rows, columns=columns)
