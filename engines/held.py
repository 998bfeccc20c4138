"""The 4-bit weights a decode step streams (``int4_rows``' words and scales) moved into one allocation, in the order the
step reads them (the model's module order: each layer's attention, MLP and per-layer products, then ``lm_head``).

Held apart, each weight is an allocation of its own: one under 2 MiB (E2B's sliding-layer attention projections and
per-layer products) in 4 KiB pages (torch's allocator asks for huge pages from 2 MiB up: ``decodebench/pages.py``),
and a step's reads jump from one allocation to the next. Measured on the 2-core KVM Xeon with AMX (streaming read
34 GB/s in 2 MiB pages), a scratch script outside the repository calling one step's 212 ``int4_rows`` products in
sequence (E2B's shapes, random levels, one row, two threads), the two holdings alternated seven rounds in one process:
apart 24.8-25.1 GB/s at best (median rounds 54.1-56.2 ms a step), together 27.2-28.1 (47.7-50.4 ms), two runs. Only a
CPU product reads them so; another device's kernels keep their own tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

import torch
from torch import nn

from engines import int4_cpu
from engines.int4 import Int4Linear

ALIGN = 64  # bytes: each tensor starts on a cache line of its own
HELD = ("words", "scales")  # an int4_rows linear's buffers, in the order its kernel reads them


def streamed(model: nn.Module) -> list[Int4Linear]:
    """``model``'s ``int4_rows`` linears, each once, in module order."""
    return [m for m in model.modules() if isinstance(m, Int4Linear) and m.kernel == int4_cpu.OP]


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """The C library's ``malloc_trim`` (glibc), or None where it has none. A weight under the allocator's mapping
    threshold comes from the C heap, and freeing it keeps its pages in the process until they are trimmed: without
    it the e2b-synthetic int4 ring's resident set after load (``memory_after_load``, VmRSS) was 716 MiB above its
    weights held apart (3,994 MiB against 3,278); with it 2,954 MiB, and its peak (``memory_peak_rss``, VmHWM) 3,279
    MiB against 3,399 apart (the trim gives back other freed pages too)."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def hold_together(model: nn.Module) -> int:
    """Moves the words and scales of every ``int4_rows`` linear of ``model`` into one allocation, in module order, each
    starting on a 64-byte line (the module's buffers become views of it, values unchanged); each old buffer is freed
    and its pages given back (``malloc_trim``) once copied, so the process holds one more weight at most meanwhile.
    Returns the allocation's bytes (0: none)."""
    linears = streamed(model)
    if not linears:
        return 0
    tensors = [getattr(m, name) for m in linears for name in HELD]
    starts = [0]
    for t in tensors:
        starts.append(starts[-1] + -(-t.nbytes // ALIGN) * ALIGN)
    together = torch.empty(starts[-1], dtype=torch.uint8, device=tensors[0].device)
    del tensors
    at, trim = iter(starts), malloc_trim()
    for m in linears:
        for name in HELD:
            old, start = getattr(m, name), next(at)
            view = together[start : start + old.nbytes].view(old.dtype).view(old.shape)
            view.copy_(old)
            setattr(m, name, view)
            del old
            if trim is not None:
                trim(0)
    return together.nbytes
