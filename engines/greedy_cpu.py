"""The greedy token of each row of logits: ``decodebench_pick::first_max`` (``csrc/first_max.cpp``, built with
``engines.cpu_kernels``) on a CPU that runs the project's kernels, aten's argmax elsewhere. Both give the same index to
the bit (the first of the largest values, a NaN the largest); aten's reduces a row on one thread, a value at a time:
over E2B's 262,144 bf16 logits ~850 us before every token on the 2-core Xeon with AMX, against ~16 us for
``first_max`` (both threads, 16 values a vector). The stepping engines call it inside their compiled steps (one opaque
operator) and the Rust engine through its shim; the evidence names which ran (``greedy``).
"""

from __future__ import annotations

import torch

from engines.cpu_kernels import missing

OP = "decodebench_pick.first_max"  # the operator's name as it is dispatched (and as the evidence names it)
ATEN = "aten.argmax"


def choose(device_kind: str, dtype: torch.dtype) -> str:
    """``OP`` where it runs here (a CPU, bf16 or float32 logits, the kernels built), else ``ATEN``."""
    runs = device_kind == "cpu" and dtype in (torch.bfloat16, torch.float32) and missing() is None
    return OP if runs else ATEN


def pick(logits: torch.Tensor, kernel: str) -> torch.Tensor:
    """[B, V] logits -> [B, 1] token ids, on their device, with ``kernel`` (``OP`` or ``ATEN``)."""
    if kernel == OP:
        return torch.ops.decodebench_pick.first_max(logits)
    return logits.argmax(-1, keepdim=True)
