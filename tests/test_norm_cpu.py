"""``decodebench_norm.rms`` (engines/norm_cpu.py) against a float64 reference and against the eager operators it
replaces in the Rust engine.

Exact means: each output within the bf16 rounding of the float64 norm plus what a float32 sum of the squares may lose;
and the bits eager PyTorch writes (the nine operators the Rust engine called), but where the two float32 sums of the
squares, taken in different orders, put a value on either side of a bf16 rounding boundary: one bf16 step apart, rare.
Shapes: E2B's norms in a decode step (the hidden state, the query heads, the per-layer inputs), a prompt piece of 256
rows, and widths that leave a partial vector.
"""

from __future__ import annotations

import pytest
import torch

from engines import norm_cpu

SHAPES = [(1, 1, 1536), (1, 1, 8, 256), (1, 1, 35, 256), (1, 256, 1536), (3, 7), (2, 33)]


@pytest.fixture(scope="module", autouse=True)
def _runs_here():
    reason = norm_cpu.unsupported("cpu", torch.bfloat16)
    if reason:
        pytest.skip(f"{norm_cpu.OP}: {reason}")


def eager(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The Rust engine's norm as eager operators (engines/rust/src/model.rs: ``rms``)."""
    xf = x.float()
    normed = xf * (xf.pow(2).mean(-1, keepdim=True) + eps).pow(-0.5)
    return (normed * weight.float() if weight is not None else normed).to(x.dtype)


def inputs(shape: tuple[int, ...], weighted: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=generator) * 3).to(torch.bfloat16)
    weight = torch.randn(shape[-1], generator=generator).to(torch.bfloat16) if weighted else None
    return x, weight


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_is_the_float64_norm_rounded_once(shape, weighted):
    x, weight = inputs(shape, weighted)
    got = norm_cpu.rms(x, weight, 1e-6).double()
    xd = x.double()
    want = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (weight.double() if weighted else 1.0)
    bound = want.abs() * (2.0**-8 + shape[-1] * 2.0**-23)
    assert got.shape == want.shape and ((got - want).abs() <= bound).all(), (got - want).abs().max()


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_writes_the_eager_operators_bits_but_at_a_rounding_boundary(shape, weighted):
    x, weight = inputs(shape, weighted)
    got, want = norm_cpu.rms(x, weight, 1e-6), eager(x, weight, 1e-6)
    apart = got != want
    assert apart.float().mean() <= 1e-4, f"{int(apart.sum())} of {got.numel()} outputs differ"
    step = want.float().abs() * 2.0**-7  # one bf16 step at the value, at most
    assert ((got.float() - want.float()).abs() <= step).all()


def test_rms_refuses_what_it_cannot_normalize():
    x = torch.randn(2, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight: bfloat16 \\[8\\]"):
        norm_cpu.rms(x, torch.ones(9, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="x: bfloat16"):
        norm_cpu.rms(x.float(), None, 1e-6)
