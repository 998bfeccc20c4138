"""``decodebench_int4.int4_rows`` (engines/int4_cpu.py) against a float64 reference: every E2B linear shape, odd
sizes (a partial last tile, an odd number of tiles, groups of 8 to 256 inputs), 1 to 12 rows (whole and partial
passes of four, over tiles taken two at a time), the scales in each dtype a checkpoint stores them in. Exact means:
each output within the bf16 rounding of the float64 value plus what float32 sums of its products may lose, and equal
to the correctly rounded bf16 value almost everywhere."""

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


def assert_held_to_reference(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``got`` [rows, out] (bf16, from a kernel) against x @ weight.T in float64 (``weight`` the exact weight)."""
    reference = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T  # sum of |products|: what float32 sums may lose a part of
    bound = reference.abs() * 2.0**-8 + magnitude * x.shape[1] * 2.0**-24
    got = got.double()
    assert got.shape == reference.shape
    assert ((got - reference).abs() <= bound).all(), (got - reference).abs().max()
    rounded = reference.to(torch.bfloat16).double()
    assert (got == rounded).double().mean() > 0.99, "most outputs are the float64 value rounded to bf16 once"


def held_to_reference(out: int, inputs: int, group: int, scale_dtype: torch.dtype, rows: int, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(-8, 8, (out, inputs), generator=generator, dtype=torch.int8)
    scale = (torch.rand(out, inputs // group, generator=generator) * 0.02 + 1e-3).to(scale_dtype)
    x = torch.randn(rows, inputs, generator=generator).to(torch.bfloat16)
    words, scales = int4_cpu.pack(levels, scale)
    weight = (levels.double().view(out, -1, group) * scale.double()[..., None]).view(out, inputs)
    assert_held_to_reference(int4_cpu.rows(x, words, scales, group, out), x, weight)


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


def test_bad_operands_are_refused_by_name():
    words, scales = int4_cpu.pack(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        int4_cpu.rows(torch.zeros(1, 64), words, scales, 32, 16)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        int4_cpu.rows(torch.zeros(1, 64, dtype=torch.bfloat16), words, scales, 12, 16)
    with pytest.raises(RuntimeError, match="words"):
        int4_cpu.rows(torch.zeros(1, 128, dtype=torch.bfloat16), words, scales, 32, 16)
