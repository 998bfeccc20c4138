"""Builds the Rust engine (``engines/rust/``) with maturin, choosing where its crates come from.

* ``registry``: the ordinary crate registry, when ``cargo fetch`` reaches it (a TPU VM, a laptop).
* ``debian``: Debian's packaged crates (``librust-pyo3-dev``, ``librust-cc-dev`` under
  ``/usr/share/cargo/registry``), offline, where the registry cannot be reached. The packages are
  installed with ``apt-get`` when missing and this process may run it (root).

The choice is written to ``engines/rust/.cargo/config.toml`` (Debian only; the registry needs no
file), and ``Cargo.lock`` is resolved anew for the source chosen: both are build outputs, not
tracked. Output is one line saying which source was used, unless something fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

CRATE = Path(__file__).resolve().parents[1] / "engines" / "rust"
DEBIAN_REGISTRY = Path("/usr/share/cargo/registry")
DEBIAN_PACKAGES = ("librust-pyo3-dev", "librust-cc-dev")
DEBIAN_CONFIG = f"""\
# Written by scripts/build_rust.py: the crate registry was not reachable, so crates come from
# Debian's packages ({", ".join(DEBIAN_PACKAGES)}), offline.
[source.crates-io]
replace-with = "debian-packages"

[source.debian-packages]
directory = "{DEBIAN_REGISTRY}"

[net]
offline = true
"""
PROBE_SECONDS = 60


class BuildError(RuntimeError):
    """The Rust engine cannot be built here, and why."""


def debian_crates_present(registry: Path = DEBIAN_REGISTRY) -> bool:
    return any(registry.glob("pyo3-0.17*")) and any(registry.glob("cc-1*"))


def can_apt() -> bool:
    return shutil.which("apt-get") is not None and os.geteuid() == 0


def choose_source(registry_reachable: bool, debian_present: bool, apt: bool) -> str:
    """``registry`` when it is reachable; else ``debian`` when its crates are (or can be) installed."""
    if registry_reachable:
        return "registry"
    if debian_present or apt:
        return "debian"
    raise BuildError(
        "the crate registry is not reachable and Debian's crates are not installed "
        f"(apt-get install {' '.join(DEBIAN_PACKAGES)} as root, or give cargo network access)"
    )


def registry_reachable(crate: Path = CRATE) -> bool:
    """True when ``cargo fetch`` resolves the crate's dependencies from the registry."""
    env = {**os.environ, "CARGO_NET_RETRY": "0", "CARGO_HTTP_TIMEOUT": "20"}
    try:
        done = subprocess.run(
            ["cargo", "fetch", "--quiet"], cwd=crate, env=env, capture_output=True, timeout=PROBE_SECONDS
        )
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return False
    return done.returncode == 0


def configure(source: str, crate: Path = CRATE) -> None:
    """Writes (debian) or removes (registry) the cargo source override."""
    config = crate / ".cargo" / "config.toml"
    if source == "debian":
        config.parent.mkdir(exist_ok=True)
        config.write_text(DEBIAN_CONFIG)
    else:
        config.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("auto", "registry", "debian"), default="auto")
    parser.add_argument("--venv", default=str(Path(sys.executable).parents[1]))
    args = parser.parse_args()
    if shutil.which("cargo") is None:
        sys.exit("build_rust: cargo is not on PATH (install Rust: rustup, or Debian's cargo package)")
    configure("registry")
    (CRATE / "Cargo.lock").unlink(missing_ok=True)  # resolved anew for the source chosen
    source = args.source
    if source == "auto":
        try:
            source = choose_source(registry_reachable(), debian_crates_present(), can_apt())
        except BuildError as exc:
            sys.exit(f"build_rust: {exc}")
    if source == "debian" and not debian_crates_present():
        subprocess.run(["apt-get", "update", "-qq"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", *DEBIAN_PACKAGES], check=True, stdout=subprocess.DEVNULL)
    configure(source)
    maturin = Path(args.venv) / "bin" / "maturin"
    env = {**os.environ, "VIRTUAL_ENV": args.venv}
    done = subprocess.run(
        [str(maturin), "develop", "--release", "--quiet"], cwd=CRATE, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"build_rust: maturin failed with crates from {source}:\n{done.stdout}{done.stderr}")
    print(f"rust engine built (crates from {source})")


if __name__ == "__main__":
    main()
