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
* ``rows``: every row count through the project's ``bf16_rows`` (``engines/bf16_cpu.py``; a CPU with AVX-512 BF16,
  bf16 weights): each dense weight repacked once at load into the layout it streams, the original freed; a table
  tied to ``lm_head`` then looks its tokens up in the packed weight, so it is still held once. A decode step's few
  rows read it 1.2-1.9x faster than ``F.linear`` on a 2-core AMD EPYC; a prompt piece of hundreds of rows about half
  as fast (oneDNN's GEMM reuses each loaded row more than it does);
* ``auto``: on a CPU, whichever of these reads the model's own weights fastest for one row on this machine
  (``choose``; ``rows`` where the engine and the CPU take it): each distinct dense weight shape timed every way
  (best of ``TIMED_CALLS``), summed over the linears of that shape, once per CPU model and flags, torch version,
  threads, dtype, ways (and the project's kernel sources and prefetch hint, where ``rows`` is timed) and shapes,
  cached in ``<cache_dir>/one_row/`` and recorded in the evidence; ``linear`` elsewhere (a GPU's BLAS and XLA already
  treat one row as a matrix-vector product). The choice is the machine's: on a 2-core Xeon with AMX ``mv`` read faster
  than ``F.linear``, on a 2-core AMD EPYC (AVX-512, no AMX) ``F.linear`` did (issue 43).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decodebench.environment import cpu_flags, cpu_model
from decodebench.files import measured_once
from engines import bf16_cpu, cpu_kernels
from engines.base import EngineLimit

TIMED_CALLS = 5  # each shape's product timed this many times each way, the best kept


class OneRow(StrEnum):
    """Which kernel a dense linear calls on one row."""

    auto = "auto"
    linear = "linear"
    mv = "mv"
    rows = "rows"


@dataclass(frozen=True)
class Choice:
    """What ``engine.one_row`` resolved to and why: ``how`` is ``set`` (on the command line), ``not a CPU``,
    ``measured`` or ``cached`` (the file); with ``auto`` on a CPU, ``ms``: each way timed, milliseconds for one
    row through every dense linear of the model (the sum of each shape's best call times its count)."""

    one_row: OneRow
    how: str
    ms: dict[str, float] | None = None
    shapes: int | None = None  # distinct dense weight shapes timed

    def record(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, OneRow) else v for k, v in asdict(self).items()}


def dense_linears(model: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear`` modules of ``model`` (not ``Int4Linear``, not a linear whose forward a wrapper
    replaced: compressed-tensors' dispatch, hooks): those whose one-row call ``engine.one_row`` decides."""
    return [m for m in model.modules() if plain_linear(m)]


def plain_linear(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass, not ``Int4Linear``) whose forward no wrapper replaced."""
    return type(module) is nn.Linear and "forward" not in vars(module)


def best_ms(fn: Any) -> float:
    """The fastest of ``TIMED_CALLS`` calls of ``fn`` in milliseconds, after one untimed call."""
    fn()
    times = []
    for _ in range(TIMED_CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def rows_refused(requested: OneRow, device_kind: str, dtype: torch.dtype) -> str | None:
    """Why ``engine.one_row=rows`` cannot run on this device and dtype (the cell is skipped), or None (also for
    any other choice)."""
    if requested != OneRow.rows:
        return None
    if device_kind != "cpu":
        return f"engine.one_row=rows is a CPU kernel ({bf16_cpu.OP}); this device is {device_kind}"
    if reason := bf16_cpu.unsupported(dtype):
        return f"engine.one_row=rows: {bf16_cpu.OP} cannot run here: {reason}"
    return None


def rows_unsupported(weights: list[torch.Tensor]) -> str | None:
    """Why ``bf16_rows`` cannot compute these weights here, or None."""
    for w in weights:
        if w.device.type != "cpu":
            return f"it runs on a CPU, these weights are on {w.device.type}"
        if reason := bf16_cpu.unsupported(w.dtype, w.shape[1]):
            return reason
    return None


def one_row_call(way: OneRow, weight: torch.Tensor) -> Any:
    """A function that multiplies one random row by ``weight`` the ``way`` says (``rows``: packed first, untimed)."""
    row = torch.randn(weight.shape[1], dtype=weight.dtype, device=weight.device)
    if way == OneRow.linear:
        return lambda: F.linear(row[None], weight)
    if way == OneRow.mv:
        return lambda: torch.mv(weight, row)
    packed = bf16_cpu.pack(weight)
    return lambda: bf16_cpu.rows(row[None], packed, weight.shape[0])


def choose(requested: OneRow, device_kind: str, weights: list[torch.Tensor], cache_dir: str | Path | None) -> Choice:
    """``engine.one_row`` resolved for ``weights`` (the model's dense linear weights): an explicit choice stands;
    ``auto`` is ``linear`` off a CPU, and on a CPU the fastest way (``rows`` only where ``bf16_rows`` runs these
    weights) over these weights on this machine, measured once and cached (``cache_dir`` None: measured every
    time)."""
    if requested != OneRow.auto:
        return Choice(requested, "set")
    if device_kind != "cpu" or not weights:
        return Choice(OneRow.linear, "not a CPU" if device_kind != "cpu" else "no dense linear")
    timed = [w for w in OneRow if w != OneRow.auto and (w != OneRow.rows or rows_unsupported(weights) is None)]
    counts = Counter((tuple(w.shape), str(w.dtype)) for w in weights)
    key = {"cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "ways": [str(w) for w in timed],
           "kernels": [cpu_kernels.loaded_digest(), cpu_kernels.prefetch_hint()] if OneRow.rows in timed else None,
           "shapes": sorted([list(shape), dtype, n] for (shape, dtype), n in counts.items())}  # fmt: skip

    def fastest() -> dict[str, Any]:
        first = {}
        for w in weights:
            first.setdefault((tuple(w.shape), str(w.dtype)), w)
        ms = dict.fromkeys(map(str, timed), 0.0)
        with torch.inference_mode():
            for shape, n in counts.items():
                for way in timed:
                    ms[str(way)] += n * best_ms(one_row_call(way, first[shape]))
        return {"one_row": min(ms, key=ms.get), "ms": ms}

    folder = Path(cache_dir) / "one_row" if cache_dir is not None else None
    kept, how = measured_once(folder, key, fastest)
    return Choice(OneRow(kept["one_row"]), how, kept["ms"], len(counts))


def choose_for(model: nn.Module, requested: OneRow, device_kind: str, cache_dir: str | Path | None) -> Choice:
    """``choose`` over ``model``'s dense linear weights (``dense_linears``), holding no reference to them after, so
    that ``rows`` frees each original weight as soon as it is packed."""
    return choose(requested, device_kind, [m.weight for m in dense_linears(model)], cache_dir)


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
    """Makes every plain ``nn.Linear`` of ``model`` (``dense_linears``) a ``RowLinear`` in place (no weight is
    copied); returns how many."""
    linears = dense_linears(model)
    for module in linears:
        module.__class__ = RowLinear
    return len(linears)


class PackedLinear(nn.Module):
    """A dense linear without a bias computed by ``bf16_rows`` from its weight packed once (``bf16_cpu.pack``);
    ``kernel`` names the operator, as ``Int4Linear``'s does."""

    kernel = bf16_cpu.OP

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if reason := rows_unsupported([linear.weight]):
            raise EngineLimit(f"engine.one_row=rows: {bf16_cpu.OP} cannot compute this weight here: {reason}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", bf16_cpu.pack(linear.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = bf16_cpu.rows(x.reshape(-1, self.in_features), self.packed, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


class PackedEmbedding(nn.Module):
    """A table tied to a ``PackedLinear``'s weight, its tokens' rows read from the packed layout times
    ``embed_scale`` (Gemma's scaled embedding: the same values as the table it replaces)."""

    def __init__(self, linear: PackedLinear, embed_scale: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = bf16_cpu.row_of(self.linear.packed, ids)
        return rows * self.embed_scale.to(rows.dtype)


def pack_dense_linears(model: nn.Module) -> int:
    """Makes every plain ``nn.Linear`` of ``model`` (``dense_linears``) without a bias a ``PackedLinear``, one at a
    time (each original weight freed once packed, unless a table shares it: that table becomes a ``PackedEmbedding``
    of the packed weight); returns how many. A linear with a bias (none in Gemma 4) keeps ``F.linear``, which adds it
    before the one rounding to the run's dtype."""
    linears = {id(m) for m in dense_linears(model) if m.bias is None}
    paths = [path for path, m in model.named_modules() if id(m) in linears]  # paths, not modules: none kept alive
    tables = {m.weight.data_ptr(): path for path, m in model.named_modules() if isinstance(m, nn.Embedding)}
    for path in paths:
        parent, _, leaf = path.rpartition(".")
        module = model.get_submodule(path)
        packed = PackedLinear(module)
        setattr(model.get_submodule(parent), leaf, packed)
        if (table_path := tables.pop(module.weight.data_ptr(), None)) is not None:
            table = model.get_submodule(table_path)
            scale = getattr(table, "embed_scale", torch.tensor(1.0))
            table_parent, _, table_leaf = table_path.rpartition(".")
            setattr(model.get_submodule(table_parent), table_leaf, PackedEmbedding(packed, scale))
            del table
        del module  # the last reference to the original weight: freed before the next one is packed
    return len(paths)
