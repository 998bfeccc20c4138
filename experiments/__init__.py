"""What is measured and how: one module per experiment, each ``run(cell) -> Result``."""

from __future__ import annotations

from collections.abc import Callable

from experiments import decode, parity, recall
from experiments.cell import Cell
from experiments.common import Result


def default(cell: Cell) -> Result:
    """The default set: decode (with memory), then the recall prompts that fit the context."""
    return recall.run(cell, decode.run(cell))


EXPERIMENTS: dict[str, Callable[[Cell], Result]] = {
    "default": default,
    "decode": decode.run,
    "recall": recall.run,
    "parity": parity.run,
}
