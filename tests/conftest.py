"""Shared fixtures: composed configs and one tiny synthetic checkpoint per test session."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

# One intra-op thread per test process (and each process a test starts): pytest-xdist already puts a worker
# on every core, so a second thread each only contends. Tests check methods, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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


def e2b_text_config() -> Any:
    """Transformers' Gemma 4 text config of E2B's shape (``model=e2b-synthetic``), for tests of its layout."""
    special = {"<pad>": 0, "<bos>": 2, "<eos>": 1, TURN_END: 106}
    return text_config(shape_of(make_cfg("model=e2b-synthetic").model), special)


def opened(*overrides: str) -> OpenEngine:
    """The engine a composed cell names, opened through the one factory on the CPU (not yet loaded)."""
    run = typed_config(make_cfg("device=cpu", *overrides))
    return open_engine(run, resolve_device("cpu", engine_class(run.engine.name).framework))


def held_pairs(warm_1_s: list[float], warm_n_s: list[float]) -> int:
    """How many timed pairs kept the decode method's rule T_N > T_1 (seconds), so gave a rate. On a loaded
    machine a short pair can break it; a test of a cell's arithmetic counts on the pairs, not on the timing."""
    return sum(t_n > t_1 for t_1, t_n in zip(warm_1_s, warm_n_s, strict=True))


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
