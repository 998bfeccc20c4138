"""``python -m reports.render``: evidence in, ``evidence/arithmetic.txt`` and ``reports/REPORT.md`` out.

A pure function of the evidence and the published data: no model, no accelerator, no clock; the
same files in give the same bytes out. Every file is written whole or not at all (``decodebench.files``): a renderer
killed mid-write leaves the previous report as it was.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from decodebench.files import write_bytes_atomic, write_text_atomic
from reports import (
    arithmetic,
    article_tables,
    definitions,
    labels,
    like_for_like,
    method,
    noise,
    plots,
    summary,
    uncertainty,
    verdicts,
)
from reports import published as published_data
from reports.tables.batch import batch_table, served_at_concurrency
from reports.tables.bench import bench_table
from reports.tables.boot import boot_runs
from reports.tables.cells import load as load_evidence
from reports.tables.decode import decode_table, headline_tables, left_out
from reports.tables.load import load_table
from reports.tables.peers import peer_tables
from reports.tables.profile import profile_table
from reports.tables.recall import recall_table
from reports.tables.serving import serve_table
from reports.tables.sweeps import sweeps_table

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).resolve().parent / "templates"  # the report's frame and its sections that are no one table's
TABLES = Path(__file__).resolve().parent / "tables"  # each table's template beside its builder
# Published boot figures shown beside a measured boot timeline: the boot, the crate's build, and the
# service's load and warm-up read from its /v1/engine.
BOOT_FIGURES = ("boot_s", "crate_build_s")
BOOT_IDS = ("rig_load_s", "rig_warmup_s")
CHAT_PNG = "chat.png"  # the chat page's screenshot beside the report
SERVED_FIGURE = "req_median_decode_tok_s"  # the Rust article's served rate: its key is the served row's


@dataclass
class Outputs:
    report: Path | None  # None: no evidence yet, so no report
    arithmetic: Path
    plots: list[Path]
    summary: str = ""  # the report's first screen as terminal text


def missing(value: Any) -> bool:
    """No figure in the evidence: None, or NaN where a pandas column has no value for the row."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def gb(value: Any) -> str:
    return "–" if missing(value) else f"{value / 1e9:.2f}"


def num(value: Any, digits: int = 2) -> str:
    return "–" if missing(value) else f"{value:.{digits}f}"


def sci(value: Any) -> str:
    return "–" if missing(value) else f"{value:.3g}"


def whole(value: Any) -> str:
    """A count as a whole number, "–" where the evidence has none."""
    return "–" if missing(value) else str(int(value))


def published_rates(pub: published_data.Published) -> dict[str, list[str]]:
    """Published decode tok/s per decodebench engine, as printed, with the article and table."""
    out: dict[str, list[str]] = {}
    figures = pub.all_figures()
    rates = figures[(figures.metric == "decode_tok_s") & figures.engine.notna()]
    for _, row in rates.iterrows():
        out.setdefault(row.engine, []).append(f"{published_data.span(row)} ({row.article}: {row.table})")

    def rank(text: str) -> tuple[bool, bool, str]:  # the articles' summary tables first
        return "Headline" not in text, "omparison" not in text, text

    return {k: sorted(v, key=rank) for k, v in out.items()}


def chat_screenshot(serving: Any, evidence_dir: Path, out: Path) -> dict[str, str] | None:
    """The chat page's screenshot of the last serve cell that took one (by file name), copied beside the
    report as ``chat.png``; None when no serve cell took one."""
    shots = serving.dropna(subset=["screenshot"]).sort_values("file")
    if shots.empty:
        return None
    source = evidence_dir / shots.iloc[-1].screenshot
    if not source.is_file():
        return None
    write_bytes_atomic(out / CHAT_PNG, source.read_bytes())
    return {"name": CHAT_PNG, "source": shots.iloc[-1].screenshot}


def environment() -> Environment:
    """The report's Jinja2 environment: its frame's and every table's templates, strict, with its filters."""
    env = Environment(
        loader=FileSystemLoader([TEMPLATES, TABLES]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(gb=gb, num=num, sci=sci, whole=whole, median=lambda i: num(getattr(i, "value", None)),
                        fmt=arithmetic.fmt, span=published_data.span,
                       ci=uncertainty.shown)
    env.tests["missing"] = missing  # `x is missing`: None, or a pandas column's NaN
    return env


def build(evidence_dir: Path, published_dir: Path, report: Path, arithmetic_out: Path) -> Outputs:
    """Renders both files (and the plots beside the report). With no evidence at all, only
    ``arithmetic.txt`` is written (the articles' figures recomputed, nothing measured) and the report is None."""
    ev = load_evidence(evidence_dir, REPO)
    pub = published_data.load(published_dir)
    judged = verdicts.judge(ev.cells, ev.records)
    every_row = decode_table(ev.cells, judged)
    decode = every_row[every_row.verdict == verdicts.VALID]
    pairs = noise.aa_pairs(every_row)
    models = {f: r["model"] for f, r in ev.records.items()}
    measured = arithmetic.measured(decode, models, noise.floors(pairs))
    recomputed = arithmetic.published(pub.figures, pub.derived)
    arithmetic_out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(arithmetic_out, arithmetic.render(measured, recomputed))
    if not ev.records and not ev.warnings and ev.boot.empty:
        return Outputs(None, arithmetic_out, [])

    report.parent.mkdir(parents=True, exist_ok=True)
    profile = profile_table(ev.records)
    load = load_table(ev.records)
    every_derived = arithmetic.with_derived_columns(every_row, measured)  # derived figures: VALID rows only
    derived = every_derived[every_derived.verdict == verdicts.VALID]
    made = [
        plots.decode_rates(derived, report.parent / "decode_tok_s.png"),
        plots.decode_vs_context(decode, report.parent / "decode_vs_context.png"),
        plots.memory(decode, report.parent / "memory.png"),
        plots.profile_bars(profile, report.parent / "profile.png"),
        plots.load_curves(load, report.parent / "load.png"),
    ]
    env = environment()
    cells = ev.cells
    recall = recall_table(ev.records)
    too_long = recall.reason.fillna("").str.contains("does not fit context")
    figures = pub.all_figures()
    serving = serve_table(ev.records)
    views = [
        *like_for_like.decode_views(every_row),
        *like_for_like.serve_views(ev.records, judged),
        *like_for_like.recall_views(recall, cells, judged),
    ]
    peers = peer_tables(every_row, ev.records, noise.floors(pairs))
    served_levels = sorted({int(v) for v in load[load["mode"] == "concurrency"].value}) if not load.empty else []
    screens = summary.screens(derived, cells, judged, peers, load, recall, figures)
    text = env.get_template("REPORT.md.j2").render(
        screens=screens,
        decode_headlines=headline_tables(derived),
        way_legend=labels.legend(derived),
        published_span=lambda row: like_for_like.published_span(like_for_like.row_view(row), figures),
        serving=serving,
        serve_published=published_data.serving_row(figures),
        serve_same_method=lambda key: like_for_like.same_method(key, figures.set_index("id").loc[SERVED_FIGURE]),
        chat_screenshot=chat_screenshot(serving, evidence_dir, report.parent),
        cells=cells,
        decode=derived,
        decode_left_out=left_out(every_row),
        peers=peers,
        batch=batch_table(every_derived),
        served=served_at_concurrency(load, served_levels),
        served_levels=served_levels,
        verdict_table=verdicts.table(cells, judged),
        aa_pairs=pairs,
        noise_floors=noise.floors(pairs),
        recall=recall[~too_long],
        recall_not_fitting=int(too_long.sum()),
        parity=cells[(cells.experiment == "parity") & (cells.status == "ok")].sort_values(["model", "engine", "file"]),
        not_ok=cells[cells.status != "ok"].sort_values("file"),
        environments=cells.drop_duplicates(
            ["fingerprint", "device", "device_name", "cpu_model", "torch", "transformers", "git_sha"]
        ).sort_values(["device", "fingerprint", "git_sha"]),
        synthetic=bool(cells.synthetic.any()),
        sweeps=sweeps_table(cells),
        boot=boot_runs(ev.boot),
        published_boot=figures[figures.metric.isin(BOOT_FIGURES) | figures.id.isin(BOOT_IDS)],
        warnings=ev.warnings,
        costs=[e for e in measured if e.key.startswith("usd-per-mtok/") and e.result is not None],
        jax_gap={e.row[1]: e for e in measured if e.key.startswith("jax-vs-fastest-pytorch/")},
        jax_published=arithmetic.JAX_GAP_PUBLISHED,
        published_rates=published_rates(pub),
        published_derived=recomputed,
        articles=pub.articles,
        figures=figures,
        published_recall=published_data.recall_table(figures),
        bench=bench_table(evidence_dir.parent / "bench"),
        profile=profile,
        profile_plot=made[3],
        load=load,
        load_plot=made[4],
        why=article_tables.build(ev.records, every_row, pub),
        published_rate=lambda row: like_for_like.published_rate(like_for_like.row_view(row), figures),
        no_pair=like_for_like.NO_PAIR,
        no_way=like_for_like.NO_WAY,
        other_hardware=like_for_like.OTHER_HARDWARE,
        coverage=like_for_like.coverage(figures, views, cells, judged),
        pairs=like_for_like.pairs(views, figures),
        definitions=method.DEFINITIONS,
        table4_effect=definitions.table4_effect(every_row),
        table4_published=definitions.stated(recomputed, *definitions.TABLE4_EFFECT),
        read_speed=definitions.read_speed(recall, cells),
        read_speed_published=definitions.stated(recomputed, *definitions.READ_SPEED),
        first_token=definitions.first_token_kl(ev.records),
        first_token_published=definitions.printed(figures, *definitions.FIRST_TOKEN),
        sequence=definitions.sequence_kl(ev.records),
        sequence_published=definitions.printed(figures, *definitions.SEQUENCE),
        identity=definitions.token_identity(cells),
        identity_published={
            c: tuple(definitions.printed(figures, *ids).values()) for c, ids in definitions.IDENTITY.items()
        },
        nb02=definitions.n_over_warm_n(views, figures),
        plots=[p for p in made[:3] if p],  # the decode section's; the profile and load plots sit in their own
        arithmetic_path=arithmetic_out.resolve().relative_to(REPO).as_posix()
        if arithmetic_out.resolve().is_relative_to(REPO)
        else str(arithmetic_out),
    )
    write_text_atomic(report, text)
    return Outputs(report, arithmetic_out, [report.parent / p for p in made if p], summary.plain(screens))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--evidence", type=Path, default=REPO / "evidence" / "runs")
    parser.add_argument("--published", type=Path, default=REPO / "evidence" / "published")
    parser.add_argument("--report", type=Path, default=REPO / "reports" / "REPORT.md")
    parser.add_argument("--arithmetic", type=Path, default=REPO / "evidence" / "arithmetic.txt")
    args = parser.parse_args(argv)
    out = build(args.evidence, args.published, args.report, args.arithmetic)
    if out.report is None:
        print(f"arithmetic: {out.arithmetic} (the articles' figures only)")
        print(f"no report: no evidence files under {args.evidence} (run `make demo` or `python run.py`)")
        return 0
    print(out.summary, end="\n\n")
    for p in out.plots:
        print(f"plot:       {p}")
    print(f"arithmetic: {out.arithmetic}\nreport:     {out.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
