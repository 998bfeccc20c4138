"""One configured run and the engine's lifecycle in it: prepare, the fit rule, a timed load, timed calls.

Experiments ask the cell, never the engine, to prepare, load and call, so chained experiments
(``default`` = decode then recall) share one load and every call is held to the method:

* ``call`` returns exactly the tokens asked for, or raises ``MethodError`` (the cell fails: a rate
  divided by the wrong count is worse than no rate).
* ``timed_call``: one call between two ``device.sync()`` calls, wall seconds.
* ``timed_pair``: a warm 1-token call and a warm N-token call on the same prompt (the articles'
  method: the prompt read drops out of T_N - T_1).
* ``misfit``: the one fit rule. A cache too small for the prompt plus N is the user's error
  (``failed``); an engine that cannot hold it by design is the engine's limit (``skipped``). A
  context larger than the model can address fails the cell at ``prepare``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from decodebench.config import ConfigError
from decodebench.device import Device
from engines.base import CONTEXT_HEADROOM, Engine, EngineLimit, Generation

T = TypeVar("T")


class MethodError(RuntimeError):
    """A call broke the experiment's method (the cell fails with this reason)."""


@dataclass(frozen=True)
class Misfit:
    """Why a prompt does not fit this cell; ``user_error``: the cell fails, else it is skipped."""

    reason: str
    user_error: bool

    def error(self) -> Exception:
        return ConfigError(self.reason) if self.user_error else EngineLimit(self.reason)


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
    """The composed config, the resolved device and the engine, with its lifecycle in this run.

    ``engine`` is None for an experiment that runs none (``modes``, ``diagnose``): those never call
    the engine's lifecycle below.
    """

    cfg: Any
    device: Device
    engine: Engine | None
    load_s: float | None = None  # set by the load this cell timed

    def prepare(self) -> None:
        """Finds the checkpoint and tokenizer (once; not timed); a context the model cannot address
        is the user's error."""
        if self.engine.checkpoint is not None:
            return
        self.engine.prepare()
        positions = self.engine.checkpoint.config.max_position_embeddings
        if self.cfg.context > positions + CONTEXT_HEADROOM:
            raise ConfigError(
                f"context={self.cfg.context} is above what the model can address: max_position_embeddings="
                f"{positions} plus {CONTEXT_HEADROOM} slots of headroom (one prompt piece, as in the "
                f"article's 131,328 = 131,072 + 256) = {positions + CONTEXT_HEADROOM}"
            )

    def misfit(self, prompt_tokens: int) -> Misfit | None:
        """The fit rule for a prompt of ``prompt_tokens`` plus ``max_new_tokens`` in this cell."""
        self.prepare()
        context, n = self.cfg.context, self.cfg.max_new_tokens
        if context < prompt_tokens + n:
            return Misfit(
                f"context={context} is too small: the prompt is {prompt_tokens} tokens and "
                f"max_new_tokens={n}, so the cache needs at least {prompt_tokens + n} slots",
                user_error=True,
            )
        limit = self.engine.limit(prompt_tokens, n)
        return Misfit(limit, user_error=False) if limit else None

    def require_fit(self, prompt_tokens: int) -> None:
        misfit = self.misfit(prompt_tokens)
        if misfit:
            raise misfit.error()

    def load(self) -> float | None:
        """Loads the engine once, timed; the seconds when this call loaded it, else None."""
        if self.load_s is not None:
            return None
        self.prepare()
        _, self.load_s = timed(self.device, self.engine.load)
        return self.load_s

    def call(self, ids: list[int], n: int, *, return_logits: bool = False) -> Generation:
        """``n`` greedy tokens after ``ids``, held to the exactly-``n`` contract."""
        gen = self.engine.generate(ids, n, return_logits=return_logits)
        return expect_tokens(gen, n, f"engine {self.engine.name}")

    def timed_call(self, ids: list[int], n: int) -> tuple[Generation, float]:
        return timed(self.device, lambda: self.call(ids, n))

    def timed_pair(self, ids: list[int]) -> tuple[float, Generation, float]:
        """A warm 1-token call and a warm N-token call on ``ids``: (T_1, the N-token generation, T_N)."""
        _, t1 = self.timed_call(ids, 1)
        gen, tn = self.timed_call(ids, self.cfg.max_new_tokens)
        return t1, gen, tn
