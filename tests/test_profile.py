"""experiment=profile: each class present per token, its bytes from the model's own buffers, the raw trace
beside the evidence."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engines.base import Generation
from engines.one_row import swap_dense_linears
from experiments import profile as profile_module
from experiments.decode import warm_pairs
from experiments.profile import CLASSES, DISPATCH, WEIGHT_KINDS, TorchProfile, account, classify
from experiments.profile_jax import instruction_classes, wall_split
from reports import render
from reports.tables.profile import profile_table
from runner import run_cell
from tests.conftest import REPO, opened


@pytest.mark.parametrize("engine", ["ring", "rust", "jax"])
def test_a_profile_names_every_class_with_the_bytes_it_reads(cell_cfg, tiny, cache_dir, tmp_path, engine):
    if engine == "rust":
        pytest.importorskip("decodebench_rs", reason="the rust engine is not built (make setup)")
    # tiny's steps are short and a 1-token call's noise is several of them: the N-token call's extra steps keep
    # T_N > T_1 (jax: under a millisecond a step, 31) and each class's N-token time above its 1-token time (torch:
    # with 3 extra steps the MLP's difference once came out <= 0 on a busy machine, leaving no GB/s to check; ring:
    # the measured calls record no shapes, so every weight product's time is one sum whose 1-token part holds the
    # prompt piece's products, and with 11 extra steps its noise under `make test` once put every kind at <= 0;
    # rust: at 0.3 ms a step, 11 extra steps once left its profiled step below zero under `make test`)
    settings = {"ring": ("engine.backend=eager", "max_new_tokens=32"), "rust": ("max_new_tokens=32",),
                "jax": ("max_new_tokens=32",)}[engine]  # fmt: skip
    record = run_cell(cell_cfg(f"engine={engine}", *settings, "experiment=profile", "repeats=2"))
    assert record["status"] == "ok", record["reason"]
    own_calls = next(c for c in record["outputs"]["checks"] if c["rule"].endswith("of the profiled calls' own step"))
    assert own_calls["holds"], own_calls["detail"]  # self times cannot outrun the wall time of their own calls
    assert record["measurements"]["profiled_step_ms"]["n"] == 2
    classes = {c["class"]: c for c in record["outputs"]["classes"]}
    assert list(classes) == list(CLASSES)
    step = record["measurements"]["step_ms"]["value"]
    assert sum(c["ms_per_token"] for c in classes.values()) == pytest.approx(step)

    torch_twin = "generate" if engine == "jax" else engine  # the same checkpoint and dtype, its torch model
    model = opened(f"cache_dir={cache_dir}", f"engine={torch_twin}").load().model
    for kind, ends in WEIGHT_KINDS.items():  # every linear of the kind, by name, its weight's bytes as held
        held = sum(getattr(m, "packed", getattr(m, "weight", None)).nbytes
                   for n, m in model.named_modules(remove_duplicate=False) if n.rpartition(".")[2] in ends)  # fmt: skip
        assert classes[kind]["bytes_per_token"] == held, kind

    trace = tmp_path / "runs" / record["outputs"]["trace"]
    (evidence,) = (tmp_path / "runs" / "test").glob(f"{engine}-*.json")
    assert trace.name == evidence.name.removesuffix(".json") + ".trace.json.gz", "named by its cell, never shared"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    # jax: XLA's, by HLO name; torch: a weight product by whichever kernel engine.one_row=auto picked here
    operation = ("ynn_fusion", "dot", "reduce") if engine == "jax" else ("aten::mm", "aten::mv", "decodebench_bf16::")
    assert any(e.get("name", "").startswith(operation) for e in events)
    assert not trace.is_relative_to(REPO / "evidence" / "published")

    table = profile_table({record["cell"]: record})  # the report's table: the classes add up to the step
    assert list(table["class"]) == list(CLASSES) and table.ms_per_token.sum() == pytest.approx(step)
    bandwidth = record["hardware"]["bandwidth_measurement"]["value"]
    # the floor another way: the class's time scaled by the GB/s it reached over the machine's, for every class with a
    # GB/s (a class whose N-token time came out at or under its 1-token time on a busy machine has none)
    rows = table.set_index("class")
    reached = [c for c, measured in classes.items() if measured["gb_s"] is not None]
    assert set(reached) & set(WEIGHT_KINDS), reached
    for c in reached:
        assert rows.loc[c].floor_ms == pytest.approx(classes[c]["ms_per_token"] * classes[c]["gb_s"] / bandwidth), c
    out = render.build(tmp_path / "runs", REPO / "evidence" / "published", tmp_path / "r" / "R.md", tmp_path / "a.txt")
    text = out.report.read_text()
    assert "## Where each millisecond of a decode step goes" in text and "| weights: MLP |" in text
    ratio = record["measurements"]["operators_over_profiled_step"]["value"]
    assert f"operators / profiled step {ratio:.3f}x" in text, "the report prints the check's own ratio"
    assert (tmp_path / "r" / "profile.png").is_file() and "![where each millisecond goes](profile.png)" in text


def test_an_engine_that_does_not_step_is_skipped(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=generate", "experiment=profile"))
    assert record["status"] == "skipped" and "needs an engine that steps" in record["reason"]


HLO = """HloModule jit_decode_step

%fused_computation.1 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %exponential = f32[4]{0} exponential(%param_0), metadata={op_name="jit(decode_step)/attention/exp"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %ynn_fusion.3 = f32[4]{0} fusion(%x), calls=%fused, metadata={op_name="jit(decode_step)/up_proj/reduce_sum"}
  %copy_fusion = f32[4]{0} fusion(%ynn_fusion.3), kind=kLoop, calls=%fused_computation.1
  ROOT %multiply.2 = f32[4]{0} multiply(%copy_fusion, %x), metadata={op_name="jit(decode_step)/mul"}
}
"""


def test_xla_operations_are_classed_by_the_models_scopes_and_concurrent_time_is_split():
    classes = instruction_classes(HLO)
    assert classes["ynn_fusion.3"] == "weights: MLP"  # its own metadata
    assert classes["copy_fusion"] == "attention"  # no metadata: its fused computation's root's
    assert classes["multiply.2"] == "norms and elementwise"
    events = [  # microseconds: the MLP op alone 0-10, with the attention op 10-14, attention alone 14-20,
        {"ph": "X", "name": "PjitFunction(decode_step)", "ts": 0, "dur": 30},  # dispatch with nothing running
        {"ph": "X", "name": "ynn_fusion.3", "ts": 0, "dur": 14},
        {"ph": "X", "name": "copy_fusion", "ts": 10, "dur": 10},
        {"ph": "X", "name": "end: copy_fusion", "ts": 20, "dur": 0},  # not an operation
        {"ph": "X", "name": "multiply.2", "ts": 40, "dur": 5},  # outside the dispatch
    ]
    split = wall_split(events, classes)
    assert split["weights: MLP"] == pytest.approx(12e-6) and split["attention"] == pytest.approx(8e-6)
    assert split["host: dispatch and wrappers"] == pytest.approx(10e-6)
    assert split["norms and elementwise"] == pytest.approx(5e-6)
    assert sum(split.values()) == pytest.approx(35e-6), "the wall time covered, never more"


def test_weight_products_of_the_decode_steps_alone_set_the_split_and_the_measured_calls_record_no_shapes(monkeypatch):
    class Block(torch.nn.Module):  # two weight products of different kinds and shapes: (in, out) 64x32 and 64x256
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(64, 32, bias=False)
            self.up_proj = torch.nn.Linear(64, 256, bias=False)

        def forward(self, prompt: torch.Tensor, steps: int) -> torch.Tensor:
            out = self.up_proj(prompt).sum()  # the prompt read: MLP products of many rows, in both calls of a pair
            for _ in range(steps):  # the decode steps: attention projections of one row each
                out = out + self.q_proj(prompt[:1]).sum()
            return out

    recorded: list[bool] = []

    def spy(*args, record_shapes: bool = False, **kwargs):
        recorded.append(record_shapes)
        return torch.profiler.profile(*args, record_shapes=record_shapes, **kwargs)

    monkeypatch.setattr(profile_module, "profile", spy)
    block, prompt = Block(), torch.randn(512, 64)
    profiler = TorchProfile(SimpleNamespace(model=block))
    profiler.prepare(lambda: block(prompt, 1), lambda: block(prompt, 8), None)
    assert profiler.splits["aten::mm"] == {"weights: attention projections": 1.0, "weights: MLP": 0.0}, (
        "the prompt's products, read by both calls, drop out of the split"
    )
    classes = profiler.run(lambda: block(prompt, 8))
    assert recorded == [True, True, False], "shapes in the preparing pair only"
    assert classes["weights: attention projections"] > classes.get("weights: MLP", 0.0) == 0.0
    assert "attention" not in classes, "a product profiled without shapes still goes to its weights' kinds"


def test_a_one_row_product_through_mv_goes_to_its_weights_kind():
    layer = torch.nn.Linear(64, 32, bias=False)
    block = torch.nn.ModuleDict({"q_proj": layer})
    assert swap_dense_linears(block) == 1  # engine.one_row=mv: one row through torch.mv (aten::mv, aten::addmv_)
    profiler = TorchProfile(SimpleNamespace(model=block))
    row, prompt = torch.randn(1, 64), torch.randn(8, 64)
    profiler.prepare(lambda: layer(prompt), lambda: [layer(prompt)] + [layer(row) for _ in range(8)], None)
    assert {"aten::mv", "aten::addmv_"} <= set(profiler.splits)
    classes = profiler.run(lambda: [layer(row) for _ in range(8)])
    assert classes["weights: attention projections"] > 0 and "norms and elementwise" not in classes
    assert "attention" not in classes


def test_a_profile_is_set_beside_the_decode_cell_of_its_own_sweep_and_settings_only():
    def record(experiment: str, sweep: str, mode: str = "eager", **measurements) -> dict:
        config = {"experiment": {"name": experiment}, "engine": {"name": "rust", "mode": mode},
                  "model": {"name": "e2b-synthetic"}, "context": 256, "max_new_tokens": 16}  # fmt: skip
        return {"status": "ok", "sweep": sweep, "config": config, "model": {"synthetic": True}, "environment": {},
                "hardware": {}, "measurements": measurements,
                "outputs": {"classes": [{"class": "weights: MLP", "ms_per_token": 1.0, "share": 0.5}]}}  # fmt: skip

    profiled = {"step_ms": {"value": 300.0}, "profiled_operators_ms": {"value": 240.0}}
    table = profile_table({
        "a/decode.json": record("decode", "a", decode_tok_s={"median": 4.0, "min": 2.0, "max": 5.0}),
        "b/decode.json": record("decode", "b", decode_tok_s={"median": 8.0, "min": 8.0, "max": 8.0}),
        "a/profile.json": record("profile", "a", **profiled),
        "a/profile-fuse.json": record("profile", "a", mode="fuse", **profiled),
        "c/decode.json": record("decode", "c"),  # ok, but every pair broke the method: no rate
        "c/profile.json": record("profile", "c", **profiled),
    }).set_index("file")  # fmt: skip
    paired = table.loc["a/profile.json"]
    assert paired.decode_file == "a/decode.json", "its own sweep's decode cell, never another sweep's"
    assert (paired.decode_step_ms, paired.decode_step_min_ms, paired.decode_step_max_ms) == (250.0, 200.0, 500.0)
    assert paired.operators_ms == 240.0
    assert table.loc["a/profile-fuse.json"].isna().decode_file, "another mode's decode cell is no pair"
    assert table.loc["c/profile.json"].isna().decode_file, "a decode cell without a rate has no step to set beside"


def test_each_unprofiled_pair_is_followed_by_its_profiled_pair():
    order: list[str] = []

    def timed_pair(ids: list[int], n: int) -> tuple[float, Generation, float]:
        order.append("unprofiled")
        return 1.0, SimpleNamespace(tokens=[7] * n), 2.0

    cell = SimpleNamespace(cfg=SimpleNamespace(repeats=3, max_new_tokens=4), timed_pair=timed_pair)
    pairs = warm_pairs(cell, [1], [7] * 4, after=lambda: order.append("profiled"))
    assert order == ["unprofiled", "profiled"] * 3 and pairs.warm_n == [2.0] * 3


def test_the_operators_answer_to_their_own_calls_and_to_the_unprofiled_step_beyond_its_noise():
    # seconds a token per pair: on e2b-synthetic (AMD) the ring's 256-row prompt piece took ~50 s, so one pair's
    # step moved between 0.26 and 0.50 s while the profiled operators stayed within 2% of their own calls' step
    ops, own_calls, noisy = [0.503, 0.517, 0.430], [0.508, 0.526, 0.437], [0.504, 0.381, 0.264]
    own, beside, (calls, step) = account(ops, own_calls, noisy)
    assert calls["holds"] and own.value == pytest.approx(0.503 / 0.508)
    assert step["holds"], "1.32x the median unprofiled step, but within the pairs' noise: not a measured excess"
    assert beside.value == pytest.approx(0.503 / 0.381) and beside.low <= 1.05
    _, _, (calls, step) = account([0.30, 0.31, 0.32], [0.25, 0.26, 0.27], [0.20, 0.201, 0.202])
    assert not calls["holds"] and "operators / profiled step 1.192" in calls["detail"]
    assert not step["holds"], "every pair's operators 1.5x a steady step: a measured excess fails"
    _, _, (_, step) = account([0.30], [0.31], [0.20])
    assert not step["holds"] and "no interval" in step["detail"], "one pair: the ratio itself is held to 5%"
    _, _, (calls, _) = account([0.01, 0.01], [-0.02, -0.01], [0.2, 0.2])
    assert not calls["holds"], "a profiled step at or under zero (noise) holds nothing"


def test_a_compiled_steps_kernels_are_operators_and_its_wrapper_is_host_time():
    """Under the profile's compile, each TorchInductor kernel is an operator of its own (norms and elementwise) and
    the code that calls them is host time, not the other way round."""
    x = torch.randn(4, 64)
    compiled = torch.compile(lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6), backend="inductor")
    with TorchProfile.compiling():
        compiled(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            compiled(x)
    classes = {e.key: classify(e.key, [], {}) for e in prof.key_averages()}
    kernels = [k for k in classes if "cpp_fused" in k]
    wrappers = [k for k in classes if k.startswith("## Call CompiledFxGraph")]
    assert kernels and all(classes[k] == {"norms and elementwise": 1.0} for k in kernels)
    assert wrappers and all(classes[k] == {DISPATCH: 1.0} for k in wrappers)
