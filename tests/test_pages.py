"""Huge pages for the weights (decodebench/pages.py): the kernel's mode and the process's huge pages read from the
files the kernel writes, and torch's allocator giving a large tensor huge pages where the tests' conftest (as
``run.py`` and ``serve.py``) asked for them before torch was imported."""

from __future__ import annotations

import os

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


def test_a_large_tensor_gets_huge_pages_where_the_kernel_gives_them():
    assert os.environ[pages.VARIABLE] == pages.ON  # the conftest's, before torch's import
    if pages.system_mode() not in ("always", "madvise") or pages.huge_kib() is None:
        pytest.skip(f"this kernel gives no transparent huge pages on request (mode {pages.system_mode()})")
    before = pages.huge_kib()
    held = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)  # written: its pages exist
    assert pages.huge_kib() - before >= 32 * 1024, "torch's allocator asked for none, or the kernel gave none"
    del held
