"""What the torch step-by-step engines share: a compiled one-token step, 4-bit weights, graph counters.

A stepping engine implements ``reset`` (empty its cache), ``prefill`` (read the prompt, return the
first token and its logits) and ``step`` (one token in at a position, the next token out), all on
torch tensors on the device; the call itself (phase timers, read-backs, streaming) is the shared
skeleton in ``engines/steps.py``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import counters

from decodebench.checkpoint import PackedTable, load_model
from decodebench.config import ConfigError, EngineConfig, Tables
from decodebench.device import Device
from engines import attention_cpu, cpu_kernels, greedy_cpu, held, int4, int4_cpu, one_row
from engines.attention_cpu import DecodeAttention
from engines.int4 import Weights
from engines.one_row import OneRow
from engines.product_bytes import product_bytes
from engines.steps import SteppedEngine

Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# TorchInductor's options before ``engine.inductor``'s: a fused kernel rounds each bf16 / fp16 intermediate as
# eager PyTorch does (Transformers' reference runs eager), instead of keeping it in float32 across the fusion.
# Without it the compiled step's bf16 logits part from Transformers' by more than the bf16 parity bound on
# e2b-synthetic (KL mean 1.38e-3 against 1e-3); with it 1.85e-4, as close as generate's own loop (1.89e-4).
INDUCTOR_DEFAULTS = {"emulate_precision_casts": True}
# The stepping engines' compiles also leave out TorchInductor's size asserts (``size_asserts``): its Python wrapper
# checked the size and strides of every input and of every operator's output it did not generate before each call,
# 977 checks a step of the e2b-synthetic int4 ring at 0.94 us each on the 2-core Xeon of model 207, 0.9 ms of its
# 57-62 ms step. The checks repeat what is fixed once loaded: the frozen model's weights (``frozen_model_guards``) and
# the outputs of the operators it calls as they are (the project's kernels, whose fake kernels state those shapes);
# TorchDynamo's guards still check the engine's own state before each call. ``+engine.inductor.size_asserts=true``
# puts them back.
STEP_DEFAULTS = {**INDUCTOR_DEFAULTS, "size_asserts": False}
MODEL_SOURCE = "self.model"  # how TorchDynamo names the model reached from a compiled method's ``self``
KEPT_ON_MODEL = ("DUPLICATE_INPUT", "NO_TENSOR_ALIASING")  # guard kinds on it that still run


def frozen_model_guards(entries: list[Any]) -> list[bool]:
    """TorchDynamo's guard filter (``guard_filter_fn``) for an engine's compiled step or piece: every guard but those
    on the model (its module tree, weights and config) other than aliasing checks. Once loaded the model is frozen
    (its modules, their attributes and hooks, its weights' shapes and kinds, its config), yet TorchDynamo checked it
    again before every call: about 12,900 of a program's 13,800 guards on E2B (empty hook dicts, module types,
    ``in_features``, 860 weight tensors), 2.1 ms of a 34 ms int4 step under the profiler, 0.3 ms without them. Every
    guard on the engine's own state (the ring's tensors and bucket, a piece's length, the tokens) and on globals
    (grad mode) still runs."""
    def kept(entry: Any) -> bool:
        on_model = entry.name == MODEL_SOURCE or entry.name.startswith((f"{MODEL_SOURCE}.", f"{MODEL_SOURCE}["))
        return not on_model or entry.guard_type in KEPT_ON_MODEL

    return [kept(entry) for entry in entries]


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


@dataclass
class SteppingEngineConfig(EngineConfig):
    """What every compiled-step engine shares.

    ``backend``: auto (tpu on a TPU, inductor elsewhere), any torch.compile backend name, or none.
    ``inductor``: options for TorchInductor's compile (``torch.compile(options=...)``, e.g.
    ``+engine.inductor.cpp_wrapper=true``: C++ instead of Python between kernels), over ``STEP_DEFAULTS``
    (``+engine.inductor.emulate_precision_casts=false`` turns eager's rounding off, ``size_asserts=true`` puts
    TorchInductor's checks of sizes and strides back); refused with any other
    backend, and an option TorchInductor does not know is refused by it when the step compiles.
    ``one_row``: which kernel a dense linear calls on one row (``engines/one_row.py``: ``auto`` is the fastest on
    this CPU, measured on the model's own shapes; ``rows`` the project's ``bf16_rows`` for every row count,
    skipped, named, where it cannot run); refused other than ``auto`` where no linear is dense
    (``engine.weights=int4``). ``int4_limbs``: how many 7-bit limbs ``int4_rows`` holds each input of an int4 linear
    in (``engines.int4_cpu.LIMBS``: 3, or 2 for two thirds of its products, inputs far below their block's largest
    rounded coarser); other than 3, refused where no linear is 4-bit and skipped where ``int4_rows`` does not run.
    ``decode_attention``: which attention a decode step calls (``engines.attention_cpu``: ``auto`` the project's
    ``one_query`` where it runs, aten's elsewhere; ``sdpa`` aten's, for ``compiled`` and ``table4`` Transformers' own
    sdpa unchanged; ``one_query`` it, the cell skipped, with the reason, where it cannot run).
    """

    backend: str = "auto"
    fullgraph: bool = False
    weights: Weights = Weights.dense
    inductor: dict[str, Any] = field(default_factory=dict)
    one_row: OneRow = OneRow.auto
    int4_limbs: int = int4_cpu.DEFAULT_LIMBS
    decode_attention: DecodeAttention = DecodeAttention.auto

    def __post_init__(self) -> None:
        if reason := int4.one_row_refused(self.one_row, self.weights) or int4.limbs_refused(self.int4_limbs,
                                                                                             self.weights):
            raise ConfigError(reason)

    def settings_without_effect(self) -> tuple[str, ...]:
        """The settings that take no effect with the others, for the evidence (each refused there other than at its
        default, so its value says nothing of the way)."""
        return int4.settings_without_effect(self.weights)


class SteppingEngine(SteppedEngine):
    """Prefill once, then a compiled one-token step per new token."""

    keep_packed: tuple[str, ...] = ()  # vocabulary tables this engine always keeps 4-bit

    @classmethod
    def dynamo_settings(cls, engine_cfg: Any, device: Device) -> dict[str, Any]:
        """The frozen model's tensors held by each compiled program (``install_free_tensors``: graph attributes)
        instead of gathered again before every call as its inputs: on E2B with int4 linears that gathering was
        5,500 bytecode instructions (860 tensors looked up module by module), 0.39 ms a step under the profiler;
        231 instructions and 0.006 ms held. The engine's own state (caches, rings, tokens) stays an input. Not for
        TorchTPU's ``tpu`` backend, which would be handed the weights inside the program (not tried): there they
        stay inputs, as in the article."""
        if compile_backend(engine_cfg.backend, device) == "tpu":
            return {}
        return {"install_free_tensors": True}

    @classmethod
    def kept_4bit(cls, engine_cfg: Any) -> tuple[str, ...]:
        """The vocabulary tables this engine keeps packed 4-bit (read from the ``-emb4`` twin) as configured."""
        return cls.keep_packed

    @classmethod
    def unsupported_reason(cls, device: Device, run_cfg: Any) -> str | None:
        if run_cfg.engine.weights == Weights.int4:
            reason = int4.unsupported(device.kind, run_cfg.dtype.torch)
            reason = reason or int4.limbs_unsupported(run_cfg.engine.int4_limbs, device.kind, run_cfg.dtype.torch)
            if reason:
                return reason
        if reason := one_row.rows_refused(run_cfg.engine.one_row, device.kind, run_cfg.dtype.torch):
            return reason
        if reason := attention_cpu.refused(run_cfg.engine.decode_attention, device.kind, run_cfg.dtype.torch):
            return reason
        return super().unsupported_reason(device, run_cfg)

    @classmethod
    def twin(cls, engine_cfg: Any, model_cfg: Any) -> str:
        """A table kept 4-bit, or ``engine.weights=int4``, reads the ``-emb4`` twin, whose tables and
        ``lm_head`` are int4."""
        if engine_cfg.weights == Weights.int4 or cls.kept_4bit(engine_cfg):
            return Tables.int4
        return super().twin(engine_cfg, model_cfg)

    def load(self) -> None:
        self.backend = compile_backend(self.ctx.engine_cfg.backend, self.ctx.device) or "none"
        if self.ctx.engine_cfg.inductor and self.backend != "inductor":  # refused before any weight is read
            raise ConfigError(f"engine.inductor={dict(self.ctx.engine_cfg.inductor)} has no effect with backend "
                              f"{self.backend}: it sets TorchInductor's options")  # fmt: skip
        device, dtype = self.ctx.device.torch_device, self.ctx.dtype
        self.int4 = self.ctx.engine_cfg.weights == Weights.int4
        lookups = tuple(dict.fromkeys(self.kept_4bit(self.ctx.engine_cfg) + (int4.LOOKUPS if self.int4 else ())))
        keep = lookups + (("lm_head",) if self.int4 else ())
        self.model, packed = self.load_weights(keep)
        tied = self.int4 and self.model.config.tie_word_embeddings
        self.packed_tables, linears = int4.split_packed(packed, lookups, tied)
        int4.swap_lookups(self.model, self.packed_tables, dtype, device)
        self.int4_linears = int4.swap_linears(self.model, linears, dtype, device,
                                              limbs=self.ctx.engine_cfg.int4_limbs)  # fmt: skip
        self.joined_linears = self.join_linears()
        self.held_together_bytes = held.hold_together(self.model)
        self.row_linears = 0
        self.one_row_choice = None
        if self.takes_one_row():
            self.one_row_choice = one_row.choose_for(self.model, self.ctx.engine_cfg.one_row, self.ctx.device.kind,
                                                     self.ctx.cache_dir)  # fmt: skip
            if self.one_row_choice.one_row == OneRow.mv:
                self.row_linears = one_row.swap_dense_linears(self.model)
            elif self.one_row_choice.one_row == OneRow.rows:
                self.row_linears = one_row.pack_dense_linears(self.model)
        self.greedy_kernel = greedy_cpu.choose(self.ctx.device.kind, self.ctx.dtype)
        self.decode_attention = attention_cpu.choose(self.ctx.engine_cfg.decode_attention, self.ctx.device.kind,
                                                     self.ctx.dtype, self.model.config)  # fmt: skip
        self.build()
        self.compiled_step: Step = self.compile(self.step)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> [B, 1] token ids, on the device, with the kernel chosen at load (``greedy_cpu``)."""
        return greedy_cpu.pick(logits, self.greedy_kernel)

    def load_weights(self, keep: tuple[str, ...]) -> tuple[torch.nn.Module, dict[str, PackedTable]]:
        """The model on the device from decodebench's loader, with the weights named in ``keep`` (and every
        linear when ``engine.weights=int4``) left packed for the engine to swap in."""
        device, dtype = self.ctx.device.torch_device, self.ctx.dtype
        return load_model(self.checkpoint, dtype, device, keep, keep_linears=self.int4)

    def compile(self, fn: Step) -> Step:
        """``fn`` compiled with the engine's backend (unchanged for backend=none): for fixed shapes, or, where
        ``dynamic_shapes`` says so, made dynamic by TorchDynamo once it sees a second length; the frozen model's
        structure guarded once, not before every call (``frozen_model_guards``)."""
        if self.backend == "none":
            return fn
        dynamic = None if self.dynamic_shapes() else False
        options = {**self.inductor_options(), "guard_filter_fn": frozen_model_guards}
        return torch.compile(fn, backend=self.backend, dynamic=dynamic, fullgraph=self.ctx.engine_cfg.fullgraph,
                             options=options)  # fmt: skip

    def inductor_options(self) -> dict[str, Any]:
        """The options TorchInductor compiles with: ``STEP_DEFAULTS`` under ``engine.inductor``; none for
        another backend."""
        if self.backend != "inductor":
            return {}
        return {**STEP_DEFAULTS, **self.ctx.engine_cfg.inductor}

    def dynamic_shapes(self) -> bool:
        """Whether a compiled program may take a dimension that changes from call to call (one program for
        every length) instead of one program per shape."""
        return False

    def join_linears(self) -> int:
        """Joins linears that read one input into one product where the engine's own forward calls them so
        (``engines.joined``), before ``engine.one_row`` decides the dense ones' call; how many joined linears."""
        return 0

    def takes_one_row(self) -> bool:
        """Whether ``engine.one_row`` may change this engine's linears (not on a path kept as Transformers has it)."""
        return True

    def build(self) -> None:
        """Engine-specific set-up after the weights are on the device (caches, module swaps)."""

    def before_step(self, position: int) -> None:
        """Called on the host before each step with the position it writes (for programs that depend on it)."""

    @abstractmethod
    def step(self, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token [1, 1] at ``position`` [1] (device tensors) -> the next token [1, 1] and logits [1, V]."""

    def running(self) -> AbstractContextManager[Any]:
        return torch.inference_mode()

    def position(self, prompt_tokens: int) -> torch.Tensor:
        return torch.tensor([prompt_tokens], device=self.ctx.device.torch_device)

    def advance(self, at: int, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.before_step(at)
        token, logits = self.compiled_step(token, position)
        return token, logits, position + 1

    def device_token(self, token: int) -> torch.Tensor:
        return torch.tensor([[token]], device=self.ctx.device.torch_device)

    def to_host(self, batch: list[torch.Tensor]) -> list[int]:
        return torch.cat(batch).view(-1).tolist()

    def host_logits(self, kept: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(kept).float().cpu()

    def close(self) -> None:
        super().close()
        self.compiled_step = self.packed_tables = None

    def compiled_programs(self) -> int | None:
        return None if self.backend == "none" else graph_counts()["graphs"]

    def describe(self) -> dict[str, Any]:
        weights: dict[str, Any] = {"weights": str(self.ctx.engine_cfg.weights),
                                   "kept_4bit": [p.rpartition(".")[2] for p in self.packed_tables]
                                   + (["linears"] if self.int4 else [])}  # fmt: skip
        if self.int4:
            weights.update(int4.described(self.model, self.int4_linears))
        for path, table in self.packed_tables.items():
            rows, cols = table.shape
            weights[f"{path.rpartition('.')[2]}_bytes"] = table.packed.nbytes + table.scale.nbytes
            weights[f"{path.rpartition('.')[2]}_dense_bytes"] = rows * cols * self.ctx.dtype.itemsize
        return {
            "backend": self.backend,
            "inductor": self.inductor_options(),
            "one_row": str(self.one_row_choice.one_row if self.row_linears else OneRow.linear),
            "one_row_linears": self.row_linears,
            "joined_linears": self.joined_linears,
            "held_together_bytes": self.held_together_bytes,
            "product_bytes": product_bytes(self.model),
            "one_row_choice": self.one_row_choice.record() if self.one_row_choice else None,
            **cpu_kernels.facts(self.model),
            "greedy": self.greedy_kernel,
            "decode_attention": self.decode_attention,
            "read_every": self.ctx.read_every,
            "settings_without_effect": list(self.ctx.engine_cfg.settings_without_effect()),
            **weights,
            **graph_counts(),
        }
