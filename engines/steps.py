"""The call every step-by-step engine shares, whatever its framework: read the prompt, then step.

A ``SteppedEngine`` says how to empty its cache (``reset``), read a prompt (``prefill``: the first new
token and its logits, on the device), make the next token (``advance``) and copy tokens and logits to
the host; ``generate`` is written once here, for the torch engines (``engines/stepping.py``) and the
JAX engine alike. Tokens and positions stay on the device; ``read_every`` decides how often tokens are
read to the host.

Phase timers (wall clock, ``device.sync()`` at the call's start and end, ``wait`` on the first token):
``read_s`` from the call's start to the first new token ready on the device (reset + prefill),
``decode_s`` from there to the last of the N tokens on the host (N-1 steps and the read-backs), so
decode tok/s = (N-1) / decode_s.
"""

from __future__ import annotations

import contextlib
import time
from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from engines.base import Engine, Generation, OnTokens


def decode_loop(
    token: Any,
    logits: Any,
    step: Callable[[int, Any], tuple[Any, Any]],
    max_new_tokens: int,
    read_every: int,
    to_host: Callable[[list[Any]], list[int]],
    on_tokens: OnTokens | None = None,
    return_logits: bool = False,
) -> tuple[list[int], list[Any]]:
    """From the prompt read's first ``token`` (on the device), ``step(i, token)`` makes each next one;
    tokens stay on the device and are read to the host (``to_host``, a copy that waits) every
    ``read_every`` tokens, each batch handed to ``on_tokens`` (a stream gets the first token alone at
    once; False stops after that batch). Returns the host tokens and, with ``return_logits``, every
    step's device logits in order."""
    pending, tokens, kept = [token], [], [logits] if return_logits else []
    steps = max_new_tokens - 1
    if on_tokens is not None:  # a stream has its first token as soon as the prompt read made it
        tokens, pending = to_host([token]), []
        steps = steps if on_tokens(list(tokens)) else 0
    for i in range(steps):
        token, logits = step(i, token)
        pending.append(token)
        if return_logits:
            kept.append(logits)
        if len(pending) >= read_every:  # the read-back: a device -> host copy that waits
            batch = to_host(pending)
            tokens += batch
            pending = []
            if on_tokens is not None and not on_tokens(batch):
                break
    if pending:
        batch = to_host(pending)
        tokens += batch
        if on_tokens is not None:
            on_tokens(batch)
    return tokens, kept


def batch_call(
    sync: Callable[[], None], read: Callable[[], torch.Tensor], step: Callable[[torch.Tensor], torch.Tensor],
    max_new_tokens: int,
) -> list[Generation]:
    """A batched call's skeleton and phase timers (``generate_batch``): ``read()`` reads every prompt and gives their
    first tokens [B, 1] on the device, ``step(tokens)`` the next [B, 1]; tokens stay on the device until the last
    step. ``read_s`` from the call's start to the last first token ready, ``decode_s`` from there to every token on
    the host (``sync()`` at each boundary)."""
    sync()
    start = time.perf_counter()
    made = [read()]
    sync()
    first = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        made.append(step(made[-1]))
    tokens = torch.cat(made, dim=1).tolist()
    sync()
    end = time.perf_counter()
    return [Generation(row, None, read_s=first - start, decode_s=end - first) for row in tokens]


class SteppedEngine(Engine):
    """Reads the prompt once, then one step per new token; ``generate`` is the shared skeleton."""

    streams = True
    splits_phases = True
    scores_prompt = True

    @abstractmethod
    def reset(self) -> None:
        """Empties the cache before a call."""

    @abstractmethod
    def prefill(self, prompt_ids: list[int]) -> tuple[Any, Any]:
        """Reads the prompt; the first new token and its logits, on the device."""

    @abstractmethod
    def position(self, prompt_tokens: int) -> Any:
        """The first decode step's position, on the device."""

    @abstractmethod
    def advance(self, at: int, token: Any, position: Any) -> tuple[Any, Any, Any]:
        """One step: ``token`` at device ``position`` (``at`` on the host) -> next token, logits, position + 1."""

    @abstractmethod
    def device_token(self, token: int) -> Any:
        """A host token id as the decode step takes it, on the device."""

    @abstractmethod
    def to_host(self, batch: list[Any]) -> list[int]:
        """Device tokens to host ids (a copy that waits for them)."""

    @abstractmethod
    def host_logits(self, kept: list[Any]) -> torch.Tensor:
        """Every kept step's logits as one [n, V] float32 tensor on the host."""

    def wait(self, token: Any) -> None:
        """Returns once ``token`` is ready on the device (the prompt read's end)."""
        self.ctx.device.sync()

    def running(self) -> AbstractContextManager[Any]:
        """The framework's context around a call (torch: inference mode)."""
        return contextlib.nullcontext()

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        return_logits: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> Generation:
        with self.running():
            self.ctx.device.sync()
            start = time.perf_counter()
            self.reset()
            token, logits = self.prefill(prompt_ids)
            self.wait(token)
            first = time.perf_counter()
            position = self.position(len(prompt_ids))

            def step(i: int, token: Any) -> tuple[Any, Any]:
                nonlocal position
                token, logits, position = self.advance(len(prompt_ids) + i, token, position)
                return token, logits

            read_every = self.ctx.read_every or max_new_tokens
            tokens, kept = decode_loop(
                token, logits, step, max_new_tokens, read_every, self.to_host, on_tokens, return_logits
            )
            self.ctx.device.sync()
            end = time.perf_counter()
            stacked = self.host_logits(kept) if return_logits else None
        return Generation(tokens, stacked, read_s=first - start, decode_s=end - first)

    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Teacher-forced (``teacher_forced``): one decode step per prompt token after the first."""
        return self.teacher_forced(prompt_ids)

    def teacher_forced(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), V] float32 on the host at every position of ``ids``, each reading only the ids
        up to it (teacher forcing): the first id read as a one-token prompt, every later id fed to the
        decode step in place of the engine's own choice. The same programs as ``generate``; not timed."""
        with self.running():
            self.reset()
            _, logits = self.prefill(ids[:1])
            kept, position = [logits], self.position(1)
            for at, token in enumerate(ids[1:], start=1):
                _, logits, position = self.advance(at, self.device_token(token), position)
                kept.append(logits)
            return self.host_logits(kept)
