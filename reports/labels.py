"""Short names for the ways of a table (``ring·int4``), and the legend that maps each back to its full settings.

A way's short label is its engine followed by the values of only those settings that vary among that engine's rows
(``engine_config`` pairs, then ``read_every``, the article way a cell names, the A/A replica, the batch: ``B=4``),
joined by ``·``: two ring rows that differ only in ``weights`` read ``ring·dense`` and ``ring·int4``, an engine
measured one way only reads its bare name. A setting the engine recorded as without effect in a row
(``settings_without_effect``: ``int4_limbs`` with dense weights) is left out of that row's label and counts for no
row's difference: ``ring·dense`` beside ``ring·int4_limbs=2·int4``. A value that says nothing alone (``true``,
``none``, a number) keeps its key (``compile=true``); a setting a row's evidence does not record (written before the
setting existed) reads ``key=–``. Model, device, context and N are columns of the tables beside the label, never part
of it; environment and code are footnotes (``footnotes``).
"""

from __future__ import annotations

import pandas as pd

SEPARATOR = "·"
LAST = ("read_every", "way", "replica", "batch")  # after the engine's own settings, in this order
LEGEND_COLUMNS = ["way", "engine", "settings", "read_every", "article_way", "replica"]
MARKS = "¹²³⁴⁵⁶⁷⁸⁹"  # footnote marks of a table's environments, in order; then [10], [11], ...


def _without_effect(row: pd.Series) -> set[str]:
    """The settings the row's engine recorded as without effect (none in evidence written before it recorded them)."""
    return set(str(getattr(row, "settings_without_effect", None) or "").split())


def _fields(row: pd.Series) -> dict[str, str]:
    """Everything that names a way apart from its engine, as printable ``key -> value``; not the settings its
    engine recorded as without effect."""
    pairs = (pair.split("=", 1) for pair in (row.engine_config or "").split() if "=" in pair)
    without_effect = _without_effect(row)
    fields = {key: value for key, value in pairs if key not in without_effect}
    fields["read_every"] = str(row.read_every or 0)
    fields["way"] = row.way if isinstance(row.way, str) else ""
    fields["replica"] = str(int(row.replica or 0))
    fields["batch"] = str(int(getattr(row, "batch", 1) or 1))
    return fields


def _part(key: str, value: str) -> str:
    """One setting in a label: its value where the value names itself, ``key=value`` where it does not."""
    if key == "replica":
        return f"A/A{value}"
    if key == "batch":
        return f"B={value}"
    if key == "read_every":
        return f"read_every={value}"
    if key == "way":
        return value or "no way"
    speaks = value and not value.replace(".", "").isdigit() and value.lower() not in ("true", "false", "none", "auto")
    return value if speaks else f"{key}={value or '–'}"


def short_labels(table: pd.DataFrame) -> pd.Series:
    """Each row's short label (see the module docstring); ``table`` needs ``engine``, ``engine_config``,
    ``read_every``, ``way`` and ``replica``. Computed over the whole table, so one way has one label everywhere."""
    fields = {i: _fields(row) for i, row in table.iterrows()}
    without_effect = {i: _without_effect(row) for i, row in table.iterrows()}
    labels = {}
    for _, group in table.groupby("engine", sort=False):
        named = sorted({k for i in group.index for k in fields[i]} - set(LAST))
        keys = [*named, *LAST]
        varying = [k for k in keys
                   if len({fields[i].get(k, "") for i in group.index if k not in without_effect[i]}) > 1]  # fmt: skip
        for i in group.index:
            parts = [_part(k, fields[i].get(k, "")) for k in varying if k not in without_effect[i]]
            labels[i] = SEPARATOR.join([table.at[i, "engine"], *parts])
    return pd.Series(labels, index=table.index, dtype=object)


def legend(table: pd.DataFrame) -> pd.DataFrame:
    """One row per short label of ``table`` (its ``way_label`` column): the engine and its full settings."""
    if table.empty:
        return pd.DataFrame(columns=LEGEND_COLUMNS)
    rows = table.drop_duplicates("way_label").sort_values("way_label")
    return pd.DataFrame(
        {
            "way": rows.way_label,
            "engine": rows.engine,
            "settings": [c or "–" for c in rows.engine_config],
            "read_every": [r or "end" for r in rows.read_every],
            "article_way": [w if isinstance(w, str) else "–" for w in rows.way],
            "replica": [int(r or 0) for r in rows.replica],
        },
        columns=LEGEND_COLUMNS,
    ).reset_index(drop=True)


def mark(k: int) -> str:
    """The ``k``-th footnote mark (0-based)."""
    return MARKS[k] if k < len(MARKS) else f"[{k + 1}]"


def footnotes(rows: pd.DataFrame) -> tuple[list[str], list[str]]:
    """Environment (its fingerprint, read in *Environment and provenance*) and code of each row as a footnote:
    (each row's mark, the footnotes in mark order). With one environment and code the marks are empty and the one
    footnote says it holds for every row."""
    where = [(r.fingerprint, r.code or "") for _, r in rows.iterrows()]
    distinct = list(dict.fromkeys(where))
    names = {w: f"env {w[0]}" + (f" @ {w[1]}" if w[1] else "") for w in distinct}
    if len(distinct) <= 1:
        return [""] * len(where), [f"every row: {names[w]}" for w in distinct]
    marks = {w: mark(k) for k, w in enumerate(distinct)}
    return [marks[w] for w in where], [f"{marks[w]} {names[w]}" for w in distinct]
