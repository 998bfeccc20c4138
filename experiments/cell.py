"""One configured run and the method every call in it is held to: the fit rule, a timed load, timed calls.

The runner opens the cell's engine through the one factory (``engines.open``: supported, checkpoint
found, context checked) and experiments ask the cell, never the engine, to load and call, so chained
experiments (``default`` = decode then recall) share one load and every call is held to the method:

* ``call`` returns exactly the tokens asked for, or raises ``MethodError`` (the cell fails: a rate
  divided by the wrong count is worse than no rate).
* ``timed_call``: one call between two ``device.sync()`` calls, wall seconds.
* ``timed_pair``: a warm 1-token call and a warm N-token call on the same prompt (the articles'
  method: the prompt read drops out of T_N - T_1).
* ``misfit``: the one fit rule (``OpenEngine.misfit``) for the run's N. A cache too small for the prompt
  plus N is the user's error (``failed``); an engine that cannot hold it by design is the engine's
  limit (``skipped``).
* ``load``: builds the engine (``OpenEngine.load``) once, between two ``device.sync()`` calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from decodebench.config import RunConfig
from decodebench.device import Device
from engines.base import Engine, Generation
from engines.open import Misfit, OpenEngine

T = TypeVar("T")


class MethodError(RuntimeError):
    """A call broke the experiment's method (the cell fails with this reason)."""


def timed(device: Device, fn: Callable[[], T]) -> tuple[T, float]:
    """Runs ``fn`` between two ``device.sync()`` calls; returns its result and wall seconds."""
    device.sync()
    start = time.perf_counter()
    result = fn()
    device.sync()
    return result, time.perf_counter() - start


def expect_tokens(gen: Generation, n: int, who: str) -> Generation:
    """The method's contract: a call asked for ``n`` tokens wrote exactly ``n``."""
    if len(gen.tokens) != n:
        raise MethodError(
            f"{who} wrote {len(gen.tokens)} tokens where the method asks for exactly {n} "
            "(EOS must not stop a timed call); no rate is computed from this call"
        )
    return gen


@dataclass
class Cell:
    """The typed run, the resolved device and the opened engine, with its load and calls in this run.

    ``opened`` is None for an experiment that runs no engine (``modes``, ``diagnose``): those never
    call the engine's lifecycle below.
    """

    cfg: RunConfig
    device: Device
    opened: OpenEngine | None
    evidence: Path | None = None  # the file this cell's record goes to
    load_s: float | None = None  # set by the load this cell timed
    # the machine's streaming read now, GB/s (``hardware.read_now``), where the roofline's bandwidth is measured and a
    # read's buffer can be kept out of the cell's memory peaks (``Device.peak_resets``); None elsewhere
    read_bandwidth: Callable[[], float] | None = None

    def beside(self, suffix: str) -> tuple[Path, str]:
        """Where a file the cell keeps beside its evidence goes (the evidence file's name, ``.json`` replaced by
        ``suffix``), and that path as the record names it: relative to ``evidence_dir``. Unique per cell, as
        the evidence file's name is."""
        if self.evidence is None:
            raise RuntimeError("this cell writes no evidence file, so nothing can be kept beside it")
        path = self.evidence.with_name(self.evidence.name.removesuffix(".json") + suffix)
        return path, str(path.relative_to(self.cfg.evidence_dir))

    @property
    def engine(self) -> Engine:
        """The loaded engine (``load`` first)."""
        assert self.opened is not None and self.opened.engine is not None, "the cell's engine is not loaded"
        return self.opened.engine

    def misfit(self, prompt_tokens: int) -> Misfit | None:
        """The fit rule for a prompt of ``prompt_tokens`` plus the run's ``max_new_tokens``."""
        return self.opened.misfit(prompt_tokens, self.cfg.max_new_tokens)

    def require_fit(self, prompt_tokens: int) -> None:
        self.opened.require_fit(prompt_tokens, self.cfg.max_new_tokens)

    def load(self) -> float | None:
        """Loads the engine once, timed; the seconds when this call loaded it, else None."""
        if self.load_s is not None:
            return None
        _, self.load_s = timed(self.device, self.opened.load)
        return self.load_s

    def call(self, ids: list[int], n: int, *, return_logits: bool = False) -> Generation:
        """``n`` greedy tokens after ``ids``, held to the exactly-``n`` contract."""
        gen = self.engine.generate(ids, n, return_logits=return_logits)
        return expect_tokens(gen, n, f"engine {self.engine.name}")

    def timed_call(self, ids: list[int], n: int) -> tuple[Generation, float]:
        return timed(self.device, lambda: self.call(ids, n))

    def call_batch(self, prompts: list[list[int]], n: int) -> list[Generation]:
        """``n`` greedy tokens after each of ``prompts``, decoded together, each held to the exactly-``n`` contract."""
        gens = self.engine.generate_batch(prompts, n)
        return [expect_tokens(gen, n, f"engine {self.engine.name}, sequence {i} of {len(gens)}")
                for i, gen in enumerate(gens)]  # fmt: skip

    def timed_pair(self, ids: list[int], n: int | None = None) -> tuple[float, Generation, float]:
        """A warm 1-token call and a warm N-token call on ``ids`` (N: ``n`` or the run's ``max_new_tokens``):
        (T_1, the N-token generation, T_N)."""
        _, t1 = self.timed_call(ids, 1)
        gen, tn = self.timed_call(ids, n or self.cfg.max_new_tokens)
        return t1, gen, tn
