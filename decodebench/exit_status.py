"""``python -m decodebench.exit_status STATUS.json ENV CMD...``: runs a cell's process as a child, waits
for it, and writes how it ended (``{"returncode": n}``, negative: the signal that killed it) to
``STATUS.json``; then exits the same way. ``ENV`` is a JSON object of environment variables to give the
child (null: unset): the sweep's own ``CUDA_VISIBLE_DEVICES``, which submitit's local executor
replaces with the GPUs it was asked for (none by default).

Submitit's local controller runs each job's command and drops its exit status; the isolated launcher
(``hydra_plugins/decodebench_launcher/isolated.py``) gives this module as submitit's ``python``
command, so the process that waits on the cell keeps the one fact only a parent can know: a
process killed by SIGKILL (the kernel's out-of-memory killer, a user) writes nothing of its own.
Standard library only: it starts in milliseconds and never touches torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # submitit's cancel and timeout signals
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: SIGKILL when this wrapper dies, so a killed wrapper leaves no cell running (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run(status: Path, command: list[str], env: dict[str, str | None] | None = None) -> int:
    """Runs ``command`` (with ``env``'s variables set, or unset where None), records its return code in
    ``status`` (atomically) and returns it."""
    environ = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    child = subprocess.Popen(command, env=environ, preexec_fn=_die_with_parent)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    returncode = child.wait()
    status.parent.mkdir(parents=True, exist_ok=True)
    tmp = status.with_name(f".{status.name}.tmp")
    tmp.write_text(json.dumps({"returncode": returncode, "pid": child.pid}) + "\n")
    os.replace(tmp, status)
    return returncode


def read(status: Path) -> int | None:
    """The recorded return code, or None when nothing was recorded (the wrapper itself did not finish)."""
    try:
        return int(json.loads(status.read_text())["returncode"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def describe(returncode: int | None) -> str:
    """How a cell's process ended, in words."""
    if returncode is None:
        return "the cell's process ended with no exit status recorded (its waiting parent was killed too)"
    if returncode < 0:
        sig = signal.Signals(-returncode)
        cause = (
            " (SIGKILL cannot be caught: the kernel's out-of-memory killer, see `dmesg`, or a user sent it)"
            if sig == signal.SIGKILL
            else ""
        )
        return f"the cell's process was killed by {sig.name} (signal {sig.value}){cause}"
    return f"the cell's process exited with status {returncode}"


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    returncode = run(Path(argv[0]), [sys.executable, *argv[2:]], json.loads(argv[1]))
    if returncode < 0:  # die the way the child died, so a waiting controller sees the same
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
