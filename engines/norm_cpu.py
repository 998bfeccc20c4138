"""Gemma's RMS norm of bf16 rows in one operator on a CPU with AVX-512 BF16: ``decodebench_norm::rms``
(``csrc/rms_norm.cpp``, built with ``engines.cpu_kernels``), which the Rust engine calls in place of the nine eager
ATen operators of its norm wherever it runs (the Rust shim finds it by name in ATen's dispatcher); elsewhere the eager
operators. ``decodebench_norm::rms_rope`` (the same file) is a q or k head's norm and then its rotary embedding, one
operator in place of the norm's nine and the rotation's eight; ``decodebench_norm::add_rms`` a residual add after a
norm (and a layer's scalar after it), one in place of the norm's, the add and the mul; ``decodebench_act::gelu_mul``
(``csrc/gelu_mul.cpp``) the MLP's and the per-layer input's ``gelu_tanh(gate) * up``, one in place of two. The compiled
engines need none of them: TorchInductor fuses their norms, rotations and elementwise operators.
"""

from __future__ import annotations

import torch

from engines.cpu_kernels import missing

OP = "decodebench_norm.rms"  # the operator's name as it is dispatched (and as the evidence names it)
ROPE = "decodebench_norm.rms_rope"
ADD_RMS = "decodebench_norm.add_rms"
GELU_MUL = "decodebench_act.gelu_mul"
EAGER = "aten (eager operators)"


def unsupported(device_kind: str, dtype: torch.dtype) -> str | None:
    """Why ``rms`` cannot run here (the eager operators do), or None."""
    if device_kind != "cpu":
        return f"it is a CPU kernel, this run's device is {device_kind}"
    if dtype != torch.bfloat16:
        return f"it normalizes bf16 rows, this run's dtype is {dtype}"
    return missing()


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., n] bf16 -> x / sqrt(mean(x^2) + eps) (times ``weight`` [n] where given), each row, in float32, rounded
    once to bf16."""
    return torch.ops.decodebench_norm.rms(x, weight, eps)


def rms_rope(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [batch, seq, heads, n] bf16 normed as ``rms`` norms it, then ``y * cos + rotate_half(y) * sin`` with cos and
    sin [1 or batch, seq, 1, n] bf16, each product and the sum rounded to bf16 (Transformers' eager rotation)."""
    return torch.ops.decodebench_norm.rms_rope(x, weight, eps, cos, sin)


def add_rms(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
            scale: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """h + rms(x, weight, eps) (h and x [..., n] bf16), then times ``scale`` (bf16, one value) where given: each step
    rounded to bf16 as the eager operators round it (the same bits as ``(h + rms(x)) * scale`` eagerly)."""
    return torch.ops.decodebench_norm.add_rms(h, x, weight, eps, scale)


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(gelu_tanh(gate)) * up), gate and up bf16 of one shape: Gemma's MLP activation times ``up``, each
    value rounded where eager's gelu and mul round it (gelu computed within a few float32 ulps of aten's)."""
    return torch.ops.decodebench_act.gelu_mul(gate, up)
