"""``python -m reports.compare A B [--threshold 5%] [--out compare.md]``: two sweeps, row by row.

A and B are sweep names (``evidence/runs/<name>``) or folders of evidence. Each side's decode rows are
built as the report builds them (``reports.tables.decode``: VALID cells pooled, ``reports.verdicts``)
and joined on the decode table's grouping key less the environment (``fingerprint``, ``device_name``),
so that the same cell measured on two machines or two software stacks meets itself. Per row: each side's
median decode tok/s with its 95% interval and n, B/A with its interval from both sides' samples, each
side's verdict, and what differs in the environment (CPU model and flags, device, package versions,
git sha).

A row is a **regression** when it is VALID on both sides and B/A (decode tok/s: higher is better) is
below 1 - threshold, further from 1 than the noise floor (the largest A/A spread measured in either
side's environment, ``reports.noise``) and its interval excludes 1. The command prints the Markdown
table, writes it to ``--out`` with a plot beside it (``<out>.png``) and exits 1 when any row regresses,
0 otherwise (also when no row is on both sides: the table says so).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from decodebench.files import write_text_atomic
from reports import noise, plots, verdicts
from reports.tables.cells import GROUP
from reports.tables.cells import load as load_evidence
from reports.tables.decode import decode_table
from reports.uncertainty import NO_DIFFERENCE, WITHIN_FLOOR, Ratio, ratio, shown

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "evidence" / "runs"
# the same measurement on any machine, made by any code
JOIN = [c for c in GROUP if c not in ("fingerprint", "code", "device_name")]
REGRESSION = "REGRESSION"
SHOWN_KEY = {"engine": "engine", "engine_config": "engine config", "model": "model", "device": "device",
             "context": "context", "dtype": "dtype", "max_new_tokens": "N", "read_every": "read every",
             "prompt_tokens": "prompt", "way": "way", "replica": "replica"}  # fmt: skip
ENVIRONMENT = ("fingerprint", "cpu_model", "device_name", "git_sha")  # compared as they are; flags and packages apart


@dataclass
class Side:
    """One side of the comparison: where its evidence is, its cells and its decode rows (all verdicts)."""

    name: str
    folder: Path
    cells: pd.DataFrame
    rows: pd.DataFrame


@dataclass
class Comparison:
    """The joined rows, the rows found on one side only, and the threshold (a fraction, 0.05 for 5%)."""

    a: Side
    b: Side
    table: pd.DataFrame
    only_a: pd.DataFrame
    only_b: pd.DataFrame
    threshold: float

    @property
    def regressions(self) -> pd.DataFrame:
        return self.table[self.table.change == REGRESSION]


def folder_of(name: str, runs: Path = RUNS) -> Path:
    """A folder given as such, else the sweep ``runs/<name>``; ValueError when neither exists."""
    if Path(name).is_dir():
        return Path(name)
    if (runs / name).is_dir():
        return runs / name
    raise ValueError(f"{name!r} is neither a folder nor a sweep under {runs}")


def threshold_of(text: str) -> float:
    """ "5%" or 0.05 as a fraction in (0, 1)."""
    value = float(text.removesuffix("%")) / (100 if text.endswith("%") else 1)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"threshold {text!r} must lie between 0 and 1 (or 0% and 100%)")
    return value


def compare(a: Path, b: Path, threshold: float, parity_from: Sequence[Path] = ()) -> Comparison:
    """Both sides' decode rows joined on ``JOIN``; parity checks are searched in both sides and ``parity_from``."""
    loaded = {name: load_evidence(folder, REPO) for name, folder in (("A", a), ("B", b))}
    pool = pd.concat([e.cells for e in loaded.values()] + [load_evidence(f, REPO).cells for f in parity_from])
    sides = {}
    for name, folder in (("A", a), ("B", b)):
        ev = loaded[name]
        sides[name] = Side(name, folder, ev.cells, decode_table(ev.cells, verdicts.judge(ev.cells, ev.records, pool)))
    floors = noise.floors(pd.concat([noise.aa_pairs(s.rows) for s in sides.values()]))
    side_a, side_b = sides["A"], sides["B"]
    if side_a.rows.empty or side_b.rows.empty:
        joined = pd.DataFrame(columns=[*JOIN, "fingerprint_a", "fingerprint_b"])
    else:
        joined = side_a.rows.merge(side_b.rows, on=JOIN, suffixes=("_a", "_b"))
    rows = [_compared(row, side_a, side_b, floors, threshold) for _, row in joined.iterrows()]
    table = pd.DataFrame(rows, columns=[*JOIN, "label", "a", "b", "ratio", "verdict_a", "verdict_b", "change",
                                        "environment"])  # fmt: skip
    return Comparison(side_a, side_b, table, _only(side_a.rows, side_b.rows), _only(side_b.rows, side_a.rows),
                      threshold)  # fmt: skip


def _only(rows: pd.DataFrame, other: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``rows`` whose join key ``other`` does not have."""
    if rows.empty or other.empty:
        return rows
    keys = set(map(tuple, other[JOIN].astype(str).values))
    return rows[[tuple(k) not in keys for k in rows[JOIN].astype(str).values]]


def _compared(row: pd.Series, a: Side, b: Side, floors: dict[str, float], threshold: float) -> dict[str, Any]:
    values_a, values_b = row.decode_values_a, row.decode_values_b
    floor = noise.floor_between(floors, row.fingerprint_a, row.fingerprint_b)
    b_over_a = ratio(values_b, values_a, floor) if values_a and values_b else None
    return {
        **{c: row[c] for c in JOIN},
        "label": row.label_a,
        "a": row.decode_a,
        "b": row.decode_b,
        "ratio": b_over_a,
        "verdict_a": _row_verdict(row.verdict_a, row.left_out_a),
        "verdict_b": _row_verdict(row.verdict_b, row.left_out_b),
        "change": change(b_over_a, row.verdict_a, row.verdict_b, threshold),
        "environment": environment_change(
            a.cells[a.cells.file.isin(row.files_a)], b.cells[b.cells.file.isin(row.files_b)]
        ),  # fmt: skip
    }


def change(b_over_a: Ratio | None, verdict_a: str, verdict_b: str, threshold: float) -> str:
    """What B/A says of a row: ``REGRESSION`` only when both sides are VALID and B/A lies below
    1 - threshold, beyond the noise floor, with an interval that excludes 1."""
    if b_over_a is None:
        return "no rate on one side"
    invalid = [side for side, v in (("A", verdict_a), ("B", verdict_b)) if v != verdicts.VALID]
    if invalid:
        return f"not judged: {' and '.join(invalid)} not VALID"
    if not b_over_a.differs:
        return NO_DIFFERENCE
    if b_over_a.within_floor:
        return WITHIN_FLOOR
    if b_over_a.value < 1 - threshold:
        return REGRESSION
    return "improvement" if b_over_a.value > 1 + threshold else f"within the {threshold:.0%} threshold"


def _row_verdict(verdict: str, left_out: list[verdicts.Verdict]) -> str:
    """VALID (with the files it left out) or INVALID with each rule its cells broke, once."""
    if verdict == verdicts.VALID:
        return f"VALID ({len(left_out)} files left out)" if left_out else verdicts.VALID
    broken = dict.fromkeys(b for v in left_out for b in v.broken)
    return f"{verdict}: {'; '.join(broken)}"


def environment_change(a: pd.DataFrame, b: pd.DataFrame) -> str:
    """What differs between the cells of A and of B: each field's values on each side (``a → b``), CPU flags
    added and removed, package versions; "same" when nothing does."""
    out = []
    for column in ENVIRONMENT:
        va, vb = (sorted({str(v) for v in side[column].dropna()}) for side in (a, b))
        if va != vb:
            out.append(f"{column.replace('_', ' ')} {', '.join(va) or '–'} → {', '.join(vb) or '–'}")
    flags_a, flags_b = ({f for flags in side.cpu_flags for f in str(flags).split()} for side in (a, b))
    if flags_a != flags_b:
        out.append("cpu flags " + " ".join([*(f"+{f}" for f in sorted(flags_b - flags_a)),
                                            *(f"-{f}" for f in sorted(flags_a - flags_b))]))  # fmt: skip
    packages_a, packages_b = (_versions(side) for side in (a, b))
    for package in sorted(set(packages_a) | set(packages_b)):
        va, vb = packages_a.get(package, {"–"}), packages_b.get(package, {"–"})
        if va != vb:
            out.append(f"{package} {', '.join(sorted(va))} → {', '.join(sorted(vb))}")
    return "; ".join(out) or "same"


def _versions(cells: pd.DataFrame) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for packages in cells.packages:
        for name, version in (packages or {}).items():
            found.setdefault(name, set()).add(str(version) if version else "none")
    return found


def markdown(c: Comparison) -> str:
    """The comparison as Markdown: the rule, the table, the verdict and the rows found on one side only."""
    lines = [
        f"# B against A: `{c.b.folder}` against `{c.a.folder}`",
        "",
        "Decode tok/s per row: median of the pooled samples of its VALID cells, [95% interval], n. B/A divides the "
        "medians, its interval from both sides' samples. A regression: VALID on both sides, B/A below "
        f"{1 - c.threshold:.2f} (threshold {c.threshold:.0%}; higher is better), further from 1 than the noise floor "
        "(the largest A/A spread of either side's environment) and an interval that excludes 1.",
        "",
    ]
    if c.table.empty:
        lines.append("No row was measured on both sides: nothing to compare.")
    else:
        head = [*SHOWN_KEY.values(), "A tok/s", "B tok/s", "B/A", "A verdict", "B verdict", "change",
                "environment A → B"]  # fmt: skip
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for _, r in c.table.iterrows():
            cells = [_key_text(r[k]) for k in SHOWN_KEY] + [
                shown(r.a), shown(r.b), r.ratio.text() if r.ratio else "–", r.verdict_a, r.verdict_b,
                f"**{r.change}**" if r.change == REGRESSION else r.change, r.environment]  # fmt: skip
            lines.append("| " + " | ".join(text.replace("|", "/") for text in cells) + " |")
    found = len(c.regressions)
    lines += ["", f"**{found} regression{'s' if found != 1 else ''}**" if found else "No regression."]
    for name, only in (("A", c.only_a), ("B", c.only_b)):
        if not only.empty:
            lines += ["", f"Only in {name} ({len(only)} rows): " + "; ".join(only.label)]
    return "\n".join(lines) + "\n"


def _key_text(value: Any) -> str:
    """A key column as a reader writes it: counts without ".0", "–" for nothing."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if str(value) not in ("", "nan", "None") else "–"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="the baseline: a sweep under evidence/runs/ or a folder of evidence")
    parser.add_argument("b", help="the candidate: a sweep under evidence/runs/ or a folder of evidence")
    parser.add_argument("--threshold", type=threshold_of, default=threshold_of("5%"), help="e.g. 5%% or 0.05")
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "compare.md", help="Markdown; PNG beside it")
    parser.add_argument("--parity-from", type=Path, action="append", default=None,
                        help="more evidence searched for parity checks (default evidence/runs/)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        a, b = folder_of(args.a), folder_of(args.b)
    except ValueError as exc:
        parser.error(str(exc))
    parity_from = args.parity_from if args.parity_from is not None else [RUNS] if RUNS.is_dir() else []
    result = compare(a, b, args.threshold, parity_from)
    text = markdown(result)
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    png = plots.comparison(result.table, args.threshold, args.out.with_suffix(".png"))
    print(f"\ncompare: {args.out}" + (f", plot: {args.out.with_suffix('.png')}" if png else ""))
    return 1 if len(result.regressions) else 0


if __name__ == "__main__":
    sys.exit(main())
