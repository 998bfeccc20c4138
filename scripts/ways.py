"""``python -m scripts.ways SELECTION WAY,WAY,... [--skip PATTERN,...]`` prints, comma-separated, the ways
``make reproduce`` runs in one of its three steps (empty when none):

* ``noise``: the ways whose rows the A/A noise floor reads (decode experiments, ``reports.noise``); they run
  with the A/A copies (``NOISE=replica=0,1``);
* ``once``: every other way (recall, serve): a copy of it adds time and no noise figure, so it runs once;
* ``checks``: one way per distinct engine and settings among the ways kept, whose bf16 parity checks cover
  them all.

``--skip`` (``make reproduce SKIP=...``) leaves out the ways matching any of its shell-style patterns
(``nb05/*``: the long-context ways); the report's coverage table names their rows *not yet measured*, with the
command that runs each.
"""

from __future__ import annotations

import argparse
from fnmatch import fnmatchcase

from decodebench.evidence import DECODE_EXPERIMENTS
from runner import way_checks, way_settings


def select(selection: str, ways: list[str], skip: list[str] | None = None) -> list[str]:
    """The ways of ``ways`` in ``selection`` (``noise``, ``once`` or ``checks``), in the order given, less those
    matching a pattern of ``skip``; a pattern that matches none of ``ways`` is refused (``ValueError``), so a
    misspelt one does not pass for a run of every way."""
    skip = skip or []
    if unmatched := [pattern for pattern in skip if not any(fnmatchcase(w, pattern) for w in ways)]:
        raise ValueError(f"SKIP={','.join(unmatched)} matches no way (ways: conf/way/<article>/<row>, e.g. nb05/*)")
    kept = [w for w in ways if not any(fnmatchcase(w, pattern) for pattern in skip)]
    if selection == "checks":
        return way_checks(kept)
    noise = selection == "noise"
    return [w for w in kept if (way_settings(w)["experiment.name"] in DECODE_EXPERIMENTS) == noise]


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("selection", choices=["noise", "once", "checks"])
    parser.add_argument("ways", help="comma-separated way names (conf/way/<article>/<row>)")
    parser.add_argument("--skip", default="", help="comma-separated shell-style patterns of ways to leave out")
    args = parser.parse_args()
    try:
        print(",".join(select(args.selection, _names(args.ways), _names(args.skip))))
    except ValueError as refused:
        parser.exit(2, f"{refused}\n")
