"""``llamacpp``: llama.cpp's server as a peer, started by the cell (``engines.peer``) on GGUF files its own converter
makes from the run's W4A16 twin.

* The build: ``engines.llamacpp_build`` (``make peers``): ``llama-server``, ``llama-quantize`` and the converter of
  one pinned source, built natively for this machine. A CPU stack only: elsewhere the cell is skipped.
* The weights, ``engine.quant``: ``bf16`` and ``q8_0`` straight from the converter (``convert_hf_to_gguf.py``
  dequantizes the twin's pack-quantized linears), ``q4_0`` and ``q4_k_m`` by ``llama-quantize`` from the bf16 file:
  llama.cpp's own 4-bit formats (its tied embedding and per-layer table come out q6_K), not the twin's W4A16 groups,
  so the evidence names the quantization. Made on first use under ``<cache_dir>/gguf/<twin digest>-<source digest>/``
  and kept; ``conversion_s`` records the seconds when this cell made them (they count in its load).
* The server: ``llama-server -m <gguf> -c <context x slots> -t <threads> -np <slots>`` on a loopback port, no web
  UI: ``engine.slots`` requests decode together (one by default: one request at a time). ``generate_batch`` sends
  its B prompts at once, one request a slot (B slots at least): the server decodes its busy slots in one batch.
* Calls: llama.cpp's own ``/completion``: the prompt as ids, ``n_predict`` = N with ``ignore_eos`` (exactly N),
  ``return_tokens`` (the ids back), temperature 0 and ``top_k`` 1 (greedy), ``n_probs`` 5 for parity (ids with their
  log-probabilities); streamed as server-sent events when a hook listens. The server's own timer of the last
  call (``timings``) is kept beside the client's clock. A load generator drives its OpenAI routes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from decodebench.config import ConfigError, Tables, at_least
from engines.base import EngineLimit, Generation, OnTokens
from engines.llamacpp_build import built, source
from engines.openai_engine import NO_LOGITS
from engines.peer import PeerEngine, PeerEngineConfig

QUANTS = ("f32", "bf16", "q8_0", "q4_0", "q4_k_m")
CONVERTED = ("f32", "bf16", "q8_0")  # what the converter writes itself; the rest llama-quantize makes from bf16


@dataclass
class LlamaCppEngineConfig(PeerEngineConfig):
    """llama.cpp's server (module docstring): ``quant``, the GGUF it serves (one of ``QUANTS``); ``slots``, the
    requests it decodes together (``-np``: its continuous batching), each slot holding the run's whole context."""

    quant: str = "q4_0"
    slots: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("engine.", self, 1, "slots")
        if self.quant not in QUANTS:
            raise ConfigError(f"engine.quant={self.quant} is not one llama.cpp serves here; valid: {', '.join(QUANTS)}")


def twin_digest(path: Path) -> str:
    """The twin's files (names, sizes, modification times): what a GGUF made from it depends on."""
    files = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir()) if f.is_file()]
    return hashlib.sha256(json.dumps([str(path), files]).encode()).hexdigest()[:12]


class LlamaCppEngine(PeerEngine):
    """llama.cpp's server, started and stopped by the cell."""

    name = "llamacpp"
    peer = "llama.cpp"
    config = LlamaCppEngineConfig
    stacks = {"cpu": "llamacpp"}
    batches = True  # generate_batch: up to engine.slots requests at once
    KERNEL_LINES = re.compile(r"(?:CPU_REPACK|system_info|load_tensors: +\S+ model buffer).*$", re.MULTILINE)

    @classmethod
    def twin(cls, engine_cfg: Any, model_cfg: Any) -> str:
        return Tables.bf16  # the converter takes the W4A16 twin (one quantization group), not the -emb4 one

    def gguf(self) -> Path:
        """The GGUF ``engine.quant`` names, made from the twin on first use (seconds in ``self.conversion_s``)."""
        made, quant = self.build, self.ctx.engine_cfg.quant
        folder = Path(self.ctx.cache_dir) / "gguf" / f"{twin_digest(self.checkpoint.path)}-{made['sha256'][:12]}"
        target = folder / f"{quant}.gguf"
        self.conversion_s = None
        if target.exists():
            return target
        began = time.monotonic()
        folder.mkdir(parents=True, exist_ok=True)
        base = folder / f"{quant if quant in CONVERTED else 'bf16'}.gguf"
        if not base.exists():
            tree = source(Path(made["folder"]))
            self._run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(self.checkpoint.path), "--outtype",
                       base.stem, "--outfile", str(base) + ".part"], base)  # fmt: skip
        if not target.exists():
            quantize = Path(made["folder"]) / "build" / "bin" / "llama-quantize"
            self._run([str(quantize), str(base), str(target) + ".part", quant.upper()], target)
        self.conversion_s = time.monotonic() - began
        return target

    def _run(self, argv: list[str], out: Path) -> None:
        """One conversion step writing ``out`` (through ``out.part``, renamed when whole); a failure says which."""
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp could not make {out.name} from {self.checkpoint.path} ({' '.join(argv)}): "
                               + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))  # fmt: skip
        Path(str(out) + ".part").rename(out)

    def provenance(self) -> dict[str, Any]:
        made = self.build
        return {"build": {k: made[k] for k in ("source", "sha256", "cmake_flags", "compiler", "build_s")},
                "weights": {"twin": "ct-text", "path": str(self.checkpoint.path), "gguf": str(self.weights),
                            "quant": self.ctx.engine_cfg.quant, "gguf_bytes": self.weights.stat().st_size,
                            "conversion_s": self.conversion_s},
                "kept_4bit": ["linears"] if self.ctx.engine_cfg.quant.startswith("q4") else [],
                "linears": self.ctx.engine_cfg.quant,
                "timings": self.timings}  # fmt: skip

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        cfg, self.build = self.ctx.engine_cfg, built()
        self.weights, self.timings = self.gguf(), None
        self.http = httpx.Client(base_url=self.root_of(port), timeout=cfg.timeout_s)  # one connection, as openai's
        server = Path(self.build["folder"]) / "build" / "bin" / "llama-server"
        threads = str(self.threads())
        argv = [str(server), "-m", str(self.weights), "--host", "127.0.0.1", "--port", str(port),
                "-c", str(self.ctx.context * cfg.slots), "-np", str(cfg.slots), "-t", threads,
                "--threads-batch", threads, "--alias", str(self.ctx.model_cfg.name), "--no-webui"]  # fmt: skip
        return argv, {}

    def _body(self, prompt_ids: list[int], max_new_tokens: int, **fields: Any) -> dict[str, Any]:
        """A greedy completion of exactly ``max_new_tokens`` tokens returned as ids."""
        return {"prompt": prompt_ids, "n_predict": max_new_tokens, "ignore_eos": True, "return_tokens": True,
                "temperature": 0.0, "top_k": 1, **fields}  # fmt: skip

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.http.post("/completion", json=body)
        reply.raise_for_status()
        data = reply.json()
        self.timings = data.get("timings")
        return data

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        return_logits: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> Generation:
        if return_logits:
            raise EngineLimit(NO_LOGITS)
        body = self._body(prompt_ids, max_new_tokens)
        if on_tokens is None:
            return Generation(self.watched(lambda: self._post(body))["tokens"])
        return Generation(self.watched(lambda: self._stream(body, on_tokens)))

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        """The prompts sent at once, each to a slot; each ``Generation`` with the server's own timer of its request
        (``prompt_ms`` as ``read_s``, ``predicted_ms`` as ``decode_s``)."""
        slots = self.ctx.engine_cfg.slots
        if len(prompts) > slots:
            raise EngineLimit(f"llama-server decodes {len(prompts)} sequences together only with engine.slots="
                              f"{len(prompts)} or more, this one has engine.slots={slots}")  # fmt: skip
        bodies = [self._body(ids, max_new_tokens) for ids in prompts]
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = self.watched(lambda: list(pool.map(self._post, bodies)))
        return [Generation(r["tokens"], read_s=r["timings"]["prompt_ms"] / 1e3,
                           decode_s=r["timings"]["predicted_ms"] / 1e3) for r in replies]  # fmt: skip

    def _stream(self, body: dict[str, Any], on_tokens: OnTokens) -> list[int]:
        """The ids of a streamed completion, each event's handed to ``on_tokens``; a false return closes it."""
        tokens: list[int] = []
        with self.http.stream("POST", "/completion", json={**body, "stream": True}) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                ids = json.loads(line.removeprefix("data: ")).get("tokens") or []
                tokens += ids
                if ids and not on_tokens(ids):
                    break  # leaving the block closes the stream: the server stops the decode
        return tokens

    def top_logprobs(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[dict[int, float]]]:
        """One completion with ``n_probs`` = 5: its ids and, at each position, the five best ids' log-probabilities."""
        data = self.watched(lambda: self._post(self._body(prompt_ids, max_new_tokens, n_probs=self.top_logprobs_k)))
        rows = data.get("completion_probabilities") or []
        return data["tokens"], [{int(t["id"]): float(t["logprob"]) for t in row["top_logprobs"]} for row in rows]

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.http.close()
