"""Like for like: a measured row is set beside a published figure only when their method keys are equal
(``reports.method``), the coverage table says where each article row stands, and the articles' own
definitions are computed as printed. Every case builds its evidence and checks the pairing it produces
against the published data in ``evidence/published/``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from decodebench import evidence
from reports import arithmetic, definitions, like_for_like, method, published, render, verdicts
from reports.tables import cells
from reports.tables.decode import decode_table
from reports.tables.recall import recall_table
from tests.test_report import PUBLISHED, cell_record, write

CT_TEXT, EMB4 = "W4A16 linears, bf16 tables", "int4 tables (-emb4)"
PER_LAYER = ["embed_tokens_per_layer"]
FIGURES = published.load(PUBLISHED).all_figures()


def by_id(figure: str) -> pd.Series:
    return FIGURES.set_index("id").loc[figure]


def decode_cell(
    engine: str,
    values: tuple[float, ...] = (50.0, 51.0),
    *,
    settings: dict | None = None,
    kept: list[str] | None = None,
    tables: str = CT_TEXT,
    way: str | None = None,
    context: int = 256,
    n: int = 64,
    read_every: int = 0,
    sweep: str = "s",
    measured: dict | None = None,
    outputs: dict | None = None,
    status: str = "ok",
    reason: str | None = None,
    experiment: str = "decode",
    dtype: str = "bfloat16",
    on_article_hardware: bool = False,
) -> dict:
    """A decode cell's evidence with the fields of its method key set: context, N, read-back, the way it
    names, the twin it read (``tables``), what its engine kept packed (``kept``; None: the engine records
    nothing, as the generate family and JAX), and further ``measured`` figures (name -> samples or value);
    ``on_article_hardware``: measured on a TPU v5e-1 with the real weights (else on a CPU, synthetic weights)."""
    record = cell_record(engine, values, sweep=sweep, settings=settings, status=status, experiment=experiment,
                         dtype=dtype)  # fmt: skip
    record["config"].update(context=context, max_new_tokens=n, read_every=read_every, way=way)
    record["model"]["tables_description"] = tables
    if on_article_hardware:
        record["hardware"]["name"] = "tpu-v5e-1"
        record["model"]["synthetic"] = False
    if kept is not None and status == "ok":
        record["engine"] = {"kept_4bit": kept}
    if status == "ok" and experiment == "decode":
        record["measurements"]["max_new_tokens"] = evidence.scalar(n, "tok").to_json()
        for name, value in (measured or {}).items():
            shaped = evidence.samples(value, "x") if isinstance(value, list) else evidence.scalar(value, "x")
            record["measurements"][name] = shaped.to_json()
    record["outputs"].update(outputs or {})
    if status != "ok":
        record["reason"] = reason or record["reason"]
    parts = [engine, experiment, *(f"{k}={v}" for k, v in sorted((settings or {}).items())), way, f"ctx{context}",
             f"re{read_every}", dtype]  # fmt: skip
    record["cell"] = "-".join(str(p).replace("/", "_") for p in parts if p)
    evidence.validate(record)
    return record


def parity(engine: str, settings: dict | None = None, sweep: str = "s", **measured: dict) -> dict:
    """A passing parity cell for ``engine`` with ``settings`` (what makes its decode cells VALID)."""
    record = cell_record(engine, experiment="parity", settings=settings, sweep=sweep)
    record["measurements"].update({k: v for k, v in measured.items()})
    name = "-".join(f"{k}={v}" for k, v in sorted((settings or {}).items()))
    record["cell"] = f"{engine}-parity-{name}".rstrip("-")
    return record


def views(folder: Path) -> tuple[cells.Evidence, dict, pd.DataFrame, list[like_for_like.View]]:
    ev = cells.load(folder, folder)
    judged = verdicts.judge(ev.cells, ev.records)
    table = decode_table(ev.cells, judged)
    found = [
        *like_for_like.decode_views(table),
        *like_for_like.serve_views(ev.records, judged),
        *like_for_like.recall_views(recall_table(ev.records), ev.cells, judged),
    ]
    return ev, judged, table, found


def rate_beside(table: pd.DataFrame, **where) -> str:
    """The decode table's *published* column for the one row matching ``where``."""
    rows = table
    for column, value in where.items():
        rows = rows[rows[column] == value]
    (row,) = [r for _, r in rows.iterrows()]
    assert row.verdict == verdicts.VALID, row.left_out
    return like_for_like.published_rate(like_for_like.row_view(row), FIGURES)


# ---------------------------------------------------------------- the key and its equality ----------------------


def key(**fields) -> dict:
    base = {"engine": "table4", "mode": "compiled", "kept_4bit": "per-layer table", "read_every": 0, "served": "bare",
            "experiment": "decode", "context": 256, "twin": "emb4", "dtype": "bfloat16", "max_new_tokens": 64,
            "prompt": {"text": "p", "tokens": 19}, "loader": "decodebench", "way": None}  # fmt: skip
    return {**base, **fields}


def test_equal_keys_pair_and_each_field_that_differs_is_named():
    assert method.differences(key(), key()) == []
    assert method.differences(key(context=33024), key()) == ["context: measured 33024, published 256"]
    assert method.differences(key(read_every=1), key()) == ["read_every: measured 1, published 0"]
    assert method.differences(key(context=256.0), key()) == []  # counts read back as floats are counts


def test_an_unknown_published_field_pairs_with_nothing_and_any_with_everything():
    assert method.differences(key(), key(context=None)) == ["context: the article does not say"]
    assert method.differences(key(), {k: v for k, v in key().items() if k != "loader"}) == [
        "loader: the article does not say"
    ]
    assert method.differences(key(context=131328, loader="transformers"), key(context="any", loader="any")) == []
    assert method.differences(key(loader=None), key()) == ["loader: not recorded in the evidence"]


def test_the_prompt_matches_on_every_part_the_article_gives():
    assert method.differences(key(), key(prompt={"tokens": 19})) == []
    assert method.differences(key(), key(prompt={"text": "p"})) == []
    assert method.differences(key(), key(prompt={"tokens": 17})) == ["prompt tokens: measured 19, published 17"]
    assert method.differences(key(prompt={"text": "p", "tokens": None}), key(prompt={"tokens": 19})) == [
        "prompt tokens: not recorded in the evidence"
    ]
    assert method.differences(key(), key(prompt="any")) == []


def test_a_way_is_compared_only_when_the_cell_names_one():
    assert method.differences(key(way=None), key(way="nb04/compiled-4bit-table")) == []
    both = ["nb03/jax_bf16", "nb04/jax-bf16"]  # a figure in two ways' rows
    assert method.differences(key(way="nb04/jax-bf16"), key(way=both)) == []
    assert method.differences(key(way="nb04/compiled"), key(way="nb04/compiled-4bit-table")) == [
        "way: measured nb04/compiled, published nb04/compiled-4bit-table"
    ]
    assert method.differences(key(way="nb04/compiled"), key(way=None)) == [
        "way: measured nb04/compiled, published run by no way"
    ]


@pytest.mark.parametrize(
    ("packed", "engine", "kept"),
    [
        ([], {"name": "compiled"}, "none"),
        (PER_LAYER, {"name": "table4"}, "per-layer table"),
        (["embed_tokens_per_layer", "embed_tokens"], {"name": "ring"}, "all tables"),
        (["embed_tokens_per_layer", "embed_tokens", "linears"], {"name": "ring", "weights": "int4"}, "all linears"),
        (None, {"name": "jax", "weights": "int4"}, "all linears"),  # JAX records no list: its config says
        (None, {"name": "ring", "per_layer_table": "int4"}, "per-layer table"),  # a cell that did not run
        (None, {"name": "generate"}, "none"),
    ],
)
def test_what_is_kept_4bit_comes_from_the_evidence_or_the_config(packed, engine, kept):
    assert method.kept_4bit(packed, engine) == kept


# ---------------------------------------------------------------- the published keys ------------------------------


def test_every_way_a_published_key_names_is_a_way_file():
    named = {w for m in FIGURES.method.dropna() for w in (m["way"] if isinstance(m["way"], list) else [m["way"]]) if w}
    assert named and named <= like_for_like.way_files()


def test_every_rate_the_articles_tabulate_carries_a_key_and_inferred_fields_cite_their_sentence():
    tables = FIGURES.table.str.contains("Headline|Step 8|Step 5")
    rates = FIGURES[FIGURES.metric.isin(like_for_like.RATE_METRICS) & tables]
    assert not rates.empty and all(isinstance(m, dict) for m in rates.method)
    table4 = by_id("nb04_table4_tok_s")
    assert table4.method["kept_4bit"] == "per-layer table" and table4.method["prompt"] == method.ANY
    assert "every way in this article computes in bf16" in table4.inferred["dtype"]
    assert "so the prompt drops out" in table4.inferred["prompt"]
    assert (
        "article does not print the tpu-jax engine's cache length"
        in by_id("nb03_jax_bf16_decode_tok_s").unknown["context"]
    )


def test_published_data_with_a_bad_key_is_refused(tmp_path):
    data = yaml.safe_load((PUBLISHED / "rust-torchtpu.yaml").read_text())
    figure = next(f for f in data["figures"] if f["id"] == "cmp_rust_decode_tok_s")
    for change, message in (
        ({"method": {**figure["method"], "mode": "fast"}}, "mode='fast' is none of"),
        ({"method": {**figure["method"], "colour": "red"}}, "unknown key field 'colour'"),
        ({"unknown": {"context": "not printed"}}, "unknown names context, which is given"),
        ({"inferred": {"kept_4bit": "a guess"}}, "inferred names kept_4bit, which is unknown"),
        ({"definition": "by eye"}, "definition 'by eye' is none of"),
    ):
        broken = dict(data, figures=[{**figure, **change}], derived=[])
        (tmp_path / "a.yaml").write_text(yaml.safe_dump(broken))
        with pytest.raises(published.PublishedDataError, match=message):
            published.load(tmp_path)


# ---------------------------------------------------------------- the mispairings, fixed ---------------------------


def test_a_defer_and_fuse_static_row_pairs_with_the_defer_and_fuse_figure_not_strict_eager(tmp_path):
    transformers = {"loader": "transformers"}
    write(
        tmp_path,
        *(parity("static", {**transformers, "mode": m}) for m in ("eager", "fuse")),
        parity("static", {"mode": "fuse"}),
        *(decode_cell("static", settings={**transformers, "mode": m}) for m in ("eager", "fuse")),
        decode_cell("static", settings={"mode": "fuse"}),
    )
    _, _, table, _ = views(tmp_path)
    fuse = rate_beside(table, engine_config="loader=transformers mode=fuse")
    assert fuse.startswith("10.6 to 11.0 (torchtpu-colab: Step 8") and "4.2" not in fuse
    assert rate_beside(table, engine_config="loader=transformers mode=eager").startswith("4.2 to 4.5 (")
    # decodebench's loader leaves no compressed-tensors wrappers on: not the article's generate over StaticCache
    assert rate_beside(table, engine_config="mode=fuse") == like_for_like.NO_PAIR


def test_a_jax_int4_row_is_never_set_beside_jax_bf16(tmp_path):
    write(tmp_path, parity("jax", {"weights": "int4"}), decode_cell("jax", settings={"weights": "int4"}))
    _, _, table, found = views(tmp_path)
    assert rate_beside(table, engine="jax") == like_for_like.NO_PAIR
    (view,) = found
    assert view.key["kept_4bit"] == "all linears"
    assert "kept_4bit: measured all linears, published none" in method.differences(
        view.key, by_id("nb03_jax_bf16_decode_tok_s").method
    )
    w4a16 = method.differences(view.key, by_id("nb03_jax_w4a16_decode_tok_s").method)
    assert not any(d.startswith("kept_4bit") for d in w4a16)  # its own row: only what the article leaves open
    assert "context: the article does not say" in w4a16


def test_a_streamed_row_pairs_with_the_streamed_figures_and_the_batched_with_the_batched(tmp_path):
    table4 = dict(kept=PER_LAYER, tables=EMB4, on_article_hardware=True)
    write(
        tmp_path,
        parity("table4"),
        decode_cell("table4", **table4, measured={"decode_streamed_tok_s": [33.0, 34.0]}),
        decode_cell("table4", (30.0, 31.0), **table4, read_every=1),
    )
    _, _, table, found = views(tmp_path)
    assert rate_beside(table, engine="table4", read_every=1).startswith("32.4 to 37.2 (torchtpu-colab: Tip: Stream")
    assert rate_beside(table, engine="table4", read_every=0).startswith("50.2 to 50.4 (torchtpu-colab: Step 8")
    pairs = like_for_like.pairs(found, FIGURES)
    inside = pairs[pairs.view.str.endswith("streamed inside the same cells (read_every=1)")]
    assert set(inside.figure) == {"nb04_table4_streamed_tok_s"}
    assert inside.measured.iloc[0] == "33.50 [33.00, 34.00] n=2"
    assert inside.ratio.iloc[0] == f"{33.5 / 37.2:.2f}x to {33.5 / 32.4:.2f}x"


def test_an_int4_ring_row_is_not_set_beside_the_articles_dense_linear_ring(tmp_path):
    ring = dict(tables=EMB4, context=33024)
    int4 = {"weights": "int4"}
    write(
        tmp_path,
        parity("ring"),
        parity("ring", int4),
        decode_cell("ring", **ring, kept=PER_LAYER),
        decode_cell("ring", (90.0, 91.0), **ring, settings=int4, kept=[*PER_LAYER, "embed_tokens", "linears"]),
    )
    _, _, table, _ = views(tmp_path)
    assert rate_beside(table, engine_config="weights=int4") == like_for_like.NO_PAIR
    dense = rate_beside(table, engine_config="")
    assert dense.startswith("45.2 (torchtpu-colab: Step 10") and "engine timer: see *engine timers*" in dense


def test_the_jax_ratio_compares_like_weights_with_like(tmp_path):
    int4 = {"weights": "int4"}
    write(
        tmp_path,
        *(parity(e, s) for e, s in (("jax", None), ("jax", int4), ("compiled", None), ("ring", int4))),
        decode_cell("jax", (100.0, 100.0)),
        decode_cell("jax", (80.0, 80.0), settings=int4),
        decode_cell("compiled", (50.0, 50.0)),
        decode_cell("ring", (600.0, 600.0), settings=int4),  # faster than every dense way: not JAX dense's peer
    )
    _, _, table, _ = views(tmp_path)
    entries = {e.key: e for e in arithmetic.jax_gap(table)}
    dense = next(e for e in entries.values() if "weights=int4" not in e.key)
    packed = next(e for e in entries.values() if "weights=int4" in e.key)
    assert (dense.result, dense.inputs[1].name) == (2.0, "fastest_pytorch_tok_s (compiled)")
    assert (packed.result, packed.inputs[1].name) == (80.0 / 600.0, "fastest_pytorch_tok_s (ring)")


# ---------------------------------------------------------------- coverage ----------------------------------------


def test_the_coverage_table_says_where_each_article_row_stands(tmp_path):
    write(
        tmp_path,
        parity("table4"),
        parity("jax"),
        decode_cell("table4", (45.0, 46.0), kept=PER_LAYER, tables=EMB4, way="nb04/compiled-4bit-table",
                    on_article_hardware=True),
        decode_cell("jax", (120.0, 121.0), way="nb03/jax_bf16"),
        decode_cell("generate", (5.0, 5.1), settings={"loader": "transformers"}, way="nb04/generate"),  # no parity
        decode_cell(
            "static",
            status="skipped",
            settings={"mode": "fuse", "loader": "transformers"},
            way="nb04/static-fuse",
            reason="engine static with mode=fuse runs on a TPU only",
        ),
    )
    ev, judged, _, found = views(tmp_path)
    table = like_for_like.coverage(FIGURES, found, ev.cells, judged).set_index(["table", "row"])
    step8 = "Step 8: the seven ways of notebook 04"
    reproduced = table.loc[(step8, "Compiled step, 4-bit table")]
    assert reproduced.status == "reproduced"
    assert reproduced.detail.startswith(f"45.50 [45.00, 46.00] n=2 / 50.2 to 50.4 = {45.5 / 50.4:.2f}x to ")
    skipped = table.loc[(step8, "Static cache, defer-and-fuse")]
    assert (skipped.status, skipped.detail.split(" (`")[0]) == (
        "not runnable here",
        "engine static with mode=fuse runs on a TPU only",
    )
    jax = table.loc[("Step 5: against JAX on the same chip (notebook 03)", "jax_bf16")]
    assert jax.status == "measured, not the same method" and "context: the article does not say" in jax.detail
    generate = table.loc[(step8, "generate")]
    assert generate.status == "measured, not VALID" and verdicts.NO_PARITY in generate.detail
    compiled = table.loc[(step8, "Compiled step")]
    assert (compiled.status, compiled.detail) == (
        "not yet measured",
        "`.venv/bin/python run.py way=nb04/compiled model=e2b-w4a16`",
    )
    compressed = table.loc[("Step 4: every way to generate, out of the box (notebook 02)", "compressed")]
    assert (compressed.status, compressed.detail) == (
        "not yet measured",
        "`.venv/bin/python run.py way=nb02/compressed model=e2b-w4a16`",
    )
    assert like_for_like.command({"way": None}, like_for_like.way_files(), {}) == like_for_like.NO_WAY


def test_the_report_answers_first_and_sets_rates_beside_their_own_method(tmp_path):
    write(tmp_path, parity("table4"),
          decode_cell("table4", (45.0, 46.0), kept=PER_LAYER, tables=EMB4, on_article_hardware=True))  # fmt: skip
    out = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    report = out.report.read_text()
    order = ["## The answer first", "## Decode: every way", "## Coverage of the articles' tables",
             "## Decode, in detail", "## Verdict per cell", "## Environment and provenance"]  # fmt: skip
    assert [report.index(h) for h in order] == sorted(report.index(h) for h in order)
    assert "| torchtpu-colab | Step 8: the seven ways of notebook 04 | Compiled step, 4-bit table | 50.2 to 50.4 " \
           "tok/s | reproduced |" in report  # fmt: skip
    headline = report[report.index("## Decode: every way") : report.index("### Memory")]
    assert "| 50.2 to 50.4 |" in headline  # the published rate of the same method, as printed
    detail = report[report.index("## Decode, in detail") :]
    # the same figure in the detail table and the comparison tables, and notebook 05's timing of the same step
    beside = "50.2 to 50.4 (torchtpu-colab: Step 8: the seven ways of notebook 04; and 4 more in *Like for like*)"
    assert f"| {beside} |" in detail


def test_the_same_method_on_other_hardware_is_named_so_without_a_ratio(tmp_path):
    write(tmp_path, parity("table4"), decode_cell("table4", (45.0, 46.0), kept=PER_LAYER, tables=EMB4))
    ev, judged, _, found = views(tmp_path)
    table = like_for_like.coverage(FIGURES, found, ev.cells, judged).set_index(["table", "row"])
    row = table.loc[("Step 8: the seven ways of notebook 04", "Compiled step, 4-bit table")]
    assert row.status == like_for_like.OTHER_HARDWARE
    assert "on cpu with synthetic weights" in row.detail and "tpu-v5e-1" in row.detail
    assert "x" not in row.detail.split(": ")[-1] and "/ 50.2" not in row.detail  # no ratio
    pairs = like_for_like.pairs(found, FIGURES)
    assert not pairs.empty and set(pairs.ratio) == {like_for_like.OTHER_HARDWARE}
    out = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    report = out.report.read_text()
    assert "| same method, other hardware |" in report and "| reproduced |" not in report
    assert "; 5 same method, other hardware." in report  # the coverage counts name the status (5 rows share its key)


# ---------------------------------------------------------------- definitions and the other columns -------------


def test_every_printed_column_is_set_beside_its_counterpart(tmp_path):
    nb03 = {"loader": "transformers"}
    write(
        tmp_path,
        parity("generate", nb03),
        decode_cell(
            "generate",
            (4.0, 5.0),
            settings=nb03,
            way="nb03/torch_eager",
            measured={"warm_1_s": [0.2, 0.3], "warm_n_s": [13.0, 14.0], "load_s": 20.0, "prompt_tokens": 19},
            on_article_hardware=True,
        ),
    )
    _, _, _, found = views(tmp_path)
    pairs = like_for_like.pairs(found, FIGURES).set_index("figure")
    assert pairs.loc["nb03_torch_eager_warm1_s"].measured == "0.250 [0.200, 0.300] n=2"
    assert pairs.loc["nb03_torch_eager_warm64_s"].measured == "13.50 [13.00, 14.00] n=2"
    warm = 13.531  # the article's warm 64 s
    assert pairs.loc["nb03_torch_eager_warm64_s"].ratio == f"{13.5 / warm:.2f}x [{13 / warm:.2f}, {14 / warm:.2f}]"
    assert pairs.loc["nb03_torch_eager_decode_tok_s"].measured_as == "(N-1)/(T_N-T_1)"
    # the memory the article printed for the way: the cell's reading right after the first call
    assert pairs.loc["nb03_torch_eager_memory_gb"].measured.startswith("not measured")


def test_notebook_02s_rate_is_n_over_the_warm_n_token_call(tmp_path):
    loader = {"loader": "transformers_dense"}
    write(
        tmp_path,
        parity("generate", loader),
        decode_cell(
            "generate",
            (4.0, 4.0),
            settings=loader,
            way="nb02/eager",
            n=32,
            measured={"warm_n_s": [8.0, 6.4], "prompt_tokens": 19},
        ),
    )
    ev, _, _, found = views(tmp_path)
    (row,) = definitions.n_over_warm_n(found, FIGURES).itertuples()
    assert row.row == "eager" and row.published == "4.6"
    assert row._3 == "4.50 [4.00, 5.00] n=2"  # 32 / 8.0 = 4.0 and 32 / 6.4 = 5.0
    assert row._6 == "4.00 [4.00, 4.00] n=2"  # the same row's (N-1)/(T_N-T_1), beside


def test_token_identity_counts_the_first_identical_ids_of_ring_and_the_table_step(tmp_path):
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    write(
        tmp_path,
        decode_cell("ring", n=8, context=33024, kept=PER_LAYER, outputs={"generated_ids": ids}),
        decode_cell("table4", n=8, kept=PER_LAYER, outputs={"generated_ids": [*ids[:5], 99, 11, 12]}),
        decode_cell("table4", n=8, sweep="other", kept=PER_LAYER, outputs={"generated_ids": ids}),  # another sweep
    )
    (row,) = definitions.token_identity(cells.load(tmp_path, tmp_path).cells).itertuples()
    assert row.identical == "first 5 of 8 identical" and row.sweep == "s"


def test_the_parity_definitions_are_read_as_each_article_printed_them(tmp_path):
    kl = evidence.scalar(2.5e-5, "nats").to_json()
    sequence = evidence.scalar(0.0011, "nats", positions=83).to_json()
    top1 = evidence.scalar(82, "positions", of=83).to_json()
    write(tmp_path, parity("jax", parity_first_token_kl=kl, parity_sequence_kl_mean=sequence,
                           parity_sequence_top1_same=top1))  # fmt: skip
    records = cells.load(tmp_path, tmp_path).records
    (first,) = definitions.first_token_kl(records).itertuples()
    assert first.compared == "jax against Transformers, bfloat16" and first._3 == "2.500e-05"
    (seq,) = definitions.sequence_kl(records).itertuples()
    assert (seq._3, seq.positions, seq._5) == ("0.0011", 83, "82 of 83")


def test_the_4bit_tables_freed_memory_and_speed_up_come_from_one_sweep(tmp_path):
    memory = {"memory_after_load": 9.8e9}
    write(
        tmp_path,
        parity("compiled"),
        parity("table4"),
        decode_cell("compiled", (30.0, 32.0), measured=memory),
        decode_cell("table4", (48.0, 50.0), kept=PER_LAYER, tables=EMB4, measured={"memory_after_load": 6.4e9}),
    )
    _, _, table, _ = views(tmp_path)
    (row,) = definitions.table4_effect(table).itertuples()
    assert row._7 == "3.4"  # 9.8 GB - 6.4 GB
    assert row._9 == f"{49 / 31:.2f}x [1.50, 1.67] n=2/2"  # bounds 48 / 32 and 50 / 30 (two samples a side)


def test_the_read_speed_ratio_is_the_same_prompt_at_the_larger_context_over_the_smaller(tmp_path):
    def recall(context: int, reads: list[float]) -> dict:
        outcome = {
            "target_tokens": 64,
            "status": "ok",
            "prompt_tokens": 60,
            "read_s": 0.1,
            "read_tok_s": 600.0,
            "decode_tok_s": 40.0,
            "answer_code": "1",
            "found": True,
            "prompt_sha256": "abc",
            "method": "engine phase timers in one generate(N): read_s to the first token, (N-1)/decode_s",
        }
        record = cell_record("ring", experiment="recall", recall=[outcome])
        record["config"]["context"] = context
        record["measurements"]["recall_64_read_tok_s"] = evidence.samples(reads, "tok/s").to_json()
        record["cell"] = f"ring-recall-{context}"
        return record

    write(tmp_path, recall(33024, [600.0, 620.0]), recall(131328, [300.0, 330.0]))
    ev = cells.load(tmp_path, tmp_path)
    (row,) = definitions.read_speed(recall_table(ev.records), ev.cells).itertuples()
    assert row.contexts == "131328 over 33024"
    assert row._6 == f"{100 * 315 / 610:.0f}% [{100 * 300 / 620:.0f}%, {100 * 330 / 600:.0f}%] n=2/2"


def test_a_recall_row_not_of_the_same_method_names_the_prompt_nearest_its_own():
    """Rows differing in as many fields: the one of the nearest prompt length is named (not the first found)."""
    fig = FIGURES.set_index("id").loc["nb05_recall_33024_4081_prompt_tokens"]
    key = {**fig.method, "max_new_tokens": 64, "loader": "decodebench"}
    found = [like_for_like.View(f"prompt {n}", {**key, "prompt": {"text": None, "tokens": n}}, True, "VALID", {})
             for n in (60, 4089, 32768)]  # fmt: skip
    status, detail = like_for_like._status(fig, found, pd.DataFrame(columns=["file"]), {}, set(), {})
    assert status == "measured, not the same method" and detail.startswith("prompt 4089: ")
    assert "prompt tokens: measured 4089, published 4081" in detail
