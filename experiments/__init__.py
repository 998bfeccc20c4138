"""What is measured and how: one module per experiment, each ``run(cell) -> Result``.

``EXPERIMENTS`` is the one registry: each entry names its function, its typed config (declared in the
experiment's own module) and its headline (the cell's one printed line), and ``register_configs``
stores the config as the Hydra option ``experiment=<name>``. An experiment that also sets run-level
defaults (``parity`` runs in float32, ``serve`` decodes the Rust article's 100 tokens) has a YAML file
in ``conf/experiment/`` that includes its schema (``/schema/experiment/<name>``) and sets them.
``engine=False``: the experiment runs no engine (the runner opens none); ``model=False``: it reads no
checkpoint either (``modes``). As with engines, the stored nodes are open to keys their class does not
declare, so the runner can refuse such a key by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from decodebench.config import ExperimentConfig
from decodebench.evidence import Record
from experiments import decode, diagnose, load, modes, parity, profile, recall, serve
from experiments.cell import Cell
from experiments.common import Result


@dataclass
class DefaultExperimentConfig(recall.RecallExperimentConfig):
    """decode (with memory), then the recall prompts that fit the context."""


def default(cell: Cell) -> Result:
    """The default set: decode (with memory), then the recall prompts that fit the context."""
    return recall.run(cell, decode.run(cell))


@dataclass(frozen=True)
class Experiment:
    run: Callable[[Cell], Result]
    config: type[ExperimentConfig]
    headline: Callable[[Record], str]  # an ok cell's one line
    run_defaults: bool = False  # True: conf/experiment/<name>.yaml sets run-level values too
    engine: bool = True  # False: runs no engine
    model: bool = True  # False: reads no checkpoint


EXPERIMENTS: dict[str, Experiment] = {
    "default": Experiment(default, DefaultExperimentConfig, decode.headline),
    "decode": Experiment(decode.run, decode.DecodeExperimentConfig, decode.headline),
    "recall": Experiment(recall.run, recall.RecallExperimentConfig, recall.headline),
    "parity": Experiment(parity.run, parity.ParityExperimentConfig, parity.headline, run_defaults=True),
    "modes": Experiment(modes.run, modes.ModesExperimentConfig, modes.headline, engine=False, model=False),
    "diagnose": Experiment(diagnose.run, diagnose.DiagnoseExperimentConfig, diagnose.headline, engine=False),
    "serve": Experiment(serve.run, serve.ServeExperimentConfig, serve.headline, run_defaults=True),
    "profile": Experiment(profile.run, profile.ProfileExperimentConfig, profile.headline),
    "load": Experiment(load.run, load.LoadExperimentConfig, load.headline),
}


def register_configs(cs: ConfigStore) -> None:
    for name, experiment in EXPERIMENTS.items():
        node = OmegaConf.structured(experiment.config(name=name))
        OmegaConf.set_struct(node, False)  # an unknown key composes, then is refused by name (runner)
        group = "schema/experiment" if experiment.run_defaults else "experiment"
        cs.store(group=group, name=name, node=node)
