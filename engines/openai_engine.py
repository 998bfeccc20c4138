"""``openai``: an OpenAI-compatible endpoint measured as an engine (vLLM, SGLang, JetStream, llama.cpp's server,
decodebench's own ``serve.py``), by the same experiments as the in-process engines.

* A call is one ``/v1/completions`` request through the official ``openai`` client: the prompt as token ids,
  greedy (``temperature=0``), exactly ``max_new_tokens`` tokens (``ignore_eos`` and ``min_tokens``, vLLM's
  fields), the tokens returned as ids (``return_token_ids``, vLLM's field), so the exactly-N rule and token
  comparisons read ids, never re-encoded text. A reply without ids, or with another count, fails the call.
* ``on_tokens``: the request streams, each chunk's ids handed to the hook as the chunk arrives; a false return
  closes the stream (the server cancels the decode).
* The clock is the client's: a call's seconds include the network and the server's queue. The decode
  experiment's (N-1)/(T_N - T_1) takes the fixed part out, as for any engine.
* ``engine.url``: the endpoint's base (``.../v1``); ``engine.model``: its model id (None: the first that
  ``/v1/models`` lists); ``engine.api_key_env``: the name of an environment variable holding the key, read at
  load and never written anywhere.
* The run's ``model=`` gives the tokenizer and the checkpoint's facts (prompt ids, EOS): it must be the model
  the endpoint serves; the evidence names both, with the endpoint's ``/v1/models`` answer and the first version
  endpoint that answers.
* An endpoint on this machine (a loopback URL) works on the cell's cores: the processes listening on its port
  and their workers count as the cell's own CPU, not contention (``environment.contention.own_processes``).
* Parity needs every logit of a position; an endpoint returns at most five log-probabilities, so parity
  compares what it returns (``top_logprobs``): the greedy tokens, and a KL restricted to the endpoint's five
  ids at each position (both sides renormalized over them), stated as such.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from decodebench.config import ConfigError, EngineConfig, positive
from decodebench.environment import listening_processes
from engines.base import Engine, EngineLimit, Generation, OnTokens

VERSION_PATHS = ("/version", "/v1/engine", "/props")  # vLLM and SGLang, decodebench, llama.cpp's server
LOOPBACK = ("127.0.0.1", "localhost", "::1")
NO_LOGITS = ("engine openai cannot return every logit of a position: an OpenAI-compatible endpoint returns at most "
             "a few log-probabilities")  # fmt: skip


@dataclass
class OpenAIEngineConfig(EngineConfig):
    """An OpenAI-compatible endpoint (module docstring); ``timeout_s``: one request's limit, seconds."""

    url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        positive("engine.", self, "timeout_s")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"engine.url={self.url!r} is not an http(s) URL (the endpoint's base, e.g. "
                              "http://127.0.0.1:8000/v1)")  # fmt: skip
        if self.api_key_env is not None and self.api_key_env not in os.environ:
            raise ConfigError(f"engine.api_key_env={self.api_key_env}: no such environment variable is set")


class OpenAIEngine(Engine):
    """Greedy calls to an OpenAI-compatible endpoint; nothing held locally but the client."""

    name = "openai"
    config = OpenAIEngineConfig
    returns_logits = False
    top_logprobs_k = 5  # OpenAI's most for completions

    @classmethod
    def local_processes(cls, engine_cfg: Any) -> list[int]:
        """An endpoint on this machine (a loopback address): the processes listening on its port and their
        workers, whose CPU is the cell's work, not contention."""
        url = urlsplit(engine_cfg.url)
        if url.hostname not in LOOPBACK:
            return []
        return listening_processes(url.port or (443 if url.scheme == "https" else 80))

    def load(self) -> None:
        cfg = self.ctx.engine_cfg
        self.connect(cfg.url, cfg.model, cfg.api_key_env, cfg.timeout_s)

    def connect(self, url: str, model: str | None, api_key_env: str | None, timeout_s: float) -> None:
        """The client of the endpoint at ``url`` (``.../v1``), its models, the one measured (``model`` or the
        first listed) and its version; the key is read from the variable ``api_key_env`` names."""
        from openai import OpenAI  # the serve extra's client, imported only for these engines

        self.url, self.api_key_env = url, api_key_env
        key = os.environ[api_key_env] if api_key_env else "none"
        self.client = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout_s)
        try:
            listed = self.client.models.list()
        except Exception as exc:  # the user named this endpoint: nothing answering there is a failure
            raise ConfigError(f"engine.url={url}: no OpenAI-compatible endpoint answers at {url}/models ({exc}); "
                              "start the server first, or name one that answers") from exc  # fmt: skip
        self.models = [m.model_dump() for m in listed.data]
        ids = [m["id"] for m in self.models]
        if model is not None and model not in ids:
            raise ConfigError(f"engine.model={model!r} is not served at {url} (it lists {', '.join(ids)})")
        if not ids:
            raise EngineLimit(f"the endpoint at {url} lists no model")
        self.model_id = model or ids[0]
        self.version = self._version(key)

    @property
    def root(self) -> str:
        """The endpoint's base URL without ``/v1``."""
        return self.url.rstrip("/").removesuffix("/v1")

    def endpoint(self) -> tuple[str, str] | None:
        if self.api_key_env:  # a load generator would need the key on its command line
            raise ConfigError(f"engine.api_key_env={self.api_key_env}: a load generator is not handed an API key "
                              "(it would show on its command line); measure a keyless endpoint")  # fmt: skip
        return self.root, self.model_id

    def _version(self, key: str) -> dict[str, Any] | None:
        """The first version endpoint that answers with JSON, as it answered (None: none does)."""
        root = self.root
        for path in VERSION_PATHS:
            try:
                answer = httpx.get(root + path, headers={"Authorization": f"Bearer {key}"}, timeout=10)
                if answer.status_code == 200:
                    return {"path": path, "answer": answer.json()}
            except (httpx.HTTPError, ValueError):
                continue
        return None

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
        request = self._request(prompt_ids, max_new_tokens)
        if on_tokens is None:
            choice = self.client.completions.create(**request).choices[0]
            return Generation(self._ids(choice))
        tokens: list[int] = []
        with self.client.completions.create(**request, stream=True) as stream:
            for chunk in stream:
                ids = self._ids(chunk.choices[0]) if chunk.choices else []
                tokens += ids
                if ids and not on_tokens(ids):
                    break  # leaving the block closes the stream: the server cancels the decode
        return Generation(tokens)

    def top_logprobs(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[dict[int, float]]]:
        """One non-streamed request asking for ``logprobs=5`` with each token named by its id (vLLM's
        ``return_tokens_as_token_ids``): the tokens and, at each, the five best ids with their log-probabilities."""
        request = self._request(prompt_ids, max_new_tokens, return_tokens_as_token_ids=True)
        choice = self.client.completions.create(**request, logprobs=self.top_logprobs_k).choices[0]
        rows = choice.logprobs.top_logprobs if choice.logprobs else None
        if not rows or not all(key.startswith("token_id:") for row in rows for key in row):
            raise RuntimeError(f"the endpoint at {self.url} did not name its log-probabilities' tokens "
                               "by id (vLLM's return_tokens_as_token_ids): they cannot be compared by id")  # fmt: skip
        return self._ids(choice), [{int(k.removeprefix("token_id:")): lp for k, lp in row.items()} for row in rows]

    def _request(self, prompt_ids: list[int], max_new_tokens: int, **fields: Any) -> dict[str, Any]:
        """A greedy completion of exactly ``max_new_tokens`` tokens returned as ids (vLLM's ``ignore_eos``,
        ``min_tokens`` and ``return_token_ids``), with any more of vLLM's ``fields``."""
        exact = {"ignore_eos": True, "min_tokens": max_new_tokens, "return_token_ids": True, **fields}
        return {"model": self.model_id, "prompt": prompt_ids, "max_tokens": max_new_tokens, "temperature": 0,
                "extra_body": exact}  # fmt: skip

    def _ids(self, choice: Any) -> list[int]:
        """A choice's token ids; a choice that carries text without them cannot be read as ids."""
        ids = choice.model_extra.get("token_ids")
        if ids is None and choice.text:
            raise RuntimeError(f"the endpoint at {self.url} returned text without token_ids: it "
                               "does not take vLLM's return_token_ids: its tokens cannot be read as ids")  # fmt: skip
        return ids or []

    def close(self) -> None:
        super().close()
        self.client.close()

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "model_id": self.model_id, "models": self.models, "version": self.version,
                "api_key_env": self.api_key_env}  # fmt: skip
