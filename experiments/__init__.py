"""What is measured and how: one module per experiment, each ``run(cell) -> Result``.

``EXPERIMENTS`` is the one registry: each entry names its function and its typed config, which
``register_configs`` stores as the Hydra option ``experiment=<name>``. An experiment that also sets
run-level defaults (``parity`` runs in float32) has a YAML file in ``conf/experiment/`` that includes
its schema (``/schema/experiment/<name>``) and sets them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from decodebench.config import (
    DecodeExperimentConfig,
    DefaultExperimentConfig,
    ExperimentConfig,
    ParityExperimentConfig,
    RecallExperimentConfig,
)
from experiments import decode, parity, recall
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


EXPERIMENTS: dict[str, Experiment] = {
    "default": Experiment(default, DefaultExperimentConfig),
    "decode": Experiment(decode.run, DecodeExperimentConfig),
    "recall": Experiment(recall.run, RecallExperimentConfig),
    "parity": Experiment(parity.run, ParityExperimentConfig, run_defaults=True),
}


def register_configs(cs: ConfigStore) -> None:
    for name, experiment in EXPERIMENTS.items():
        node = experiment.config(name=name)
        cs.store(group="schema/experiment" if experiment.run_defaults else "experiment", name=name, node=node)
