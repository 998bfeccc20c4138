"""Huge pages for what a decode step streams: every entry point (``run.py``, ``serve.py``, the tests' conftest) asks
torch's CPU allocator for them before torch is imported (``VARIABLE`` set to ``ON`` unless the environment says), and
every evidence file says which pages the process had (``facts``).

A decode step on a CPU reads every weight once; with 4 KiB pages each 4 KiB of a stream is a TLB miss, and in a
virtual machine (two levels of page tables) a miss costs a walk of both. On the 2-core KVM Xeon (AMX) of the
xeon-e2b sweeps a streaming read of 256 MiB reached 24 GB/s in 4 KiB pages and 30-37 GB/s in 2 MiB ones, in the same
minute; the int4 Rust way decoded 13.8 tok/s and 14.6-15.2 (e2b-synthetic, one process each, alternated). torch's
allocator backs an allocation of 2 MiB or more with transparent huge pages (``madvise``) when ``THP_MEM_ALLOC_ENABLE``
is 1, which it reads once, at its first allocation: so it is set before torch is imported. The roofline's
read (``decodebench.device.measure_bandwidth``) is taken in the same process, so it is measured in the pages the
weights are held in. A user who sets the variable (0 turns it off) keeps their value; a system whose transparent huge
pages are ``never`` gives 4 KiB pages whatever it says, and the evidence shows it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

VARIABLE = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator: 1 = madvise(MADV_HUGEPAGE) on allocations of 2 MiB or more
ON = "1"
SYSTEM = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def system_mode(path: Path = SYSTEM) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), or None where it has none."""
    try:
        chosen = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return chosen.group(1) if chosen else None


def huge_kib(smaps: Path = Path("/proc/self/smaps_rollup")) -> int | None:
    """KiB of this process's anonymous memory in transparent huge pages now, or None where the kernel does not say."""
    try:
        found = re.search(r"^AnonHugePages:\s+(\d+) kB", smaps.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def facts() -> dict[str, Any]:
    """For the evidence: what torch's allocator was asked for, what the kernel allows, and what the process holds
    now (the runner reads it again with the engine loaded, so ``anon_huge_kib`` is what its weights hold)."""
    return {"torch_allocator": os.environ.get(VARIABLE), "system": system_mode(), "anon_huge_kib": huge_kib()}
