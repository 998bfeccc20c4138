"""Experiment ``decode``: the articles' method for decode speed, first-call cost and memory.

Timer boundaries (each between two ``device.sync()`` calls, wall clock):
* ``load_s``: ``engine.load()`` — reading the checkpoint, dequantizing, placing it on the device.
* ``first_call_s``: the first ``generate`` of N tokens, compilation included.
* ``warm_1_s`` / ``warm_n_s``: warm calls that write exactly 1 and N tokens (EOS ignored).
* ``decode_tok_s`` = (N - 1) / (T_N - T_1) for each repeat's pair, so the prompt read drops out.
* ``decode_streamed_tok_s``: the same for engines that read tokens back themselves, with every
  token read to the host as it is made (``read_every=1``), beside the run's own ``read_every``.
* ``memory_with_cache``: after the first call, when every cache is allocated; ``cache_bytes_from_shape``
  beside ``cache_bytes_measured`` (with cache minus after load, same counter).
"""

from __future__ import annotations

from decodebench.config import check_fits
from decodebench.evidence import samples, scalar
from engines.base import Generation
from experiments.common import Cell, Result, answer, prompt_ids, timed


def timed_pair(cell: Cell, ids: list[int]) -> tuple[float, Generation, float]:
    """A warm 1-token call and a warm N-token call on ``ids``: (T_1, the N-token generation, T_N)."""
    device, engine, n = cell.device, cell.engine, cell.cfg.max_new_tokens
    _, t1 = timed(device, lambda: engine.generate(ids, 1))
    gen, tn = timed(device, lambda: engine.generate(ids, n))
    return t1, gen, tn


def warm_pairs(cell: Cell, ids: list[int], expected: list[int]) -> tuple[list[float], list[float], list[float]]:
    """``repeats`` timed pairs; the decode rate (N-1)/(T_N - T_1) of each pair."""
    n = cell.cfg.max_new_tokens
    warm_1, warm_n, rates = [], [], []
    for _ in range(cell.cfg.repeats):
        t1, gen, tn = timed_pair(cell, ids)
        if gen.tokens != expected:
            raise RuntimeError("a warm greedy call wrote different tokens from the first call")
        warm_1.append(t1)
        warm_n.append(tn)
        rates.append((n - 1) / (tn - t1))
    return warm_1, warm_n, rates


def run(cell: Cell, result: Result | None = None) -> Result:
    cfg, device, engine = cell.cfg, cell.device, cell.engine
    n = cfg.max_new_tokens
    result = result or Result()
    result.timers.update(
        {
            "load_s": "engine.load(), device.sync() before and after",
            "first_call_s": "first generate(N), compile included, device.sync() before and after",
            "warm_1_s": "warm generate(1), device.sync() before and after",
            "warm_n_s": "warm generate(N), EOS ignored, device.sync() before and after",
            "decode_tok_s": "(N-1) / (warm_n_s - warm_1_s), per repeat pair",
        }
    )
    engine.prepare()
    ids = prompt_ids(engine.tokenizer, cfg.prompt, cfg.chat_template)
    check_fits(cfg.context, len(ids), n)
    engine.check_fits(len(ids), n)
    device.reset_peak()
    _, load_s = timed(device, engine.load)
    engine.loaded = True
    after_load = device.memory_now()

    first, first_s = timed(device, lambda: engine.generate(ids, n))
    with_cache = device.memory_now()
    warm_1, warm_n, rates = warm_pairs(cell, ids, first.tokens)
    if engine.streams and cfg.read_every != 1:  # the streaming tip: the same calls, each token read at once
        with engine.reading_every(1):
            _, _, streamed = warm_pairs(cell, ids, first.tokens)
        result.measurements["decode_streamed_tok_s"] = samples(
            streamed, "tok/s", formula="(N-1)/(T_N-T_1), read_every=1"
        )
        result.samples["decode_streamed_tok_s"] = streamed
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
        load_s=scalar(load_s, "s"),
        first_call_s=scalar(first_s, "s"),
        warm_1_s=samples(warm_1, "s"),
        warm_n_s=samples(warm_n, "s"),
        decode_tok_s=samples(rates, "tok/s", formula="(N-1)/(T_N-T_1)"),
        prompt_tokens=scalar(len(ids), "tok"),
        new_tokens=scalar(n, "tok"),
        memory_after_load=after_load.as_dict(),
        memory_with_cache=with_cache.as_dict(),
        **{f"memory_peak_{name}": reading.as_dict() for name, reading in peaks.items()},
    )
    result.samples.update(warm_1_s=warm_1, warm_n_s=warm_n, decode_tok_s=rates)
    result.outputs.update(prompt_ids=ids, **answer(first.tokens, engine.eos_ids, engine.tokenizer))
    return result
