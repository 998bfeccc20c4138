"""The one engine lifecycle, for the runner, the server and every experiment: ``open_engine``.

``open_engine(run, device)`` binds an engine class to a run's typed config and device: it refuses what
the engine cannot run here (``EngineLimit``: the cell is ``skipped``), finds the checkpoint the engine
reads (building a synthetic one on first use) and its tokenizer, and checks that the model addresses
the context. What it returns, an ``OpenEngine``, holds the fit rule and the prompt encoder; its
``load()`` builds the engine, the one place an engine class is constructed (a constructed engine is
loaded and complete; ``Cell`` times this call), and ``close()`` frees it. Global framework state is set
and restored here only (``FrameworkState``).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import counters
from transformers import PreTrainedTokenizerBase

from decodebench.checkpoint import Checkpoint, load_tokenizer, resolve
from decodebench.config import ConfigError, RunConfig
from decodebench.device import Device
from decodebench.prompts import prompt_ids
from engines import engine_class, streamers
from engines.base import CONTEXT_HEADROOM, Engine, EngineContext, EngineLimit


@dataclass(frozen=True)
class Misfit:
    """Why a prompt does not fit an engine's cache; ``user_error``: the cell fails (the user asked for a
    cache too small), else it is skipped (the engine cannot hold it by design)."""

    reason: str
    user_error: bool

    def error(self) -> Exception:
        return ConfigError(self.reason) if self.user_error else EngineLimit(self.reason)


class FrameworkState:
    """Global framework state around one engine's life, the one place it is set and restored: TorchDynamo
    starts clean (no programs, zeroed counters, so each engine's graph counts are its own), takes the
    engine's own settings while it is open (``Engine.dynamo_settings``), and is reset when it closes (its
    compiled programs go with it). Nothing runs if the engine is never closed (no finalizer)."""

    def __init__(self, cls: type[Engine], engine_cfg: Any, device: Device) -> None:
        self.torch = cls.framework == "torch"
        self.settings = torch._dynamo.config.patch(cls.dynamo_settings(engine_cfg, device)) if self.torch else None

    def open(self) -> None:
        if self.torch:
            counters.clear()
            torch._dynamo.reset()
            self.settings.__enter__()

    def close(self) -> None:
        if self.torch:
            self.settings.__exit__(None, None, None)
            torch._dynamo.reset()


def freeze_what_came_before() -> None:
    """Once a process, before its first engine: what lives then (modules, configs) is moved out of the
    collector's sight (``gc.freeze``), so each ``close``'s collection walks only what engines and cells made
    since, not every object the imports made (half a million: a quarter of a second a collection here, about
    half a second in a pytest process that has run many cells). Garbage is collected first: nothing is kept."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


@dataclass
class OpenEngine:
    """An engine class bound to one run: its context, checkpoint and tokenizer; the engine once loaded."""

    cls: type[Engine]
    ctx: EngineContext
    checkpoint: Checkpoint
    tokenizer: PreTrainedTokenizerBase
    chat_template: bool = True
    engine: Engine | None = None
    state: FrameworkState | None = field(default=None, repr=False)  # set while the engine is open

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def eos_ids(self) -> list[int]:
        return self.checkpoint.eos_ids

    def encode(self, text: str) -> list[int]:
        """The run's prompt encoder: ``text`` as the model reads it (chat template or BOS + text)."""
        return prompt_ids(self.tokenizer, text, self.chat_template)

    def misfit(self, prompt_tokens: int, new_tokens: int, budget: str = "max_new_tokens") -> Misfit | None:
        """The one fit rule: a prompt of ``prompt_tokens`` plus ``new_tokens`` (the setting named ``budget``)
        in this cache. Too small a cache is the user's error; what the engine cannot hold by design is its
        limit."""
        context = self.ctx.context
        if context < prompt_tokens + new_tokens:
            return Misfit(
                f"context={context} is too small: the cache holds {context} tokens, the prompt is {prompt_tokens} "
                f"tokens and {budget}={new_tokens}, so it needs at least {prompt_tokens + new_tokens} slots",
                user_error=True,
            )
        limit = self.cls.limit(self.checkpoint.config, prompt_tokens, new_tokens)
        return Misfit(limit, user_error=False) if limit else None

    def require_fit(self, prompt_tokens: int, new_tokens: int, budget: str = "max_new_tokens") -> None:
        misfit = self.misfit(prompt_tokens, new_tokens, budget)
        if misfit:
            raise misfit.error()

    def load(self) -> Engine:
        """The engine, built (read onto the device) on the first call; the one place an engine is constructed."""
        if self.engine is None:
            freeze_what_came_before()
            self.state = FrameworkState(self.cls, self.ctx.engine_cfg, self.ctx.device)
            self.state.open()
            self.engine = self.cls(self.ctx, self.checkpoint, self.tokenizer)
        return self.engine

    def close(self) -> None:
        """Frees the engine's model, caches and compiled programs, so the next engine starts clean."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.state is not None:
            self.state.close()
            self.state = None
        gc.collect()


def open_engine(run: RunConfig, device: Device) -> OpenEngine:
    """The engine ``run.engine`` names, on ``device``, prepared but not loaded.

    Raises ``EngineLimit`` when the engine cannot run here (the cell is skipped, with the reason) and
    ``ConfigError`` when the context is more than the model can address, or ``read_every`` asks an engine
    that hands over every token as it is made (it does not read tokens back itself) for batches of more.
    """
    cls = engine_class(run.engine.name)
    if run.read_every > 1 and not cls.streams:
        raise ConfigError(
            f"read_every={run.read_every} has no effect on engine {cls.name}: it does not read tokens back itself "
            f"(it hands each token or chunk over as it comes; read_every 0 or 1), batched read-backs are a "
            f"setting of {', '.join(streamers())}"
        )
    reason = cls.unsupported_reason(device, run)
    if reason:
        raise EngineLimit(reason)
    checkpoint = resolve(run.model, cls.twin(run.engine, run.model), run.cache_dir)
    positions = checkpoint.config.max_position_embeddings
    if run.context > positions + CONTEXT_HEADROOM:
        raise ConfigError(
            f"context={run.context} is above what the model can address: max_position_embeddings="
            f"{positions} plus {CONTEXT_HEADROOM} slots of headroom (one prompt piece, as in the "
            f"article's 131,328 = 131,072 + 256) = {positions + CONTEXT_HEADROOM}"
        )
    ctx = EngineContext(run.engine, run.model, device, run.dtype.torch, run.context, run.cache_dir, run.read_every)
    return OpenEngine(cls, ctx, checkpoint, load_tokenizer(checkpoint), run.chat_template)
