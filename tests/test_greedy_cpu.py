"""``decodebench_pick.first_max`` (engines/greedy_cpu.py) against torch's argmax, which it replaces: the same index
to the bit on every row (the first of the largest, a NaN the largest, -0 equal to +0, -inf a value like another), on
E2B's vocabulary (split among the threads), widths that leave a partial vector or a part of one more value, and rows
made to tie; the choice of kernel, and the shape a compiled step traces."""

from __future__ import annotations

import pytest
import torch

from engines import greedy_cpu
from tests.conftest import opened

WIDTHS = [1, 15, 17, 1000, 65536, 131073, 262144]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module", autouse=True)
def _runs_here():
    if greedy_cpu.choose("cpu", torch.bfloat16) != greedy_cpu.OP:
        pytest.skip(f"{greedy_cpu.OP}: the project's CPU kernels do not run here")


def first_max(x: torch.Tensor) -> torch.Tensor:
    return greedy_cpu.pick(x, greedy_cpu.OP)


def logits(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rounded to integers: many values tie at the top of a row."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=generator) * 4).round().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_the_index_argmax_gives(width, dtype):
    x = logits(3, width, dtype, width)
    assert torch.equal(first_max(x), x.argmax(-1, keepdim=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tie_goes_to_the_first_index_even_in_another_thread_s_part(dtype):
    x = torch.zeros(1, 262144, dtype=dtype)
    for at in (262143, 200000, 131072, 131071):  # the last part first, then ever earlier ones
        x[0, at] = 5
        assert first_max(x).item() == x.argmax(-1).item() == at


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [17, 262144])
def test_the_first_nan_is_the_largest(width, dtype):
    x = logits(2, width, dtype, 7)
    x[0, width - 1] = float("nan")
    x[1, [width // 3, width - 2]] = float("nan")
    x[1, 0] = float("inf")
    assert torch.equal(first_max(x), x.argmax(-1, keepdim=True))
    assert first_max(x)[:, 0].tolist() == [width - 1, width // 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities_and_signed_zeros(dtype):
    width = 262144
    x = torch.full((4, width), float("-inf"), dtype=dtype)  # row 0: every value -inf
    x[1, 140000] = -1e30 if dtype == torch.float32 else -3e38  # row 1: one finite value among -inf
    x[2] = -0.0
    x[2, 200000] = 0.0  # row 2: -0 and +0 tie, the first wins
    x[3, [150000, 9]] = float("inf")  # row 3: two +inf
    assert torch.equal(first_max(x), x.argmax(-1, keepdim=True))
    assert first_max(x)[:, 0].tolist() == [0, 140000, 0, 9]


def test_bad_input_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"x: \[rows, n\]"):
        first_max(torch.zeros(4))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        first_max(torch.zeros(1, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="n > 0"):
        first_max(torch.zeros(1, 0))


def test_the_kernel_is_chosen_only_where_it_runs():
    assert greedy_cpu.choose("cpu", torch.bfloat16) == greedy_cpu.OP
    assert greedy_cpu.choose("cpu", torch.float16) == greedy_cpu.ATEN
    assert greedy_cpu.choose("cuda", torch.bfloat16) == greedy_cpu.ATEN
    x = logits(2, 300, torch.float16, 3)
    assert torch.equal(greedy_cpu.pick(x, greedy_cpu.ATEN), x.argmax(-1, keepdim=True))


def test_a_compiled_step_calls_it_as_one_operator():
    """Traced through its fake (the [rows, 1] int64 it returns), the compiled function gives the eager index."""
    x = logits(2, 4097, torch.bfloat16, 11)

    def step(v: torch.Tensor) -> torch.Tensor:
        return greedy_cpu.pick(torch.tanh(v / 30) * 30, greedy_cpu.OP)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), step(x))
    assert torch.equal(step(x), (torch.tanh(x / 30) * 30).argmax(-1, keepdim=True))


@pytest.mark.parametrize("engine", ["ring", "rust"])
def test_an_engine_picks_with_it_and_writes_argmax_s_tokens(cache_dir, tiny, monkeypatch, engine):
    """A stepping engine and the Rust engine pick each token with ``first_max`` where it runs and say so; forced to
    aten's argmax, the same engine writes the same tokens."""
    overrides = (f"cache_dir={cache_dir}", f"engine={engine}", "engine.weights=int4")
    prompt = list(range(3, 40))
    tokens, kernels = {}, {}
    for kernel in (greedy_cpu.OP, greedy_cpu.ATEN):
        monkeypatch.setattr(greedy_cpu, "choose", lambda kind, dtype, kernel=kernel: kernel)
        loaded = opened(*overrides, *(("engine.backend=eager",) if engine == "ring" else ())).load()
        try:
            tokens[kernel] = loaded.generate(prompt, 12).tokens
            kernels[kernel] = loaded.describe()["greedy"]
        finally:
            loaded.close()
    assert kernels == {greedy_cpu.OP: greedy_cpu.OP, greedy_cpu.ATEN: greedy_cpu.ATEN}
    assert tokens[greedy_cpu.OP] == tokens[greedy_cpu.ATEN] and len(tokens[greedy_cpu.OP]) == 12
