"""``python -m scripts.make_checkpoint [model=tiny] [model.FIELD=VALUE ...]``: builds a synthetic
checkpoint (``decodebench.synthetic``) into the cache, as a cell would on first use; prints its paths."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from hydra import compose, initialize_config_dir

from decodebench.config import validate_synthetic_shape
from decodebench.synthetic import ensure_synthetic
from runner import register_configs


def main() -> None:
    register_configs()
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=sys.argv[1:])
    validate_synthetic_shape(cfg.model)
    ckpt = ensure_synthetic(cfg.model, cfg.cache_dir)
    print(json.dumps({k: str(v) for k, v in asdict(ckpt).items()}))


if __name__ == "__main__":
    main()
