"""The bytes a decode step's weight products read, counted from the tensors the engine holds for them, in bytes.

A roofline divides these bytes by the machine's read bandwidth, so they must be what the kernels stream, not a count
of weights times an assumed width: the same checkpoint is held as 0.5 + 2/32 bytes a weight by ``int4_rows`` (levels
and the stored scale of each group of 32), 0.5 + 2 x 2 x 2/32 by aten's int4 kernels with float16 scales in a bf16
run (scales and zeros, two parts: ``engines.int4.scale_parts``), 2 by a bf16 ``nn.Linear``. Counted here: every
tensor (parameter or buffer) of every product module, once however many modules share it (a joined product, a tied
``lm_head`` and the table that reads its rows, views into ``engines.held``'s one allocation).
"""

from __future__ import annotations

from torch import nn

from engines.int4 import Int4Linear
from engines.one_row import PackedLinear

PRODUCTS = (nn.Linear, Int4Linear, PackedLinear)  # the modules a decode step's weight products run in


def product_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the tensors ``model``'s products read each decode step: ``lm_head``'s, and every other product's
    (``linears``), each tensor once (by its memory: start and size)."""
    lm_head = model.get_submodule("lm_head")
    counted: set[tuple[int, int]] = set()

    def held(module: nn.Module) -> int:
        total = 0
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            key = (tensor.data_ptr(), tensor.nbytes)
            if key not in counted:
                counted.add(key)
                total += tensor.nbytes
        return total

    head = held(lm_head)
    linears = sum(held(m) for m in model.modules() if isinstance(m, PRODUCTS) and m is not lm_head)
    return {"linears": linears, "lm_head": head}
