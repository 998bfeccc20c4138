"""Hardware facts for derived figures: from ``conf/hardware/<name>.yaml``, bandwidth measured when unknown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from decodebench.config import HardwareConfig
from decodebench.device import Device, measure_bandwidth

CONF = Path(__file__).resolve().parents[1] / "conf" / "hardware"
KNOWN_GPUS = {"H200": "nvidia-h200"}


def auto_name(device: Device) -> str:
    """hardware=auto: the facts file that matches the device."""
    if device.kind == "tpu":
        return "tpu-v5e-1"
    if device.kind == "cuda":
        return next((f for key, f in KNOWN_GPUS.items() if key in device.name), "cuda-generic")
    return "cpu"


def resolve(hardware_cfg: Any, device: Device) -> dict[str, Any]:
    """The hardware block of an evidence file; a missing bandwidth is measured on ``device``."""
    if hardware_cfg.name == "auto":
        raw = OmegaConf.load(CONF / f"{auto_name(device)}.yaml")
        raw.pop("defaults", None)
        facts = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(HardwareConfig), raw))
    else:
        facts = OmegaConf.to_container(hardware_cfg)
    facts["bandwidth_source"] = "facts file" if facts["memory_bandwidth_gb_s"] else "measured"
    if not facts["memory_bandwidth_gb_s"]:
        measured = measure_bandwidth(device)
        facts["memory_bandwidth_gb_s"] = measured["value"]
        facts["bandwidth_measurement"] = measured
    return facts
