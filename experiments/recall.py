"""Experiment ``recall``: numbered records fill the context; the model is asked for one code back.

For each prompt of ``experiments.recall_prompts`` that fits (article 003, Step 11 shape), each of
``experiment.repeats`` times:
* stepping engines (``splits_phases``): one warm ``generate(prompt, N)``; ``read_s`` is the engine's
  own prompt-read phase (up to the first new token) and ``decode_tok_s`` = (N-1) / decode_s from its
  decode phase, so the prompt is read once per repeat and its noise stays out of the decode rate.
* other engines: a warm ``generate(prompt, 1)`` (``read_s``: the prompt read plus one token) and a
  warm ``generate(prompt, N)``; ``decode_tok_s`` = (N-1) / (T_N - T_1), as in ``decode``.
``read_tok_s`` = prompt tokens / read_s; the answer text up to EOS, the six-digit code parsed from it,
found yes/no, the asked record and the true code. Each outcome names its ``method``. Before the
first prompt one N-token call on the smallest prompt pays the compile (``recall_first_call_s``). A longer
prompt can still make an engine compile inside its timed calls (the ring with ``attend=filled`` or ``exact``:
a program per bucket or slot count not met before): ``programs_compiled`` counts them (the engine's own count,
None where it compiles nothing), so a read or decode rate that includes compiling says so.
Timer boundaries: ``device.sync()`` before and after every call, and at each engine phase boundary.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any

from decodebench.config import ExperimentConfig, at_least
from decodebench.evidence import Record, samples, scalar
from engines.base import EngineLimit, Generation
from experiments import recall_prompts
from experiments.cell import Cell
from experiments.common import Result, answer

CODE = re.compile(r"(?<!\d)(\d{6})(?!\d)")


@dataclass
class RecallExperimentConfig(ExperimentConfig):
    """Numbered records fill the context; the model is asked for one code (experiments/recall_prompts).

    ``repeats``: timed reads of each recall prompt (a long prompt's read already spans many pieces).
    """

    repeats: int = 1

    def __post_init__(self) -> None:
        at_least("experiment.", self, 1, "repeats")


def headline(record: Record) -> str:
    """The cell's one line: the prompts that ran and each one's read rate."""
    ran = [o for o in record.outputs["recall"] if o["status"] == "ok"]
    rates = ", ".join(f"{o['prompt_tokens']} tok read at {o['read_tok_s']:.0f} tok/s" for o in ran)
    return f"recall: {len(ran)} of {len(record.outputs['recall'])} prompts ran ({rates})"


def fitting_targets(cell: Cell) -> tuple[list[int], dict[int, str]]:
    """Targets whose prompt the fit rule admits, capped at the model's positions; reasons for the rest."""
    cfg = cell.cfg
    room = min(cfg.context, cell.opened.checkpoint.config.max_position_embeddings) - cfg.max_new_tokens
    fit, skipped = [], {}
    for target in recall_prompts.TARGETS:
        misfit = cell.misfit(target)
        if misfit is None or not misfit.user_error:  # an engine limit is judged on the built prompt
            fit.append(min(target, room))
        else:
            skipped[target] = f"target {target} tokens does not fit context={cfg.context}: {misfit.reason}"
    return fit, skipped


def read_and_decode(cell: Cell, ids: list[int]) -> tuple[float, Generation, float]:
    """One repeat on a recall prompt: (read seconds, the N-token generation, decode tok/s)."""
    n = cell.cfg.max_new_tokens
    if cell.opened.cls.splits_phases:
        gen, _ = cell.timed_call(ids, n)
        return gen.read_s, gen, (n - 1) / gen.decode_s
    read_s, gen, total_s = cell.timed_pair(ids)
    return read_s, gen, (n - 1) / (total_s - read_s)


def parse_code(text: str) -> str | None:
    match = CODE.search(text)
    return match.group(1) if match else None


def run(cell: Cell, result: Result | None = None) -> Result:
    cfg, opened = cell.cfg, cell.opened
    n = cfg.max_new_tokens
    method = (
        "engine phase timers in one generate(N): read_s to the first token, (N-1)/decode_s"
        if opened.cls.splits_phases
        else "generate(1) for read_s, generate(N); (N-1)/(T_N - T_1)"
    )
    result = result or Result()
    result.timers.update(recall_read_s=method, recall_decode_tok_s=method)
    targets, skipped = fitting_targets(cell)
    prompts: list[recall_prompts.RecallPrompt] = []
    outcomes: list[dict[str, Any]] = [
        {"target_tokens": t, "status": "skipped", "reason": r} for t, r in skipped.items()
    ]
    for target in targets:
        prompt = recall_prompts.build(opened.tokenizer, target, cfg.seed, cfg.chat_template)
        misfit = cell.misfit(prompt.prompt_tokens)
        if misfit:
            outcomes.append({**prompt.evidence(), "status": "skipped", "reason": misfit.reason})
        else:
            prompts.append(prompt)
    if not prompts:
        raise EngineLimit("no recall prompt fits: " + "; ".join(o["reason"] for o in outcomes))
    load_s = cell.load()
    if load_s is not None:
        result.measurements["load_s"] = scalar(load_s, "s")
    _, first_s = cell.timed_call(list(prompts[0].ids), n)
    result.measurements["recall_first_call_s"] = scalar(first_s, "s", prompt_tokens=prompts[0].prompt_tokens)
    for prompt in prompts:
        ids = list(prompt.ids)
        reads, rates = [], []
        programs_before = cell.engine.compiled_programs()
        for _ in range(cfg.experiment.repeats):
            read_s, gen, rate = read_and_decode(cell, ids)
            reads.append(read_s)
            rates.append(rate)
        said = answer(gen.tokens, opened.eos_ids, opened.tokenizer)
        code = parse_code(said["text"])
        read_s = statistics.median(reads)
        outcomes.append(
            {
                **prompt.evidence(),
                "status": "ok",
                "method": method,
                "repeats": len(reads),
                "read_s": read_s,
                "read_tok_s": prompt.prompt_tokens / read_s,
                "decode_tok_s": statistics.median(rates),
                "answer_text": said["text"],
                "answer_code": code,
                "found": code == prompt.true_code,
                "programs_compiled": None if programs_before is None
                else cell.engine.compiled_programs() - programs_before,
            }
        )
        key = f"recall_{prompt.target_tokens}"
        result.measurements[f"{key}_read_tok_s"] = samples(
            [prompt.prompt_tokens / r for r in reads], "tok/s", method=method
        )
        result.measurements[f"{key}_decode_tok_s"] = samples(rates, "tok/s", method=method)
    result.outputs["recall"] = sorted(outcomes, key=lambda o: o["target_tokens"])
    return result
