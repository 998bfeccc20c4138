"""Evidence files: one JSON document per cell, validated by ``evidence/schema.json``, written atomically.

Measurements carry units; repeated samples keep their raw values next to median, min, max and n.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_VERSION = "1.0"
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "evidence" / "schema.json"
# Settings that say where and how evidence is kept, not what was measured.
NOT_MEASURED = ("sweep", "resume", "evidence_dir", "cache_dir")


def scalar(value: float | int | None, unit: str, **extra: Any) -> dict[str, Any]:
    return {"value": value, "unit": unit, **extra}


def samples(values: list[float], unit: str, **extra: Any) -> dict[str, Any]:
    """Raw repeats with their median, min, max and n (never an average of averages)."""
    return {
        "unit": unit,
        "values": list(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        **extra,
    }


def config_hash(config: dict[str, Any]) -> str:
    measured = {k: v for k, v in config.items() if k not in NOT_MEASURED}
    return hashlib.sha256(json.dumps(measured, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cell_name(config: dict[str, Any]) -> str:
    """Readable and unique: the main axes, then a hash of everything else that was set."""
    return (
        f"{config['engine']['name']}-{config['model']['name']}-{config['experiment']['name']}"
        f"-ctx{config['context']}-{config['dtype']}-{config_hash(config)}"
    )


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def validate(record: dict[str, Any], schema: dict[str, Any] | None = None) -> None:
    """Raises jsonschema.ValidationError when the record does not follow the schema."""
    jsonschema.validate(record, schema or load_schema(), cls=jsonschema.Draft202012Validator)


def write_atomic(path: Path, record: dict[str, Any]) -> None:
    """Writes to a temporary file in the same folder, then renames: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; evidence is for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def finished_ok(path: Path) -> bool:
    """True when ``path`` holds a readable evidence file whose status is ok (the resume rule)."""
    try:
        return read(path).get("status") == "ok"
    except (OSError, ValueError):
        return False
