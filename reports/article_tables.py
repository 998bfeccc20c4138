"""The Colab article's why-tables (article 003: Step 2 and the Tip after it, Steps 3, 6, 7, 8 and 12):
rows measured by the ``modes`` and ``diagnose`` experiments beside the article's published figures.

Each table is a DataFrame of display strings: the article's row as printed (``published.span``; the
TPU v5e-1 it ran on), then one column per measured device (``modes``: the newest ok file per device)
or per checkpoint and device (``diagnose``). Nothing is computed here: every measured number is read
from an evidence file as the experiment wrote it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from decodebench.evidence import Record, Samples
from decodebench.stats import median_interval
from reports import uncertainty
from reports.like_for_like import row_view, same_method
from reports.published import Published, span

ARTICLE = "torchtpu-colab"
PUBLISHED = "published (TPU v5e-1)"
MODES = ("eager", "fuse", "compile")
PASS_IDS = {  # the Tip's listing: one figure per length, in the article's order
    (probe, which): tuple(f"nb01_{probe}_{which}_pass_ms_{i}" for i in range(1, 5))
    for probe in ("raw", "bucketed")
    for which in ("first", "second")
}
CLAIM_FIGURES: dict[str, tuple[str, tuple[str, ...]]] = {  # claim key -> (format, figure ids) of the article's row
    "names": ("{} / {}", ("nb02_names_matched_as_stored_today", "nb02_names_mapped_today")),
    "to_device": ("{}", ("nb02_tensors_on_tpu_after_to_today",)),
    "device_map": ("{}", ("nb02_tensors_on_tpu_device_map_today",)),
    "packed_after_load": ("{}", ("nb04_packed_present_after_load",)),
    "packed_after_forward_2": ("{}", ("nb04_packed_present_after_forward2",)),
    "weight_dtype": ("{}", ("nb04_weight_dtype_after",)),
    "wrapped": ("{}", ("nb04_wrapped_modules",)),
    "first_break": (
        "{} at {}:{}",
        ("nb04_first_graph_break_reason", "nb04_first_graph_break_file", "nb04_first_graph_break_line"),
    ),
    "wrapped_after_remove_dispatch": ("{}", ("nb04_wrapped_modules_after_remove_dispatch",)),
    "break_after_remove_dispatch": ("{} graph / {} breaks", ("nb04_compiled_graphs", "nb04_compiled_breaks")),
    "full_slots": ("{} ({} layers)", ("nb04_static4352_full_slots", "nb04_static4352_full_layers")),
    "sliding_slots": ("{} ({} layers)", ("nb04_static4352_sliding_slots", "nb04_static4352_sliding_layers")),
}
MEMORY = {  # diagnose's readings -> their column and the Step 6 listing's figure
    "memory_before_load": ("before load", None),
    "memory_after_load": ("after load", "nb04_mem_after_load_gb"),
    "memory_after_forward_1": ("after forward 1", "nb04_mem_after_forward1_gb"),
    "memory_after_forward_2": ("after forward 2", "nb04_mem_after_forward2_gb"),
}


class Printed:
    """The article's figures and derived statements by id, as printed (booleans as True/False)."""

    def __init__(self, pub: Published) -> None:
        figures = pub.all_figures()
        self.figures = {row.id: row for _, row in figures[figures.article == ARTICLE].iterrows()}
        self.derived = {d["id"]: d for d in pub.derived.get(ARTICLE, [])}

    def __call__(self, *ids: str, sep: str = ", ") -> str:
        return sep.join(self.one(i) for i in ids) if ids else "–"

    def one(self, ref: str) -> str:
        if ref.startswith("derived:"):
            return str(self.derived[ref.removeprefix("derived:")]["stated"])
        row = self.figures[ref]
        text = span(row)
        return {"1": "True", "0": "False"}.get(text, text) if row.unit == "bool" else text


@dataclass(frozen=True)
class Row:
    """One row of a device table: its label, the article's figure ids and the measured text of a record."""

    figure: str
    published: tuple[str, ...]
    measured: Callable[[Record], str]


def number(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def listed(values: list[float], digits: int = 1) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def measured_text(r: Record, name: str, show: Callable[[Any], str]) -> str:
    """A measurement as ``show`` prints it; one made of samples as their median with its 95% interval and n."""
    m = r.measurements.get(name)
    return uncertainty.figure(median_interval(m.values), show) if isinstance(m, Samples) else show(r.value(name))


def mode_value(mode: str, name: str, show: Callable[[Any], str]) -> Callable[[Record], str]:
    """A mode's measurement, or the mode's status when it did not run."""

    def get(r: Record) -> str:
        outcome = next((m for m in r.outputs.get("modes", []) if m["mode"] == mode), None)
        if outcome is None or outcome["status"] != "ok":
            return outcome["status"] if outcome else "–"
        return measured_text(r, f"modes_{mode}_{name}", show)

    return get


def host_read(r: Record) -> str:
    """Seconds with ``.item()`` after every step over seconds with one read at the end: the ratio of the two
    medians, its interval from the pairs (each repeat times both loops, so the samples are paired)."""
    read = r.outputs["host_read"]
    return f"{uncertainty.ratio(read['each_step_s'], read['at_end_s'], paired=True).text()} ({read['mode']})"


def modes_rows() -> list[Row]:
    rows = [Row("work a step (GFLOP)", ("nb01_work_gflop",), lambda r: number(r.value("modes_work_gflop"), 3))]
    for mode in MODES:
        rows += [
            Row(
                f"{mode}: first call s",
                (f"nb01_{mode}_first_call_s",),
                mode_value(mode, "first_call_s", lambda v: number(v, 3)),
            ),
            Row(f"{mode}: step ms (median)", (f"nb01_{mode}_step_ms",), mode_value(mode, "step_ms", number)),
            Row(f"{mode}: TFLOP/s", (f"nb01_{mode}_tflop_s",), mode_value(mode, "tflop_s", lambda v: f"{v:.3g}")),
            Row(f"{mode}: checksum", (f"nb01_{mode}_checksum",), mode_value(mode, "checksum", lambda v: number(v, 1))),
        ]
        if mode != "eager":
            rows += [
                Row(
                    f"{mode} vs eager: step x faster",
                    (f"derived:nb01_{mode}_vs_eager_step",),
                    mode_value(mode, "vs_eager_step", number),
                ),
                Row(
                    f"{mode} vs eager: checksum differs by",
                    (f"derived:nb01_{mode}_checksum_diff",),
                    mode_value(mode, "checksum_diff", lambda v: f"{v:.1e}"),
                ),
            ]
    return rows


def probe(name: str, field: str) -> Callable[[Record], str]:
    """A list of the compile-count probe's raw or bucketed pass: its lengths, or ms per length."""

    def get(r: Record) -> str:
        values = r.outputs["compile_count"][name][field]
        return listed(values) if field.endswith("_ms") else ", ".join(map(str, values))

    return get


def compile_rows() -> list[Row]:
    rows = []
    for name in ("raw", "bucketed"):
        rows += [
            Row(
                f"{name}: programs compiled",
                (f"nb01_{name}_graphs",),
                lambda r, n=name: str(r.value(f"compile_{n}_graphs")),
            ),
            Row(f"{name}: rows fed", (), probe(name, "lengths")),
            Row(f"{name}: first pass ms", PASS_IDS[(name, "first")], probe(name, "first_pass_ms")),
            Row(f"{name}: second pass ms", PASS_IDS[(name, "second")], probe(name, "second_pass_ms")),
        ]
    return [
        *rows,
        Row("bucket (rows)", ("nb01_bucket_size_tok",), lambda r: str(r.outputs["compile_count"]["bucket"])),
        Row(
            "largest difference, padded vs raw",
            ("nb01_bucketed_max_difference",),
            lambda r: f"{r.value('compile_max_difference'):.1e}",
        ),
        Row(
            ".item() each step vs one read at the end (x)",
            ("derived:nb01_item_readback_cost",),
            host_read,
        ),
    ]


def device_label(r: Record) -> str:
    return f"{r.environment.get('device_kind')}: {r.environment.get('device_name') or '?'}"


def newest(
    records: dict[str, dict[str, Any]], experiment: str, key: Callable[[Record], str]
) -> dict[str, tuple[str, Record]]:
    """The newest ok record of ``experiment`` (by UTC time, then file) for each ``key``: its file and record."""
    found: dict[str, tuple[str, str, Record]] = {}
    for file, data in sorted(records.items()):
        r = Record.from_json(data)
        if r.status != "ok" or r.config["experiment"]["name"] != experiment:
            continue
        label, stamp = key(r), (r.environment.get("utc_time") or "", file)
        if label not in found or stamp > found[label][:2]:
            found[label] = (*stamp, r)
    return {label: (file, r) for label, (_, file, r) in sorted(found.items())}


def device_table(rows: list[Row], measured: dict[str, tuple[str, Record]], printed: Printed) -> pd.DataFrame:
    """One row per ``Row``: its label, the article's figure, then each measured column."""
    table = [
        {
            "figure": row.figure,
            PUBLISHED: printed(*row.published),
            **{c: row.measured(r) for c, (_, r) in measured.items()},
        }
        for row in rows
    ]
    return pd.DataFrame(table, columns=["figure", PUBLISHED, *measured])


@dataclass
class Tables:
    """Everything the why-sections render: the tables, the files they read, and notes."""

    modes: pd.DataFrame
    compile_count: pd.DataFrame
    modes_files: dict[str, str]
    skipped_modes: list[str]
    diagnose: list[dict[str, Any]]
    wrappers: pd.DataFrame


def claim_rows(r: Record, printed: Printed) -> pd.DataFrame:
    rows = []
    for c in r.outputs["claims"]:
        form, ids = CLAIM_FIGURES.get(c["key"], ("{}", ()))
        rows.append(
            {
                "step": c["step"],
                "claim": c["claim"],
                "expected": shown(c["expected"]),
                "measured": shown(c["measured"]),
                "holds": "yes" if c["holds"] else "no",
                PUBLISHED: form.format(*(printed.one(i) for i in ids)) if ids else "–",
            }
        )
    return pd.DataFrame(rows, columns=["step", "claim", "expected", "measured", "holds", PUBLISHED])


def shown(value: Any) -> str:
    return " / ".join(map(str, value)) if isinstance(value, list) else str(value)


def memory_rows(r: Record, printed: Printed) -> pd.DataFrame:
    """Step 6's memory listing: the article's HBM readings, then this cell's (in GB, naming the counter)."""
    measured = {label: r.measurements[name] for name, (label, _) in MEMORY.items() if name in r.measurements}
    counter = next(iter(measured.values())).counter if measured else ""
    labels = [label for label, _ in MEMORY.values()]
    return pd.DataFrame(
        [
            {"GB": PUBLISHED + ", HBM", **{label: printed(i) if i else "–" for label, i in MEMORY.values()}},
            {"GB": f"measured ({counter})", **{label: f"{m.central / 1e9:.2f}" for label, m in measured.items()}},
        ],
        columns=["GB", *labels],
    ).fillna("–")


SAME_METHOD = "same method as the article's row"


def wrapper_rows(decode: pd.DataFrame, printed: Printed) -> pd.DataFrame:
    """The compiled step's graphs and breaks with the wrappers on and off (Step 8), beside the article's rows,
    and whether the row's method key is the article row's (``reports.method``: else the fields that differ)."""
    columns = ["way", "model", "device", "decode tok/s", "verdict", "graphs / breaks", PUBLISHED, SAME_METHOD]
    ways = {True: "compiled_wrappers", False: "compiled"}
    article = {
        on: f"{printed(f'nb04_{way}_tok_s')} tok/s, {printed(f'nb04_{way}_graphs', f'nb04_{way}_breaks', sep=' / ')}"
        for on, way in ways.items()
    }
    if decode.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for _, d in decode[decode.engine == "compiled"].sort_values(["model", "device", "engine_config"]).iterrows():
        on = "remove_wrappers=False" in d.engine_config
        rows.append(
            {
                "way": f"compiled step, wrappers {'on' if on else 'off'} ({d.engine_config})",
                "model": d.model,
                "device": d.device,
                "decode tok/s": uncertainty.shown(d.decode),
                "verdict": d.verdict,
                "graphs / breaks": "–" if pd.isna(d.graphs) else f"{int(d.graphs)} / {int(d.graph_breaks)}",
                PUBLISHED: article[on],
                SAME_METHOD: same_method(row_view(d).key, printed.figures[f"nb04_{ways[on]}_tok_s"]),
            }
        )
    return pd.DataFrame(rows, columns=columns)


def build(records: dict[str, dict[str, Any]], decode: pd.DataFrame, pub: Published) -> Tables:
    printed = Printed(pub)
    modes = newest(records, "modes", device_label)
    skipped = [
        f"{label}: {m['mode']}: {m['reason']}"
        for label, (_, r) in modes.items()
        for m in r.outputs["modes"]
        if m["status"] != "ok"
    ]
    diagnose = newest(records, "diagnose", lambda r: f"{r.config['model']['name']} on {device_label(r)}")
    return Tables(
        modes=device_table(modes_rows(), modes, printed),
        compile_count=device_table(compile_rows(), modes, printed),
        modes_files={label: file for label, (file, _) in modes.items()},
        skipped_modes=skipped,
        diagnose=[
            {
                "label": label,
                "file": file,
                "synthetic": bool(r.model.get("synthetic")),
                "claims": claim_rows(r, printed),
                "memory": memory_rows(r, printed),
                "cache": r.outputs["cache_slots"],
                "breaks": r.outputs["breaks"],
            }
            for label, (file, r) in diagnose.items()
        ],
        wrappers=wrapper_rows(decode, printed),
    )
