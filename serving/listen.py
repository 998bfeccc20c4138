"""An ASGI app served by uvicorn on a thread of its own: what the server and the shim share (no torch here,
so the laptop shim loads none)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

STARTUP_S = 30.0  # how long ``running`` waits for uvicorn to listen


@contextmanager
def running(app: Any, host: str = "127.0.0.1", port: int = 0, *, name: str = "decodebench-http",
            lifespan: str = "off") -> Iterator[str]:  # fmt: skip
    """uvicorn on a thread called ``name`` (port 0: a free one); yields the base URL once it listens."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"{name} did not start on {host}:{port}")
        time.sleep(0.01)
    try:
        yield f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
