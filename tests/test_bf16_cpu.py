"""``decodebench_bf16.bf16_rows`` (engines/bf16_cpu.py) against a float64 reference: every E2B linear shape, odd
sizes (a partial last tile, an odd number of tiles), 1 to 17 rows (whole and partial passes of eight), and the rows
a tied table reads back from the packed layout. Exact means: each output within the bf16 rounding of the float64
value plus what float32 sums of its products may lose, and equal to the correctly rounded bf16 value almost
everywhere."""

from __future__ import annotations

import pytest
import torch

from engines import bf16_cpu, cpu_kernels
from tests.bench_int4 import SHAPES
from tests.test_int4_cpu import assert_held_to_reference


@pytest.fixture(scope="module", autouse=True)
def _runs_here():
    reason = bf16_cpu.unsupported(torch.bfloat16)
    if reason:
        pytest.skip(f"{bf16_cpu.OP}: {reason}")


def held_to_reference(out: int, inputs: int, rows: int, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out, inputs, generator=generator) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, inputs, generator=generator).to(torch.bfloat16)
    assert_held_to_reference(bf16_cpu.rows(x, bf16_cpu.pack(weight), out), x, weight)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] * s[1] <= 1 << 26], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_e2b_shape(shape):
    held_to_reference(*shape, rows=1)


def test_lm_head_shape_first_tiles():
    """``lm_head`` [262144, 1536]: its first 8192 rows (the kernel treats every tile alike)."""
    held_to_reference(8192, 1536, rows=3)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
@pytest.mark.parametrize(("out", "inputs"), [(37, 96), (16, 64), (48, 384), (5, 256), (33, 8), (100, 1536)])
def test_odd_sizes_and_rows(out, inputs, rows):
    held_to_reference(out, inputs, rows, seed=out + rows)


def test_a_row_read_back_from_the_packed_layout_is_the_weights_row():
    weight = torch.randn(37, 96).to(torch.bfloat16)
    ids = torch.tensor([[0, 36, 15], [16, 17, 0]])
    assert torch.equal(bf16_cpu.row_of(bf16_cpu.pack(weight), ids), weight[ids])


def test_bad_operands_are_refused_by_name():
    packed = bf16_cpu.pack(torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16_cpu.rows(torch.zeros(1, 64), packed, 16)
    with pytest.raises(RuntimeError, match="packed"):
        bf16_cpu.rows(torch.zeros(1, 128, dtype=torch.bfloat16), packed, 16)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        bf16_cpu.rows(torch.zeros(1, 60, dtype=torch.bfloat16), packed, 16)
    assert "multiple of 8" in bf16_cpu.unsupported(torch.bfloat16, 60)
    assert "float32" in bf16_cpu.unsupported(torch.float32, 64)


def test_a_product_is_shared_among_torchs_threads_with_the_same_outputs():
    """Built with OpenMP, the kernels' tiles are shared among torch's threads (without it every product ran on one
    core); a tile is one thread's whole, so the outputs are the same bits on one thread or two."""
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(1000, 1536, generator=generator) * 0.05).to(torch.bfloat16)
    x = torch.randn(5, 1536, generator=generator).to(torch.bfloat16)
    packed, before = bf16_cpu.pack(weight), torch.get_num_threads()
    try:
        outputs = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert cpu_kernels.threads() == threads
            outputs[threads] = bf16_cpu.rows(x, packed, 1000)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[1], outputs[2])
