"""``python -m serving.shim`` (``make shim``): one local address, ``http://127.0.0.1:8015``, for whichever
server is up — a browser (the server's own chat page at ``/``), any OpenAI client (``/v1``) and the demo MCP
server (``serving.mcp_demo``), as the Rust article's laptop shim.

Every request is passed through to the upstream with httpx: the method, path, query, body and headers
(hop-by-hop ones dropped); the response's status, headers and bytes come back as they arrive, so a
server-sent-events stream is passed chunk by chunk. A client that goes away closes the upstream request,
so the server sees its client go and cancels the decode (streamed or not). ``GET /health`` is the shim's
own: the upstream's address and what its ``/health`` answered (200 when it answers 200, else 503).

The upstream is ``--upstream URL``, or found by a lookup command whose output (its first line) is a URL or
a host (then ``http://HOST:--upstream-port``): ``--queued-resource NAME --zone Z --project P`` looks up the
TPU VM's external IP with gcloud; ``--lookup-cmd CMD`` runs any command (the tests' fake one reads a file).
When the upstream stops accepting connections, the shim looks it up again and retries the request once at
the new address (a new flex-start VM needs no reconfiguration). Nothing of decodebench is imported: the
shim runs on a laptop without torch.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, asynccontextmanager
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from serving import listen

HOST, PORT, UPSTREAM_PORT = "127.0.0.1", 8015, 8000
LOOKUP_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 5.0
DISCONNECT_POLL_S = 0.25

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx and uvicorn set for themselves.
DROPPED = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
           "transfer-encoding", "upgrade", "host", "content-length"}  # fmt: skip


def gcloud_lookup(name: str, zone: str, project: str) -> list[str]:
    """The TPU VM's external IP (its node is named as its queued resource, as scripts/tpu_vm/create.py makes it)."""
    return ["gcloud", "compute", "tpus", "tpu-vm", "describe", name, "--zone", zone, "--project", project,
            "--format", "value(networkEndpoints[0].accessConfig.externalIp)"]  # fmt: skip


class UpstreamLookupError(RuntimeError):
    """The lookup command failed or printed nothing."""


class Upstream:
    """Where requests go: a fixed URL, or the output of a lookup command, looked up again on demand."""

    def __init__(self, url: str | None = None, lookup: list[str] | None = None, port: int = UPSTREAM_PORT,
                 describe: str | None = None, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:  # fmt: skip
        if not url and not lookup:
            raise ValueError("an upstream URL or a lookup command")
        self.url = url.rstrip("/") if url else None
        self.lookup_cmd, self.port, self.timeout_s = lookup, port, timeout_s
        self.describe = describe or (f"lookup: {shlex.join(lookup)}" if lookup else "fixed")
        self.lookups = 0
        self.last_error: str | None = None
        self._lock = asyncio.Lock()

    def _run_lookup(self) -> str:
        assert self.lookup_cmd
        try:
            done = subprocess.run(self.lookup_cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UpstreamLookupError(f"{shlex.join(self.lookup_cmd)}: {exc}") from exc
        first = next((line.strip() for line in done.stdout.splitlines() if line.strip()), "")
        if done.returncode != 0 or not first:
            why = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}, no output"]
            raise UpstreamLookupError(f"{shlex.join(self.lookup_cmd)}: {why[0]}")
        return first.rstrip("/") if "://" in first else f"http://{first}:{self.port}"

    async def lookup(self) -> str:
        """Runs the lookup command (off the event loop, bounded); the new address."""
        self.lookups += 1
        try:
            url = await asyncio.to_thread(self._run_lookup)
        except UpstreamLookupError as exc:
            self.last_error = str(exc)
            raise
        self.url, self.last_error = url, None
        return url

    async def current(self) -> str:
        async with self._lock:
            if self.url is None:
                return await self.lookup()
            return self.url

    async def refresh(self, failed: str) -> str | None:
        """After ``failed`` stopped answering: the address looked up again (once, however many requests
        saw it fail), or None when there is no lookup command or it failed."""
        if not self.lookup_cmd:
            return None
        async with self._lock:
            if self.url != failed:  # another request looked it up already
                return self.url
            try:
                return await self.lookup()
            except UpstreamLookupError:
                return None


def _forwarded(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in DROPPED}


def _error(status: int, message: str, code: str) -> JSONResponse:
    """OpenAI's error shape, so an OpenAI client says what went wrong."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"message": message, "type": kind, "param": None, "code": code}
    return JSONResponse({"error": body}, status_code=status)


def create_shim(upstream: Upstream, read_timeout_s: float = 600.0) -> FastAPI:
    """The shim's app: ``/health`` its own, every other path passed through."""
    timeout = httpx.Timeout(connect=5.0, read=read_timeout_s, write=30.0, pool=30.0)
    client = httpx.AsyncClient(timeout=timeout, follow_redirects=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="decodebench shim", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.upstream, app.state.client = upstream, client

    async def connect(build: Any) -> tuple[str, httpx.Response]:
        """``build(url)`` sent to the upstream, looked up again and retried once if it refuses to connect."""
        url = await upstream.current()
        try:
            return url, await client.send(build(url), stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            fresh = await upstream.refresh(url)
            if fresh is None:
                raise
            return fresh, await client.send(build(fresh), stream=True)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        local = str(request.base_url).rstrip("/")
        out: dict[str, Any] = {"shim": local, "upstream": None, "upstream_health": None, "lookup": upstream.describe,
                               "lookups": upstream.lookups}  # fmt: skip
        try:
            url, response = await connect(lambda u: client.build_request("GET", f"{u}/health",
                                                                        timeout=HEALTH_TIMEOUT_S))  # fmt: skip
            try:
                body = await response.aread()
            finally:
                await response.aclose()
            out.update(upstream=url, upstream_health=response.status_code)
            try:
                out["upstream_body"] = response.json() if body else None
            except ValueError:
                out["upstream_body"] = body.decode(errors="replace")[:200]
        except (httpx.HTTPError, UpstreamLookupError) as exc:
            out.update(upstream=upstream.url, error=f"{type(exc).__name__}: {exc}")
        out["lookups"], out["lookup_error"] = upstream.lookups, upstream.last_error
        out["status"] = "ok" if out["upstream_health"] == 200 else "upstream_down"
        return JSONResponse(out, status_code=200 if out["status"] == "ok" else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def passthrough(path: str, request: Request) -> Response:
        body = await request.body()  # read before watching for a disconnect (that reads the same channel)
        headers = _forwarded(request.headers)
        sent = request.scope.get("raw_path") or f"/{path}".encode()  # the path as the client sent it, still %-encoded

        def build(url: str) -> httpx.Request:
            return client.build_request(request.method, f"{url}{sent.decode('latin-1')}", params=request.query_params,
                                        headers=headers, content=body)  # fmt: skip

        async def gone() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        # A non-streamed reply's headers come only once the decode is done: wait for them, and for the client.
        sending, watching = asyncio.ensure_future(connect(build)), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
        if not sending.done():  # the client left first: dropping the request closes its connection upstream
            sending.cancel()
            return Response(status_code=499)
        try:
            _, upstream_response = sending.result()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            return _error(502, f"the upstream {upstream.url} does not answer ({exc}); {upstream.describe}",
                          "upstream_unreachable")  # fmt: skip
        except UpstreamLookupError as exc:
            return _error(502, f"no upstream: {exc}", "upstream_lookup_failed")
        except httpx.InvalidURL as exc:  # a path no URL can carry: the client's request, not the upstream
            return _error(400, f"{request.method} {path!r}: not a path this shim can forward ({exc})", "invalid_path")
        except httpx.HTTPError as exc:
            return _error(502, f"the upstream {upstream.url} failed: {type(exc).__name__}: {exc}", "upstream_error")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream_response.aiter_raw():
                    yield chunk
            finally:  # the client went away, or the stream ended: close upstream (shielded from the cancel)
                with anyio.CancelScope(shield=True):
                    await upstream_response.aclose()

        return StreamingResponse(chunks(), status_code=upstream_response.status_code,
                                 headers=_forwarded(upstream_response.headers),
                                 background=BackgroundTask(upstream_response.aclose))  # fmt: skip

    return app


def running(app: FastAPI, host: str = HOST, port: int = 0) -> AbstractContextManager[str]:
    """The shim on a thread of its own (port 0: a free one), its lifespan on; yields the base URL."""
    return listen.running(app, host, port, name="decodebench-shim", lifespan="on")


def upstream_from(args: argparse.Namespace) -> Upstream:
    if args.upstream:
        return Upstream(url=args.upstream)
    if args.lookup_cmd:
        return Upstream(lookup=shlex.split(args.lookup_cmd), port=args.upstream_port)
    describe = f"queued resource {args.queued_resource} in {args.zone}, project {args.project}"
    return Upstream(lookup=gcloud_lookup(args.queued_resource, args.zone, args.project), port=args.upstream_port,
                    describe=describe)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--upstream", help="the server's base URL, e.g. http://127.0.0.1:8000")
    where.add_argument("--lookup-cmd", help="a command that prints the server's URL or host")
    where.add_argument("--queued-resource", help="the TPU VM's queued resource (its address from gcloud)")
    parser.add_argument("--zone", default="us-west4-a")
    parser.add_argument("--project", help="the cloud project (with --queued-resource)")
    parser.add_argument("--upstream-port", type=int, default=UPSTREAM_PORT, help="when the lookup prints a host")
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, default=PORT, help="0: a free one")
    parser.add_argument("--read-timeout", type=float, default=600.0, help="seconds an upstream may stay silent")
    args = parser.parse_args(argv)
    if args.queued_resource and not args.project:
        parser.error("--queued-resource needs --project")
    upstream = upstream_from(args)
    try:
        url = asyncio.run(upstream.current())
    except UpstreamLookupError as exc:
        url = f"not found yet ({exc})"
    with running(create_shim(upstream, args.read_timeout), args.host, args.port) as local:
        print(f"decodebench shim at {local}/v1 (chat page: {local}/) -> {url}; {upstream.describe}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("decodebench shim: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
