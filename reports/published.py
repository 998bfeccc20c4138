"""The articles' published figures (``evidence/published/*.yaml``), never mixed with measurements."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

FIGURE_COLUMNS = [
    "id",
    "table",
    "way",
    "engine",
    "device",
    "checkpoint",
    "context",
    "prompt",
    "metric",
    "value",
    "min",
    "max",
    "unit",
    "source",
]


@dataclass
class Published:
    """One table of figures and one list of derived statements per article file (keyed by file stem)."""

    articles: dict[str, dict[str, Any]]
    figures: dict[str, pd.DataFrame]
    derived: dict[str, list[dict[str, Any]]]

    def all_figures(self) -> pd.DataFrame:
        frames = [df.assign(article=name) for name, df in sorted(self.figures.items())]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=[*FIGURE_COLUMNS, "article"])


class PublishedDataError(ValueError):
    """A published-data file that is malformed: the message names the file and the entry."""


def load(folder: Path) -> Published:
    articles, figures, derived = {}, {}, {}
    for path in sorted(Path(folder).glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        name = path.stem
        rows = data.get("figures") or []
        for row in rows:
            missing = [c for c in ("id", "metric", "unit", "source") if not row.get(c)]
            if missing:
                raise PublishedDataError(f"{path}: figure {row.get('id', '?')} lacks {', '.join(missing)}")
            if row.get("value") is None and (row.get("min") is None or row.get("max") is None):
                raise PublishedDataError(f"{path}: figure {row['id']} has neither a value nor a min-max range")
        frame = pd.DataFrame(rows, columns=FIGURE_COLUMNS)
        if frame.id.duplicated().any():
            raise PublishedDataError(f"{path}: duplicate figure ids {sorted(set(frame.id[frame.id.duplicated()]))}")
        known = set(frame.id)
        for item in data.get("derived") or []:
            if not isinstance(item.get("stated"), str):
                raise PublishedDataError(
                    f"{path}: derived {item.get('id', '?')} stated={item.get('stated')!r} must be the printed "
                    'string, quoted (e.g. "25.0"): its precision decides whether a recomputed value agrees'
                )
            for ref in (item.get("inputs") or {}).values():
                if ref.partition(".")[0] not in known:
                    raise PublishedDataError(f"{path}: derived {item['id']} cites unknown figure {ref}")
        articles[name] = {k: data.get(k) for k in ("article", "author", "seed_file", "date")}
        figures[name] = frame
        derived[name] = list(data.get("derived") or [])
    return Published(articles, figures, derived)


def span(row: pd.Series) -> str:
    """A published figure as printed: a value, or 'min to max'."""
    if row["value"] is not None and not (isinstance(row["value"], float) and pd.isna(row["value"])):
        return f"{row['value']:g}" if isinstance(row["value"], int | float) else str(row["value"])
    return f"{row['min']:g} to {row['max']:g}"
