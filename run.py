"""decodebench entry point: ``python run.py engine=ring context=131328`` runs one cell;
``python run.py -m engine=generate,compiled context=256,33024`` sweeps (Hydra multirun).
Every cell writes one evidence file under ``evidence/runs/<sweep>/``, even when it fails.
"""

from __future__ import annotations

import os

from decodebench import pages

os.environ.setdefault(pages.VARIABLE, pages.ON)  # huge pages: before torch is imported (decodebench/pages.py)

import logging
import sys

import hydra
from omegaconf import DictConfig
from transformers.utils import logging as transformers_logging

from runner import is_multirun, register_configs, run_cell

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    transformers_logging.disable_progress_bar()  # one line per cell, in whichever process runs it
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # not its search for a TPU everywhere
    for client_log in ("httpx", "httpx2"):  # experiment=serve: not a line per request of the openai client
        logging.getLogger(client_log).setLevel(logging.WARNING)
    record = run_cell(cfg)
    if record is not None and record["status"] == "failed" and not is_multirun():
        sys.exit(1)


if __name__ == "__main__":
    main()
