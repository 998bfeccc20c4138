"""``jax``: the articles' peer, Gemma 4 in ``jax.numpy`` under ``jax.jit`` on JAX's own device.

Weights come from the one loader's state dict (``decodebench.checkpoint.text_state_dict``: the text
prefix, the compressed-tensors unpacking and dequantization are shared, never written twice) and
become ``jax.Array``s on the JAX device once. ``engine.weights=dense`` dequantizes at load as the
PyTorch engines do; ``engine.weights=int4`` keeps every packed linear as the checkpoint's int32 words
and group scales, unpacked inside the jitted programs (``engines.jax_model.Int4``).

The model (``engines/jax_model.py``) runs over the ring cache's geometry (``decodebench.layout``),
compiled to exactly two programs: one prompt piece of ``engine.piece`` tokens (the last one padded)
and one decode step; the cache buffers are donated to each call. ``engine.step_matmul`` says how the
step multiplies a token by a weight (``engines.jax_model.linear``); ``auto`` is ``reduce`` on a CPU,
where XLA's bf16 dot takes a slow path, and ``dot`` on a TPU or GPU.

The call is the shared skeleton of every engine that steps (``engines/steps.py``), with its phase
timers: ``read_s`` from the call's start to the first new token ready on the device
(``block_until_ready``), ``decode_s`` from there to the last of the N tokens on the host; tokens are
read back every ``read_every`` tokens.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import Any

import numpy as np
import torch

from decodebench.checkpoint import text_state_dict
from decodebench.config import EngineConfig, at_least
from decodebench.device import Device
from decodebench.layout import cache_layout
from engines.int4 import Weights
from engines.steps import SteppedEngine


class StepMatmul(StrEnum):
    """How the JAX engine's decode step multiplies a token by a weight: ``dot`` (XLA's dot in the run's
    dtype), ``upcast`` (XLA's dot in float32), ``reduce`` (a float32 multiply-and-sum), ``auto``:
    ``reduce`` on a CPU (XLA:CPU's bf16 dot takes a slow path), ``dot`` elsewhere."""

    auto = "auto"
    dot = "dot"
    upcast = "upcast"
    reduce = "reduce"


@dataclass
class JaxEngineConfig(EngineConfig):
    """Gemma 4 in ``jax.numpy`` under ``jax.jit`` (engines/jax_model.py): the ring cache's layout and
    pieces, two programs; ``weights=int4`` keeps every packed linear 4-bit, unpacked inside the step."""

    piece: int = 256
    weights: Weights = Weights.dense
    step_matmul: StepMatmul = StepMatmul.auto

    def __post_init__(self) -> None:
        at_least("engine.", self, 1, "piece", why=" (prompt tokens read per piece)")


def host_to_jax(tensor: torch.Tensor, device: Any) -> Any:
    """A torch CPU tensor as a ``jax.Array`` on ``device`` (bfloat16 through its bits: numpy has none)."""
    import jax
    import jax.numpy as jnp

    bits = tensor.dtype == torch.bfloat16
    array = tensor.view(torch.int16).numpy().view(jnp.bfloat16) if bits else tensor.numpy()
    return jax.device_put(array, device)


class JaxEngine(SteppedEngine):
    name = "jax"
    config = JaxEngineConfig
    framework = "jax"

    @classmethod
    def unsupported_reason(cls, device: Device, run_cfg: Any) -> str | None:
        if importlib.util.find_spec("jax") is None:
            return "jax is not installed: `make setup` installs the jax extra (pip install '.[jax]')"
        return super().unsupported_reason(device, run_cfg)

    def load(self) -> None:
        import jax
        import jax.numpy as jnp

        from engines import jax_model

        config, cfg = self.checkpoint.config, self.ctx.engine_cfg
        device = self.ctx.device.jax_device
        dtype = jnp.dtype(str(self.ctx.dtype).removeprefix("torch."))
        self.int4 = cfg.weights == Weights.int4
        state, packed = text_state_dict(self.checkpoint, self.ctx.dtype, keep_linears=self.int4)
        params: dict[str, Any] = {}
        for name in list(state):  # one tensor at a time: the torch copy is freed as the JAX one lands
            params[name.removeprefix("model.")] = host_to_jax(state.pop(name), device)
        for module, table in packed.items():
            words, scale = host_to_jax(table.packed, device), host_to_jax(table.scale, device)
            params[module.removeprefix("model.") + ".weight"] = jax_model.Int4(words, scale)
        params.setdefault("lm_head.weight", params["embed_tokens.weight"])  # tied: the same array
        hidden, ple = config.hidden_size, config.hidden_size_per_layer_input
        # Transformers keeps these scales as float32 buffers cast to the weights' dtype at use
        params["embed_scale"] = jax.device_put(jnp.asarray(np.float32(hidden**0.5), dtype), device)
        params["ple_embed_scale"] = jax.device_put(jnp.asarray(np.float32(ple**0.5), dtype), device)
        self.params = params
        self.rope = jax_model.rope_tables(config)
        matmul = str(cfg.step_matmul)
        if cfg.step_matmul == StepMatmul.auto:
            matmul = "reduce" if self.ctx.device.kind == "cpu" else "dot"
        self.plan = jax_model.plan_of(config, self.ctx.context, cfg.piece, dtype, matmul)
        self.cache = jax.device_put(jax_model.new_cache(self.plan), device)
        self.piece_fn = jax.jit(partial(read_piece, self.plan, self.rope), donate_argnums=(1,))
        self.step_fn = jax.jit(partial(decode_step, self.plan, self.rope), donate_argnums=(1,))

    def reset(self) -> None:
        """Empties the ring: every slot's position record back to -1 (stale K/V are masked out)."""
        import jax.numpy as jnp

        self.cache = {
            **self.cache,
            "ring_pos": jnp.full_like(self.cache["ring_pos"], -1),
            "full_pos": jnp.full_like(self.cache["full_pos"], -1),
        }

    def prefill(self, prompt_ids: list[int]) -> tuple[Any, Any]:
        """Reads the prompt in pieces; the first new token [1] and its logits [V], on the device."""
        import jax

        piece, device = self.plan.piece, self.ctx.device.jax_device
        pieces = math.ceil(len(prompt_ids) / piece)
        if pieces * piece > self.plan.full_slots:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit {self.plan.full_slots} slots")
        padded = np.zeros(pieces * piece, np.int32)
        padded[: len(prompt_ids)] = prompt_ids
        for k in range(pieces):
            count = min(piece, len(prompt_ids) - k * piece)
            inputs = (padded[k * piece : (k + 1) * piece], np.int32(k * piece), np.int32(count))
            token, logits, self.cache = self.piece_fn(self.params, self.cache, *jax.device_put(inputs, device))
        return token, logits

    def wait(self, token: Any) -> None:
        token.block_until_ready()

    def position(self, prompt_tokens: int) -> Any:
        import jax

        return jax.device_put(np.asarray([prompt_tokens], np.int32), self.ctx.device.jax_device)

    def advance(self, at: int, token: Any, position: Any) -> tuple[Any, Any, Any]:
        token, logits, self.cache, position = self.step_fn(self.params, self.cache, token, position)
        return token, logits, position

    def device_token(self, token: int) -> Any:
        import jax

        return jax.device_put(np.asarray([token], np.int32), self.ctx.device.jax_device)

    def to_host(self, batch: list[Any]) -> list[int]:
        import jax

        return [int(t[0]) for t in jax.device_get(batch)]

    def host_logits(self, kept: list[Any]) -> torch.Tensor:
        import jax

        return torch.from_numpy(np.stack(jax.device_get(kept)).astype(np.float32))

    def close(self) -> None:
        self.params = self.cache = self.piece_fn = self.step_fn = None

    def weight_bytes(self) -> int | None:
        """Bytes of every parameter array as held on the device (a tied table once), from shapes."""
        import jax

        arrays = {id(a): a for a in jax.tree_util.tree_leaves(self.params)}
        return sum(a.nbytes for a in arrays.values())

    def cache_bytes(self) -> int | None:
        import jax

        return sum(a.nbytes for a in jax.tree_util.tree_leaves(self.cache["kv"]))

    def programs(self) -> dict[str, int]:
        """Distinct compiled programs of each jitted function, from JAX's own caches."""
        return {"piece": self.piece_fn._cache_size(), "step": self.step_fn._cache_size()}

    def compiled_programs(self) -> int | None:
        return sum(self.programs().values())

    def program_texts(self) -> dict[str, str]:
        """The two compiled programs' HLO text, piece then step (``experiment=profile`` names XLA's operations
        by it); lowered for the shapes they were called with, so JAX's compile cache answers."""
        import jax

        ids = np.zeros(self.plan.piece, np.int32)
        piece = jax.device_put((ids, np.int32(0), np.int32(1)), self.ctx.device.jax_device)
        step = (self.device_token(0), self.position(0))
        return {
            "piece": self.piece_fn.lower(self.params, self.cache, *piece).compile().as_text(),
            "step": self.step_fn.lower(self.params, self.cache, *step).compile().as_text(),
        }

    def describe(self) -> dict[str, Any]:
        programs = self.programs()
        return {
            "weights": str(self.ctx.engine_cfg.weights),
            "step_matmul": self.plan.matmul,
            "programs": programs,
            "graphs": sum(programs.values()),
            "layout": cache_layout(self.checkpoint.config, self.ctx.context, self.plan.piece),
            "cache_bytes": self.cache_bytes(),
            "read_every": self.ctx.read_every,
            "graph_breaks": 0,  # jax.jit traces the whole function or fails: it cannot break a graph
            "jax_device": str(self.ctx.device.jax_device),
        }


def greedy(logits: Any) -> Any:
    """The argmax token [1] of logits [V] (named ``logits`` with the soft cap, as a profile sees it)."""
    import jax
    import jax.numpy as jnp

    with jax.named_scope("logits"):
        return jnp.argmax(logits, keepdims=True).astype(jnp.int32)


def read_piece(plan: Any, rope: Any, params: Any, cache: Any, ids: Any, start: Any, count: Any) -> tuple:
    """One piece: ``ids`` [piece] from position ``start`` with ``count`` real tokens -> greedy token
    [1], its logits [V] and the cache."""
    import jax.numpy as jnp

    from engines.jax_model import forward

    offsets = jnp.arange(plan.piece, dtype=jnp.int32)
    logits, cache = forward(plan, rope, params, cache, ids, start + offsets, offsets < count, count - 1)
    return greedy(logits), logits, cache


def decode_step(plan: Any, rope: Any, params: Any, cache: Any, token: Any, position: Any) -> tuple:
    """One token [1] at ``position`` [1] -> the next token [1], its logits [V], the cache, position + 1."""
    import jax.numpy as jnp

    from engines.jax_model import forward

    logits, cache = forward(plan, rope, params, cache, token, position, jnp.ones(1, bool), jnp.int32(0))
    return greedy(logits), logits, cache, position + 1
