"""The articles' published figures (``evidence/published/*.yaml``), never mixed with measurements."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from reports import method as method_key

# libyaml's parser where PyYAML was built with it (its wheels are): the same safe constructor, several
# times faster on these files, which every render reads twice
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

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
    "note",
    "method",  # the figure's method key (reports/method.py): what it pairs with
    "inferred",  # key field -> the article's sentence the field was inferred from
    "unknown",  # key field -> why the article leaves it open
    "definition",  # how the article computed the figure, when not as its metric's default (method.DEFINITIONS)
]
PRINTED = ("value", "min", "max")  # each also kept as printed, e.g. "3.00", in printed_<field>


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
        data = yaml.load(path.read_text(), Loader=LOADER)
        name = path.stem
        rows = data.get("figures") or []
        for row in rows:
            missing = [c for c in ("id", "metric", "unit", "source") if not row.get(c)]
            if missing:
                raise PublishedDataError(f"{path}: figure {row.get('id', '?')} lacks {', '.join(missing)}")
            if row.get("value") is None and (row.get("min") is None or row.get("max") is None):
                raise PublishedDataError(f"{path}: figure {row['id']} has neither a value nor a min-max range")
            _check_method(path, row)
        frame = pd.DataFrame(rows, columns=FIGURE_COLUMNS)
        printed = _printed_scalars(path)
        for column in PRINTED:
            frame[f"printed_{column}"] = [printed.get(i, {}).get(column) for i in frame.id]
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


def _printed_scalars(path: Path) -> dict[str, dict[str, str]]:
    """Each figure's value, min and max exactly as the file spells them (YAML would read "3.00" as 3.0)."""
    root = yaml.compose(path.read_text(), Loader=LOADER)
    out: dict[str, dict[str, str]] = {}
    figures = next((v for k, v in root.value if k.value == "figures"), None)
    for item in figures.value if figures is not None else []:
        fields = {k.value: v.value for k, v in item.value if isinstance(v, yaml.ScalarNode)}
        out[fields.get("id", "")] = {k: fields[k] for k in PRINTED if fields.get(k) not in (None, "null", "~")}
    return out


def _check_method(path: Path, row: dict[str, Any]) -> None:
    """A figure's method key, its sentences and its definition must follow ``reports.method``."""
    if row.get("method") is None:
        if row.get("inferred") or row.get("unknown"):
            raise PublishedDataError(f"{path}: figure {row['id']} names inferred or unknown fields but has no method")
        return
    problems = method_key.check_published(row["method"], row.get("inferred") or {}, row.get("unknown") or {})
    if row.get("definition") not in (None, *method_key.DEFINITIONS):
        problems.append(f"definition {row['definition']!r} is none of {', '.join(method_key.DEFINITIONS)}")
    if problems:
        raise PublishedDataError(f"{path}: figure {row['id']}: {'; '.join(problems)}")


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and pd.isna(value))


def span(row: pd.Series) -> str:
    """A published figure as printed: a value, or 'min to max'."""
    if _present(row["value"]):
        return row.get("printed_value") or str(row["value"])
    return f"{row.get('printed_min') or row['min']} to {row.get('printed_max') or row['max']}"


RECALL_COLUMNS = ["prompt_tokens", "read_s", "read_tok_s", "decode_tok_s", "answer_code", "found", "record",
                  "laptop_answer_code", "same_as_laptop"]  # fmt: skip


def recall_table(figures: pd.DataFrame) -> pd.DataFrame:
    """The Colab article's Step 11 recall table in its own shape: one row per prompt, values as printed."""
    step11 = figures.table.fillna("").str.startswith("Step 11:")
    rows = figures[step11 & figures.way.str.contains(", prompt ")]  # not the graphs-after-every-prompt line
    table: dict[tuple[int, str], dict[str, Any]] = {}
    for _, fig in rows.iterrows():
        laptop = ", laptop answer" in fig.way
        key = (int(fig.context), fig.way.replace(", laptop answer", ""))
        column = "laptop_answer_code" if laptop and fig.metric == "answer_code" else fig.metric
        entry = table.setdefault(key, {"context": key[0]})
        text = span(fig)
        entry[column] = {"1": "yes", "0": "no"}.get(text, text) if column in ("found", "same_as_laptop") else text
    ordered = sorted(table.values(), key=lambda e: (e["context"], int(e.get("prompt_tokens", 0))))
    return pd.DataFrame(ordered, columns=["context", *RECALL_COLUMNS])


SERVE_ARTICLE = "rust-torchtpu"
FIVE_REQUESTS = "Five requests, one at a time (engine timer)"


def serving_row(figures: pd.DataFrame) -> dict[str, str]:
    """The Rust article's served figures as one row of the serving table, each as printed: the five
    requests' tokens, finish and seconds (the smallest to the largest printed), its median engine tok/s
    with min and max, the streamed first-token and client rates, and the cancel counter."""
    rig = figures[figures.article == SERVE_ARTICLE]
    by_id = {row.id: row for _, row in rig.iterrows()}
    five = rig[rig.table == FIVE_REQUESTS]

    def printed_range(metric: str) -> str:
        rows = five[five.way.str.startswith("request ") & (five.metric == metric)]
        if rows.empty:
            return "–"
        texts = sorted((span(r) for _, r in rows.iterrows()), key=float)
        return texts[0] if texts[0] == texts[-1] else f"{texts[0]} to {texts[-1]}"

    def one(figure: str) -> str:
        return span(by_id[figure]) if figure in by_id else "–"

    return {
        "tokens": printed_range("completion_tokens"),
        "finish": one("req_finish_reason"),
        "read_s": printed_range("read_s"),
        "decode_s": printed_range("decode_s"),
        "client_s": printed_range("client_s"),
        "engine_tok_s": f"{one('req_median_decode_tok_s')} ({one('req_min_decode_tok_s')} to "
        f"{one('req_max_decode_tok_s')})",
        "ttft": one("client_first_token_s"),
        "client_tok_s": one("client_tok_s"),
        "cancel": f"{one('rig_cancel_counter_before')} → {one('rig_cancel_counter_after')} "
        f"after {one('client_cancel_after_chunks')} chunks",
    }
