"""Linears of one input joined into one product (engines/joined.py): each output as its own linear computes it, and
what cannot be joined is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines import int4
from engines.joined import join
from tests.conftest import opened
from tests.test_int4 import ATEN, ROWS, packed_weight, runs_here

IN = 64


def holder(**linears: nn.Module) -> nn.Module:
    module = nn.Module()
    for name, linear in linears.items():
        setattr(module, name, linear)
    return module


def int4_linear(rows: int, seed: int, kernel: str = ROWS) -> int4.Int4Linear:
    weight, _ = packed_weight(rows, IN)
    weight.scale.mul_(1 + seed)  # another weight a part: a joined product that mixed them up would show it
    return int4.Int4Linear(weight, torch.bfloat16, torch.device("cpu"), kernel=kernel)


def test_joined_int4_rows_give_each_part_its_own_outputs_exactly():
    runs_here(ROWS)
    parts = {"q_proj": int4_linear(48, 0), "k_proj": int4_linear(16, 1), "v_proj": int4_linear(32, 2)}
    x = torch.randn(3, IN, dtype=torch.bfloat16)
    alone = [m(x) for m in parts.values()]
    module = holder(**parts)
    assert join(module, "qkv_proj")
    assert not hasattr(module, "q_proj") and module.qkv_proj_sizes == [48, 16, 32]
    together = module.qkv_proj(x).split(module.qkv_proj_sizes, dim=-1)
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))  # the same sums, bit for bit


def test_joined_dense_linears_give_each_part_its_own_outputs():
    torch.manual_seed(0)
    parts = [nn.Linear(IN, n, bias=False, dtype=torch.bfloat16) for n in (40, 24)]
    x = torch.randn(1, IN, dtype=torch.bfloat16)
    alone = [m(x) for m in parts]
    module = holder(gate_proj=parts[0], up_proj=parts[1])
    assert join(module, "gate_up_proj")
    assert module.gate_up_proj.weight.dtype == torch.bfloat16 and not module.gate_up_proj.weight.requires_grad
    gate, up = module.gate_up_proj(x).split(module.gate_up_proj_sizes, dim=-1)
    for joined, own in ((gate, alone[0]), (up, alone[1])):
        torch.testing.assert_close(joined, own)  # bf16 rounding at most: the library may sum a longer product so


@pytest.mark.parametrize("case", ["another int4 kernel", "not whole tiles", "a bias", "other inputs"])
def test_what_cannot_be_joined_is_left_as_it_was(case):
    if case == "another int4 kernel":
        parts = {"gate_proj": int4_linear(32, 0, ATEN), "up_proj": int4_linear(32, 1, ATEN)}
    elif case == "not whole tiles":
        runs_here(ROWS)
        parts = {"gate_proj": int4_linear(24, 0), "up_proj": int4_linear(32, 1)}
    elif case == "a bias":
        parts = {"gate_proj": nn.Linear(IN, 8), "up_proj": nn.Linear(IN, 8, bias=False)}
    else:
        parts = {"gate_proj": nn.Linear(IN, 8, bias=False), "up_proj": nn.Linear(IN + 8, 8, bias=False)}
    module = holder(**parts)
    assert not join(module, "gate_up_proj")
    assert module.gate_proj is parts["gate_proj"] and module.up_proj is parts["up_proj"]
    assert not hasattr(module, "gate_up_proj")


def test_the_ring_joins_q_k_v_where_a_layer_writes_its_own_kv_and_every_mlp(cache_dir, tiny):
    """(Its tokens against Transformers': tests/test_engines.py, through these joined linears.)"""
    engine = opened(f"cache_dir={cache_dir}", "engine=ring", "dtype=float32", "engine.backend=none")
    engine.load()
    try:
        model, config = engine.engine.model, engine.engine.model.config
        own = [layer for layer in model.model.layers if not layer.self_attn.is_kv_shared_layer]
        assert 0 < len(own) < config.num_hidden_layers  # tiny shares K/V as E2B does
        assert engine.engine.describe()["joined_linears"] == len(own) + config.num_hidden_layers
        assert all(hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.self_attn, "k_proj") for layer in own)
        assert all(hasattr(layer.mlp, "gate_up_proj") for layer in model.model.layers)
    finally:
        engine.close()


def test_a_joined_linear_takes_its_first_part_s_place_among_the_children():
    runs_here(ROWS)
    module = holder(q_norm=nn.Identity(), q_proj=int4_linear(48, 0), k_proj=int4_linear(16, 1),
                    v_proj=int4_linear(32, 2), o_proj=int4_linear(16, 3))  # fmt: skip
    assert join(module, "qkv_proj")
    assert list(module._modules) == ["q_norm", "qkv_proj", "o_proj"]  # the order engines.held lays weights out in
