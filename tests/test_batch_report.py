"""The report's batch table (reports/tables/batch.py): a way measured at several batches, a row per B with its gain
over its own B=1; the servers beside it at each concurrency, told apart by the settings that differ."""

from __future__ import annotations

import pandas as pd

from reports.tables.batch import batch_table, served_at_concurrency
from reports.tables.cells import GROUP
from reports.tables.load import LOAD_COLUMNS, serving
from reports.uncertainty import sampled


def decode_row(engine: str, config: str, batch: int, rate: float, verdict: str = "VALID", code: str = "c1") -> dict:
    """A decode table row (``reports.tables.decode``) with every key of its measurement group."""
    label = f"{engine}·{config.split('=')[-1]}" + (f"·B={batch}" if batch > 1 else "")
    group = {key: None for key in GROUP} | {"experiment": "decode", "fingerprint": "env-a", "code": code, "replica": 0}
    return group | {"engine": engine, "engine_config": config, "model": "m", "device": "cpu", "context": 256,
            "max_new_tokens": 32, "dtype": "bfloat16", "batch": batch, "way_label": label,
            "decode": sampled([rate * 0.99, rate, rate * 1.01]), "decode_median": rate, "memory_peak": 3e9,
            "roofline_pct_shown": "50.0 %", "matmul_pct_shown": "9.0 %", "usd_per_mtok_shown": "–",
            "verdict": verdict, "left_out": []}  # fmt: skip


def test_a_row_per_batch_of_each_way_scanned_with_its_gain_over_its_own_batch_of_one():
    derived = pd.DataFrame([decode_row("ring", "weights=int4", b, r) for b, r in ((1, 20.0), (4, 56.0), (2, 36.0))]
                           + [decode_row("ring", "weights=dense", 1, 4.6)])  # fmt: skip
    table = batch_table(derived)
    assert list(table.batch) == [1, 2, 4] and set(table.way) == {"ring·int4"}, "a way at one batch only is no scan"
    assert list(table.per_sequence) == [20.0, 18.0, 14.0]
    assert list(table.x_batch_1) == [1.0, 36.0 / 20.0, 56.0 / 20.0]
    assert batch_table(derived[derived.batch == 1]).empty


def test_the_same_way_measured_by_other_code_is_a_scan_of_its_own_marked_with_its_code():
    """A way re-measured after a change (another commit) is not pooled or replaced: each code's rows keep their own
    gain over their own B=1, marked as the decode table marks environments and code."""
    derived = pd.DataFrame([decode_row("ring", "weights=dense", b, r, code=code)
                            for code, rates in (("old", (4.6, 32.6)), ("new", (12.8, 60.2)))
                            for b, r in zip((1, 8), rates, strict=True)])  # fmt: skip
    table = batch_table(derived)
    assert list(table.way) == ["ring·dense¹"] * 2 + ["ring·dense²"] * 2
    assert list(table.decode_median) == [12.8, 60.2, 4.6, 32.6]
    assert list(table.x_batch_1) == [1.0, 60.2 / 12.8, 1.0, 32.6 / 4.6]
    assert table.attrs["footnotes"] == ["¹ env env-a @ new", "² env env-a @ old"]


def test_the_servers_at_each_concurrency_are_told_apart_by_their_settings():
    def level(file: str, config: str, c: int, rate: float, max_batch: int = 1, pieces: bool = False) -> dict:
        serve = {"max_batch": max_batch, "prompt_read": "pieces" if pieces else "whole"}
        return {**dict.fromkeys(LOAD_COLUMNS), "file": file, "engine": "ring", "engine_config": config,
                "weights": "int4", "max_batch": max_batch, "serving": serving(serve), "generator": "CPU 1 (server 0)",
                "model": "m",
                "level": f"c{c}", "mode": "concurrency", "value": c, "output_tok_s": rate,
                "ttft_p50": 1.0 / rate}  # fmt: skip

    load = pd.DataFrame([level("a", "last_piece=padded weights=int4", 1, 3.4, 4),
                         level("a", "last_piece=padded weights=int4", 4, 4.5, 4),
                         level("b", "last_piece=bucketed weights=int4", 1, 5.3, 4),
                         level("b", "last_piece=bucketed weights=int4", 4, 7.7, 4),
                         level("c", "last_piece=bucketed weights=int4", 4, 8.1, 4, pieces=True)])  # fmt: skip
    served = served_at_concurrency(load, [1, 2, 4])
    assert list(served.way) == ["ring·bucketed (max_batch 4)", "ring·bucketed (max_batch 4, prompt read in pieces)",
                                "ring·padded (max_batch 4)"]  # fmt: skip
    assert list(served.c4) == [7.7, 8.1, 4.5] and served.c2.isna().all()
