"""Gemma 4 text in plain ``jax.numpy``: the forward the PyTorch ring runs, over the same ring cache.

Pure functions of a flat parameter dict (names as Transformers' ``Gemma4ForCausalLM`` state dict,
``model.`` dropped) and a cache pytree; the layer plan (``Plan``) is read from the text config exactly
as ``engines/ring.py`` reads it (``decodebench.checkpoint.layers_of_config``: layer types, KV
sharing, head sizes, double-wide MLPs) and is static under ``jax.jit``.

* Norms compute in float32 and cast back (``Gemma4RMSNorm``); RoPE tables come from Transformers'
  own ``Gemma4TextRotaryEmbedding`` (both settings: default for sliding layers, proportional with
  partial rotation for full ones), so no RoPE arithmetic is written twice.
* The cache is the ring's (``decodebench.layout``): full layers one slot per
  position, sliding layers a ring of window + piece slots with a record of the position each holds.
* From the first KV-shared layer on, a piece keeps only its last real row (those layers write no
  cache; Transformers slices the same way with ``logits_to_keep``).
* A linear is dense ``[out, in]`` or 4-bit (``Int4``: the checkpoint's int32 words and group scales,
  unpacked inside the jitted program). A decode step multiplies with ``dot_general`` in the run's
  dtype (``matmul="dot"``) or in float32 (``"upcast"``), or as a float32 multiply-and-sum over the
  input dimension (``"reduce"``), which XLA:CPU runs as a fused loop where its bf16 dot takes a slow
  path (shared/notes/jax-on-this-machine.md); a prompt piece always uses ``dot``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from decodebench.layout import full_slots, layers_of_config, sliding_slots


class Int4(NamedTuple):
    """A linear kept 4-bit: int32 words [out, in/8] of level + 8, low nibble first; scales [out, in/group]."""

    words: jax.Array
    scale: jax.Array


@dataclass(frozen=True)
class Layer:
    sliding: bool
    source: int  # the layer whose K/V this one reads (itself unless KV-shared)
    head_dim: int
    kv_heads: int


@dataclass(frozen=True)
class Plan:
    """Everything static about the model and its cache: hashable, so ``jax.jit`` can close over it."""

    layers: tuple[Layer, ...]
    heads: int
    hidden: int
    ple_dim: int
    window: int
    piece: int
    ring_slots: int
    full_slots: int
    first_shared: int  # index of the first KV-shared layer (num_hidden_layers when none)
    eps: float
    softcap: float | None
    dtype: Any
    matmul: str  # "dot", "upcast" or "reduce": how a decode step multiplies (a piece always uses dot)


def plan_of(config: Any, context: int, piece: int, dtype: Any, matmul: str) -> Plan:
    layers = tuple(
        Layer(layer["type"] == "sliding_attention", layer["kv_source"], layer["head_dim"], layer["kv_heads"])
        for layer in layers_of_config(config)
    )
    shared = [i for i, layer in enumerate(layers) if layer.source != i]
    return Plan(
        layers=layers,
        heads=config.num_attention_heads,
        hidden=config.hidden_size,
        ple_dim=config.hidden_size_per_layer_input,
        window=config.sliding_window,
        piece=piece,
        ring_slots=sliding_slots(config.sliding_window, piece, context),
        full_slots=full_slots(context, piece),
        first_shared=shared[0] if shared else len(layers),
        eps=config.rms_norm_eps,
        softcap=config.final_logit_softcapping,
        dtype=dtype,
        matmul=matmul,
    )


def rope_tables(config: Any) -> dict[str, Any]:
    """Per layer type: inverse frequencies and attention scaling, from Transformers' own rotary module."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    rotary = Gemma4TextRotaryEmbedding(config)
    return {
        kind: (
            np.asarray(getattr(rotary, f"{kind}_inv_freq").float().numpy()),
            float(getattr(rotary, f"{kind}_attention_scaling")),
        )
        for kind in ("sliding_attention", "full_attention")
    }


def new_cache(plan: Plan) -> dict[str, Any]:
    """Zeroed K/V buffers [kv_heads, slots, head_dim] for each cache-owning layer, and empty records."""
    kv = {}
    for i, layer in enumerate(plan.layers):
        if layer.source == i:
            slots = plan.ring_slots if layer.sliding else plan.full_slots
            kv[str(i)] = (
                jnp.zeros((layer.kv_heads, slots, layer.head_dim), plan.dtype),
                jnp.zeros((layer.kv_heads, slots, layer.head_dim), plan.dtype),
            )
    return {
        "kv": kv,
        "ring_pos": jnp.full((plan.ring_slots,), -1, jnp.int32),
        "full_pos": jnp.full((plan.full_slots,), -1, jnp.int32),
    }


def unpack_int4(w: Int4, dtype: Any) -> jax.Array:
    """[out, in] weights in ``dtype``: level * scale computed in float32, cast once (as the loader does)."""
    out, words = w.words.shape
    nibbles = (w.words[:, :, None] >> jnp.arange(0, 32, 4, dtype=jnp.int32)) & 0xF
    levels = (nibbles.reshape(out, words * 8) - 8).astype(jnp.float32)
    groups = w.scale.shape[1]
    grouped = levels.reshape(out, groups, -1) * w.scale.astype(jnp.float32)[:, :, None]
    return grouped.reshape(out, words * 8).astype(dtype)


def linear(x: jax.Array, params: dict[str, Any], name: str, plan: Plan) -> jax.Array:
    """x [S, in] @ w.T -> [S, out] in the run's dtype, ``w`` = ``params[name + ".weight"]``; its operations
    are named after the linear (``q_proj``, ``lm_head``, ...: ``jax.named_scope``, seen by a profile)."""
    w = params[name + ".weight"]
    with jax.named_scope(name.rpartition(".")[2]):
        dense = unpack_int4(w, plan.dtype) if isinstance(w, Int4) else w
        if plan.matmul == "reduce" and x.shape[0] == 1:
            product = (dense.astype(jnp.float32) * x.astype(jnp.float32)).sum(-1)  # [out, in] * [1, in]
            if name == "lm_head":  # rounded to the run's dtype, then cast: the same values as the cast alone, but
                # XLA:CPU then keeps the cast out of YNNPACK's reduce fusion, which ran ~10x slower with it inside
                # on the vocabulary-wide product (472 ms against 46 ms, bit-identical; experiment=profile showed
                # the logits at 1.5 GB/s); on the narrower linears the same rounding made them slower
                info = jnp.finfo(plan.dtype)
                product = jax.lax.reduce_precision(product, info.nexp, info.nmant)
            return product[None].astype(plan.dtype)
        if plan.matmul == "upcast" and x.shape[0] == 1:
            x, dense = x.astype(jnp.float32), dense.astype(jnp.float32)
        product = jax.lax.dot_general(x, dense, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return product.astype(plan.dtype)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    normed = x.astype(jnp.float32)
    normed = normed * jnp.power(jnp.mean(normed * normed, -1, keepdims=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.astype(jnp.float32)
    return normed.astype(x.dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on x [S, heads, D] with cos, sin [S, D] (Transformers' ``apply_rotary_pos_emb``)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def attention(q: jax.Array, keys: jax.Array, values: jax.Array, keep: jax.Array) -> jax.Array:
    """q [S, H, D], keys/values [KV, slots, D], keep [S, slots] -> [S, H * D]; scale 1 (Gemma 4's
    q/k norms), head h reads K/V head h // (H / KV), scores and softmax in float32."""
    seq, heads, dim = q.shape
    kv = keys.shape[0]
    grouped = q.reshape(seq, kv, heads // kv, dim)
    scores = jnp.einsum("skgd,ktd->kgst", grouped, keys, preferred_element_type=jnp.float32)
    scores = jnp.where(keep[None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("kgst,ktd->skgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(seq, heads * values.shape[-1]).astype(q.dtype)


def forward(
    plan: Plan,
    rope: dict[str, Any],
    params: dict[str, Any],
    cache: dict[str, Any],
    ids: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    row: jax.Array,
) -> tuple[jax.Array, dict[str, Any]]:
    """Logits [V] (float32) at ``row`` of ``ids`` [S] read at ``positions`` [S] (``valid`` False:
    padding, recorded as empty), and the cache with this forward's K/V written into it."""
    p, dtype = params, plan.dtype
    ring_slot = positions % plan.ring_slots
    recorded = jnp.where(valid, positions, -1)
    ring_pos = cache["ring_pos"].at[ring_slot].set(recorded)
    full_pos = cache["full_pos"].at[positions].set(recorded)
    qpos = positions[:, None]
    keep = {
        True: (ring_pos[None] >= 0) & (ring_pos[None] <= qpos) & (qpos - ring_pos[None] < plan.window),
        False: (full_pos[None] >= 0) & (full_pos[None] <= qpos),
    }
    tables = {}
    for sliding, kind in ((True, "sliding_attention"), (False, "full_attention")):
        inv_freq, scaling = rope[kind]
        freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None]
        emb = jnp.concatenate([freqs, freqs], -1)
        tables[sliding] = ((jnp.cos(emb) * scaling).astype(dtype), (jnp.sin(emb) * scaling).astype(dtype))

    layers = len(plan.layers)
    with jax.named_scope("embed"):
        x = p["embed_tokens.weight"][ids] * p["embed_scale"]
        token_part = (p["embed_tokens_per_layer.weight"][ids] * p["ple_embed_scale"]).reshape(-1, layers, plan.ple_dim)
    context_part = linear(x, p, "per_layer_model_projection", plan) * (plan.hidden**-0.5)
    context_part = rms_norm(
        context_part.reshape(-1, layers, plan.ple_dim), p["per_layer_projection_norm.weight"], plan.eps
    )
    per_layer = (context_part + token_part) * (2.0**-0.5)

    kv = dict(cache["kv"])
    for i, layer in enumerate(plan.layers):
        if i == plan.first_shared and x.shape[0] > 1:  # later layers write no cache: keep the row asked for
            x, per_layer = (jax.lax.dynamic_slice_in_dim(t, row, 1, axis=0) for t in (x, per_layer))
            keep = {s: jax.lax.dynamic_slice_in_dim(m, row, 1, axis=0) for s, m in keep.items()}
            tables = {s: tuple(jax.lax.dynamic_slice_in_dim(t, row, 1, axis=0) for t in cs) for s, cs in tables.items()}
            ring_slot, positions = (jax.lax.dynamic_slice_in_dim(t, row, 1, axis=0) for t in (ring_slot, positions))
        pre = f"layers.{i}."
        cos, sin = tables[layer.sliding]
        h = rms_norm(x, p[pre + "input_layernorm.weight"], plan.eps)
        q = linear(h, p, pre + "self_attn.q_proj", plan).reshape(x.shape[0], plan.heads, layer.head_dim)
        q = rotate(rms_norm(q, p[pre + "self_attn.q_norm.weight"], plan.eps), cos, sin)
        if layer.source == i:
            shape = (x.shape[0], layer.kv_heads, layer.head_dim)
            k = rotate(
                rms_norm(
                    linear(h, p, pre + "self_attn.k_proj", plan).reshape(shape),
                    p[pre + "self_attn.k_norm.weight"],
                    plan.eps,
                ),
                cos,
                sin,
            )
            v = rms_norm(linear(h, p, pre + "self_attn.v_proj", plan).reshape(shape), None, plan.eps)
            slots = ring_slot if layer.sliding else positions
            keys, values = kv[str(i)]
            with jax.named_scope("attention"):  # the cache write: attention's traffic
                k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
                kv[str(i)] = (keys.at[:, slots].set(k), values.at[:, slots].set(v))
        keys, values = kv[str(layer.source)]
        with jax.named_scope("attention"):
            attended = attention(q, keys, values, keep[layer.sliding])
        attended = linear(attended, p, pre + "self_attn.o_proj", plan)
        x = x + rms_norm(attended, p[pre + "post_attention_layernorm.weight"], plan.eps)

        h = rms_norm(x, p[pre + "pre_feedforward_layernorm.weight"], plan.eps)
        gate = jax.nn.gelu(linear(h, p, pre + "mlp.gate_proj", plan), approximate=True)
        h = linear(gate * linear(h, p, pre + "mlp.up_proj", plan), p, pre + "mlp.down_proj", plan)
        x = x + rms_norm(h, p[pre + "post_feedforward_layernorm.weight"], plan.eps)

        h = jax.nn.gelu(linear(x, p, pre + "per_layer_input_gate", plan), approximate=True) * per_layer[:, i]
        h = rms_norm(
            linear(h, p, pre + "per_layer_projection", plan),
            p[pre + "post_per_layer_input_norm.weight"],
            plan.eps,
        )
        x = (x + h) * p[pre + "layer_scalar"]

    last = jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0) if x.shape[0] > 1 else x
    logits = linear(rms_norm(last, p["norm.weight"], plan.eps), p, "lm_head", plan)[0]
    if plan.softcap is not None:
        with jax.named_scope("logits"):
            logits = jnp.tanh(logits / plan.softcap) * plan.softcap
    return logits.astype(jnp.float32), {"kv": kv, "ring_pos": ring_pos, "full_pos": full_pos}
