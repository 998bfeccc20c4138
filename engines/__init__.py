"""Engines behind one interface (``engines.base.Engine``), looked up by ``engine.name``.

``ENGINES`` is the one registry: each class names itself and its typed config, which
``register_configs`` stores as the Hydra option ``engine=<name>``.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from engines.base import Engine
from engines.compiled import CompiledEngine
from engines.generate import FuseEngine, GenerateEngine, StaticEngine
from engines.jax_engine import JaxEngine
from engines.ring import RingEngine
from engines.rust_engine import RustEngine
from engines.table4 import Table4Engine

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
    )
}


def engine_class(name: str) -> type[Engine]:
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r}; valid: {', '.join(sorted(ENGINES))}") from None


def register_configs(cs: ConfigStore) -> None:
    for name, cls in ENGINES.items():
        cs.store(group="engine", name=name, node=cls.config(name=name))
