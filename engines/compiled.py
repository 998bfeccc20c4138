"""``compiled``: one compiled decode step over Transformers' StaticCache (article 003, Steps 7-8).

The StaticCache's tensors never change shape.  Its sliding-window layers count their length in a
Python int, which a compiled step treats as a constant and recompiles on; while every position the
run writes lies inside the sliding window, the plain static layer's methods give the same result
with the counter on the device (the article's fix), applied here to this engine's cache only.
Past the window that fix would write beyond the sliding layers' buffers (on the chip it halted the
TPU, Step 12), so the engine refuses such a cell instead.  Positions are device tensors, so the
step compiles once.

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
from engines.generate import static_cache_bytes
from engines.int4 import Weights
from engines.one_row import OneRow
from engines.stepping import SteppingEngine, SteppingEngineConfig, greedy

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


def forward_logits(model: Any, cache: StaticCache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Last-position logits [1, V] after ``ids`` [1, n] at ``positions`` [n] (device tensors), written to ``cache``."""
    out = model(input_ids=ids, position_ids=positions[None], cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


@dataclass
class CompiledEngineConfig(SteppingEngineConfig):
    """One compiled decode step over a StaticCache (article 003, Steps 7-8).

    ``remove_wrappers=false``: the model is loaded through Transformers' own compressed-tensors path
    and compressed-tensors' module wrappers are left on (the article's "wrappers on" row, Step 8).
    """

    remove_wrappers: bool = True
    keeps_table_4bit: ClassVar[bool] = False  # table4 keeps the per-layer table packed

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.remove_wrappers and self.one_row in (OneRow.mv, OneRow.rows):
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


class CompiledEngine(SteppingEngine):
    name = "compiled"
    config = CompiledEngineConfig

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
        self.cache = static_cache(self.model.config, self.ctx.context)

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
        last = forward_logits(self.model, self.cache, ids, torch.arange(len(prompt_ids), device=ids.device))
        return greedy(last), last

    def step(self, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = forward_logits(self.model, self.cache, token, position)
        return greedy(logits), logits

    def cache_bytes(self) -> int | None:
        return static_cache_bytes(self.cache)

    def close(self) -> None:
        super().close()
        self.cache = None

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "cache": f"transformers StaticCache, max_cache_len={self.ctx.context}, sliding-window fix",
            "loader": "decodebench" if self.ctx.engine_cfg.remove_wrappers else "transformers (compressed-tensors)",
            "wrapped_modules_before": self.wrapped_before,
            "wrapped_modules_after": self.wrapped_after,
            "wrapped_modules_at_end": dispatch_wrapped(self.model),
        }
