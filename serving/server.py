"""An OpenAI-compatible server over any decodebench engine (``serve.py`` runs it from the command line;
``experiment=serve`` measures through it):

* ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed (server-sent events) or not,
  each field taken as OpenAI documents it, accepted at the one value that describes greedy decoding,
  or refused by name (``serving.api``). ``max_tokens`` defaults to what the cache holds after the
  prompt; a reply ends at the checkpoint's EOS ids and at ``stop`` strings (``serving.text``); chat
  prompts go through the checkpoint's chat template; several completion prompts give one choice each,
  in order. Every response carries a ``decodebench`` extension field (``worker.Finished.extension``):
  the engine's own ``read_s`` and ``decode_s`` for this request, ``engine_tokens``, ``engine_tok_s`` =
  (engine_tokens - 1) / decode_s, ``queue_s`` and ``finish`` (several prompts: one such record each
  under ``prompts``), ``ignored`` (fields accepted without effect) and ``notes``; a stream carries it
  on each choice's last chunk, and each token chunk its batch's token count (``tokens``).
* ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text),
  ``GET /v1/engine`` (what is loaded and how, as of the warm-up), ``GET /`` (a chat page: replies
  stream, Stop cancels).

Bad input (malformed JSON, a refused or unknown field, a prompt that does not fit the cache, an
unknown model or route, a body over ``serve.max_body_bytes``, a full queue: ``serve.max_queue``) gets
a 4xx with an OpenAI-shaped error body naming the field, and the server keeps serving. The engine is
owned by the thread that built it (``serving.worker``); uvicorn and the event loop run on a thread of
their own and never call the model, and tokenizing and detokenizing run off the event loop
(``asyncio.to_thread``). A client that goes away, streamed or not, cancels its decode at the engine's
next batch.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from decodebench.config import ServeConfig
from decodebench.environment import capture
from decodebench.prompts import chat_ids, template_names, text_ids
from engines import ENGINES
from engines.open import OpenEngine
from serving.api import ChatRequest, CompletionRequest, where
from serving.listen import running
from serving.text import StopRule, TextStream, TokenText, whole_text
from serving.worker import EngineWorker, Finished, Job

__all__ = ["create_app", "describe_engine", "running"]  # running: re-exported, callers start the app with it

CHAT_PAGE = Path(__file__).resolve().parent / "chat.html"
RECENT = 16  # decodes the Retry-After estimate looks back on
Body = ChatRequest | CompletionRequest


class APIError(HTTPException):
    """A request the server refuses, as OpenAI shapes it: ``{"error": {message, type, param, code}}``.
    An HTTPException, so FastAPI passes it on from where it reads the body (the body limit raises it there)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(status, message, headers)
        self.message, self.param, self.code = message, param, code

    def response(self) -> JSONResponse:
        status = self.status_code
        kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=status, headers=self.headers)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused (413) as it is read, on its
    declared Content-Length or, sent in chunks, on the bytes that came."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = int(dict(scope["headers"]).get(b"content-length", 0))
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if max(declared, received) > self.limit:
                raise APIError(413, f"the request body is over serve.max_body_bytes={self.limit} bytes",
                               code="request_too_large")  # fmt: skip
            return message

        await self.app(scope, limited, send)


@dataclass
class Served:
    """What the HTTP side knows of the engine: read on the engine's thread once, after the warm-up."""

    model_id: str
    tokenizer: PreTrainedTokenizerBase
    eos_ids: list[int]
    context: int
    info: dict[str, Any]  # the /v1/engine document
    fingerprint: str
    vocab_size: int  # token ids a prompt may hold: [0, vocab_size)
    developer_role: bool  # the chat template names a developer role (else developer turns are read as system)


def describe_engine(
    opened: OpenEngine, model_id: str, load_s: float | None, warmup_s: float | None, read_every: int
) -> Served:
    """What the server says of its loaded engine; called on the engine's own thread (``describe`` may
    touch an unsendable engine)."""
    engine, device = opened.load(), opened.ctx.device
    env = capture(device)
    info = {
        "engine": opened.name,
        "engine_class": f"{type(engine).__name__}, owned by thread {threading.current_thread().name}",
        "model": model_id,
        "checkpoint": opened.checkpoint.provenance,
        "device": {"kind": device.kind, "name": device.name},
        "versions": {"python": env["python"], "rustc": env["rustc"], **env["packages"]},
        "load_s": load_s,
        "warmup_s": warmup_s,
        "context": opened.ctx.context,
        "read_every": read_every,
        "eos_ids": opened.eos_ids,
        "decoding": "greedy",
        "layout": engine.describe(),
    }
    return Served(model_id, opened.tokenizer, opened.eos_ids, opened.ctx.context, info,
                  f"decodebench-{opened.name}-greedy", opened.checkpoint.config.vocab_size,
                  template_names(opened.tokenizer, "developer"))  # fmt: skip


@dataclass
class Reply:
    """One prompt's decode as the HTTP side follows it: its job, its text, the prompt it echoes (text
    and each token's offset in it; empty without echo) and, once it comes, the worker's record."""

    index: int
    job: Job
    text: TextStream
    echo: str = ""
    echo_offsets: list[int] = field(default_factory=list)
    record: Finished | None = None

    async def batches(self) -> AsyncIterator[tuple[str, list[int]]]:
        """Per batch the engine read: the text a client may see now (decoded off the event loop) and the
        batch's token ids; ``record`` is set once the job's last event comes."""
        while not isinstance(event := await self.job.events.get(), Finished):
            yield await asyncio.to_thread(self.text.feed, event), list(event)
        self.record = event


@asynccontextmanager
async def watching(request: Request, jobs: list[Job]) -> AsyncIterator[None]:
    """While the block runs, a task awaits starlette's ``http.disconnect``: the client going away
    cancels every job at its engine's next batch, at once, streamed or not (nothing polled). Leaving
    the block cancels any job not finished (a no-op for the others)."""

    def cancel() -> None:
        for job in jobs:
            job.cancel.set()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel()

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        cancel()


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def create_app(
    served: Served, worker: EngineWorker, opened: OpenEngine, settings: ServeConfig | None = None
) -> FastAPI:
    """The FastAPI app; ``opened`` is read only for its fit rule and engine class (pure Python), its engine
    never called; ``settings``: the body limit and the queue bound (``serve.*``; the defaults when None)."""
    settings = settings or ServeConfig()
    app = FastAPI(title="decodebench", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    metrics, tokens = worker.metrics, TokenText(served.tokenizer)
    scorers = [name for name, cls in ENGINES.items() if cls.scores_prompt]
    app.state.served, app.state.worker = served, worker

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Every refusal, ours or starlette's (an unknown route, a wrong method), OpenAI-shaped and counted."""
        if not isinstance(exc, APIError):
            code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
            exc = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code,
                           headers=exc.headers)  # fmt: skip
        metrics.rejected.labels(str(exc.status_code)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": (), "type": ""}
        kind, name = first.get("type"), where(tuple(first.get("loc", ())))
        if kind == "json_invalid":
            detail = first.get("ctx", {}).get("error", first.get("msg"))
            error = APIError(400, f"the body is not valid JSON: {detail}", code="invalid_json")
        elif kind == "extra_forbidden":
            error = APIError(400, f"{name}: unrecognized field: this server refuses what it does not implement "
                             "rather than ignore it", param=name, code="unrecognized_field")  # fmt: skip
        else:
            code = "unsupported_value" if kind == "unsupported" else "invalid_value"
            message = f"{name}: {first.get('msg')}" if name else str(first.get("msg"))
            error = APIError(400, message, param=name or None, code=code)
        return await http_error(request, error)

    def check_model(model: str) -> None:
        if model != served.model_id:
            raise APIError(404, f"model {model!r} does not exist; this server serves {served.model_id!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def retry_after() -> int:
        """Seconds until the engine likely takes another job: its recent decodes' median, rounded up."""
        recent = [r.ended - r.started for r in list(worker.records)[-RECENT:]]
        return max(1, math.ceil(statistics.median(recent))) if recent else 1

    def admit(kind: str, body: Body, prompts: list[list[int]], score_prompt: bool) -> list[Job]:
        """Each prompt held to the fit rule and ``min_tokens``, then room in the queue for all: the jobs."""
        rule = StopRule(frozenset(served.eos_ids), tuple(body.stop or ()), body.min_tokens, body.ignore_eos)
        loop, jobs = asyncio.get_running_loop(), []
        for ids in prompts:
            room = served.context - len(ids)
            budget = max(room, 1) if body.budget is None else body.budget
            misfit = opened.misfit(len(ids), budget, "max_tokens")
            if misfit:
                param = ("messages" if kind == "chat" else "prompt") if room < 1 else "max_tokens"
                raise APIError(400, misfit.reason, param=param, code="context_length_exceeded")
            if body.min_tokens > budget:
                raise APIError(400, f"min_tokens={body.min_tokens} is more than the {budget} tokens this reply may "
                               "have (max_tokens, or what the cache holds after the prompt)", param="min_tokens",
                               code="invalid_value")  # fmt: skip
            jobs.append(Job(ids, budget, kind, loop, rule, body.top_k, score_prompt, stream=body.stream))
        waiting = worker.jobs.qsize()
        after = waiting + len(jobs) - worker.free_rows()  # a free engine (or row of a batch) takes a job at once
        if after > settings.max_queue:
            raise APIError(429, f"{waiting} requests wait for the engine and this one would make {after} wait: "
                           f"serve.max_queue={settings.max_queue}; retry later", code="queue_full",
                           headers={"Retry-After": str(retry_after())})  # fmt: skip
        return jobs

    def head(kind: str, job: Job) -> dict[str, Any]:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return {"id": f"{prefix}-{job.id}", "created": int(time.time()), "model": served.model_id,
                "system_fingerprint": served.fingerprint}  # fmt: skip

    def counted(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage(records: list[Finished]) -> dict[str, int]:
        return counted(sum(r.prompt_tokens for r in records), sum(r.completion_tokens for r in records))

    def logprobs(kind: str, reply: Reply, as_ids: bool) -> dict[str, Any] | None:
        """The reply's log-probabilities in its endpoint's shape (None: not asked, or no decode to score);
        ``as_ids``: each token named by its id (``return_tokens_as_token_ids``)."""
        record = reply.record
        if record.scores is None:
            return None
        if kind == "chat":
            return tokens.chat(record.scores, as_ids)
        unscored, scores, offsets = [], record.scores, reply.text.offsets
        if record.prompt_scores is not None:  # echo: the prompt's first token, the rest of it, then the reply
            unscored, scores = reply.job.prompt_ids[:1], record.prompt_scores + scores
            offsets = reply.echo_offsets + [len(reply.echo) + o for o in offsets]
        return tokens.completion(unscored, scores, offsets, as_ids)

    def choice(kind: str, index: int, text: str, finish: str | None, scored: dict[str, Any] | None,
               final: bool, ids: list[int] | None = None) -> dict[str, Any]:  # fmt: skip
        if kind == "chat":
            body = {"message": {"role": "assistant", "content": text}} if final else {"delta": {"content": text}}
        else:
            body = {"text": text}
        return {"index": index, **body, "finish_reason": finish, "logprobs": scored,
                **({"token_ids": ids} if ids is not None else {})}  # fmt: skip

    async def complete(kind: str, request: Request, body: Body, prompts: list[list[int]], notes: dict[str, str],
                       echoes: list[tuple[str, list[int]]] | None = None) -> Response:  # fmt: skip
        """The prompts' jobs queued, followed and answered: one JSON response, or a stream of chunks."""
        jobs = admit(kind, body, prompts, score_prompt=echoes is not None and body.top_k is not None)
        replies = [Reply(i, job, TextStream(served.tokenizer, job.rule), *(echoes[i] if echoes else ()))
                   for i, job in enumerate(jobs)]  # fmt: skip
        for job in jobs:
            worker.submit(job)
        extra = {"ignored": body.ignored(), "notes": notes}
        if not body.stream:
            async with watching(request, jobs):
                for reply in replies:
                    async for _ in reply.batches():
                        pass
            records = [reply.record for reply in replies]
            failed = next((r for r in records if r.finish == "error"), None)
            if failed:
                raise APIError(500, f"the engine failed: {failed.error}", code="engine_error")
            timers = records[0].extension() if len(records) == 1 else {"prompts": [r.extension() for r in records]}
            choices = [choice(kind, r.index, r.echo + r.text.reply, r.record.finish,
                              await asyncio.to_thread(logprobs, kind, r, body.return_tokens_as_token_ids), final=True,
                              ids=r.text.tokens if body.return_token_ids else None) for r in replies]  # fmt: skip
            return JSONResponse({**head(kind, jobs[0]), "object": "chat.completion" if kind == "chat" else
                                 "text_completion", "choices": choices, "usage": usage(records),
                                 "decodebench": {**timers, **extra}})  # fmt: skip

        def so_far(reply: Reply) -> dict[str, Any]:
            """A chunk's ``usage`` with ``continuous_usage_stats``: its reply's prompt and the tokens sent so far."""
            return {"usage": counted(len(reply.job.prompt_ids), reply.text.count)} if body.continuous_usage else {}

        async def chunks() -> AsyncIterator[str]:
            top = {**head(kind, jobs[0]), "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
            async with watching(request, jobs):
                if kind == "chat":
                    yield sse({**top, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "finish_reason": None}], **so_far(replies[0])})  # fmt: skip
                for reply in replies:
                    if reply.echo:  # the prompt, before any token
                        yield sse({**top, "decodebench": {"tokens": 0}, **so_far(reply),
                                   "choices": [choice(kind, reply.index, reply.echo, None, None, False)]})  # fmt: skip
                    async for delta, batch in reply.batches():  # one chunk per batch the engine read
                        ids = batch if body.return_token_ids else None
                        yield sse({**top, "decodebench": {"tokens": len(batch)}, **so_far(reply),
                                   "choices": [choice(kind, reply.index, delta, None, None, False, ids)]})  # fmt: skip
                    record = reply.record
                    scored = await asyncio.to_thread(logprobs, kind, reply, body.return_tokens_as_token_ids)
                    last = choice(kind, reply.index, reply.text.visible(final=True), record.finish, scored, False)
                    final = {**top, "decodebench": {**record.extension(), **extra}, "choices": [last], **so_far(reply)}
                    if record.finish == "error":
                        final["error"] = {"message": record.error, "type": "server_error"}
                    yield sse(final)
                if body.include_usage:
                    yield sse({**top, "choices": [], "usage": usage([reply.record for reply in replies])})
                yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        notes = body.notes()
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        if not served.developer_role and any(m["role"] == "developer" for m in messages):
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
            notes["developer"] = "the chat template names no developer role: developer messages were read as system"
        ids = await asyncio.to_thread(chat_ids, served.tokenizer, messages)
        return await complete("chat", request, body, [ids], notes)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if body.echo and body.logprobs is not None and not opened.cls.scores_prompt:
            raise APIError(400, f"echo with logprobs needs the prompt's log-probabilities, and engine {opened.name} "
                           "cannot read a prompt's logits at every position (engines that can: "
                           f"{', '.join(scorers)}); ask for echo or logprobs alone", param="echo",
                           code="unsupported_value")  # fmt: skip
        for i, prompt in enumerate(body.prompt):
            outside = [t for t in prompt if not 0 <= t < served.vocab_size] if isinstance(prompt, list) else []
            if outside:
                raise APIError(400, f"prompt[{i}]: token ids {outside[:5]} are outside the vocabulary "
                               f"[0, {served.vocab_size})", param=f"prompt[{i}]", code="invalid_value")  # fmt: skip

        def encode() -> tuple[list[list[int]], list[tuple[str, list[int]]] | None]:
            """Each prompt's ids (token ids as given; text as BOS + its tokens) and, with echo, its text."""
            prompts = [p if isinstance(p, list) else text_ids(served.tokenizer, p) for p in body.prompt]
            echoes = [whole_text(served.tokenizer, served.eos_ids, ids) for ids in prompts] if body.echo else None
            return prompts, echoes

        prompts, echoes = await asyncio.to_thread(encode)
        return await complete("text", request, body, prompts, body.notes(), echoes)

    def card() -> dict[str, Any]:
        return {"id": served.model_id, "object": "model", "created": 0, "owned_by": "decodebench"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return card()

    @app.get("/v1/engine")
    async def engine_info() -> dict[str, Any]:
        return {**served.info, "owner_thread": worker.owner}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "engine": served.info["engine"], "model": served.model_id, "busy": worker.busy,
                "idle": worker.idle(), "queue_depth": worker.jobs.qsize()}  # fmt: skip

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        return CHAT_PAGE.read_text()

    return app
