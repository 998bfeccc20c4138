"""The isolated launcher (``hydra/launcher=isolated``, ``conf/hydra/launcher/isolated.yaml``): every cell
of a sweep in a process of its own, one after another, so cells never share the machine or a framework's
state (compiled programs, a chip held by one framework).

The processes come from Python's ``multiprocessing`` fork server: at the sweep's first cell it starts one
fresh interpreter that imports ``runner`` (torch, Transformers, the engines: about 5 s) and runs nothing
else; each cell is a fork of it, so a cell starts with the modules imported and nothing compiled, opened
or run. On a TPU each cell is a fresh interpreter instead (``spawn``): whether torch_tpu's import leaves
state that a fork must not share cannot be checked off a TPU. A cell whose process dies before it writes
its evidence (SIGKILL from the kernel's out-of-memory killer or a user, a crash in native code) gets a
``failed`` evidence file written here, in the sweep's process, from its exit status, naming the signal; a
cell past ``timeout_min`` is stopped (SIGTERM, SIGKILL 10 s later) and recorded the same way (a cell that
SIGTERM reaches while it runs writes its own failed file, with the traceback of where it was, and this
launcher adds how its process ended to the reason); the sweep goes on, and ``resume=true`` reruns only the
cells that are not ok (checked here, before a process is started for them).
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

PRELOAD = ["runner"]  # what the fork server imports once, for every cell it forks
STARTED = b"started"  # a cell's first message: its process runs (its time starts)
STOP_GRACE_S = 10.0  # after SIGTERM, a cell past its time has this long to end before SIGKILL


class IsolatedLauncher(Launcher):
    """Each cell in its own process, sequentially; see the module docstring."""

    def __init__(self, timeout_min: float = 1440) -> None:
        if not float(timeout_min) > 0:
            raise ValueError(f"hydra.launcher.timeout_min={timeout_min} must be a positive number of minutes: "
                             "a cell past it is stopped, so at most 0 would stop every cell at once")  # fmt: skip
        self.timeout_min = float(timeout_min)
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from decodebench.device import tpu_present

        assert self.config is not None
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        context = cell_context(tpu_present())
        with sigterm_stops_the_sweep():
            return [self._launch_one(context, list(o), initial_job_idx + i) for i, o in enumerate(job_overrides)]

    def _launch_one(self, context: BaseContext, overrides: list[str], idx: int) -> JobReturn:
        from decodebench.config import ConfigError
        from runner import evidence_path, resumed

        assert self.hydra_context is not None and self.config is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        cfg = task_config(sweep_config)
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        try:
            path: Path | None = evidence_path(cfg, config)
        except ConfigError:  # the cell itself reports it (and writes nothing)
            path = None
        done = JobReturn(overrides=overrides, cfg=cfg, hydra_cfg=sweep_config, status=JobStatus.COMPLETED)
        if path is not None and resumed(cfg, path):
            return done
        before = stamp(path)
        job = cloudpickle.dumps((self.hydra_context, self.task_function, sweep_config, idx, Singleton.get_state()))
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=run_one, args=(job, writer), name=f"decodebench-cell-{idx}")
        process.start()
        writer.close()
        try:
            result, timed_out = wait_for(process, reader, self.timeout_min * 60)
        except KeyboardInterrupt:
            stop(process)
            raise
        finally:
            reader.close()
        if result is not None:
            return result
        assert process.exitcode is not None  # wait_for returns once the process has ended
        how = describe(process.exitcode)
        if timed_out:
            how = f"the cell ran past hydra.launcher.timeout_min={self.timeout_min:g} and was stopped ({how})"
        done.return_value = died(cfg, config, path, before, process.exitcode, how)
        return done


@contextlib.contextmanager
def sigterm_stops_the_sweep() -> Iterator[None]:
    """While the cells run, SIGTERM to the sweep's process ends the sweep as Ctrl-C does: the running cell is stopped
    first (``_launch_one``) and writes its failed file, so no cell outlives its sweep. Python's own SIGTERM ended the
    sweep's process at once and left its cell running, unwatched, to the end. (Signals are the main thread's.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"the sweep was stopped by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cell_context(tpu: bool) -> BaseContext:
    """Where the cells' processes come from: the ``forkserver`` context, each cell a fork of one interpreter
    that has imported ``PRELOAD`` and run nothing; on a TPU the ``spawn`` one, each cell a fresh interpreter."""
    context = multiprocessing.get_context("spawn" if tpu else "forkserver")
    if not tpu:
        context.set_forkserver_preload(PRELOAD)
    return context


def run_one(job: bytes, result: Connection) -> None:
    """In the cell's process: the cell as Hydra runs a job of a sweep (its own job folder, callbacks and
    logging), its ``JobReturn`` sent back to the sweep's process (after a first message: it runs)."""
    result.send_bytes(STARTED)
    hydra_context, task_function, sweep_config, idx, singletons = cloudpickle.loads(job)
    Singleton.set_state(singletons)
    setup_globals()
    with open_dict(sweep_config.hydra.job) as hydra_job:
        hydra_job.id = f"{idx}_{os.getpid()}"
        hydra_job.num = idx
    returned = run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=sweep_config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    result.send_bytes(cloudpickle.dumps(returned))
    result.close()


def wait_for(process: Any, reader: Connection, timeout_s: float) -> tuple[JobReturn | None, bool]:
    """The cell's ``JobReturn`` (None when its process ended without sending one) and whether it ran past
    ``timeout_s`` (it is stopped then), counted from the moment its process runs (the fork server's start,
    before the first cell, is not the cell's time); returns once the process has ended."""
    started, _ = receive(process, reader, None)
    result, timed_out = (None, False) if started is None else receive(process, reader, timeout_s)
    if timed_out:
        stop(process)
    process.join()
    return (None if result is None else cloudpickle.loads(result)), timed_out


def receive(process: Any, reader: Connection, timeout_s: float | None) -> tuple[bytes | None, bool]:
    """The cell's next message, or None when its process ended first; and whether ``timeout_s`` passed first."""
    ready = wait([reader, process.sentinel], timeout=timeout_s)
    if not ready:
        return None, True
    if reader in ready:  # a process that ended after it sent leaves its message readable
        try:
            return reader.recv_bytes(), False
        except EOFError:
            pass
    return None, False


def stop(process: Any) -> None:
    """SIGTERM, then SIGKILL when the process has not ended ``STOP_GRACE_S`` later."""
    process.terminate()
    process.join(STOP_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join()


def describe(returncode: int) -> str:
    """How a cell's process ended, in words (a negative return code: the signal that ended it)."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        cause = (
            " (SIGKILL cannot be caught: the kernel's out-of-memory killer, see `dmesg`, or a user sent it)"
            if sig == signal.SIGKILL
            else ""
        )
        return f"the cell's process was killed by {sig.name} (signal {sig.value}){cause}"
    return f"the cell's process exited with status {returncode}"


def died(
    cfg: DictConfig, config: dict[str, Any], path: Path | None, before: int | None, returncode: int, how: str
) -> dict[str, Any] | None:
    """The evidence of a cell whose process ended without a result: its own file if it wrote one before
    it died (a ``failed`` one, which a stopped cell writes, also says how its process ended), else a
    ``failed`` one written here from its exit status."""
    from decodebench import evidence
    from runner import new_record, write

    if path is None:
        print(f"[failed] nothing written: {how}", file=sys.stderr, flush=True)
        return None
    if stamp(path) != before:  # it wrote its evidence, then died: the file stands
        print(f"[note] {path}: {how} after it wrote this file", file=sys.stderr, flush=True)
        own = evidence.read(path)
        if own["status"] != "failed":
            return own
        own["reason"] = f"{how} (isolated launcher, exit status {returncode}); in the cell: {own['reason']}"
        evidence.validate(own)
        evidence.write_atomic(path, own)
        return own
    record = new_record(cfg, config, path)
    record.reason = f"{how} before it wrote its evidence (isolated launcher, exit status {returncode})"
    record.traceback = (
        "no Python traceback: the process did not end by itself"
        if returncode < 0
        else "the process raised before its cell ran: its traceback is in the sweep's output (stderr)"
    )
    return write(record, path)


def task_config(sweep_config: DictConfig) -> DictConfig:
    """A job's config as its task function receives it: the sweep config without the ``hydra`` node."""
    cfg = copy.deepcopy(sweep_config)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


def stamp(path: Path | None) -> int | None:
    """When ``path`` was last written (ns), or None when it does not exist."""
    try:
        return None if path is None else path.stat().st_mtime_ns
    except OSError:
        return None
