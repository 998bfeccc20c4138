"""``python -m scripts.way_checks WAY,WAY,...`` prints, comma-separated, one way per distinct engine and settings
among the ways given: the ways whose parity checks cover them all (``make reproduce`` runs them under
``experiment=parity-bf16``)."""

from __future__ import annotations

import sys

from runner import way_checks

if __name__ == "__main__":
    print(",".join(way_checks(sys.argv[1].split(","))))
