"""Evidence files: one JSON document per cell, validated by ``evidence/schema.json``, written atomically.

The record and its measurements are dataclasses, written (``Record.to_json``) by the runner and read
back (``Record.from_json``) by the report, so a number is traced from experiment to report through
this one module. Measurements carry units: a ``Scalar``, raw repeated ``Samples`` (with median, min,
max and n, never an average of averages), or a ``MemoryReading`` that names its counter.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from decodebench.files import write_bytes_atomic
from decodebench.stats import median_interval

SCHEMA_VERSION = "1.0"
BOOT = "boot"  # the ``kind`` of a boot-stage file (scripts/tpu_vm); a cell's file has no kind
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "evidence" / "schema.json"
BOOT_SCHEMA_PATH = SCHEMA_PATH.with_name("boot.schema.json")
DECODE_EXPERIMENTS = ("decode", "default")  # experiments whose files carry decode_tok_s samples
# Settings that say where and how evidence is kept (or where a server listens), not what was measured.
NOT_MEASURED = ("sweep", "resume", "evidence_dir", "cache_dir", "host", "serve")
SERVE_MEASURED = {"max_batch": 1, "prompt_read": "whole"}  # the server's settings that change what is measured


@dataclass(frozen=True)
class Scalar:
    """One value with its unit; ``extra`` holds how it was made (method, bound, ...)."""

    value: float | int | None
    unit: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def central(self) -> float | int | None:
        return self.value

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "unit": self.unit, **self.extra}


@dataclass(frozen=True)
class Samples:
    """Raw repeats with their median, min, max, n and the median's bootstrap 95% interval
    (``ci95``: [low, high], nulls below two repeats; ``decodebench.stats``)."""

    values: list[float]
    unit: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def central(self) -> float:
        return statistics.median(self.values)

    def to_json(self) -> dict[str, Any]:
        v = list(self.values)
        ci = median_interval(v)
        return {"unit": self.unit, "values": v, "median": self.central, "min": min(v), "max": max(v), "n": len(v),
                "ci95": [ci.low, ci.high], **self.extra}  # fmt: skip


@dataclass(frozen=True)
class MemoryReading:
    """One memory figure in bytes, with the counter that produced it."""

    bytes: int
    counter: str

    @property
    def central(self) -> int:
        return self.bytes

    def to_json(self) -> dict[str, Any]:
        return {"value": self.bytes, "unit": "B", "counter": self.counter}


Measurement = Scalar | Samples | MemoryReading
AIPERF_EXPORTS = ".aiperf"  # the folder a load cell keeps AIPerf's exports in, beside its evidence file
KEPT_BESIDE = (AIPERF_EXPORTS,)  # folders of a tool's own files kept beside a cell's evidence: not evidence
PEAK = "memory_peak_"  # memory_peak_<counter name>: one measurement per peak counter the device has


def scalar(value: float | int | None, unit: str, **extra: Any) -> Scalar:
    return Scalar(value, unit, extra)


def samples(values: list[float], unit: str, **extra: Any) -> Samples:
    return Samples(list(values), unit, extra)


def memory_peaks(peaks: dict[str, MemoryReading]) -> dict[str, MemoryReading]:
    """The device's peak counters under their measurement names."""
    return {f"{PEAK}{name}": reading for name, reading in peaks.items()}


def measurement_from_json(data: dict[str, Any]) -> Measurement:
    if "values" in data:
        known = ("unit", "values", "median", "min", "max", "n")
        return Samples(data["values"], data["unit"], {k: v for k, v in data.items() if k not in known})
    if "counter" in data and data.get("unit") == "B":
        return MemoryReading(data["value"], data["counter"])
    return Scalar(data["value"], data["unit"], {k: v for k, v in data.items() if k not in ("value", "unit")})


@dataclass
class Record:
    """One cell's evidence: what ran, where, with what outcome and measurements."""

    cell: str
    sweep: str
    config: dict[str, Any]
    config_hash: str
    environment: dict[str, Any]
    model: dict[str, Any]
    status: str = "failed"
    reason: str | None = None
    traceback: str | None = None
    hardware: dict[str, Any] | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    measurements: dict[str, Measurement] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    timers: dict[str, str] = field(default_factory=dict)
    schema_version: str = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["measurements"] = {name: m.to_json() for name, m in self.measurements.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["measurements"] = {n: measurement_from_json(m) for n, m in data.get("measurements", {}).items()}
        return cls(**fields)

    def value(self, name: str) -> Any:
        """A measurement's value (the median of samples), or None when it was not measured."""
        m = self.measurements.get(name)
        return None if m is None else m.central

    def memory_peak(self) -> MemoryReading | None:
        """The first peak counter by name (``memory_peak_allocated`` before ``memory_peak_reserved``)."""
        return next((m for name, m in sorted(self.measurements.items()) if name.startswith(PEAK)), None)


def config_hash(config: dict[str, Any]) -> str:
    """The cell's settings as a hash: every key but where it runs and writes (``NOT_MEASURED``); of the server's
    settings only ``serve.max_batch`` and ``serve.prompt_read`` change what is measured, each hashed where it is not
    its default (1, whole)."""
    measured = {k: v for k, v in config.items() if k not in NOT_MEASURED}
    serve = config.get("serve") or {}
    for key, default in SERVE_MEASURED.items():
        if serve.get(key, default) != default:
            measured[f"serve.{key}"] = serve[key]
    return hashlib.sha256(json.dumps(measured, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cell_name(config: dict[str, Any], *, engine: bool = True, model: bool = True) -> str:
    """Readable and unique: the main axes the cell uses (no engine name for an experiment that runs
    none, no model or context for one that reads no checkpoint), then a hash of everything that was set."""
    axes = [
        config["engine"]["name"] if engine else None,
        config["model"]["name"] if model else None,
        config["experiment"]["name"],
        f"ctx{config['context']}" if model else None,
        config["dtype"],
        config_hash(config),
    ]
    return "-".join(a for a in axes if a)


def load_schema(kind: str | None = None) -> dict[str, Any]:
    """The schema of a cell's file (``kind`` None) or of a boot stage's (``kind="boot"``)."""
    return json.loads((BOOT_SCHEMA_PATH if kind == BOOT else SCHEMA_PATH).read_text())


def validate(record: dict[str, Any], schema: dict[str, Any] | None = None) -> None:
    """Raises jsonschema.ValidationError when the record does not follow its kind's schema."""
    kind = record.get("kind") if isinstance(record, dict) else None
    jsonschema.validate(record, schema or load_schema(kind), cls=jsonschema.Draft202012Validator)


def write_atomic(path: Path, record: dict[str, Any]) -> None:
    """A record as indented JSON, written whole or not at all (``files.write_bytes_atomic``)."""
    write_bytes_atomic(path, (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode())


def read(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def finished_ok(path: Path) -> bool:
    """True when ``path`` holds a readable evidence file whose status is ok."""
    try:
        return read(path).get("status") == "ok"
    except (OSError, ValueError):
        return False


def evidence_files(folder: Path) -> list[Path]:
    """Every ``*.json`` below ``folder`` in name order but the tools' own files a cell keeps beside its evidence
    (``KEPT_BESIDE``: AIPerf's exports)."""
    return [p for p in sorted(Path(folder).rglob("*.json"))
            if not any(part.endswith(KEPT_BESIDE) for part in p.relative_to(folder).parts[:-1])]  # fmt: skip


def cell_files(sweep_dir: Path, cell: str) -> list[Path]:
    """Every evidence file of one cell in a sweep folder: ``<sweep>/<cell>.json`` (one machine) and
    ``<sweep>/<host>/<cell>.json`` (a folder per host, ``host=auto``)."""
    return sorted(p for p in (sweep_dir / f"{cell}.json", *sweep_dir.glob(f"*/{cell}.json")) if p.is_file())


def cell_ok(sweep_dir: Path, cell: str) -> bool:
    """The resume rule: some machine already finished this cell ok in this sweep."""
    return any(finished_ok(p) for p in cell_files(sweep_dir, cell))
