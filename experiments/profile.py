"""Experiment ``profile``: where each millisecond of a decode step goes, for an engine that steps.

The method is the decode experiment's, applied to a profile: ``repeats`` pairs of a warm 1-token call and
a warm N-token call run under the framework's profiler, and every class's time is the N-token call's less
the 1-token call's, over N-1: per token, the prompt read dropped out; each class's figure is the median over
the pairs. Each profiled pair follows an unprofiled one, whose median gives the step the classes must add up
to. One more pair under the profiler comes first: its N-token call keeps the raw trace and, under
``torch.profiler``, the pair records the operators' input shapes, which tell the weight products of the decode
steps apart (``TorchProfile``); the measured pairs run without them. Under ``torch.profiler`` (the Rust engine's
ATen calls reach it through the dispatcher) a class's time is its operators' self time; under ``jax.profiler``
it is the wall time of XLA's operations, split where they run at once (``experiments/profile_jax.py``).
Operators fall into classes a reader can act on:

* ``weights: attention projections``, ``weights: MLP``, ``weights: per-layer inputs``: matrix products
  with a weight, matched to the model's linears by shape (where two kinds share a shape, split in
  proportion to how many linears of each the model has; in JAX, by the linear's named scope);
* ``attention``: the attention products and softmax; ``table lookups``: embedding and index reads;
* ``logits and argmax``: the ``lm_head`` product, the soft cap and the argmax;
* ``norms and elementwise``: every other operator (with a step compiled by TorchInductor on a CPU, its fused kernels:
  the cell compiles with ``cpp.enable_kernel_profile``, so each kernel is an operator of its own, not part of the
  self time of the code that calls it);
* ``host: dispatch and wrappers``: TorchDynamo's cache lookup, compiled-region wrappers (TorchInductor's code between
  its kernels, ``## Call CompiledFxGraph``), tensor metadata (in JAX: a program's dispatch on the calling thread while
  no operation runs);
* ``host: between operators``: the unprofiled step time (warm pairs in this cell, as ``decode`` measures
  it) less everything above: Python, dispatch and read-backs outside any operator, and, when negative,
  the profiler's own overhead inside them (stated as is).

The classes sum to the unprofiled step time by construction. Two checks hold the attribution to account
(else the cell is INVALID for that rule): the profiled operators come to no more than 5% above the step of the
very calls they were profiled in (their own wall times, T_N - T_1 over N-1: the same prompt read on both sides,
so its noise drops out), and no more than 5% above the unprofiled step beyond the pairs' noise (the 95% interval
of operators / unprofiled step, each profiled pair taken with the unprofiled pair it follows, lies wholly above
1.05 only when the excess is measured; with a prompt read of many seconds against a step of a few hundred
milliseconds, one pair's step moves by tens of percent, so the unprofiled step alone cannot settle 5%).
Each class gets its time per token, its share, the bytes it must read per token (weights from their buffers,
the KV cache from its shape, one row of each table) and the GB/s that makes, beside the machine's bandwidth. The raw
trace goes beside the evidence, gzip-compressed.
"""

from __future__ import annotations

import gzip
import json
import shutil
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from decodebench.config import ExperimentConfig
from decodebench.evidence import Record, samples, scalar
from decodebench.stats import Interval, ratio_interval
from engines.base import EngineLimit
from engines.steps import SteppedEngine
from experiments.cell import Cell
from experiments.common import Result
from experiments.decode import warm_pairs
from experiments.profile_classes import BETWEEN, CLASSES, DISPATCH, WEIGHT_KINDS
from experiments.profile_jax import JaxProfile

MATMULS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::mv", "aten::addmv_",
           "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int4pack_mm", "decodebench_int4::int4_rows",
           "decodebench_bf16::bf16_rows")  # fmt: skip
ATTENTION = ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax", "aten::_safe_softmax", "attention",
             "decodebench_attn::one_query")  # fmt: skip
LOOKUPS = ("aten::embedding", "aten::index_select", "aten::index", "aten::gather")
LOGITS = ("aten::argmax", "aten::tanh")
HOST = ("TorchDynamo", "Torch-Compiled Region", "## Call CompiledFxGraph", "Pregraph", "AOTDispatcher", "aten::empty",
        "aten::empty_strided", "aten::view", "aten::as_strided", "aten::transpose", "aten::reshape",
        "aten::_unsafe_view", "aten::expand", "aten::t", "aten::select", "aten::slice", "aten::unsqueeze",
        "aten::squeeze", "aten::permute", "aten::detach", "aten::lift_fresh", "aten::alias", "aten::resize_",
        "decodebench::one_row_mv")  # fmt: skip  # the custom operator's own dispatch; its aten::mv is a product
Shapes = dict[tuple[int, int], dict[str, int]]  # (in, out) features -> how many linears of each weight class
OPERATOR_SLACK = 0.05  # the profiled operators may exceed the unprofiled step by this share (timer noise)


@dataclass
class ProfileExperimentConfig(ExperimentConfig):
    """Warm decode steps under the framework's profiler, attributed to classes (module docstring).
    ``trace``: keep the raw profile beside the evidence (gzip)."""

    trace: bool = True


def headline(record: Record) -> str:
    """The cell's one line: the step time and its three largest classes."""
    classes = sorted(record.outputs["classes"], key=lambda c: -c["ms_per_token"])[:3]
    top = ", ".join(f"{c['class']} {c['share']:.0%}" for c in classes)
    return f"profile: {record.value('step_ms'):.2f} ms a token; {top}"


def linear_shapes(model: torch.nn.Module) -> Shapes:
    """(in, out) features of every linear weight -> how many linears of each weight class have that shape."""
    shapes: Shapes = defaultdict(lambda: defaultdict(int))
    for name, module in model.named_modules(remove_duplicate=False):  # lm_head by its name, also when tied
        kind = next((k for k, ends in WEIGHT_KINDS.items() if name.rpartition(".")[2] in ends), None)
        out_in = getattr(module, "out_features", None), getattr(module, "in_features", None)
        if kind and None not in out_in:
            shapes[(out_in[1], out_in[0])][kind] += 1
    return shapes


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes each weight class reads per token: every buffer and parameter of its linears, as held."""
    held: dict[str, int] = defaultdict(int)
    for name, module in model.named_modules(remove_duplicate=False):  # lm_head by its name, also when tied
        kind = next((k for k, ends in WEIGHT_KINDS.items() if name.rpartition(".")[2] in ends), None)
        if kind:
            held[kind] += sum(t.nbytes for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))
    return dict(held)


def matmul_shape(op: str, shapes: list[list[int]]) -> tuple[int, int] | None:
    """(in, out) of a matrix product with a weight, from its recorded input shapes, or None."""
    if op == "decodebench_int4::int4_rows":  # x [rows, in], words [tiles of 16 outputs, in / 8, 32]
        x, words = (shapes + [[], []])[:2]
        return (x[-1], words[0] * 16) if len(x) >= 2 and len(words) == 3 else None
    if op == "decodebench_bf16::bf16_rows":  # x [rows, in], packed [tiles of 16 outputs, in / 2, 16, 2]
        x, packed = (shapes + [[], []])[:2]
        return (x[-1], packed[0] * 16) if len(x) >= 2 and len(packed) == 4 else None
    if op.endswith("_weight_int4pack_mm_for_cpu") or op.endswith("_weight_int4pack_mm"):
        x, scales = shapes[0], shapes[-1]  # scales and zeros: [in / group, out, 2]
        return (x[-1], scales[1]) if len(x) >= 2 and len(scales) == 3 else None
    if op in ("aten::addmm", "aten::addmv_"):
        shapes = shapes[1:]
    if op in ("aten::mv", "aten::addmv_"):  # the weight as held, [out, in], times one row [in] (engine.one_row=mv)
        w, x = (shapes + [[], []])[:2]
        return (w[1], w[0]) if len(w) == 2 and x == [w[1]] else None
    if len(shapes) < 2 or len(shapes[0]) < 2 or len(shapes[1]) != 2:
        return None
    x, w = shapes[0], shapes[1]
    if op == "aten::linear":  # the weight as held, [out, in]; the input of any rank
        return (w[1], w[0]) if x[-1] == w[1] else None
    # mm, addmm, matmul: the weight transposed, [in, out]; mm and addmm take one-row-per-token 2-D inputs only
    return (w[0], w[1]) if x[-1] == w[0] and (op == "aten::matmul" or len(x) == 2) else None


def classify(name: str, input_shapes: list[list[int]], shapes: Shapes) -> dict[str, float]:
    """The classes an operator's self time goes to, as shares summing to 1 (a weight product is matched to the
    model's linears by its input shapes; where two kinds share a shape, in proportion to their counts)."""
    kinds = shapes.get(matmul_shape(name, input_shapes)) if name in MATMULS else None
    if kinds:
        total = sum(kinds.values())
        return {kind: count / total for kind, count in kinds.items()}
    if name in MATMULS or name.startswith(ATTENTION) or "scaled_dot_product" in name:
        return {"attention": 1.0}
    if name in LOOKUPS:
        return {"table lookups": 1.0}
    if name in LOGITS:
        return {"logits and argmax": 1.0}
    return {DISPATCH: 1.0} if name.startswith(HOST) else {"norms and elementwise": 1.0}


def attribute(events: Any, share: Callable[[Any], dict[str, float]]) -> dict[str, float]:
    """Self seconds of a profile's operators (``key_averages()``) by class, each event's split by ``share``."""
    out: dict[str, float] = defaultdict(float)
    for event in events:
        for c, fraction in share(event).items():
            out[c] += event.self_cpu_time_total / 1e6 * fraction
    return out


class TorchProfile:
    """One torch engine's calls under ``torch.profiler``, operators attributed by class (module docstring).

    Input shapes, which tell one weight product from another, are recorded in ``prepare``'s pair only: recording
    them costs about a microsecond per operator, inside its caller's self time (``F.linear`` of one bf16 row,
    11 operators: 7.1 us a call unprofiled, 10.4 us of self time profiled, 22.3 us with shapes), which the
    measured calls would charge to the classes, most to an engine of many small ATen calls (``rust``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model = engine.model  # the Rust engine keeps the torch model its weights came from
        self.shapes = linear_shapes(self.model)
        self.splits: dict[str, dict[str, float]] = {}  # matrix product -> its self time's shares by class

    def prepare(self, one: Callable[[], Any], many: Callable[[], Any], trace: Path | None) -> None:
        """A 1-token call ``one`` and an N-token call ``many`` once each under the profiler with input shapes:
        each matrix product's self time in the decode steps alone split by class (``splits``), the N-token
        call's raw trace (gzip) to ``trace``. A product of one shape counts for the calls the N-token call makes
        beyond the 1-token call's, at its mean self time a call: the prompt's products (read by both calls, in
        pieces of many rows) drop out."""
        before = self.shaped(one, None)
        by_product: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for (name, input_shapes), (count, self_us) in self.shaped(many, trace).items():
            extra = count - before.get((name, input_shapes), (0, 0.0))[0]
            for c, fraction in classify(name, json.loads(input_shapes), self.shapes).items():
                by_product[name][c] += max(extra, 0) * self_us / count * fraction
        self.splits = {op: {c: t / sum(times.values()) for c, t in times.items()}
                       for op, times in by_product.items() if sum(times.values()) > 0}  # fmt: skip

    @staticmethod
    def compiling() -> AbstractContextManager[Any]:
        """Where the cell compiles and runs: TorchInductor's CPU kernels each recorded as an operator
        (``cpp.enable_kernel_profile``: a ``RECORD_FUNCTION`` in each, a check of a flag while no profiler runs).
        Without it a fused kernel's time is the self time of the compiled step's wrapper that calls it, so the
        wrapper's own Python would be counted as norms and elementwise (on the int4 ring on E2B: 7 ms a token)."""
        import torch._inductor.config  # TorchInductor's import is heavy: only where a torch engine is profiled

        return torch._inductor.config.patch({"cpp.enable_kernel_profile": True})

    @staticmethod
    def shaped(call: Callable[[], Any], trace: Path | None) -> dict[tuple[str, str], tuple[int, float]]:
        """``call`` once under the profiler with input shapes: (product, its input shapes as JSON) -> (calls,
        self microseconds) for every matrix product; the raw trace (gzip) to ``trace``."""
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            call()
        if trace is not None:
            with tempfile.TemporaryDirectory() as tmp:
                raw = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(raw))
                with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        return {(e.key, json.dumps(e.input_shapes)): (e.count, e.self_cpu_time_total)
                for e in prof.key_averages(group_by_input_shape=True) if e.key in MATMULS}  # fmt: skip

    def run(self, call: Callable[[], Any]) -> dict[str, float]:
        """``call`` once under the profiler, shapes not recorded: self seconds by class, each matrix product's
        split as ``prepare`` found it."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        return attribute(prof.key_averages(), lambda e: self.splits.get(e.key) or classify(e.key, [], self.shapes))

    def read_bytes(self) -> dict[str, int]:
        """Bytes the model's own arrays make each class read per token (the KV cache is the engine's: ``run``
        adds it): the weights of its linears as held, one row of each vocabulary table."""
        reads = weight_bytes(self.model)
        tables = [m for n, m in self.model.named_modules() if n.endswith(("embed_tokens", "embed_tokens_per_layer"))]
        reads["table lookups"] = sum(sum(t[0].nbytes for t in (*m.parameters(), *m.buffers()) if t.dim() == 2)
                                     for m in tables)  # fmt: skip
        return reads


PROFILES = {"torch": TorchProfile, "jax": JaxProfile}


def account(
    operators: list[float], profiled: list[float], unprofiled: list[float]
) -> tuple[Interval, Interval, list[dict[str, Any]]]:
    """The two checks that hold a profile to account (module docstring), from each pair's profiled operators,
    its profiled calls' own step and the step of the unprofiled pair before it (seconds a token, in pair
    order): the two ratios' intervals and the checks. An unprofiled pair that broke the method (T_N <= T_1,
    a step <= 0) is left out with its profiled pair."""
    own = ratio_interval(operators, profiled, paired=True)  # the same calls on both sides
    kept = [i for i, s in enumerate(unprofiled) if s > 0]
    beside = ratio_interval([operators[i] for i in kept], [unprofiled[i] for i in kept], paired=True)
    limit, profiled_step = 1 + OPERATOR_SLACK, statistics.median(profiled)
    ops, step = statistics.median(operators), statistics.median(unprofiled[i] for i in kept) if kept else 0.0
    return own, beside, [
        {"rule": f"profiled operators within {OPERATOR_SLACK:.0%} of the profiled calls' own step",
         "holds": profiled_step > 0 and own.value <= limit, "detail": f"operators / profiled step "
         f"{interval_text(own)} (the pairs' operator sums {ops * 1e3:.3f} ms, profiled step "
         f"{profiled_step * 1e3:.3f} ms a token, medians)"},
        {"rule": f"profiled operators within {OPERATOR_SLACK:.0%} of the unprofiled step, beyond the pairs' noise",
         "holds": (beside.low if beside.known else beside.value) <= limit, "detail": f"operators / unprofiled step "
         f"{interval_text(beside)} (the unprofiled pairs' step {step * 1e3:.3f} ms a token, median; fails when "
         f"the whole 95% interval, or without one the ratio, lies above {limit:.2f})"},
    ]  # fmt: skip


def interval_text(ratio: Interval) -> str:
    """A ratio and its 95% interval as the checks print it."""
    span = f" (95% {ratio.low:.3f}-{ratio.high:.3f})" if ratio.known else " (no interval: fewer than 2 pairs)"
    return f"{ratio.value:.3f}{span}"


def run(cell: Cell) -> Result:
    if not issubclass(cell.opened.cls, SteppedEngine) and cell.opened.name != "rust":
        raise EngineLimit(f"experiment=profile needs an engine that steps; engine {cell.opened.name} does not")
    kind = PROFILES[cell.opened.cls.framework]
    with kind.compiling():
        return profiled(cell, kind)


def profiled(cell: Cell, kind: type[TorchProfile] | type[JaxProfile]) -> Result:
    """The profile of the cell's engine (module docstring) by its framework's profile ``kind``, inside
    ``kind.compiling()``."""
    cfg = cell.cfg
    n = cfg.max_new_tokens
    ids = cell.opened.encode(cfg.prompt)
    cell.require_fit(len(ids))
    cell.load()
    first = cell.call(ids, n)  # compile and warm up
    estimates: dict[str, list[float]] = defaultdict(list)
    profiler = kind(cell.engine)
    trace, trace_name = cell.beside(".trace.json.gz") if cfg.experiment.trace else (None, None)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.prepare(lambda: cell.call(ids, 1), lambda: cell.call(ids, n), trace)  # the products' shapes, the trace

    walls: dict[int, float] = {}  # a profiled call's own seconds (device-synced), timed inside the profile
    operator_sums: list[float] = []  # per pair: every class's seconds a token
    profiled_steps: list[float] = []  # per pair: the profiled calls' own (T_N - T_1) / (N-1), seconds

    def timed(k: int) -> Callable[[], None]:
        return lambda: walls.__setitem__(k, cell.timed_call(ids, k)[1])

    def profiled_pair() -> None:  # per token, the N-token call's class times less the 1-token call's, over N-1
        one, many = profiler.run(timed(1)), profiler.run(timed(n))
        per_class = {c: (many.get(c, 0.0) - one.get(c, 0.0)) / (n - 1) for c in CLASSES[:-1]}
        for c, s in per_class.items():
            estimates[c].append(s)
        operator_sums.append(sum(per_class.values()))
        profiled_steps.append((walls[n] - walls[1]) / (n - 1))

    # each unprofiled pair is followed by a profiled one, so the two see the machine alike (a slow spell of a
    # shared machine falls on both, not on the profiled pairs alone); per token, the medians of the pairs
    pairs = warm_pairs(cell, ids, first.tokens, after=profiled_pair)
    if not pairs.rates:
        raise EngineLimit(f"no warm pair kept T_N > T_1 ({pairs.check()['detail']}): no step time to attribute")
    step_s = 1 / statistics.median(pairs.rates)
    per_token = {c: statistics.median(values) for c, values in estimates.items()}
    operators = sum(per_token.values())
    per_token[BETWEEN] = step_s - operators
    reads = profiler.read_bytes()
    if cache := cell.engine.cache_bytes():  # every slot of the KV cache, as a step over the whole cache reads
        reads["attention"] = cache
    classes = [
        {"class": c, "ms_per_token": s * 1e3, "share": s / step_s, "bytes_per_token": reads.get(c),
         "gb_s": reads[c] / s / 1e9 if reads.get(c) and s > 0 else None}
        for c, s in per_token.items()
    ]  # fmt: skip
    own, beside, checks = account(operator_sums, profiled_steps, pairs.steps)
    result = Result(timers={
        "step_ms": "1 / median (N-1)/(T_N-T_1) of warm pairs, unprofiled, this cell",
        "classes": "each class's profiled time (torch: operator self time, each TorchInductor CPU kernel an operator "
                   "of its own by cpp.enable_kernel_profile; jax: wall time split among the operations running at "
                   "once), N-token call less 1-token call, over N-1",
    })  # fmt: skip
    result.measurements.update(
        step_ms=scalar(step_s * 1e3, "ms", method="unprofiled warm pairs in this cell", pairs=len(pairs.rates)),
        profiled_operators_ms=scalar(operators * 1e3, "ms", method="sum of operator self times per token"),
        profiled_step_ms=samples([s * 1e3 for s in profiled_steps], "ms",
                                 formula="(T_N - T_1)/(N-1) of the profiled calls, each timed inside its profile"),
        operators_over_profiled_step=scalar(own.value, "x", low=own.low, high=own.high,
                                            method="median per-pair operators / median profiled step, paired"),
        operators_over_step=scalar(beside.value, "x", low=beside.low, high=beside.high,
                                   method="median per-pair operators / median unprofiled step, paired"),
        **{f"profile_{c.replace(': ', '_').replace(' ', '_').replace('-', '_')}_ms": scalar(s * 1e3, "ms")
           for c, s in per_token.items()},  # fmt: skip
    )
    result.outputs.update(
        classes=classes,
        trace=trace_name,
        checks=[pairs.check(), *checks],
    )
    return result
