"""An OpenAI-compatible server over any decodebench engine (``serve.py`` runs it from the command line;
``experiment=serve`` measures through it):

* ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed (server-sent events) or not.
  Decoding is greedy (sampling fields are accepted and ignored); ``max_tokens`` (default: what the
  cache holds after the prompt); generation stops at the checkpoint's EOS ids; chat prompts go
  through the checkpoint's chat template. Every response carries a ``decodebench`` extension field
  (``worker.Finished.extension``): the engine's own ``read_s`` and ``decode_s`` for this request,
  ``engine_tokens``, ``engine_tok_s`` = (engine_tokens - 1) / decode_s, ``queue_s`` and ``finish``;
  a stream carries it on its last chunk, and each token chunk its batch's token count (``tokens``).
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /v1/engine`` (what
  is loaded and how, as of the warm-up), ``GET /`` (a chat page: replies stream, Stop cancels).

Bad input (malformed JSON, an empty message list, ``max_tokens`` < 1, a prompt that does not fit the
cache, an unknown model) gets a 4xx with an OpenAI-shaped error body and the server keeps serving.
The engine is owned by the thread that built it (``serving.worker``); uvicorn and the event loop
run on a thread of their own and never call the model. A client that goes away mid-stream cancels
its decode at the engine's next batch.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from decodebench.environment import capture
from decodebench.prompts import chat_ids, text_ids
from engines.open import OpenEngine
from serving.worker import EngineWorker, Finished, Job

CHAT_PAGE = Path(__file__).resolve().parent / "chat.html"
STARTUP_S = 30.0  # how long ``running`` waits for uvicorn to listen


class APIError(Exception):
    """A request the server refuses, as OpenAI shapes it: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Common(BaseModel):
    """Fields both endpoints read; sampling fields (temperature, top_p, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(Common):
    prompt: str = Field(min_length=1)


@dataclass
class Served:
    """What the HTTP side knows of the engine: read on the engine's thread once, after the warm-up."""

    model_id: str
    tokenizer: PreTrainedTokenizerBase
    eos_ids: list[int]
    context: int
    info: dict[str, Any]  # the /v1/engine document
    fingerprint: str


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
                  f"decodebench-{opened.name}-greedy")  # fmt: skip


class Detokenizer:
    """Text deltas for a growing list of ids (EOS dropped); holds back a half-decoded character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: list[int]) -> None:
        self.tokenizer, self.eos = tokenizer, set(eos_ids)
        self.ids: list[int] = []
        self.text = ""

    def push(self, batch: list[int]) -> str:
        self.ids += [t for t in batch if t not in self.eos]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.text) :] if text.startswith(self.text) else text
        self.text = text
        return delta


def create_app(served: Served, worker: EngineWorker, opened: OpenEngine) -> FastAPI:
    """The FastAPI app; ``opened`` is read only for its fit rule (pure Python), its engine never called."""
    app = FastAPI(title="decodebench", docs_url=None, redoc_url=None)
    metrics = worker.metrics
    app.state.served, app.state.worker = served, worker

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.rejected.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            error = APIError(400, f"the body is not valid JSON: {first.get('msg')}", code="invalid_json")
        else:
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            error = APIError(400, f"{where}: {first.get('msg')}", param=where or None, code="invalid_value")
        metrics.rejected.labels("400").inc()
        return error.response()

    def admit(model: str, ids: list[int], max_tokens: int | None) -> int:
        """The model name and the fit rule; returns the token budget."""
        if model != served.model_id:
            raise APIError(404, f"model {model!r} does not exist; this server serves {served.model_id!r}",
                           param="model", code="model_not_found")  # fmt: skip
        room = served.context - len(ids)
        budget = max(room, 1) if max_tokens is None else max_tokens
        misfit = opened.misfit(len(ids), budget, "max_tokens")
        if misfit:
            param = "messages" if room < 1 else "max_tokens"
            raise APIError(400, misfit.reason, param=param, code="context_length_exceeded")
        return budget

    async def events(job: Job, request: Request) -> AsyncIterator[list[int] | Finished]:
        """The job's events until its record; a client gone while waiting cancels the decode."""
        while True:
            get = asyncio.ensure_future(job.events.get())
            try:
                while not (await asyncio.wait({get}, timeout=0.25))[0]:  # the same get, never a lost event
                    if await request.is_disconnected():
                        job.cancel.set()
            finally:
                get.cancel()  # a no-op once done; when this generator is cancelled, the pending get goes
            event = get.result()
            yield event
            if isinstance(event, Finished):
                return

    def head(kind: str, job: Job) -> dict[str, Any]:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return {"id": f"{prefix}-{job.id}", "created": int(time.time()), "model": served.model_id,
                "system_fingerprint": served.fingerprint}  # fmt: skip

    def usage(record: Finished) -> dict[str, int]:
        total = record.prompt_tokens + record.completion_tokens
        return {"prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
                "total_tokens": total}  # fmt: skip

    def choice(kind: str, text: str, finish: str | None, final: bool) -> dict[str, Any]:
        if kind == "chat":
            body = {"message": {"role": "assistant", "content": text}} if final else {"delta": {"content": text}}
        else:
            body = {"text": text}
        return {"index": 0, **body, "finish_reason": finish, "logprobs": None}

    async def complete(kind: str, request: Request, ids: list[int], budget: int, stream: bool,
                       include_usage: bool) -> Response:  # fmt: skip
        job = Job(ids, budget, kind, asyncio.get_running_loop())
        worker.submit(job)
        detok = Detokenizer(served.tokenizer, served.eos_ids)
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if not stream:
            record: Finished | None = None
            try:
                async for event in events(job, request):
                    if isinstance(event, Finished):
                        record = event
                    else:
                        detok.push(event)
            finally:
                if record is None:
                    job.cancel.set()
            if record.finish == "error":
                raise APIError(500, f"the engine failed: {record.error}", code="engine_error")
            return JSONResponse({**head(kind, job), "object": obj,
                                 "choices": [choice(kind, detok.text, record.finish, final=True)],
                                 "usage": usage(record), "decodebench": record.extension()})  # fmt: skip

        def sse(data: dict[str, Any]) -> str:
            return f"data: {json.dumps(data)}\n\n"

        async def chunks() -> AsyncIterator[str]:
            obj_chunk = "chat.completion.chunk" if kind == "chat" else "text_completion"
            done = False
            try:
                if kind == "chat":
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield sse({**head(kind, job), "object": obj_chunk, "choices": [first]})
                async for event in events(job, request):
                    if isinstance(event, Finished):
                        final = {**head(kind, job), "object": obj_chunk, "decodebench": event.extension(),
                                 "choices": [choice(kind, "", event.finish, final=False)]}  # fmt: skip
                        if event.finish == "error":
                            final["error"] = {"message": event.error, "type": "server_error"}
                        yield sse(final)
                        if include_usage:
                            yield sse({**head(kind, job), "object": obj_chunk, "choices": [], "usage": usage(event)})
                        yield "data: [DONE]\n\n"
                        done = True
                    else:  # one chunk per batch the engine read, with its token count
                        yield sse({**head(kind, job), "object": obj_chunk, "decodebench": {"tokens": len(event)},
                                   "choices": [choice(kind, detok.push(event), None, final=False)]})  # fmt: skip
            finally:
                if not done:  # the client went away (or the server stops): cancel at the next batch
                    job.cancel.set()

        return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        ids = chat_ids(served.tokenizer, [m.model_dump() for m in body.messages])
        budget = admit(body.model, ids, body.max_completion_tokens or body.max_tokens)
        include = bool(body.stream_options and body.stream_options.include_usage)
        return await complete("chat", request, ids, budget, body.stream, include)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ids = text_ids(served.tokenizer, body.prompt)
        budget = admit(body.model, ids, body.max_tokens)
        include = bool(body.stream_options and body.stream_options.include_usage)
        return await complete("text", request, ids, budget, body.stream, include)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": 0,
                                            "owned_by": "decodebench"}]}  # fmt: skip

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


@contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """uvicorn on a thread of its own (port 0: a free one); yields the base URL once it listens."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="decodebench-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = sock.getsockname()[1]
    try:
        yield f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
