"""Shared fixtures: composed configs and one tiny synthetic checkpoint per test session."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from decodebench import pages

# One intra-op thread per test process (and each process a test starts): pytest-xdist already puts a worker
# on every core, so a second thread each only contends. Tests check methods, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault(pages.VARIABLE, pages.ON)  # huge pages: before torch is imported (decodebench/pages.py)
os.environ.setdefault("DECODEBENCH_READ_TRIES", "1")  # the other xdist worker keeps a core busy: no second read
# Each cell reads the memory before and after itself: 256 MiB, not the several GiB that a CPU with a large cache reads
# for a sweep (decodebench/device.py: read_bytes), which would add minutes to `make test`
os.environ.setdefault("DECODEBENCH_READ_BYTES", str(256 * 2**20))

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from decodebench.device import resolve_device
from decodebench.synthetic import SyntheticCheckpoint, ensure_synthetic, shape_of, text_config
from decodebench.synthetic_tokenizer import TURN_END
from engines import engine_class
from engines.open import OpenEngine, open_engine
from runner import register_configs, typed_config

REPO = Path(__file__).resolve().parents[1]
register_configs()


def make_cfg(*overrides: str) -> DictConfig:
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def e2b_text_config(model: str = "e2b-synthetic") -> Any:
    """Transformers' Gemma 4 text config of E2B's shape (``model=e2b-synthetic``, or another model config), for
    tests of its layout."""
    special = {"<pad>": 0, "<bos>": 2, "<eos>": 1, TURN_END: 106}
    return text_config(shape_of(make_cfg(f"model={model}").model), special)


def opened(*overrides: str) -> OpenEngine:
    """The engine a composed cell names, opened through the one factory on the CPU (not yet loaded)."""
    run = typed_config(make_cfg("device=cpu", *overrides))
    return open_engine(run, resolve_device("cpu", engine_class(run.engine.name).framework))


def held_pairs(warm_1_s: list[float], warm_n_s: list[float]) -> int:
    """How many timed pairs kept the decode method's rule T_N > T_1 (seconds), so gave a rate. On a loaded
    machine a short pair can break it; a test of a cell's arithmetic counts on the pairs, not on the timing."""
    return sum(t_n > t_1 for t_1, t_n in zip(warm_1_s, warm_n_s, strict=True))


STOP_S = 30.0  # a process a test started has this long to end after its signal, then it is killed


def default_sigint() -> None:
    """In a child before it runs: Ctrl-C as an interactive shell gives it, however the suite was started (a background
    job of a script starts with SIGINT ignored, and every child inherits that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_serve(*args: str, sigint: Any = default_sigint) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    """``serve.py ARGS`` in a process of its own (SIGINT as ``sigint`` sets it up), its output lines on a queue."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "serve.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=sigint)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


def served_line(lines: queue.Queue[str], timeout_s: float = 180) -> str:
    """The line serve.py prints once it serves (each line within ``timeout_s``)."""
    line = ""
    while "decodebench serving" not in line:
        line = lines.get(timeout=timeout_s)
    return line


def stop(proc: subprocess.Popen[Any], signum: int = signal.SIGTERM, bound_s: float = STOP_S) -> int:
    """``signum`` to a process a test started (when it still runs), SIGKILL after ``bound_s`` seconds; waited for
    either way. Its exit status (-9 when it had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(signum)
        try:
            return proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def descendants(pid: int) -> list[int]:
    """The live processes descended from ``pid`` (from /proc; zombies left out)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return sorted(found - {pid})


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_running():
    """After the session: every process a test started has ended; any left is killed and fails the run by name."""
    yield
    left = {}
    for pid in descendants(os.getpid()):
        try:
            left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes the tests started are still running (now killed): {left}"


def check_streaming(engine: Any, ids: list[int], n: int = 6) -> list[int]:
    """A streamed call hands over the same ids as a whole call, batch by batch, and a false return from the hook
    stops it before ``n``; the whole call's ids."""
    whole = engine.generate(ids, n).tokens
    batches: list[list[int]] = []
    assert engine.generate(ids, n, on_tokens=lambda b: batches.append(b) is None).tokens == whole
    assert [t for b in batches for t in b] == whole and len(whole) == n
    stopped = engine.generate(ids, n, on_tokens=lambda b: False)
    assert stopped.tokens == whole[: len(stopped.tokens)] and len(stopped.tokens) < n
    return whole


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny(cache_dir: Path) -> SyntheticCheckpoint:
    return ensure_synthetic(make_cfg().model, cache_dir)


@pytest.fixture
def cell_cfg(cache_dir: Path, tmp_path: Path):
    """A composer for cells that write into this test's own evidence folder."""

    def _make(*overrides: str) -> DictConfig:
        return make_cfg(
            f"cache_dir={cache_dir}",
            f"evidence_dir={tmp_path / 'runs'}",
            "sweep=test",
            "device=cpu",
            "repeats=2",  # the tests check the method, not intervals: two pairs (the run's default is 5)
            *overrides,
        )

    return _make


@pytest.fixture(autouse=True)
def _single_thread_determinism():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with the most ``slow`` tests first, then those with the most tests (stable otherwise):
    ``make test`` runs pytest-xdist with ``--dist loadscope --no-loadscope-reorder``, which hands whole
    modules to its workers in this order, so the long ones start at once instead of one worker finishing
    them alone while the other idles (xdist's own reorder, by test count only, put them last)."""
    slow = Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    tests = Counter(item.module.__name__ for item in items)
    items.sort(key=lambda item: (-slow[item.module.__name__], -tests[item.module.__name__]))
