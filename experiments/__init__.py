"""What is measured and how: one module per experiment, each ``run(cell) -> Result``."""

from __future__ import annotations

from collections.abc import Callable

from experiments import decode, parity
from experiments.common import Cell, Result

EXPERIMENTS: dict[str, Callable[[Cell], Result]] = {"decode": decode.run, "parity": parity.run}
