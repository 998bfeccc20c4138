"""``decodebench_norm.rms`` and ``rms_rope`` (engines/norm_cpu.py) against a float64 reference and against the eager
operators they replace in the Rust engine.

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


def angles(batch: int, seq: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [batch, seq, 1, n] in bf16 as Transformers' rotary embedding gives them: each position's angles
    repeated over the two halves."""
    generator = torch.Generator().manual_seed(seed)
    half = torch.rand(batch, seq, 1, n // 2, generator=generator) * 40
    both = torch.cat([half, half], dim=-1)
    return both.cos().to(torch.bfloat16), both.sin().to(torch.bfloat16)


def eager_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Transformers' (and the Rust engine's) eager rotation in bf16: y * cos + rotate_half(y) * sin."""
    half = y.shape[-1] // 2
    return y * cos + torch.cat([-y[..., half:], y[..., :half]], dim=-1) * sin


ROPE_SHAPES = [(1, 1, 8, 256), (1, 1, 1, 512), (1, 256, 8, 256), (2, 3, 4, 40), (1, 5, 2, 18)]


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_rms_rope_writes_the_norm_then_the_eager_rotations_bits(shape, per_batch):
    """The norm is ``rms``'s, and the rotation rounds each product and the sum as eager's bf16 operators do: the same
    bits, every output (angles one set for all rows, or a batch's own)."""
    x, weight = inputs(shape, True)
    x[..., ::5] = 0.0  # zeros of both signs after the norm's weight: eager's neg and sums keep each zero's sign
    cos, sin = angles(shape[0] if per_batch else 1, shape[1], shape[3], seed=shape[3])
    cos[..., ::7], sin[..., 1::7] = 0.0, 0.0
    got = norm_cpu.rms_rope(x, weight, 1e-6, cos, sin)
    want = eager_rope(norm_cpu.rms(x, weight, 1e-6), cos, sin)
    same = got.view(torch.int16) == want.view(torch.int16)  # bits: torch.equal counts -0 and +0 equal
    assert got.shape == x.shape and same.all(), f"{int((~same).sum())} of {got.numel()} differ"


@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_rms_rope_is_the_float64_rotation_of_its_norm(shape):
    """Against float64: each output within the three bf16 roundings of the rotation (the two products and their sum)."""
    x, weight = inputs(shape, True)
    cos, sin = angles(1, shape[1], shape[3], seed=1)
    got = norm_cpu.rms_rope(x, weight, 1e-6, cos, sin).double()
    y, c, s = norm_cpu.rms(x, weight, 1e-6).double(), cos.double(), sin.double()
    half = shape[3] // 2
    rotated = torch.cat([-y[..., half:], y[..., :half]], dim=-1)
    want = y * c + rotated * s
    bound = ((y * c).abs() + (rotated * s).abs()) * 2.0**-8 * (1 + 2.0**-8) + want.abs() * 2.0**-8
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


def test_rms_rope_refuses_what_it_cannot_rotate():
    x = torch.randn(1, 2, 3, 8).to(torch.bfloat16)
    cos, sin = angles(1, 2, 8, seed=0)
    with pytest.raises(RuntimeError, match="n even"):
        norm_cpu.rms_rope(torch.randn(1, 2, 3, 7).to(torch.bfloat16), None, 1e-6, cos[..., :7], sin[..., :7])
    with pytest.raises(RuntimeError, match="cos and sin: bfloat16 \\[1 or 1, 2, 1, 8\\]"):
        norm_cpu.rms_rope(x, None, 1e-6, cos[:, :1], sin[:, :1])
    with pytest.raises(RuntimeError, match="x: bfloat16 \\[batch, seq, heads, n\\]"):
        norm_cpu.rms_rope(x[0], None, 1e-6, cos, sin)


ADD_SHAPES = [(1, 1, 1536), (1, 256, 1536), (3, 7), (2, 33)]


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("shape", ADD_SHAPES)
def test_add_rms_writes_the_eager_residual_bits(shape, scaled):
    """h + rms(x) (then times a layer's scalar): the bits of the norm as ``rms`` writes it, eager's add and eager's
    mul, as the Rust engine computed it before (model.rs: ``add_rms``)."""
    x, weight = inputs(shape, True)
    h = (torch.randn(*shape, generator=torch.Generator().manual_seed(7)) * 30).to(torch.bfloat16)
    scale = torch.tensor([0.37], dtype=torch.bfloat16) if scaled else None
    want = h + norm_cpu.rms(x, weight, 1e-6)
    want = want * scale if scaled else want
    assert torch.equal(norm_cpu.add_rms(h, x, weight, 1e-6, scale), want)


def test_add_rms_refuses_what_it_cannot_add():
    x = torch.randn(2, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="h and x: bfloat16 \\[..., n\\] of one shape"):
        norm_cpu.add_rms(x[:, :4], x, None, 1e-6, None)
    with pytest.raises(RuntimeError, match="scale: bfloat16, one value"):
        norm_cpu.add_rms(x, x, None, 1e-6, torch.ones(2, dtype=torch.bfloat16))


GELU_SHAPES = [(1, 1, 12288), (1, 1, 6144), (1, 1, 256), (1, 256, 6144), (3, 7), (2, 33)]


def gelu_inputs(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(shape) + 1)
    gate = (torch.randn(*shape, generator=generator) * 4).to(torch.bfloat16)  # -16 to 16: both tails of gelu
    return gate, torch.randn(*shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("shape", GELU_SHAPES)
def test_gelu_mul_is_the_float64_product_rounded_where_eager_rounds(shape):
    """Each output the float64 gelu_tanh(gate) rounded to bf16, times up, rounded again: within one bf16 step of it
    (where the float32 gelu lies within its few ulps of a rounding boundary), equal almost everywhere. The reference is
    x / (1 + exp(-2u)), the same function as 0.5 x (1 + tanh(u)) without its cancellation far below zero (there even
    float64's tanh(u) is -1 and the product 0)."""
    gate, up = gelu_inputs(shape)
    g = gate.double()
    exact = g / (1 + torch.exp(-2 * 0.7978845608028654 * (g + 0.044715 * g**3)))
    want = (exact.to(torch.bfloat16).double() * up.double()).to(torch.bfloat16)
    got = norm_cpu.gelu_mul(gate, up)
    apart = got != want
    # u in float32 carries a relative error of a few ulps, which exp turns into |2u| times that: 0.1-0.2 % of gelu's
    # values (gates of 4 times a normal's) then lie close enough to a bf16 rounding boundary to round the other way
    assert apart.float().mean() <= 5e-3, f"{int(apart.sum())} of {got.numel()} outputs differ"
    # one bf16 step at the value; a gelu under 2^-120 in magnitude (a gate below about -10, where exp(-2u) lies beyond
    # float32's largest or the value under its smallest normal, which the conversion to bf16 flushes) comes out 0, as
    # eager's does (its tanh(u) is -1 there)
    step = want.double().abs() * 2.0**-7 + 2.0**-120
    assert ((got.double() - want.double()).abs() <= step).all()


@pytest.mark.parametrize("shape", GELU_SHAPES)
def test_gelu_mul_writes_eager_gelu_times_up_but_where_aten_loses_digits(shape):
    """Against eager's two operators (aten's bf16 gelu with its tanh, then mul): equal where gelu is not tiny; where the
    gate is below -3, aten's 1 + tanh(u) has lost digits to cancellation and the two may differ by more than a step."""
    gate, up = gelu_inputs(shape)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    got = norm_cpu.gelu_mul(gate, up)
    plain = gate.float() > -3
    apart = (got != want) & plain
    assert apart.float().mean() <= 1e-3, f"{int(apart.sum())} of {got.numel()} outputs differ"
    step = want.float().abs() * 2.0**-7
    assert ((got.float() - want.float()).abs()[plain] <= step[plain]).all()


def test_gelu_mul_gives_eagers_zeros_and_limits():
    """gelu(0) = 0, gelu(x) = x far above zero, -0 far below it (its sign kept, as eager's 0.5 x (1 + -1) gives it),
    infinity at infinity, NaN at -infinity (eager's -inf x 0) and at NaN."""
    gate = torch.tensor([0.0, 20.0, -20.0, float("inf"), float("-inf"), float("nan")], dtype=torch.bfloat16)
    got = norm_cpu.gelu_mul(gate, torch.ones_like(gate))
    want = torch.nn.functional.gelu(gate, approximate="tanh")
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got[:4]), torch.signbit(want[:4]))  # a NaN's sign bit means nothing


def test_gelu_mul_refuses_what_it_cannot_multiply():
    x = torch.randn(2, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="gate and up: bfloat16 of one shape"):
        norm_cpu.gelu_mul(x, x[:, :4])
    with pytest.raises(RuntimeError, match="gate and up: bfloat16 of one shape"):
        norm_cpu.gelu_mul(x.float(), x.float())
