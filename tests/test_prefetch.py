"""The kernels' prefetch hint (``engines/prefetch.py``): timed in turns, the faster kept and cached per machine, set
for every kernel, refused by name when unknown, and without effect on any output."""

from __future__ import annotations

import json

import pytest
import torch

from engines import bf16_cpu, cpu_kernels, int4_cpu, prefetch

HINTS_HERE = cpu_kernels.missing()


@pytest.fixture(autouse=True)
def _hint_kept():
    """Each test here may set the hint; the process's choice is set again after it."""
    if HINTS_HERE:
        pytest.skip(f"the project's CPU kernels: {HINTS_HERE}")
    yield
    torch.ops.decodebench_int4.use_prefetch_hint(cpu_kernels.prefetch_choice().hint)


@pytest.mark.parametrize(("ms", "faster"), [({"nta": 2.0, "t0+t1": 1.0}, "t0+t1"), ({"nta": 1.0, "t0+t1": 3.0}, "nta")])
def test_the_faster_hint_is_set_and_cached_per_machine(tmp_path, ms, faster):
    timed = []

    def fake_timed():
        timed.append(1)
        return ms

    held = prefetch.key("digest", 2)
    choice = prefetch.choose(tmp_path, held, fake_timed)
    assert (choice.hint, choice.how, choice.ms, len(timed)) == (faster, "measured", ms, 1)
    assert cpu_kernels.prefetch_hint() == faster
    (saved,) = tmp_path.glob("*.json")
    assert json.loads(saved.read_text())["cpu"] == held["cpu"]
    torch.ops.decodebench_int4.use_prefetch_hint("nta" if faster != "nta" else "t0+t1")
    again = prefetch.choose(tmp_path, held, fake_timed)
    assert (again.hint, again.how, len(timed)) == (faster, f"cached ({saved})", 1)  # read, not timed
    assert cpu_kernels.prefetch_hint() == faster  # and set again
    assert prefetch.choose(tmp_path, prefetch.key("digest", 1), fake_timed).how == "measured" and len(timed) == 2


def test_each_hint_is_timed_in_turns_and_its_median_kept(monkeypatch):
    """A clock that moves 2 ms for a pass with NTA and 1 ms with T0: each hint's median is its own, and the rounds
    alternate which goes first."""
    clock = [0.0]
    order = []

    def passes():
        hint = cpu_kernels.prefetch_hint()
        order.append(hint)
        clock[0] += 0.002 if hint == "nta" else 0.001

    monkeypatch.setattr(prefetch.time, "perf_counter", lambda: clock[0])
    assert prefetch.measure(passes) == pytest.approx({"nta": 2.0, "t0+t1": 1.0})
    rounds = [tuple(order[i : i + 2]) for i in range(2, len(order), 2)]
    assert order[:2] == ["nta", "t0+t1"] and len(rounds) == prefetch.ROUNDS
    assert rounds[::2] == [("nta", "t0+t1")] * len(rounds[::2])
    assert rounds[1::2] == [("t0+t1", "nta")] * len(rounds[1::2])


def test_an_unknown_hint_is_refused_by_name():
    with pytest.raises(RuntimeError, match="prefetch hint: nta or t0\\+t1, got t2"):
        torch.ops.decodebench_int4.use_prefetch_hint("t2")


def test_the_loaded_library_prefetches_with_its_machines_choice():
    """The hint the kernels use is the one chosen for this machine (each hint timed), whichever it is."""
    choice = cpu_kernels.prefetch_choice()
    assert choice.hint in prefetch.HINTS and set(choice.ms) == set(prefetch.HINTS)
    assert cpu_kernels.prefetch_hint() == choice.hint


def test_the_outputs_are_the_same_under_either_hint():
    generator = torch.Generator().manual_seed(0)
    levels = torch.randint(-8, 8, (100, 256), generator=generator, dtype=torch.int8)
    words, scales = int4_cpu.pack(levels, torch.rand(100, 8, generator=generator).to(torch.bfloat16))
    packed = bf16_cpu.pack(torch.randn(100, 256, generator=generator).to(torch.bfloat16))
    x = torch.randn(3, 256, generator=generator).to(torch.bfloat16)
    buffer = torch.randint(0, 255, (1 << 20,), generator=generator, dtype=torch.uint8)
    outputs = {}
    for hint in prefetch.HINTS:
        torch.ops.decodebench_int4.use_prefetch_hint(hint)
        outputs[hint] = (int4_cpu.rows(x, words, scales, 32, 100, 3), bf16_cpu.rows(x, packed, 100),
                         torch.ops.decodebench_read.stream(buffer))  # fmt: skip
    for got, want in zip(*outputs.values(), strict=True):
        assert torch.equal(got, want)
