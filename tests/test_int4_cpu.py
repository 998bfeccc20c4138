"""``decodebench_int4.int4_rows`` (engines/int4_cpu.py) against a float64 reference: every E2B linear shape, odd
sizes (a partial last tile, an odd number of tiles, groups of 8 to 256 inputs), 1 to 12 rows (whole and partial
passes of four, over tiles taken two at a time), the scales in each dtype a checkpoint stores them in, inputs spread
far below their group's largest, tiny and not finite. Exact means: each output within the bf16 rounding of the float64
value plus what float32 sums of its products may lose and what holding x in fixed point may lose (the kernel's
integer products: each input rounded at half of 2^(E - 20), E the exponent of its block's largest input, which is
nothing for an input within 2^13 of it), and equal to the correctly rounded bf16 value almost everywhere."""

from __future__ import annotations

import pytest
import torch

from engines import int4_cpu
from tests.bench_int4 import SHAPES


@pytest.fixture(scope="module", autouse=True)
def _runs_here():
    reason = int4_cpu.unsupported(torch.bfloat16, 32)
    if reason:
        pytest.skip(f"{int4_cpu.OP}: {reason}")


MIN_EXPONENT = -127  # E of a block whose largest input is subnormal (csrc/int4_rows.cpp: its exponent bits)


def fixed_point_loss(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
    """[rows, out]: the most that rounding each input to fixed point may move an output: half of 2^(E - 20) an input
    times its weight's magnitude, E the exponent of the largest input of its group (a block is its group or a part of
    it, so its E is at most the group's)."""
    largest = x.double().abs().view(x.shape[0], -1, group).amax(-1).clamp_min(2.0**MIN_EXPONENT)
    half_step = torch.exp2(torch.floor(torch.log2(largest)) - 21).repeat_interleave(group, 1)
    return half_step @ weight.double().abs().T


def assert_held_to_reference(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group: int | None = None
) -> None:
    """``got`` [rows, out] (bf16, from a kernel) against x @ weight.T in float64 (``weight`` the exact weight; ``group``
    the inputs a scale of an int4 weight, whose kernel holds x in fixed point; None: a kernel that reads x as it is)."""
    reference = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T  # sum of |products|: what float32 sums may lose a part of
    bound = reference.abs() * 2.0**-8 + magnitude * x.shape[1] * 2.0**-24
    if group is not None:
        bound = bound + fixed_point_loss(x, weight, group)
    got = got.double()
    assert got.shape == reference.shape
    assert ((got - reference).abs() <= bound).all(), (got - reference).abs().max()
    rounded = reference.to(torch.bfloat16).double()
    assert (got == rounded).double().mean() > 0.99, "most outputs are the float64 value rounded to bf16 once"


def random_weight(
    out: int, inputs: int, group: int, scale_dtype: torch.dtype, generator: torch.Generator, scale_power: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random int4 weight packed for the kernel (words, scales: 2^``scale_power`` times 0.001 to 0.021) and
    exactly, in float64 [out, inputs]."""
    levels = torch.randint(-8, 8, (out, inputs), generator=generator, dtype=torch.int8)
    scale = ((torch.rand(out, inputs // group, generator=generator) * 0.02 + 1e-3) * 2.0**scale_power).to(scale_dtype)
    words, scales = int4_cpu.pack(levels, scale)
    return words, scales, (levels.double().view(out, -1, group) * scale.double()[..., None]).view(out, inputs)


def held_to_reference(
    out: int,
    inputs: int,
    group: int,
    scale_dtype: torch.dtype,
    rows: int,
    seed: int = 0,
    spread: float = 0.0,
    power: int = 0,
    scale_power: int = 0,
) -> None:
    """A random weight and ``rows`` rows of x, each input times 2^``power`` and 2 to a uniform power in [-spread, 0]."""
    generator = torch.Generator().manual_seed(seed)
    words, scales, weight = random_weight(out, inputs, group, scale_dtype, generator, scale_power)
    x = torch.randn(rows, inputs, generator=generator) * torch.exp2(
        power - spread * torch.rand(rows, inputs, generator=generator)
    )
    x = x.to(torch.bfloat16)
    assert_held_to_reference(int4_cpu.rows(x, words, scales, group, out), x, weight, group)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] * s[1] <= 1 << 26], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_e2b_shape(shape):
    held_to_reference(*shape, group=32, scale_dtype=torch.bfloat16, rows=1)


def test_lm_head_shape_first_tiles():
    """``lm_head`` [262144, 1536]: its first 8192 rows (the kernel treats every tile alike; the whole one's float64
    reference takes 3 GiB)."""
    held_to_reference(8192, 1536, group=32, scale_dtype=torch.float16, rows=1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12])
@pytest.mark.parametrize(("out", "inputs", "group"), [(37, 96, 32), (16, 64, 64), (100, 384, 128), (5, 256, 256),
                                                      (33, 48, 8), (50, 144, 48)])  # fmt: skip
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_odd_sizes_rows_and_scale_dtypes(out, inputs, group, rows, scale_dtype):
    held_to_reference(out, inputs, group, scale_dtype, rows, seed=out + rows)


@pytest.mark.parametrize("group", [32, 128])
def test_inputs_far_below_their_groups_largest(group):
    """Inputs 2^0 to 2^-40 of one another in a group: those within 2^13 of the largest keep every bit, the rest are
    rounded at 2^-21 of it (few inputs a product, so that the allowance for float32 sums stays small)."""
    held_to_reference(48, 256, group, torch.bfloat16, rows=3, seed=group, spread=40.0)


def test_tiny_and_huge_inputs():
    """Rows whose inputs are near 2^-112, subnormal (2^-126 and below) and near 2^100: 2^(E - 20) is then a
    subnormal float32, or 2^(20 - E) beyond float32's range, which the kernel takes in two factors. (Scales of 2^30 for
    the subnormal inputs: an output that is subnormal itself is written as 0, as vcvtneps2bf16 does.)"""
    held_to_reference(48, 256, 32, torch.bfloat16, rows=2, seed=1, spread=8.0, power=-112)
    held_to_reference(48, 256, 32, torch.float32, rows=2, seed=2, spread=4.0, power=-127, scale_power=30)
    held_to_reference(48, 256, 32, torch.float32, rows=2, seed=3, spread=8.0, power=100)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_an_input_not_finite_makes_its_rows_outputs_nan(bad):
    generator = torch.Generator().manual_seed(3)
    words, scales, weight = random_weight(40, 96, 32, torch.bfloat16, generator)
    x = torch.randn(3, 96, generator=generator).to(torch.bfloat16)
    x[1, 37] = bad
    got = int4_cpu.rows(x, words, scales, 32, 40)
    assert got[1].isnan().all()
    assert_held_to_reference(got[[0, 2]], x[[0, 2]], weight, 32)


def test_both_threads_compute_their_tiles():
    """The tests run torch on one thread (conftest); a decode step runs the kernel on every core, each thread taking
    its own tiles, and the rows' fixed point made once by the calling thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.ops.decodebench_int4.threads() == 2
        held_to_reference(2048, 1536, 32, torch.bfloat16, rows=1, seed=4)
        held_to_reference(512, 128, 32, torch.float16, rows=6, seed=5)
    finally:
        torch.set_num_threads(threads)


def test_bad_operands_are_refused_by_name():
    words, scales = int4_cpu.pack(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        int4_cpu.rows(torch.zeros(1, 64), words, scales, 32, 16)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        int4_cpu.rows(torch.zeros(1, 64, dtype=torch.bfloat16), words, scales, 12, 16)
    with pytest.raises(RuntimeError, match="words"):
        int4_cpu.rows(torch.zeros(1, 128, dtype=torch.bfloat16), words, scales, 32, 16)
