"""A decode step's attention on a CPU with AVX-512 BF16: ``decodebench_attn::one_query`` (``csrc/one_query.cpp``,
built with ``engines.cpu_kernels``), which the ring and the Rust engine call where a decode step would call aten's
flash attention (the Rust shim finds it by name in ATen's dispatcher).

``engine.decode_attention`` (``DecodeAttention``): ``auto`` takes it where it runs (a CPU, bf16, head dims of
multiples of 32) and aten's ``scaled_dot_product_attention`` elsewhere; ``sdpa`` always aten's; ``one_query`` always
it, the cell skipped, with the reason, where it cannot run. A prompt's pieces are aten's either way.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import torch

from engines.base import EngineLimit
from engines.cpu_kernels import missing

OP = "decodebench_attn.one_query"  # the operator's name as it is dispatched (and as the evidence names it)
SDPA = "aten.scaled_dot_product_attention"
DOT_WIDTH = 32  # head dims must be multiples of it (csrc/one_query.cpp: kDotWidth)


class DecodeAttention(StrEnum):
    auto = "auto"
    sdpa = "sdpa"
    one_query = "one_query"


def unsupported(device_kind: str, dtype: torch.dtype, head_dims: set[int] | None = None) -> str | None:
    """Why ``one_query`` cannot run here (aten's attention does), or None; ``head_dims`` None: before the model's
    config is read."""
    if device_kind != "cpu":
        return f"it is a CPU kernel, this run's device is {device_kind}"
    if dtype != torch.bfloat16:
        return f"it computes bf16 attention, this run's dtype is {dtype}"
    if head_dims is not None and any(d % DOT_WIDTH for d in head_dims):
        return f"it takes head dims of multiples of {DOT_WIDTH}, this model's are {sorted(head_dims)}"
    return missing()


def refusal(reason: str) -> str:
    """What a cell that asked for ``one_query`` where it cannot run is skipped with."""
    return f"engine.decode_attention=one_query cannot run here: {reason}"


def refused(requested: DecodeAttention, device_kind: str, dtype: torch.dtype) -> str | None:
    """Why ``engine.decode_attention`` as asked cannot run here (the cell is skipped), or None: before the model is
    read, so its head dims are checked by ``choose``."""
    if requested == DecodeAttention.one_query and (reason := unsupported(device_kind, dtype)):
        return refusal(reason)
    return None


def choose(requested: DecodeAttention, device_kind: str, dtype: torch.dtype, config: Any) -> str:
    """The operator a decode step's attention calls (``OP`` or ``SDPA``) for ``engine.decode_attention`` and the
    model's text ``config``; ``one_query`` asked where the model's head dims rule it out raises ``EngineLimit``."""
    if requested == DecodeAttention.sdpa:
        return SDPA
    head_dims = {config.per_layer_config[i].head_dim for i in range(config.num_hidden_layers)}
    reason = unsupported(device_kind, dtype, head_dims)
    if reason and requested == DecodeAttention.one_query:
        raise EngineLimit(refusal(reason))
    return SDPA if reason else OP


def one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scale: float
              ) -> torch.Tensor:  # fmt: skip
    """q [B, KV, rows, D] (each K/V head's query rows), keys and values [B, KV, slots, D], keep [B, rows, slots]
    (True: the row may see the slot; the rows may be one row's, expanded) -> [B, KV, rows, D], all bf16 but ``keep``."""
    return torch.ops.decodebench_attn.one_query(q, keys, values, keep, scale)
