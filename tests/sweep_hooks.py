"""Hydra callbacks a test adds to a sweep from the command line (``+hydra.callbacks.<name>._target_=...``);
they run inside the process of each cell, and production code knows nothing of them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class WaitToBeKilled(Callback):
    """In the cell of engine ``engine``: writes the cell's process id, its parent's and its CUDA_VISIBLE_DEVICES to
    ``pid_file`` (JSON) and waits for a test to kill it; after ``seconds`` the cell runs normally (so a
    test that never kills it fails)."""

    def __init__(self, engine: str, pid_file: str, seconds: float = 120.0) -> None:
        self.engine, self.pid_file, self.seconds = engine, Path(pid_file), seconds

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.engine.name != self.engine:
            return
        announce(self.pid_file)
        time.sleep(self.seconds)


class StallInCell(Callback):
    """In the cell of engine ``engine``: the cell runs (past its start, inside ``runner.run_cell``) but opens its
    engine only after ``seconds``, having written ``pid_file`` as ``WaitToBeKilled`` does; the factory is
    restored when the job ends, for the cells after it in the same process."""

    def __init__(self, engine: str, pid_file: str, seconds: float = 120.0) -> None:
        self.engine, self.pid_file, self.seconds = engine, Path(pid_file), seconds
        self.restore: Any = None

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        import runner

        if config.engine.name != self.engine:
            return
        factory = self.restore = runner.open_engine

        def stalled(*args: Any, **kw: Any) -> Any:
            announce(self.pid_file)
            time.sleep(self.seconds)
            return factory(*args, **kw)

        runner.open_engine = stalled

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        import runner

        if self.restore is not None:
            runner.open_engine, self.restore = self.restore, None


def announce(pid_file: Path) -> None:
    """This process's id, its parent's and its CUDA_VISIBLE_DEVICES into ``pid_file`` (JSON), atomically."""
    tmp = pid_file.with_suffix(".tmp")
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    tmp.write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cuda_visible_devices": devices}))
    tmp.rename(pid_file)
