"""Huge pages for the weights (decodebench/pages.py): the kernel's mode and the process's huge pages read from the
files the kernel writes, and torch's allocator giving a large tensor huge pages where the tests' conftest (as
``run.py`` and ``serve.py``) asked for them before torch was imported."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from decodebench import pages

MODES = [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
         ("always madvise [never]\n", "never"), ("", None)]  # fmt: skip


@pytest.mark.parametrize(("text", "mode"), MODES)
def test_the_kernels_mode_is_the_bracketed_word(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert pages.system_mode(path) == mode
    assert pages.system_mode(tmp_path / "absent") is None


def test_the_huge_pages_held_are_read_from_smaps(tmp_path):
    smaps = tmp_path / "smaps_rollup"
    smaps.write_text("Rss:      812 kB\nAnonymous:    4000 kB\nAnonHugePages:     2048 kB\nShmemPmdMapped: 0 kB\n")
    assert pages.huge_kib(smaps) == 2048
    smaps.write_text("Rss: 812 kB\n")
    assert pages.huge_kib(smaps) is None


def vm_flags(address: int) -> list[str]:
    """The kernel's flags of the mapping that holds ``address`` in this process (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


def test_torchs_allocator_asks_for_huge_pages_for_a_large_tensor():
    """The conftest set the variable before torch's import, so the allocator marks a large tensor's memory for huge
    pages (``hg``: madvise(MADV_HUGEPAGE)); whether the kernel can give them at that moment (memory free in 2 MiB
    runs) is the kernel's, and the evidence's ``anon_huge_kib`` says what it gave."""
    assert os.environ[pages.VARIABLE] == pages.ON
    if pages.system_mode() not in ("always", "madvise") or not Path("/proc/self/smaps").exists():
        pytest.skip(f"this kernel gives no transparent huge pages on request (mode {pages.system_mode()})")
    held = torch.empty(64 * 2**20, dtype=torch.uint8)
    assert "hg" in vm_flags(held.data_ptr()), "torch's allocator did not ask for huge pages"
