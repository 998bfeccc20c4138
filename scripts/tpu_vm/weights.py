"""``python -m scripts.tpu_vm.weights engine=rust model=e2b-emb4 [cache_dir=...] [OVERRIDE ...]``: the boot's
``weights`` stage. Fetches the checkpoint the server will read, before it starts, and times it: the twin
the engine reads (the engine class decides, as ``engines.open`` does), downloaded by hub id with
huggingface_hub (``decodebench.checkpoint``'s own download, into the hub cache the server reads later), or
for a synthetic model built by ``decodebench.synthetic`` (a dry run on ``model=tiny``). Takes serve.py's
overrides and prints one JSON line: kind, hub id, path, files, bytes, seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from decodebench.checkpoint import resolve
from engines import engine_class
from runner import register_configs, typed_config

REPO = Path(__file__).resolve().parents[2]


def fetch(overrides: list[str]) -> dict[str, Any]:
    register_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        run = typed_config(compose("config", overrides=overrides))
    twin = engine_class(run.engine.name).twin(run.engine, run.model)
    started = time.perf_counter()
    checkpoint = resolve(run.model, twin, run.cache_dir)
    seconds = time.perf_counter() - started
    provenance = checkpoint.provenance
    files = [p for p in Path(provenance["path"]).rglob("*") if p.is_file()]
    return {
        "model": run.model.name,
        "engine": run.engine.name,
        "tables": str(twin),
        "kind": provenance["kind"],
        "synthetic": provenance["synthetic"],
        "hub_id": provenance.get("hub_id"),
        "path": provenance["path"],
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "seconds": round(seconds, 3),
    }


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(fetch(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
