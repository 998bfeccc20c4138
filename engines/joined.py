"""Linears that read one input, joined into one product (gpt-fast's ``wqkv``): a decode step calls one operator for
an attention layer's q, k and v (``qkv_proj``) and one for an MLP's gate and up (``gate_up_proj``) where it called
three and two, each joined weight read front to back in one pass.

On a 2-core CPU a decode step is hundreds of products, and each costs a floor before it reads a byte (the call, the
threads' start, the output's allocation); E2B's small ones (k and v: 1536 -> 256) run far below the machine's read
for it. Joining leaves 65 fewer calls a token (15 attention layers hold their own K/V, 35 MLPs) and larger products.

Joined where every part is a plain ``nn.Linear`` without a bias (weights stacked; ``engine.one_row`` then decides the
joined linear's one-row call like any other, and a library product may order an output's sums otherwise: bf16
rounding at most) or an ``Int4Linear`` on ``int4_rows`` (tiles stacked: 16 outputs a tile, so each part's outputs a
whole number of tiles; each output the same sums in the same order, bit for bit); other kinds (aten's int4 kernels,
the TPU's unpack) stay as they are.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from engines import int4_cpu
from engines.int4 import Int4Linear
from engines.one_row import plain_linear

JOINED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stacked(parts: list[nn.Module]) -> nn.Module | None:
    """One linear whose outputs are ``parts``' outputs side by side, in order, or None where they cannot be joined
    (another kind, other input sizes or group sizes, outputs that are not whole tiles, a bias)."""
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        return None
    if all(plain_linear(p) and p.bias is None for p in parts):
        joined = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=False, device="meta")
        joined.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        return joined
    if all(isinstance(p, Int4Linear) and p.kernel == int4_cpu.OP and p.group == first.group and p.limbs == first.limbs
           and p.out_features % int4_cpu.TILE == 0 for p in parts):  # fmt: skip
        return Int4Linear.stacked(parts)
    return None


def join(module: nn.Module, name: str) -> bool:
    """Replaces ``module``'s linears ``JOINED[name]`` with one linear ``name`` in the first one's place among its
    children (module order is the order ``engines.held`` lays weights out in) and records their output sizes as
    ``<name>_sizes`` (what the caller splits the joined output by); False, and nothing changed, where they cannot
    be joined."""
    parts = [getattr(module, part) for part in JOINED[name]]
    joined = stacked(parts)
    if joined is None:
        return False
    place = list(module._modules).index(JOINED[name][0])
    for part in JOINED[name]:
        delattr(module, part)
    setattr(module, name, joined)
    children = list(module._modules.items())
    children.insert(place, children.pop())
    module._modules.clear()
    module._modules.update(children)
    setattr(module, f"{name}_sizes", [p.out_features for p in parts])
    return True


def joined_mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``Gemma4TextMLP.forward`` with its gate and up products joined (``gate_up_proj``)."""
    gate, up = self.gate_up_proj(x).split(self.gate_up_proj_sizes, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def join_layers(model: nn.Module) -> int:
    """Joins, in a Transformers Gemma 4 ``model``, q, k and v of each layer that writes its own K/V (a KV-shared layer
    has only q) and gate and up of every MLP (its forward then ``joined_mlp``); how many joined linears."""
    joined = 0
    for layer in model.model.layers:
        if not layer.self_attn.is_kv_shared_layer:
            joined += join(layer.self_attn, "qkv_proj")
        if join(layer.mlp, "gate_up_proj"):
            layer.mlp.forward = types.MethodType(joined_mlp, layer.mlp)
            joined += 1
    return joined
