"""Weights that stay 4-bit while they compute (``engine.weights=int4``), one existing kernel per device.

With ``engine.weights=int4`` an engine reads the ``-emb4`` twin, where every large tensor is int4, and
keeps them so: the vocabulary tables as ``Int4Embedding`` (packed rows looked up, only those
unpacked) and every linear, ``lm_head`` included, as ``Int4Linear``.

The checkpoint's W4A16 levels and group-32 scales are used as stored (no re-quantization), repacked
once at load into the layout the device's kernel wants:

* ``cpu``: ``aten._weight_int4pack_mm_for_cpu`` over ``aten._convert_weight_to_int4pack_for_cpu``;
* ``cuda``: tinygemm's ``aten._weight_int4pack_mm`` over ``aten._convert_weight_to_int4pack`` (bf16);
* ``tpu``: the checkpoint's packed words, unpacked inside the compiled step (whether XLA fuses the
  unpack into the matmul is what a TPU run measures).

The asymmetric kernels compute w = (q - 8) * scale + zero with q = level + 8 and zero = 0, which is
the checkpoint's w = level * scale exactly.
"""

from __future__ import annotations

import warnings
from enum import StrEnum

import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from torch import nn

from decodebench.checkpoint import PackedTable

GROUP = 32


class Weights(StrEnum):
    """How the W4A16 linears are held while they compute: dequantized at load, or 4-bit (this module)."""

    dense = "dense"
    int4 = "int4"


LOOKUPS = ("embed_tokens_per_layer", "embed_tokens")  # tables read by row: kept packed as Int4Embedding
# The checkpoint stores the table's scales in float16 and a bf16 run writes bf16 rows, so inductor's
# CPU code generator sees both in one fused lookup and says so. The lookup unpacks in float32, so
# nothing is lost; converting the scales instead would either round the checkpoint's own numbers
# (bf16) or double their bytes (float32), against the point of keeping the table 4-bit.
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node", category=UserWarning)


class Int4Embedding(nn.Module):
    """An embedding whose table stays packed: int32 words [rows, cols/8], scales [rows, cols/32].

    ``forward(ids)`` gives the same values as the dequantized table times ``embed_scale``, in ``dtype``.
    """

    def __init__(self, table: PackedTable, embed_scale: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("packed", table.packed.to(device))
        self.register_buffer("scale", table.scale.to(device))
        self.register_buffer("shifts", torch.arange(0, 32, 4, dtype=torch.int32, device=device))
        self.cols = table.shape[1]
        self.dtype = dtype
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        words, scale = self.packed[ids], self.scale[ids]
        levels = ((words.unsqueeze(-1) >> self.shifts) & 15).to(torch.float32) - 8
        groups = levels.view(*ids.shape, scale.shape[-1], -1) * scale.unsqueeze(-1).to(torch.float32)
        weights = groups.view(*ids.shape, self.cols).to(self.dtype)
        return weights * torch.tensor(self.embed_scale, dtype=self.dtype, device=ids.device)


KERNELS = {
    "cpu": "aten._weight_int4pack_mm_for_cpu",
    "cuda": "aten._weight_int4pack_mm (tinygemm)",
    "tpu": "packed words unpacked in the compiled step",
}


def unsupported(device_kind: str, dtype: torch.dtype) -> str | None:
    """Why int4 linears cannot run here (the cell is skipped, never run dense instead), or None."""
    if device_kind not in KERNELS:
        return f"engine.weights=int4 has no int4 kernel for device {device_kind} (kernels: {', '.join(KERNELS)})"
    if device_kind == "cuda" and dtype != torch.bfloat16:
        return f"engine.weights=int4 on cuda uses tinygemm, which computes in bfloat16; this run's dtype is {dtype}"
    return None


class Int4Linear(nn.Module):
    """``y = x @ w.T`` with ``w`` held 4-bit: [out, in] levels and one scale per 32 inputs."""

    def __init__(self, weight: PackedTable, dtype: torch.dtype, device: torch.device, kind: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kind = kind or device.type  # which kernel (a KERNELS key); tests run the tpu one on a CPU
        if self.kind == "tpu":
            self.register_buffer("words", weight.packed.to(device))
            self.register_buffer("scale", weight.scale.to(device))
            self.register_buffer("shifts", torch.arange(0, 32, 4, dtype=torch.int32, device=device))
            self.dtype = dtype
            return
        levels = unpack_from_int32(weight.packed, 4, torch.Size(weight.shape)).to(torch.int32) + 8  # 0..15
        zeros = torch.zeros_like(weight.scale, dtype=torch.float32)
        scales_and_zeros = torch.stack([weight.scale.float().t(), zeros.t()], dim=-1).to(dtype).contiguous()
        if self.kind == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
        else:
            nibbles = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), 8)
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kind == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros)
        elif self.kind == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(rows, self.packed, GROUP, self.scales_and_zeros)
        else:
            levels = ((self.words.unsqueeze(-1) >> self.shifts) & 15).to(torch.float32) - 8
            grouped = levels.view(self.out_features, -1, GROUP) * self.scale.to(torch.float32).unsqueeze(-1)
            y = F.linear(rows, grouped.view(self.out_features, self.in_features).to(self.dtype))
        return y.view(*x.shape[:-1], self.out_features)


def swap_linears(model: nn.Module, packed: dict[str, PackedTable], dtype: torch.dtype, device: torch.device) -> int:
    """Replaces each packed linear (module path -> its weight) with an ``Int4Linear``; returns how many."""
    for path, weight in packed.items():
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Int4Linear(weight, dtype, device))
    return len(packed)


def swap_lookups(model: nn.Module, packed: dict[str, PackedTable], dtype: torch.dtype, device: torch.device) -> None:
    """Replaces each packed table (module path -> its weight) with an ``Int4Embedding`` of the same scale."""
    for path, table in packed.items():
        parent, _, leaf = path.rpartition(".")
        old = model.get_submodule(path)
        setattr(model.get_submodule(parent), leaf, Int4Embedding(table, old.scalar_embed_scale, dtype, device))
