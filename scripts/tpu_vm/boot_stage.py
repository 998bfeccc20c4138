"""``python3 boot_stage.py ...``: one stage of a machine's boot as an evidence file of kind ``boot``
(``evidence/boot.schema.json``), written by ``startup.sh`` when the stage ends; prints the stage's one
line, which the startup script also writes to the VM's guest attributes. A stage's own figures
(``--measurement KEY=NUMBER``: the weights stage's ``fetch_s`` and ``bytes``, the serving stage's ``load_s``
and ``warmup_s`` read from the server's ``/v1/engine``) go under ``measurements``.

Standard library only, any Python 3.8+: the first stages run before the project's own Python exists.
Times are wall-clock seconds from ``date +%s.%N`` taken by the startup script around the stage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

SCHEMA_VERSION = "1.0"
PACKAGES = ("torch", "torch_tpu", "libtpu", "jax", "jaxlib", "transformers", "decodebench", "decodebench_rs")
# Run by the project's Python: the version of each package named on its command line (None: not installed).
VERSIONS_CODE = """
import importlib.metadata as m, json, platform, sys
def version(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"python": platform.python_version(), **{p: version(p) for p in sys.argv[1:]}}))
"""


def boot_file_stem(index: int, stage: str) -> str:
    """A boot stage's file name without ``.json``: ``boot-02-torch``."""
    return f"boot-{index:02d}-{stage}"


def versions(python: str | None) -> dict[str, str | None]:
    """What is installed so far: the project's Python and packages (when it exists yet), and rustc."""
    found: dict[str, str | None] = {"python": None, **{p: None for p in PACKAGES}}
    if python and Path(python).exists():
        done = subprocess.run([python, "-c", VERSIONS_CODE, *PACKAGES], capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            found.update(json.loads(done.stdout))
    rustc = shutil.which("rustc")
    found["rustc"] = (
        subprocess.run([rustc, "--version"], capture_output=True, text=True).stdout.strip() if rustc else None
    )
    return found


def record(args: argparse.Namespace) -> dict:
    reason = args.reason.strip() if args.reason else None
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "boot",
        "sweep": args.sweep,
        "host": args.host,
        "stage": args.stage,
        "index": args.index,
        "status": args.status,
        "reason": reason or ("the stage's command failed (no output)" if args.status == "failed" else None),
        "seconds": round(args.ended - args.started, 3),
        "since_boot_s": round(args.ended - args.boot_start, 3),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(args.started)),
        "versions": versions(args.python),
        "dry_run": args.dry_run,
        "detail": "; ".join(part for part in args.detail.splitlines() if part.strip()) or None,
        "platform": platform.platform(),
        **({"measurements": dict(args.measurement)} if args.measurement else {}),
    }


def write(data: dict, folder: Path) -> Path:
    """Atomically, as ``folder/boot-<index>-<stage>.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{boot_file_stem(data['index'], data['stage'])}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def line(data: dict) -> str:
    """The stage in one line (the guest attribute's value): status, seconds, seconds since boot, then the
    stage's measurements and the versions installed so far."""
    parts = [f"{data['status']} {data['seconds']:.1f}s (at {data['since_boot_s']:.1f}s)"]
    parts += [f"{k}={v:.10g}" for k, v in data.get("measurements", {}).items()]
    parts += [f"{k}={v}" for k, v in data["versions"].items() if v and k != "rustc"]
    return " ".join(parts)


def measurement(text: str) -> tuple[str, float]:
    """``KEY=NUMBER``: a figure the stage measured (the server's ``load_s=6.83``)."""
    key, _, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = None
    if not key or number is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=NUMBER")
    return key, number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True, help="evidence_dir/<sweep>/<host>")
    parser.add_argument("--sweep", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--status", choices=("ok", "failed"), required=True)
    parser.add_argument("--reason", default="")
    parser.add_argument("--detail", default="")
    parser.add_argument("--started", type=float, required=True, help="epoch seconds")
    parser.add_argument("--ended", type=float, required=True, help="epoch seconds")
    parser.add_argument("--boot-start", type=float, required=True, help="epoch seconds")
    parser.add_argument("--python", default=None, help="the project's Python, once it exists")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--measurement", type=measurement, action="append", default=[], help="KEY=NUMBER")
    args = parser.parse_args(argv)
    data = record(args)
    write(data, args.folder)
    print(line(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
