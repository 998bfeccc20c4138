"""`make report`: pure, deterministic, robust to bad files; the arithmetic checked by hand."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from decodebench.checkpoint import layers_of_config, shape_of_config
from decodebench.synthetic import shape_of, text_config
from decodebench.synthetic_tokenizer import TURN_END
from reports import arithmetic, published, render
from reports.tables.bench import bench_table
from runner import run_cell
from tests.conftest import REPO, make_cfg

PUBLISHED = REPO / "evidence" / "published"


@pytest.fixture(scope="module")
def evidence_dir(tmp_path_factory, cache_dir, tiny) -> Path:
    """A small real sweep: two engines' decode cells, one parity cell, one skipped cell."""
    from tests.conftest import make_cfg

    runs = tmp_path_factory.mktemp("evidence")
    common = [
        f"cache_dir={cache_dir}",
        f"evidence_dir={runs}",
        "sweep=r",
        "device=cpu",
        "max_new_tokens=6",
        "repeats=2",
    ]
    for overrides in (
        ["engine=generate"],
        ["engine=ring", "engine.backend=eager"],
        ["engine=fuse"],
        ["engine=ring", "engine.backend=eager", "experiment=parity", "max_new_tokens=6"],
    ):
        assert run_cell(make_cfg(*common, *overrides))["status"] in ("ok", "skipped")
    return runs


def _render(evidence: Path, out: Path) -> tuple[bytes, bytes]:
    result = render.build(evidence, PUBLISHED, out / "REPORT.md", out / "arithmetic.txt")
    assert result is not None
    return (out / "REPORT.md").read_bytes(), (out / "arithmetic.txt").read_bytes()


def test_rendering_twice_gives_the_same_bytes(evidence_dir, tmp_path):
    first = _render(evidence_dir, tmp_path)
    pngs = {p.name: p.read_bytes() for p in tmp_path.glob("*.png")}
    second = _render(evidence_dir, tmp_path)
    assert first == second
    assert pngs and pngs == {p.name: p.read_bytes() for p in tmp_path.glob("*.png")}


def test_report_sections_and_labels(evidence_dir, tmp_path):
    report, arith = (b.decode() for b in _render(evidence_dir, tmp_path))
    assert "Synthetic weights" in report and "published" in report
    assert "| ring |" in report and "| generate |" in report
    assert "engine fuse runs on tpu" in report  # skipped cells appear with their reason
    assert "## Parity with Transformers" in report and "| pass |" in report
    assert "[decode-ratio/ring-vs-generate/" in arith and "[roofline/ring/" in arith
    assert "[published/rust-torchtpu/cost_rust_usd_per_mtok]" in arith


def test_a_corrupt_file_is_named_and_the_rest_renders(evidence_dir, tmp_path):
    bad = tmp_path / "runs"
    shutil.copytree(evidence_dir, bad)
    (bad / "r" / "broken.json").write_text("{ not json")
    (bad / "r" / "wrong.json").write_text('{"schema_version": "1.0", "status": "great"}')
    report, _ = (b.decode() for b in _render(bad, tmp_path / "out"))
    assert "broken.json: unreadable" in report and "wrong.json: does not follow evidence/schema.json" in report
    assert "| ring |" in report


def test_empty_evidence_still_writes_the_articles_arithmetic(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    args = ["--evidence", str(runs), "--report", str(tmp_path / "R.md"), "--arithmetic", str(tmp_path / "a.txt")]
    assert render.main(args) == 0
    assert "no report: no evidence files" in capsys.readouterr().out
    assert not (tmp_path / "R.md").exists()
    text = (tmp_path / "a.txt").read_text()
    assert arithmetic.NOTHING_MEASURED in text
    pub = published.load(PUBLISHED)
    derived = sum(len(items) for items in pub.derived.values())
    assert text.count("[published/") == derived > 60


@pytest.mark.parametrize(
    ("result", "printed", "agrees"),
    [
        (130.71, "130.8", False),  # nb03: values of 100 or more are compared at their decimals
        (130.76, "130.8", True),
        (143.98, "143.6", False),  # nb01
        (25.08, "25.0", False),  # nb04: the trailing zero is a printed decimal
        (25.04, "25.0", True),
        (14.816, "14.8", True),
        (14.864, "14.8", False),
        (6601.4, "6601", True),
        (6601.6, "6601", False),
        (0.0, "0.0e+00", True),
        (-0.0, "0.0e+00", True),
        (1e-9, "0.0e+00", False),  # e-notation precision is relative: 1.0e-09
        (0.04, "0.0", True),
        (1.2e-3, "1.1e-03", False),
        (13.664, "13.66", True),
    ],
)
def test_agrees_only_at_the_printed_precision(result, printed, agrees):
    assert arithmetic.agrees_as_printed(result, printed) is agrees


def test_the_three_entries_that_used_to_say_agrees_now_differ():
    pub = published.load(PUBLISHED)
    entries = {e.key: e for e in arithmetic.published(pub.figures, pub.derived)}
    for key in (
        "nb03_jax_bf16_decode_tok_s_from_times",
        "nb01_compile_tflop_s_from_step",
        "nb04_jax_bf16_x_generate_min",
    ):
        entry = entries[f"published/torchtpu-colab/{key}"]
        assert entry.agrees is False and "differs at the printed precision" in entry.notes[0]
        assert len(entry.notes) > 1, "a differing entry explains the article's rounding"
    for entry in entries.values():
        if entry.result is not None:
            assert entry.agrees == arithmetic.agrees_as_printed(entry.result, entry.stated)


def test_a_stated_number_that_is_not_the_printed_string_is_refused(tmp_path):
    data = yaml.safe_load((PUBLISHED / "rust-torchtpu.yaml").read_text())
    data["derived"][0]["stated"] = 25.0
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(published.PublishedDataError, match="must be the printed string"):
        published.load(tmp_path)


def row(**values) -> pd.Series:
    base = {
        "engine": "ring",
        "engine_config": "",
        "model": "m",
        "checkpoint": "k",
        "device": "tpu",
        "device_name": "",
        "context": 256,
        "dtype": "bfloat16",
        "read_every": 0,
        "max_new_tokens": 64,
        "decode_median": 50.0,
        "n": 2,
        "files": ["evidence/runs/x.json"],
        "price_usd_per_hour": 0.60,
        "hardware": "tpu-v5e-1",
        "bandwidth_gb_s": 858.99,
        "bandwidth_source": "facts file",
        "prompt_tokens": 19,
        "key": "m/k/tpu/ctx256/bfloat16/N=64/read_every=0",
        "weights": "dense",
    }
    return pd.Series({**base, **values})


def test_cost_and_ratio_by_hand():
    decode = pd.DataFrame([row(engine="generate", decode_median=5.0), row(engine="compiled", decode_median=32.5)])
    ratio = arithmetic.decode_ratios(decode)
    assert len(ratio) == 1 and ratio[0].result == pytest.approx(6.5)
    cost = {e.key.split("/")[1]: e for e in arithmetic.costs(decode)}
    # 0.60 USD/h / (32.5 tok/s * 3600 s/h) * 1e6 = 5.128... USD per million tokens
    assert cost["compiled"].result == pytest.approx(5.1282, rel=1e-4)
    assert "5.13 USD/Mtok" in cost["compiled"].text()


def e2b_model_block() -> dict:
    """The model block an E2B-shaped evidence file records: its shape and per-layer layout."""
    model = make_cfg("model=e2b-synthetic").model
    config = text_config(shape_of(model), {"<pad>": 0, "<bos>": 2, "<eos>": 1, TURN_END: 106})
    return {"shape": shape_of_config(config), "layers": layers_of_config(config)}


def test_bytes_per_token_matches_the_e2b_reference_figures():
    model = e2b_model_block()
    weights, kv, parts = arithmetic.bytes_per_token(model["shape"], model["layers"], 2, 131072)
    assert parts["linears"] == 1_876_819_968 * 2  # quantizable linears of E2B, in bf16 (notes 1.5)
    assert parts["lm_head"] == 262144 * 1536 * 2
    assert kv == 28672 * 512 + 14336 * 131072  # notes 1.6: 28,672 min(T,512) + 14,336 T bytes
    assert math.isclose(weights / 1e9, 4.559, rel_tol=1e-3)


def test_roofline_fraction_by_hand():
    decode = pd.DataFrame([row(decode_median=50.0, prompt_tokens=96, max_new_tokens=64)])
    models = {"evidence/runs/x.json": e2b_model_block()}
    entries = {e.key.split("/")[0]: e for e in arithmetic.roofline(decode, models)}
    per_token = entries["bytes-per-token"].result
    assert entries["roofline"].result == pytest.approx(100 * per_token * 50.0 / 1e9 / 858.99)


def test_published_data_loads_and_recomputes_the_articles():
    pub = published.load(PUBLISHED)
    assert set(pub.figures) == {"torchtpu-colab", "rust-torchtpu"}
    entries = {e.key: e for e in arithmetic.published(pub.figures, pub.derived)}
    cost = entries["published/rust-torchtpu/cost_vllm_usd_per_mtok"]
    assert cost.result == pytest.approx(0.60 / (144.1 * 3600) * 1e6) and cost.agrees
    assert entries["published/rust-torchtpu/vllm_vs_rust"].result == pytest.approx(144.1 / 12.20)
    figures = pub.all_figures()
    assert (figures.unit.notna()).all() and (figures.source.str.len() > 0).all()


def test_published_loader_rejects_bad_entries(tmp_path):
    good = yaml.safe_load((PUBLISHED / "rust-torchtpu.yaml").read_text())
    broken = dict(
        good,
        derived=[
            {
                "id": "x",
                "inputs": {"a": "no_such_figure"},
                "formula": "a",
                "statement": "s",
                "stated": "1",
                "unit": "x",
                "source": "s",
            }
        ],
    )
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(broken))
    with pytest.raises(published.PublishedDataError, match="unknown figure no_such_figure"):
        published.load(tmp_path)
    nameless = dict(good, derived=[], figures=[{**good["figures"][0], "source": None}])
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(nameless))
    with pytest.raises(published.PublishedDataError, match="lacks source"):
        published.load(tmp_path)


def test_comparator_matches_engine_context_and_twin():
    figures = published.load(PUBLISHED).all_figures()
    ring_256 = published.comparator(figures, "ring", 256, "ct-text")
    assert ring_256.startswith("45.2") and "nearest published context 33024" in ring_256
    assert published.comparator(figures, "ring", 131328, "emb4").startswith("38.6 to 38.7 (context 131328;")
    table4 = published.comparator(figures, "table4", 256, "emb4")
    assert table4.startswith("50.2 to 50.4 (context 256;")
    compiled = published.comparator(figures, "compiled", 256, "ct-text")
    assert compiled.startswith("31.3 to 33.4 (context 256;") and "45.1" not in compiled
    assert published.comparator(figures, "static", 256, "ct-text").startswith("4.2 to 4.5 (context 256;")
    assert published.comparator(figures, "no-such-engine", 256, "ct-text") == "–"


def test_the_rust_articles_compile_row_is_not_assigned_to_an_engine():
    figures = published.load(PUBLISHED).all_figures().set_index("id")
    for fid in ("cmp_torch_compile_batched_tok_s", "cmp_torch_compile_streamed_tok_s"):
        row = figures.loc[fid]
        assert pd.isna(row.engine) and "does not say which way" in row.note and "45.2" in row.note


def test_one_metric_name_per_quantity_and_contradictions_noted():
    figures = published.load(PUBLISHED).all_figures().set_index("id")
    after_load = ["nb04_after_load_bf16_table_gb", "mem_ring_33024_after_load_gb", "cmp_ring_hbm_after_load_gb"]
    assert set(figures.loc[after_load].metric) == {"memory_after_load_gb"}
    capacity = ["setup_chip_hbm_gb", "mem_chip_hbm_gib", "mem_chip_hbm_gb", "nb05_laptop_gpu_memory_gb"]
    assert set(figures.loc[capacity].metric) == {"device_memory_capacity"}
    assert figures.loc["setup_chip_hbm_gb"].unit == "GB" and figures.loc["mem_chip_hbm_gib"].unit == "GiB"
    for fid in ("setup_chip_hbm_gb", "sw_full_context_tokens", "cmp_ring_first_call_s", "sw_ring_compile_s"):
        assert "contradicts itself" in figures.loc[fid].note


def test_published_figures_print_as_printed_and_recall_in_the_articles_shape():
    figures = published.load(PUBLISHED).all_figures()
    by_id = figures.set_index("id")
    assert published.span(by_id.loc["nb01_compile_first_call_s"]) == "3.00"
    recall = published.recall_table(figures)
    assert len(recall) == 5 and list(recall.context) == [33024, 33024, 33024, 131328, 131328]
    first = recall.iloc[0]
    assert (first.prompt_tokens, first.read_tok_s, first.decode_tok_s, first.answer_code, first.found) == (
        "61",
        "1218",
        "45.2",
        "915965",
        "yes",
    )
    assert recall.iloc[-1].found == "no" and recall.iloc[-1].same_as_laptop == "yes"


def test_an_int4_cell_is_credited_with_int4_bytes_only():
    model = e2b_model_block()
    _, _, dense = arithmetic.bytes_per_token(model["shape"], model["layers"], 2, 1000)
    _, _, packed = arithmetic.bytes_per_token(model["shape"], model["layers"], 2, 1000, int4_linears=True)
    params = 1_876_819_968  # the quantizable linears of E2B (notes 1.5)
    assert packed["linears"] == params / 2 + params / 32 * 2 * 2  # half a byte, plus a bf16 scale and zero per 32
    assert packed["lm_head"] == 262144 * 1536 / 2 + 262144 * 1536 / 32 * 2 * 2  # lm_head is int4 too
    assert packed["linears"] < dense["linears"] / 3


def test_bench_table_reads_pytest_benchmark_json(tmp_path):
    def bench(weights: str, median: float) -> dict:
        params = {"shape": [1536, 12288], "weights": weights}
        return {"params": params, "stats": {"median": median, "rounds": 10}, "extra_info": {"device": "cpu"}}

    data = {"machine_info": {"cpu": {"brand_raw": "X"}}, "benchmarks": [bench("dense", 2e-3), bench("int4", 1e-3)]}
    (tmp_path / "int4-linear.json").write_text(json.dumps(data))
    table = bench_table(tmp_path)
    assert list(table.linear) == ["1536x12288"] * 2
    assert table.x_dense.iloc[1] == pytest.approx(2.0) and pd.isna(table.x_dense.iloc[0])
