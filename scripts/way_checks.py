"""Prints, comma-separated, one way per distinct engine and settings among the ways given (comma-separated):
the ways whose parity checks cover them all (``make reproduce`` runs them under ``experiment=parity-bf16``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner import way_checks  # noqa: E402

if __name__ == "__main__":
    print(",".join(way_checks(sys.argv[1].split(","))))
