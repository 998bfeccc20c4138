"""``compiled``: one compiled decode step over Transformers' StaticCache (article 003, Steps 7-8).

The StaticCache's tensors never change shape.  Its sliding-window layers count their length in a
Python int, which a compiled step treats as a constant and recompiles on; while every position the
run writes lies inside the sliding window, the plain static layer's methods give the same result
with the counter on the device (the article's fix), applied here to this engine's cache only.
Past the window that fix would write beyond the sliding layers' buffers (on the chip it halted the
TPU, Step 12), so the engine refuses such a cell instead.  Positions are device tensors, so the
step compiles once.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from decodebench.config import CompiledEngineConfig
from engines.generate import static_cache_bytes
from engines.stepping import SteppingEngine, greedy

WINDOW_FIX = ("update", "get_seq_length", "get_mask_sizes")


def count_wrapped_modules(model: torch.nn.Module) -> int:
    """Modules whose forward compressed-tensors (or accelerate) wrapped; each one breaks a graph."""
    return sum(1 for m in model.modules() if hasattr(m, "_hf_hook") or "forward" in vars(m))


class CompiledEngine(SteppingEngine):
    name = "compiled"
    config = CompiledEngineConfig

    def build(self) -> None:
        self.wrapped_before = count_wrapped_modules(self.model)
        if self.wrapped_before:
            from compressed_tensors.offload.dispatch import remove_dispatch

            remove_dispatch(self.model)
        self.wrapped_after = count_wrapped_modules(self.model)
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.ctx.context)
        for layer in self.cache.layers:
            if isinstance(layer, StaticSlidingWindowLayer):
                for method in WINDOW_FIX:
                    setattr(layer, method, types.MethodType(getattr(StaticLayer, method), layer))

    def limit(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        assert self.checkpoint is not None
        window = self.checkpoint.config.sliding_window
        last = prompt_tokens + max_new_tokens
        if last <= window:
            return None
        return (
            f"engine {self.name} holds at most sliding_window={window} positions in its sliding "
            f"layers, and this cell needs {last} (prompt {prompt_tokens} + max_new_tokens "
            f"{max_new_tokens}): past the window the StaticCache recipe writes beyond those buffers "
            "(it halted the TPU in article 003, Step 12); use engine=ring"
        )

    def reset(self) -> None:
        self.cache.reset()

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([prompt_ids], device=self.ctx.device.torch_device)
        positions = torch.arange(len(prompt_ids), device=ids.device)[None]
        logits = self.model(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=1)
        last = logits.logits[:, -1]
        return greedy(last), last

    def step(self, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(
            input_ids=token, position_ids=position[None], cache=self.cache, use_cache=True, logits_to_keep=1
        )
        logits = out.logits[:, -1]
        return greedy(logits), logits

    def cache_bytes(self) -> int | None:
        return static_cache_bytes(self.cache)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "cache": f"transformers StaticCache, max_cache_len={self.ctx.context}, sliding-window fix",
            "wrapped_modules_before": getattr(self, "wrapped_before", None),
            "wrapped_modules_after": getattr(self, "wrapped_after", None),
        }
