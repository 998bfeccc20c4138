"""What a run ran on, enough for a stranger to re-run a cell: host, CPU model and flags, cores and threads,
the environment variables that change speed, the memory pages it held, library and driver versions, device,
git state (with a hash of any uncommitted change) and time, for every evidence file; and what else used the
machine while the cell ran (``Contention``).

``fingerprint`` names the environment class a figure belongs to (CPU model and flags, cores, device,
software stack): the report never pools cells whose fingerprints differ.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from decodebench import pages
from decodebench.device import ACCELERATOR_OWNERS, Device, cpu_model

PACKAGES = (
    "torch",
    "torch_tpu",
    "libtpu",
    "transformers",
    "compressed-tensors",
    "jax",
    "jaxlib",
    "numpy",
    "scipy",
    "tokenizers",
    "safetensors",
    "hydra-core",
    "decodebench_rs",
)
REPO = Path(__file__).resolve().parents[1]
# Environment variables that change how fast a kernel runs, by prefix (thread pools, compilers, devices).
SPEED_VARIABLES = ("OMP_", "MKL_", "OPENBLAS_", "XLA_FLAGS", "TORCHINDUCTOR_", "TORCH_", "CUDA_VISIBLE_DEVICES",
                   "TPU_", "JAX_", "PJRT_", "LIBTPU_", pages.VARIABLE)  # fmt: skip
SPEED_FLAGS = re.compile(r"^(avx2|avx512.*|amx.*|.*bf16.*|fma|f16c)$")  # CPU flags that decide which kernels run
CONTENDED_CORES = 0.25  # other processes' average busy cores above which a cell is contended


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _rustc() -> str | None:
    if shutil.which("rustc") is None:
        return None
    try:
        return subprocess.run(["rustc", "--version"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_flags() -> list[str]:
    """The CPU's flags that decide which kernels run (AVX2, AVX-512, AMX, bf16, FMA), from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return sorted({f for f in line.partition(":")[2].split() if SPEED_FLAGS.match(f)})


def threads() -> dict[str, int | None]:
    """Cores this process may use and the thread pools the frameworks run with."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu_count": os.cpu_count(), "usable_cores": usable, "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads()}  # fmt: skip


def drivers() -> dict[str, str | None]:
    """CUDA and accelerator driver versions where present (null elsewhere)."""
    import torch

    driver = None
    if shutil.which("nvidia-smi"):
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            driver = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {"cuda": torch.version.cuda, "nvidia_driver": driver, "libtpu": _version("libtpu")}


def git_state() -> dict[str, Any]:
    """HEAD, whether anything differs from it (tracked or untracked), and a hash of that difference:
    the diff against HEAD plus each untracked file's name and bytes."""
    status = _git("status", "--porcelain", "--untracked-files=normal")
    dirty = bool(status) if status is not None else None
    digest = None
    if dirty:
        h = hashlib.sha256((_git("diff", "HEAD", "--binary") or "").encode())
        for name in sorted((_git("ls-files", "--others", "--exclude-standard") or "").splitlines()):
            h.update(name.encode())
            path = REPO / name
            if path.is_file():
                h.update(path.read_bytes())
        digest = h.hexdigest()[:16]
    return {"git_sha": _git("rev-parse", "HEAD"), "git_dirty": dirty, "git_diff_sha256_16": digest}


CODE = git_state()
"""The code this process runs, read once, when it imports decodebench: a cell forked later from this process (the
isolated launcher's fork server) runs the modules imported then, whatever the working tree holds by the time."""


def stack() -> dict[str, Any]:
    """The software stack this interpreter was set up from: the lock's name and hash (``make setup`` writes
    them beside the venv), or nulls for an interpreter set up otherwise."""
    try:
        return json.loads((Path(sys.prefix) / "decodebench-stack.json").read_text())
    except (OSError, ValueError):
        return {"name": None, "lock": None, "lock_sha256_16": None}


def fingerprint(env: dict[str, Any]) -> str:
    """The environment class of a figure: CPU model and flags, usable cores, device, Python, the stack and
    its packages. A CPU is named by its model and flags, not by the label each framework gives its CPU
    device (torch's and JAX's cells on one CPU are one class)."""
    keys = ("cpu_model", "cpu_flags", "device_kind", "device_name", "python", "stack", "packages")
    key = {k: env.get(k) for k in keys}
    if env.get("device_kind") == "cpu":
        key["device_name"] = None
    key["cores"] = (env.get("threads") or {}).get("usable_cores")
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def capture(device: Device | None) -> dict[str, Any]:
    """The environment block of an evidence file; absent packages are recorded as null."""
    env = {
        "python": sys.version.split()[0],
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in PACKAGES},
        "stack": stack(),
        "rustc": _rustc(),
        "drivers": drivers(),
        "device_kind": device.kind if device else None,
        "device_name": device.name if device else None,
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "threads": threads(),
        "speed_variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith(SPEED_VARIABLES)},
        "memory_pages": pages.facts(),
        "process": {"pid": os.getpid(), "accelerator_owners": dict(ACCELERATOR_OWNERS)},
        **CODE,
        "utc_time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    env["fingerprint"] = fingerprint(env)
    return env


def _busy_seconds() -> float | None:
    """CPU seconds every process on the machine has spent busy since boot (/proc/stat), or None."""
    try:
        fields_ = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields_[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds this process and its waited-for children have used (user + system)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used (/proc/<pid>/stat), or None when it is gone."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15


def listening_processes(port: int) -> list[int]:
    """The processes holding a listening TCP socket on ``port`` (any local address), and their descendants
    (a server's workers), from /proc; empty where /proc cannot say."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    owners, parents = set(), {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(proc.name)] = int(proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            if inodes and any(os.readlink(fd) in inodes for fd in proc.joinpath("fd").iterdir()):
                owners.add(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    found, grew = set(owners), True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return sorted(found - {os.getpid()})  # this process's CPU is the cell's already


class Contention:
    """What else used the machine while a cell ran: every process's busy CPU time (/proc/stat) less this
    process's own (and its children's) and that of ``own_processes`` (processes doing the cell's work
    elsewhere: the local server an ``openai`` engine measures), over the cell's wall time, as average busy
    cores; and the load average at the start and the end. A cell is ``contended`` when other processes kept
    more than ``threshold_cores`` busy on average. Accelerators' other users are not visible here (null)."""

    def __init__(self, threshold_cores: float = CONTENDED_CORES, own_processes: list[int] | None = None) -> None:
        self.threshold_cores = threshold_cores
        self.processes = {pid: process_cpu_seconds(pid) for pid in own_processes or []}
        self.start = (time.monotonic(), _busy_seconds(), _own_seconds())
        self.load_start = list(os.getloadavg())

    def measure(self) -> dict[str, Any]:
        """The block ``environment.contention`` of the cell's evidence, from the start up to now."""
        start, busy_start, own_start = self.start
        wall, busy, own = time.monotonic() - start, _busy_seconds(), _own_seconds() - own_start
        counted = []
        for pid, before in self.processes.items():
            now = process_cpu_seconds(pid)
            if before is not None and now is not None:
                counted.append({"pid": pid, "cpu_s": now - before})
                own += now - before
        other = None if busy is None or busy_start is None else max(busy - busy_start - own, 0.0)
        cores = None if other is None or wall <= 0 else other / wall
        return {"wall_s": wall, "own_cpu_s": own, "other_cpu_s": other, "other_cores": cores,
                "threshold_cores": self.threshold_cores, "load_avg_start": self.load_start,
                "load_avg_end": list(os.getloadavg()), "accelerator_other_users": None,
                "own_processes": counted,
                "contended": None if cores is None else cores > self.threshold_cores}  # fmt: skip
