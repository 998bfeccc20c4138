"""``python serve.py engine=ring model=tiny serve.port=8000``: the OpenAI-compatible server (``serving``)
over one engine, from the command line.

It composes the same Hydra config as ``run.py`` (plus ``serve.host``, default 127.0.0.1, ``serve.port``,
``serve.max_body_bytes`` and ``serve.max_queue``), opens and loads the engine through the one factory
(``engines.open``) on this, the main, thread, runs one warm-up decode, then serves until Ctrl-C or
SIGTERM (both stop it the same way: the "stopped" line, the engine closed, exit status 0). A ring is served
with the server's own defaults (``serving.defaults``) unless the command line or a way sets them.
"""

from __future__ import annotations

import os

from decodebench import pages

os.environ.setdefault(pages.VARIABLE, pages.ON)  # huge pages: before torch is imported (decodebench/pages.py)

import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from decodebench.config import ConfigError
from decodebench.device import resolve_device
from engines import engine_class
from engines.base import EngineLimit
from engines.open import open_engine
from experiments.cell import timed
from experiments.common import quiet
from runner import register_configs, typed_config
from serving.defaults import serving_settings
from serving.listen import running
from serving.server import create_app, describe_engine
from serving.worker import Metrics, make_worker

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Loads the engine on this (main) thread, warms it up, serves until Ctrl-C or SIGTERM."""
    try:
        device = resolve_device(cfg.device.kind, engine_class(cfg.engine.name).framework)
        fast = serving_settings(cfg.engine, list(HydraConfig.get().overrides.task), cfg.get("way"), device.kind)
        for key, value in fast.items():
            OmegaConf.update(cfg, key, value)
        run = typed_config(cfg)
        opened = open_engine(run, device)
    except (ConfigError, EngineLimit, KeyError) as exc:
        sys.exit(f"engine {cfg.engine.name} cannot serve here: {exc}")
    read_every = max(run.read_every, 1)  # a server streams: every batch of read_every tokens goes out at once
    with quiet():
        _, load_s = timed(device, opened.load)
        engine = opened.engine
        ids = opened.encode(run.prompt)
        with engine.reading_every(read_every):
            _, warmup_s = timed(device, lambda: engine.generate(ids, min(run.max_new_tokens, run.context - len(ids))))
    served = describe_engine(opened, run.model.name, load_s, warmup_s, read_every)
    try:
        worker = make_worker(engine, Metrics(), read_every, run.serve.max_batch, run.serve.prompt_read)
    except ConfigError as exc:
        opened.close()
        sys.exit(f"engine {cfg.engine.name} cannot serve here: {exc}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM raises KeyboardInterrupt, as Ctrl-C does
    with running(create_app(served, worker, opened, run.serve), run.serve.host, run.serve.port) as url:
        print(f"decodebench serving {run.engine.name} / {run.model.name} at {url}/v1 (chat page: {url}/); "
              f"load {load_s:.2f} s, warm-up {warmup_s:.2f} s"
              + (f"; serving defaults {' '.join(f'{k}={v}' for k, v in fast.items())}" if fast else ""),
              flush=True)  # fmt: skip
        try:
            worker.serve_until(lambda: False)
        except KeyboardInterrupt:
            print("decodebench: stopped", flush=True)
        finally:
            opened.close()


if __name__ == "__main__":
    main()
