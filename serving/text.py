"""Tokens into the text a client reads: where a reply ends (``StopRule``), its text as tokens arrive
(``TextStream``: incremental detokenization, stop strings, held-back text), and log-probabilities in
OpenAI's two shapes (``Scores``, ``TokenText``).

The worker (the engine's thread) and the HTTP side hold the same rule: the worker decides which token
ends a reply (``TextStream`` only when the request has stop strings, so a plain request decodes no
text on the engine's thread), the HTTP side turns the tokens it is handed into text (off the event
loop) and cuts it where the same rule says. Both decode the same tokens the same way, so they agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import decoders
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


@dataclass(frozen=True)
class StopRule:
    """When a reply ends before its token budget: at an EOS id (unless ``ignore_eos``) or once its text
    holds a stop string; neither can end it within its first ``min_tokens`` tokens, and stop strings are
    looked for only in the text after those tokens."""

    eos: frozenset[int]
    stops: tuple[str, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False

    def at_eos(self, token: int, n: int) -> bool:
        """Whether ``token``, the reply's ``n``-th (from 1), ends it as an EOS."""
        return not self.ignore_eos and token in self.eos and n > self.min_tokens


class TextStream:
    """A reply's text as its tokens arrive, one token at a time (``push``).

    Incremental detokenization: each token's text is the difference between decoding the ids from a
    prefix offset with and without the new ones, so a reply of n tokens costs O(n) decodes of a few
    tokens, not n decodes of the whole; a token that ends inside a character (U+FFFD) waits for the
    next. EOS ids and special tokens add no text. ``offsets[i]``: the length of the text before token i.
    ``cut``: where the text ends (the first stop string's start), once a stop string is found.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rule: StopRule) -> None:
        self.tokenizer, self.rule = tokenizer, rule
        self.tokens: list[int] = []  # every id pushed: the reply's tokens (EOS included)
        self.ids: list[int] = []  # the ids that carry text (EOS ids left out)
        self.prefix = self.read = 0  # ids[prefix:read]: the context the next decode starts from
        self.text = ""
        self.offsets: list[int] = []
        self.count = 0
        self.floor = 0  # stop strings are looked for from here (the text after the first min_tokens tokens)
        self.cut: int | None = None
        self.shown = 0  # characters handed out by ``visible``
        self.longest = max(map(len, rule.stops), default=0)

    def push(self, token: int) -> bool:
        """One token in; True when the reply ends with it (EOS or a stop string, per the rule)."""
        self.count += 1
        self.tokens.append(token)
        self.offsets.append(len(self.text))
        searched = len(self.text)
        if token not in self.rule.eos:
            self.ids.append(token)
            self.text += self.decoded()
        if self.count <= self.rule.min_tokens:
            self.floor = len(self.text)
            return False
        if self.rule.at_eos(token, self.count):
            return True
        start = max(self.floor, searched - self.longest + 1)  # a new match ends in the new text
        found = [i for i in (self.text.find(s, start) for s in self.rule.stops) if i >= 0]
        if found:
            self.cut = min(found)
        return bool(found)

    def decoded(self) -> str:
        """The text the ids added since the last decode that ended on a whole character."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def feed(self, batch: list[int]) -> str:
        """A batch in (the worker cut it after the token that ends the reply); returns the text a client
        may see now."""
        for token in batch:
            self.push(token)
        return self.visible()

    @property
    def reply(self) -> str:
        """The reply's text: up to the cut (the stop string's start) once there is one."""
        return self.text if self.cut is None else self.text[: self.cut]

    def held(self) -> int:
        """Characters at the end of the text that could be the start of a stop string."""
        tail = self.text[max(self.floor, len(self.text) - self.longest + 1) :]
        starts = (i for i in range(len(tail)) if any(s.startswith(tail[i:]) for s in self.rule.stops))
        return len(tail) - next(starts, len(tail))

    def visible(self, final: bool = False) -> str:
        """Text not yet handed out: up to the cut, and, until ``final``, short of a tail that could be the
        start of a stop string."""
        end = self.cut if self.cut is not None else len(self.text) - (0 if final else self.held())
        out = self.text[self.shown : max(end, self.shown)]
        self.shown += len(out)
        return out


def whole_text(tokenizer: PreTrainedTokenizerBase, eos_ids: list[int], ids: list[int]) -> tuple[str, list[int]]:
    """Ids decoded as a reply's text is (no stop rule): the text and each token's offset in it."""
    stream = TextStream(tokenizer, StopRule(frozenset(eos_ids), ignore_eos=True))
    stream.feed(ids)
    return stream.text, stream.offsets


@dataclass
class Scores:
    """Log-probabilities (natural log) of the tokens a model read or wrote, each from the logits that
    predicted it; ``top``: the ``k`` best ids at each position, best first, with theirs."""

    ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    @classmethod
    def of(cls, logits: torch.Tensor, ids: list[int], k: int) -> Scores:
        """``logits`` [len(ids), vocab] (row i predicts ids[i]) on the host: log-softmax, then top-k."""
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(ids, dtype=torch.long).view(-1, 1)).view(-1)
        top = logprobs.topk(k, dim=-1)
        return cls(ids, chosen.tolist(), top.indices.tolist(), top.values.tolist())

    def __add__(self, other: Scores) -> Scores:
        return Scores(self.ids + other.ids, self.logprobs + other.logprobs, self.top_ids + other.top_ids,
                      self.top_logprobs + other.top_logprobs)  # fmt: skip


class TokenText:
    """Each token's text and UTF-8 bytes as OpenAI's log-probabilities carry them: the bytes are exact
    even for a token that holds part of a character (a byte-level BPE piece, a ``<0xNN>`` fallback)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own
        byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self.byte_of = {c: b for b, c in bytes_to_unicode().items()} if byte_level else {}

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def bytes(self, token: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if self.byte_of and all(c in self.byte_of for c in piece):
            return [self.byte_of[c] for c in piece]
        fallback = BYTE_PIECE.fullmatch(piece)
        return [int(fallback[1], 16)] if fallback else list(self.text(token).encode())

    def name(self, token: int, as_ids: bool) -> str:
        """How log-probabilities name a token: its text, or (vLLM's ``return_tokens_as_token_ids``) its id."""
        return f"token_id:{token}" if as_ids else self.text(token)

    def entry(self, token: int, logprob: float, as_ids: bool = False) -> dict[str, Any]:
        return {"token": self.name(token, as_ids), "logprob": logprob, "bytes": self.bytes(token)}

    def chat(self, scores: Scores, as_ids: bool = False) -> dict[str, Any]:
        """``choices[].logprobs`` of a chat completion: ``content[]`` with each token's top alternatives."""
        rows = zip(scores.ids, scores.logprobs, scores.top_ids, scores.top_logprobs, strict=True)
        content = [
            {**self.entry(token, logprob, as_ids),
             "top_logprobs": [self.entry(t, lp, as_ids) for t, lp in zip(ids, lps, strict=True)]}
            for token, logprob, ids, lps in rows
        ]  # fmt: skip
        return {"content": content, "refusal": None}

    def completion(
        self, unscored: list[int], scores: Scores, offsets: list[int], as_ids: bool = False
    ) -> dict[str, Any]:
        """``choices[].logprobs`` of a completion: ``unscored`` tokens first (an echoed prompt's first
        token, which nothing predicts: null, as OpenAI gives it), then the scored ones;
        ``offsets``: each token's start in the choice's text."""
        top = [{self.name(t, as_ids): lp for t, lp in zip(ids, lps, strict=True)}
               for ids, lps in zip(scores.top_ids, scores.top_logprobs, strict=True)]  # fmt: skip
        return {"tokens": [self.name(t, as_ids) for t in unscored + scores.ids],
                "token_logprobs": [None] * len(unscored) + scores.logprobs,
                "top_logprobs": [None] * len(unscored) + top, "text_offset": offsets}  # fmt: skip
