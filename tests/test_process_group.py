"""A server in a process group of its own under a guard (``decodebench.process_group``): it stops with every process
it started, a server that ignores SIGTERM is killed, a failed start says why with its log, and a caller killed
with SIGKILL leaves nothing behind. The server here is a small HTTP server that starts a worker of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from decodebench.process_group import ServerFailed, ServerGroup, members
from engines.peer import free_port

SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    if sys.argv[2] == "ignore-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by its worker too
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a worker of its own
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if sys.argv[2] != "never-ready" else 503)
            self.end_headers()
        def log_message(self, *args):
            pass
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def server(tmp_path: Path, how: str = "plain") -> tuple[ServerGroup, str]:
    port = free_port()
    group = ServerGroup("test server", [sys.executable, "-c", SERVER, str(port), how], dict(os.environ),
                        tmp_path / f"server-{how}.log")  # fmt: skip
    return group, f"http://127.0.0.1:{port}/health"


def gone(pgid: int, within_s: float) -> bool:
    """Process group ``pgid`` is empty within ``within_s`` seconds."""
    end = time.monotonic() + within_s
    while members(pgid) and time.monotonic() < end:
        time.sleep(0.2)
    return not members(pgid)


def test_a_server_stops_with_every_process_it_started(tmp_path):
    group, ready = server(tmp_path)
    startup_s = group.start(ready, timeout_s=60)
    try:
        pids = members(group.pgid)
        assert len(pids) == 3 and group.guard.pid in pids and group.server_pid in pids  # guard, server, its worker
        assert 0 < startup_s < 60 and "serving" in Path(group.log).read_text()
        group.check()  # alive: no error
        memory = group.memory()
        assert {p["pid"] for p in memory["processes"]} == set(pids)
        assert all(p["peak_rss_bytes"] >= p["rss_bytes"] for p in memory["processes"])
    finally:
        left = group.stop()
    assert left == [] and group.stopped_by == "SIGTERM" and not members(group.pgid)


def test_a_server_that_ignores_sigterm_is_killed_after_the_bound(tmp_path):
    group, ready = server(tmp_path, "ignore-sigterm")
    group.start(ready, timeout_s=60)
    began = time.monotonic()
    group.stop(stop_s=1.0)
    assert group.stopped_by == "SIGKILL" and time.monotonic() - began < 10 and not members(group.pgid)


def test_a_server_gone_mid_use_fails_the_check_with_its_log(tmp_path):
    group, ready = server(tmp_path)
    group.start(ready, timeout_s=60)
    try:
        os.kill(group.server_pid, signal.SIGKILL)
        time.sleep(1.0)
        with pytest.raises(ServerFailed, match=r"(?s)test server (lost its server process|exited).*serving"):
            group.check()
    finally:
        group.stop()
    assert not members(group.pgid)


def test_a_start_that_fails_says_why_and_leaves_nothing(tmp_path):
    exits = ServerGroup("test server", [sys.executable, "-c", "print('no weights here'); raise SystemExit(3)"],
                        dict(os.environ), tmp_path / "exits.log")  # fmt: skip
    with pytest.raises(ServerFailed, match=r"(?s)exited with status 3.*no weights here"):
        exits.start(f"http://127.0.0.1:{free_port()}/health", timeout_s=60)
    slow, ready = server(tmp_path, "never-ready")
    with pytest.raises(ServerFailed, match=r"was not ready at .* within 2 s"):
        slow.start(ready, timeout_s=2)
    assert slow.stopped_by == "SIGTERM" and not members(slow.pgid)


def test_a_caller_killed_with_sigkill_leaves_no_server_behind(tmp_path):
    """The guard sees its caller gone and stops the group: no server process outlives a ``kill -9`` of its cell."""
    caller = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from decodebench.process_group import ServerGroup
        group = ServerGroup("test server", [sys.executable, "-c", {SERVER!r}, sys.argv[1], "plain"], dict(os.environ),
                            Path({str(tmp_path / "orphan.log")!r}))
        group.start(f"http://127.0.0.1:{{sys.argv[1]}}/health", timeout_s=60)
        print(group.pgid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", caller, str(free_port())], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    try:
        pgid = int(proc.stdout.readline())
        assert len(members(pgid)) == 3
        proc.kill()
        proc.wait()
        assert gone(pgid, within_s=20), f"left running: {members(pgid)}"
    finally:
        proc.kill()
        proc.wait()
