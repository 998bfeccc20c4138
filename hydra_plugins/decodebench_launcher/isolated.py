"""The isolated launcher (``hydra/launcher=isolated``, ``conf/hydra/launcher/isolated.yaml``): every cell
of a sweep in a fresh process, one after another.

It is hydra-submitit-launcher's local launcher run one job at a time (so cells never share the
machine), with one addition: the process that waits on each cell is ``decodebench.exit_status``,
which records the cell's exit status that submitit's controller drops. A cell whose process dies
before it writes its evidence (SIGKILL from the kernel's out-of-memory killer or a user, a crash in
native code) gets a ``failed`` evidence file written here, in the sweep's process, naming the signal;
the sweep goes on, and ``resume=true`` reruns only the cells that are not ok (checked here, before a
process is started for them).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from decodebench import exit_status

# What the sweep's process has that submitit's local executor replaces in a job's: the GPUs it may use.
KEEP_ENV = ("CUDA_VISIBLE_DEVICES",)
# submitit's own log lines in a job's output (its format, or Hydra's once the job has set up logging)
SUBMITIT_LINE = re.compile(r"^(submitit [A-Z]+ \(|\[[^]]*\]\[submitit\]\[)")


class IsolatedLauncher(LocalLauncher):
    """Each job in its own process (submitit's local executor), sequentially; see the module docstring."""

    def checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """No requeue: a cell that runs past ``timeout_min`` is recorded ``failed`` (submitit requeues a job
        whose callable returns a resubmission here, as the plugin's own launchers do)."""
        return None

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        return [self._launch_one(list(overrides), initial_job_idx + i) for i, overrides in enumerate(job_overrides)]

    def _launch_one(self, overrides: list[str], idx: int) -> JobReturn:
        import submitit  # here, not at the top: Hydra imports this module whenever it starts

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
        status = Path(str(self.config.hydra.sweep.dir)) / ".exit_status" / f"{idx}.json"
        keep = json.dumps({name: os.environ.get(name) for name in KEEP_ENV})
        python = (
            f"{shlex.quote(sys.executable)} -m decodebench.exit_status {shlex.quote(str(status))} {shlex.quote(keep)}"
        )
        executor = submitit.AutoExecutor(folder=self.params["submitit_folder"], cluster="local", local_python=python)
        executor.update_parameters(**executor_parameters(self.params))
        before = stamp(path)
        job = executor.submit(self, overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
        # submitit waits up to 15 s for a finished job's result file to show through a network filesystem's
        # caches; a local job writes it on this machine before its process ends, so a cell killed from outside
        # (no result at all) would only hold the sweep up for that long
        job._results_timeout_s = 0
        try:
            return job.result()
        except (submitit.core.utils.UncompletedJobError, submitit.core.utils.FailedJobError) as exc:
            # killed from outside, or timed out (the job raised "not requeued" in its own process)
            done.return_value = self._died(cfg, config, path, before, exit_status.read(status), str(exc))
            return done
        except KeyboardInterrupt:
            job.cancel()
            raise
        finally:
            echo(job.stdout(), sys.stdout)
            echo(job.stderr(), sys.stderr)

    @staticmethod
    def _died(
        cfg: DictConfig, config: dict[str, Any], path: Path | None, before: int | None, returncode: int | None, log: str
    ) -> dict[str, Any] | None:
        """The evidence of a cell whose process ended without a result: its own file if it wrote one
        before it died, else a ``failed`` one written here from its exit status."""
        from decodebench import evidence
        from runner import new_record, write

        how = exit_status.describe(returncode)
        if "timed-out" in log:  # submitit's word for a job past timeout_min, which this launcher never requeues
            how = f"the cell ran past hydra.launcher.timeout_min and was stopped ({how})"
        if path is None:
            print(f"[failed] nothing written: {how}", file=sys.stderr, flush=True)
            return None
        if stamp(path) != before:  # it wrote its evidence, then died: the file stands
            print(f"[note] {path}: {how} after it wrote this file", file=sys.stderr, flush=True)
            return evidence.read(path)
        record = new_record(cfg, config, path)
        record.reason = f"{how} before it wrote its evidence (isolated launcher, exit status {returncode})"
        record.traceback = f"no Python traceback: the process did not end by itself. What submitit saw:\n{log}"
        return write(record, path)


def task_config(sweep_config: DictConfig) -> DictConfig:
    """A job's config as its task function receives it: the sweep config without the ``hydra`` node."""
    cfg = copy.deepcopy(sweep_config)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


def executor_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """The launcher's settings as submitit's executor takes them (as the plugin's own ``launch`` maps them)."""
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    return {k if k in base else f"local_{k}": v for k, v in params.items() if k != "submitit_folder"}


def stamp(path: Path | None) -> int | None:
    """When ``path`` was last written (ns), or None when it does not exist."""
    try:
        return None if path is None else path.stat().st_mtime_ns
    except OSError:
        return None


def echo(text: str | None, stream: Any) -> None:
    """A job's output in the sweep's own, without submitit's log lines."""
    lines = [line for line in (text or "").splitlines() if not SUBMITIT_LINE.match(line)]
    if lines:
        print("\n".join(lines), file=stream, flush=True)
