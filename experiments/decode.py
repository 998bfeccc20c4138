"""Experiment ``decode``: the articles' method for decode speed, first-call cost and memory.

Timer boundaries (each between two ``device.sync()`` calls, wall clock):
* ``load_s``: building the engine (``OpenEngine.load``): reading the checkpoint, dequantizing, placing it
  on the device.
* ``first_call_s``: the first ``generate`` of N tokens, compilation included.
* ``warm_1_s`` / ``warm_n_s``: warm calls that write exactly 1 and N tokens (EOS ignored; another
  count fails the cell).
* ``decode_tok_s`` = (N - 1) / (T_N - T_1) for each repeat's pair, so the prompt read drops out.
* ``decode_phase_tok_s`` = (N - 1) / decode_s from the engine's own phase timers inside each warm
  N-token call (stepping engines; see ``engines.base``), beside the articles' method; engines that
  cannot split a call say so in ``outputs.phase_timers``.
* ``decode_streamed_tok_s``: the same for engines that read tokens back themselves, with every
  token read to the host as it is made (``read_every=1``), beside the run's own ``read_every``.
* ``memory_with_cache``: after the first call, when every cache is allocated; ``cache_bytes_from_shape``
  beside ``cache_bytes_measured`` (with cache minus after load, same counter).
* ``bandwidth_at_pairs_gb_s``: where the roofline's bandwidth is measured (``Cell.read_bandwidth``), the machine's
  streaming read after each pair, outside its timers, one for each ``decode_tok_s`` sample in its order: a shared
  host's read moves 2x within minutes, and a rate beside the read of its own moment is a share of what the machine
  read then (the report's roofline at the pairs). The read's buffer is kept out of the memory peaks.

``experiment.batch=B`` (B > 1, engines that set ``batches``): B sequences decoded together, each exactly N tokens:
the run's prompt and B-1 variants of it (`` Once more.`` added once, twice, ...: prompts of their own lengths).
Each is first decoded alone (N tokens, its reference), then the batch: every sequence must write in the batch the
tokens it wrote alone (checked, else the cell fails). ``warm_1_s`` / ``warm_n_s`` time batched calls of 1 and N tokens
a sequence; ``decode_tok_s`` = B(N-1)/(T_N - T_1), every sequence's tokens a second (what the machine delivers);
``decode_tok_s_per_sequence`` = (N-1)/(T_N - T_1); ``decode_phase_tok_s`` = B(N-1)/decode_s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decodebench import hardware
from decodebench.config import ExperimentConfig, at_least
from decodebench.evidence import MemoryReading, Record, memory_peaks, samples, scalar
from engines import batchers
from engines.base import EngineLimit, Generation
from experiments.cell import Cell, MethodError, timed
from experiments.common import Result, answer


@dataclass
class DecodeExperimentConfig(ExperimentConfig):
    """The articles' method: warm 1-token and N-token calls, decode tok/s = (N-1)/(T_N - T_1); ``batch``: sequences
    decoded together (1: the articles' one request)."""

    batch: int = 1

    def __post_init__(self) -> None:
        at_least("experiment.", self, 1, "batch", why=" (sequences decoded together)")


def headline(record: Record) -> str:
    """The cell's one line: its decode rate, the median of its pairs, or why there is none."""
    synthetic = " (synthetic weights)" if record.model.get("synthetic") else ""
    rate = record.measurements.get("decode_tok_s")
    if rate is None:
        broken = [c["detail"] for c in record.outputs.get("checks", []) if not c["holds"]]
        return f"decode: no valid pair ({'; '.join(broken)}){synthetic}"
    return f"decode {rate.central:.2f} tok/s median of {len(rate.values)}{synthetic}"


@dataclass
class Pairs:
    """``repeats`` warm pairs on one prompt: each pair's T_1 and T_N seconds and its N-token call.

    The decode rate of a pair is (N-1)/(T_N - T_1); a pair whose T_N is not above its T_1 breaks the
    method (noise larger than N-1 steps), so it gives no rate and is named in ``check``.
    """

    n: int
    warm_1: list[float]
    warm_n: list[float]
    calls: list[Generation]

    @property
    def rates(self) -> list[float]:
        return [(self.n - 1) / (tn - t1) for t1, tn in zip(self.warm_1, self.warm_n, strict=True) if tn > t1]

    @property
    def steps(self) -> list[float]:
        """Every pair's (T_N - T_1)/(N-1), seconds a token, in pair order: at or under 0 where it broke the method."""
        return [(tn - t1) / (self.n - 1) for t1, tn in zip(self.warm_1, self.warm_n, strict=True)]

    def of_rated(self, values: list[float]) -> list[float]:
        """``values``, one a pair, kept for the pairs that gave a rate, in the order of ``rates``."""
        return [v for v, t1, tn in zip(values, self.warm_1, self.warm_n, strict=True) if tn > t1]

    def check(self) -> dict[str, Any]:
        """The rule T_N > T_1 over every pair, with the times of any pair that breaks it."""
        broken = [(t1, tn) for t1, tn in zip(self.warm_1, self.warm_n, strict=True) if tn <= t1]
        detail = "; ".join(f"T_1 = {t1:.6f} s, T_N = {tn:.6f} s" for t1, tn in broken)
        return {"rule": f"T_N > T_1 in every pair (N={self.n})", "holds": not broken,
                "detail": detail or f"{len(self.warm_1)} pairs"}  # fmt: skip


@dataclass
class PairReads:
    """Called after each pair: the machine's streaming read then (``Cell.read_bandwidth``, GB/s; nothing where the
    cell has none), with the memory peak so far kept before it and a new peak window started after it, so the read's
    buffer never counts in the cell's peaks."""

    cell: Cell
    gb_s: list[float] = field(default_factory=list)
    windows: list[dict[str, MemoryReading]] = field(default_factory=list)

    def __call__(self) -> None:
        if self.cell.read_bandwidth is None:
            return
        self.windows.append(self.cell.device.peak_memory())
        self.gb_s.append(self.cell.read_bandwidth())
        self.cell.device.reset_peak()

    def peak_memory(self) -> dict[str, MemoryReading]:
        """Each counter's highest peak over the windows before the reads and the one open now."""
        now = self.cell.device.peak_memory()
        return {name: max((w[name] for w in [*self.windows, now]), key=lambda m: m.bytes) for name in now}

    def record(self, pairs: Pairs, result: Result) -> None:
        """``bandwidth_at_pairs_gb_s``: the reads after the pairs that gave a rate, one for each in its order; none
        where no pair gave one (as ``decode_tok_s``)."""
        reads = pairs.of_rated(self.gb_s) if self.gb_s else []
        if reads:
            method = (f"hardware.read_now (best of {hardware.CELL_READS} streaming reads) after each pair giving a "
                      "rate, outside its timers")
            result.measurements["bandwidth_at_pairs_gb_s"] = samples(reads, "GB/s", method=method)
            result.samples["bandwidth_at_pairs_gb_s"] = reads


def warm_pairs(
    cell: Cell, ids: list[int], expected: list[int], n: int | None = None, after: Callable[[], None] | None = None
) -> Pairs:
    """``repeats`` timed pairs of a warm 1-token and a warm N-token call (N: ``n`` or the run's
    ``max_new_tokens``); every N-token call must write ``expected``, the first call's tokens. ``after`` runs
    after each pair, outside its timers (work that must see the machine as each pair did)."""
    n = n or cell.cfg.max_new_tokens
    pairs = Pairs(n, [], [], [])
    for _ in range(cell.cfg.repeats):
        t1, gen, tn = cell.timed_pair(ids, n)
        if gen.tokens != expected:
            raise MethodError("a warm greedy call wrote different tokens from the first call")
        pairs.warm_1.append(t1)
        pairs.warm_n.append(tn)
        pairs.calls.append(gen)
        if after is not None:
            after()
    return pairs


def phase_rates(cell: Cell, calls: list[Generation], result: Result) -> None:
    """``decode_phase_tok_s`` and ``read_phase_s`` from the engine's own timers, or why there are none."""
    engine, n = cell.engine, cell.cfg.max_new_tokens
    if not engine.splits_phases:
        result.outputs["phase_timers"] = (
            f"engine {engine.name} cannot split one call into prompt read and decode "
            "(Transformers' generate does both inside one call); only (N-1)/(T_N-T_1) is measured"
        )
        return
    rates = [(n - 1) / gen.decode_s for gen in calls]
    reads = [gen.read_s for gen in calls]
    result.measurements["decode_phase_tok_s"] = samples(rates, "tok/s", formula="(N-1)/decode_s, engine timers")
    result.measurements["read_phase_s"] = samples(reads, "s", method="engine timer: prompt read to first token")
    result.samples.update(decode_phase_tok_s=rates, read_phase_s=reads)
    result.outputs["phase_timers"] = "engine timers inside each warm N-token call, device-synced at each boundary"


def batch_prompts(prompt: str, batch: int) -> list[str]:
    """The run's prompt and ``batch - 1`` variants of it, each longer than the one before (`` Once more.`` added
    once more each time): sequences of their own lengths, so their positions differ in every step."""
    return [prompt + " Once more." * b for b in range(batch)]


def run_batch(cell: Cell, result: Result) -> Result:
    """``experiment.batch`` sequences decoded together (the module docstring's method)."""
    cfg, device, n, batch = cell.cfg, cell.device, cell.cfg.max_new_tokens, cell.cfg.experiment.batch
    result.timers.update(
        {
            "load_s": "the engine's construction (OpenEngine.load), device.sync() before and after",
            "first_call_s": f"first generate_batch of {batch} sequences x N, compile included, device.sync() around",
            "warm_1_s": f"warm generate_batch of {batch} sequences x 1 token, device.sync() before and after",
            "warm_n_s": f"warm generate_batch of {batch} sequences x N tokens, EOS ignored, device.sync() around",
            "decode_tok_s": "B * (N-1) / (warm_n_s - warm_1_s), per repeat pair: every sequence's tokens a second",
            "decode_tok_s_per_sequence": "(N-1) / (warm_n_s - warm_1_s), per repeat pair",
            "decode_phase_tok_s": "B * (N-1) / decode_s, the engine's own timer inside each warm generate_batch",
        }
    )
    prompts = [cell.opened.encode(text) for text in batch_prompts(cfg.prompt, batch)]
    cell.require_fit(max(len(ids) for ids in prompts))
    device.reset_peak()
    cell.load()
    engine = cell.engine
    after_load = device.memory_now()
    alone = [cell.call(ids, n).tokens for ids in prompts]  # each sequence's own tokens (and the one-row programs)
    first, first_s = timed(device, lambda: cell.call_batch(prompts, n))
    with_cache = device.memory_now()
    differ = [i for i, (gen, own) in enumerate(zip(first, alone, strict=True)) if gen.tokens != own]
    if differ:
        at = [next(k for k, (a, b) in enumerate(zip(first[i].tokens, alone[i], strict=True)) if a != b)
              for i in differ]  # fmt: skip
        raise MethodError(f"in a batch of {batch}, sequences {differ} wrote other tokens than alone (first "
                          f"difference at tokens {at}): a batched rate of other tokens is no rate of this "
                          "way")  # fmt: skip
    warm_1, warm_n, calls, reads = [], [], [], PairReads(cell)
    for _ in range(cfg.repeats):
        _, t1 = timed(device, lambda: cell.call_batch(prompts, 1))
        gens, tn = timed(device, lambda: cell.call_batch(prompts, n))
        if [g.tokens for g in gens] != alone:
            raise MethodError("a warm batched call wrote different tokens from the sequences alone")
        warm_1.append(t1)
        warm_n.append(tn)
        calls.append(gens[0])
        reads()
    pairs = Pairs(n, warm_1, warm_n, calls)
    reads.record(pairs, result)
    rates = [batch * r for r in pairs.rates]
    if rates:
        result.measurements["decode_tok_s"] = samples(rates, "tok/s", formula="B(N-1)/(T_N-T_1)", batch=batch)
        result.measurements["decode_tok_s_per_sequence"] = samples(pairs.rates, "tok/s", formula="(N-1)/(T_N-T_1)")
        result.samples.update(decode_tok_s=rates, decode_tok_s_per_sequence=pairs.rates)
    phase = [batch * (n - 1) / gen.decode_s for gen in calls]
    result.measurements["decode_phase_tok_s"] = samples(phase, "tok/s", formula="B(N-1)/decode_s, engine timers")
    result.samples["decode_phase_tok_s"] = phase
    cache = engine.cache_bytes()
    result.measurements.update(
        load_s=scalar(cell.load_s, "s"),
        first_call_s=scalar(first_s, "s"),
        warm_1_s=samples(warm_1, "s"),
        warm_n_s=samples(warm_n, "s"),
        batch=scalar(batch, "sequences"),
        prompt_tokens=scalar(len(prompts[0]), "tok"),
        max_new_tokens=scalar(n, "tok"),
        memory_after_load=after_load,
        memory_with_cache=with_cache,
        **memory_peaks(reads.peak_memory()),
    )
    if cache is not None:
        held = "sum of K/V buffer nbytes: a cache row a sequence, and the one-sequence cache prompts are read into"
        result.measurements["cache_bytes_from_shape"] = scalar(cache * (batch + 1), "B", method=held)
    result.samples.update(warm_1_s=warm_1, warm_n_s=warm_n)
    calls_made = batch + 1 + 2 * cfg.repeats
    result.outputs["checks"] = result.outputs.get("checks", []) + [
        {"rule": "exactly N tokens in every call", "holds": True,
         "detail": f"{calls_made} calls, every sequence held to its count (another count fails the cell)"},
        {"rule": "each sequence of the batch writes the tokens it writes alone", "holds": True,
         "detail": f"{batch} sequences of {[len(p) for p in prompts]} prompt tokens, every batched call"},
        pairs.check(),
    ]  # fmt: skip
    result.outputs.update(prompt_ids=prompts[0], batch_prompt_tokens=[len(p) for p in prompts],
                          **answer(first[0].tokens, engine.eos_ids, engine.tokenizer))  # fmt: skip
    return result


def run(cell: Cell, result: Result | None = None) -> Result:
    cfg, device = cell.cfg, cell.device
    if getattr(cfg.experiment, "batch", 1) > 1:
        if not cell.opened.cls.batches:
            raise EngineLimit(f"engine {cell.opened.name} decodes one sequence at a time: experiment.batch="
                              f"{cfg.experiment.batch} needs an engine that batches "
                              f"({', '.join(batchers())})")  # fmt: skip
        return run_batch(cell, result or Result())
    n = cfg.max_new_tokens
    result = result or Result()
    result.timers.update(
        {
            "load_s": "the engine's construction (OpenEngine.load), device.sync() before and after",
            "first_call_s": "first generate(N), compile included, device.sync() before and after",
            "warm_1_s": "warm generate(1), device.sync() before and after",
            "warm_n_s": "warm generate(N), EOS ignored, device.sync() before and after",
            "decode_tok_s": "(N-1) / (warm_n_s - warm_1_s), per repeat pair",
            "decode_phase_tok_s": "(N-1) / decode_s, the engine's own timer inside each warm generate(N)",
        }
    )
    ids = cell.opened.encode(cfg.prompt)
    cell.require_fit(len(ids))
    device.reset_peak()
    cell.load()
    engine = cell.engine
    after_load = device.memory_now()

    first, first_s = cell.timed_call(ids, n)
    with_cache = device.memory_now()
    reads = PairReads(cell)
    pairs = warm_pairs(cell, ids, first.tokens, after=reads)
    reads.record(pairs, result)
    phase_rates(cell, pairs.calls, result)
    checks = [pairs.check()]
    rated = {"decode_tok_s": (pairs, "(N-1)/(T_N-T_1)")}
    if engine.streams and cfg.read_every != 1:  # the streaming tip: the same calls, each token read at once
        with engine.reading_every(1):
            streamed = warm_pairs(cell, ids, first.tokens)
        checks.append({**streamed.check(), "rule": f"{streamed.check()['rule']}, read_every=1"})
        rated["decode_streamed_tok_s"] = (streamed, "(N-1)/(T_N-T_1), read_every=1")
    for name, (each, formula) in rated.items():
        if each.rates:  # a pair that broke the method gives no rate; a cell with none has no rate at all
            result.measurements[name] = samples(each.rates, "tok/s", formula=formula)
            result.samples[name] = each.rates
    peaks = reads.peak_memory()
    weights = engine.weight_bytes()
    if weights is not None:
        result.measurements["weight_bytes_from_shape"] = scalar(
            weights, "B", method="unique storages of parameters and buffers"
        )
    cache = engine.cache_bytes()
    if cache is not None:
        result.measurements["cache_bytes_from_shape"] = scalar(cache, "B", method="sum of K/V buffer nbytes")
        result.measurements["cache_bytes_measured"] = scalar(
            with_cache.bytes - after_load.bytes, "B", counter=f"{with_cache.counter}, after first call minus after load"
        )

    result.measurements.update(
        load_s=scalar(cell.load_s, "s"),
        first_call_s=scalar(first_s, "s"),
        warm_1_s=samples(pairs.warm_1, "s"),
        warm_n_s=samples(pairs.warm_n, "s"),
        prompt_tokens=scalar(len(ids), "tok"),
        max_new_tokens=scalar(n, "tok"),
        memory_after_load=after_load,
        memory_with_cache=with_cache,
        **memory_peaks(peaks),
    )
    result.samples.update(warm_1_s=pairs.warm_1, warm_n_s=pairs.warm_n)
    calls = 1 + len(pairs.calls) * 2 * len(rated)
    checks.insert(0, {"rule": "exactly N tokens in every call", "holds": True,
                      "detail": f"{calls} calls, each held to its count (another count fails the cell)"})  # fmt: skip
    result.outputs["checks"] = result.outputs.get("checks", []) + checks
    result.outputs.update(prompt_ids=ids, **answer(first.tokens, engine.eos_ids, engine.tokenizer))
    return result
