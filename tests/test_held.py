"""The int4 weights a decode step streams held in one allocation (engines/held.py): in module order, each on a line
of its own, every product's outputs unchanged, other kernels' weights left as they were; an engine holds its own so."""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import nn

from engines import held, int4_cpu
from engines.int4 import Int4Linear
from tests.conftest import opened
from tests.test_int4 import ATEN, ROWS, runs_here
from tests.test_joined import IN, holder, int4_linear


def test_the_weights_move_into_one_allocation_in_module_order_with_the_same_outputs():
    runs_here(ROWS)
    parts = {"first": int4_linear(48, 0), "second": int4_linear(16, 1), "third": int4_linear(32, 2)}
    parts["inner"] = holder(deeper=int4_linear(64, 3))
    module = holder(**parts, aten=int4_linear(32, 4, ATEN))
    x = torch.randn(2, IN, dtype=torch.bfloat16)
    before = [m(x) for m in module.modules() if isinstance(m, Int4Linear)]
    aten_packed = module.aten.packed
    stored = held.hold_together(module)
    linears = [module.first, module.second, module.third, module.inner.deeper]
    tensors = [getattr(m, name) for m in linears for name in held.HELD]
    base = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in tensors)  # one allocation
    assert stored == tensors[0].untyped_storage().nbytes() >= sum(t.nbytes for t in tensors)
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts) and all((s - base) % held.ALIGN == 0 for s in starts)  # module order, on lines
    assert all(a.data_ptr() + a.nbytes <= b.data_ptr() for a, b in pairwise(tensors))  # none overlaps
    assert module.aten.packed is aten_packed  # another kernel's weight is left as it was
    after = [m(x) for m in module.modules() if isinstance(m, Int4Linear)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_model_without_int4_rows_linears_is_left_as_it_was():
    module = holder(dense=nn.Linear(IN, 8), aten=int4_linear(32, 0, ATEN))
    weight = module.dense.weight
    assert held.hold_together(module) == 0
    assert module.dense.weight is weight


def test_an_int4_engine_holds_its_weights_together(cache_dir, tiny):
    runs_here(ROWS)
    engine = opened(f"cache_dir={cache_dir}", "engine=ring", "engine.weights=int4", "engine.backend=eager").load()
    linears = held.streamed(engine.model)
    assert linears and all(m.kernel == int4_cpu.OP for m in linears)
    storages = {getattr(m, name).untyped_storage().data_ptr() for m in linears for name in held.HELD}
    assert len(storages) == 1
    assert engine.describe()["held_together_bytes"] == linears[0].words.untyped_storage().nbytes()
    engine.close()
