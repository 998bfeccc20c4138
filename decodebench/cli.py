"""Runs one cell end to end and writes its evidence, whatever happens; summarises a multirun."""

from __future__ import annotations

import gc
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from decodebench import evidence, hardware
from decodebench.checkpoint import CheckpointError
from decodebench.config import ConfigError, validate, validate_sweep
from decodebench.device import DeviceUnavailable, resolve_device
from decodebench.environment import capture
from engines import engine_class
from engines.base import DTYPES, EngineContext, EngineLimit
from experiments import EXPERIMENTS
from experiments.cell import Cell, MethodError

log = logging.getLogger("decodebench")
EXPECTED = (ConfigError, DeviceUnavailable, CheckpointError, MethodError)
_written: list[tuple[str, Path]] = []  # (status, path) of the cells run in this process


def evidence_path(cfg: DictConfig, config: dict[str, Any]) -> Path:
    return Path(cfg.evidence_dir) / str(cfg.sweep) / f"{evidence.cell_name(config)}.json"


def run_cell(cfg: DictConfig) -> dict[str, Any] | None:
    """Runs the cell and writes its evidence file; returns the record (None when resumed past)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("defaults", None)
    try:
        validate_sweep(str(cfg.sweep))
    except ConfigError as exc:  # no safe folder to write this cell's evidence into
        print(f"[failed] nothing written: {exc}", file=sys.stderr, flush=True)
        return {"status": "failed", "reason": str(exc)}
    path = evidence_path(cfg, config)
    if cfg.resume and evidence.finished_ok(path):
        log.info("resume: %s is already ok, skipped", path)
        _written.append(("resumed", path))
        return None
    record: dict[str, Any] = {
        "schema_version": evidence.SCHEMA_VERSION,
        "cell": path.stem,
        "sweep": str(cfg.sweep),
        "status": "failed",
        "reason": None,
        "traceback": None,
        "config": config,
        "config_hash": evidence.config_hash(config),
        "environment": capture(None),
        "hardware": None,
        "model": {"synthetic": cfg.model.source == "synthetic", "kind": str(cfg.model.source)},
        "engine": {},
        "measurements": {},
        "samples": {},
        "outputs": {},
        "timers": {},
    }
    try:
        validate(cfg)
        engine_cls = engine_class(cfg.engine.name)
        experiment = EXPERIMENTS.get(cfg.experiment.name)
        if experiment is None:
            raise ConfigError(f"unknown experiment {cfg.experiment.name!r}; valid: {', '.join(sorted(EXPERIMENTS))}")
        device = resolve_device(cfg.device.kind)
        record["environment"] = capture(device)
        record["hardware"] = hardware.resolve(cfg.hardware, device)
        reason = engine_cls.unsupported_reason(device, cfg)
        if reason:
            record.update(status="skipped", reason=reason)
        else:
            engine = engine_cls(
                EngineContext(
                    cfg.engine,
                    cfg.model,
                    device,
                    DTYPES[cfg.dtype],
                    cfg.context,
                    cfg.cache_dir,
                    cfg.read_every,
                )
            )
            try:
                result = experiment(Cell(cfg, device, engine))
            finally:
                if engine.checkpoint is not None:
                    record["model"] = {**record["model"], **engine.checkpoint.provenance}
                record["engine"] = engine.describe()
                release(engine)
            record.update(
                status="ok",
                measurements=result.measurements,
                samples=result.samples,
                outputs=result.outputs,
                timers=result.timers,
            )
    except EngineLimit as exc:
        record.update(status="skipped", reason=str(exc))
    except EXPECTED as exc:
        record.update(status="failed", reason=str(exc), traceback=traceback.format_exc())
    except Exception as exc:  # a crash is evidence too; the sweep goes on
        record.update(status="failed", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    evidence.validate(record)
    evidence.write_atomic(path, record)
    _written.append((record["status"], path))
    stream = sys.stdout if record["status"] != "failed" else sys.stderr
    print(f"[{record['status']}] {path}{_headline(record)}", file=stream, flush=True)
    return record


def release(engine: Any) -> None:
    """Frees a finished cell's model and compiled programs, so the next cell of a sweep starts clean."""
    engine.__dict__.clear()
    torch._dynamo.reset()
    gc.collect()


def _headline(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return f"\n  reason: {record['reason']}"
    rate = record["measurements"].get("decode_tok_s")
    synthetic = " (synthetic weights)" if record["model"].get("synthetic") else ""
    return f"\n  decode {rate['median']:.2f} tok/s median of {rate['n']}{synthetic}" if rate else ""


def is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


class SweepSummary(Callback):
    """After a multirun: one line per cell, so a failure in the middle is not lost in the log."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        counts: dict[str, int] = {}
        print("\nsweep summary:")
        for status, path in _written:
            counts[status] = counts.get(status, 0) + 1
            print(f"  {status:8s} {path}")
        print("  " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
