"""decodebench's long-context recall prompts (generator version 1), stable and documented.

The article's own generator is not public, so decodebench defines this one:

* Records ``Record NNNN: code DDDDDD.``, numbered from 1, each with a six-digit code drawn from
  ``random.Random(seed)`` (``randrange(10**6)``, zero-padded), in order, one per line.
* The user turn is ``INTRO`` + the records + a question for the record a quarter of the way in
  (record ``max(1, n // 4)``), read through the model's chat template (which adds BOS).
* ``n`` is the largest record count whose prompt, counted with the model's own tokenizer and chat
  template, is at most the target token count (binary search).
* Targets follow the article: about 64, 4 096, 32 768 and 131 072 tokens; each is used only when it
  fits ``context - max_new_tokens`` (and ``max_position_embeddings - max_new_tokens``).

Everything needed to rebuild a prompt is recorded: version, seed, record count, asked record, depth,
true code, prompt token count and the SHA-256 of the prompt ids.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import Any

from decodebench.prompts import prompt_ids

GENERATOR_VERSION = 1
TARGETS = (64, 4096, 32768, 131072)
INTRO = "Each record has a six-digit code.\n"
QUESTION = "\nWhat is the code of record {record:04d}? Answer with the six digits only."


@dataclass(frozen=True)
class RecallPrompt:
    target_tokens: int
    generator_version: int
    seed: int
    records: int
    asked_record: int
    depth: float
    true_code: str
    prompt_tokens: int
    prompt_sha256: str
    ids: tuple[int, ...]

    def evidence(self) -> dict[str, Any]:
        """Everything but the ids themselves (their hash identifies them)."""
        return {k: v for k, v in asdict(self).items() if k != "ids"}


def codes(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.randrange(10**6):06d}" for _ in range(n)]


def text(seed: int, n: int) -> tuple[str, int, str]:
    """The user turn for ``n`` records; the asked record number and its code."""
    all_codes = codes(seed, n)
    asked = max(1, n // 4)
    body = "".join(f"Record {i:04d}: code {c}.\n" for i, c in enumerate(all_codes, start=1))
    return INTRO + body + QUESTION.format(record=asked), asked, all_codes[asked - 1]


def build(tokenizer: Any, target: int, seed: int, chat_template: bool = True) -> RecallPrompt:
    """The largest prompt of this generator that is at most ``target`` tokens."""

    def size(n: int) -> int:
        return len(prompt_ids(tokenizer, text(seed, n)[0], chat_template))

    if size(1) > target:
        raise ValueError(f"a recall prompt of one record is already {size(1)} tokens, above the target {target}")
    low, high = 1, 2
    while size(high) <= target:
        low, high = high, high * 2
    while high - low > 1:  # size(low) <= target < size(high)
        mid = (low + high) // 2
        low, high = (mid, high) if size(mid) <= target else (low, mid)
    content, asked, code = text(seed, low)
    ids = prompt_ids(tokenizer, content, chat_template)
    return RecallPrompt(
        target_tokens=target,
        generator_version=GENERATOR_VERSION,
        seed=seed,
        records=low,
        asked_record=asked,
        depth=asked / low,
        true_code=code,
        prompt_tokens=len(ids),
        prompt_sha256=hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest(),
        ids=tuple(ids),
    )
