"""The device layer: which device a run uses, how to wait for it, and what its memory counters say.

Selection: ``auto`` is tpu when torch_tpu is installed and ``torch.accelerator`` reports a TPU, else
cuda when CUDA is available, else cpu.  A named kind that is absent fails with the reason.
Every memory reading carries the name of the counter it came from.
"""

from __future__ import annotations

import contextlib
import importlib.util
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decodebench.evidence import MemoryReading


class DeviceUnavailable(RuntimeError):
    """The requested device kind does not exist on this machine."""


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


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux; no VmHWM elsewhere


def _reset_rss_peak() -> None:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def resolve_device(requested: str) -> Device:
    kind = select_kind(requested, has_tpu=requested in ("auto", "tpu") and tpu_present(), has_cuda=cuda_present())
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


def measure_bandwidth(device: Device, nbytes: int = 256 * 2**20, repeats: int = 5) -> dict[str, object]:
    """Streaming-copy bandwidth in GB/s (bytes read + bytes written per second), best of ``repeats``.

    Timer boundaries: ``device.sync()`` before and after each copy.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device.torch_device).fill_(1.0)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(repeats):
        device.sync()
        start = time.perf_counter()
        dst.copy_(src)
        device.sync()
        samples.append(2 * nbytes / (time.perf_counter() - start) / 1e9)
    return {
        "value": max(samples),
        "unit": "GB/s",
        "method": f"torch copy_ of {nbytes} B float32, read+write bytes / seconds, best of {repeats}",
        "samples": samples,
    }


def tpu_eager_mode(mode: str):
    """A context manager that runs TorchTPU eager ops in ``mode`` ('fuse' = DEFER_AND_FUSE, 'eager' =
    DEFER_NEVER) and restores the previous mode; torch_tpu 0.2.0's ``torch.tpu.set_eager_mode``."""
    modes = {"fuse": torch.tpu.EagerMode.DEFER_AND_FUSE, "eager": torch.tpu.EagerMode.DEFER_NEVER}
    return torch.tpu.set_eager_mode(modes[mode])
