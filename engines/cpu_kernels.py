"""The project's own products for a CPU with AVX-512 BF16, built from ``csrc/`` into one library at setup.

``decodebench_int4::int4_rows`` (``engines.int4_cpu``, ``csrc/int4_rows.cpp``) multiplies bf16 rows by a W4A16
weight, ``decodebench_bf16::bf16_rows`` (``engines.bf16_cpu``, ``csrc/bf16_rows.cpp``) by a bf16 one; both read a
weight packed once at load into tiles of 16 outputs, front to back, and share ``csrc/rows.h``;
``decodebench_attn::one_query`` (``engines.attention_cpu``, ``csrc/one_query.cpp``) is a decode step's attention;
``decodebench_norm::rms`` (``engines.norm_cpu``, ``csrc/rms_norm.cpp``) the Rust engine's RMS norm in one operator
(with ``add_rms``, the residual add after it) and ``decodebench_act::gelu_mul`` (``csrc/gelu_mul.cpp``) its MLP's
activation times ``up``;
``decodebench_pick::first_max`` (``engines.greedy_cpu``, ``csrc/first_max.cpp``) the greedy token of a row of logits;
``decodebench_read::stream`` (``reads``, ``csrc/stream_read.cpp``) a streaming read with the products' prefetch, for the
roofline's bandwidth.
They are built by torch's C++ extension loader (``main``, at setup: no test or cell compiles them) into
``build/`` and registered in C++ (``TORCH_LIBRARY``), so a compiled step calls each as one opaque operator. Where
they cannot be built (no compiler) or run (the CPU lacks AVX-512 BF16) the engines use aten's kernels and the
evidence names which ran.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from decodebench.device import Device, Read
from engines import prefetch

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "int4_rows.cpp", CSRC / "bf16_rows.cpp", CSRC / "one_query.cpp", CSRC / "rms_norm.cpp",
           CSRC / "first_max.cpp", CSRC / "gelu_mul.cpp", CSRC / "stream_read.cpp")  # fmt: skip
BUILD = Path(__file__).parents[1] / "build" / f"cpu_kernels-torch{torch.__version__.replace('+', '-')}"
# -fopenmp: ATen's parallel_for is inline code that shares the tiles among torch's threads only when the kernels are
# compiled with OpenMP; without it every product ran on the calling thread (one core: a one-row bf16 product over a
# 1 GiB weight read 37 GB/s where two threads read 75 on the 2-core AMD EPYC). The library links the OpenMP runtime
# torch already loaded (the same soname), so the threads are torch's own.
CFLAGS = ("-O3", "-std=c++20", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def source_digest() -> str:
    """The kernels' sources and build flags, hashed: what a measurement cached across runs (``engine.one_row=auto``)
    is keyed by, so a changed kernel is timed again."""
    digest = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for path in (*SOURCES, CSRC / "rows.h"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def built() -> bool:
    """Builds (once per source and torch version; a no-op after) and loads the library, its prefetch hint set to
    this machine's (``prefetch_choice``); True when this CPU runs it, False when it cannot be built here (a warning
    says why) or this CPU cannot run it."""
    return prefetch_choice() is not None


@functools.cache
def loaded_digest() -> str | None:
    """``source_digest`` of the sources this process built and loaded the library from (taken just before: a source
    edited later in the run is not what ran), or None where it was not built or this CPU cannot run it."""
    from torch.utils import cpp_extension

    digest = source_digest()
    BUILD.mkdir(parents=True, exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)  # the ninja the project installs (pyproject), which the loader runs
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(name="decodebench_cpu", sources=[str(s) for s in SOURCES],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), extra_include_paths=[str(CSRC)],
                           build_directory=str(BUILD), is_python_module=False, verbose=False)  # fmt: skip
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        warnings.warn(f"the project's CPU kernels could not be built here, aten's run instead: {exc}", stacklevel=3)
        return None

    @torch.library.register_fake("decodebench_int4::int4_rows")
    def _(x, words, scales, group, out_features, limbs):  # its output's shape, for a compiled step that traces it
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("decodebench_bf16::bf16_rows")
    def _(x, packed, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("decodebench_attn::one_query")
    def _(q, k, v, keep, scale):
        return q.new_empty(*q.shape[:3], v.shape[3])

    @torch.library.register_fake("decodebench_pick::first_max")
    def _(x):
        return x.new_empty(x.shape[0], 1, dtype=torch.long)

    return digest if torch.ops.decodebench_int4.supported() else None


@functools.cache
def prefetch_choice() -> prefetch.Choice | None:
    """The cache level the kernels prefetch into on this machine (``engines.prefetch``: timed once on cold weights,
    cached in ``build/`` per CPU, torch, threads and sources), set for this process's kernels; None where they do not
    run here."""
    digest = loaded_digest()
    if digest is None:
        return None
    return prefetch.choose(BUILD / "prefetch", prefetch.key(digest, torch.get_num_threads()))


def missing() -> str | None:
    """Why no kernel of the library runs here (each kernel's own ``unsupported`` adds its rules), or None."""
    return None if built() else "it was not built here, or this CPU lacks AVX-512 BF16 or VNNI"


def threads() -> int | None:
    """The threads the kernels share a product among (torch's intra-op threads when built with OpenMP), or None
    where they do not run here: recorded in a way's evidence beside the kernels it used."""
    return int(torch.ops.decodebench_int4.threads()) if built() else None


def prefetch_hint() -> str | None:
    """The cache level the kernels' prefetches ask for now (``nta`` or ``t0+t1``; ``prefetch_choice`` sets it), or
    None where they do not run here."""
    return str(torch.ops.decodebench_int4.prefetch_hint()) if built() else None


STREAM_READ = "the project's stream read"  # its name among the bandwidth's reads (decodebench.device)


def reads(device: Device) -> dict[str, Read]:
    """The library's streaming read (``decodebench_read::stream``: every byte once, 64 bytes a load, torch's threads
    each a contiguous part, the products' prefetch) by name, for the roofline's bandwidth of ``device`` beside torch's
    reductions (``decodebench.device.measure_bandwidth``), where ``device`` is this CPU and the library runs on it;
    none elsewhere."""
    return {STREAM_READ: torch.ops.decodebench_read.stream} if device.kind == "cpu" and built() else {}


NAMESPACES = ("decodebench_int4.", "decodebench_bf16.")  # the library's products, as a module's ``kernel`` names them


def facts(model: nn.Module) -> dict[str, int | str | None]:
    """For a way's evidence: the threads the kernels share a product among, their prefetch hint (and how it was
    chosen) and the digest of their sources (a parity check vouches for a decode cell only where both ran the same
    kernels), where some product of ``model`` runs on them (``int4_rows``, ``bf16_rows``); None for each where none
    does."""
    used = any(str(getattr(m, "kernel", "")).startswith(NAMESPACES) for m in model.modules())
    return {
        "cpu_kernel_threads": threads() if used else None,
        "cpu_kernel_prefetch": prefetch_hint() if used else None,
        "cpu_kernel_prefetch_choice": prefetch_choice().record() if used else None,
        "cpu_kernel_source": loaded_digest() if used else None,
    }


def main() -> None:
    """``make setup``: builds them once."""
    if built():
        choice = prefetch_choice()
        ms = ", ".join(f"{hint} {ms:.1f} ms" for hint, ms in choice.ms.items())
        runs = f"built, and this CPU runs them on {threads()} threads, prefetching {choice.hint} ({choice.how}: {ms})"
    else:
        runs = "not run here (see the warning above, or no AVX-512 BF16)"
    print(f"setup: the project's CPU kernels into {BUILD}: {runs}")
