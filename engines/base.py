"""The engine interface: an engine is built loaded (``engines.open`` constructs it, the one place that
does), then greedily generates a token budget from prompt ids, until ``close()``.

The experiment puts ``device.sync()`` and the clock around the construction and ``generate``.  Engines that
step (``splits_phases``) also time their own two phases inside one call, as the Rust article's
engine does: ``read_s`` from the call's start until the first new token is ready on the device
(the prompt read), ``decode_s`` from then until the last token is on the host, each boundary after
a ``device.sync()``.  ``on_tokens`` is the one streaming hook (the server's): called on the calling
thread with each batch of new tokens as it reaches the host, in order; a false return stops the
call after that batch.  Without it, ``generate`` runs exactly as timed.  Capability flags
(``devices``) and ``unsupported_reason`` decide ``skipped`` cells; ``limit`` says what an engine cannot hold by design.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedTokenizerBase

from decodebench.checkpoint import Checkpoint
from decodebench.config import EngineConfig, ModelConfig
from decodebench.device import Device

CONTEXT_HEADROOM = 256  # cache slots allowed past max_position_embeddings (a padded last prompt piece)
OnTokens = Callable[[list[int]], bool]  # a batch of new token ids on the host -> go on (False: stop after it)


class EngineLimit(RuntimeError):
    """The engine cannot run this cell by design (recorded as ``skipped`` with this reason)."""


@dataclass
class Generation:
    """Tokens an engine wrote after the prompt; ``logits`` [n, vocab] float32 on the host when asked;
    the engine's own phase seconds (None when it cannot split a call)."""

    tokens: list[int]
    logits: torch.Tensor | None = None
    read_s: float | None = None
    decode_s: float | None = None


@dataclass
class EngineContext:
    """What every engine is built from: its own config, the run's model, device, dtype and cache size."""

    engine_cfg: EngineConfig
    model_cfg: ModelConfig
    device: Device
    dtype: torch.dtype
    context: int
    cache_dir: str
    read_every: int = 0


class Engine(ABC):
    """One way of running the model. Subclasses set ``name`` and ``config`` and implement ``load`` (called
    by the constructor: a constructed engine is complete) and ``generate``; ``close`` frees what it holds."""

    name: ClassVar[str]
    config: ClassVar[type[EngineConfig]]  # the typed config Hydra composes for ``engine=<name>``
    devices: ClassVar[tuple[str, ...]] = ("tpu", "cuda", "cpu")
    framework: ClassVar[str] = "torch"  # which framework's device the cell resolves (decodebench.device)
    streams: ClassVar[bool] = False  # True: the engine reads tokens to the host itself (read_every applies)
    splits_phases: ClassVar[bool] = False  # True: generate() fills Generation.read_s and decode_s
    scores_prompt: ClassVar[bool] = False  # True: prompt_logits() reads a prompt's logits at every position
    returns_logits: ClassVar[bool] = True  # False: generate(return_logits=True) cannot be answered (no parity)
    top_logprobs_k: ClassVar[int] = 0  # > 0: top_logprobs returns this many log-probabilities a position
    batches: ClassVar[bool] = False  # True: generate_batch decodes several sequences in each step
    joins: ClassVar[bool] = False  # True: rows join and leave a running batch (open_rows, admit, step_rows, release)
    model: torch.nn.Module | None = None  # the torch model, for engines that run one

    def __init__(self, ctx: EngineContext, checkpoint: Checkpoint, tokenizer: PreTrainedTokenizerBase) -> None:
        """Reads ``checkpoint`` onto ``ctx.device`` (``load``); the caller times the construction."""
        self.ctx = ctx
        self.checkpoint = checkpoint
        self.tokenizer = tokenizer
        self.load()

    @classmethod
    def unsupported_reason(cls, device: Device, run_cfg: Any) -> str | None:
        """Why this engine cannot run this cell here (recorded as ``skipped``), or None."""
        if device.kind not in cls.devices:
            return f"engine {cls.name} runs on {', '.join(cls.devices)}; this run's device is {device.kind}"
        return None

    @classmethod
    def twin(cls, engine_cfg: Any, model_cfg: Any) -> str:
        """Which twin this engine reads (``model.tables`` unless the engine keeps a table 4-bit)."""
        return model_cfg.tables

    @classmethod
    def limit(cls, config: Any, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why this engine cannot hold the prompt plus its new tokens by design (``skipped``), or None;
        ``config`` is the checkpoint's text config."""
        return None

    def top_logprobs(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[dict[int, float]]]:
        """Greedy tokens and, at each, the ``top_logprobs_k`` best ids with their log-probabilities: what an
        engine that cannot return every logit (``returns_logits=False``) gives parity instead."""
        raise EngineLimit(f"engine {self.name} returns no top log-probabilities")

    def endpoint(self) -> tuple[str, str] | None:
        """Where an OpenAI-compatible server already serves this engine: its base URL (without ``/v1``) and
        model id; None for an engine that runs in the cell's process (a load is served by decodebench's server)."""
        return None

    @classmethod
    def local_processes(cls, engine_cfg: Any) -> list[int]:
        """Other processes on this machine that do this engine's work (their CPU is the cell's own, not
        contention); none for an engine that runs in the cell's process."""
        return []

    @classmethod
    def dynamo_settings(cls, engine_cfg: Any, device: Device) -> dict[str, Any]:
        """TorchDynamo settings this engine needs while it is open on ``device`` (``engines.open`` sets and restores
        them)."""
        return {}

    @abstractmethod
    def load(self) -> None:
        """Reads the checkpoint onto the device (called once, by the constructor)."""

    @abstractmethod
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        return_logits: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> Generation:
        """Exactly ``max_new_tokens`` greedy tokens, never stopping at EOS (callers cut the answer).

        ``on_tokens``: called with each batch of tokens read to the host, in order (an engine that
        ``streams`` reads every ``read_every`` tokens, the stepping engines the first token alone as
        soon as the prompt read made it; the ``generate`` family hands over each token); when it
        returns False the call stops after that batch and ``tokens`` holds what was made so far.
        """

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        """Exactly ``max_new_tokens`` greedy tokens after each prompt (each its own length), the sequences decoded
        together: one step makes a token for every sequence. Each ``Generation`` carries the call's phase seconds
        (``read_s``: every prompt read; ``decode_s``: the steps). Engines that set ``batches``."""
        raise EngineLimit(f"engine {self.name} decodes one sequence at a time (batch=1)")

    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [len(prompt_ids), vocab] float32 on the host, row i from the ids up to i (it predicts token
        i + 1: the server's echoed log-probabilities); engines that set ``scores_prompt``. Not timed."""
        raise EngineLimit(f"engine {self.name} cannot read a prompt's logits at every position")

    def close(self) -> None:
        """Drops the model, caches and compiled programs; the engine cannot be called after this."""
        self.model = None

    @contextmanager
    def reading_every(self, k: int) -> Iterator[None]:
        """Temporarily read tokens to the host every ``k`` tokens."""
        saved = self.ctx.read_every
        self.ctx.read_every = k
        try:
            yield
        finally:
            self.ctx.read_every = saved

    def cache_bytes(self) -> int | None:
        """Bytes of the KV cache computed from its buffers' shapes, when the engine owns one."""
        return None

    def compiled_programs(self) -> int | None:
        """Programs this engine has compiled since it was opened (TorchDynamo's graphs, JAX's jitted programs), so an
        experiment can tell a timed call that compiled from a warm one; None for an engine that compiles nothing."""
        return None

    def weight_bytes(self) -> int | None:
        """Bytes of the model's parameters and buffers as held (each storage once), from their shapes.

        On a CPU the resident-set counters miss tables that are memory-mapped and never touched;
        this figure is what a device must hold.
        """
        if self.model is None:
            return None
        storages = {}
        for tensor in (*self.model.parameters(), *self.model.buffers()):
            if tensor.stride() and 0 in tensor.stride():
                continue  # zero-stride placeholders hold no memory
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return sum(storages.values())

    def describe(self) -> dict[str, Any]:
        """Engine-specific evidence (graph counts, cache layout, ...)."""
        return {}

    @property
    def eos_ids(self) -> list[int]:
        return self.checkpoint.eos_ids
