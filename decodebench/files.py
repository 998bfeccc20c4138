"""Files written whole or not at all: a reader (or a renderer killed mid-write) never leaves half a file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Writes ``data`` to a temporary file in ``path``'s folder, flushes it to the disk, then renames it over
    ``path``: the old file stays whole until the new one is. Readable by everyone the umask allows (as a plain
    write would make it); the temporary file is removed when anything fails, a full disk included."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """``write_bytes_atomic`` of ``text`` as UTF-8."""
    write_bytes_atomic(path, text.encode())


def measured_once(
    folder: Path | None, key: dict[str, Any], measure: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any], str]:
    """A measurement kept per machine and setting: read back from ``folder``'s file for ``key`` (a JSON-able dict,
    its digest the file's name) where it is there, how ``cached (<path>)``; else taken by ``measure`` and written
    there whole, the key beside it, how ``measured`` (``folder`` None: taken every time, nothing written)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = folder / f"{digest}.json" if folder is not None else None
    if path is not None and path.is_file():
        return json.loads(path.read_text()), f"cached ({path})"
    measured = measure()
    if path is not None:
        write_text_atomic(path, json.dumps({**key, **measured}, indent=2) + "\n")
    return measured, "measured"


def cannot_write(folder: Path) -> str | None:
    """Why no file can be made in ``folder``, or None when one can: a file is created and removed in it, or, where
    it does not exist yet, in its nearest existing parent (nothing is left behind), so a read-only disk, missing
    permission or a path through a file all say so here."""
    existing = Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a folder")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"{folder} cannot be written ({exc.strerror or exc})"
    return None


def disk_of(path: Path) -> str:
    """The disk a path lies on, for a message: its mount point and the bytes free there."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    mount = folder.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return f"the disk mounted at {mount} ({shutil.disk_usage(mount).free:,} bytes free)"
