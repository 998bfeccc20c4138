"""Which cache level the project's CPU kernels prefetch into on this machine: timed once on cold weights, cached.

The row kernels (``int4_rows``, ``bf16_rows``) and the roofline's stream read each read their bytes once, front to
back, asking the cache for the bytes 16 KiB ahead (``csrc/rows.h``). Which hint serves them best is the CPU's, not its
vendor's: non-temporal (``nta``) was faster on a Zen 5 EPYC, starved both kernels on a Xeon with AMX, and on a Zen 4
EPYC left the int4 product at 28.5 GB/s where T0 with T1 further ahead (``t0+t1``) read 36.2 (``csrc/rows.h`` has the
figures). So once the library is loaded (``engines.cpu_kernels``), ``choose`` times both on this machine: one row
through each kernel over cold copies of E2B's MLP weight (``SHAPE``: int4 in three limbs, and bf16; for each kernel
the bytes the roofline's streaming read covers, ``decodebench.device.read_bytes``), the hints taking
turns for ``ROUNDS`` rounds, each hint's median round kept; the faster is set for every kernel of the process. The
choice is cached per CPU model and flags, torch version, threads and kernel sources (``key``) and recorded in each
way's evidence (``cpu_kernel_prefetch_choice``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from decodebench.device import read_bytes
from decodebench.environment import cpu_flags, cpu_model
from decodebench.files import measured_once

HINTS = ("nta", "t0+t1")  # the names csrc/rows.h gives its hints
SHAPE = (12288, 1536)  # outputs, inputs: E2B's MLP gate and up of one layer, joined
GROUP = 32  # inputs a scale of the int4 copies (E2B's)
TILE = 16  # outputs a tile of both kernels' layouts
ROUNDS = 7  # each hint timed this many times, the median kept


@dataclass(frozen=True)
class Choice:
    """The hint the kernels prefetch with, how it was reached (``measured``, ``cached (<path>)``) and each hint's
    median round in milliseconds: one row through ``int4_rows`` and one through ``bf16_rows`` over all their cold
    copies."""

    hint: str
    how: str
    ms: dict[str, float]

    def record(self) -> dict[str, Any]:
        return asdict(self)


def key(kernels: str, threads: int) -> dict[str, Any]:
    """What a cached choice holds for: this CPU, torch, the threads the kernels share a product among and the digest
    of the kernels' sources."""
    return {"cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__, "threads": threads,
            "kernels": kernels}  # fmt: skip


def cold_passes() -> Callable[[], None]:
    """One row through ``int4_rows`` (three limbs) and through ``bf16_rows`` over copies of ``SHAPE``, for each kernel
    the bytes a streaming read covers (``read_bytes``: 256 MiB, at least four times the last-level cache), laid out as
    their packing lays a weight out (random levels and values: the rate does not depend on them). The layouts' shapes
    are written here, not packed by ``int4_cpu`` and ``bf16_cpu``: those import the library's loader, which imports
    this module; the operators check every shape."""
    out, inputs = SHAPE
    tiles = out // TILE
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**15), 2**15, (tiles, inputs // 8, 32), dtype=torch.int16, generator=generator)
    scales = torch.rand(tiles, inputs // GROUP, TILE, generator=generator).to(torch.float16)
    packed = torch.randn(tiles, inputs // 2, TILE, 2, generator=generator).to(torch.bfloat16)
    cold = read_bytes("cpu")
    int4 = [(words.clone(), scales.clone()) for _ in range(max(1, cold // (words.nbytes + scales.nbytes)))]
    bf16 = [packed.clone() for _ in range(max(1, cold // packed.nbytes))]
    x = torch.randn(1, inputs, generator=generator).to(torch.bfloat16)

    def passes() -> None:
        for w, s in int4:
            torch.ops.decodebench_int4.int4_rows(x, w, s, GROUP, out, 3)
        for p in bf16:
            torch.ops.decodebench_bf16.bf16_rows(x, p, out)

    return passes


def measure(passes: Callable[[], None]) -> dict[str, float]:
    """Each hint's median of ``ROUNDS`` timed ``passes`` (ms), after one untimed pass each; the hints take turns,
    the first of a round alternating, so that a machine whose read changes over the rounds weighs on both alike."""
    times: dict[str, list[float]] = {hint: [] for hint in HINTS}
    for hint in HINTS:
        torch.ops.decodebench_int4.use_prefetch_hint(hint)
        passes()
    for round_ in range(ROUNDS):
        for hint in HINTS if round_ % 2 == 0 else HINTS[::-1]:
            torch.ops.decodebench_int4.use_prefetch_hint(hint)
            start = time.perf_counter()
            passes()
            times[hint].append(1e3 * (time.perf_counter() - start))
    return {hint: statistics.median(t) for hint, t in times.items()}


def choose(cache: Path | None, held: dict[str, Any], timed: Callable[[], dict[str, float]] | None = None) -> Choice:
    """The faster hint on this machine, read from ``cache`` where a choice for ``held`` (``key``) is there, else
    measured (``timed``: ``measure`` over ``cold_passes``) and written there (``cache`` None: measured every time);
    set for every kernel of the process either way."""

    def fastest() -> dict[str, Any]:
        with torch.inference_mode():
            ms = timed() if timed is not None else measure(cold_passes())
        return {"hint": min(ms, key=ms.get), "ms": ms}

    kept, how = measured_once(cache, held, fastest)
    choice = Choice(kept["hint"], how, kept["ms"])
    torch.ops.decodebench_int4.use_prefetch_hint(choice.hint)
    return choice
