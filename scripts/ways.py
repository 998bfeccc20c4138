"""``python -m scripts.ways SELECTION WAY,WAY,...`` prints, comma-separated, the ways ``make reproduce`` runs in
one of its three steps (empty when none):

* ``noise``: the ways whose rows the A/A noise floor reads (decode experiments, ``reports.noise``); they run
  with the A/A copies (``NOISE=replica=0,1``);
* ``once``: every other way (recall, serve): a copy of it adds time and no noise figure, so it runs once;
* ``checks``: one way per distinct engine and settings among the ways given, whose bf16 parity checks cover
  them all.
"""

from __future__ import annotations

import argparse

from decodebench.evidence import DECODE_EXPERIMENTS
from runner import way_checks, way_settings


def select(selection: str, ways: list[str]) -> list[str]:
    """The ways of ``ways`` in ``selection`` (``noise``, ``once`` or ``checks``), in the order given."""
    if selection == "checks":
        return way_checks(ways)
    noise = selection == "noise"
    return [w for w in ways if (way_settings(w)["experiment.name"] in DECODE_EXPERIMENTS) == noise]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("selection", choices=["noise", "once", "checks"])
    parser.add_argument("ways", help="comma-separated way names (conf/way/<article>/<row>)")
    args = parser.parse_args()
    print(",".join(select(args.selection, args.ways.split(","))))
