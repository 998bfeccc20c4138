"""Engines over Hugging Face ``generate``: the eager baseline, defer-and-fuse, and the StaticCache way."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from transformers import CompileConfig, GenerationConfig, StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from decodebench.checkpoint import load_model, load_reference
from decodebench.config import ConfigError, EngineConfig
from decodebench.device import Device, EagerMode, fuse_unsupported, tpu_eager_mode
from engines.base import Engine, Generation, OnTokens
from engines.stepping import INDUCTOR_DEFAULTS, compile_backend, graph_counts


class Loader(StrEnum):
    """Who builds the model: decodebench's loader (dequantized by us, plain modules), or Transformers' own
    compressed-tensors path, as the articles' ``generate`` rows loaded the repack: ``transformers`` keeps the
    linears packed at load and unpacks them at the first forward (its default, notebook 02's "compressed");
    ``transformers_dense`` unpacks them at load (compressed-tensors' ``dequantize=True``)."""

    decodebench = "decodebench"
    transformers = "transformers"
    transformers_dense = "transformers_dense"


@dataclass
class GenerateEngineConfig(EngineConfig):
    """Hugging Face ``generate``: greedy, eager, dynamic cache; ``loader``: who builds the model."""

    loader: Loader = Loader.decodebench


@dataclass
class FuseEngineConfig(GenerateEngineConfig):
    """``generate`` under TorchTPU's defer-and-fuse eager mode (TPU only)."""


@dataclass
class StaticEngineConfig(GenerateEngineConfig):
    """``generate`` over Transformers' StaticCache; ``mode=fuse`` runs it under defer-and-fuse (TPU only).

    ``compile``: generate compiles the model's forward over the fixed buffer itself (Transformers' own
    ``CompileConfig``, on any device; notebook 02's "buffer"), with ``backend`` (``auto``: tpu on a TPU,
    inductor elsewhere). Off, generate never compiles (strict eager), on a TPU too, where Transformers
    would compile a static-cache generate by default.
    """

    mode: EagerMode = EagerMode.eager
    compile: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.compile and self.mode == EagerMode.fuse:
            raise ConfigError("engine.compile=true with engine.mode=fuse: generate compiles its forward or runs it "
                              "under defer-and-fuse, not both")  # fmt: skip
        if self.compile and self.backend == "none":
            raise ConfigError("engine.compile=true with engine.backend=none: generate would not compile; drop one")
        if not self.compile and self.backend != "auto":
            raise ConfigError(f"engine.backend={self.backend} has no effect without engine.compile=true (static "
                              "generate is strict eager otherwise)")  # fmt: skip


def static_cache_bytes(cache: StaticCache | None) -> int | None:
    """Bytes of a StaticCache's allocated K/V tensors (layers allocate at their first update)."""
    layers = cache.layers if cache is not None else []  # a Cache with no tokens is falsy
    tensors = [t for layer in layers for t in (layer.keys, layer.values) if t is not None]
    return sum(t.nbytes for t in tensors) if tensors else None


class Streamer(BaseStreamer, StoppingCriteria):
    """``on_tokens`` inside Transformers' ``generate``: each new token as ``generate`` hands it to its
    streamer (the prompt first, skipped); once ``on_tokens`` returns False, nothing more is handed on
    and the stopping criterion ends the call at generate's next check."""

    def __init__(self, on_tokens: OnTokens) -> None:
        self.on_tokens, self.prompt_seen, self.stopped = on_tokens, False, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
        elif not self.stopped:
            self.stopped = not self.on_tokens(value.view(-1).tolist())

    def end(self) -> None:
        """Nothing is held back."""

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def greedy_generate(
    model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    return_logits: bool = False,
    cache: Any = None,
    on_tokens: OnTokens | None = None,
    compile_config: CompileConfig | None = None,
) -> Generation:
    """Transformers ``generate``: greedy, exactly ``max_new_tokens`` (no EOS stop, so every call does the
    same work), on the model's device; logits [n, V] float32 on the host when asked. ``compile_config``:
    generate compiles the forward as it says (a compilable cache needed); None: it never compiles.

    ``eos_token_id=[]``, not None: generate fills every None field from the model's own generation
    config, whose EOS list would then stop the call early. ``on_tokens`` (see ``engines.base``) goes in
    as generate's own streamer and stopping criterion; the tokens returned are those it was handed.
    """
    ids = torch.tensor([prompt_ids], device=model.device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=model.generation_config.pad_token_id,
        bos_token_id=model.config.bos_token_id,
        output_logits=return_logits,
        return_dict_in_generate=True,
        disable_compile=compile_config is None,
        compile_config=compile_config,
    )
    streamer = Streamer(on_tokens) if on_tokens is not None else None
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        generation_config=config,
        cache=cache,
        streamer=streamer,
        stopping_criteria=StoppingCriteriaList([streamer]) if streamer else None,
    )
    logits = torch.cat([step.float().cpu() for step in out.logits]) if return_logits else None
    return Generation(out.sequences[0, len(prompt_ids) :].tolist(), logits)


class GenerateEngine(Engine):
    """``generate``: greedy, eager, Transformers' dynamic cache (the articles' baseline)."""

    name = "generate"
    config = GenerateEngineConfig
    scores_prompt = True
    eager_mode: str | None = None  # TorchTPU eager mode to run generate under (None: the default)

    def load(self) -> None:
        device = self.ctx.device.torch_device
        if self.ctx.engine_cfg.loader != Loader.decodebench:
            dense = self.ctx.engine_cfg.loader == Loader.transformers_dense
            self.model = load_reference(self.checkpoint, self.ctx.dtype, device, dequantize=dense)
        else:
            self.model, _ = load_model(self.checkpoint, self.ctx.dtype, device)

    def cache(self) -> Any:
        """The cache object handed to generate; None lets Transformers make a DynamicCache."""
        return None

    def compile_config(self) -> CompileConfig | None:
        """How generate compiles the forward; None: it does not."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"loader": str(self.ctx.engine_cfg.loader)}

    def running(self) -> contextlib.AbstractContextManager[Any]:
        """The TorchTPU eager mode the model runs under (none by default)."""
        return tpu_eager_mode(self.eager_mode) if self.eager_mode else contextlib.nullcontext()

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """The model's own forward over the prompt, no cache kept."""
        with self.running():
            ids = torch.tensor([prompt_ids], device=self.model.device)
            return self.model(input_ids=ids, use_cache=False).logits[0].float().cpu()

    @torch.inference_mode()  # the cache is reset in place: it must be inside, with the generate that made it
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        return_logits: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> Generation:
        with self.running():
            return greedy_generate(
                self.model,
                prompt_ids,
                max_new_tokens,
                return_logits=return_logits,
                cache=self.cache(),
                on_tokens=on_tokens,
                compile_config=self.compile_config(),
            )


class FuseEngine(GenerateEngine):
    """``generate`` under TorchTPU's defer-and-fuse mode (article 003, notebooks 02-03). TPU only."""

    name = "fuse"
    config = FuseEngineConfig
    devices = ("tpu",)
    eager_mode = "fuse"


class StaticEngine(GenerateEngine):
    """``generate`` over Transformers' own StaticCache of ``context`` slots; strict eager, or fused on a TPU."""

    name = "static"
    config = StaticEngineConfig

    def load(self) -> None:
        super().load()
        self.eager_mode = {EagerMode.eager: None, EagerMode.fuse: "fuse"}[self.ctx.engine_cfg.mode]
        self._cache: StaticCache | None = None

    @classmethod
    def unsupported_reason(cls, device: Device, run_cfg: Any) -> str | None:
        return fuse_unsupported(run_cfg.engine.mode, "static", device.kind) or super().unsupported_reason(
            device, run_cfg
        )

    def compile_config(self) -> CompileConfig | None:
        if not self.ctx.engine_cfg.compile:
            return None
        backend = compile_backend(self.ctx.engine_cfg.backend, self.ctx.device)  # not none: refused by the config
        config = CompileConfig(backend=backend, mode=None, options=self.inductor_options() or None)
        config._compile_all_devices = True  # Transformers compiles on accelerators only unless told so
        return config

    def inductor_options(self) -> dict[str, Any]:
        """What TorchInductor compiles the forward with: Transformers' default mode (``reduce-overhead``) as its
        options, torch.compile taking one or the other, and ``INDUCTOR_DEFAULTS`` (bf16 intermediates rounded as
        eager rounds them: without it notebook 02's buffer failed the bf16 parity bound on e2b-synthetic, KL mean
        1.02e-3 over 1e-3); none when generate does not compile, or with another backend."""
        if not self.ctx.engine_cfg.compile:
            return {}
        if compile_backend(self.ctx.engine_cfg.backend, self.ctx.device) != "inductor":
            return {}
        from torch._inductor import list_mode_options  # TorchInductor's import is heavy: only when it compiles

        return {**list_mode_options("reduce-overhead"), **INDUCTOR_DEFAULTS}

    def cache(self) -> StaticCache:
        if self._cache is None:
            self._cache = StaticCache(config=self.model.config, max_cache_len=self.ctx.context)
        self._cache.reset()
        return self._cache

    def cache_bytes(self) -> int | None:
        return static_cache_bytes(self._cache)

    def close(self) -> None:
        super().close()
        self._cache = None

    def compiled_programs(self) -> int | None:
        return graph_counts()["graphs"] if self.ctx.engine_cfg.compile else None

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "cache": f"transformers StaticCache, max_cache_len={self.ctx.context}",
            "mode": self.ctx.engine_cfg.mode,
            "compile": self.ctx.engine_cfg.compile,
            **({"inductor": self.inductor_options(), **graph_counts()} if self.ctx.engine_cfg.compile else {}),
        }
