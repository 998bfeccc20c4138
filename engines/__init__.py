"""Engines behind one interface (``engines.base.Engine``), looked up by ``engine.name``.

``ENGINES`` is the one registry: each class names itself and its typed config (declared beside the
class), which ``register_configs`` stores as the Hydra option ``engine=<name>``. The stored nodes are
open to keys their class does not declare, so one engine setting given beside a sweep of engines
(``-m engine=ring,generate engine.weights=int4``) composes for every cell; the runner then refuses it
by name in the cells whose engine does not take it (``takers`` names the engines that do).
"""

from __future__ import annotations

from dataclasses import fields

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from engines.base import Engine
from engines.compiled import CompiledEngine
from engines.generate import FuseEngine, GenerateEngine, StaticEngine
from engines.jax_engine import JaxEngine
from engines.llamacpp_engine import LlamaCppEngine
from engines.openai_engine import OpenAIEngine
from engines.ring import RingEngine
from engines.rust_engine import RustEngine
from engines.table4 import Table4Engine
from engines.vllm_engine import VllmEngine

ENGINES: dict[str, type[Engine]] = {
    cls.name: cls
    for cls in (
        GenerateEngine,
        FuseEngine,
        StaticEngine,
        CompiledEngine,
        Table4Engine,
        RingEngine,
        RustEngine,
        JaxEngine,
        OpenAIEngine,
        VllmEngine,
        LlamaCppEngine,
    )
}


def engine_class(name: str) -> type[Engine]:
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r}; valid: {', '.join(sorted(ENGINES))}") from None


def takers(setting: str) -> list[str]:
    """The engines whose config declares ``setting``."""
    return sorted(name for name, cls in ENGINES.items() if setting in {f.name for f in fields(cls.config)})


def streamers() -> list[str]:
    """The engines that read tokens back to the host themselves, every ``read_every`` tokens."""
    return sorted(name for name, cls in ENGINES.items() if cls.streams)


def batchers() -> list[str]:
    """The engines that decode several sequences in one step (``generate_batch``)."""
    return sorted(name for name, cls in ENGINES.items() if cls.batches)


def register_configs(cs: ConfigStore) -> None:
    for name, cls in ENGINES.items():
        node = OmegaConf.structured(cls.config(name=name))
        OmegaConf.set_struct(node, False)  # a setting only some engines take still composes (see above)
        cs.store(group="engine", name=name, node=node)
