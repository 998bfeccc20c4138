"""``decodebench_int4.int4_rows`` (engines/int4_cpu.py) against a float64 reference: every E2B linear shape, odd
sizes (a partial last tile, an odd number of tiles, groups of 8 to 256 inputs), 1 to 12 rows (whole and partial
passes of four, over tiles taken two at a time), the scales in each dtype a checkpoint stores them in, inputs spread
far below their group's largest, tiny and not finite, with x held in three limbs and in two. Exact means: each output
within the bf16 rounding of the float64 value plus what float32 sums of its products may lose and what holding x in
fixed point may lose (the kernel's integer products: each input rounded at half of 2^(E - F), E the exponent of its
block's largest input and F = 20 for three limbs, 13 for two, which is nothing for an input within 2^(F - 7) of it),
and equal to the correctly rounded bf16 value almost everywhere (``ROUNDED_ONCE``); and, where the inputs are chosen
so that holding them in two limbs moves the outputs far beyond that, within it of the product over x as the limbs hold
it."""

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
# By limbs: the share of outputs that are the float64 value rounded to bf16 once, at least, and how many more may miss
# it (two limbs: a product of tens of outputs has too few for that share to settle). Three keep all but a few in ten
# thousand; two move about one in a hundred by one bf16 unit (98.8-99.0 % kept on E2B's shapes, normal inputs).
ROUNDED_ONCE = {3: (0.99, 0), 2: (0.98, 3)}


def exponents(x: torch.Tensor, size: int) -> torch.Tensor:
    """[rows, in / size]: E of each run of ``size`` inputs, the exponent of its largest (``MIN_EXPONENT`` at least)."""
    largest = x.double().abs().view(x.shape[0], -1, size).amax(-1)
    return torch.floor(torch.log2(largest)).clamp_min(MIN_EXPONENT)


def fixed_point_loss(x: torch.Tensor, weight: torch.Tensor, group: int, limbs: int) -> torch.Tensor:
    """[rows, out]: the most that rounding each input to fixed point may move an output: half of 2^(E - F) an input
    times its weight's magnitude, E the exponent of the largest input of its group (a block is its group or a part of
    it, so its E is at most the group's)."""
    fraction = int4_cpu.fraction_bits(limbs)
    half_step = torch.exp2(exponents(x, group) - fraction - 1).repeat_interleave(group, 1)
    return half_step @ weight.double().abs().T


def block_of(group: int) -> int:
    """The inputs of a block of the kernel's fixed point: the largest multiple of 8 dividing the group, 64 at most."""
    return max(b for b in range(8, min(group, 64) + 1, 8) if group % b == 0)


def held_in_limbs(x: torch.Tensor, group: int, limbs: int) -> torch.Tensor:
    """x [rows, in] (float64) as the kernel holds it: each input rounded to the nearest (ties to even) multiple of
    2^(E - F), E its block's."""
    block = block_of(group)
    unit = torch.exp2(exponents(x, block) - int4_cpu.fraction_bits(limbs)).repeat_interleave(block, 1)
    return torch.round(x.double() / unit) * unit


def assert_held_to_reference(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group: int | None = None, limbs: int = 3
) -> None:
    """``got`` [rows, out] (bf16, from a kernel) against x @ weight.T in float64 (``weight`` the exact weight; ``group``
    the inputs a scale of an int4 weight, whose kernel holds x in fixed point of ``limbs`` limbs; None: a kernel that
    reads x as it is)."""
    reference = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T  # sum of |products|: what float32 sums may lose a part of
    bound = reference.abs() * 2.0**-8 + magnitude * x.shape[1] * 2.0**-24
    if group is not None:
        bound = bound + fixed_point_loss(x, weight, group, limbs)
    got = got.double()
    assert got.shape == reference.shape
    assert ((got - reference).abs() <= bound).all(), (got - reference).abs().max()
    rounded = reference.to(torch.bfloat16).double()
    share, few = ROUNDED_ONCE[limbs if group is not None else 3]
    misses = int((got != rounded).sum())
    assert misses <= (1 - share) * got.numel() + few, f"{misses} of {got.numel()} outputs not the float64 value rounded"


def random_weight(
    out: int, inputs: int, group: int, scale_dtype: torch.dtype, generator: torch.Generator, scale_power: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random int4 weight packed for the kernel (words, scales: 2^``scale_power`` times 0.001 to 0.021) and
    exactly, in float64 [out, inputs]."""
    levels = torch.randint(-8, 8, (out, inputs), generator=generator, dtype=torch.int8)
    scale = ((torch.rand(out, inputs // group, generator=generator) * 0.02 + 1e-3) * 2.0**scale_power).to(scale_dtype)
    return packed_and_exact(levels, scale)


def packed_and_exact(levels: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levels [out, inputs] and their scales packed for the kernel (words, scales), and the weight exactly, in
    float64."""
    out, inputs = levels.shape
    words, scales = int4_cpu.pack(levels, scale)
    group = inputs // scale.shape[1]
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
    limbs: int = 3,
) -> None:
    """A random weight and ``rows`` rows of x, each input times 2^``power`` and 2 to a uniform power in [-spread, 0]."""
    generator = torch.Generator().manual_seed(seed)
    words, scales, weight = random_weight(out, inputs, group, scale_dtype, generator, scale_power)
    x = torch.randn(rows, inputs, generator=generator) * torch.exp2(
        power - spread * torch.rand(rows, inputs, generator=generator)
    )
    x = x.to(torch.bfloat16)
    assert_held_to_reference(int4_cpu.rows(x, words, scales, group, out, limbs), x, weight, group, limbs)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] * s[1] <= 1 << 26], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_e2b_shape(shape):
    held_to_reference(*shape, group=32, scale_dtype=torch.bfloat16, rows=1)
    held_to_reference(*shape, group=32, scale_dtype=torch.bfloat16, rows=1, limbs=2)


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


@pytest.mark.parametrize("limbs", [3, 2])
@pytest.mark.parametrize("rows", [1, 4, 5, 9])
@pytest.mark.parametrize(("out", "inputs", "group"), [(37, 96, 32), (100, 384, 128), (33, 48, 8), (50, 144, 48)])
def test_two_limbs_odd_sizes_and_rows(out, inputs, group, rows, limbs):
    held_to_reference(out, inputs, group, torch.float16, rows, seed=out + rows, limbs=limbs)


@pytest.mark.parametrize("limbs", [3, 2])
@pytest.mark.parametrize("group", [32, 128])
def test_inputs_far_below_their_groups_largest(group, limbs):
    """Inputs 2^0 to 2^-40 of one another in a group: those within 2^(F - 7) of the largest keep every bit, the rest
    are rounded at 2^-(F + 1) of it (few inputs a product, so that the allowance for float32 sums stays small)."""
    held_to_reference(48, 256, group, torch.bfloat16, rows=3, seed=group, spread=40.0, limbs=limbs)


@pytest.mark.parametrize("limbs", [3, 2])
@pytest.mark.parametrize("group", [32, 128])
def test_x_is_held_in_the_limbs_asked_for(group, limbs):
    """Each block's first input 1, its others about 2^-10 (7 to 9 bits below it), the weight's levels zero on the
    first: the outputs are the small inputs' products, which two limbs round at 2^-14 (three or four of their bits
    kept) and three keep whole. Each count's outputs are within bf16 rounding and float32 sums of the product over x as
    that count holds it (``held_in_limbs``), and, for two limbs, that product is further from the exact one than this
    allowance on more than half the outputs (about four in five): a kernel holding x in the other count fails here."""
    generator = torch.Generator().manual_seed(group + limbs)
    out, inputs, block = 64, 256, block_of(group)
    levels = torch.randint(-8, 8, (out, inputs), generator=generator, dtype=torch.int8)
    levels[:, ::block] = 0
    scale = (torch.rand(out, inputs // group, generator=generator) * 0.02 + 1e-3).to(torch.bfloat16)
    words, scales, weight = packed_and_exact(levels, scale)
    sign = torch.where(torch.rand(2, inputs, generator=generator) < 0.5, -1.0, 1.0)
    x = (torch.rand(2, inputs, generator=generator) + 1.0) * 2.0**-10 * sign
    x[:, ::block] = 1.0
    x = x.to(torch.bfloat16)
    got = int4_cpu.rows(x, words, scales, group, out, limbs).double()
    held = held_in_limbs(x, group, limbs) @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    allowance = held.abs() * 2.0**-8 + magnitude * inputs * 2.0**-24
    assert ((got - held).abs() <= allowance).all()
    moved = (held - x.double() @ weight.T).abs() > 2 * allowance
    assert moved.double().mean() > 0.5 if limbs == 2 else not moved.any()


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
    """Each wrong operand or argument named in the error."""
    words, scales = int4_cpu.pack(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        int4_cpu.rows(torch.zeros(1, 64), words, scales, 32, 16)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        int4_cpu.rows(torch.zeros(1, 64, dtype=torch.bfloat16), words, scales, 12, 16)
    with pytest.raises(RuntimeError, match="words"):
        int4_cpu.rows(torch.zeros(1, 128, dtype=torch.bfloat16), words, scales, 32, 16)
    with pytest.raises(RuntimeError, match="limbs: 2 or 3"):
        int4_cpu.rows(torch.zeros(1, 64, dtype=torch.bfloat16), words, scales, 32, 16, 4)
