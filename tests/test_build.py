"""The build leaves the checkout clean, and the Rust crates' source is chosen as the README says."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scripts.build_rust import DEBIAN_CONFIG, BuildError, choose_source, configure, debian_crates_present

REPO = Path(__file__).resolve().parents[1]
BUILD_OUTPUTS = (
    "engines/rust/python/decodebench_rs/_native.cpython-311-x86_64-linux-gnu.so",
    "engines/rust/Cargo.lock",
    "engines/rust/.cargo/config.toml",
    "engines/rust/target/release/libdecodebench_rs.so",
    ".venv/.setup-stamp",
)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_no_build_output_is_tracked_and_all_are_ignored():
    tracked = git("ls-files").splitlines()
    assert not [p for p in tracked if p.endswith((".so", ".pyd")) or p in BUILD_OUTPUTS]
    ignored = git("check-ignore", "--no-index", *BUILD_OUTPUTS).splitlines()
    assert sorted(ignored) == sorted(BUILD_OUTPUTS)


def test_set_up_checkout_has_no_tracked_file_modified_by_the_build():
    """Every file the build wrote (anything under the crate that git ignores) is untracked."""
    written = git("ls-files", "--others", "--ignored", "--exclude-standard", "engines/rust").splitlines()
    assert not set(written) & set(git("ls-files").splitlines())
    assert any(p.endswith(".so") for p in written), "make setup builds the Rust module before the tests"


@pytest.mark.parametrize(
    ("reachable", "debian", "apt", "source"),
    [
        (True, True, True, "registry"),  # a machine with both uses the registry
        (True, False, False, "registry"),  # a TPU VM or a laptop
        (False, True, False, "debian"),  # here: Debian's crates, offline
        (False, False, True, "debian"),  # Debian's crates installed by apt-get first
    ],
)
def test_crate_source_choice(reachable, debian, apt, source):
    assert choose_source(reachable, debian, apt) == source


def test_no_source_is_a_clear_error():
    with pytest.raises(BuildError, match="registry is not reachable and Debian's crates are not installed"):
        choose_source(False, False, False)


def test_configure_writes_the_debian_override_and_removes_it(tmp_path):
    configure("debian", tmp_path)
    assert (tmp_path / ".cargo" / "config.toml").read_text() == DEBIAN_CONFIG
    configure("registry", tmp_path)
    assert not (tmp_path / ".cargo" / "config.toml").exists()


def test_debian_crates_detected_from_their_folders(tmp_path):
    assert not debian_crates_present(tmp_path)
    (tmp_path / "pyo3-0.17.3").mkdir()
    (tmp_path / "cc-1.0.73").mkdir()
    assert debian_crates_present(tmp_path)
