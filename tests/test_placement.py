"""Where a load generator and the server it loads run (``experiment.generator_cpus``, decodebench/placement.py)."""

from __future__ import annotations

import os

import pytest
import torch

from decodebench.config import ConfigError
from decodebench.placement import applied, parse_cpus, place


def test_cpu_lists_read_as_taskset_writes_them():
    assert parse_cpus("3") == {3} and parse_cpus("0-2,5") == {0, 1, 2, 5} and parse_cpus("1, 3") == {1, 3}
    with pytest.raises(ConfigError, match="generator_cpus='x'.*auto, shared or a CPU list"):
        parse_cpus("x")


def test_auto_gives_the_generator_the_last_core_and_the_server_the_rest(monkeypatch):
    monkeypatch.setattr("decodebench.placement.core_of", lambda cpu: {cpu, cpu + 4} if cpu < 4 else {cpu, cpu - 4})
    placed = place("auto", {0, 1, 2, 3, 4, 5, 6, 7})  # four cores of two SMT threads: 3 and 7 are one core
    assert placed.generator == (3, 7) and placed.server == (0, 1, 2, 4, 5, 6)
    assert placed.command(["aiperf", "profile"]) == ["taskset", "-c", "3,7", "aiperf", "profile"]
    alone = place("auto", {5})
    assert alone.generator == () and alone.server == (5,) and "one core" in alone.how
    assert alone.command(["aiperf"]) == ["aiperf"]


def test_a_list_and_shared_are_taken_as_given_and_a_list_that_leaves_the_server_nothing_is_refused():
    assert place("2-3", {0, 1, 2, 3}).server == (0, 1) and place("2-3", {0, 1, 2, 3}).generator == (2, 3)
    assert place("shared", {0, 1}).generator == () and place("shared", {0, 1}).server == (0, 1)
    with pytest.raises(ConfigError, match="may run on CPUs \\[0, 1\\]"):
        place("0-1", {0, 1})
    with pytest.raises(ConfigError, match="among them"):
        place("4", {0, 1})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a process that may run on two CPUs")
def test_applied_pins_this_process_and_its_threads_then_puts_them_back():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    placed = place("auto")
    with applied(placed):
        assert os.sched_getaffinity(0) == set(placed.server)
        assert torch.get_num_threads() == min(threads, len(placed.server))
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
    with pytest.raises(RuntimeError), applied(placed):
        raise RuntimeError("a cell that fails inside")
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
