"""What the step-by-step engines share: a compiled one-token step, graph counters, the decode loop.

A stepping engine implements ``reset`` (empty its cache), ``prefill`` (read the prompt, return the
first token and its logits) and ``step`` (one token in at a position, the next token out).  Tokens
and positions stay on the device; ``read_every`` decides how often tokens are read to the host.

Phase timers (wall clock, ``device.sync()`` at each boundary): ``read_s`` from the call's start to
the first new token ready on the device (reset + prefill), ``decode_s`` from there to the last of
the N tokens on the host (N-1 steps and the read-backs), so decode tok/s = (N-1) / decode_s.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters

from decodebench.checkpoint import PackedTable, load_model
from decodebench.config import Tables, Weights
from decodebench.device import Device
from engines import int4
from engines.base import Engine, Generation, OnTokens, decode_loop

Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def compile_backend(requested: str, device: Device) -> str | None:
    """``auto``: TorchTPU's ``tpu`` backend on a TPU, inductor on CUDA and CPU; ``none``: no compile."""
    if requested == "none":
        return None
    if requested == "auto":
        return "tpu" if device.kind == "tpu" else "inductor"
    return requested


def graph_counts() -> dict[str, int]:
    """Graphs compiled and graph breaks so far, from TorchDynamo's own counters."""
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[1, V] logits -> [1, 1] token ids, on the device."""
    return logits.argmax(-1, keepdim=True)


class SteppingEngine(Engine):
    """Prefill once, then a compiled one-token step per new token."""

    keep_packed: tuple[str, ...] = ()
    streams = True
    splits_phases = True

    @classmethod
    def unsupported_reason(cls, device: Device, run_cfg: Any) -> str | None:
        if run_cfg.engine.weights == Weights.int4:
            reason = int4.unsupported(device.kind, run_cfg.dtype.torch)
            if reason:
                return reason
        return super().unsupported_reason(device, run_cfg)

    def twin(self) -> str:
        """``engine.weights=int4`` reads the ``-emb4`` twin, whose tables and ``lm_head`` are int4 too."""
        return Tables.int4 if self.ctx.engine_cfg.weights == Weights.int4 else super().twin()

    def load(self) -> None:
        assert self.checkpoint is not None
        counters.clear()
        torch._dynamo.reset()
        device, dtype = self.ctx.device.torch_device, self.ctx.dtype
        self.int4 = self.ctx.engine_cfg.weights == Weights.int4
        lookups = tuple(dict.fromkeys(self.keep_packed + (int4.LOOKUPS if self.int4 else ())))
        keep = lookups + (("lm_head",) if self.int4 else ())
        self.model, packed = self.load_weights(keep)
        self.packed_tables = {p: w for p, w in packed.items() if p.rpartition(".")[2] in lookups}
        int4.swap_lookups(self.model, self.packed_tables, dtype, device)
        linears = {p: w for p, w in packed.items() if p not in self.packed_tables}
        if self.int4 and "lm_head" not in linears and self.model.config.tie_word_embeddings:
            linears["lm_head"] = self.packed_tables["model.embed_tokens"]  # tied: lm_head reads the same table
        self.int4_linears = int4.swap_linears(self.model, linears, dtype, device)
        self.backend = compile_backend(self.ctx.engine_cfg.backend, self.ctx.device) or "none"
        self.build()
        self.compiled_step: Step = self.compile(self.step)

    def load_weights(self, keep: tuple[str, ...]) -> tuple[torch.nn.Module, dict[str, PackedTable]]:
        """The model on the device from decodebench's loader, with the weights named in ``keep`` (and every
        linear when ``engine.weights=int4``) left packed for the engine to swap in."""
        assert self.checkpoint is not None
        device, dtype = self.ctx.device.torch_device, self.ctx.dtype
        return load_model(self.checkpoint, dtype, device, keep, keep_linears=self.int4)

    def compile(self, fn: Step) -> Step:
        """``fn`` compiled once for fixed shapes with the engine's backend (unchanged for backend=none)."""
        if self.backend == "none":
            return fn
        return torch.compile(fn, backend=self.backend, dynamic=False, fullgraph=self.ctx.engine_cfg.fullgraph)

    def build(self) -> None:
        """Engine-specific set-up after the weights are on the device (caches, module swaps)."""

    def before_step(self, position: int) -> None:
        """Called on the host before each step with the position it writes (for programs that depend on it)."""

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reads the prompt; returns the first new token [1, 1] and its logits [1, V], on the device."""

    @abstractmethod
    def step(self, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token [1, 1] at ``position`` [1] (device tensors) -> the next token [1, 1] and logits [1, V]."""

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        return_logits: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> Generation:
        sync = self.ctx.device.sync
        sync()
        start = time.perf_counter()
        self.reset()
        token, logits = self.prefill(prompt_ids)
        sync()
        first = time.perf_counter()
        position = torch.tensor([len(prompt_ids)], device=self.ctx.device.torch_device)

        def step(i: int, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal position
            self.before_step(len(prompt_ids) + i)
            token, logits = self.compiled_step(token, position)
            position = position + 1
            return token, logits

        tokens, kept_logits = decode_loop(
            token,
            logits,
            step,
            max_new_tokens,
            self.ctx.read_every or max_new_tokens,
            lambda batch: torch.cat(batch).view(-1).tolist(),
            on_tokens,
            return_logits,
        )
        sync()
        end = time.perf_counter()
        stacked = torch.cat(kept_logits).float().cpu() if return_logits else None
        return Generation(tokens, stacked, read_s=first - start, decode_s=end - first)

    def describe(self) -> dict[str, Any]:
        weights: dict[str, Any] = {"weights": str(self.ctx.engine_cfg.weights)}
        if getattr(self, "int4", False):
            weights.update(int4_kernel=int4.KERNELS[self.ctx.device.kind], int4_linears=self.int4_linears)
        for path, table in getattr(self, "packed_tables", {}).items():
            rows, cols = table.shape
            weights[f"{path.rpartition('.')[2]}_bytes"] = table.packed.nbytes + table.scale.nbytes
            weights[f"{path.rpartition('.')[2]}_dense_bytes"] = rows * cols * self.ctx.dtype.itemsize
        return {
            "backend": getattr(self, "backend", None),
            "read_every": self.ctx.read_every,
            **weights,
            **graph_counts(),
        }
