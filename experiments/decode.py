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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decodebench.config import ExperimentConfig
from decodebench.evidence import Record, memory_peaks, samples, scalar
from engines.base import Generation
from experiments.cell import Cell, MethodError
from experiments.common import Result, answer


@dataclass
class DecodeExperimentConfig(ExperimentConfig):
    """The articles' method: warm 1-token and N-token calls, decode tok/s = (N-1)/(T_N - T_1)."""


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

    def check(self) -> dict[str, Any]:
        """The rule T_N > T_1 over every pair, with the times of any pair that breaks it."""
        broken = [(t1, tn) for t1, tn in zip(self.warm_1, self.warm_n, strict=True) if tn <= t1]
        detail = "; ".join(f"T_1 = {t1:.6f} s, T_N = {tn:.6f} s" for t1, tn in broken)
        return {"rule": f"T_N > T_1 in every pair (N={self.n})", "holds": not broken,
                "detail": detail or f"{len(self.warm_1)} pairs"}  # fmt: skip


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


def run(cell: Cell, result: Result | None = None) -> Result:
    cfg, device = cell.cfg, cell.device
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
    pairs = warm_pairs(cell, ids, first.tokens)
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
    peaks = device.peak_memory()
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
