"""The device layer: which device a run uses, how to wait for it, and what its memory counters say.

Selection: ``auto`` is tpu when torch_tpu is installed and ``torch.accelerator`` reports a TPU, else
cuda when CUDA is available, else cpu.  A named kind that is absent fails with the reason.
Every memory reading carries the name of the counter it came from.

A JAX engine's cells get a ``JaxDevice``: the same interface over JAX's own device (selected by the
same rule from the platforms JAX sees), its ``memory_stats()`` where the device keeps them (TPU,
GPU) and the process resident set on a CPU. One framework owns an accelerator per process
(``claim``): on a TPU, torch_tpu and JAX cannot both hold the chip, so the second one to ask is
refused with the reason and the way out (a process per cell: ``hydra/launcher=isolated``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from decodebench.evidence import MemoryReading


class DeviceUnavailable(RuntimeError):
    """The requested device kind does not exist on this machine."""


class DeviceHeld(RuntimeError):
    """Another framework in this process already holds the accelerator (the cell is ``skipped``)."""


ACCELERATOR_OWNERS: dict[str, str] = {}  # device kind -> the framework that first took it in this process


def claim(kind: str, framework: str, owners: dict[str, str] = ACCELERATOR_OWNERS) -> None:
    """Records that ``framework`` uses the ``kind`` accelerator in this process; refuses a second framework
    (a CPU is shared freely)."""
    if kind == "cpu":
        return
    owner = owners.setdefault(kind, framework)
    if owner != framework:
        raise DeviceHeld(
            f"{owner} already holds the {kind} in this process and {framework} cannot share it; run each cell "
            "in a process of its own: python run.py -m hydra/launcher=isolated ..."
        )


def tpu_present() -> bool:
    """True when torch_tpu is installed and the accelerator PyTorch sees is a TPU.

    Never calls ``torch.tpu.is_available()``: torch_tpu 0.2.0 raises there (shared/notes).
    """
    if importlib.util.find_spec("torch_tpu") is None:
        return False
    import torch_tpu  # noqa: F401  (registers the 'tpu' device when autoload is off)

    if not torch.accelerator.is_available():
        return False
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu"


def cuda_present() -> bool:
    return torch.cuda.is_available()


def select_kind(requested: str, *, has_tpu: bool, has_cuda: bool) -> str:
    """The selection rule, separate from probing so it can be tested anywhere (``requested`` is a
    ``DeviceKind``: composition has already refused any other value)."""
    if requested == "auto":
        return "tpu" if has_tpu else "cuda" if has_cuda else "cpu"
    if requested == "tpu" and not has_tpu:
        raise DeviceUnavailable(
            "device.kind=tpu but no TPU is visible: torch_tpu is not installed (pip install '.[tpu]') "
            "or torch.accelerator reports no TPU"
        )
    if requested == "cuda" and not has_cuda:
        raise DeviceUnavailable("device.kind=cuda but torch.cuda.is_available() is False")
    return requested


@dataclass(frozen=True)
class Device:
    """A resolved device: its torch device, a name for humans, sync and memory counters."""

    kind: str
    torch_device: torch.device
    name: str

    def sync(self) -> None:
        """Waits for all queued work; called at every timer boundary."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch_device)
        elif self.kind == "tpu":
            torch.tpu.synchronize()

    @property
    def peak_resets(self) -> bool:
        """Whether ``reset_peak`` starts a new window for ``peak_memory`` (a JAX accelerator's counts from process
        start)."""
        return True

    def reset_peak(self) -> None:
        """Starts a new peak window for ``peak_memory``."""
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.torch_device)
        elif self.kind == "tpu":
            torch.accelerator.reset_peak_memory_stats()
        else:
            _reset_rss_peak()

    def memory_now(self) -> MemoryReading:
        if self.kind == "cuda":
            return MemoryReading(torch.cuda.memory_allocated(self.torch_device), "torch.cuda.memory_allocated")
        if self.kind == "tpu":
            return MemoryReading(torch.accelerator.memory_allocated(), "torch.accelerator.memory_allocated (TPU HBM)")
        return MemoryReading(_status_kib("VmRSS") * 1024, "/proc/self/status VmRSS (process resident set)")

    def peak_memory(self) -> dict[str, MemoryReading]:
        """Peaks since the last ``reset_peak``: every counter the device offers."""
        if self.kind == "cuda":
            return {
                "allocated": MemoryReading(
                    torch.cuda.max_memory_allocated(self.torch_device), "torch.cuda.max_memory_allocated"
                ),
                "reserved": MemoryReading(
                    torch.cuda.max_memory_reserved(self.torch_device), "torch.cuda.max_memory_reserved"
                ),
            }
        if self.kind == "tpu":
            return {
                "allocated": MemoryReading(
                    torch.accelerator.max_memory_allocated(),
                    "torch.accelerator.max_memory_allocated (TPU HBM)",
                )
            }
        return {"rss": MemoryReading(_status_kib("VmHWM") * 1024, "/proc/self/status VmHWM (peak resident set)")}


@dataclass(frozen=True)
class JaxDevice(Device):
    """A JAX device behind the same interface. ``torch_device`` is the host CPU: torch work in a JAX
    cell (the parity reference) stays off the accelerator JAX holds."""

    jax_device: Any = field(default=None, compare=False)

    def sync(self) -> None:
        """Waits for JAX's queued effects and a value computed after all earlier work on the device."""
        import jax

        jax.effects_barrier()
        jax.device_put(0, self.jax_device).block_until_ready()

    @property
    def peak_resets(self) -> bool:
        return self.kind == "cpu"

    def reset_peak(self) -> None:
        if self.kind == "cpu":
            _reset_rss_peak()  # a JAX device's own peak cannot be reset: it counts from process start

    def stats(self) -> dict[str, int] | None:
        return self.jax_device.memory_stats() if self.kind != "cpu" else None

    def memory_now(self) -> MemoryReading:
        stats = self.stats()
        if stats and "bytes_in_use" in stats:
            return MemoryReading(stats["bytes_in_use"], f"jax {self.kind} memory_stats()['bytes_in_use']")
        return MemoryReading(_status_kib("VmRSS") * 1024, "/proc/self/status VmRSS (process resident set)")

    def peak_memory(self) -> dict[str, MemoryReading]:
        stats = self.stats()
        if stats and "peak_bytes_in_use" in stats:
            counter = f"jax {self.kind} memory_stats()['peak_bytes_in_use'] (since process start)"
            return {"allocated": MemoryReading(stats["peak_bytes_in_use"], counter)}
        return {"rss": MemoryReading(_status_kib("VmHWM") * 1024, "/proc/self/status VmHWM (peak resident set)")}


JAX_PLATFORMS = {"tpu": "tpu", "gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}  # JAX platform -> decodebench kind


def resolve_jax_device(requested: str) -> JaxDevice:
    """The JAX device for ``requested`` (the same rule as ``select_kind``, over what JAX sees), claimed
    for JAX in this process."""
    import jax

    kinds = {JAX_PLATFORMS.get(d.platform, d.platform): d for d in jax.devices()}
    kind = select_kind(requested, has_tpu="tpu" in kinds, has_cuda="cuda" in kinds)
    device = kinds.get(kind) or jax.devices("cpu")[0]
    claim(kind, "jax")
    return JaxDevice(kind, torch.device("cpu"), str(device.device_kind), device)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux; no VmHWM elsewhere


def _reset_rss_peak() -> None:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def resolve_device(requested: str, framework: str = "torch") -> Device:
    """The device a cell runs on, for the framework its engine uses (``torch`` or ``jax``)."""
    if framework == "jax":
        return resolve_jax_device(requested)
    kind = select_kind(requested, has_tpu=requested in ("auto", "tpu") and tpu_present(), has_cuda=cuda_present())
    claim(kind, "torch")
    if kind == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        return Device(kind, dev, torch.cuda.get_device_name(dev))
    if kind == "tpu":
        props = torch.tpu.get_device_properties()
        return Device(kind, torch.device("tpu", 0), str(getattr(props, "name", "TPU")))
    return Device("cpu", torch.device("cpu"), cpu_model())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def blocking(program: Callable[[Any], Any], x: Any) -> None:
    """A jitted JAX ``program`` run on ``x`` to its end."""
    program(x).block_until_ready()


# The reductions a torch device's streaming read is taken with, each over the same bytes viewed as its dtype: the
# read is the best any of them reaches. On the 2-core Intel Xeon (AMX) a float32 sum read 5-10 % below an int64 sum
# or a uint8 max of the same 256 MiB in the same minute (20.5 against 21.7 and 22.7 GB/s, best of 10 each, passes
# interleaved), and the project's bf16 weight kernel read above the float32 sum: a decode step's own read cleared
# a roofline divided by that sum (100.6 %), so the float32 sum alone understated what a read reaches there.
# A CPU's figure; an accelerator's is its float32 sum alone (a dtype view of its memory is not assumed of every
# backend, TorchTPU's included). None of torch's reductions asks the cache ahead: where the caller has a read that does
# (``Read``: the project's kernels' stream read, ``engines.cpu_kernels.reads``), it is one more of a CPU's reads.
FLOAT_SUM = "sum float32"
Read = Callable[[torch.Tensor], object]  # reads every byte of a contiguous tensor once (its result unused)
READ_REDUCTIONS = {FLOAT_SUM: (torch.float32, torch.sum), "sum int64": (torch.int64, torch.sum),
                   "amax uint8": (torch.uint8, torch.amax)}  # fmt: skip


# The bytes a streaming read covers: ``READ_BYTES`` (environment variable, bytes) where set, else ``BASE_READ_BYTES``,
# on a CPU at least ``CACHE_TIMES`` times its last-level cache, so that a read that passes over it again finds little of
# it in the cache: a decode step streams more than the cache holds (e2b-synthetic's int4 products 1.28 GB, its bf16
# ones 4.56 GB), each byte once a step. On the 2-core KVM Xeon with AMX (sysfs: a 480 MiB L3) the best of torch's three
# reductions read 51-54 GB/s over 64 MiB, 33.5-35.3 over 256 MiB and 31.2-33.1 over 1,920 MiB in one run (28.5-31.6
# over 1.28-4 GiB in another), and the project's int4 products in sequence read 28.8-29.4, a plain read of their bytes
# from C++ 28.4-29.4: 256 MiB overstated what a step's reads can reach there. The tests set a small ``READ_BYTES``.
READ_BYTES = "DECODEBENCH_READ_BYTES"
BASE_READ_BYTES = 256 * 2**20
CACHE_TIMES = 4
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def cache_bytes(level: int | None = None, caches: Path = CPU_CACHES) -> int:
    """The size in bytes of the data cache of ``level`` (the largest of any level where None) that this CPU's first
    core reports (sysfs ``index*/``: ``type``, ``level``, ``size`` as ``2048K``); 0 where it reports none."""
    sizes = [0]
    for index in caches.glob("index*"):
        facts = {f.name: f.read_text().strip() for f in (index / "type", index / "level", index / "size") if f.exists()}
        if facts.get("type") == "Instruction" or "size" not in facts:
            continue
        if level is not None and facts.get("level") != str(level):
            continue
        text = facts["size"]
        sizes.append(int(text[:-1]) * SIZE_UNITS[text[-1]] if text[-1] in SIZE_UNITS else int(text))
    return max(sizes)


def read_bytes(device_kind: str, caches: Path = CPU_CACHES) -> int:
    """The bytes a streaming read of ``device_kind``'s memory covers (``READ_BYTES``, else ``BASE_READ_BYTES``, on a
    CPU at least ``CACHE_TIMES`` x its last-level cache)."""
    if text := os.environ.get(READ_BYTES):
        if not text.isdigit() or int(text) < 2**20:
            raise ValueError(f"{READ_BYTES}={text!r}: the bytes a streaming read covers, a whole number, 1 MiB or more")
        return int(text)
    cache = cache_bytes(caches=caches) if device_kind == "cpu" else 0
    return max(BASE_READ_BYTES, CACHE_TIMES * cache)


def measure_bandwidth(
    device: Device, nbytes: int | None = None, repeats: int = 5, copy: bool = True, reads: dict[str, Read] | None = None
) -> dict[str, object]:
    """Memory bandwidth in GB/s, best of ``repeats`` each way: a streaming read (every thread over ``nbytes``, by
    default ``read_bytes``: what a decode step does to its weights, recorded as ``bytes``), the figure a roofline
    divides by (``value``), and beside it (unless ``copy`` is
    false) a streaming copy (bytes read + bytes written per second, ``copy``), which on a CPU understates what a read
    reaches. A CPU reads with each of ``READ_REDUCTIONS``, then each of the caller's ``reads`` (by name; taken on any
    torch device, so the caller offers only what runs on it; a JAX accelerator's memory is not a torch tensor: refused
    there) in turn, every repeat: a repeat's read is the best of them, each one's samples kept
    (``reductions``); a reduction's arithmetic can cost more than its bytes on one CPU and not on another, and every
    one of them reads every byte, so none reads faster than memory gives.

    Timer boundaries: ``device.sync()`` before and after each pass. A JAX accelerator reads with a jitted sum and
    copies with a jitted ``x + 1`` over its own memory, never through the host.
    """
    nbytes = nbytes or read_bytes(device.kind)
    if isinstance(device, JaxDevice) and device.kind != "cpu":
        if reads:
            raise ValueError(f"reads {', '.join(reads)}: a JAX {device.kind}'s memory is not a torch tensor to read")
        import jax
        import jax.numpy as jnp

        src = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), device.jax_device)
        total = jax.jit(jnp.sum)
        total(src).block_until_ready()
        passes = {FLOAT_SUM: functools.partial(blocking, total, src)}
        how = {"read": f"jax jit sum over {nbytes} B float32", "copy": f"jax jit x + 1 over {nbytes} B float32"}
        copy_pass = None
        if copy:
            add = jax.jit(lambda x: x + 1)
            add(src).block_until_ready()
            copy_pass = functools.partial(blocking, add, src)
    else:
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=device.torch_device).fill_(1.0)
        reductions = READ_REDUCTIONS if device.kind == "cpu" else {FLOAT_SUM: READ_REDUCTIONS[FLOAT_SUM]}
        passes = {name: functools.partial(reduce, src.view(dtype)) for name, (dtype, reduce) in reductions.items()}
        passes |= {name: functools.partial(read, src) for name, read in (reads or {}).items()}
        how = {"read": f"the best of torch {', '.join(reductions)}{''.join(f' and {n}' for n in reads or {})} over "
                       f"{nbytes} B",
               "copy": f"torch copy_ of {nbytes} B float32"}  # fmt: skip
        copy_pass = functools.partial(torch.empty_like(src).copy_, src) if copy else None

    def rate(run: Callable[[], object], moved: int) -> float:
        device.sync()
        start = time.perf_counter()
        run()
        device.sync()
        return moved / (time.perf_counter() - start) / 1e9

    by_reduction: dict[str, list[float]] = {name: [] for name in passes}
    read_samples, copy_samples = [], []
    for _ in range(repeats):
        for name, run in passes.items():
            by_reduction[name].append(rate(run, nbytes))
        read_samples.append(max(samples[-1] for samples in by_reduction.values()))
        if copy_pass is not None:
            copy_samples.append(rate(copy_pass, 2 * nbytes))
    read = {"value": max(read_samples), "unit": "GB/s", "samples": read_samples, "reductions": by_reduction,
            "bytes": nbytes, "method": f"{how['read']}, bytes read / seconds, best of {repeats}"}  # fmt: skip
    if copy_pass is None:
        return read
    copied = {"value": max(copy_samples), "method": f"{how['copy']}, read+write bytes / seconds, best of {repeats}",
              "samples": copy_samples}  # fmt: skip
    return {**read, "copy": copied}


MATMUL_SHAPE = (512, 1536, 6144)  # rows, inputs, outputs: a prompt piece of 512 tokens through E2B's MLP gate


def measure_matmul(device: Device, repeats: int = 10) -> dict[str, object]:
    """The bf16 matrix-product rate this device reaches, in GFLOP/s (2 x rows x inputs x outputs a product), best of
    ``repeats``: the framework's own GEMM over ``MATMUL_SHAPE``, large enough to be bound by arithmetic, not by
    memory. What a batched decode step's products could reach here (a report's compute ceiling where no facts file
    gives the chip's peak); a library's GEMM, not the instruction set's theoretical peak.

    Timer boundaries: ``device.sync()`` before and after each product, after one untimed product."""
    rows, inputs, outputs = MATMUL_SHAPE
    if isinstance(device, JaxDevice) and device.kind != "cpu":
        import jax
        import jax.numpy as jnp

        x = jax.device_put(jnp.ones((rows, inputs), jnp.bfloat16), device.jax_device)
        w = jax.device_put(jnp.ones((inputs, outputs), jnp.bfloat16), device.jax_device)
        dot = jax.jit(jnp.dot)
        product, how = (lambda: dot(x, w).block_until_ready()), "jax jit dot"
    else:
        x = torch.randn(rows, inputs, device=device.torch_device).to(torch.bfloat16)
        w = torch.randn(inputs, outputs, device=device.torch_device).to(torch.bfloat16)
        product, how = (lambda: torch.mm(x, w)), "torch mm"
    flop = 2 * rows * inputs * outputs
    product()
    samples = []
    for _ in range(repeats):
        device.sync()
        start = time.perf_counter()
        product()
        device.sync()
        samples.append(flop / (time.perf_counter() - start) / 1e9)
    return {"value": max(samples), "unit": "GFLOP/s", "samples": samples,
            "method": f"{how} of bf16 [{rows}, {inputs}] x [{inputs}, {outputs}], 2*rows*inputs*outputs FLOP / "
                      f"seconds, best of {repeats}"}  # fmt: skip


class EagerMode(StrEnum):
    """How TorchTPU runs eager ops: strict eager (each op as it is called) or defer-and-fuse (ops collected
    and compiled in groups; TPU only). Engines that run plain PyTorch ops take it as ``engine.mode``."""

    eager = "eager"
    fuse = "fuse"


def fuse_unsupported(mode: str, engine: str, device_kind: str) -> str | None:
    """Why ``engine`` cannot run under ``mode`` on this device (defer-and-fuse needs a TPU), or None."""
    if mode == EagerMode.fuse and device_kind != "tpu":
        return f"{engine} with mode=fuse needs TorchTPU's defer-and-fuse mode, a TPU; this device is {device_kind}"
    return None


def tpu_eager_mode(mode: str):
    """A context manager that runs TorchTPU eager ops in ``mode`` ('fuse' = DEFER_AND_FUSE, 'eager' =
    DEFER_NEVER) and restores the previous mode; torch_tpu 0.2.0's ``torch.tpu.set_eager_mode``."""
    modes = {"fuse": torch.tpu.EagerMode.DEFER_AND_FUSE, "eager": torch.tpu.EagerMode.DEFER_NEVER}
    return torch.tpu.set_eager_mode(modes[mode])
