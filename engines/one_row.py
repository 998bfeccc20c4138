"""How a dense linear computes one row (a decode step's token): ``engine.one_row``.

A decode step multiplies one activation row by every weight, so its speed is the rate at which the
weights are read. On a CPU, ``F.linear`` of one bf16 row goes through oneDNN's matrix product, while
``torch.mv`` of the same weight and row goes through ATen's matrix-vector kernel: the same products,
accumulated in float32, equal outputs but for a rare last-bit rounding (``tests/test_one_row.py``), read
faster: on a 2-core Xeon with AMX (``make bench-int4``) ``lm_head``, too large for the caches, at 26.6 GB/s
against 21.2, and inside a decode step of e2b-synthetic (``experiment=profile``) the MLP weights at 22.9 GB/s
against 19.8. A prompt piece (more than one row) keeps ``F.linear``.

* ``linear``: ``F.linear`` for every row count (Transformers' own modules, unchanged);
* ``mv``: one row through ``torch.mv``;
* ``auto``: ``mv`` on a CPU, ``linear`` elsewhere (a GPU's BLAS and XLA already treat one row as a
  matrix-vector product).
"""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import nn


class OneRow(StrEnum):
    """Which kernel a dense linear calls on one row."""

    auto = "auto"
    linear = "linear"
    mv = "mv"


def resolve(requested: OneRow, device_kind: str) -> OneRow:
    """``auto`` -> ``mv`` on a CPU, ``linear`` elsewhere; an explicit choice stands."""
    if requested == OneRow.auto:
        return OneRow.mv if device_kind == "cpu" else OneRow.linear
    return requested


@torch.library.custom_op("decodebench::one_row_mv", mutates_args=())
def one_row_mv(weight: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """``torch.mv`` as one opaque operator for a compiled step: TorchInductor would otherwise decompose it into
    a product and a sum and fuse those into its own loops, which on e2b-synthetic read the weights about 3x
    slower than ATen's kernel (a compiled decode step at 1.4 tok/s against 4.1 with ``F.linear``)."""
    return torch.mv(weight, row)


@one_row_mv.register_fake
def _(weight: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return row.new_empty(weight.shape[0])


class RowLinear(nn.Linear):
    """``nn.Linear`` whose one-row call is ``torch.mv`` (its weight, bias and state dict unchanged); inside a
    compiled program, the same kernel as the opaque ``one_row_mv``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        mv = one_row_mv if torch.compiler.is_compiling() else torch.mv
        y = mv(self.weight, x.reshape(-1))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def swap_dense_linears(model: nn.Module) -> int:
    """Makes every plain ``nn.Linear`` of ``model`` a ``RowLinear`` in place (no weight is copied); returns
    how many. Modules of other classes (``Int4Linear``) and linears whose forward a wrapper replaced
    (compressed-tensors' dispatch, hooks) are left as they are."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m)]
    for module in linears:
        module.__class__ = RowLinear
    return len(linears)
