"""``decodebench_attn.one_query`` (engines/attention_cpu.py) against a float64 reference, and the ring's choice of it.

Exact means: each output within the bf16 rounding of the float64 attention plus what float32 sums of its products may
lose. Shapes: E2B's (8 query rows over one K/V head of 256 and 512 dims) at slot counts that make one part and
several, a batch of two with two K/V heads, keys and values read through a view of a longer cache (a bucket of the
full layers), rows that see a few slots, and a row that sees none (zeros); more rows than the eight a pass takes, slots
no row sees, and a V narrower than K.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engines import attention_cpu
from runner import run_cell
from tests.conftest import opened

KERNEL_EVENT = "decodebench_attn::one_query"  # the operator as the profiler names it


@pytest.fixture(scope="module")
def _runs_here():
    reason = attention_cpu.unsupported("cpu", torch.bfloat16)
    if reason:
        pytest.skip(f"{attention_cpu.OP}: {reason}")


def reference(q, keys, values, keep, scale) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=keep[:, None],
                                          scale=scale)  # fmt: skip


@pytest.mark.usefixtures("_runs_here")
@pytest.mark.parametrize(
    ("batch", "heads", "rows", "slots", "dim", "dim_v"),
    [
        (1, 1, 8, 256, 256, 256),
        (1, 1, 8, 768, 256, 256),
        (1, 1, 8, 300, 512, 512),
        (2, 2, 8, 37, 64, 64),
        (1, 1, 3, 1000, 32, 32),
        (1, 2, 12, 200, 96, 96),
        (1, 1, 5, 130, 64, 48),
    ],
)
def test_one_query_is_the_float64_attention_rounded_once(batch, heads, rows, slots, dim, dim_v):
    generator = torch.Generator().manual_seed(slots)
    q = torch.randn(batch, heads, rows, dim, generator=generator).to(torch.bfloat16)
    cache_k, cache_v = (torch.randn(batch, heads, slots + 7, width, generator=generator).to(torch.bfloat16)
                        for width in (dim, dim_v))  # fmt: skip
    keys, values = cache_k[:, :, :slots], cache_v[:, :, :slots]  # a view: rows 7 slots longer apart per head
    keep = torch.rand(batch, rows, slots, generator=generator) < 0.6
    keep[:, 0] = False
    keep[:, 0, slots // 2] = True  # a row that sees one slot: that slot's V
    scale = dim**-0.5
    want = reference(q, keys, values, keep, scale)
    bound = want.abs() * 2.0**-8 + values.double().abs().amax() * slots * 2.0**-24
    seen_one = values[:, :, slots // 2].double()
    unseen = ~keep.any(1)[:, None, :, None].expand(-1, heads, -1, -1)  # slots no row may see: a ring's unwritten ones
    keys.masked_fill_(unseen, float("nan")), values.masked_fill_(unseen, float("nan"))  # never read
    got = attention_cpu.one_query(q, keys, values, keep, scale).double()
    assert got.shape == want.shape
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    assert torch.equal(got[:, :, 0], seen_one)


@pytest.mark.usefixtures("_runs_here")
@pytest.mark.parametrize(("first", "end"), [(0, 320), (500, 800), (1000, 1024)])
def test_a_decode_steps_span_of_slots_with_gemmas_unit_scale(first, end):
    """A decode step's one mask row (broadcast to the 8 rows) sees slots [first, end) of a full layer's 1024 of 512,
    two threads sharing that span; at Gemma's scale of 1 a fifth of the weights fall below exp(-87), taken as 0: the
    float64 attention rounded once all the same, and no slot outside the span read (NaN there)."""
    generator = torch.Generator().manual_seed(first)
    q = torch.randn(1, 1, 8, 512, generator=generator).to(torch.bfloat16)
    keys, values = (torch.randn(1, 1, 1024, 512, generator=generator).to(torch.bfloat16) for _ in range(2))
    keep = torch.zeros(1, 1, 1024, dtype=torch.bool)
    keep[..., first:end] = True
    keep = keep.expand(1, 8, 1024)
    want = reference(q, keys, values, keep, 1.0)
    bound = want.abs() * 2.0**-8 + values.double().abs().amax() * (end - first) * 2.0**-24
    keys[:, :, :first], values[:, :, :first] = float("nan"), float("nan")
    keys[:, :, end:], values[:, :, end:] = float("nan"), float("nan")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = attention_cpu.one_query(q, keys, values, keep, 1.0).double()
    finally:
        torch.set_num_threads(threads)
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


@pytest.mark.usefixtures("_runs_here")
def test_one_query_gives_zeros_to_a_row_that_sees_no_slot():
    q, keys, values = (torch.randn(1, 1, n, 64).to(torch.bfloat16) for n in (2, 100, 100))
    keep = torch.ones(1, 2, 100, dtype=torch.bool)
    keep[0, 1] = False
    got = attention_cpu.one_query(q, keys, values, keep, 0.125)
    assert torch.equal(got[0, 0, 1], torch.zeros(64, dtype=torch.bfloat16))
    want = reference(q[:, :, :1], keys, values, keep[:, :1], 0.125)[0, 0, 0]  # the other row, as any row
    assert (got[0, 0, 0].double() - want).abs().max() <= 2.0**-8 * want.abs().max() + 1e-3


def test_one_query_is_refused_by_name_where_it_cannot_run(cell_cfg, tiny):
    """Asked for at float32 (the kernel computes bf16) the cell is skipped with the reason; the ring's own choice
    (``auto``) takes aten's attention there and says so."""
    refused = run_cell(cell_cfg("engine=ring", "engine.backend=eager", "engine.decode_attention=one_query",
                                "dtype=float32", "experiment=decode", "max_new_tokens=2", "repeats=1"))  # fmt: skip
    assert refused["status"] == "skipped"
    assert "engine.decode_attention=one_query cannot run here: it computes bf16 attention" in refused["reason"]
    auto = run_cell(cell_cfg("engine=ring", "engine.backend=eager", "dtype=float32", "experiment=decode",
                             "max_new_tokens=2", "repeats=1"))  # fmt: skip
    assert auto["status"] == "ok" and auto["engine"]["decode_attention"] == attention_cpu.SDPA


@pytest.mark.usefixtures("_runs_here")
@pytest.mark.parametrize("attention", ["one_query", "sdpa"])
@pytest.mark.parametrize("engine", ["ring", "compiled", "rust"])
def test_a_decode_step_at_bf16_writes_the_reference_tokens_with_either_attention(cell_cfg, tiny, engine, attention):
    """The ring, ``compiled`` (Transformers' model, the kernel through its attention interface) and the Rust engine
    (whose shim finds the operator by name in ATen's dispatcher)."""
    if engine == "rust":
        pytest.importorskip("decodebench_rs", reason="the rust engine is not built (make setup)")
    compiled = ("engine.backend=eager",) if engine != "rust" else ()
    record = run_cell(cell_cfg(f"engine={engine}", *compiled, "experiment=parity-bf16", "context=256",
                               f"engine.decode_attention={attention}"))  # fmt: skip
    assert record["status"] == "ok", record["reason"]
    assert record["outputs"]["verdict"] == "pass"
    assert record["outputs"]["prompt"]["first_difference"] is None
    expected = attention_cpu.OP if attention == "one_query" else attention_cpu.SDPA
    assert record["engine"]["decode_attention"] == expected


@pytest.mark.usefixtures("_runs_here")
def test_one_query_takes_one_mask_row_broadcast_to_every_query_row():
    """A decode step's mask is the same for every query row: ``keep`` expanded from one row (stride 0, no copy)
    gives the bits of the same mask copied to every row."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 64, generator=generator).to(torch.bfloat16)
    keys, values = (torch.randn(2, 1, 300, 64, generator=generator).to(torch.bfloat16) for _ in range(2))
    row = torch.rand(2, 1, 300, generator=generator) < 0.5
    broadcast = row.expand(-1, 8, -1)
    assert broadcast.stride(1) == 0
    got = attention_cpu.one_query(q, keys, values, broadcast, 0.125)
    assert torch.equal(got, attention_cpu.one_query(q, keys, values, broadcast.contiguous(), 0.125))


@pytest.mark.usefixtures("_runs_here")
@pytest.mark.parametrize("masked", [True, False])
def test_transformers_attention_is_sdpa_for_a_decode_step_and_sdpa_itself_for_a_prompt(masked):
    """The attention ``compiled`` and ``table4`` hand Transformers' model (``transformers_attention``): for one query a
    sequence (a batch of two, 8 query heads over one K/V head, each row its own mask; no mask: every slot) the
    float64 attention rounded once, in Transformers' sdpa layout [B, S, H, D]; for a prompt of several queries
    Transformers' own sdpa, bit for bit, and so the float64 attention within the bf16 rounding of its weights."""
    generator = torch.Generator().manual_seed(11)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 8, True
    keys, values = (torch.randn(2, 1, 200, 256, generator=generator).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(2, 8, 1, 256, generator=generator).to(torch.bfloat16)
    mask = (torch.rand(2, 1, 1, 200, generator=generator) < 0.7) if masked else None
    got, weights = attention_cpu.transformers_attention(module, q, keys, values, mask, scaling=1.0)
    keep = mask[:, 0].expand(2, 8, 200) if masked else torch.ones(2, 8, 200, dtype=torch.bool)
    want = reference(q.view(2, 1, 8, 256), keys, values, keep, 1.0).view(2, 8, 1, 256).transpose(1, 2)
    assert weights is None and got.shape == (2, 1, 8, 256)
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + values.double().abs().amax() * 200 * 2.0**-24).all()
    prompt = torch.randn(2, 8, 5, 256, generator=generator).to(torch.bfloat16)
    prompt_mask = torch.rand(2, 1, 5, 200, generator=generator) < 0.7
    piece, _ = attention_cpu.transformers_attention(module, prompt, keys, values, prompt_mask, scaling=1.0)
    assert torch.equal(piece, sdpa_attention_forward(module, prompt, keys, values, prompt_mask, scaling=1.0)[0])
    # aten's bf16 attention rounds the softmax weights (which sum to 1) to bf16 before V: up to 2^-8 of V's largest
    want = reference(prompt, keys.expand(2, 8, -1, -1), values.expand(2, 8, -1, -1), prompt_mask[:, 0], 1.0)
    want = want.transpose(1, 2)
    assert ((piece.double() - want).abs() <= (want.abs() + values.double().abs().amax()) * 2.0**-8).all()


@pytest.mark.usefixtures("_runs_here")
@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_compileds_decode_steps_call_the_kernel_through_transformers_attention(attention):
    """``compiled`` on Transformers' model: with ``auto`` each decode step calls ``one_query`` once a layer, the
    prompt keeps Transformers' sdpa for every layer that reads all of its rows; ``sdpa`` leaves the kernel out. Counted
    once compiled (tracing calls each operator's fake kernel under the same name)."""
    engine = opened("engine=compiled", "engine.backend=eager", f"engine.decode_attention={attention}").load()
    try:
        engine.generate([5, 6, 7, 8], 2)
        calls = {}
        for steps in (2, 4):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.generate([5, 6, 7, 8], steps)
            names = [e.name for e in prof.events()]
            calls[steps] = tuple(names.count(op) for op in (KERNEL_EVENT, "aten::scaled_dot_product_attention"))
        layers = engine.model.config.num_hidden_layers
        if attention == "auto":
            assert engine.describe()["decode_attention"] == attention_cpu.OP
            assert calls[4][0] - calls[2][0] == 2 * layers and calls[4][1] == calls[2][1] > 0
        else:
            assert engine.describe()["decode_attention"] == attention_cpu.SDPA
            assert calls[4][0] == 0 and calls[4][1] - calls[2][1] == 2 * layers
    finally:
        engine.close()
