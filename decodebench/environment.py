"""What a run ran on: host, library versions, device, CPU, git state and time, for every evidence file."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from decodebench.device import ACCELERATOR_OWNERS, Device, cpu_model

PACKAGES = (
    "torch",
    "torch_tpu",
    "libtpu",
    "transformers",
    "compressed-tensors",
    "jax",
    "jaxlib",
    "decodebench_rs",
)
REPO = Path(__file__).resolve().parents[1]


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


def capture(device: Device | None) -> dict[str, Any]:
    """The environment block of an evidence file; absent packages are recorded as null."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "python": sys.version.split()[0],
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in PACKAGES},
        "rustc": _rustc(),
        "device_kind": device.kind if device else None,
        "device_name": device.name if device else None,
        "cpu_model": cpu_model(),
        "process": {"pid": os.getpid(), "accelerator_owners": dict(ACCELERATOR_OWNERS)},
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "utc_time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
