"""The bytes a decode step's products read, counted from the engine's tensors (engines/product_bytes.py): each tensor
once, lm_head apart, at the width each kernel holds (not an assumed one), and what the report's roofline and bandwidth
ceiling divide by where the evidence has the count."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch import nn

from engines import held
from engines.product_bytes import product_bytes
from reports import arithmetic
from tests.conftest import opened
from tests.test_int4 import ATEN, ROWS, runs_here
from tests.test_joined import IN, holder, int4_linear
from tests.test_report import by_engine, cell_record, e2b_model_block, judged, row, write


def bf16_linear(out: int) -> nn.Linear:
    return nn.Linear(IN, out, bias=False, dtype=torch.bfloat16)


def test_dense_products_count_each_weight_once_and_lm_head_apart():
    head = bf16_linear(32)
    reader = bf16_linear(32)
    reader.weight = head.weight  # a second module over lm_head's weight (a tied table's reader): read once
    module = holder(lm_head=head, q=bf16_linear(16), o=bf16_linear(48), tied=reader)
    assert product_bytes(module) == {"linears": (16 + 48) * IN * 2, "lm_head": 32 * IN * 2}


def test_int4_rows_hold_half_a_byte_and_the_stored_scale_a_weight():
    """``packed_weight``'s bf16 scales, one per 32 inputs: 0.5 + 2/32 bytes a weight (whole tiles of 16 outputs)."""
    runs_here(ROWS)
    module = holder(lm_head=int4_linear(32, 0), q=int4_linear(48, 1), k=int4_linear(16, 2))
    assert product_bytes(module) == {"linears": (48 + 16) * IN * (0.5 + 2 / 32), "lm_head": 32 * IN * (0.5 + 2 / 32)}
    before = product_bytes(module)
    held.hold_together(module)  # views into one allocation: the same bytes, each counted once
    assert product_bytes(module) == before


def test_aten_int4_counts_its_scales_and_zeros():
    """aten's int4 kernels hold a scale and a zero per group in the run's dtype: 0.5 + 4/32 bytes a weight, more than
    the checkpoint's own 0.5 + 2/32."""
    module = holder(lm_head=int4_linear(32, 0, ATEN))
    assert product_bytes(module) == {"linears": 0, "lm_head": 32 * IN * (0.5 + 4 / 32)}


def test_an_int4_ring_counts_the_bytes_it_holds_together(cache_dir, tiny):
    runs_here(ROWS)
    engine = opened(f"cache_dir={cache_dir}", "engine=ring", "engine.weights=int4", "engine.backend=eager").load()
    try:
        counted = engine.describe()["product_bytes"]
        linears = held.streamed(engine.model)
        together = engine.describe()["held_together_bytes"]
        # every product is int4_rows and held together, each tensor from a line of its own (at most 63 bytes between)
        assert together - 2 * held.ALIGN * len(linears) < counted["linears"] + counted["lm_head"] <= together
        assert counted["lm_head"] == engine.model.lm_head.words.nbytes + engine.model.lm_head.scales.nbytes
    finally:
        engine.close()


def test_the_roofline_divides_the_engines_count_not_the_shapes():
    """An int4_rows way's count (0.5 + 2/32 bytes a weight) in place of the shape at aten's width (0.5 + 4/32): the
    bytes and the share 10 % lower, and the input names where the count came from."""
    model = e2b_model_block()
    shape = arithmetic.token_bytes(model, "bfloat16", 19, 64, "int4")
    weights = {"linears": 1_876_819_968, "lm_head": 262144 * 1536}  # E2B's linears' weights (notes 1.5), lm_head's
    count = {part: int(n * (0.5 + 2 / 32)) for part, n in weights.items()}
    decode = pd.DataFrame([row(weights="int4", product_bytes=count), row(weights="int4", product_bytes=None)])
    entries = [e for e in arithmetic.roofline(decode, {"evidence/runs/x.json": model})]
    counted, shaped = (e for e in entries if e.key.startswith("bytes-per-token"))
    assert counted.result == shape.total - sum(n * 2 / 32 for n in weights.values())
    assert shaped.result == shape.total
    assert "engine.product_bytes" in counted.text() and "engine.product_bytes" not in shaped.text()
    shares = [e.result for e in entries if e.key.startswith("roofline")]
    assert shares[0] == pytest.approx(shares[1] * counted.result / shaped.result)


@pytest.mark.parametrize(("share", "valid"), [(1.0, False), (0.5, True)])
def test_the_bandwidth_ceiling_takes_the_engines_count(tmp_path, share, valid):
    """50.5 tok/s of tiny at 1,620 B a token (the shape's count) is above a ceiling of 8e-05 GB/s; the engine's own
    count of half its products' bytes brings it under."""
    tiny = cell_record("ring", bandwidth=8e-5)["model"]
    _, _, parts = arithmetic.bytes_per_token(tiny["shape"], tiny["layers"], 2, 14)
    count = {part: int(parts[part] * share) for part in ("linears", "lm_head")}
    write(tmp_path, cell_record("ring", experiment="parity"), cell_record("ring", bandwidth=8e-5, product_bytes=count))
    _, every, _ = judged(tmp_path)
    decode = by_engine(every)["ring-decode-bfloat16"]
    assert decode.valid is valid, decode.text()
