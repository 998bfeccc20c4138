"""``python await_server.py --log serve.out [--pid N] [--timeout S]``: the boot's ``serving`` stage waits here
until the server it started answers ``/health``, then prints one JSON line with what ``/v1/engine`` says:
the address, the engine, the model, and the server's own load and warm-up seconds (the Rust article's 6.8 s
and 18.8 s).

The address comes from the server's own line in its log (``decodebench serving ... at http://HOST:PORT/v1``,
so ``serve.port=0`` works); a wildcard host is asked on 127.0.0.1. With ``--pid`` a server that exits
before it answers ends the wait at once, with the end of its log. Standard library only; every wait is
bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVING = re.compile(r"decodebench serving .* at (?P<url>https?://\S+)/v1")
POLL_S = 0.5


def address(log: Path) -> str | None:
    """The last address the server printed (a restarted server prints a new one)."""
    if not log.exists():
        return None
    found = SERVING.findall(log.read_text(errors="replace"))
    if not found:
        return None
    return found[-1].replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://127.0.0.1:")


def get(url: str, timeout_s: float = 5.0) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.status, json.loads(response.read())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")  # a zombie has exited
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z")


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def wait(log: Path, pid: int | None, timeout_s: float) -> dict:
    started = time.monotonic()
    deadline = started + timeout_s
    last_error = "the server has not printed its address yet"
    while time.monotonic() < deadline:
        if pid is not None and not alive(pid):
            raise RuntimeError(f"the server (pid {pid}) exited before it answered /health; its log:\n{tail(log)}")
        url = address(log)
        if url:
            try:
                status, health = get(f"{url}/health")
                if status == 200:
                    _, info = get(f"{url}/v1/engine")
                    return {"url": url, "health": health, "waited_s": round(time.monotonic() - started, 3),
                            "engine": info.get("engine"), "model": info.get("model"),
                            "device": info.get("device", {}).get("kind"), "context": info.get("context"),
                            "load_s": rounded(info.get("load_s")),
                            "warmup_s": rounded(info.get("warmup_s"))}  # fmt: skip
                last_error = f"/health answered {status}"
            except (OSError, urllib.error.URLError, ValueError) as exc:
                last_error = f"{url}/health: {exc}"
        time.sleep(POLL_S)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s ({last_error}); its log:\n"
                       f"{tail(log)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, required=True, help="the server's output")
    parser.add_argument("--pid", type=int, default=None, help="the server's process, when it is our child")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(wait(args.log, args.pid, args.timeout)))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
