"""The classes ``experiment=profile`` attributes a decode step's time to, shared by its torch and JAX sides."""

from __future__ import annotations

WEIGHT_KINDS = {
    "weights: attention projections": ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"),
    "weights: MLP": ("gate_proj", "up_proj", "gate_up_proj", "down_proj"),
    "weights: per-layer inputs": ("per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"),
    "logits and argmax": ("lm_head",),
}
DISPATCH = "host: dispatch and wrappers"
BETWEEN = "host: between operators"
CLASSES = (*WEIGHT_KINDS, "attention", "table lookups", "norms and elementwise", DISPATCH, BETWEEN)
