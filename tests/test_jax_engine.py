"""The JAX engine: Transformers' greedy tokens on the same checkpoint (float32, short prompt and a
prompt that wraps the ring), 4-bit weights equal to the dequantized ones, exactly two programs,
and the device layer's JAX side (sync, memory counters, one framework per accelerator)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

from decodebench import evidence
from decodebench.checkpoint import (
    _quant_args,
    dequantize,
    open_checkpoint,
    stored_tensors,
    text_state_dict,
    unpack_weight,
)
from decodebench.device import DeviceHeld, JaxDevice, claim, resolve_device
from runner import run_cell

jax = pytest.importorskip("jax", reason="the jax extra is not installed (make setup installs it)")


@pytest.mark.parametrize(
    "extra",
    [
        ("engine.piece=32", "experiment.wrap_piece=32", "experiment.wrap_extra=300", "engine.step_matmul=upcast"),
        ("engine.weights=int4", "engine.step_matmul=reduce"),
    ],
    ids=["dense-wraps-the-ring", "int4-reduce"],
)
def test_jax_writes_the_reference_tokens(cell_cfg, tiny, extra):
    record = run_cell(cell_cfg("engine=jax", "experiment=parity", *extra))
    assert record["status"] == "ok", record["reason"]
    assert record["outputs"]["verdict"] == "pass"
    for name in ("prompt", "long"):
        out = record["outputs"][name]
        assert out["first_difference"] is None and out["tokens_equal"] == 32, name
        assert out["kl_max"] < 1e-6 and out["top5_engine"] == out["top5_reference"]
    long, layout = record["outputs"]["long"], record["engine"]["layout"]
    if layout["piece"] == 32:
        assert long["prompt_tokens"] > 2 * layout["ring_slots"], "the long prompt must wrap the ring"
    assert record["engine"]["programs"] == {"piece": 1, "step": 1}


def test_int4_unpack_equals_the_dequantized_weights(tiny):
    import jax.numpy as jnp

    from engines.jax_model import Int4, unpack_int4

    ckpt = open_checkpoint(tiny.w4a16)
    _, packed = text_state_dict(ckpt, torch.float32, keep_linears=True)
    stored = "model.language_model.layers.1.mlp.down_proj"
    table = packed["model.layers.1.mlp.down_proj"]
    with stored_tensors(ckpt.path) as tensors:
        expected = dequantize(
            unpack_weight(tensors, stored),
            tensors[f"{stored}.weight_scale"],
            _quant_args(ckpt.quantization, stored, False),
            torch.float32,
        )
    got = unpack_int4(Int4(jnp.asarray(table.packed.numpy()), jnp.asarray(table.scale.float().numpy())), jnp.float32)
    assert got.shape == tuple(expected.shape)
    assert torch.equal(torch.from_numpy(jax.device_get(got).copy()), expected)


def test_a_jax_decode_cell_writes_valid_evidence_and_two_programs(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=jax", "experiment=decode", "max_new_tokens=8", "repeats=1"))
    assert record["status"] == "ok", record["reason"]
    evidence.validate(record)
    engine, measured = record["engine"], record["measurements"]
    assert engine["programs"] == {"piece": 1, "step": 1} and engine["graphs"] == 2
    assert engine["step_matmul"] == "reduce"  # auto on a CPU
    config = open_checkpoint(tiny.w4a16).config  # bf16 (the cell's dtype): 2 bytes a value
    with torch.device("meta"):
        state = Gemma4ForCausalLM(config).state_dict(keep_vars=True)
    values = sum(t.numel() for t in {id(t): t for t in state.values()}.values())  # lm_head tied: counted once
    assert measured["weight_bytes_from_shape"]["value"] == 2 * (values + 2)  # and the two embedding scales
    layout = engine["layout"]
    slots = {"full_attention": layout["full_slots"], "sliding_attention": layout["ring_slots"]}
    kv = [2 * n["kv_heads"] * n["head_dim"] * slots[n["type"]] for i, n in enumerate(record["model"]["layers"])
          if n["kv_source"] == i]  # fmt: skip
    assert len(kv) == layout["full_layers"] + layout["sliding_layers"]
    assert measured["cache_bytes_from_shape"]["value"] == 2 * sum(kv)
    assert measured["decode_phase_tok_s"]["values"] and "VmHWM" in measured["memory_peak_rss"]["counter"]
    assert record["environment"]["device_kind"] == "cpu"


def test_jax_device_syncs_and_names_its_counters():
    device = resolve_device("cpu", "jax")
    assert isinstance(device, JaxDevice) and device.torch_device == torch.device("cpu")
    device.sync()
    device.reset_peak()
    assert device.memory_now().bytes > 0 and "VmRSS" in device.memory_now().counter
    assert "VmHWM" in device.peak_memory()["rss"].counter


def test_one_framework_holds_an_accelerator_per_process():
    owners: dict[str, str] = {}
    claim("cpu", "torch", owners)
    claim("cpu", "jax", owners)  # a CPU is shared freely
    claim("tpu", "torch", owners)
    claim("tpu", "torch", owners)
    with pytest.raises(DeviceHeld, match="hydra/launcher=isolated"):
        claim("tpu", "jax", owners)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_lm_heads_rounding_before_its_cast_leaves_every_bit_as_the_cast_alone(dtype):
    import jax.numpy as jnp
    import numpy as np

    from engines.jax_model import linear

    plan = type("P", (), {"dtype": jnp.dtype(dtype), "matmul": "reduce"})()  # the fields linear reads
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {name + ".weight": jax.random.normal(keys[0], (4096, 256), plan.dtype) for name in ("lm_head", "other")}
    x = jax.random.normal(keys[1], (1, 256), plan.dtype) * 3
    rounded, plain = (np.asarray(linear(x, params, name, plan), np.float32) for name in ("lm_head", "other"))
    assert rounded.dtype == plain.dtype and np.array_equal(rounded, plain)
    assert linear(x, params, "lm_head", plan).dtype == plan.dtype
