"""A server started in a process group of its own, under a guard, and stopped with everything it started.

``ServerGroup.start`` runs this file as a guard process (``python process_group.py PARENT -- ARGV``, by path,
so it imports nothing but the standard library) in a new session: its process group holds the guard, the
server and every process the server starts. The guard

* is a child subreaper: a server's orphaned workers are re-parented to it and reaped, so their CPU seconds
  reach the caller's own children's seconds when the caller waits for the guard (a cell counts them as its
  own work, not contention);
* watches its parent: when the caller dies (``kill -9`` of a cell included), it stops the whole group, SIGTERM
  then SIGKILL after a bound, so no server process outlives its caller;
* exits with the server's exit status once the server and all of its descendants are gone.

``ServerGroup.stop`` sends SIGTERM to the group, SIGKILL after ``stop_s`` seconds, waits for the guard, and
kills anything of the group still there. Readiness is an HTTP URL answering 200 within a stated time; a server
that exits first fails with the tail of its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
POLL_S = 0.25
STOP_S = 30.0  # a server's time to stop after SIGTERM before the group gets SIGKILL
LOG_TAIL_LINES = 40


class ServerFailed(RuntimeError):
    """A server that did not come up, or went away while in use; the message ends with its log's tail."""


GONE_S = 5.0  # how long a group signalled to end may take to leave /proc (a killed process exits, then is reaped)


def members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (from /proc), oldest first."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # field 5 (pgrp); a zombie holds no memory and runs nothing
            found.append(int(stat.parent.name))
    return sorted(found)


def members_after(pgid: int, seconds: float) -> list[int]:
    """The processes of group ``pgid`` still there after waiting up to ``seconds`` for it to empty: a process sent
    SIGKILL is still listed (exiting) for a moment after its parent's wait returns."""
    deadline = time.monotonic() + seconds
    while (left := members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def status_bytes(pid: int, key: str) -> int | None:
    """A ``kB`` line of /proc/<pid>/status (``VmHWM``: peak resident set, ``VmRSS``: resident now), in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ServerGroup:
    """One server under a guard in a process group of its own; its log goes to ``log``.

    ``name``: what the messages call it; ``argv`` / ``env``: the server's command and its whole environment.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.guard: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self.stopped_by: str | None = None
        self._server_pid: int | None = None

    @property
    def pgid(self) -> int:
        assert self.guard is not None, "the server was not started"
        return self.guard.pid

    def start(self, ready_url: str, timeout_s: float) -> float:
        """Starts the server and waits until ``ready_url`` answers 200; the seconds that took. A server that
        exits first, or is not ready within ``timeout_s``, is stopped and raises ``ServerFailed``."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        guard = [sys.executable, __file__, str(os.getpid()), "--", *self.argv]
        began = time.monotonic()
        with self.log.open("wb") as out:
            self.guard = subprocess.Popen(guard, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          env=self.env, start_new_session=True)  # fmt: skip
        try:
            while not answers(ready_url):
                self.check()
                if time.monotonic() - began > timeout_s:
                    raise ServerFailed(self.explain(f"was not ready at {ready_url} within {timeout_s:g} s"))
                time.sleep(POLL_S)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        _ = self.server_pid  # known from now on, so that check() sees it go
        return self.startup_s

    def check(self, grace_s: float = 0.0) -> None:
        """Raises ``ServerFailed`` (with its log's tail) when the server has exited: the guard has, or the server's
        own process is gone while the guard still stops what it left. ``grace_s``: how long to look for that
        (a request that failed may have seen the server's sockets close before its process is seen to end)."""
        end = time.monotonic() + grace_s
        while self.guard is None or (self.guard.poll() is None and (self.server_pid is None or alive(self.server_pid))):
            if self.guard is None or time.monotonic() >= end:
                return
            time.sleep(POLL_S / 5)
        try:  # the server is gone: its status once the guard has reaped what it left (a moment, unless they linger)
            status = self.guard.wait(timeout=2 * POLL_S + 1)
        except subprocess.TimeoutExpired:
            raise ServerFailed(self.explain(f"lost its server process (pid {self.server_pid})")) from None
        raise ServerFailed(self.explain(f"exited with status {status}"))

    @property
    def server_pid(self) -> int | None:
        """The server's own process: the guard's first child (None before it is started)."""
        if self._server_pid is None and self.guard is not None:
            children = Path(f"/proc/{self.guard.pid}/task/{self.guard.pid}/children")
            try:
                self._server_pid = int(children.read_text().split()[0])
            except (OSError, IndexError, ValueError):
                return None
        return self._server_pid

    def explain(self, what: str) -> str:
        return f"{self.name} {what}; the last lines of its log ({self.log}):\n{tail(self.log)}"

    def memory(self) -> dict[str, Any]:
        """Each live process of the group with its peak and current resident set (bytes), and their sums: the
        sum of peaks bounds the group's simultaneous peak from above (each process peaked at its own time)."""
        if self.guard is None:
            return {"processes": []}
        rows = [{"pid": pid, "name": process_name(pid), "peak_rss_bytes": status_bytes(pid, "VmHWM"),
                 "rss_bytes": status_bytes(pid, "VmRSS")} for pid in members(self.pgid)]  # fmt: skip
        return {"processes": rows, "peak_rss_bytes_sum": sum(r["peak_rss_bytes"] or 0 for r in rows),
                "rss_bytes_sum": sum(r["rss_bytes"] or 0 for r in rows)}  # fmt: skip

    def stop(self, stop_s: float = STOP_S) -> list[int]:
        """SIGTERM to the whole group, SIGKILL after ``stop_s`` seconds, the guard waited for; the pids that were
        still in the group ``GONE_S`` seconds after that and were killed (none when the server stops as asked).
        Returns once the group has left /proc (or ``GONE_S`` more seconds have passed)."""
        if self.guard is None or self.stopped_by is not None:
            return []
        self.stopped_by = "exited" if self.guard.poll() is not None else "SIGTERM"
        signal_group(self.pgid, signal.SIGTERM)
        try:
            self.guard.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            self.stopped_by = "SIGKILL"
            signal_group(self.pgid, signal.SIGKILL)
            self.guard.wait()
        left = members_after(self.pgid, GONE_S)
        for pid in left:
            kill(pid, signal.SIGKILL)
        members_after(self.pgid, GONE_S)
        return left


def answers(url: str) -> bool:
    """``url`` answers 200 (within a couple of seconds)."""
    try:
        with urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (URLError, OSError, ValueError):
        return False


def alive(pid: int) -> bool:
    """``pid`` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def reap_all() -> list[tuple[int, int]]:
    """Every exited child reaped without blocking: (pid, wait status) each."""
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, status))


def guard(parent: int, argv: list[str], sleep: Callable[[float], None] = time.sleep) -> int:
    """The guard's loop (module docstring): the server's exit status, or 128 + the signal that ended it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM is for the server; the guard stays to reap
    server = subprocess.Popen(argv)
    status: int | None = None
    ending_since: float | None = None
    while True:
        for pid, raw in reap_all():
            if pid == server.pid:
                status = os.waitstatus_to_exitcode(raw)
                server.returncode = status
        caller_gone, server_gone = os.getppid() != parent, status is not None
        if not (caller_gone or server_gone):  # serving: no /proc scan while the caller times its calls
            sleep(POLL_S)
            continue
        others = [pid for pid in members(os.getpgid(0)) if pid != os.getpid()]
        if server_gone and not others:
            return status if status >= 0 else 128 - status
        if ending_since is None:  # stop what is left of the group
            ending_since = time.monotonic()
            for pid in others:
                kill(pid, signal.SIGTERM)
        if ending_since is not None and time.monotonic() - ending_since > STOP_S:
            for pid in others:
                kill(pid, signal.SIGKILL)
        sleep(POLL_S)


if __name__ == "__main__":
    sep = sys.argv.index("--")
    sys.exit(guard(int(sys.argv[1]), sys.argv[sep + 1 :]))
