"""`make report`: pure, deterministic, robust to bad files; the arithmetic checked by hand."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml

from decodebench import evidence
from decodebench.checkpoint import layers_of_config, shape_of_config
from decodebench.stats import median_interval
from reports import arithmetic, noise, published, render, verdicts
from reports.tables import cells
from reports.tables.bench import bench_table
from reports.tables.decode import decode_table
from reports.tables.peers import peer_tables
from reports.tables.recall import recall_table
from runner import run_cell
from tests.conftest import REPO, e2b_text_config

PUBLISHED = REPO / "evidence" / "published"


@pytest.fixture(scope="module")
def evidence_dir(tmp_path_factory, cache_dir, tiny) -> Path:
    """A small real sweep: two engines' decode cells, their bf16 parity checks (so that their decode
    cells can be VALID), one float32 parity cell, one skipped cell."""
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
        ["engine=ring", "engine.backend=none"],
        ["engine=fuse"],
        ["engine=generate", "experiment=parity", "max_new_tokens=6"],
        ["engine=generate", "experiment=parity-bf16"],
        ["engine=ring", "engine.backend=none", "experiment=parity-bf16"],
    ):
        assert run_cell(make_cfg(*common, *overrides))["status"] in ("ok", "skipped")
    for path in runs.rglob("*.json"):  # the suite's machine is shared: these tests are about rendering, and
        record = json.loads(path.read_text())  # the contention rule has tests of its own on synthetic evidence
        if record["environment"].pop("contention", None) is not None:
            evidence.write_atomic(path, record)
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
    assert "[published/rust-torchtpu/cost_rust_usd_per_mtok]" in arith
    # Each decode cell is either pooled into a VALID row (its file an input of the row's figures) or left out
    # and listed with its verdict: a cell measured on a busy machine is INVALID, and the report says why.
    ev = cells.load(evidence_dir, REPO)
    every = verdicts.judge(ev.cells, ev.records)
    decode = ev.cells[(ev.cells.status == "ok") & ev.cells.experiment.isin(evidence.DECODE_EXPERIMENTS)]
    assert set(decode.engine) == {"generate", "ring"}
    table = report[report.index("## Decode") : report.index("### Memory")]
    for file in decode.file:
        assert f"<- {file}" in arith if every[file].valid else f"`{file}` {every[file].text()}" in table


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
        (94.6, "95%", True),  # as the articles print them: a unit after the number,
        (94.4, "95%", False),
        (6601.4, "6,601", True),  # thousands grouped by commas,
        (6602.0, "6,601", False),
        (94.6, "91-95", True),  # a range: the value rounded at the printed precision lies in it
        (95.6, "91-95", False),
        (90.4, "91-95", False),
        (9.2, "9.1 to 9.4", True),
        (14.82, "14.8x", True),
        (14.86, "14.8x", False),
        (3.0, "see the note", None),  # not a number (an "e" in it once raised ValueError): not compared
        (3.0, "none", None),
    ],
)
def test_agrees_only_at_the_printed_precision(result, printed, agrees):
    assert arithmetic.agrees_as_printed(result, printed) is agrees


def test_a_stated_string_that_is_not_a_number_is_not_compared(tmp_path):
    data = yaml.safe_load((PUBLISHED / "rust-torchtpu.yaml").read_text())
    item = next(d for d in data["derived"] if d["id"] == "vllm_vs_rust")
    data["derived"] = [{**item, "stated": "about twelve"}]
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    pub = published.load(tmp_path)
    (entry,) = arithmetic.published(pub.figures, pub.derived)
    assert entry.agrees is None and "not a number as printed: not compared" in entry.notes[0]


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
    expected = {  # worked by hand from the published inputs, rounded at the printed precision
        "rust-torchtpu/vllm_vs_rust": True,  # 144.1 / 12.2 = 11.811 -> "11.8"
        "rust-torchtpu/rust_vs_tch": True,  # 12.2 / 15.1 = 0.80795 -> "0.81"
        "torchtpu-colab/jax_vs_best_torch_nb03": False,  # 130.8 / 8.8 = 14.864 -> "14.9", printed "14.8"
        "torchtpu-colab/nb01_fuse_vs_eager_step": False,  # 2.91 / 1.68 = 1.7321 -> "1.73", printed "1.72"
        "torchtpu-colab/nb01_eager_tflop_s_from_step": False,  # 275 / 2.91 = 94.502 -> "94.5", printed "94.6"
        "torchtpu-colab/nb04_table4_x_generate_max": True,  # 50.4 / 5.0 = 10.08 -> "10.1"
        "torchtpu-colab/nb05_ring_slots_from_window": True,  # 512 + 256 = 768
        "torchtpu-colab/nb05_recall_33024_61_read_tok_s_calc": False,  # 61 / 0.1 = 610, printed "1218"
        "torchtpu-colab/mem_chip_gib_to_gb": True,  # 16 * 1.073741824 = 17.18 -> "17.2"
        "torchtpu-colab/sw_table4_about_10x_generate": True,  # 50.3 / 5.15 = 9.77 -> "10"
    }
    assert {key: entries[f"published/{key}"].agrees for key in expected} == expected


def test_a_stated_number_that_is_not_the_printed_string_is_refused(tmp_path):
    data = yaml.safe_load((PUBLISHED / "rust-torchtpu.yaml").read_text())
    data["derived"][0]["stated"] = 25.0
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(published.PublishedDataError, match="must be the printed string"):
        published.load(tmp_path)


def row(**values) -> pd.Series:
    """A decode table row as ``decode_table`` builds it: ``decode_median`` stands for two equal samples."""
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
        "batch": 1,
        "decode_median": 50.0,
        "n": 2,
        "files": ["evidence/runs/x.json"],
        "price_usd_per_hour": 0.60,
        "price_note": None,
        "hardware": "tpu-v5e-1",
        "bandwidth_gb_s": 858.99,
        "bandwidth_note": None,
        "bandwidth_source": "facts file",
        "peak_tflops": 197.0,
        "peak_source": "facts file",
        "prompt_tokens": 19,
        "fingerprint": "env",
        "code": "",
        "replica": 0,
        "key": "m/k/tpu/ctx256/bfloat16/N=64/read_every=0",
        "weights": "dense",
    }
    merged = {**base, **values}
    samples = values.get("decode_values", [merged["decode_median"]] * 2)
    return pd.Series({**merged, "decode_values": samples, "decode": median_interval(samples)})


def test_cost_and_ratio_by_hand():
    decode = pd.DataFrame([row(engine="generate", decode_median=5.0), row(engine="compiled", decode_median=32.5)])
    ratio = arithmetic.decode_ratios(decode)
    assert len(ratio) == 1 and ratio[0].result == pytest.approx(6.5)
    cost = {e.key.split("/")[1]: e for e in arithmetic.costs(decode)}
    # 0.60 USD/h / (32.5 tok/s * 3600 s/h) * 1e6 = 5.128... USD per million tokens
    assert cost["compiled"].result == pytest.approx(5.1282, rel=1e-4)
    assert "5.13 USD/Mtok" in cost["compiled"].text()


def test_a_ratio_carries_the_interval_of_both_sides_by_hand():
    """For two samples a < b the percentile bootstrap's median is (a+b)/2 and its interval exactly [a, b]
    (a resample's median is a, (a+b)/2 or b, with chances 1/4, 1/2, 1/4); over a constant 10 tok/s, the
    ratio's interval is [a/10, b/10]."""
    decode = pd.DataFrame([row(engine="generate", decode_values=[10.0, 10.0]), row(decode_values=[60.0, 70.0])])
    (entry,) = arithmetic.decode_ratios(decode)
    assert (entry.ratio.value, entry.ratio.interval.low, entry.ratio.interval.high) == (6.5, 6.0, 7.0)
    assert entry.shown() == "6.50x [6.00, 7.00] n=2/2"
    assert "ring_tok_s = 65 tok/s [60, 70] n=2" in entry.text() and "result:  6.50x [6.00, 7.00] n=2/2" in entry.text()


def test_a_ratio_whose_interval_contains_one_is_no_measurable_difference():
    decode = pd.DataFrame([row(engine="generate", decode_values=[10.0, 12.0]), row(decode_values=[10.5, 11.5])])
    (entry,) = arithmetic.decode_ratios(decode)
    assert entry.ratio.interval.low < 1 < entry.ratio.interval.high
    assert entry.shown().startswith("no measurable difference [") and "x" not in entry.shown().split("]")[0]
    assert "result:  no measurable difference" in entry.text()


def e2b_model_block() -> dict:
    """The model block an E2B-shaped evidence file records: its shape and per-layer layout."""
    config = e2b_text_config()
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
    position = 96 + 64 // 2  # the middle of the decode
    per_token = (
        1_876_819_968 * 2  # E2B's quantizable linears in bf16 (notes 1.5)
        + 262144 * 1536 * 2  # lm_head: vocab x hidden, bf16
        + (1536 + 35 * 256) * 2  # one row of each embedding table: hidden + 35 layers x 256 per-layer inputs
        + 28672 * min(position, 512)  # notes 1.6: sliding layers' KV, bounded by the window
        + 14336 * position  # notes 1.6: full layers' KV
    )
    assert per_token == 4_564_472_320 and entries["bytes-per-token"].result == per_token
    assert entries["roofline"].result == pytest.approx(100 * 4_564_472_320 * 50.0 / 1e9 / 858.99)  # 26.57 %


def test_roofline_notes_say_when_the_read_moved_and_nothing_otherwise():
    """A row whose files measured different reads says so; beside it (pandas makes its empty note NaN), a row
    whose files agree adds no note."""
    moved = "the machine's read bandwidth moved: 42.9 GB/s before this cell and 77.3 after"
    decode = pd.DataFrame([row(bandwidth_note=moved), row(files=["evidence/runs/y.json"])])
    models = {"evidence/runs/x.json": e2b_model_block(), "evidence/runs/y.json": e2b_model_block()}
    notes = [e.notes for e in arithmetic.roofline(decode, models) if e.key.startswith("roofline")]
    assert len(notes) == 2 and notes[0][-1] == moved and len(notes[1]) == 1 and notes[1][0].startswith("achieved")


def test_matmul_ceiling_by_hand():
    """Every token multiplies every linear and lm_head weight once (2 FLOP each), B tokens a step or one."""
    models = {"evidence/runs/x.json": e2b_model_block()}
    for batch, rate in ((1, 50.0), (8, 400.0)):
        decode = pd.DataFrame([row(decode_median=rate, batch=batch, peak_tflops=1.0, peak_source="measured")])
        (entry,) = arithmetic.matmul_ceiling(decode, models)
        flop_per_token = 2 * (1_876_819_968 + 262144 * 1536)  # E2B's quantizable linears (notes 1.5) and lm_head
        assert flop_per_token == 4_558_946_304
        assert entry.result == pytest.approx(100 * 4_558_946_304 * rate / 1e12 / 1.0)  # 22.79 % and 182.4 %
        assert entry.key.startswith("matmul-ceiling/ring/") and "measured for tpu-v5e-1" in entry.text()
    no_peak = pd.DataFrame([row(peak_tflops=None)])
    assert arithmetic.matmul_ceiling(no_peak, models) == [], "no figure without the device's rate"


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
    _, _, packed = arithmetic.bytes_per_token(model["shape"], model["layers"], 2, 1000, "int4")
    params = 1_876_819_968  # the quantizable linears of E2B (notes 1.5)
    assert packed["linears"] == params / 2 + params / 32 * 2 * 2  # half a byte, plus a bf16 scale and zero per 32
    assert packed["lm_head"] == 262144 * 1536 / 2 + 262144 * 1536 / 32 * 2 * 2  # lm_head is int4 too
    assert packed["linears"] < dense["linears"] / 3
    _, _, q4_0 = arithmetic.bytes_per_token(model["shape"], model["layers"], 2, 1000, "q4_0")  # llama.cpp's GGUF
    _, _, q8_0 = arithmetic.bytes_per_token(model["shape"], model["layers"], 2, 1000, "q8_0")
    assert q4_0["linears"] == params * 18 / 32 and q8_0["linears"] == params * 34 / 32  # its block sizes
    assert arithmetic.token_bytes(model, "bfloat16", 20, 16, "q5_1") is None  # a holding it cannot count


def test_bench_table_reads_pytest_benchmark_json(tmp_path):
    def bench(weights: str, median: float, shape: tuple[int, int] = (1536, 12288), **held: int) -> dict:
        params = {"shape": list(shape), "weights": weights}
        return {"params": params, "stats": {"median": median, "rounds": 10}, "extra_info": {"device": "cpu", **held}}

    dense_bytes = 1536 * 12288 * 2  # what the dense call reads: 37.7 MB
    benchmarks = [bench("dense", 2e-3, bytes=dense_bytes, read_gb_s=25),  # the machine read 25 GB/s just after
                  bench("int4", 1e-3),  # an older file: no bytes for int4, no read
                  bench("dense", 0.4e-3, (16, 64), bytes=2048)]  # one tile: what any dense call costs
    data = {"machine_info": {"cpu": {"brand_raw": "X"}}, "benchmarks": benchmarks}
    (tmp_path / "int4-linear.json").write_text(json.dumps(data))
    table = bench_table(tmp_path)
    assert list(table.linear) == ["1536x12288"] * 2 + ["16x64"]
    assert table.x_dense.iloc[1] == pytest.approx(2.0) and pd.isna(table.x_dense.iloc[0])
    assert table.gb_s.iloc[0] == pytest.approx(18.874368) and pd.isna(table.gb_s.iloc[1])  # 37.7 MB in 2 ms
    text = render.environment().get_template("bench.md.j2").render(bench=table)  # as the report renders it
    assert table.of_read.iloc[0] == pytest.approx(18.874368 / 25) and pd.isna(table.of_read.iloc[1])
    # past the floor: 37.7 MB in the 1.6 ms the call takes past the 0.4 a one-tile call takes; int4 has no floor
    assert table.past_floor_gb_s.iloc[0] == pytest.approx(dense_bytes / 1.6e-3 / 1e9) and pd.isna(table.floor_s.iloc[1])
    assert pd.isna(table.past_floor_gb_s.iloc[2])  # the floor's own row reads next to nothing: no rate past itself
    assert "| – | 2.000 | 18.9 | 75 % | 0.400 | 23.6 | 10 |" in text  # threads not recorded
    assert "| – | 1.000 | – | – | – | – | 10 |" in text
    assert set(table.residence) == {"memory"} and set(table.bound) == {"–"}  # a file from before the cache rows


def test_bench_table_takes_the_share_of_the_read_from_paired_rounds(tmp_path):
    """Rounds alternating a pass over the weights with the streaming read give the share of the read at each moment:
    the host's read moving 2x between rounds leaves a kernel at half of it every round at half, interval and all."""
    reads = [20.0, 40.0, 25.0, 36.0, 30.0]
    pairs = [{"kernel_gb_s": r / 2, "read_gb_s": r} for r in reads]
    info = {"bytes": 10_000_000, "read_gb_s": 80.0, "read_pairs": pairs}  # the read after: another moment's
    old = {"bytes": 10_000_000, "read_gb_s": 40.0}  # a file from before the rounds: the read after
    benchmarks = [{"params": {"shape": [1536, 12288], "weights": weights}, "stats": {"median": 1e-3, "rounds": 10},
                   "extra_info": extra} for weights, extra in (("int4", info), ("dense", old))]  # fmt: skip
    (tmp_path / "int4-linear.json").write_text(json.dumps({"benchmarks": benchmarks}))
    table = bench_table(tmp_path).set_index("weights")
    assert table.of_read["int4"] == pytest.approx(0.5) and table.read_gb_s["int4"] == pytest.approx(30.0)
    assert table.of_read_shown["int4"] == "50 % [50, 50] n=5"  # unpaired, the rounds' reads would spread it
    assert table.of_read["dense"] == pytest.approx(0.25) and table.of_read_shown["dense"] == "25 %"
    text = render.environment().get_template("bench.md.j2").render(bench=bench_table(tmp_path))
    assert "| 50 % [50, 50] n=5 |" in text and "| 25 % |" in text


def test_bench_pairs_each_pass_with_a_read_taking_turns_first(monkeypatch):
    """``make bench-int4``'s memory rows: a pass and a read each round, which goes first alternating, each GB/s kept
    under its own name whichever went first."""
    import experiments.cell as cell
    import tests.bench_int4 as bench

    order, reads = [], iter([1.0, 2.0, 3.0, 4.0])
    times = iter([0.0, 1.0, 10.0, 12.0, 20.0, 24.0, 30.0, 38.0])  # the passes take 1, 2, 4 and 8 s
    monkeypatch.setattr(cell.time, "perf_counter", lambda: next(times))
    monkeypatch.setattr(bench, "measure_bandwidth", lambda *a, **k: order.append("read") or {"value": next(reads)})
    monkeypatch.setattr(bench, "PAIRED_ROUNDS", 4)
    monkeypatch.setattr(bench.cpu_kernels, "reads", lambda device: {})
    device = SimpleNamespace(sync=lambda: None)
    rounds = bench.read_pairs(lambda: order.append("pass"), 10**9, device)  # 1 GB a pass
    assert order == ["pass", "read", "read", "pass", "pass", "read", "read", "pass"]
    assert [r["kernel_gb_s"] for r in rounds] == [1.0, 0.5, 0.25, 0.125]
    assert [r["read_gb_s"] for r in rounds] == [1.0, 2.0, 3.0, 4.0]


def test_bench_cache_rows_fit_the_cores_l2():
    """``make bench-int4``'s cache-resident weights: at most ``CACHED_BYTES`` held, every output of a shape that fits,
    else whole steps of tiles for every thread, and never more outputs than the shape has."""
    from tests.bench_int4 import CACHED_BYTES, CACHED_STEP, HELD_PER_WEIGHT, SHAPES, cached_outputs

    trimmed = 0
    for out, inputs in SHAPES:
        for weights, per_weight in (("dense", HELD_PER_WEIGHT["dense"]), ("int4", HELD_PER_WEIGHT["int4"])):
            outputs = cached_outputs((out, inputs), weights)
            assert outputs <= out and (outputs == out or outputs % CACHED_STEP == 0)
            assert outputs * inputs * per_weight <= max(CACHED_BYTES, CACHED_STEP * inputs * per_weight)
            trimmed += outputs < out
    assert trimmed  # lm_head at least is cut down to what the caches hold


def test_bench_table_says_what_bounds_a_kernel(tmp_path):
    """A kernel slower from its caches than the machine reads is bound by its own work; one faster, by memory."""
    def bench(weights: str, residence: str, median: float, held: int, read: float | None = None) -> dict:
        params = {"shape": [1536, 12288], "weights": weights, "residence": residence}
        info = {"bytes": held, **({"read_gb_s": read} if read else {})}
        return {"params": params, "stats": {"median": median, "rounds": 10}, "extra_info": info}

    benchmarks = [bench("int4", "memory", 1e-3, 10_000_000, read=30),  # 10 GB/s from memory
                  bench("int4", "cache", 0.5e-3, 2_000_000, read=30),  # 4 GB/s from L2: below the read of 30
                  bench("dense", "memory", 2e-3, 40_000_000, read=30),  # 20 GB/s from memory
                  bench("dense", "cache", 0.04e-3, 2_000_000),  # 50 GB/s from L2: above it
                  bench("dense-mv", "memory", 2e-3, 40_000_000)]  # no read recorded, no cache row
    data = {"machine_info": {"cpu": {"brand_raw": "X"}}, "benchmarks": benchmarks}
    (tmp_path / "int4-linear.json").write_text(json.dumps(data))
    table = bench_table(tmp_path).set_index(["weights", "residence"])
    assert table.cache_gb_s[("int4", "memory")] == pytest.approx(4.0)
    assert table.loc[("int4", "memory"), "bound"] == "kernel"
    assert table.cache_gb_s[("dense", "memory")] == pytest.approx(50.0)
    assert table.loc[("dense", "memory"), "bound"] == "memory"
    assert table.loc[("dense-mv", "memory"), "bound"] == "–" and table.loc[("int4", "cache"), "bound"] == "–"
    assert table.x_dense[("int4", "memory")] == pytest.approx(2.0)  # both from memory: the shape's whole weight
    assert pd.isna(table.x_dense[("int4", "cache")])  # a cache row holds another weight per kind: no ratio
    text = render.environment().get_template("bench.md.j2").render(bench=bench_table(tmp_path))
    assert "| 4.0 | kernel |" in text and "| 50.0 | memory |" in text
    assert text.count("| 1536x12288 |") == 3  # the memory rows; the cache ones are their columns


# ---------------------------------------------------------------- synthetic evidence ---------------------------------

TINY_MODEL = {  # one full-attention layer, small enough to count its bytes per token by hand
    "shape": {"hidden_size": 8, "num_attention_heads": 1, "hidden_size_per_layer_input": 2, "vocab_size": 16,
              "sliding_window": 4},
    "layers": [{"type": "full_attention", "kv_source": 0, "head_dim": 4, "kv_heads": 1, "intermediate_size": 16}],
}  # fmt: skip
# Bytes read per token by TINY_MODEL in bf16 at prompt 10, N 8 (position 10 + 8 // 2 = 14), counted by hand:
# q, o 2 x 8 x 4 + k, v 2 x 8 x 4 + MLP 3 x 8 x 16 + per-layer projections 2 x 8 x 2 + model projection 8 x 2
# = 560 weights x 2 B; lm_head 16 x 8 x 2 B; one row of each table (8 + 2) x 2 B; K and V 2 x 4 x 2 B x 14 slots.
TINY_BYTES = 560 * 2 + 16 * 8 * 2 + (8 + 2) * 2 + 2 * 4 * 2 * 14
CHECKS_HOLD = [{"rule": "exactly N tokens in every call", "holds": True, "detail": "5 calls"},
               {"rule": "T_N > T_1 in every pair (N=8)", "holds": True, "detail": "2 pairs"}]  # fmt: skip
QUIET = {"contended": False, "other_cores": 0.02, "threshold_cores": 0.25, "load_avg": [0.1, 0.1, 0.1]}


def cell_record(
    engine: str = "ring",
    values: tuple[float, ...] = (50.0, 51.0),
    *,
    sweep: str = "s",
    experiment: str = "decode",
    status: str = "ok",
    dtype: str = "bfloat16",
    settings: dict | None = None,
    replica: int | None = None,
    fingerprint: str | None = "env-a",
    checks: list | None = CHECKS_HOLD,
    contention: dict | None = QUIET,
    verdict: str = "pass",
    bandwidth: float | None = 100.0,
    price: float | None = None,
    cpu_model: str = "cpu-x",
    torch: str = "2.13.0",
    git_sha: str = "a" * 40,
    recall: list | None = None,
    batch: int | None = None,
    around: tuple[float, float] | None = None,
    sweep_read_contention: dict | None = None,
    cpu_kernels: str | None = None,
    product_bytes: dict | None = None,
    pair_reads: list[float] | None = None,
    without_effect: list[str] | None = None,
) -> dict:
    """One cell's evidence as the runner writes it (``decodebench.evidence.Record``), validated against
    ``evidence/schema.json``. ``None`` leaves a field out, as evidence written before it existed does
    (``replica``, ``fingerprint``, ``checks``, ``contention``, ``cpu_kernels``: the digest of the project's CPU
    kernels' sources, ``product_bytes``: the engine's count of its products' bytes, ``pair_reads``: the machine's read
    after each pair, ``bandwidth_at_pairs_gb_s``; ``without_effect``: the settings the engine says took no effect);
    a parity cell passes with ``verdict``."""
    parity = experiment == "parity"
    experiment_cfg = {"name": experiment, **({"batch": batch} if batch is not None else {})}
    if parity:
        experiment_cfg.update(all_tokens=dtype == "float32", kl_mean=1e-3, kl_max=1e-2)
    config = {"engine": {"name": engine, **(settings or {})}, "model": {"name": "m", "source": "synthetic"},
              "device": {"kind": "cpu"}, "experiment": experiment_cfg, "hardware": {"name": "cpu"}, "context": 256,
              "max_new_tokens": 8, "repeats": len(values), "dtype": dtype, "prompt": "p", "read_every": 0}  # fmt: skip
    if replica is not None:
        config["replica"] = replica
    environment = {"python": "3.11", "packages": {"torch": torch, "transformers": "5.0"}, "device_kind": "cpu",
                   "device_name": cpu_model, "cpu_model": cpu_model, "cpu_flags": ["avx2"], "git_sha": git_sha,
                   "git_dirty": False, "utc_time": "2026-01-01T00:00:00Z"}  # fmt: skip
    for name, value in (("fingerprint", fingerprint), ("contention", contention)):
        if value is not None:
            environment[name] = value
    measurements, outputs = {}, {}
    if status == "ok" and parity:
        outputs["verdict"] = verdict
    elif status == "ok":
        measurements = {"decode_tok_s": evidence.samples(list(values), "tok/s", formula="(N-1)/(T_N-T_1)"),
                        "prompt_tokens": evidence.scalar(10, "tok"), "max_new_tokens": evidence.scalar(8, "tok"),
                        "first_call_s": evidence.scalar(2.0, "s"), "load_s": evidence.scalar(1.0, "s")}  # fmt: skip
        if pair_reads is not None:
            measurements["bandwidth_at_pairs_gb_s"] = evidence.samples(list(pair_reads), "GB/s")
    if checks is not None and status == "ok":
        outputs["checks"] = checks
    if recall is not None:
        outputs["recall"] = recall
    hardware = {"name": "cpu", "memory_bandwidth_gb_s": bandwidth, "bandwidth_source": "measured",
                "price_usd_per_hour": price}  # fmt: skip
    if around is not None:  # the machine's read before and after the cell (runner.measure)
        hardware["bandwidth_at_cell"] = {"before": {"value": around[0]}, "after": {"value": around[1]}, "unit": "GB/s"}
    if sweep_read_contention is not None:  # what else ran while the sweep's read was taken (hardware.uncontended_read)
        hardware["bandwidth_measurement"] = {"value": bandwidth, "contention": sweep_read_contention}
    name = "-".join(str(p) for p in (engine, experiment, dtype, *sorted((settings or {}).items()), replica) if p)
    record = evidence.Record(
        cell=name.replace(" ", "").replace("'", "").replace(",", "=").replace("(", "").replace(")", ""),
        sweep=sweep,
        config=config,
        config_hash=evidence.config_hash(config),
        environment=environment,
        model={"synthetic": True, "kind": "synthetic", "key": "m-k", **TINY_MODEL},
        status=status,
        reason=None if status == "ok" else f"the cell {status}",
        hardware=hardware,
        measurements=measurements,
        outputs=outputs,
        timers={"parity": "not timed"}
        if parity
        else {"decode_tok_s": "(N-1) / (warm_n_s - warm_1_s), per repeat pair"},
        engine={**({} if cpu_kernels is None else {"cpu_kernel_source": cpu_kernels}),
                **({} if product_bytes is None else {"product_bytes": product_bytes}),
                **({} if without_effect is None else {"settings_without_effect": without_effect})},
    ).to_json()
    evidence.validate(record)
    return record


def write(folder: Path, *records: dict) -> Path:
    """Each record as ``folder/<sweep>/<cell>.json``; the folder."""
    for record in records:
        evidence.write_atomic(folder / record["sweep"] / f"{record['cell']}.json", record)
    return folder


def judged(folder: Path) -> tuple[cells.Evidence, dict[str, verdicts.Verdict], pd.DataFrame]:
    ev = cells.load(folder, REPO)
    every = verdicts.judge(ev.cells, ev.records)
    return ev, every, decode_table(ev.cells, every)


def by_engine(every: dict[str, verdicts.Verdict]) -> dict[str, verdicts.Verdict]:
    return {Path(f).stem: v for f, v in every.items()}


@pytest.mark.parametrize(("batch", "valid"), [(1, False), (4, True)])
def test_the_bandwidth_ceiling_of_a_batch_counts_its_linears_once_for_its_tokens(tmp_path, batch, valid):
    """50.5 tok/s of tiny at 1,620 B a token needs 8.181e-05 GB/s: above a ceiling of 8e-05 at one sequence a step,
    below it when four sequences share each step's read of the linears."""
    write(tmp_path, cell_record("ring", experiment="parity"), cell_record("ring", bandwidth=8e-5, batch=batch))
    _, every, _ = judged(tmp_path)
    decode = by_engine(every)["ring-decode-bfloat16"]
    assert decode.valid is valid, decode.text()
    assert valid or "rate above the bandwidth ceiling: 1,620 B/token" in decode.text()


@pytest.mark.parametrize(
    ("around", "pair_reads", "within"),
    [
        (None, None, None),  # the sweep's read alone: above it is above the ceiling
        ((7e-5, 9e-5), None, "the read after the cell (9e-05)"),
        (None, [7.9e-5, 8.5e-5], "the largest read after its pairs (8.5e-05)"),
        ((7e-5, 8.1e-5), [8e-5, 8.15e-5], None),  # every read below the 8.181e-05 GB/s the rate needs
    ],
)  # fmt: skip
def test_the_bandwidth_ceiling_is_the_largest_read_the_machine_gave_at_the_cell(tmp_path, around, pair_reads, within):
    """A rate above the sweep's read (8e-05 GB/s) is impossible only above every read the machine gave at the cell
    (before and after it, after each pair): within one, the cell stays VALID with a note naming it, and the report
    gives it no roofline share by the sweep's read (over 100 %), only the one at its reads; above all, INVALID."""
    write(tmp_path, cell_record("ring", experiment="parity"),
          cell_record("ring", bandwidth=8e-5, around=around, pair_reads=pair_reads))  # fmt: skip
    ev, every, decode = judged(tmp_path)
    verdict = by_engine(every)["ring-decode-bfloat16"]
    assert verdict.valid is (within is not None), verdict.text()
    if within is None:
        assert verdict.text().startswith("INVALID: rate above the bandwidth ceiling: 1,620 B/token x 50.5 tok/s")
        largest = max([*(around or ()), *(pair_reads or ())], default=None)
        assert largest is None or verdict.text().endswith(f"{largest:.4g} GB/s")
        return
    assert f"= 8.181e-05 GB/s, above the sweep's read (8e-05 GB/s) but within {within}" in " ".join(verdict.notes)
    models = {f: r["model"] for f, r in ev.records.items()}
    entries = {tuple(e.key.split("/")[:2]) for e in arithmetic.measured(decode, models)}
    assert ("bytes-per-token", "ring") in entries and ("roofline", "ring") not in entries
    assert (("roofline-at-pairs", "ring") in entries) is (pair_reads is not None)
    report = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    (fastest,) = [line for line in report.report.read_text().splitlines() if line.startswith("- Fastest VALID way")]
    shown = "of its roofline at its reads (none by the sweep's read)" if pair_reads else "no roofline"
    assert shown in fastest, fastest


MOVED = ("the machine's read bandwidth moved: {} GB/s before this cell and {} after, the sweep's figure 100 (its "
         "roofline share and ratios to cells of other times move with it)")


@pytest.mark.parametrize(("around", "note"), [((85.0, 118.0), None), ((79.0, 100.0), MOVED.format(79, 100)),
                                              ((100.0, 121.0), MOVED.format(100, 121))])  # fmt: skip
def test_a_cell_whose_read_bandwidth_moved_from_the_sweeps_is_noted_with_the_figures(tmp_path, around, note):
    """Within 20% of the sweep's 100 GB/s before and after: nothing to say; beyond it either way: a note with the
    three figures (not a broken rule: the cell stays VALID)."""
    write(tmp_path, cell_record("ring", experiment="parity"), cell_record("ring", around=around))
    decode = by_engine(judged(tmp_path)[1])["ring-decode-bfloat16"]
    assert decode.valid, decode.text()
    assert [n for n in decode.notes if n.startswith("the machine's read bandwidth moved")] == ([note] if note else [])


@pytest.mark.parametrize("contended", [False, True])
def test_a_sweep_read_taken_while_the_machine_was_busy_is_noted(tmp_path, contended):
    """A sweep's read with other processes busy beside it (every try of it) gets a note on each decode cell, which
    stays VALID (its roofline share may read high, its rate is its own); a quiet read gets none."""
    busy = {"contended": contended, "other_cores": 0.9 if contended else 0.1, "threshold_cores": 0.25}
    write(tmp_path, cell_record("ring", experiment="parity"), cell_record("ring", sweep_read_contention=busy))
    decode = by_engine(judged(tmp_path)[1])["ring-decode-bfloat16"]
    assert decode.valid, decode.text()
    notes = [n for n in decode.notes if n.startswith("the sweep's read")]
    assert notes == ([
        "the sweep's read (100 GB/s) was taken while other processes kept 0.90 cores busy on average (threshold "
        "0.25): it may understate the machine's read, and the roofline share overstate"
    ] if contended else [])


def test_a_parity_check_of_other_kernels_vouches_for_no_decode_cell(tmp_path):
    """The project's CPU kernels changed between the parity check and the decode cell (their sources' digest): the
    check says nothing of the new kernels' tokens, so the cell has no parity until a check of the same kernels runs."""
    write(tmp_path, cell_record("ring", experiment="parity", sweep="before", cpu_kernels="k1"),
          cell_record("ring", sweep="after", cpu_kernels="k2"))  # fmt: skip
    assert by_engine(judged(tmp_path)[1])["ring-decode-bfloat16"].text() == f"INVALID: {verdicts.NO_PARITY}"
    write(tmp_path, cell_record("ring", experiment="parity", sweep="later", cpu_kernels="k2"))
    decode = by_engine(judged(tmp_path)[1])["ring-decode-bfloat16"]
    assert decode.valid and "parity passed in sweep later" in decode.notes[0]


def test_each_rule_gives_its_verdict_and_names_its_figure(tmp_path):
    bf16_pass = [cell_record(e, experiment="parity") for e in ("ring", "generate", "compiled", "static")]
    old = dict(fingerprint=None, checks=None, contention=None)
    broken_pair = [CHECKS_HOLD[0], {"rule": "T_N > T_1 in every pair (N=8)", "holds": False,
                                    "detail": "T_1 = 0.500000 s, T_N = 0.400000 s"}]  # fmt: skip
    loaded = {"contended": True, "other_cores": 0.8, "threshold_cores": 0.25, "load_avg_end": [1.5, 1.2, 1.0]}
    write(
        tmp_path,
        *bf16_pass,
        cell_record("table4", experiment="parity", contention=loaded),  # not timed: contention cannot touch it
        cell_record("ring"),
        cell_record("generate", checks=broken_pair),
        cell_record("compiled", contention=loaded),
        cell_record("static", bandwidth=5e-5),  # 1,620 B x 50.5 tok/s = 8.181e-05 GB/s > 5e-05 GB/s
        cell_record("table4", **old),
        cell_record("jax"),
        cell_record("rust", status="failed"),
        cell_record("fuse", status="skipped"),
        cell_record("ring", sweep="other", settings={"attend": "filled"}),
        cell_record("ring", sweep="checks", experiment="parity", settings={"attend": "filled"}),
    )
    _, every, _ = judged(tmp_path)
    got = by_engine(every)
    assert got["ring-decode-bfloat16"].text() == "VALID"
    assert got["ring-decode-bfloat16"].notes == ("parity passed in the same sweep: bfloat16: KL mean <= 0.001 nats, "
                                                 "max <= 0.01",)  # fmt: skip
    assert got["generate-decode-bfloat16"].text() == (
        "INVALID: T_N > T_1 in every pair (N=8): T_1 = 0.500000 s, T_N = 0.400000 s"
    )
    assert got["compiled-decode-bfloat16"].text() == (
        "INVALID: contended: other processes kept 0.80 cores busy on average (threshold 0.25; load average 1.50, "
        "1.20, 1.00)"
    )
    assert TINY_BYTES == 1620
    assert got["static-decode-bfloat16"].text() == (
        "INVALID: rate above the bandwidth ceiling: 1,620 B/token x 50.5 tok/s = 8.181e-05 GB/s > measured bandwidth "
        "5e-05 GB/s (measured)"
    )
    assert got["table4-parity-bfloat16"].text() == "VALID"
    old_evidence = got["table4-decode-bfloat16"]
    assert old_evidence.verdict == "VALID" and "contention not recorded" in old_evidence.notes
    assert got["jax-decode-bfloat16"].text() == f"INVALID: {verdicts.NO_PARITY}"
    assert (got["rust-decode-bfloat16"].verdict, got["fuse-decode-bfloat16"].verdict) == ("FAILED", "SKIPPED")
    other = got["ring-decode-bfloat16-attend=filled"]
    assert other.valid and "parity passed in sweep checks (`" in other.notes[0]
    assert "checks/ring-parity-bfloat16-attend=filled.json`)" in other.notes[0]


def test_the_decode_table_shows_valid_rows_only_and_lists_the_rest(tmp_path):
    write(
        tmp_path,
        cell_record("ring", experiment="parity"),
        cell_record("ring", (40.0, 50.0)),
        cell_record("ring", (44.0,), sweep="t", contention={**QUIET, "contended": True, "other_cores": 1.0}),
        cell_record("generate", (10.0, 10.0)),
    )
    result = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    report = result.report.read_text()
    decode = report[report.index("## Decode") : report.index("### Memory")]
    assert "| ring |" in decode and "| generate |" not in decode
    # ring: the contended file is left out of its row, so the row pools (40, 50): median 45, interval [40, 50]
    assert "| 45.00 [40.00, 50.00] n=2 |" in decode
    assert "Left out: 1 rows with no VALID cell, and 1 files of VALID rows:" in decode
    assert f"INVALID: {verdicts.NO_PARITY}" in decode and "INVALID: contended: other processes kept 1.00" in decode
    assert "| VALID | ring | m | decode |" in report and "| INVALID | generate | m | decode |" in report
    assert "decode-ratio/" not in result.arithmetic.read_text()  # generate is not VALID: no ratio against it


def test_pooled_samples_are_the_files_raw_samples_by_hand(tmp_path):
    write(tmp_path, cell_record("ring", experiment="parity"), cell_record("ring", (40.0, 50.0)),
          cell_record("ring", (44.0,), sweep="t"))  # fmt: skip
    _, _, decode = judged(tmp_path)
    (r,) = decode.itertuples()
    assert (sorted(r.decode_values), r.decode_median, r.decode_min, r.decode_max, r.n) == ([40, 44, 50], 44, 40, 50, 3)
    assert {s: run["values"] for s, run in r.by_sweep.items()} == {"s": [40.0, 50.0], "t": [44.0]}


def test_cells_of_different_environments_are_never_pooled(tmp_path):
    write(
        tmp_path,
        cell_record("ring", experiment="parity", fingerprint="env-a"),
        cell_record("ring", (40.0, 41.0), fingerprint="env-a"),
        cell_record("ring", (80.0, 81.0), sweep="t", fingerprint="env-b"),
        # evidence without a fingerprint: derived from CPU model, device name, torch and transformers
        cell_record("ring", (20.0, 21.0), sweep="u", fingerprint=None),
        cell_record("ring", (22.0, 23.0), sweep="v", fingerprint=None),
        cell_record("ring", (60.0, 61.0), sweep="w", fingerprint=None, torch="2.14.0"),
    )
    ev, _, decode = judged(tmp_path)
    rows = {r.fingerprint: sorted(r.decode_values) for r in decode.itertuples()}
    derived = sorted(fp for fp in rows if fp.startswith("~"))
    assert len(rows) == 4 and rows["env-a"] == [40, 41] and rows["env-b"] == [80, 81]
    assert sorted(rows[fp] for fp in derived) == [[20, 21, 22, 23], [60, 61]]
    assert all(len(fp) == 12 for fp in derived)


def test_cost_and_roofline_use_the_rows_own_price_and_bandwidth(tmp_path):
    write(
        tmp_path,
        *(cell_record("ring", experiment="parity", fingerprint=fp) for fp in ("env-a", "env-b")),
        cell_record("ring", (40.0, 40.0), price=1.0, bandwidth=10.0, fingerprint="env-a"),
        cell_record("ring", (80.0, 80.0), sweep="t", price=3.0, bandwidth=20.0, fingerprint="env-b"),
    )
    ev, _, decode = judged(tmp_path)
    models = {f: r["model"] for f, r in ev.records.items()}
    entries = {(e.key.split("/")[0], e.key.rsplit("env=", 1)[1]): e for e in arithmetic.measured(decode, models)}
    assert entries[("usd-per-mtok", "env-a")].result == pytest.approx(1.0 / (40 * 3600) * 1e6)  # 6.94 USD/Mtok
    assert entries[("usd-per-mtok", "env-b")].result == pytest.approx(3.0 / (80 * 3600) * 1e6)  # 10.42 USD/Mtok
    assert entries[("roofline", "env-a")].result == pytest.approx(100 * 1620 * 40 / 1e9 / 10.0)
    assert entries[("roofline", "env-b")].result == pytest.approx(100 * 1620 * 80 / 1e9 / 20.0)


def test_the_roofline_at_the_pairs_takes_each_rate_over_the_read_after_it(tmp_path):
    """Each pair's rate over the read after it, the median of those: 2, 2 and 1.1 tokens a GB read give 2 (the
    median rate over the median read would give 33 / 20, the sweep's read 33 / 10). A row whose file took no reads
    after its pairs gets none, and the report prints `–` for it."""
    held = {"linears": 100_000_000, "lm_head": 0}  # what the products read a token: rooflines of tens of percent
    write(
        tmp_path,
        *(cell_record(e, experiment="parity") for e in ("generate", "ring")),
        cell_record("ring", (20.0, 40.0, 33.0), bandwidth=10.0, pair_reads=[10.0, 20.0, 30.0], product_bytes=held),
        cell_record("generate", (20.0, 40.0, 33.0), bandwidth=10.0, product_bytes=held),
    )
    ev, _, decode = judged(tmp_path)
    models = {f: r["model"] for f, r in ev.records.items()}
    entries = {tuple(e.key.split("/")[:2]): e for e in arithmetic.measured(decode, models)}
    total = entries[("bytes-per-token", "ring")].result
    at_pairs, roofline = entries[("roofline-at-pairs", "ring")], entries[("roofline", "ring")]
    assert at_pairs.result == pytest.approx(100 * total * 2.0 / 1e9)  # 2 tokens a GB read: about 20 %
    assert at_pairs.interval.low <= at_pairs.result <= at_pairs.interval.high
    assert roofline.result == pytest.approx(100 * total * 33.0 / 1e9 / 10.0)  # the sweep's read: about 33 %
    assert ("roofline-at-pairs", "generate") not in entries
    result = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    assert "rate / bandwidth = 2 tok/GB [1.1, 2] n=3 (pooled median, each pair's rate" in result.arithmetic.read_text()
    lines = result.report.read_text().splitlines()
    assert any(line.startswith("| ring |") and f"| {roofline.shown()} | {at_pairs.shown()} |" in line for line in lines)
    generate = entries[("roofline", "generate")].shown()
    assert any(line.startswith("| generate |") and f"| {generate} | – |" in line for line in lines)


def test_files_of_one_row_that_disagree_on_price_get_no_cost_and_say_so(tmp_path):
    write(
        tmp_path,
        cell_record("ring", experiment="parity"),
        cell_record("ring", (40.0, 40.0), price=1.0, bandwidth=10.0),
        cell_record("ring", (40.0, 40.0), sweep="t", price=3.0, bandwidth=30.0),
    )
    ev, _, decode = judged(tmp_path)
    models = {f: r["model"] for f, r in ev.records.items()}
    entries = {e.key.split("/")[0]: e for e in arithmetic.measured(decode, models)}
    cost = entries["usd-per-mtok"]
    assert cost.result is None and "record different price_usd_per_hour (1 USD/h in `" in cost.notes[0]
    roofline = entries["roofline"]  # each sweep measured its bandwidth: the row uses their median, 20 GB/s
    assert roofline.result == pytest.approx(100 * 1620 * 40 / 1e9 / 20.0)
    assert "their median 20 GB/s is used" in roofline.notes[-1]


def test_the_aa_spread_sets_the_noise_floor_and_marks_smaller_differences(tmp_path):
    base = (100.0, 100.5, 99.5, 100.2, 99.8, 100.1)
    write(
        tmp_path,
        *(cell_record(e, experiment="parity") for e in ("generate", "compiled")),
        cell_record("generate", base, replica=0),
        cell_record("generate", tuple(0.96 * v for v in base), replica=1),
        cell_record("compiled", tuple(1.03 * v for v in base), replica=0),
    )
    _, _, decode = judged(tmp_path)
    pairs = noise.aa_pairs(decode)
    assert list(pairs.spread.round(6)) == [-0.04] and noise.floors(pairs) == {"env-a": pytest.approx(0.04)}
    (entry,) = arithmetic.decode_ratios(decode, noise.floors(pairs))
    assert entry.ratio.differs and entry.ratio.within_floor
    assert entry.shown().startswith("1.03x [") and entry.shown().endswith(", within the noise floor (A/A 4.0%)")
    result = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    report = result.report.read_text()
    assert "| -4.0% |" in report and "- env env-a: noise floor 4.0%" in report
    assert "within the noise floor (A/A 4.0%)" in report


def test_the_recall_table_keeps_each_rate_method_in_its_own_column(tmp_path):
    def outcome(method: str, rate: float) -> dict:
        return {"target_tokens": 64, "status": "ok", "prompt_tokens": 60, "read_s": 0.1, "read_tok_s": 600.0,
                "decode_tok_s": rate, "answer_code": "1", "found": True, "method": method}  # fmt: skip

    timers = "engine phase timers in one generate(N): read_s to the first token, (N-1)/decode_s"
    pair = "generate(1) for read_s, generate(N); (N-1)/(T_N - T_1)"
    ev = cells.load(
        write(
            tmp_path,
            cell_record("ring", experiment="recall", recall=[outcome(timers, 30.0)]),
            cell_record("generate", experiment="recall", recall=[outcome(pair, 20.0)]),
        ),  # fmt: skip
        REPO,
    )
    table = recall_table(ev.records).set_index("engine")
    assert table.loc["ring"].decode_timer.value == 30.0 and table.loc["ring"].decode_pair is None
    assert table.loc["generate"].decode_pair.value == 20.0 and table.loc["generate"].decode_timer is None


def test_arithmetic_writes_out_every_figure_of_a_valid_row(tmp_path):
    write(
        tmp_path,
        *(cell_record(e, experiment="parity") for e in ("generate", "ring")),
        cell_record("generate", (10.0, 10.0), price=1.0),
        cell_record("ring", (50.0, 51.0), price=1.0),
    )
    result = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    arith = result.arithmetic.read_text()
    key = "m/m-k/cpu/ctx256/P=10/bfloat16/N=8/read_every=0/code=aaaaaaaaaaaa/env=env-a"
    for entry in ("decode-ratio/ring-vs-generate", "roofline/ring", "bytes-per-token/ring", "usd-per-mtok/ring"):
        assert f"[{entry}/{key}]" in arith
    assert f"inputs:  ring_tok_s = 50.5 tok/s [50, 51] n=2 (pooled median) <- {tmp_path.name}/s/ring-decode" in arith
    assert "result:  5.05x [5.00, 5.10] n=2/2" in arith  # (50.5 [50, 51]) / 10, by hand
    assert "result:  1_620 B" in arith  # TINY_BYTES
    # 1 USD/h / (rate x 3600 s/h) x 1e6 at the rate's median 50.5 and its bounds 51 and 50
    assert "result:  5.50 USD/Mtok [5.45, 5.56] n=2" in arith
    assert "| 5.50 [5.45, 5.56] n=2 |" in result.report.read_text()


def test_a_failed_parity_check_is_named_and_never_counts_as_a_pass(tmp_path):
    write(tmp_path, cell_record("ring", experiment="parity", verdict="fail"), cell_record("ring"))
    _, every, _ = judged(tmp_path)
    got = by_engine(every)
    assert got["ring-parity-bfloat16"].text() == "INVALID: parity failed (bfloat16: KL mean <= 0.001 nats, max <= 0.01)"
    decode = got["ring-decode-bfloat16"].text()
    assert decode.startswith("INVALID: its parity check failed (bfloat16: KL mean <= 0.001 nats, max <= 0.01: `")
    assert "ring-parity-bfloat16.json`)" in decode and verdicts.NO_PARITY not in decode


def test_engine_settings_leave_out_an_empty_option_set_so_older_evidence_groups_with_newer():
    from reports.tables.cells import engine_settings

    assert engine_settings({"name": "ring", "weights": "int4", "inductor": {}}) == "weights=int4"
    assert engine_settings({"name": "ring", "inductor": {"cpp_wrapper": True}, "weights": "int4"}) == (
        "inductor={'cpp_wrapper': True} weights=int4"
    )


def test_the_published_files_read_with_libyaml_as_with_pyyamls_own_parser(monkeypatch):
    if published.LOADER is yaml.SafeLoader:
        pytest.skip("PyYAML without libyaml: the report reads with its own parser only")
    fast = published.load(PUBLISHED)
    monkeypatch.setattr(published, "LOADER", yaml.SafeLoader)  # the pure-Python parser, the same constructor
    plain = published.load(PUBLISHED)
    assert fast.articles == plain.articles and fast.derived == plain.derived
    assert fast.figures.keys() == plain.figures.keys()
    for name, frame in fast.figures.items():
        pd.testing.assert_frame_equal(frame, plain.figures[name])


def test_cells_of_other_code_are_never_pooled_nor_divided_by_each_other(tmp_path):
    """The same settings run by two commits are two rows, each with its own x generate; a ratio never divides
    one commit's rate by another's; an uncommitted change is a code of its own."""
    before, after = "a" * 40, "b" * 40
    write(
        tmp_path,
        *(cell_record(e, experiment="parity") for e in ("generate", "ring")),
        cell_record("generate", (10.0, 10.0), sweep="before", git_sha=before),
        cell_record("ring", (50.0, 50.0), sweep="before", git_sha=before),
        cell_record("generate", (20.0, 20.0), sweep="after", git_sha=after),
        cell_record("ring", (60.0, 60.0), sweep="after", git_sha=after),
    )
    _, _, decode = judged(tmp_path)
    rows = decode.set_index(["engine", "code"]).sort_index()
    assert list(rows.index) == [("generate", "a" * 12), ("generate", "b" * 12), ("ring", "a" * 12), ("ring", "b" * 12)]
    assert rows.loc[("ring", "a" * 12)].decode_values == [50.0, 50.0], "not pooled with the other commit's 60s"
    ratios = {e.key.split("/code=")[1].split("/")[0]: e.result for e in arithmetic.decode_ratios(decode)}
    assert ratios == {"a" * 12: pytest.approx(5.0), "b" * 12: pytest.approx(3.0)}
    assert cells.code({"git_sha": after, "git_dirty": True, "git_diff_sha256_16": "0123456789abcdef"}) == (
        "b" * 12 + "+0123456789abcdef"
    )
    assert cells.code({"git_sha": None}) == "", "evidence that names no commit is one group, as before"


PEER_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}


def peer_record(
    engine: str,
    values: tuple[float, ...],
    *,
    quant: str | None = None,
    startup_s: float = 30.0,
    rss: int = 3_400_000_000,
    sweep: str = "s",
) -> dict:
    """A peer's decode cell: ``cell_record`` with the ``engine`` block a peer describes itself with
    (``engines.peer``; a llama.cpp q4_* file keeps its linears 4-bit, and vLLM serves the W4A16 twin's)."""
    record = cell_record(engine, values, settings={"quant": quant} if quant else None, sweep=sweep)
    weights = {"twin": "ct-text", "path": "/twins/m-ct-text"}
    if quant:
        weights |= {"quant": quant, "gguf_bytes": 1_500_000_000, "conversion_s": None}
    four_bit = engine == "vllm" or str(quant).startswith("q4")
    record["engine"] = {"peer": PEER_NAMES[engine], "startup_s": startup_s, "weights": weights,
                        "memory": {"peak_rss_bytes_sum": rss, "processes": []},
                        "version": {"path": "/version", "answer": "1.0"},
                        **({"kept_4bit": ["linears"]} if four_bit else {})}  # fmt: skip
    return record


def by_hand(top: tuple[float, float], bottom: tuple[float, float]) -> tuple[float, float, float]:
    """median(top) / median(bottom) and its 95% interval for two samples a side: a resampled median is the low
    sample, the middle or the high one (chances 1/4, 1/2, 1/4), so each extreme ratio has a chance of 1/16 > 2.5%
    and the percentile interval is exactly [min(top) / max(bottom), max(top) / min(bottom)]."""
    return (sum(top) / 2) / (sum(bottom) / 2), min(top) / max(bottom), max(top) / min(bottom)


def test_the_peers_table_sets_each_peer_beside_the_fastest_valid_way_of_each_precision(tmp_path):
    q4, q8, vllm, dense, int4 = (40.0, 44.0), (45.0, 47.0), (35.0, 36.0), (30.0, 32.0), (60.0, 64.0)
    bf16 = (25.0, 26.0)
    int4_cell = cell_record("ring", int4, settings={"weights": "int4"})
    int4_cell["measurements"]["memory_peak_rss"] = {"value": 1_250_000_000, "unit": "B", "counter": "VmHWM"}
    other_model = cell_record("ring", (70.0, 71.0), sweep="t")  # a faster VALID way of another model: no peer there
    other_model["config"]["model"]["name"] = "other"
    write(
        tmp_path,
        *(cell_record(e, experiment="parity") for e in ("ring", "compiled", "vllm")),
        cell_record("ring", experiment="parity", settings={"weights": "int4"}),
        cell_record("llamacpp", experiment="parity", settings={"quant": "q4_0"}),
        cell_record("llamacpp", experiment="parity", settings={"quant": "q8_0"}, verdict="fail"),
        cell_record("llamacpp", experiment="parity", settings={"quant": "bf16"}),
        cell_record("ring", dense),
        int4_cell,
        cell_record("compiled", (20.0, 21.0)),  # dense, slower than ring: not shown
        cell_record("generate", (100.0, 101.0)),  # the fastest, but INVALID (no parity check): not shown
        peer_record("llamacpp", q4, quant="q4_0", startup_s=12.5, rss=2_000_000_000),
        peer_record("llamacpp", q8, quant="q8_0"),  # faster than q4_0, but INVALID: not the fastest peer
        peer_record("vllm", vllm, startup_s=38.0),
        peer_record("llamacpp", bf16, quant="bf16"),
        other_model,
    )
    ev, _, decode = judged(tmp_path)
    (table,) = peer_tables(decode, ev.records)
    assert table.title == (
        "m on cpu (cpu-x), hardware cpu, synthetic weights: context 256, N=8, P=10, env env-a, sweep s"
    )
    assert list(table.rows.way) == ["ring·int4", "llama.cpp q8_0", "llama.cpp q4_0", "vLLM", "ring·dense",
                                    "llama.cpp bf16"]
    rows = table.rows.set_index("way")
    assert table.fastest_peer == "llama.cpp q4_0" and rows.loc["llama.cpp q4_0"].x_shown == "–"
    assert rows.loc["llama.cpp q4_0"].x_fastest_peer is None
    for way, samples in (("ring·int4", int4), ("llama.cpp q8_0", q8), ("vLLM", vllm), ("ring·dense", dense)):
        ratio = rows.loc[way].x_fastest_peer.interval
        assert (ratio.value, ratio.low, ratio.high) == pytest.approx(by_hand(samples, q4)), way
        assert rows.loc[way].decode.value == statistics.median(samples)
    assert rows.loc["ring·int4"].x_shown == "1.48x [1.36, 1.60] n=2/2"  # 62/42, 60/44, 64/40
    # at its own precision: the int4 way over llama.cpp q4_0 (the faster of the int4 peers, vLLM serving the W4A16
    # twin the other), the dense one over llama.cpp bf16 (q8_0 is int8: a class alone)
    assert list(rows.precision) == ["int4", "int8", "int4", "int4", "dense", "dense"]
    assert rows.loc["ring·int4"].x_same_shown == "1.48x [1.36, 1.60] n=2/2 over llama.cpp q4_0"
    same = rows.loc["ring·dense"].x_same_precision.interval
    assert (same.value, same.low, same.high) == pytest.approx(by_hand(dense, bf16))
    assert rows.loc["ring·dense"].same_precision_peer == "llama.cpp bf16"
    assert [rows.loc[w].x_same_shown for w in ("llama.cpp q8_0", "llama.cpp bf16")] == ["–"] * 2  # alone in their class
    for peer, other, samples in (("llama.cpp q4_0", "vLLM", (q4, vllm)), ("vLLM", "llama.cpp q4_0", (vllm, q4))):
        assert rows.loc[peer].same_precision_peer == other  # the two int4 peers, each beside the other
        same = rows.loc[peer].x_same_precision.interval
        assert (same.value, same.low, same.high) == pytest.approx(by_hand(*samples))
    assert list(rows.verdict) == ["VALID", "INVALID: its parity check failed", "VALID", "VALID", "VALID", "VALID"]
    assert (rows.loc["llama.cpp q4_0"].startup_s, rows.loc["vLLM"].startup_s, rows.loc["ring·int4"].startup_s) == (
        12.5, 38.0, 1.0)  # fmt: skip
    assert rows.loc["llama.cpp q4_0"].memory_peak_bytes == 2_000_000_000
    assert rows.loc["ring·int4"].memory_peak_bytes == 1_250_000_000
    assert rows.loc["llama.cpp q4_0"].weights == "GGUF q4_0, 1.50 GB" and rows.loc["vLLM"].weights == "ct-text twin"
    assert rows.loc["ring·int4"].weights.endswith("4-bit: all linears")
    assert table.verdict == (
        "The fastest VALID in-process way (ring·int4) decodes 1.48x [1.36, 1.60] n=2/2 the rate of the fastest "
        "peer (llama.cpp q4_0): ahead of it. At its own precision: ring·int4 decodes 1.48x [1.36, 1.60] n=2/2 the rate "
        "of llama.cpp q4_0; ring·dense decodes 1.22x [1.15, 1.28] n=2/2 the rate of llama.cpp bf16."
    )  # 31/25.5, 30/26, 32/25
    (dense_only,) = peer_tables(decode[decode.engine_config != "weights=int4"], ev.records)
    assert dense_only.verdict == (  # 31/42, 30/44, 32/40
        "The fastest VALID in-process way (ring·dense) decodes 0.74x [0.68, 0.80] n=2/2 the rate of the fastest "
        "peer (llama.cpp q4_0): behind it. At its own precision: ring·dense decodes 1.22x [1.15, 1.28] n=2/2 the rate "
        "of llama.cpp bf16."
    )
    assert peer_tables(decode[decode.model == "other"], ev.records) == []

    result = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    report = result.report.read_text()
    peers = report[report.index("## Peers") : report.index("\n## ", report.index("## Peers"))]
    assert peers.count("\n### ") == 1 and f"### {table.title}" in peers and "### other" not in peers
    assert table.verdict in peers
    int4_line = (
        "| ring·int4 | weights=int4 | bfloat16 | 62.00 [60.00, 64.00] n=2 | 1.48x [1.36, 1.60] n=2/2 | 1.48x [1.36, "
        "1.60] n=2/2 over llama.cpp q4_0 | 1.0 | 1.25 |"
    )
    q4_line = (
        "| llama.cpp q4_0 | quant=q4_0 | bfloat16 | 42.00 [40.00, 44.00] n=2 | – | 1.18x [1.11, 1.26] n=2/2 over vLLM "
        "| 12.5 | 2.00 | VALID | GGUF q4_0,"
    )  # 42/35.5, 40/36, 44/35
    assert f"{int4_line} VALID |" in peers and f"{q4_line} 1.50 GB |" in peers


def test_each_sweep_sets_its_ways_beside_its_own_peers(tmp_path):
    """One way and one peer measured in two sweeps (the same commit and settings: one decode row each, pooled):
    each sweep's table divides that sweep's samples alone, as a machine whose read moved between runs needs."""
    q4_s, q4_t, int4 = (40.0, 44.0), (80.0, 88.0), (60.0, 64.0)
    write(
        tmp_path,
        cell_record("ring", experiment="parity", settings={"weights": "int4"}),
        cell_record("llamacpp", experiment="parity", settings={"quant": "q4_0"}),
        *(cell_record("ring", int4, settings={"weights": "int4"}, sweep=sweep) for sweep in ("s", "t")),
        peer_record("llamacpp", q4_s, quant="q4_0", sweep="s"),
        peer_record("llamacpp", q4_t, quant="q4_0", sweep="t"),
    )
    ev, _, decode = judged(tmp_path)
    assert len(decode) == 2 and all(len(v) == 4 for v in decode.decode_values), "each row pools both sweeps"
    tables = peer_tables(decode, ev.records)
    assert [t.title.rpartition(", sweep ")[2] for t in tables] == ["s", "t"]
    for table, q4 in zip(tables, (q4_s, q4_t), strict=True):
        rows = table.rows.set_index("way")
        ratio = rows.loc["ring·int4"].x_same_precision.interval
        assert (ratio.value, ratio.low, ratio.high) == pytest.approx(by_hand(int4, q4))
        assert rows.loc["llama.cpp q4_0"].decode.value == statistics.median(q4)
        assert [Path(f).parent.name for f in rows.loc["ring·int4"].files] == [table.title[-1]]


def test_a_way_is_set_beside_its_precisions_peer_even_when_that_peer_is_not_valid(tmp_path):
    """llama.cpp q4_0 fails parity (its verdict INVALID), yet it is the int4 peer a user would run: the int4 way's
    same-precision ratio is over it, marked; the fastest-peer ratio is over the VALID bf16 one."""
    q4, bf16, int4 = (40.0, 44.0), (10.0, 11.0), (60.0, 64.0)
    write(
        tmp_path,
        cell_record("ring", experiment="parity", settings={"weights": "int4"}),
        cell_record("llamacpp", experiment="parity", settings={"quant": "q4_0"}, verdict="fail"),
        cell_record("llamacpp", experiment="parity", settings={"quant": "bf16"}),
        cell_record("ring", int4, settings={"weights": "int4"}),
        peer_record("llamacpp", q4, quant="q4_0"),
        peer_record("llamacpp", bf16, quant="bf16"),
    )
    ev, _, decode = judged(tmp_path)
    (table,) = peer_tables(decode, ev.records)
    rows = table.rows.set_index("way")
    assert list(rows.precision) == ["int4", "int4", "dense"]
    assert rows.loc["ring·int4"].same_precision_peer == "llama.cpp q4_0 (INVALID)"
    same = rows.loc["ring·int4"].x_same_precision.interval
    assert (same.value, same.low, same.high) == pytest.approx(by_hand(int4, q4))
    fastest = rows.loc["ring·int4"].x_fastest_peer.interval
    assert (fastest.value, fastest.low, fastest.high) == pytest.approx(by_hand(int4, bf16))


def test_a_report_without_peers_says_so_and_renders_no_peers_table(tmp_path):
    write(tmp_path, cell_record("ring", experiment="parity"), cell_record("ring"))
    result = render.build(tmp_path, PUBLISHED, tmp_path / "out" / "REPORT.md", tmp_path / "out" / "arithmetic.txt")
    report = result.report.read_text()
    peers = report[report.index("## Peers") : report.index("\n## ", report.index("## Peers"))]
    assert "No peer decode cell was measured" in peers and "\n### " not in peers and "| way |" not in peers


def test_parity_rows_name_what_their_kl_is_over_only_when_it_is_top_k(evidence_dir, tmp_path):
    """A peer's parity is over its top-k log-probabilities and says so; a full-logit row beside it says nothing
    (its column is empty there, not "nan")."""
    runs = tmp_path / "runs"
    shutil.copytree(evidence_dir, runs)
    path = next(runs.rglob("ring-*parity*.json"))
    record = json.loads(path.read_text())
    prompt = record["outputs"]["prompt"]
    prompt.update(topk=20, topk_kl_mean=prompt.pop("kl_mean"), topk_kl_max=prompt.pop("kl_max"))
    evidence.write_atomic(path, record)
    report, _ = (b.decode() for b in _render(runs, tmp_path / "out"))
    table = report[report.index("## Parity with Transformers") :]
    assert "(over the engine's top-20 ids)" in table and "over the engine's nan" not in table
