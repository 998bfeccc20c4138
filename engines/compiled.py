"""``compiled``: one compiled decode step over Transformers' StaticCache (article 003, Steps 7-8).

The StaticCache's tensors never change shape.  Its sliding-window layers count their length in a
Python int, which a compiled step treats as a constant and recompiles on; while every position the
run writes lies inside the sliding window, the plain static layer's methods give the same result
with the counter on the device (the article's fix), applied here to this engine's cache only.
Past the window that fix would write beyond the sliding layers' buffers (on the chip it halted the
TPU, Step 12), so the engine refuses such a cell instead.  Positions are device tensors, so the
step compiles once.

``generate_batch`` (``experiment.batch``) reads each prompt alone and copies it into a row of a batch StaticCache,
right-aligned with the longest (the StaticCache counts one slot for every row, so a shorter prompt's first slots
are its padding, masked), then steps every row at once; a sequence cannot join a running batch (the ring does).

By default the model comes from decodebench's loader, which builds plain modules (nothing to
unwrap; compressed-tensors' ``remove_dispatch`` runs if any wrapper is found).  With
``engine.remove_wrappers=false`` it comes from Transformers' own compressed-tensors path and the
wrappers compressed-tensors puts on the modules (compressed-tensors 0.20 adds them at the first
forward, when it unpacks the weights) stay on: the article's "wrappers on" row, whose graphs and breaks TorchDynamo's
counters give (``describe``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from decodebench.checkpoint import PackedTable, load_reference
from decodebench.config import ConfigError
from engines import attention_cpu
from engines.base import Generation
from engines.generate import static_cache_bytes
from engines.int4 import Weights
from engines.one_row import OneRow
from engines.stepping import SteppingEngine, SteppingEngineConfig
from engines.steps import batch_call

WINDOW_FIX = ("update", "get_seq_length", "get_mask_sizes")


def dispatch_wrapped(model: torch.nn.Module) -> int:
    """Modules whose forward compressed-tensors' dispatch (``_original_forward_func``) or accelerate
    (``_hf_hook``) wrapped to move its inputs first: what ``remove_dispatch`` takes off."""
    return sum(1 for m in model.modules() if hasattr(m, "_original_forward_func") or hasattr(m, "_hf_hook"))


def forward_replaced(model: torch.nn.Module) -> int:
    """Modules whose forward is not their class's own (any wrapper: dispatch, quantize-dequantize, hooks)."""
    return sum(
        1
        for m in model.modules()
        if "forward" in vars(m) and getattr(vars(m)["forward"], "__func__", None) is not type(m).forward
    )


def static_cache(config: Any, slots: int) -> StaticCache:
    """Transformers' StaticCache of ``slots`` positions with the article's sliding-window fix."""
    cache = StaticCache(config=config, max_cache_len=slots)
    for layer in cache.layers:
        if isinstance(layer, StaticSlidingWindowLayer):
            for method in WINDOW_FIX:
                setattr(layer, method, types.MethodType(getattr(StaticLayer, method), layer))
    return cache


def forward_logits(
    model: Any, cache: StaticCache, ids: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor | None = None
) -> torch.Tensor:
    """Last-position logits [B, V] after ``ids`` [B, n] at ``positions`` [B, n] (device tensors), written to ``cache``
    at its next n slots (one slot count for every row). ``padding``: [B, slots] bool, False at the slots before a row's
    first token (a batch's left padding, masked), True from there on; None: no row is padded."""
    out = model(input_ids=ids, position_ids=positions, attention_mask=padding, cache=cache, use_cache=True,
                logits_to_keep=1)  # fmt: skip
    return out.logits[:, -1]


def written(cache: StaticCache, like: StaticCache) -> list[tuple[StaticLayer, StaticLayer]]:
    """The layers of two StaticCaches of one config that hold K/V buffers, paired (a KV-shared layer holds none)."""
    return [(a, b) for a, b in zip(cache.layers, like.layers, strict=True) if isinstance(a, StaticLayer)]


def rows_cache(single: StaticCache, config: Any, slots: int, rows: int) -> StaticCache:
    """A StaticCache of ``rows`` sequences shaped as ``single`` (one sequence, already written), with the same fix."""
    cache = static_cache(config, slots)
    for layer, like in written(cache, single):
        layer.lazy_initialization(like.keys.expand(rows, -1, -1, -1), like.values.expand(rows, -1, -1, -1))
    return cache


def take_row(rows: StaticCache, row: int, single: StaticCache, tokens: int, end: int) -> None:
    """Copies the ``tokens`` slots ``single`` holds into ``rows``' row ``row`` so that they end at slot ``end``:
    a shorter prompt is right-aligned with the longest (the slots before it are the row's padding)."""
    for into, out in written(rows, single):
        into.keys[row, :, end - tokens : end] = out.keys[0, :, :tokens]
        into.values[row, :, end - tokens : end] = out.values[0, :, :tokens]
        into.cumulative_length.fill_(end)


@dataclass
class CompiledEngineConfig(SteppingEngineConfig):
    """One compiled decode step over a StaticCache (article 003, Steps 7-8).

    ``remove_wrappers=false``: the model is loaded through Transformers' own compressed-tensors path
    and compressed-tensors' module wrappers are left on (the article's "wrappers on" row, Step 8).
    ``decode_attention`` (``SteppingEngineConfig``): ``auto`` gives a decode step's attention to the project's
    ``one_query`` where it runs, through Transformers' attention interface (``attention_cpu.use_in``), with the
    wrappers on or off; ``sdpa`` keeps Transformers' own, as the article ran it.
    """

    remove_wrappers: bool = True
    keeps_table_4bit: ClassVar[bool] = False  # table4 keeps the per-layer table packed

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.remove_wrappers and self.one_row != OneRow.auto:
            raise ConfigError(
                f"engine.one_row={self.one_row} has no effect with engine.remove_wrappers=false: that is the article's "
                "Transformers path, whose linears are kept as compressed-tensors wraps them; leave engine.one_row=auto"
            )
        if not self.remove_wrappers and (self.keeps_table_4bit or self.weights == Weights.int4):
            raise ConfigError(
                "engine.remove_wrappers=false loads through Transformers' compressed-tensors path, which unpacks "
                f"every weight to the run's dtype: it cannot keep weights 4-bit (engine={self.name}, "
                f"engine.weights={self.weights}); use engine=compiled engine.weights=dense"
            )

    def settings_without_effect(self) -> tuple[str, ...]:
        """With the wrappers on, ``one_row`` too: no linear is swapped for a one-row kernel."""
        return (*super().settings_without_effect(), *(() if self.remove_wrappers else ("one_row",)))


class CompiledEngine(SteppingEngine):
    name = "compiled"
    config = CompiledEngineConfig
    batches = True

    def load_weights(self, keep: tuple[str, ...]) -> tuple[torch.nn.Module, dict[str, PackedTable]]:
        if self.ctx.engine_cfg.remove_wrappers:
            return super().load_weights(keep)
        return load_reference(self.checkpoint, self.ctx.dtype, self.ctx.device.torch_device), {}

    def takes_one_row(self) -> bool:
        """Not with ``remove_wrappers=false``: the article's Transformers path keeps its own linears."""
        return self.ctx.engine_cfg.remove_wrappers

    def build(self) -> None:
        self.wrapped_before = dispatch_wrapped(self.model)
        if self.wrapped_before and self.ctx.engine_cfg.remove_wrappers:
            from compressed_tensors.offload.dispatch import remove_dispatch

            remove_dispatch(self.model)
        self.wrapped_after = dispatch_wrapped(self.model)
        if self.decode_attention == attention_cpu.OP:
            attention_cpu.use_in(self.model)
        self.cache = static_cache(self.model.config, self.ctx.context)
        self.batch_cache: StaticCache | None = None  # generate_batch's, a row per sequence (built at first use)
        self.compiled_rows_step = self.compile(self.rows_step)

    @classmethod
    def limit(cls, config: Any, prompt_tokens: int, max_new_tokens: int) -> str | None:
        window = config.sliding_window
        last = prompt_tokens + max_new_tokens
        if last <= window:
            return None
        return (
            f"engine {cls.name} holds at most sliding_window={window} positions in its sliding "
            f"layers, and this cell needs {last} (prompt {prompt_tokens} + max_new_tokens "
            f"{max_new_tokens}): past the window the StaticCache recipe writes beyond those buffers "
            "(it halted the TPU in article 003, Step 12); use engine=ring"
        )

    def reset(self) -> None:
        self.cache.reset()

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([prompt_ids], device=self.ctx.device.torch_device)
        last = forward_logits(self.model, self.cache, ids, torch.arange(len(prompt_ids), device=ids.device)[None])
        return self.greedy(last), last

    def step(self, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = forward_logits(self.model, self.cache, token, position[None])
        return self.greedy(logits), logits

    def rows_step(
        self, token: torch.Tensor, position: torch.Tensor, padding: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token a sequence of the batch cache: ``token`` [B, 1] at ``position`` [B, 1], ``padding`` [B, slots]
        (``forward_logits``) -> the next [B, 1] and logits [B, V]."""
        logits = forward_logits(self.model, self.batch_cache, token, position, padding)
        return self.greedy(logits), logits

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        """Each prompt read alone (``prefill``, the one-sequence programs) and its cache copied into a row of a batch
        StaticCache, right-aligned so that every prompt ends at the longest one's last slot (the slots before a
        shorter one are masked as padding: the StaticCache counts one slot for every row); then one compiled step
        for every row at once (``rows_step``), each at its own position; tokens and phase timers as
        ``steps.batch_call`` keeps them."""
        device, rows, longest = self.ctx.device.torch_device, len(prompts), max(map(len, prompts))
        lengths = torch.tensor([len(ids) for ids in prompts], device=device)
        padding = torch.arange(self.ctx.context, device=device)[None] >= (longest - lengths)[:, None]
        position = lengths[:, None]

        def read() -> torch.Tensor:
            first_tokens = []
            for row, ids in enumerate(prompts):
                self.reset()
                token, _ = self.prefill(ids)
                if self.batch_cache is None or self.batch_cache.layers[0].batch_size != rows:
                    self.batch_cache = rows_cache(self.cache, self.model.config, self.ctx.context, rows)
                take_row(self.batch_cache, row, self.cache, len(ids), longest)
                first_tokens.append(token)
            return torch.cat(first_tokens)

        def step(token: torch.Tensor) -> torch.Tensor:
            nonlocal position
            token, _ = self.compiled_rows_step(token, position, padding)
            position = position + 1
            return token

        with self.running():
            return batch_call(self.ctx.device.sync, read, step, max_new_tokens)

    def cache_bytes(self) -> int | None:
        return static_cache_bytes(self.cache)

    def close(self) -> None:
        super().close()
        self.cache = self.batch_cache = self.compiled_rows_step = None

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "cache": f"transformers StaticCache, max_cache_len={self.ctx.context}, sliding-window fix",
            "loader": "decodebench" if self.ctx.engine_cfg.remove_wrappers else "transformers (compressed-tensors)",
            "wrapped_modules_before": self.wrapped_before,
            "wrapped_modules_after": self.wrapped_after,
            "wrapped_modules_at_end": dispatch_wrapped(self.model),
        }
