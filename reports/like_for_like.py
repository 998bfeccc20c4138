"""Like for like: each measured figure beside the article's figure made the same way, and the coverage of the
articles' tables.

A *view* is one measured row as the report can set it beside an article: a decode row (``reports.tables.decode``),
the streamed rate measured inside the same cells (``decode_streamed_tok_s``: the row's key with ``read_every=1``),
a serve cell, or one recall prompt. Each has a method key (``reports.method``) and its quantities by name. A
published figure is paired with a view only when their keys are equal; the view's quantity it is set beside is
the one its metric names (``METRIC_QUANTITY``), or its ``definition``'s (``DEFINITION_QUANTITY``).

The coverage table lists every row of every article table whose figures carry a method key: *reproduced*
(a VALID view with the same key on the article's hardware and real weights: measured / published), *same method,
other hardware* (the same key on other hardware or synthetic weights: no ratio), *not runnable here* (its cells
were skipped, with their reason), *failed here*, *measured, not VALID*, *measured, not the same method* (the way's
cells ran, and the fields that differ), or *not yet measured* (the command that runs it, or "no way runs this row
yet"). The like-for-like pairs print a ratio only on the article's hardware and weights, too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from decodebench.evidence import Record, Samples
from decodebench.stats import Interval
from reports import method, uncertainty
from reports.published import span
from reports.verdicts import VALID, Verdict

REPO = Path(__file__).resolve().parents[1]
WAYS = REPO / "conf" / "way"
MODELS = REPO / "conf" / "model"
NO_PAIR = "no published row with this method"
NO_WAY = "no way runs this row yet"
REPRODUCED = "reproduced"  # the same method key, on the article's hardware and weights: the ratio is the comparison
OTHER_HARDWARE = "same method, other hardware"  # the same method key elsewhere (or on synthetic weights): no ratio

# A published metric -> the view quantity it is set beside (its definition aside).
METRIC_QUANTITY = {
    "decode_tok_s_median": "decode_tok_s",
    "decode_tok_s": "decode_tok_s",
    "streamed_tok_s": "decode_tok_s",  # the figure's key says read_every=1
    "warm_tok_s": "n_over_warm_n",
    "decode_tok_s_min": "decode_tok_s_min",
    "decode_tok_s_max": "decode_tok_s_max",
    "first_call_s": "first_call_s",
    "first64_s": "first_call_s",
    "load_s": "load_s",
    "warmup_s": "warmup_s",
    "warm1_s": "warm_1_s",
    "warm64_s": "warm_n_s",
    "warm_call_s": "warm_n_s",
    "memory_after_load_gb": "memory_after_load",
    "memory_with_cache_gb": "memory_with_cache",
    "memory_in_use_gb": "memory_with_cache",
    "memory_peak_gb": "memory_peak",
    "cache_gb": "cache_bytes",
    "graphs": "graphs",
    "breaks": "graph_breaks",
    "read_s": "read_s",
    "read_tok_s": "read_tok_s",
    "answer_code": "answer_code",
    "found": "found",
}
RATE_METRICS = ("decode_tok_s_median", "decode_tok_s", "streamed_tok_s")  # what the decode table's column shows
DEFINITION_QUANTITY = {"engine timer": "decode_phase_tok_s", "after first call": "memory_peak_after_first_call"}
QUANTITY_LABELS = {  # how each view quantity was measured, for the reader
    "decode_tok_s": "(N-1)/(T_N-T_1)",
    "decode_phase_tok_s": "(N-1)/decode_s, engine timer",
    "n_over_warm_n": "N / warm N-token call s",
    "decode_tok_s_min": "smallest served engine tok/s",
    "decode_tok_s_max": "largest served engine tok/s",
    "first_call_s": "first call s, compile included",
    "load_s": "load s",
    "warmup_s": "server warm-up s",
    "warm_1_s": "warm 1-token call s",
    "warm_n_s": "warm N-token call s",
    "memory_after_load": "memory after load GB",
    "memory_with_cache": "memory with the cache (after the first call) GB",
    "memory_peak": "peak memory since loading GB",
    "memory_peak_after_first_call": "peak memory right after the first call GB",
    "cache_bytes": "KV cache GB from its buffers' shapes",
    "graphs": "graphs",
    "graph_breaks": "graph breaks",
    "read_s": "prompt read s",
    "read_tok_s": "prompt read tok/s",
    "answer_code": "answer",
    "found": "found",
}
BYTES = ("memory_after_load", "memory_with_cache", "memory_peak", "memory_peak_after_first_call", "cache_bytes")
COVERAGE_COLUMNS = ["article", "table", "row", "published", "status", "detail"]
PAIR_COLUMNS = ["view", "article", "table", "row", "figure", "measured_as", "measured", "published", "ratio"]

Value = Interval | float | int | str | None


@dataclass
class View:
    """One measured row the report can set beside an article's figure."""

    label: str
    key: dict[str, Any]
    valid: bool
    verdict: str  # VALID, or the verdict and every rule its files broke
    quantities: dict[str, Value] = field(default_factory=dict)
    hardware: str | None = None  # the hardware it ran on, by its evidence's name (``tpu-v5e-1``, ``cpu``)
    synthetic: bool = False  # measured on weights decodebench made itself


def on_article_hardware(view: View, figure: pd.Series) -> bool:
    """Whether a view was measured where the article's figure was: the same hardware and the real weights. The
    method key names neither, so a view of the same key elsewhere reproduces the method, not the figure."""
    device = figure.get("device")
    return not view.synthetic and _present(device) and view.hardware == device


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def row_view(row: pd.Series) -> View:
    """A decode row as a view: its key and every figure an article prints for a way."""
    quantities = {
        "decode_tok_s": row.decode,
        "decode_phase_tok_s": row.phase,
        "n_over_warm_n": row.n_over_warm_n,
        "first_call_s": row.first_call,
        "load_s": row.load,
        "warm_1_s": row.warm_1,
        "warm_n_s": row.warm_n,
        "memory_after_load": row.memory_after_load,
        "memory_with_cache": row.memory_with_cache,
        "memory_peak": row.memory_peak,
        "cache_bytes": row.cache_bytes,
        "graphs": row.graphs,
        "graph_breaks": row.graph_breaks,
    }
    broken = "; ".join(dict.fromkeys(rule for v in row.left_out for rule in v.broken))
    verdict = row.verdict if row.verdict == VALID else f"{row.verdict}: {broken}"
    return View(row.label, dict(row.method), row.verdict == VALID, verdict, quantities, row.hardware,
                bool(row.synthetic))


def decode_views(decode: pd.DataFrame) -> list[View]:
    """Each decode row as a view, and, where its cells measured the streamed rate beside their own
    ``read_every``, that rate as a view of its own (the row's key with ``read_every=1``)."""
    views = []
    for _, row in decode.iterrows():
        view = row_view(row)
        views.append(view)
        if isinstance(row.streamed, Interval) and row.read_every != 1:
            label = f"{row.label}, streamed inside the same cells (read_every=1)"
            key = {**view.key, "read_every": 1}
            views.append(View(label, key, view.valid, view.verdict, {"decode_tok_s": row.streamed}, view.hardware,
                              view.synthetic))
    return views


def serve_views(records: dict[str, dict[str, Any]], verdicts: dict[str, Verdict]) -> list[View]:
    """Each ok serve cell: the served engine rate ((tokens-1)/decode_s per request: the Rust article's
    definition), its smallest and largest, load and warm-up seconds."""
    views = []
    for file, data in sorted(records.items()):
        if data["status"] != "ok" or data["config"]["experiment"]["name"] != method.SERVE:
            continue
        r = Record.from_json(data)
        served = r.measurements.get("served_engine_tok_s")
        values = list(served.values) if isinstance(served, Samples) else []
        quantities = {
            "decode_tok_s": uncertainty.sampled(values),
            "decode_tok_s_min": min(values, default=None),
            "decode_tok_s_max": max(values, default=None),
            "load_s": r.value("load_s"),
            "warmup_s": r.value("warmup_s"),
        }
        verdict = verdicts[file]
        label = f"{r.config['engine']['name']} served ({r.config['model']['name']}, `{file}`)"
        views.append(View(label, method.of_record(r), verdict.valid, verdict.text(), quantities,
                          (r.hardware or {}).get("name"), bool(r.model.get("synthetic"))))
    return views


def recall_views(recall: pd.DataFrame, cells: pd.DataFrame, verdicts: dict[str, Verdict]) -> list[View]:
    """Each ok recall prompt: its cell's key as a recall figure (``experiment=recall``, the prompt's own token
    count), its read and decode figures."""
    keys = dict(zip(cells.file, cells.method, strict=True))
    where = dict(zip(cells.file, zip(cells.hardware, cells.synthetic, strict=True), strict=True))
    views = []
    for _, r in recall[recall.status == "ok"].iterrows():
        key = {**keys[r.file], "experiment": method.RECALL, "prompt": {"text": None, "tokens": r.prompt_tokens}}
        quantities = {"read_s": r.read, "read_tok_s": r.read_rate, "decode_phase_tok_s": r.decode_timer,
                      "decode_tok_s": r.decode_pair, "answer_code": r.answer_code,
                      "found": "yes" if r.found else "no"}  # fmt: skip
        verdict = verdicts[r.file]
        label = f"{r.engine} recall, prompt {int(r.prompt_tokens)} tokens ({r.model}, ctx {r.context}, `{r.file}`)"
        views.append(View(label, key, verdict.valid, verdict.text(), quantities, *where[r.file]))
    return views


def quantity(figure: pd.Series) -> str | None:
    """The view quantity a published figure is set beside: its definition's, else its metric's."""
    definition = figure.get("definition")
    return DEFINITION_QUANTITY[definition] if _present(definition) else METRIC_QUANTITY.get(figure.metric)


def measured(view: View, figure: pd.Series) -> Value:
    """The view's figure under the published figure's definition, in the published unit (GB for bytes);
    None when the view has none."""
    name = quantity(figure)
    value = view.quantities.get(name) if name else None
    if not _present(value):
        return None
    if name in BYTES:
        return float(value) / 1e9
    return value


def shown(value: Value) -> str:
    """A measured figure as the report prints it: an interval's median with its bounds and n, a number, text."""
    if isinstance(value, Interval):
        return uncertainty.figure(value, uncertainty.decimals(3 if abs(value.value) < 1 else 2))
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return "–" if value is None else str(value)


def _number(value: Value) -> float | None:
    if isinstance(value, Interval):
        return value.value
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def ratio(value: Value, figure: pd.Series) -> str:
    """measured / published: a value's ratio (with the measured interval's bounds over it), or over a printed
    range the ratio to its largest and to its smallest end; "–" when either side is not a number."""
    center = _number(value)
    if center is None:
        return "–"
    if _present(figure.value):
        try:
            published = float(figure.value)
        except (TypeError, ValueError):
            return "–"
        if published == 0:
            return "–"
        if isinstance(value, Interval) and value.known:
            return f"{center / published:.2f}x [{value.low / published:.2f}, {value.high / published:.2f}]"
        return f"{center / published:.2f}x"
    return f"{center / float(figure['max']):.2f}x to {center / float(figure['min']):.2f}x"


def _keyed(figures: pd.DataFrame) -> pd.DataFrame:
    """The figures that carry a method key, the articles' detailed tables before their summaries."""
    keyed = figures.loc[[isinstance(m, dict) for m in figures.method]].copy()
    keyed["summary"] = keyed.table.str.contains("Headline|Compare|Comparison")
    keyed["order"] = range(len(keyed))
    return keyed.sort_values(["summary", "article", "order"])


def matching(view: View, figures: pd.DataFrame) -> pd.DataFrame:
    """The published figures whose key equals the view's."""
    keyed = _keyed(figures)
    return keyed.loc[[not method.differences(view.key, m) for m in keyed.method]]


def pairs(views: list[View], figures: pd.DataFrame) -> pd.DataFrame:
    """Every VALID view beside every published figure of the same method that it has a quantity for."""
    rows = []
    for view in views:
        if not view.valid:
            continue
        for _, fig in matching(view, figures).iterrows():
            name = quantity(fig)
            if name is None:
                continue
            value = measured(view, fig)
            rows.append(
                {
                    "view": view.label,
                    "article": fig.article,
                    "table": fig.table,
                    "row": fig.way,
                    "figure": fig.id,
                    "measured_as": QUANTITY_LABELS[name],
                    "measured": shown(value) if value is not None else "not measured under this definition",
                    "published": f"{span(fig)} {fig.unit}",
                    "ratio": ratio(value, fig) if on_article_hardware(view, fig) else OTHER_HARDWARE,
                }
            )
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def same_method(key: dict[str, Any], figure: pd.Series) -> str:
    """Whether a measured key is a published figure's: "yes", or every field that differs."""
    return "; ".join(method.differences(key, figure.method)) or "yes"


def published_rate(view: View, figures: pd.DataFrame) -> str:
    """The decode table's *published* column: the article's rate made the same way (its definition named when
    not (N-1)/(T_N-T_1)), or that there is none."""
    found = matching(view, figures)
    found = found[found.metric.isin(RATE_METRICS)]
    if found.empty:
        return NO_PAIR
    fig = found.iloc[0]
    definition = f"; {fig.definition}: see *engine timers*" if _present(fig.definition) else ""
    more = f"; and {len(found) - 1} more in *Like for like*" if len(found) > 1 else ""
    return f"{span(fig)} ({fig.article}: {fig.table}{definition}{more})"


def published_span(view: View, figures: pd.DataFrame) -> str:
    """The headline's *published* column: the article's rate made the same way as printed, ``–`` when none is
    (its article, table and definition are in the detail table and *Like for like*)."""
    found = matching(view, figures)
    found = found[found.metric.isin(RATE_METRICS)]
    return "–" if found.empty else span(found.iloc[0])


# ---------------------------------------------------------------- coverage ----------------------------------------


def ways_of(key: dict[str, Any]) -> list[str]:
    way = key.get("way")
    return way if isinstance(way, list) else [way] if way else []


def way_files(folder: Path = WAYS) -> set[str]:
    """The ways ``conf/way/`` holds (``<article>/<row>``)."""
    return {p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml")}


def reproduce_models(folder: Path = MODELS) -> dict[str, str]:
    """The model config that reads each real checkpoint twin (``conf/model/``: a hub model, by its tables)."""
    found = {}
    for path in sorted(folder.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        if spec.get("source") == "hub":
            found.setdefault("emb4" if spec.get("tables") == "int4" else "ct-text", spec["name"])
    return found


def command(key: dict[str, Any], ways: set[str], models: dict[str, str]) -> str:
    """What runs a row: ``.venv/bin/python run.py way=<way> model=<model>`` per way it names that has a file."""
    runnable = [w for w in ways_of(key) if w in ways]
    if not runnable:
        return NO_WAY
    model = models.get(key.get("twin") or "ct-text", "<model>")
    return "; ".join(f"`.venv/bin/python run.py way={w} model={model}`" for w in runnable)


def _headline(group: pd.DataFrame) -> pd.Series:
    """The figure that stands for a row: its first with the highest-ranked metric the report measures."""
    ranks = {metric: i for i, metric in enumerate(METRIC_QUANTITY)}
    return group.assign(rank=[ranks.get(m, len(ranks)) for m in group.metric]).sort_values(["rank", "order"]).iloc[0]


def _linked(key: dict[str, Any], cells: pd.DataFrame) -> pd.DataFrame:
    """The cells that ran (or tried) a row: those naming one of its ways, and those that did not run whose
    settings are the row's (a cell that did not run records no prompt)."""
    ways = ways_of(key)
    named = [w in ways for w in cells.way]
    tried = [s != "ok" and not method.differences(m, key, ignore=("prompt", "way"))
             for s, m in zip(cells.status, cells.method, strict=True)]  # fmt: skip
    return cells.loc[[a or b for a, b in zip(named, tried, strict=True)]]


def _prompt_distance(measured_key: dict[str, Any], published_key: dict[str, Any]) -> float:
    """How far a measured prompt's token count is from a published one's (0 when either is not counted): among
    rows that differ in as many fields, the closest is the one of the nearest prompt length (a recall prompt)."""
    have, want = ((k.get("prompt") or {}) for k in (measured_key, published_key))
    tokens = have.get("tokens") if isinstance(have, dict) else None
    wanted = want.get("tokens") if isinstance(want, dict) else None
    return abs(float(tokens) - float(wanted)) if tokens is not None and wanted is not None else 0.0


def _status(fig: pd.Series, views: list[View], cells: pd.DataFrame, verdicts: dict[str, Verdict],
            ways: set[str], models: dict[str, str]) -> tuple[str, str]:  # fmt: skip
    key = fig.method
    same = [v for v in views if v.valid and not method.differences(v.key, key)]
    here = [v for v in same if on_article_hardware(v, fig)]
    if here:
        view = here[0]
        value = measured(view, fig)
        others = f" (and {len(here) - 1} more rows)" if len(here) > 1 else ""
        if value is None:
            return REPRODUCED, f"{view.label}{others}: the same method; its {fig.metric} is not measured"
        return REPRODUCED, f"{shown(value)} / {span(fig)} = {ratio(value, fig)}: {view.label}{others}"
    if same:
        view = same[0]
        others = f" (and {len(same) - 1} more rows)" if len(same) > 1 else ""
        weights = "synthetic weights" if view.synthetic else "the real weights"
        return OTHER_HARDWARE, (f"{view.label}{others}: on {view.hardware or 'unnamed hardware'} with {weights}, the "
                                f"article on {fig.device} with {fig.checkpoint}: no ratio")  # fmt: skip
    invalid = [v for v in views if not v.valid and not method.differences(v.key, key)]
    if invalid:
        return "measured, not VALID", f"{invalid[0].label}: {invalid[0].verdict}"
    by_way = [(method.differences(v.key, key), v) for v in views if v.valid and v.key.get("way") in ways_of(key)]
    if by_way:
        differs, view = min(by_way, key=lambda found: (len(found[0]), _prompt_distance(found[1].key, key)))
        return "measured, not the same method", f"{view.label}: {'; '.join(differs)}"
    linked = _linked(key, cells)
    for status, label in (("ok", "measured, not VALID"), ("skipped", "not runnable here"), ("failed", "failed here")):
        found = linked[linked.status == status].sort_values("file")
        if not found.empty:
            cell = found.iloc[-1]
            why = verdicts[cell.file].text() if status == "ok" else (cell.reason or "").splitlines()[0]
            return label, f"{why} (`{cell.file}`)"
    return "not yet measured", command(key, ways, models)


def coverage(figures: pd.DataFrame, views: list[View], cells: pd.DataFrame, verdicts: dict[str, Verdict],
             ways: set[str] | None = None, models: dict[str, str] | None = None) -> pd.DataFrame:  # fmt: skip
    """One row per article row (figures of one table and one printed way) that carries a method key and a
    figure the report measures, in the articles' order: its headline figure as printed, its status and the
    detail (see the module docstring)."""
    keyed = _keyed(figures).sort_values(["article", "order"])
    ways = way_files() if ways is None else ways
    models = reproduce_models() if models is None else models
    rows = []
    for (article, table, way), group in keyed.groupby(["article", "table", "way"], sort=False):
        if all(quantity(f) is None for _, f in group.iterrows()):
            continue  # a row of settings or facts, nothing measured: no coverage to state
        fig = _headline(group)
        status, detail = _status(fig, views, cells, verdicts, ways, models)
        rows.append({"article": article, "table": table, "row": way, "published": f"{span(fig)} {fig.unit}",
                     "status": status, "detail": detail})  # fmt: skip
    return pd.DataFrame(rows, columns=COVERAGE_COLUMNS)
