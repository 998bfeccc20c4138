"""Peers: the servers a user would run instead of these ways (vLLM, llama.cpp's server), started by the cell
from their own environments, measured through the same endpoint code as ``engine=openai``, and stopped.

A ``PeerEngine`` is an ``OpenAIEngine`` whose ``load`` starts the peer's server on a free loopback port
(``decodebench.process_group.ServerGroup``: a process group of its own under a guard, so no peer process
outlives its cell, a killed cell included), waits for its readiness URL within ``engine.startup_timeout_s``,
then connects; ``close`` stops the whole group. Every call is watched: a peer that dies mid-cell fails the
call with the tail of its log, never a bare connection error. The cell's ``load_s`` is the peer's start;
the evidence adds the server's own ``startup_s``, its command, the stack it ran from (lock file and digest),
the kernel choices its log names, and the peak resident set of each of its processes.

Subclasses say which device runs which stack (``stacks``), the server's command (``command``) and what its
log says of its kernels (``KERNEL_LINES``), and what it ran from (``provenance``). A stack that is not installed
fails the cell with the command that installs it (``make peers``).
"""

from __future__ import annotations

import os
import re
import socket
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from decodebench.config import ConfigError, EngineConfig, positive
from decodebench.device import Device
from decodebench.process_group import ServerGroup, tail
from engines.base import Generation, OnTokens
from engines.openai_engine import OpenAIEngine

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
CHECK_GRACE_S = 2.0  # after a failed request, how long to look for the peer's end before taking the error as it is


@dataclass
class PeerEngineConfig(EngineConfig):
    """A peer's server, started by the cell: ``startup_timeout_s`` (seconds from start to its readiness URL
    answering), ``timeout_s`` (one request), ``threads`` (cores it computes on: None gives it torch's
    intra-op thread count in the cell's process, what an in-process engine gets)."""

    startup_timeout_s: float = 900.0
    timeout_s: float = 600.0
    threads: int | None = None

    def __post_init__(self) -> None:
        positive("engine.", self, "startup_timeout_s", "timeout_s", "threads")


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def core_list(threads: int) -> list[int]:
    """The first ``threads`` cores this process may run on."""
    cores = sorted(os.sched_getaffinity(0))
    if threads > len(cores):
        raise ConfigError(f"engine.threads={threads}: this process may run on {len(cores)} cores ({cores})")
    return cores[:threads]


class PeerEngine(OpenAIEngine):
    """A peer's OpenAI-compatible server, started by ``load`` and stopped by ``close`` (module docstring)."""

    peer: ClassVar[str]  # the peer's name in messages and evidence
    stacks: ClassVar[dict[str, str]]  # device kind -> the stack it runs there (a lock or build under locks/)
    ready_path: ClassVar[str] = "/health"
    KERNEL_LINES: ClassVar[re.Pattern[str]]  # what the peer's log says of the kernels it chose

    @classmethod
    def unsupported_reason(cls, device: Device, run_cfg: Any) -> str | None:
        reason = super().unsupported_reason(device, run_cfg)
        if reason is None and device.kind not in cls.stacks:
            return f"engine {cls.name} has no stack for a {device.kind} device (it has {', '.join(cls.stacks)})"
        return reason

    @classmethod
    def local_processes(cls, engine_cfg: Any) -> list[int]:
        return []  # the peer is the cell's child: its CPU seconds come back as the cell's own when it is stopped

    def threads(self) -> int:
        """The cores the peer computes on (``engine.threads``, or torch's intra-op threads in the cell)."""
        return self.ctx.engine_cfg.threads or torch.get_num_threads()

    @abstractmethod
    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        """The server's argv and the environment variables it needs beside the cell's own (files it needs made)."""

    @abstractmethod
    def provenance(self) -> dict[str, Any]:
        """What the peer ran from (its stack or build) and on (its weights), for the evidence."""

    def load(self) -> None:
        port = free_port()
        argv, extra = self.command(port)
        self.argv, self.extra_env = argv, extra
        log = Path(self.ctx.cache_dir) / "peers" / f"{self.name}-{port}-{int(time.time())}.log"
        self.server = ServerGroup(f"peer {self.name} ({self.peer})", argv, {**os.environ, **extra}, log)
        cfg = self.ctx.engine_cfg
        self.server.start(self.root_of(port) + self.ready_path, cfg.startup_timeout_s)
        try:
            self.watched(lambda: self.connect(self.root_of(port) + "/v1", None, None, cfg.timeout_s))
        except BaseException:
            self.server.stop()
            raise

    @staticmethod
    def root_of(port: int) -> str:
        """The peer's base URL on the loopback address."""
        return f"http://127.0.0.1:{port}"

    def watched(self, call: Callable[[], T]) -> T:
        """``call`` (a request to the peer); when the peer is gone after it failed, the failure says so, with
        the tail of the peer's log."""
        try:
            return call()
        except Exception as exc:
            self.server.check(grace_s=CHECK_GRACE_S)  # raises ServerFailed with the log's tail if the peer is gone
            raise exc

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        return_logits: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> Generation:
        call = super().generate
        return self.watched(lambda: call(prompt_ids, max_new_tokens, return_logits=return_logits, on_tokens=on_tokens))

    def top_logprobs(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[dict[int, float]]]:
        call = super().top_logprobs
        return self.watched(lambda: call(prompt_ids, max_new_tokens))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.left_after_stop = self.server.stop()

    def describe(self) -> dict[str, Any]:
        kernels = sorted({m.group(0).strip() for m in self.KERNEL_LINES.finditer(tail(self.server.log, 10**6))})
        return {
            **super().describe(),
            "peer": self.peer,
            **self.provenance(),
            "command": self.argv,
            "environment_set": self.extra_env,
            "threads": self.threads(),
            "startup_s": self.server.startup_s,
            "kernels": kernels,
            "memory": self.server.memory(),
            "log": str(self.server.log),
        }  # fmt: skip
