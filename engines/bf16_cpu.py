"""The project's own bf16 product for a CPU with AVX-512 BF16: ``decodebench_bf16::bf16_rows`` (``csrc/bf16_rows.cpp``,
built with ``engines.cpu_kernels``), what ``engine.one_row=rows`` computes every dense linear with.

``pack`` lays a [out, in] bf16 weight out once, at load, in tiles of 16 outputs, each pair of inputs of a tile in
64 bytes ([tiles, in / 2, 16, 2]); ``rows`` computes ``x @ w.T`` for bf16 rows from it, summing the bf16 products
in float32 and rounding each output to bf16 once (what ``F.linear`` and ``torch.mv`` compute, up to the order of
the float32 sums). ``row_of`` reads rows of the weight back from the packed layout: a tied embedding looks its
tokens up there, so the table is held once.

On a 2-core AMD EPYC (Zen 5, AVX-512 BF16, no AMX), both cores sharing the tiles, one row of each E2B shape over
cold copies (``make bench-int4``, medians): 30-73 GB/s of the weight (67-73 on the MLP shapes, 53 on ``lm_head``),
against ``F.linear``'s 13-32 and ``torch.mv``'s 11-23; from the caches, eight rows 0.70-0.91 TFLOP/s and 64 rows
0.97-1.05, where oneDNN's GEMM (``F.linear``) reaches 0.77-0.90 at 64.
"""

from __future__ import annotations

import torch

from engines.cpu_kernels import missing

OP = "decodebench_bf16.bf16_rows"  # the operator's name as it is dispatched (and as the evidence names it)
TILE = 16  # outputs per tile (csrc/rows.h)


def unsupported(dtype: torch.dtype, in_features: int | None = None) -> str | None:
    """Why ``bf16_rows`` cannot compute a weight of ``in_features`` inputs (any, when None) in ``dtype`` here, or
    None."""
    if dtype != torch.bfloat16:
        return f"it computes bf16 weights and activations, this run's are {dtype}"
    if in_features is not None and in_features % 8:
        return f"it takes a multiple of 8 inputs, this weight has {in_features}"
    return missing()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as the operator reads it: [tiles, in / 2, 16, 2], the last tile padded with zeros."""
    out, inputs = weight.shape
    tiles = -(-out // TILE)
    packed = torch.empty(tiles, inputs // 2, TILE, 2, dtype=weight.dtype, device=weight.device)
    whole = out // TILE
    packed[:whole] = weight[: whole * TILE].view(whole, TILE, inputs // 2, 2).transpose(1, 2)
    if whole < tiles:
        last = torch.zeros(TILE, inputs, dtype=weight.dtype, device=weight.device)
        last[: out - whole * TILE] = weight[whole * TILE :]
        packed[whole] = last.view(TILE, inputs // 2, 2).transpose(0, 1)
    return packed


def rows(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x`` [rows, in] bf16 times the packed weight: [rows, out_features] bf16."""
    return torch.ops.decodebench_bf16.bf16_rows(x, packed, out_features)


def row_of(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the weight ``packed`` holds: [*ids.shape, in]."""
    picked = packed[ids.reshape(-1) // TILE, :, ids.reshape(-1) % TILE]  # [n, in / 2, 2]
    return picked.reshape(*ids.shape, -1)
