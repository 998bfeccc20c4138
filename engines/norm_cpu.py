"""Gemma's RMS norm of bf16 rows in one operator on a CPU with AVX-512 BF16: ``decodebench_norm::rms``
(``csrc/rms_norm.cpp``, built with ``engines.cpu_kernels``), which the Rust engine calls in place of the nine eager
ATen operators of its norm wherever it runs (the Rust shim finds it by name in ATen's dispatcher); elsewhere the eager
operators. ``decodebench_norm::rms_rope`` (the same file) is a q or k head's norm and then its rotary embedding, one
operator in place of the norm's nine and the rotation's eight. The compiled engines need neither: TorchInductor fuses
their norms and rotations.
"""

from __future__ import annotations

import torch

from engines.cpu_kernels import missing

OP = "decodebench_norm.rms"  # the operator's name as it is dispatched (and as the evidence names it)
ROPE = "decodebench_norm.rms_rope"
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
