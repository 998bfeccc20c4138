"""Experiment ``modes``: the device's execution modes on a stack of matrix multiplies, no model
(article 003, Step 2 and the Tip after it).

The step: ``layers`` products x <- x @ W_i of square [n, n] matrices in the run's dtype (seeded
inputs, W_i scaled by 1/sqrt(n) so values stay near 1). n is the multiple of 128 nearest to
(work / (2 layers))^(1/3), where work is ``gflop`` GFLOP divided by ``cpu_work_divisor`` on a CPU;
the FLOP a step actually does (2 n^3 a product) is recorded and used.

Modes, each over the same inputs on the device:
* ``eager``: strict eager (TorchTPU's DEFER_NEVER on a TPU, PyTorch's eager elsewhere).
* ``fuse``: TorchTPU's defer-and-fuse (a TPU; elsewhere ``skipped`` with the reason).
* ``compile``: ``torch.compile(dynamic=False)`` with ``experiment.backend`` (auto: tpu on a TPU,
  inductor elsewhere).
For each: ``first_call_s`` (compile or fusion included), ``step_ms`` (``steps`` warm steps; median),
``tflop_s`` = FLOP per step / median step, ``checksum`` (the float32 sum of the step's output) and
its absolute difference from eager's, and ``vs_eager_step`` = eager's median step / this mode's.

Compile-count probe: a row-wise function, relu(x @ A) @ B of width ``probe_width``, compiled with
``dynamic=False`` and called at each of ``lengths`` rows, raw and padded with zero rows up to a
multiple of ``bucket``: programs compiled (TorchDynamo's ``unique_graphs``), first and second pass ms
per length, and the largest difference between the padded results (cut back to their rows) and the
raw ones.

Host read: ``read_steps`` steps of the stack, each followed by ``.item()`` of its output's sum,
against the same steps with each sum kept on the device and all read once at the end; ratio = with /
without, once per ``repeats``, after one untimed call of each. Under defer-and-fuse on a TPU (the
article's case), eager elsewhere.

Timer boundaries: every call or loop is timed between two ``device.sync()`` calls, wall clock.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from decodebench.config import ConfigError, ExperimentConfig, at_least, positive
from decodebench.device import Device, tpu_eager_mode
from decodebench.evidence import Record, samples, scalar
from engines.stepping import compile_backend, graph_counts
from experiments.cell import Cell, timed
from experiments.common import Result

GRAPHS = "torch._dynamo counters stats.unique_graphs"
ALIGN = 128  # the stack's side is a multiple of this (a TPU's matrix unit is 128 x 128)
FUNCTION = "relu(x @ A) @ B"  # the compile-count probe's function: each row on its own, so padding rows changes none


@dataclass
class ModesExperimentConfig(ExperimentConfig):
    """The device's execution modes on a stack of matrix multiplies; no model (article 003, Step 2 and its Tip).

    The stack is ``layers`` products of square matrices whose side is chosen so that one step does
    ``gflop`` GFLOP (the article's 275), divided by ``cpu_work_divisor`` on a CPU. ``steps``: timed warm
    steps per mode (median). The compile-count probe runs a row-wise function of width ``probe_width``
    at each of ``lengths`` rows, raw and padded up to a multiple of ``bucket``. The host-read probe runs
    ``read_steps`` steps with one ``.item()`` after each, and without. ``backend``: as ``engine.backend``.
    """

    gflop: float = 275.0
    layers: int = 16
    cpu_work_divisor: int = 512
    steps: int = 10
    lengths: list[int] = field(default_factory=lambda: [37, 64, 100, 200])
    bucket: int = 128
    probe_width: int = 512
    read_steps: int = 20
    backend: str = "auto"

    def __post_init__(self) -> None:
        at_least("experiment.", self, 1, "layers", "cpu_work_divisor", "steps", "bucket", "probe_width", "read_steps")
        positive("experiment.", self, "gflop")
        if not self.lengths or min(self.lengths) < 1:
            raise ConfigError(f"experiment.lengths={list(self.lengths)} must be one or more positive row counts")


def headline(record: Record) -> str:
    """The cell's one line: each mode's warm step and the compile-count probe's summary."""
    ran = [m["mode"] for m in record.outputs["modes"] if m["status"] == "ok"]
    steps = ", ".join(f"{mode} {record.value(f'modes_{mode}_step_ms'):.2f} ms" for mode in ran)
    return f"modes: step {steps}; {record.outputs['compile_count']['summary']}"


@dataclass(frozen=True)
class Stack:
    """``layers`` products of [size, size] matrices."""

    size: int
    layers: int

    @property
    def flop(self) -> int:
        return 2 * self.layers * self.size**3


def stack_for(experiment: Any, device_kind: str) -> Stack:
    """The stack doing ``gflop`` GFLOP a step (divided by ``cpu_work_divisor`` on a CPU), side rounded to ``ALIGN``."""
    work = experiment.gflop * 1e9 / (experiment.cpu_work_divisor if device_kind == "cpu" else 1)
    side = (work / (2 * experiment.layers)) ** (1 / 3)
    return Stack(max(ALIGN, ALIGN * round(side / ALIGN)), experiment.layers)


def matmul_stack(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    for w in weights:
        x = x @ w
    return x


def rowwise(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ a) @ b


def seeded(
    shape: tuple[int, ...], generator: torch.Generator, device: Device, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    """Standard normal values times ``scale``, drawn on the host from ``generator``, then moved."""
    return (torch.randn(shape, generator=generator) * scale).to(device.torch_device, dtype)


def eager_mode(mode: str, device: Device) -> contextlib.AbstractContextManager:
    """The TorchTPU eager mode a mode runs under on a TPU; nothing elsewhere (``compile`` keeps the default)."""
    if device.kind != "tpu" or mode == "compile":
        return contextlib.nullcontext()
    return tpu_eager_mode(mode)


def unsupported(mode: str, device: Device) -> str | None:
    if mode == "fuse" and device.kind != "tpu":
        return (
            "defer-and-fuse is TorchTPU's eager mode (torch.tpu.EagerMode.DEFER_AND_FUSE) and needs a TPU; "
            f"this device is {device.kind}"
        )
    return None


def run_modes(cell: Cell, stack: Stack, backend: str, result: Result) -> None:
    """Each mode's first call, warm steps, TFLOP/s and checksum against eager's."""
    device, steps = cell.device, cell.cfg.experiment.steps
    g = torch.Generator().manual_seed(cell.cfg.seed)
    dtype = cell.cfg.dtype.torch
    x = seeded((stack.size, stack.size), g, device, dtype)
    weights = [seeded((stack.size, stack.size), g, device, dtype, stack.size**-0.5) for _ in range(stack.layers)]
    functions: dict[str, Callable] = {
        "eager": matmul_stack,
        "fuse": matmul_stack,
        "compile": torch.compile(matmul_stack, backend=backend, dynamic=False),
    }
    outcomes, checksums = [], {}
    for mode, fn in functions.items():
        reason = unsupported(mode, device)
        if reason:
            outcomes.append({"mode": mode, "status": "skipped", "reason": reason})
            continue
        with eager_mode(mode, device):
            out, first_s = timed(device, lambda fn=fn: fn(x, weights))
            step_s = [timed(device, lambda fn=fn: fn(x, weights))[1] for _ in range(steps)]
            checksums[mode] = float(out.float().sum())
        median_s = statistics.median(step_s)
        key = f"modes_{mode}"
        result.measurements.update(
            {
                f"{key}_first_call_s": scalar(first_s, "s"),
                f"{key}_step_ms": samples([s * 1e3 for s in step_s], "ms"),
                f"{key}_tflop_s": scalar(stack.flop / median_s / 1e12, "TFLOP/s", formula="FLOP a step / median step"),
                f"{key}_checksum": scalar(checksums[mode], "value", method="float32 sum of the step's output"),
            }
        )
        if mode != "eager" and "eager" in checksums:
            diff = abs(checksums[mode] - checksums["eager"])
            eager_ms = result.measurements["modes_eager_step_ms"].central
            result.measurements[f"{key}_checksum_diff"] = scalar(diff, "value", formula=f"|{mode} - eager|")
            result.measurements[f"{key}_vs_eager_step"] = scalar(
                eager_ms / (median_s * 1e3), "x", formula=f"median eager step / median {mode} step"
            )
        result.samples[f"{key}_step_ms"] = [s * 1e3 for s in step_s]
        how = {"eager": "strict eager", "fuse": "defer-and-fuse", "compile": f"torch.compile backend={backend}"}[mode]
        outcomes.append({"mode": mode, "status": "ok", "how": how})
    result.outputs["modes"] = outcomes


def compile_pass(
    device: Device, backend: str, rows: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor, bucket: int | None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One probe: a fresh compiled function called twice at each length (padded up to ``bucket`` rows
    when given); the programs it compiled, both passes' ms, and each length's result cut to its rows."""
    torch._dynamo.reset()
    before = graph_counts()["graphs"]
    fn = torch.compile(rowwise, backend=backend, dynamic=False)
    fed = [
        torch.nn.functional.pad(x, (0, 0, 0, bucket * math.ceil(len(x) / bucket) - len(x))) if bucket else x
        for x in rows
    ]
    passes: list[list[float]] = [[], []]
    outs = []
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, len(fed))):
        for ms in passes:
            for x, padded in zip(rows, fed, strict=True):
                out, seconds = timed(device, lambda padded=padded: fn(padded, a, b))
                ms.append(seconds * 1e3)
                if len(outs) < len(rows):
                    outs.append(out[: len(x)])
    probe = {
        "lengths": [len(x) for x in fed],
        "graphs": graph_counts()["graphs"] - before,
        "first_pass_ms": passes[0],
        "second_pass_ms": passes[1],
    }
    return probe, outs


def run_compile_count(cell: Cell, backend: str, result: Result) -> None:
    """The Tip after Step 2: programs compiled at four lengths, raw against padded to buckets."""
    exp, device, dtype = cell.cfg.experiment, cell.device, cell.cfg.dtype.torch
    g = torch.Generator().manual_seed(cell.cfg.seed)
    width = exp.probe_width
    a = seeded((width, width), g, device, dtype, width**-0.5)
    b = seeded((width, width), g, device, dtype, width**-0.5)
    rows = [seeded((n, width), g, device, dtype) for n in exp.lengths]
    raw, raw_outs = compile_pass(device, backend, rows, a, b, None)
    bucketed, bucketed_outs = compile_pass(device, backend, rows, a, b, exp.bucket)
    difference = max(float((p.float() - r.float()).abs().max()) for p, r in zip(bucketed_outs, raw_outs, strict=True))
    torch._dynamo.reset()
    result.outputs["compile_count"] = {
        "function": FUNCTION,
        "width": width,
        "bucket": exp.bucket,
        "backend": backend,
        "raw": raw,
        "bucketed": bucketed,
        "max_difference": difference,
        "summary": f"{raw['graphs']} programs raw, {bucketed['graphs']} bucketed",
    }
    result.measurements.update(
        compile_raw_graphs=scalar(raw["graphs"], "count", counter=GRAPHS),
        compile_bucketed_graphs=scalar(bucketed["graphs"], "count", counter=GRAPHS),
        compile_max_difference=scalar(difference, "value", formula="max |padded result cut to its rows - raw result|"),
    )


def run_host_read(cell: Cell, stack: Stack, result: Result) -> None:
    """``.item()`` after every step against one read at the end: the ratio of the two loops' seconds."""
    device, dtype, k = cell.device, cell.cfg.dtype.torch, cell.cfg.experiment.read_steps
    g = torch.Generator().manual_seed(cell.cfg.seed)
    x = seeded((stack.size, stack.size), g, device, dtype)
    weights = [seeded((stack.size, stack.size), g, device, dtype, stack.size**-0.5) for _ in range(stack.layers)]
    mode = "fuse" if device.kind == "tpu" else "eager"

    def each_step() -> list[float]:
        return [matmul_stack(x, weights).sum().item() for _ in range(k)]

    def at_end() -> list[float]:
        return torch.stack([matmul_stack(x, weights).sum() for _ in range(k)]).tolist()

    each_s, end_s = [], []
    with eager_mode(mode, device):
        each_step()  # untimed: pays any first-use compile of either loop
        at_end()
        for _ in range(cell.cfg.repeats):
            each_s.append(timed(device, each_step)[1])
            end_s.append(timed(device, at_end)[1])
    ratios = [e / n for e, n in zip(each_s, end_s, strict=True)]
    result.outputs["host_read"] = {"mode": mode, "steps": k, "each_step_s": each_s, "at_end_s": end_s}
    result.measurements["host_read_ratio"] = samples(
        ratios, "x", formula=f"seconds of {k} steps with .item() after each / with one read at the end", mode=mode
    )
    result.samples["host_read_ratio"] = ratios


def run(cell: Cell) -> Result:
    exp, device = cell.cfg.experiment, cell.device
    backend = compile_backend(exp.backend, device)
    if backend is None:
        raise ConfigError("experiment.backend=none: the modes experiment compares compiling with not compiling")
    stack = stack_for(exp, device.kind)
    result = Result(
        timers={
            "first_call_s": "the first call of a mode, compile or fusion included, device.sync() before and after",
            "step_ms": "one warm call, device.sync() before and after; median of experiment.steps",
            "compile_first_pass_ms": "each length's first call (a compile when the shape is new), synced",
            "host_read": "the whole loop of experiment.read_steps steps, device.sync() before and after",
        }
    )
    result.measurements["modes_work_gflop"] = scalar(
        stack.flop / 1e9, "GFLOP", size=stack.size, layers=stack.layers, formula="2 x layers x size^3"
    )
    with torch.inference_mode():
        run_modes(cell, stack, backend, result)
        run_compile_count(cell, backend, result)
        run_host_read(cell, stack, result)
    return result
