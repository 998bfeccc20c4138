"""Experiment ``recall``: numbered records fill the context; the model is asked for one code back.

For each prompt of ``experiments.recall_prompts`` that fits (article 003, Step 11 shape):
* ``read_s``: a warm ``generate(prompt, 1)`` — the prompt read as the engine reads it (in pieces
  for ``ring``) plus one token; ``read_tok_s`` = prompt tokens / read_s.
* ``decode_tok_s`` = (N-1) / (T_N - T_1) from the same prompt, as in ``decode``.
* the answer text up to EOS, the six-digit code parsed from it, found yes/no, the asked record and
  the true code.
Before the first prompt one N-token call on the smallest prompt pays the compile (``first_call_s``).
Timer boundaries: ``device.sync()`` before and after every call.
"""

from __future__ import annotations

import re
from typing import Any

from decodebench.evidence import scalar
from engines.base import EngineLimit
from experiments import recall_prompts
from experiments.common import Cell, Result, answer, timed
from experiments.decode import timed_pair

CODE = re.compile(r"(?<!\d)(\d{6})(?!\d)")


def fitting_targets(cfg: Any, max_positions: int) -> tuple[list[int], dict[int, str]]:
    """Targets that fit ``context - max_new_tokens`` (and the model's positions); reasons for the rest."""
    room = min(cfg.context, max_positions) - cfg.max_new_tokens
    fit, skipped = [], {}
    for target in recall_prompts.TARGETS:
        if target <= cfg.context - cfg.max_new_tokens:
            fit.append(min(target, room))
        else:
            skipped[target] = (
                f"target {target} tokens does not fit context={cfg.context} minus max_new_tokens={cfg.max_new_tokens}"
            )
    return fit, skipped


def parse_code(text: str) -> str | None:
    match = CODE.search(text)
    return match.group(1) if match else None


def run(cell: Cell, result: Result | None = None) -> Result:
    cfg, device, engine = cell.cfg, cell.device, cell.engine
    n = cfg.max_new_tokens
    result = result or Result()
    result.timers.update(
        recall_read_s="warm generate(prompt, 1), device.sync() before and after",
        recall_decode_tok_s="(N-1) / (T_N - T_1) on the recall prompt",
    )
    if engine.checkpoint is None:
        engine.prepare()
    targets, skipped = fitting_targets(cfg, engine.checkpoint.config.max_position_embeddings)
    prompts: list[recall_prompts.RecallPrompt] = []
    outcomes: list[dict[str, Any]] = [
        {"target_tokens": t, "status": "skipped", "reason": r} for t, r in skipped.items()
    ]
    for target in targets:
        prompt = recall_prompts.build(engine.tokenizer, target, cfg.seed, cfg.chat_template)
        try:
            engine.check_fits(prompt.prompt_tokens, n)
            prompts.append(prompt)
        except EngineLimit as exc:
            outcomes.append({**prompt.evidence(), "status": "skipped", "reason": str(exc)})
    if not prompts:
        raise EngineLimit("no recall prompt fits: " + "; ".join(o["reason"] for o in outcomes))
    if not engine.loaded:
        _, load_s = timed(device, engine.load)
        engine.loaded = True
        result.measurements["load_s"] = scalar(load_s, "s")
    _, first_s = timed(device, lambda: engine.generate(list(prompts[0].ids), n))
    result.measurements["recall_first_call_s"] = scalar(first_s, "s", prompt_tokens=prompts[0].prompt_tokens)
    for prompt in prompts:
        ids = list(prompt.ids)
        read_s, gen, total_s = timed_pair(cell, ids)
        said = answer(gen.tokens, engine.eos_ids, engine.tokenizer)
        code = parse_code(said["text"])
        outcomes.append(
            {
                **prompt.evidence(),
                "status": "ok",
                "read_s": read_s,
                "read_tok_s": prompt.prompt_tokens / read_s,
                "decode_tok_s": (n - 1) / (total_s - read_s),
                "answer_text": said["text"],
                "answer_code": code,
                "found": code == prompt.true_code,
            }
        )
        key = f"recall_{prompt.target_tokens}"
        result.measurements[f"{key}_read_tok_s"] = scalar(prompt.prompt_tokens / read_s, "tok/s")
        result.measurements[f"{key}_decode_tok_s"] = scalar((n - 1) / (total_s - read_s), "tok/s")
    result.outputs["recall"] = sorted(outcomes, key=lambda o: o["target_tokens"])
    return result
