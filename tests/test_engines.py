"""The PyTorch engine family: every engine writes Transformers' greedy tokens on the same checkpoint.

Compile paths run with the ``eager`` TorchDynamo backend here (graph capture without codegen), so
the graph and program counts are real while the suite stays fast.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from decodebench.device import Device, resolve_device
from decodebench.layout import bucket_for, kv_sources
from engines.attention_cpu import grouped_attention
from engines.int4 import Int4Embedding
from engines.ring import RingEngine
from engines.stepping import frozen_model_guards
from runner import run_cell, typed_config
from tests.conftest import e2b_text_config, make_cfg, opened

COMPILED = ("engine.backend=eager",)
NOT_COMPILED = ("engine.backend=none",)  # where the host loop or the weights are the point, not the programs


def parity(cell_cfg, engine: str, *extra: str) -> dict:
    overrides = [f"engine={engine}", "experiment=parity", *extra]
    if engine in ("compiled", "table4", "ring"):
        overrides += COMPILED
    record = run_cell(cell_cfg(*overrides))
    assert record["status"] == "ok", record["reason"]
    return record


@pytest.mark.parametrize("engine", ["generate", "static", "compiled", "table4", "ring", "rust"])
def test_engine_writes_the_reference_tokens(cell_cfg, tiny, engine):
    if engine == "rust":
        pytest.importorskip("decodebench_rs", reason="the rust engine is not built (make setup)")
    record = parity(cell_cfg, engine)
    out = record["outputs"]["prompt"]
    assert out["first_difference"] is None and out["tokens_equal"] == 32
    assert out["kl_max"] < 1e-6 and out["top5_engine"] == out["top5_reference"]
    assert record["outputs"]["verdict"] == "pass"
    assert len(set(out["engine_ids"])) > 1


@pytest.mark.slow
def test_ring_wraps_around_and_keeps_two_programs(cell_cfg, tiny):
    record = parity(cell_cfg, "ring", "engine.piece=32", "experiment.wrap_piece=32", "experiment.wrap_extra=300")
    long = record["outputs"]["long"]
    layout = record["engine"]["layout"]
    assert long["prompt_tokens"] > layout["ring_slots"] * 2, "the long prompt must wrap the ring more than once"
    assert long["first_difference"] is None and long["kl_max"] < 1e-6
    assert record["engine"]["graphs"] == 2 and record["engine"]["graph_breaks"] == 0


@pytest.mark.parametrize("engine", ["ring", "rust", "jax"])
def test_short_context_rings_hold_its_slots_alone(cell_cfg, tiny, engine):
    """At context=256 with pieces of 256 tokens a sliding ring of window + piece (128 + 256 rounded: 512 slots)
    could never fill: it holds the full layers' 256, never wraps, and the window is still kept by the mask (the
    long prompt, 200 tokens, runs past tiny's window of 128 within those slots)."""
    if engine == "rust":
        pytest.importorskip("decodebench_rs", reason="the rust engine is not built (make setup)")
    record = parity(cell_cfg, engine, "context=256", "experiment.wrap_piece=32", "experiment.wrap_extra=40")
    layout = record["engine"]["layout"]
    assert layout["ring_slots"] == layout["full_slots"] == 256
    for name in ("prompt", "long"):
        out = record["outputs"][name]
        assert out["first_difference"] is None and out["kl_max"] < 1e-6, name
    assert record["outputs"]["long"]["prompt_tokens"] > record["config"]["model"]["sliding_window"]


def test_compiled_refuses_past_the_window(cell_cfg, tiny):
    record = parity(cell_cfg, "compiled")
    assert record["outputs"]["long"]["status"] == "skipped"
    assert "sliding_window=128" in record["outputs"]["long"]["reason"]
    decode = run_cell(cell_cfg("engine=compiled", *COMPILED, "max_new_tokens=120"))
    assert decode["status"] == "skipped" and "use engine=ring" in decode["reason"]


def test_compiled_step_compiles_once(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=compiled", *COMPILED, "max_new_tokens=8", "repeats=2"))
    assert record["status"] == "ok", record["reason"]
    assert record["engine"]["graphs"] == 1 and record["engine"]["graph_breaks"] == 0


def test_fuse_is_skipped_off_tpu(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=fuse"))
    assert record["status"] == "skipped" and "tpu" in record["reason"]
    record = run_cell(cell_cfg("engine=static", "engine.mode=fuse"))
    assert record["status"] == "skipped" and "defer-and-fuse" in record["reason"]


@pytest.mark.parametrize("read_every", [1, 3, 0])
def test_read_every_changes_when_tokens_are_read_not_which(cell_cfg, tiny, read_every):
    record = run_cell(
        cell_cfg("engine=ring", *NOT_COMPILED, "max_new_tokens=7", "repeats=1", f"read_every={read_every}")
    )
    reference = run_cell(cell_cfg("engine=generate", "max_new_tokens=7", "repeats=1"))
    assert record["outputs"]["generated_ids"] == reference["outputs"]["generated_ids"]
    assert record["engine"]["read_every"] == read_every


def test_int4_lookup_equals_the_dequantized_table(tiny, cache_dir):
    table4 = opened(f"cache_dir={cache_dir}", "engine=table4", "dtype=float32").load()
    plain = opened(f"cache_dir={cache_dir}", "engine=generate", "dtype=float32").load()
    ids = torch.tensor([[0, 5, 4095, 17]])
    lookup = table4.model.model.embed_tokens_per_layer
    assert isinstance(lookup, Int4Embedding)
    assert torch.equal(lookup(ids), plain.model.model.embed_tokens_per_layer(ids))
    assert table4.model.model.embed_tokens_per_layer.packed.dtype == torch.int32


@pytest.mark.slow
@pytest.mark.parametrize(
    ("attend", "last_piece"), [("filled", "padded"), ("cache", "bucketed"), ("exact", "bucketed"), ("cache", "exact")]
)
def test_ring_reading_only_what_it_needs_writes_the_same_tokens(cell_cfg, tiny, attend, last_piece):
    record = parity(
        cell_cfg,
        "ring",
        f"engine.attend={attend}",
        f"engine.last_piece={last_piece}",
        "engine.piece=32",
        "experiment.wrap_piece=32",
        "experiment.wrap_extra=40",  # 200 tokens: past the ring's 160 slots, four buckets, a short last piece
    )
    for name in ("prompt", "long"):
        out = record["outputs"][name]
        assert out["first_difference"] is None and out["kl_max"] < 1e-6, name
    engine = record["engine"]
    assert engine["attend"] == attend and engine["last_piece"] == last_piece
    buckets = [int(b) for b in engine["buckets"]]
    if attend == "filled":  # the wrap prompt fills 7 pieces of 32: buckets 32, 64, 128, 256
        assert len(buckets) > 2 and max(buckets) < engine["layout"]["full_slots"]
    elif attend == "exact":  # whole pieces: 32, 64, ..., 224, and the steps' 224, 256
        assert buckets == list(range(32, 257, 32))
        assert engine["graphs"] < len(buckets), "one program for every slot count once it is made dynamic"
    else:
        assert buckets == [engine["layout"]["full_slots"]]
    lengths = [int(n) for n in engine["piece_lengths"]]
    assert (min(lengths) < 32) == (last_piece != "padded")
    if last_piece == "exact":  # the wrap prompt's last piece holds 200 - 6 * 32 = 8 tokens
        assert 8 in lengths
    assert engine["graphs"] > 2 and engine["graph_breaks"] == 0


@pytest.mark.parametrize(("last_piece", "shared_rows"), [("bucketed", 1), ("exact", 1), ("padded", 32)])
def test_a_padded_piece_runs_only_its_last_row_through_the_kv_shared_layers(cache_dir, tiny, last_piece, shared_rows):
    """A 20-token prompt in 32-token pieces: padded to 32 (bucketed, and the article's padded) or read as 20
    (exact). Its padding first, the last row is the prompt's: the KV-shared layers (which write no K/V) run that row
    alone; the article's layout pads at the end and runs every row through every layer. The same first token."""
    engine = opened(f"cache_dir={cache_dir}", "engine=ring", "engine.piece=32", f"engine.last_piece={last_piece}",
                    "dtype=float32", *NOT_COMPILED).load()  # fmt: skip
    rows: dict[int, list[int]] = {}
    for i, layer in enumerate(engine.model.model.layers):
        layer.mlp.register_forward_hook(lambda _m, args, _out, i=i: rows.setdefault(i, []).append(args[0].shape[1]))
    ids = [2] + [(7 * k) % 200 + 10 for k in range(19)]
    first = engine.generate(ids, 1).tokens
    shared = engine.model.config.num_kv_shared_layers
    own_rows = {r for i in range(len(rows) - shared) for r in rows[i]}
    shared_rows_seen = {r for i in range(len(rows) - shared, len(rows)) for r in rows[i]}
    assert own_rows == {20 if last_piece == "exact" else 32} and shared_rows_seen == {shared_rows}
    alone = opened(f"cache_dir={cache_dir}", "engine=generate", "dtype=float32").load()
    assert first == alone.generate(ids, 1).tokens
    engine.close()
    alone.close()


@pytest.mark.parametrize(
    ("needed", "bucket"), [(1, 32), (32, 32), (33, 64), (64, 64), (65, 128), (200, 256), (1000, 1024), (1025, 1056)]
)
def test_bucket_for_rounds_up_to_piece_times_a_power_of_two(needed, bucket):
    assert bucket_for(needed, piece=32, full=1056) == bucket


def test_a_kv_shared_layer_reads_the_last_owner_of_its_kind_as_transformers_marks_it():
    """On E2B's shape (several sliding owners): each shared layer's K/V source is
    the layer Transformers' Gemma 4 config marks to store it, the last owner of that kind, not the first."""
    config = e2b_text_config()
    modes, kinds = config.kv_sharing_modes, config.layer_types
    sources = kv_sources(config)
    shared = [i for i, mode in enumerate(modes) if mode == "reuse"]
    assert len(shared) == 20
    for i in shared:
        assert modes[sources[i]] == "store" and kinds[sources[i]] == kinds[i], i
    first_sliding = kinds.index("sliding_attention")
    assert sources[shared[0]] != first_sliding and sources[shared[0]] != shared[0]


def test_grouped_attention_equals_sdpa_with_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 5, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    keep = torch.rand(5, 40) > 0.3
    keep[:, 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=keep[None, None], scale=0.25, enable_gqa=True
    )
    assert torch.allclose(grouped_attention(q, k, v, keep.repeat(4, 1)[None], 0.25), expected, atol=1e-6)


@pytest.mark.slow
def test_the_ring_keeps_the_per_layer_table_4bit_as_table4_does(cell_cfg, tiny):
    """The article's notebook 05 ring reads the -emb4 twin and looks its per-layer table up packed: the
    same tokens as table4 on the same prompt, and the same weight bytes held; bf16 is one setting away."""
    common = ("experiment=decode", "max_new_tokens=8", "repeats=1", *NOT_COMPILED)
    ring, table4 = (run_cell(cell_cfg(f"engine={e}", *common)) for e in ("ring", "table4"))
    dense = run_cell(cell_cfg("engine=ring", "engine.per_layer_table=bf16", "model.tables=int4", *common))
    for record in (ring, table4, dense):
        assert record["status"] == "ok", record["reason"]
    assert ring["outputs"]["generated_ids"] == table4["outputs"]["generated_ids"]
    assert ring["engine"]["kept_4bit"] == table4["engine"]["kept_4bit"] == ["embed_tokens_per_layer"]
    assert dense["engine"]["kept_4bit"] == [] and ring["model"]["tables_description"].startswith("int4")
    held = {name: r["measurements"]["weight_bytes_from_shape"]["value"] for name, r in
            (("ring", ring), ("table4", table4), ("dense", dense))}  # fmt: skip
    assert held["ring"] == held["table4"]
    table = ring["engine"]["embed_tokens_per_layer_dense_bytes"] - ring["engine"]["embed_tokens_per_layer_bytes"]
    saved = held["dense"] - held["ring"]  # the same twin: only the per-layer table differs
    assert saved - table == 2 - 32, "the table's bytes, less the dense scale (2 B) and the lookup's shifts (32 B)"


def test_rust_under_defer_and_fuse_needs_a_tpu(cell_cfg, tiny):
    """The Rust article's SERVE_DEFER_AND_FUSE=1: engine.mode=fuse, skipped off a TPU with the reason."""
    pytest.importorskip("decodebench_rs", reason="the rust engine is not built (make setup)")
    record = run_cell(cell_cfg("engine=rust", "engine.mode=fuse"))
    assert record["status"] == "skipped" and "rust with mode=fuse needs TorchTPU's defer-and-fuse" in record["reason"]
    plain = run_cell(cell_cfg("engine=rust", "experiment=decode", "max_new_tokens=3", "repeats=1"))
    assert plain["status"] == "ok", plain["reason"]
    assert plain["engine"]["torch_tpu_defer_and_fuse"] == "0" and plain["engine"]["mode"] == "eager"


def test_a_ring_with_a_dynamic_slot_count_is_refused_on_a_tpu_and_runs_elsewhere():
    run = typed_config(make_cfg("engine=ring", "engine.attend=exact"))
    tpu = Device(kind="tpu", name="a TPU", torch_device=torch.device("cpu"))
    assert "fixed shapes" in RingEngine.unsupported_reason(tpu, run)
    assert RingEngine.unsupported_reason(resolve_device("cpu", "torch"), run) is None
    bucketed = typed_config(make_cfg("engine=ring", "engine.attend=filled"))
    assert RingEngine.unsupported_reason(tpu, bucketed) is None


def test_a_compiled_step_guards_the_engines_state_and_not_the_frozen_model():
    """The guards kept: the engine's own (the ring's tensors and bucket), globals, and aliasing checks on the model;
    dropped: the model's module tree, weights and config, which do not change once it is loaded."""
    entries = [SimpleNamespace(name=name, guard_type=kind) for name, kind in [
        ("self.model._modules['model']._modules['norm']", "TYPE_MATCH"),
        ("self.model._modules['model']._modules['layers']._modules['3']._forward_hooks", "EMPTY_NN_MODULE_HOOKS_DICT"),
        ("self.model._modules['lm_head']._parameters['weight']", "TENSOR_MATCH"),
        ("self.model.config.__dict__['sliding_window']", "CONSTANT_MATCH"),
        ("self.model", "TYPE_MATCH"),
        ("self.model._modules['model']._modules['layers']._modules['0']._modules['self_attn'].forward.__func__",
         "DUPLICATE_INPUT"),
        ("self.ring.k[0]", "TENSOR_MATCH"),
        ("self.ring.bucket", "CONSTANT_MATCH"),
        ("self.model_like", "TYPE_MATCH"),
        ("G['torch'].is_grad_enabled", "GRAD_MODE"),
    ]]  # fmt: skip
    assert frozen_model_guards(entries) == [False] * 5 + [True] * 5


@pytest.mark.parametrize(("extra", "checked"), [((), False), (("+engine.inductor.size_asserts=true",), True)])
def test_a_compiled_steps_wrapper_checks_no_sizes_unless_told(tiny, extra, checked):
    """The ring's step compiled by TorchInductor (``STEP_DEFAULTS``): the Python wrapper it writes checks no input's
    or operator output's size and strides before each call (the frozen model's weights among them), unless
    ``+engine.inductor.size_asserts=true`` asks for the checks back."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    opened_ring = opened("engine=ring", f"cache_dir={tiny.root.parents[1]}", *extra)
    try:
        ring = opened_ring.load()
        with config.patch(fx_graph_cache=False):  # a cached program is loaded, not written: write it
            _, codes = run_and_get_code(lambda: ring.generate(opened_ring.encode("a short prompt"), 3))
    finally:
        opened_ring.close()
    assert codes and all("def call(" in code for code in codes)
    assert all(("assert_size_stride(" in code) == checked for code in codes)


def test_a_compiled_step_holds_the_frozen_model_and_takes_the_ring_each_call(cell_cfg, tiny):
    """The step's program holds the model's tensors (``install_free_tensors``): the code TorchDynamo runs before it
    looks up the ring's buffers alone, not each weight through the module tree; on a TPU the weights stay inputs."""
    run = typed_config(make_cfg("engine=ring"))
    tpu = Device(kind="tpu", name="a TPU", torch_device=torch.device("cpu"))
    assert RingEngine.dynamo_settings(run.engine, resolve_device("cpu", "torch"))["install_free_tensors"] is True
    assert "install_free_tensors" not in RingEngine.dynamo_settings(run.engine, tpu)
    opened_ring = opened("engine=ring", *COMPILED, f"cache_dir={tiny.root.parents[1]}")
    try:
        opened_ring.load().generate(opened_ring.encode("a short prompt"), 3)
        [entry] = _debug_get_cache_entry_list(RingEngine.step.__code__)
        assert "ring" in entry.code.co_names and "_modules" not in entry.code.co_names
    finally:
        opened_ring.close()


def test_the_skeleton_has_e2bs_layers_at_tiny_widths():
    """``model=e2b-skeleton`` (what a step costs beside its weights) builds E2B's layers: the same layer types, K/V
    sources, head dims and doubled MLPs in the same pattern, the same heads, and every width far below E2B's."""
    e2b, skeleton = e2b_text_config(), e2b_text_config("e2b-skeleton")
    assert skeleton.layer_types == e2b.layer_types and kv_sources(skeleton) == kv_sources(e2b)

    def layer(config, i):  # against the first layer's (a sliding layer of the narrow MLP)
        per, first = config.per_layer_config[i], config.per_layer_config[0]
        return per.head_dim // first.head_dim, per.intermediate_size // first.intermediate_size, per.num_key_value_heads

    assert [layer(skeleton, i) for i in range(35)] == [layer(e2b, i) for i in range(35)]
    assert (skeleton.num_attention_heads, skeleton.num_kv_shared_layers) == (e2b.num_attention_heads, 20)
    for width in ("hidden_size", "vocab_size", "hidden_size_per_layer_input"):
        assert getattr(skeleton, width) * 8 <= getattr(e2b, width), width
    for width in ("head_dim", "intermediate_size"):
        assert getattr(skeleton.per_layer_config[4], width) * 8 <= getattr(e2b.per_layer_config[4], width), width
