"""The report answers first (issue 45): a first screen per model and device generated from the tables, short way
labels with their legend, headline tables a reader can scan, plots whose text stays on the canvas, and the
evidence loader reading evidence only."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from reports import labels, plots, render, summary
from reports.tables import cells
from reports.tables.load import LOAD_COLUMNS
from runner import summarise
from tests.test_like_for_like import decode_cell, parity
from tests.test_report import PUBLISHED, QUIET, cell_record, write

HEADLINE_COLUMNS = 10  # the "about ten"


def _build(folder: Path):
    return render.build(folder, PUBLISHED, folder / "out" / "REPORT.md", folder / "out" / "arithmetic.txt")


def test_short_labels_name_only_the_settings_that_differ_and_the_legend_maps_them_back():
    table = pd.DataFrame(
        [
            {"engine": "ring", "engine_config": "attend=cache int4_limbs=3 one_row=mv weights=dense", "read_every": 0,
             "way": None, "replica": 0, "settings_without_effect": "int4_limbs"},
            {"engine": "ring", "engine_config": "attend=cache int4_limbs=3 one_row=auto weights=int4", "read_every": 0,
             "way": None, "replica": 0, "settings_without_effect": "one_row"},
            {"engine": "ring", "engine_config": "attend=cache int4_limbs=2 one_row=auto weights=int4", "read_every": 0,
             "way": None, "replica": 0, "settings_without_effect": "one_row"},
            {"engine": "ring", "engine_config": "attend=cache int4_limbs=3 one_row=linear weights=dense",
             "read_every": 0, "way": None, "replica": 0, "settings_without_effect": "int4_limbs"},
            {"engine": "compiled", "engine_config": "fullgraph=True one_row=mv", "read_every": 0, "way": None,
             "replica": 0},
            {"engine": "compiled", "engine_config": "fullgraph=False one_row=mv", "read_every": 0, "way": None,
             "replica": 1},
            {"engine": "generate", "engine_config": "", "read_every": 0, "way": "nb04/generate", "replica": 0},
            {"engine": "rust", "engine_config": "weights=int4", "read_every": 0, "way": None, "replica": 0},
            {"engine": "rust", "engine_config": "int4_limbs=2 weights=int4", "read_every": 0, "way": None,
             "replica": 0},
        ]
    )  # fmt: skip
    table["way_label"] = labels.short_labels(table)
    assert list(table.way_label) == [
        "ring·mv·dense",  # int4_limbs takes no effect with dense weights (its engine says so): not in the label
        "ring·int4_limbs=3·int4",  # nor one_row with int4 ones
        "ring·int4_limbs=2·int4",
        "ring·linear·dense",
        "compiled·fullgraph=True·A/A0",  # a value that does not name itself keeps its key
        "compiled·fullgraph=False·A/A1",
        "generate",  # one way of its engine: the bare name
        "rust·int4_limbs=–",  # evidence from before the setting existed does not record it
        "rust·int4_limbs=2",
    ]
    legend = labels.legend(table).set_index("way")
    assert legend.loc["ring·mv·dense", "settings"] == "attend=cache int4_limbs=3 one_row=mv weights=dense"
    assert legend.loc["generate", "article_way"] == "nb04/generate"


def test_the_decode_table_leaves_a_setting_without_effect_out_of_its_rows_label(tmp_path):
    """The engine's ``settings_without_effect`` reach the report's labels: the dense ring's ``int4_limbs`` (at its
    default, refused otherwise) does not name it; evidence that does not record them keeps every setting."""
    dense, four = {"weights": "dense", "int4_limbs": 3}, {"weights": "int4", "int4_limbs": 3}
    two = {"weights": "int4", "int4_limbs": 2}
    records = [cell_record("ring", experiment=experiment, settings=settings, without_effect=without)
               for experiment in ("parity", "decode")
               for settings, without in ((dense, ["int4_limbs"]), (four, ["one_row"]), (two, ["one_row"]))]  # fmt: skip
    write(tmp_path, *records)
    report = _build(tmp_path).report.read_text()
    assert all(f"| {label} |" in report for label in ("ring·dense", "ring·int4_limbs=2·int4", "ring·int4_limbs=3·int4"))
    write(tmp_path / "older", *[cell_record("ring", experiment=e, settings=s) for e in ("parity", "decode")
                                for s in (dense, two)])  # fmt: skip
    older = _build(tmp_path / "older").report.read_text()
    assert "| ring·int4_limbs=3·dense |" in older and "| ring·int4_limbs=2·int4 |" in older


def test_footnotes_mark_environments_only_where_they_differ():
    one = pd.DataFrame({"fingerprint": ["e1", "e1"], "code": ["abc", "abc"]})
    assert labels.footnotes(one) == (["", ""], ["every row: env e1 @ abc"])
    two = pd.DataFrame({"fingerprint": ["e1", "e2", "e1"], "code": ["abc", "abc", ""]})
    marks, notes = labels.footnotes(two)
    assert marks == ["¹", "²", "³"] and notes == ["¹ env e1 @ abc", "² env e2 @ abc", "³ env e1"]


@pytest.fixture
def sweep(tmp_path) -> Path:
    """Dense and int4 ring, generate, their parity checks; one contended ring file, one failed and one skipped cell;
    two of the articles' ways in the published order reversed (generate measured faster than compiled)."""
    int4 = {"weights": "int4"}
    write(
        tmp_path,
        cell_record("ring", experiment="parity", settings={"weights": "dense"}),
        cell_record("ring", experiment="parity", settings=int4),
        cell_record("generate", experiment="parity"),
        cell_record("ring", (40.0, 42.0), settings={"weights": "dense"}),
        cell_record("ring", (60.0, 64.0), settings=int4),
        cell_record("ring", (90.0,), settings=int4, sweep="busy",
                    contention={**QUIET, "contended": True, "other_cores": 1.0}),  # fmt: skip
        cell_record("generate", (8.0, 12.0)),
        cell_record("rust", status="failed"),
        cell_record("fuse", status="skipped"),
        parity("compiled"),
        parity("generate", {"loader": "transformers"}),
        decode_cell("compiled", (20.0, 21.0), way="nb04/compiled"),
        decode_cell("generate", (30.0, 31.0), settings={"loader": "transformers"}, way="nb04/generate"),
    )
    return tmp_path


def test_the_first_screen_answers_from_the_tables(sweep, capsys):
    out = _build(sweep)
    report = out.report.read_text()
    first = report[report.index("## The answer first") : report.index("## Decode: every way")]
    (fastest,) = [line for line in first.splitlines() if line.startswith("- Fastest VALID way")]
    # the int4 ring's two quiet samples (the contended file is left out): median 62, interval [60, 64]
    assert "**ring·int4** 62.00 tok/s [60.00, 64.00] n=2 (context 256, N=8)" in fastest
    assert f"{statistics.median([60.0, 64.0]) / statistics.median([8.0, 12.0]):.2f}x" in fastest  # x generate
    assert "[→ decode](#decode-every-way-of-running-the-model)" in fastest
    (left,) = [line for line in first.splitlines() if line.startswith("- Left out")]
    assert left.startswith("- Left out: 1 INVALID, 1 FAILED, 1 SKIPPED.") and "contended (ring·int4 decode)" in left
    (articles,) = [line for line in first.splitlines() if line.startswith("- The articles")]
    rates = summary.published_rates(render.published_data.load(PUBLISHED).all_figures())
    assert rates["nb04/compiled"] > rates["nb04/generate"]  # the published order this sweep reverses
    assert "does not hold for 1 of 1 pairs: nb04/compiled ahead of nb04/generate there" in articles
    assert "(other hardware: an order, no ratio)" in articles
    # every link points at a heading the report has
    headings = {summary.anchor(h) for h in re.findall(r"^#+ (.+)$", report, flags=re.M)}
    assert set(re.findall(r"\]\((#[^)]+)\)", first)) <= headings
    # `make report` prints the same screen to the terminal, without the links
    assert render.main(["--evidence", str(sweep), "--report", str(sweep / "t" / "R.md"),
                        "--arithmetic", str(sweep / "t" / "a.txt")]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "ring·int4 62.00 tok/s [60.00, 64.00] n=2" in printed and "[→" not in printed


def test_headline_tables_stay_within_ten_columns(sweep):
    report = _build(sweep).report.read_text()
    headline = report[: report.index("## Decode, in detail")]
    widths = [line.count("|") - 1 for line in headline.splitlines() if line.startswith("|---")]
    assert widths and max(widths) <= HEADLINE_COLUMNS, widths


def test_a_figure_with_text_past_its_canvas_is_refused(tmp_path):
    fig, ax = plt.subplots(figsize=(4, 3), layout="constrained")
    ax.plot([0, 1], [0, 1])
    assert plots.overflow(fig) == 0
    fig.text(1.3, 0.5, "past the right edge")  # at 130 % of the width: no wider canvas brings it in
    assert plots.overflow(fig) > 1
    with pytest.raises(ValueError, match="past the canvas"):
        plots.save(fig, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def _decode_rows(n: int) -> pd.DataFrame:
    long = "compiled·fullgraph=True·one_row=linear·per_layer_table=int4·last_piece=padded"
    return pd.DataFrame(
        {
            "way_label": [f"{long}·{i}" for i in range(n)],
            "model": ["e2b-synthetic"] * n,
            "device": ["cpu"] * n,
            "context": [256, 131328] * (n // 2),
            "max_new_tokens": [64] * n,
            "decode_median": [10.0 + i for i in range(n)],
            "decode_low": [9.0 + i for i in range(n)],
            "decode_high": [11.0 + i for i in range(n)],
            "roofline_pct": [50.0] * n,
            "memory_after_load": [4e9] * n,
            "memory_peak": [5e9] * n,
            "fingerprint": [f"env{i % 3}" for i in range(n)],
            "code": ["0123456789ab+dirtydirtydirty"] * n,
        }
    )


def test_every_plot_the_report_makes_fits_its_canvas_with_long_labels(tmp_path, monkeypatch):
    """Each plot through ``plots.save``, which measures what reaches past the canvas: the test records that every
    saved figure fit (0 inches past) and that each was written."""
    fits = {}
    real = plots.overflow

    def measured(fig):
        past = real(fig)
        fits[id(fig)] = past
        return past

    monkeypatch.setattr(plots, "overflow", measured)
    rows = _decode_rows(12)
    lines = rows.assign(way_label=[r.split("·")[0] + f"·{i % 3}" for i, r in enumerate(rows.way_label)])
    load = pd.DataFrame([{**dict.fromkeys(LOAD_COLUMNS), "file": f"f{k}", "engine": "llamacpp", "weights": "q4_0",
                          "max_batch": 1, "serving": "", "model": "e2b-synthetic", "device": "cpu", "level": f"c{c}",
                          "output_tok_s": 2.0 * c, "ttft_p50": 0.5 * c, "tpot_p50": 0.1, "slo_ttft_s": 2.0,
                          "slo_tpot_s": 0.1}
                         for k in range(3) for c in (1, 2, 4)])  # fmt: skip
    profile = pd.DataFrame([{"file": f"p{k}", "engine": "ring", "model": "e2b-synthetic", "device": "cpu",
                             "class": f"class with a long name {c}", "ms_per_token": 10.0 + c, "floor_ms": 3.0}
                            for k in range(2) for c in range(8)])  # fmt: skip
    made = [
        plots.decode_rates(rows, tmp_path / "decode.png"),
        plots.decode_vs_context(lines, tmp_path / "context.png"),
        plots.memory(rows, tmp_path / "memory.png"),
        plots.load_curves(load, tmp_path / "load.png"),
        plots.profile_bars(profile, tmp_path / "profile.png"),
    ]
    assert all(made) and all((tmp_path / name).is_file() for name in made)
    assert fits and all(past <= plots.SLACK_IN for past in list(fits.values()))
    assert len(fits) >= len(made)


def test_the_files_a_load_cell_keeps_beside_its_evidence_are_not_read_as_evidence(tmp_path):
    write(tmp_path, cell_record("ring", experiment="parity"), cell_record("ring"))
    exports = tmp_path / "s" / f"ring-decode-bfloat16{cells.evidence.AIPERF_EXPORTS}" / "c1"
    exports.mkdir(parents=True)
    (exports / "profile_export_aiperf.json").write_text('{"records": []}')
    ev = cells.load(tmp_path, tmp_path)
    assert len(ev.cells) == 2 and not ev.warnings
    assert summarise(tmp_path / "s") == f"sweep {tmp_path / 's'}: 2 ok"  # the sweep's own summary as well
