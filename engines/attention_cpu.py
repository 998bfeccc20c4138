"""A decode step's attention on a CPU with AVX-512 BF16: ``decodebench_attn::one_query`` (``csrc/one_query.cpp``,
built with ``engines.cpu_kernels``), which the stepping engines and the Rust engine call where a decode step would call
aten's flash attention (the Rust shim finds it by name in ATen's dispatcher). The ring calls it from its own attention
(``grouped_attention``); ``compiled`` and ``table4``, which run Transformers' own model, through Transformers' attention
interface (``use_in``). aten's CPU flash attention took 0.44-1.0 ms a call for one query of E2B's (8 heads over one K/V
head of 256 or 512 dims, 256-512 slots; a scratch loop on the 2-core AMD EPYC of Zen 4, two threads), about a third of
the int4 ``compiled`` step; its math backend 0.31-0.60 ms.

``engine.decode_attention`` (``DecodeAttention``): ``auto`` takes it where it runs (a CPU, bf16, head dims of
multiples of 32) and aten's ``scaled_dot_product_attention`` elsewhere; ``sdpa`` always aten's; ``one_query`` always
it, the cell skipped, with the reason, where it cannot run. A prompt's pieces are aten's either way.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engines.base import EngineLimit
from engines.cpu_kernels import missing

OP = "decodebench_attn.one_query"  # the operator's name as it is dispatched (and as the evidence names it)
SDPA = "aten.scaled_dot_product_attention"
TRANSFORMERS_NAME = "decodebench_one_query"  # what Transformers' attention and mask interfaces know ``use_in``'s by
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


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scale: float, own: bool = False
) -> torch.Tensor:
    """SDPA with each K/V head's G = H/KV query heads folded into the query length: q [B, H, S, D],
    keys and values [B, KV, slots, D], keep [B, G*S, slots] (each sequence's [S, slots] mask repeated G times) ->
    [B, H, S, D]. The products are the same as with ``enable_gqa`` (head h reads K/V head h // G);
    on a CPU one [G*S, slots] product per K/V head is far cheaper than G broadcast ones. ``own``: the project's
    kernel (``one_query``) instead of aten's."""
    batch, heads, seq, dim = q.shape
    folded = q.reshape(batch, keys.shape[1], heads // keys.shape[1] * seq, dim)
    if own:
        out = one_query(folded, keys, values, keep, scale)
    else:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=keep[:, None], scale=scale)
    return out.view(batch, heads, seq, values.shape[-1])


def transformers_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function of Transformers' interface (``AttentionInterface``) whose decode step is ``one_query``:
    query [B, H, S, D], key and value [B, KV, slots, D] as the model's cache holds them, ``attention_mask`` as
    Transformers' sdpa mask makes it ([B, 1, S, slots] bool, True: the query may see the slot; None: every slot) ->
    ([B, S, H, D], None), as Transformers' sdpa returns. One query a sequence (S = 1) is folded as the ring folds it
    (``grouped_attention``, its mask row shared by the G query heads of a K/V head); anything else (a prompt, another
    kind of mask, dropout, a position bias) is Transformers' own sdpa, unchanged."""
    batch, heads, seq, dim = query.shape
    if seq != 1 or dropout or kwargs.get("position_bias") is not None or (
            attention_mask is not None and attention_mask.dtype != torch.bool):  # fmt: skip
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    slots = key.shape[2]
    keep = attention_mask[:, 0] if attention_mask is not None else query.new_ones(batch, 1, slots, dtype=torch.bool)
    scale = scaling if scaling is not None else dim**-0.5
    out = grouped_attention(query, key, value, keep.expand(batch, heads // key.shape[1], slots), scale, True)
    return out.transpose(1, 2).contiguous(), None


def use_in(model: Any) -> None:
    """Transformers' ``model`` (a ``PreTrainedModel``) calls ``transformers_attention``: registered with Transformers'
    attention interface, and its masks with the mask interface as sdpa's, under ``TRANSFORMERS_NAME``."""
    AttentionInterface.register(TRANSFORMERS_NAME, transformers_attention)
    AttentionMaskInterface.register(TRANSFORMERS_NAME, sdpa_mask)
    model.set_attn_implementation(TRANSFORMERS_NAME)
