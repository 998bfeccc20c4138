"""Pieces every experiment shares: the result it hands back, the answer, quiet loading."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from decodebench.evidence import Measurement


@dataclass
class Result:
    """What an experiment hands back for the evidence record (``decodebench.evidence.Record``).

    ``model``: the provenance of a checkpoint the experiment read itself (one that runs no engine).
    """

    measurements: dict[str, Measurement] = field(default_factory=dict)
    samples: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    timers: dict[str, str] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keeps compressed-tensors' progress bars (at load, and at the first forward when it unpacks) and
    Transformers' load report out of the cell output."""
    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        transformers_logging.set_verbosity(level)


def answer(tokens: list[int], eos_ids: list[int], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The answer as a user would see it: tokens up to the first EOS, its text and finish reason."""
    stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    kept = tokens if stop is None else tokens[:stop]
    return {
        "generated_ids": tokens,
        "answer_ids": kept,
        "text": tokenizer.decode(kept, skip_special_tokens=True),
        "finish_reason": "length" if stop is None else "stop",
        "answer_tokens": len(kept),
    }
