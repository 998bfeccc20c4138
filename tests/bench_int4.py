"""``make bench-int4``: every E2B linear shape at batch 1, dense bf16 (``F.linear``, ``torch.mv``: what
``engine.one_row=mv`` calls on one row, and ``dense-rows``, the project's ``bf16_rows``: ``engine.one_row=rows``)
against int4 (the kernel ``engine.weights=int4`` picks here: ``int4_rows`` on a CPU with AVX-512 BF16; ``int4-2limbs``,
``int4_rows`` holding x in two limbs, ``engine.int4_limbs=2``; and ``int4-aten``, aten's
``_weight_int4pack_mm_for_cpu``), timed by pytest-benchmark. ``FLOOR``, a weight of one
tile, times what a call costs before it reads anything (the call, the threads' start, the output), which the report
takes from each kernel's other medians.

Each kernel and shape is timed twice (``residence``): from ``memory`` (copies of the weight that leave the caches
behind, each call reading another, as a decode step reads each weight once) and from ``cache`` (one weight of the
shape's inputs and as many of its outputs as ``CACHED_BYTES`` holds, ``cached_outputs``, called over and over: it
stays in the cores' L2). The second is what the kernel's arithmetic allows with the memory out of the way: where it is
below the machine's streaming read, the kernel cannot reach the read from memory either, and the report says so
(``kernel`` against ``memory``).

Not part of ``make test`` (speed belongs in benchmarks): the Makefile runs this file alone and keeps
pytest-benchmark's JSON under ``evidence/bench/``, where ``make report`` reads it. Each benchmark
also checks that the int4 output equals the dense one on the dequantized weight (bf16 tolerance), and records
the bytes one call must read (``extra_info["bytes"]``: the held weight's, from its tensors) and the project's kernels'
prefetch hint (``extra_info["prefetch"]``: ``engines/prefetch.py``'s choice, None where they do not run), so the report
can give each kernel's GB/s alone, against the same class's GB/s inside a decode step (``experiment=profile``), and the
machine's streaming read just after it (``extra_info["read_gb_s"]``, ``hardware.read_now``, the project's stream
read beside torch's). A memory row also alternates, ``PAIRED_ROUNDS`` times, one pass over every copy of its weight
with one streaming read (``extra_info["read_pairs"]``: the GB/s of each, round by round), so its share of the read is
taken at the same moment: on a shared host the read moves 2x within minutes, which a read after the benchmark does not
see.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

from decodebench import hardware
from decodebench.device import Device, cache_bytes, measure_bandwidth, resolve_device
from engines import cpu_kernels, int4, int4_cpu, one_row
from engines.joined import JOINED
from experiments.cell import timed
from tests.conftest import e2b_text_config
from tests.test_int4 import packed_weight


def e2b_linear_shapes() -> list[tuple[int, int]]:
    """Every distinct [out, in] of E2B's linears (sliding and full attention, single and double-wide MLPs,
    per-layer projections, lm_head) and of those the ring joins (``engines.joined``: q, k and v where a layer writes
    its own K/V, gate and up), read off Transformers' model built on the meta device from E2B's text config."""
    with torch.device("meta"):
        model = Gemma4ForCausalLM(e2b_text_config())
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    for layer in model.model.layers:
        qkv = () if layer.self_attn.is_kv_shared_layer else JOINED["qkv_proj"]
        for module, parts in ((layer.self_attn, qkv), (layer.mlp, JOINED["gate_up_proj"])):
            if parts:
                weights = [getattr(module, part).weight for part in parts]
                shapes.add((sum(w.shape[0] for w in weights), weights[0].shape[1]))
    return sorted(shapes)


FLOOR = (16, 64)  # one tile of outputs (2 KB bf16, 0.6 KB int4): a call that reads next to nothing, what any call costs
SHAPES = [*e2b_linear_shapes(), FLOOR]
KERNELS = {"dense": "F.linear", "dense-mv": "torch.mv"}


def packed_linear(weight: torch.Tensor) -> one_row.PackedLinear:
    """``weight`` [out, in] as ``engine.one_row=rows`` holds it."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    linear.weight.data = weight
    return one_row.PackedLinear(linear)


# A call's weight copies together hold at least this much (1024 copies at most): twice the largest cache, 512 MiB at
# least. A fixed 512 MiB left a 2-core Xeon that reports 480 MiB of L3 reading some copies from it: torch.mv "read"
# 102-105 % of the streaming read on E2B's layer shapes there.
COLD_BYTES = max(512 << 20, 2 * cache_bytes())
# A cache-resident weight holds at most this much: half of each thread's L2 (1 MiB where none is reported).
CACHED_BYTES = torch.get_num_threads() * (cache_bytes(2) or 2 << 20) // 2
# Outputs of a cache-resident weight come in multiples of this: two tiles of 16 for each thread (the row kernels share
# tiles between threads two at a time), so every thread gets as many.
CACHED_STEP = 32 * torch.get_num_threads()
# Memory rows: rounds of one pass over every copy against one streaming read, which of the two goes first alternating.
PAIRED_ROUNDS = 9
# Bytes a weight holds per input of one output: bf16; int4 levels with a bf16 scale (and aten's zero) per 32 inputs.
HELD_PER_WEIGHT = {"dense": 2.0, "int4": 0.5 + 4 / 32}


def cached_outputs(shape: tuple[int, int], weights: str) -> int:
    """Outputs of the cache-resident weight for an [out, in] ``shape`` held as ``weights``: all of them where the
    weight fits in ``CACHED_BYTES``, else the most in multiples of ``CACHED_STEP`` that fit (at least one step)."""
    out, inputs = shape
    per_output = inputs * HELD_PER_WEIGHT["int4" if weights.startswith("int4") else "dense"]
    if out * per_output <= CACHED_BYTES:
        return out
    return max(CACHED_STEP, int(CACHED_BYTES // per_output) // CACHED_STEP * CACHED_STEP)


def read_pairs(one_pass: Callable[[], None], nbytes: int, device: Device) -> list[dict[str, float]]:
    """``PAIRED_ROUNDS`` rounds, each the GB/s of ``one_pass`` (which reads ``nbytes``, 1e9 bytes a GB; ``timed``: from
    before its first call to after its last, ``device.sync()`` at both ends) and of the machine's streaming read at that
    moment (``measure_bandwidth``'s read, the best of torch's reductions and the project's stream read over
    ``read_bytes``, one repeat: the figure a cell's roofline divides by), the pass first in even rounds, the read first
    in odd ones."""
    def passed() -> float:
        return nbytes / timed(device, one_pass)[1] / 1e9

    def read() -> float:
        return measure_bandwidth(device, repeats=1, copy=False, reads=cpu_kernels.reads(device))["value"]

    rounds = []
    for turn in range(PAIRED_ROUNDS):
        if turn % 2:
            read_gb_s, kernel_gb_s = read(), passed()
        else:
            kernel_gb_s, read_gb_s = passed(), read()
        rounds.append({"kernel_gb_s": kernel_gb_s, "read_gb_s": read_gb_s})
    return rounds


@pytest.fixture(scope="module")
def device():
    return resolve_device("auto")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("weights", ["dense", "dense-mv", "dense-rows", "int4", "int4-2limbs", "int4-aten"])
@pytest.mark.parametrize("residence", ["memory", "cache"])
def test_linear(benchmark, device, shape, weights, residence):
    reason = int4.unsupported(device.kind, torch.bfloat16)
    if weights.startswith("int4") and reason:
        pytest.skip(reason)
    if weights == "int4-aten" and device.kind != "cpu":
        pytest.skip("aten's CPU int4 kernel is the cpu's alternative only")
    limbs = 2 if weights == "int4-2limbs" else int4_cpu.DEFAULT_LIMBS
    if limbs != int4_cpu.DEFAULT_LIMBS and (reason := int4.limbs_unsupported(limbs, device.kind, torch.bfloat16)):
        pytest.skip(reason)
    cached = residence == "cache"
    outputs = cached_outputs(shape, weights) if cached else shape[0]
    packed, dense = packed_weight(outputs, shape[1])
    x = torch.randn(1, shape[1], dtype=torch.bfloat16, device=device.torch_device)
    w = dense.to(torch.bfloat16).to(device.torch_device)
    if weights == "dense-rows" and (reason := one_row.rows_unsupported([w])):
        pytest.skip(reason)
    kernel = int4.KERNELS["cpu"] if weights == "int4-aten" else None
    if weights.startswith("int4"):
        make = lambda: int4.Int4Linear(packed, torch.bfloat16, device.torch_device, kernel=kernel, limbs=limbs)  # noqa: E731
    elif weights == "dense-rows":
        make = lambda: packed_linear(w)  # noqa: E731
    else:
        make = None
    layers = [make()] if make else []
    held = sum(t.nbytes for t in layers[0].buffers()) if layers else w.nbytes
    # copies enough to leave the caches behind: each call reads another, as a decode step reads each weight once
    copies = 1 if cached else max(1, min(1024, -(-COLD_BYTES // held)))
    layers += [make() for _ in range(copies - 1)] if make else []
    weights_held = [w] + [w.clone() for _ in range(copies - 1)] if not layers else []
    turn = iter(range(1 << 62))

    def call() -> torch.Tensor:
        k = next(turn) % copies
        if layers:
            y = layers[k](x)
        elif weights == "dense-mv":
            y = torch.mv(weights_held[k], x.view(-1)).view(1, -1)
        else:
            y = F.linear(x, weights_held[k])
        device.sync()
        return y

    benchmark.extra_info.update(device=device.name, kernel=layers[0].kernel if layers else KERNELS[weights], bytes=held,
                                copies=copies, threads=torch.get_num_threads(), outputs=outputs,
                                prefetch=cpu_kernels.prefetch_hint())  # fmt: skip
    y = benchmark(call)
    # what the machine's streaming read gave just after (a shared host's moves within minutes): the GB/s beside it
    benchmark.extra_info["read_gb_s"] = hardware.read_now(device, cpu_kernels.reads(device))["value"]
    if not cached:
        benchmark.extra_info["read_pairs"] = read_pairs(lambda: [call() for _ in range(copies)], held * copies, device)
    reference = F.linear(x.float(), dense.to(device.torch_device))
    assert (y.float() - reference).abs().max() <= 2e-2 * reference.abs().max()
