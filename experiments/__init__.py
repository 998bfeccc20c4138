"""What is measured and how: one module per experiment, each ``run(cell) -> Result``.

``EXPERIMENTS`` is the one registry: each entry names its function and its typed config, which
``register_configs`` stores as the Hydra option ``experiment=<name>``. An experiment that also sets
run-level defaults (``parity`` runs in float32) has a YAML file in ``conf/experiment/`` that includes
its schema (``/schema/experiment/<name>``) and sets them. ``engine=False``: the experiment runs no
engine (the runner builds none); ``model=False``: it reads no checkpoint either (``modes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from decodebench.config import (
    DecodeExperimentConfig,
    DefaultExperimentConfig,
    DiagnoseExperimentConfig,
    ExperimentConfig,
    ModesExperimentConfig,
    ParityExperimentConfig,
    RecallExperimentConfig,
    ServeExperimentConfig,
)
from experiments import decode, diagnose, modes, parity, recall, serve
from experiments.cell import Cell
from experiments.common import Result


def default(cell: Cell) -> Result:
    """The default set: decode (with memory), then the recall prompts that fit the context."""
    return recall.run(cell, decode.run(cell))


@dataclass(frozen=True)
class Experiment:
    run: Callable[[Cell], Result]
    config: type[ExperimentConfig]
    run_defaults: bool = False  # True: conf/experiment/<name>.yaml sets run-level values too
    engine: bool = True  # False: runs no engine
    model: bool = True  # False: reads no checkpoint


EXPERIMENTS: dict[str, Experiment] = {
    "default": Experiment(default, DefaultExperimentConfig),
    "decode": Experiment(decode.run, DecodeExperimentConfig),
    "recall": Experiment(recall.run, RecallExperimentConfig),
    "parity": Experiment(parity.run, ParityExperimentConfig, run_defaults=True),
    "modes": Experiment(modes.run, ModesExperimentConfig, engine=False, model=False),
    "diagnose": Experiment(diagnose.run, DiagnoseExperimentConfig, engine=False),
    "serve": Experiment(serve.run, ServeExperimentConfig),
}


def register_configs(cs: ConfigStore) -> None:
    for name, experiment in EXPERIMENTS.items():
        node = experiment.config(name=name)
        cs.store(group="schema/experiment" if experiment.run_defaults else "experiment", name=name, node=node)
