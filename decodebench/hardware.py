"""Hardware facts for derived figures: ``conf/hardware/<name>.yaml``, plus a bandwidth and a matmul measurement.

``facts`` is a pure function of the config and the device. Where a facts file gives no memory
bandwidth, ``bandwidth`` measures it once per host, device and sweep (the best of many streaming reads, what a
decode step does, with the best streaming copy beside it; ``reads``: the caller's reads beside torch's, on a CPU the
project's kernels' stream read, ``engines.cpu_kernels.reads``) and keeps the measurement beside the cache, so every
cell of a sweep divides by the same denominator; each cell's evidence records the measurement it used, with the
file it came from. Where it gives no bf16 peak either, the same file holds the bf16 matrix-product rate measured
here (``measure_matmul``), the compute ceiling a batched step's products are held against.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from decodebench import evidence
from decodebench.config import HardwareConfig
from decodebench.device import Device, Read, measure_bandwidth, measure_matmul
from decodebench.environment import Contention

CONF = Path(__file__).resolve().parents[1] / "conf" / "hardware"
KNOWN_GPUS = {"H200": "nvidia-h200"}
BANDWIDTH_COPIES = 10
# A sweep's read taken while other processes kept the cores busy (``Contention``) is taken again, up to READ_TRIES
# times in all (environment variable, default 3; 1: never again), BANDWIDTH_PAUSE_S apart: every cell of the sweep
# divides by it. Sweep xeon-e2b-1206d (2-core Xeon) read 23.2 GB/s while a report's tables were computed beside its
# first cell; the reads around its cells gave 33-38. The tests set 1: under pytest-xdist the other worker always keeps a
# core busy, and waiting for it added six minutes to `make test`.
READ_TRIES = "DECODEBENCH_READ_TRIES"
BANDWIDTH_PAUSE_S = 10.0
CELL_READS = 3  # streaming reads before and after each cell (best of): is the machine's bandwidth still the sweep's?


def auto_name(device: Device) -> str:
    """hardware=auto: the facts file that matches the device."""
    if device.kind == "tpu":
        return "tpu-v5e-1"
    if device.kind == "cuda":
        return next((f for key, f in KNOWN_GPUS.items() if key in device.name), "cuda-generic")
    return "cpu"


def facts(hardware_cfg: HardwareConfig, device: Device) -> dict[str, Any]:
    """The facts file's values (``auto``: the one matching the device); no measurement."""
    if hardware_cfg.name != "auto":
        return asdict(hardware_cfg)
    raw = OmegaConf.load(CONF / f"{auto_name(device)}.yaml")
    raw.pop("defaults", None)
    return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(HardwareConfig), raw))


def bandwidth(
    device: Device, cache_dir: str | Path, sweep: str, reads: dict[str, Read] | None = None
) -> dict[str, Any]:
    """This host's measured memory bandwidth for ``sweep`` on this device: measured by the first cell, then
    reused. The file is named by host, device kind and device name, and a reused file must say the same
    host and device (else it is measured again: a copied cache never lends another machine's figure), and must hold
    each of ``reads`` (else it is measured again: a read that was not taken may have read faster). A file
    from before the matmul rate was measured gets it added, its bandwidth kept (the sweep's denominator stays)."""
    host = socket.gethostname()
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", device.name).strip("-") or device.kind
    path = Path(cache_dir) / "bandwidth" / sweep / f"{host}-{device.kind}-{name}.json"
    if path.is_file():
        kept = evidence.read(path)
        same = kept.get("host") == host and kept.get("device") == device.name and kept.get("device_kind") == device.kind
        taken = set(reads or {}) <= set(kept.get("reductions", {}))
        if same and taken and "copy" in kept:  # a file from before the read (or a read now offered) was taken: again
            if "matmul" not in kept:
                kept["matmul"] = measure_matmul(device)
                evidence.write_atomic(path, kept)
            return {**kept, "file": str(path)}
    measured = {**uncontended_read(device, reads), "matmul": measure_matmul(device), "host": host,
                "device": device.name, "device_kind": device.kind}  # fmt: skip
    evidence.write_atomic(path, measured)
    return {**measured, "file": str(path)}


def read_tries() -> int:
    """How many times in all a contended sweep read is taken (``READ_TRIES`` in the environment, default 3)."""
    text = os.environ.get(READ_TRIES, "3")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{READ_TRIES}={text!r}: the times a contended sweep read is taken, a whole number, 1 or more")
    return int(text)


def uncontended_read(device: Device, reads: dict[str, Read] | None = None) -> dict[str, Any]:
    """``measure_bandwidth`` (best of ``BANDWIDTH_COPIES``, with ``reads`` beside torch's) with what else used the
    machine meanwhile (``contention``): taken again, ``BANDWIDTH_PAUSE_S`` later, while other processes kept the cores
    busy, up to ``read_tries()`` times in all. The last try is kept (``contention.contended`` says whether even it was
    contended), the ones before it listed with their read and contention (``contended_tries``)."""
    tries: list[dict[str, Any]] = []
    most = read_tries()
    while True:
        watch = Contention()
        read = measure_bandwidth(device, repeats=BANDWIDTH_COPIES, reads=reads)
        read["contention"] = watch.measure()
        if not read["contention"]["contended"] or len(tries) + 1 >= most:
            return {**read, "contended_tries": tries}
        tries.append({"value": read["value"], "contention": read["contention"]})
        time.sleep(BANDWIDTH_PAUSE_S)


def resolve(hardware_cfg: HardwareConfig, device: Device, cache_dir: str | Path, sweep: str,
            reads: dict[str, Read] | None = None) -> dict[str, Any]:
    """The hardware block of an evidence file: the facts, and the sweep's bandwidth (``bandwidth_measurement``, with
    ``reads`` beside torch's) and bf16 matmul rate (as ``peak_bf16_tflops``, ``matmul_measurement``) where the facts
    give none."""
    block = facts(hardware_cfg, device)
    block["bandwidth_source"] = "facts file" if block["memory_bandwidth_gb_s"] else "measured"
    block["peak_source"] = "facts file" if block["peak_bf16_tflops"] else "measured"
    if not block["memory_bandwidth_gb_s"] or not block["peak_bf16_tflops"]:
        measured = bandwidth(device, cache_dir, sweep, reads)
        if not block["memory_bandwidth_gb_s"]:  # only a figure in use is recorded as its measurement
            block["memory_bandwidth_gb_s"] = measured["value"]
            block["bandwidth_measurement"] = measured
        if not block["peak_bf16_tflops"]:
            block["peak_bf16_tflops"] = measured["matmul"]["value"] / 1e3
            block["matmul_measurement"] = {**measured["matmul"], "file": measured["file"]}
    return block


def read_now(device: Device, reads: dict[str, Read] | None = None) -> dict[str, Any]:
    """The streaming read figure now (``measure_bandwidth``'s read alone, ``reads`` beside torch's, best of
    ``CELL_READS``), in GB/s: taken before and after each cell whose roofline divides by the sweep's measured figure.
    A shared host's bandwidth moves (the 2-core AMD EPYC read 84 GB/s one hour and 46-50 the next), so a cell records
    what the machine read around it."""
    return measure_bandwidth(device, repeats=CELL_READS, copy=False, reads=reads)
