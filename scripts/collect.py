"""``python -m scripts.collect FROM [--into evidence/runs]`` (``make collect FROM=...``): merges evidence
written by many machines (a shared folder, a mounted bucket, copies gathered by hand) into one tree.

Every JSON file under FROM that is an evidence file (a cell's or a boot stage's: it names its sweep)
goes to ``INTO/<sweep>/<host>/<cell>.json`` (a boot stage: ``boot-<index>-<stage>.json``), each part
read from the file itself (a cell's ``environment.host``, a boot stage's ``host``) and checked to be a
plain name; a file that names no host (written before hosts were recorded) goes to
``INTO/<sweep>/<cell>.json``. Where a file lies under FROM, and its name there, do not matter.

* not there yet: copied (atomically);
* there with the same bytes: nothing to do, the file is counted once;
* there with other bytes: both kept, the newcomer as ``<stem>.<sha256 prefix>.json`` beside it, and
  the report names both under *Warnings*.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decodebench.config import ConfigError, validate_folder
from decodebench.evidence import BOOT
from scripts.tpu_vm.boot_stage import boot_file_stem

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Collected:
    """What a merge did, file by file (source paths)."""

    copied: list[Path] = field(default_factory=list)
    identical: list[Path] = field(default_factory=list)
    conflicting: list[tuple[Path, Path]] = field(default_factory=list)  # (source, where it was kept)
    ignored: list[str] = field(default_factory=list)  # "path: why"

    def summary(self) -> str:
        lines = [
            f"collect: {len(self.copied)} copied, {len(self.identical)} already there (same bytes), "
            f"{len(self.conflicting)} conflicting (kept beside the other), {len(self.ignored)} ignored"
        ]
        lines += [f"  conflict: {src} kept as {dst}" for src, dst in self.conflicting]
        lines += [f"  ignored: {why}" for why in self.ignored]
        return "\n".join(lines)


def host_of(record: dict[str, Any]) -> str | None:
    """The machine a record was written on, as the record says."""
    host = record.get("host") or (record.get("environment") or {}).get("host")
    return str(host) if host else None


def file_name(record: dict[str, Any]) -> str:
    """The record's own file name: ``<cell>.json``, or ``boot-<index>-<stage>.json`` for a boot stage
    (as scripts/tpu_vm/boot_stage.py names it)."""
    if record.get("kind") == BOOT:
        name = boot_file_stem(int(record.get("index", -1)), str(record.get("stage") or ""))
    else:
        name = str(record.get("cell") or "")
    validate_folder("cell", name, "INTO/<sweep>/<host>/<cell>.json")
    return f"{name}.json"


def destination(record: dict[str, Any], into: Path) -> Path:
    """``into/<sweep>/<host>/<file>`` (``into/<sweep>/<file>`` for a record naming no host).
    Raises ConfigError when the sweep, host or file name is not a plain name."""
    name = file_name(record)
    sweep = str(record.get("sweep") or "")
    validate_folder("sweep", sweep, "INTO/<sweep>/")
    host = host_of(record)
    if host is None:
        return into / sweep / name
    validate_folder("host", host, "INTO/<sweep>/<host>/")
    return into / sweep / host / name


def copy_atomic(data: bytes, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def collect(source: Path, into: Path) -> Collected:
    """Merges every evidence file under ``source`` into ``into`` (see the module docstring)."""
    done = Collected()
    into_resolved = into.resolve()
    for path in sorted(source.rglob("*.json")):
        if path.name.startswith(".") or path.resolve().is_relative_to(into_resolved):
            continue
        data = path.read_bytes()
        try:
            record = json.loads(data)
            if not isinstance(record, dict) or "sweep" not in record:
                raise ValueError("not an evidence file (names no sweep)")
            dst = destination(record, into)
        except (ValueError, ConfigError) as exc:
            done.ignored.append(f"{path}: {str(exc).splitlines()[0]}")
            continue
        if not dst.exists():
            copy_atomic(data, dst)
            done.copied.append(path)
            continue
        if dst.read_bytes() == data:
            done.identical.append(path)
            continue
        twin = dst.with_name(f"{dst.stem}.{hashlib.sha256(data).hexdigest()[:12]}{dst.suffix}")
        if twin.exists():  # this very file was collected before
            done.identical.append(path)
            continue
        copy_atomic(data, twin)
        done.conflicting.append((path, twin))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a folder (or mounted bucket) of evidence from one or more hosts")
    parser.add_argument("--into", type=Path, default=REPO / "evidence" / "runs")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        print(f"collect: FROM={args.source} is not a folder", file=sys.stderr)
        return 2
    print(collect(args.source, args.into).summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
