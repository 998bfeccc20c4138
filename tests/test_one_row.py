"""``engine.one_row``: a dense linear's one-row call through ``torch.mv`` gives ``F.linear``'s values, so do the
project's packed ``bf16_rows`` (a tied table read back from the packed ``lm_head``), the stepping engines take the
fastest by default on a CPU and write the same tokens, and a setting an engine cannot take is refused by name."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engines import bf16_cpu, cpu_kernels, one_row
from engines.one_row import OneRow, PackedEmbedding, PackedLinear, RowLinear, choose, swap_dense_linears
from runner import run_cell

ROWS_HERE = bf16_cpu.unsupported(torch.bfloat16)  # why this CPU cannot run bf16_rows, or None

NOT_COMPILED = ("engine.backend=none",)


@pytest.mark.parametrize(("out_features", "in_features"), [(2048, 1536), (1536, 6144), (4096, 256)])
def test_one_row_through_mv_equals_f_linear(out_features, in_features):
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    layer.weight.data = weight
    swap_dense_linears(layer)
    assert type(layer) is RowLinear
    row = torch.randn(1, 1, in_features, dtype=torch.bfloat16)
    got, want = layer(row), F.linear(row, weight)
    assert got.shape == want.shape == (1, 1, out_features)
    exact = torch.float64
    truth = row.to(exact).view(-1) @ weight.to(exact).t()
    # Both round one float32 sum to bf16: each is within a bf16 half-ulp of the float64 truth, plus the float32
    # accumulation's own error; they may differ where the two kernels sum in another order.
    ulp = torch.finfo(torch.bfloat16).eps * truth.abs().clamp_min(1e-3)
    assert ((got.view(-1).to(exact) - truth).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.99, "two float32 sums of the same products round alike almost always"
    rows = torch.randn(3, in_features, dtype=torch.bfloat16)  # more than one row: F.linear itself
    assert torch.equal(layer(rows), F.linear(rows, weight))


def test_swap_leaves_other_modules_and_wrapped_linears():
    plain, wrapped, other = nn.Linear(4, 4), nn.Linear(4, 4), nn.Embedding(4, 4)
    wrapped.forward = lambda x: x  # a wrapper's own forward (compressed-tensors' dispatch puts one there)
    model = nn.Sequential(plain, wrapped, other)
    assert swap_dense_linears(model) == 1
    assert type(plain) is RowLinear and type(wrapped) is nn.Linear and type(other) is nn.Embedding


def test_an_explicit_choice_stands_and_auto_is_linear_off_a_cpu(tmp_path):
    weights = [torch.randn(8, 4)]
    assert choose(OneRow.mv, "tpu", weights, tmp_path).one_row == OneRow.mv
    assert choose(OneRow.linear, "cpu", weights, tmp_path) == one_row.Choice(OneRow.linear, "set")
    assert choose(OneRow.auto, "cuda", weights, tmp_path).one_row == OneRow.linear
    assert not (tmp_path / "one_row").exists()  # nothing was timed


@pytest.mark.parametrize(("mv_ms", "picked"), [(1.0, OneRow.mv), (3.0, OneRow.linear)])
def test_auto_on_a_cpu_picks_the_faster_way_over_the_models_shapes_once(tmp_path, monkeypatch, mv_ms, picked):
    """Each distinct shape timed each way, weighted by how many linears have it; the choice cached per machine.
    float32 weights: ``bf16_rows`` cannot take them, so it is not timed."""
    timed = []

    def fake_best_ms(fn):
        timed.append(fn)
        return mv_ms if len(timed) % 2 == 0 else 2.0  # linear, then mv, for each shape

    monkeypatch.setattr(one_row, "best_ms", fake_best_ms)
    weights = [torch.randn(8, 4), torch.randn(8, 4), torch.randn(16, 4)]  # two shapes, three linears
    choice = choose(OneRow.auto, "cpu", weights, tmp_path)
    assert (choice.one_row, choice.how, choice.shapes, len(timed)) == (picked, "measured", 2, 4)
    assert choice.ms == {"linear": 3 * 2.0, "mv": 3 * mv_ms}
    again = choose(OneRow.auto, "cpu", weights, tmp_path)
    assert again.one_row == picked and again.how.startswith("cached") and len(timed) == 4  # read, not timed
    monkeypatch.setattr(torch, "__version__", "0.0-other")  # another torch: measured again
    assert choose(OneRow.auto, "cpu", weights, tmp_path).how == "measured" and len(timed) == 8


def test_auto_times_rows_only_where_it_runs(tmp_path, monkeypatch):
    """bf16 weights on a CPU with AVX-512 BF16: ``rows`` is timed beside the two and picked when fastest."""
    speeds = {"linear": 3.0, "mv": 2.0, "rows": 1.0}
    monkeypatch.setattr(one_row, "one_row_call", lambda way, weight: str(way))  # what best_ms then times: its name
    monkeypatch.setattr(one_row, "best_ms", lambda way: speeds[way])
    weights = [torch.randn(32, 64, dtype=torch.bfloat16)]
    choice = choose(OneRow.auto, "cpu", weights, None)
    assert choice.one_row == (OneRow.mv if ROWS_HERE else OneRow.rows)
    assert set(choice.ms) == ({"linear", "mv"} if ROWS_HERE else {"linear", "mv", "rows"})


@pytest.mark.skipif(ROWS_HERE is not None, reason=f"{bf16_cpu.OP}: {ROWS_HERE}")
def test_packed_linears_give_f_linears_values_and_a_tied_table_is_held_once():
    class Scaled(nn.Embedding):  # Gemma's scaled table: rows times embed_scale, a buffer in the run's dtype
        def __init__(self, n: int, d: int) -> None:
            super().__init__(n, d, dtype=torch.bfloat16)
            self.embed_scale = nn.Buffer(torch.tensor(3.0))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * self.embed_scale.to(self.weight.dtype)

    model = nn.Module()
    model.table, model.head = Scaled(100, 64), nn.Linear(64, 100, bias=False, dtype=torch.bfloat16)
    model.head.weight = model.table.weight  # tied
    model.mlp = nn.Linear(64, 40, bias=False, dtype=torch.bfloat16)
    model.biased = nn.Linear(64, 8, dtype=torch.bfloat16)  # keeps F.linear: it adds the bias before rounding
    ids, x = torch.tensor([[3, 99, 17]]), torch.randn(1, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():  # no graph that would hold the weights
        want = model.table(ids), model.head(x), model.mlp(x)
    originals = [weakref.ref(model.mlp.weight), weakref.ref(model.head.weight)]
    assert one_row.pack_dense_linears(model) == 2
    assert all(ref() is None for ref in originals), "each original weight freed once packed (the tied one too)"
    assert type(model.head) is PackedLinear and type(model.mlp) is PackedLinear and type(model.biased) is nn.Linear
    assert type(model.table) is PackedEmbedding and model.table.linear is model.head  # held once: the packed one
    got = model.table(ids), model.head(x), model.mlp(x)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.shape == w.shape and (g == w).float().mean() > 0.9
        assert ((g.float() - w.float()).abs() <= 2**-7 * w.float().abs().clamp_min(2**-4)).all()


@pytest.mark.parametrize("engine", ["compiled", "ring"])
def test_a_stepping_engine_writes_the_same_tokens_every_way(cell_cfg, tiny, engine):
    records = {
        setting: run_cell(cell_cfg(f"engine={engine}", *NOT_COMPILED, "max_new_tokens=12", "repeats=1",
                                   f"engine.one_row={setting}"))  # fmt: skip
        for setting in ("mv", "linear", "rows", "auto")
    }
    if ROWS_HERE:  # skipped with the reason, never run another way
        assert records.pop("rows")["status"] == "skipped" and bf16_cpu.OP in records["rows"]["reason"]
    for record in records.values():
        assert record["status"] == "ok", record["reason"]
    mv, linear, auto = (records[s]["engine"] for s in ("mv", "linear", "auto"))
    assert mv["one_row"] == "mv" and linear["one_row"] == "linear" and linear["one_row_linears"] == 0
    assert auto["one_row"] == auto["one_row_choice"]["one_row"] and auto["one_row_choice"]["how"] != "set"
    assert all(e["settings_without_effect"] == ["int4_limbs"] for e in (mv, linear, auto))  # no linear is 4-bit
    # tiny: 6 layers of q, k, v, o, gate, up, down, per-layer gate and projection, less k, v on the KV-shared
    # layers; the per-layer model projection and lm_head. The ring joins q, k, v (one linear for three) on the layers
    # that hold their own K/V and gate, up (one for two) on every layer (engines/joined.py)
    layers, shared = 6, 2
    joined = 2 * (layers - shared) + layers if engine == "ring" else 0
    assert mv["one_row_linears"] == 9 * layers - 2 * shared + 2 - joined
    assert mv["joined_linears"] == (layers - shared + layers if engine == "ring" else 0)
    for setting, record in records.items():
        assert record["outputs"]["generated_ids"] == records["linear"]["outputs"]["generated_ids"], setting
    for record in (mv, linear):  # no product on the kernels
        assert record["cpu_kernel_threads"] is None and record["cpu_kernel_prefetch"] is None
        assert record["cpu_kernel_prefetch_choice"] is None
        assert record["cpu_kernel_source"] is None
    if "rows" in records:
        rows = records["rows"]["engine"]
        assert (rows["one_row"], rows["one_row_linears"]) == ("rows", mv["one_row_linears"])
        assert rows["cpu_kernel_threads"] == torch.get_num_threads()  # the thread count this process runs with
        assert rows["cpu_kernel_prefetch"] == cpu_kernels.prefetch_hint() == rows["cpu_kernel_prefetch_choice"]["hint"]
        assert rows["cpu_kernel_source"] == cpu_kernels.source_digest()  # what its parity check must share with it


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("engine=ring", "engine.weights=int4", "engine.one_row=mv"), "engine.one_row=mv has no effect with engine."),
        (("engine=ring", "engine.weights=int4", "engine.one_row=rows"), "engine.one_row=rows has no effect with"),
        (("engine=compiled", "engine.remove_wrappers=false", "engine.one_row=mv"), "engine.remove_wrappers=false"),
        (("engine=compiled", "engine.remove_wrappers=false", "engine.one_row=rows"), "engine.remove_wrappers=false"),
        (("engine=compiled", "engine.remove_wrappers=false", "engine.one_row=linear"), "engine.remove_wrappers=false"),
        (("engine=rust", "engine.weights=int4", "engine.one_row=rows"), "engine.one_row=rows has no effect with"),
        (("engine=ring", "engine.weights=int4", "engine.one_row=linear"), "engine.one_row=linear has no effect with"),
        (("engine=rust", "engine.weights=int4", "engine.one_row=linear"), "engine.one_row=linear has no effect with"),
    ],
)
def test_mv_where_no_linear_takes_it_is_refused(cell_cfg, overrides, message):
    record = run_cell(cell_cfg(*overrides))
    assert record["status"] == "failed" and message in record["reason"]


def test_a_compiled_step_calls_atens_kernel_not_fused_loops():
    """TorchInductor decomposes ``torch.mv`` into a product and a sum fused into its own loops (3x slower on
    e2b-synthetic); inside a compiled program the one-row product is the opaque ``one_row_mv``, ATen's kernel."""
    from torch._inductor.utils import run_and_get_code

    layer = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    swap_dense_linears(layer)
    row = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, (code, *_) = run_and_get_code(torch.compile(lambda x: torch.relu(layer(x)), backend="inductor"), row)
    assert "torch.ops.decodebench.one_row_mv.default(" in code
    assert torch.equal(got.view(-1), torch.relu(torch.mv(layer.weight, row.view(-1))))


@pytest.mark.skipif(ROWS_HERE is not None, reason=f"{bf16_cpu.OP}: {ROWS_HERE}")
def test_a_compiled_step_calls_the_packed_kernel_as_one_operator():
    from torch._inductor.utils import run_and_get_code

    layer = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    packed = PackedLinear(layer)
    row = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, (code, *_) = run_and_get_code(torch.compile(lambda x: torch.relu(packed(x)), backend="inductor"), row)
    assert "torch.ops.decodebench_bf16.bf16_rows.default(" in code
    assert torch.equal(got, torch.relu(packed(row)))
