"""The noise floor: how far apart two copies of the same measurement land (A/A).

Cells that differ only in the config key ``replica`` (0 by default and in evidence written before it
existed) are copies of one measurement; a sweep that measures its own noise runs ``replica=0,1`` as its
first axis so that the copies interleave. For each VALID decode row with a replica above the lowest, its
*A/A spread* is its median over the lowest replica's median minus 1 (a signed fraction: -0.03 is 3%
slower). The *noise floor* of an environment (fingerprint) is the largest absolute spread measured in it:
a difference between two rows no larger than that is "within the noise floor" (``reports.uncertainty``).
"""

from __future__ import annotations

import pandas as pd

from reports.tables.cells import GROUP
from reports.verdicts import VALID

PAIR_COLUMNS = ["label", "fingerprint", "replica_a", "replica_b", "median_a", "median_b", "spread", "files"]


def aa_pairs(decode: pd.DataFrame) -> pd.DataFrame:
    """One row per A/A pair of VALID decode rows: the lowest replica (``a``) against each other one (``b``);
    medians in tok/s, ``spread`` = median_b / median_a - 1."""
    same = [c for c in GROUP if c != "replica"]
    rows = []
    valid = decode[decode.verdict == VALID] if not decode.empty else decode
    for _, group in valid.groupby(same, sort=True, dropna=False):
        if group.replica.nunique() < 2:
            continue
        group = group.sort_values("replica")
        base = group.iloc[0]
        for _, other in group.iloc[1:].iterrows():
            rows.append(
                {
                    "label": base.label,
                    "fingerprint": base.fingerprint,
                    "replica_a": int(base.replica),
                    "replica_b": int(other.replica),
                    "median_a": base.decode_median,
                    "median_b": other.decode_median,
                    "spread": other.decode_median / base.decode_median - 1,
                    "files": [*base.files, *other.files],
                }
            )
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def floors(pairs: pd.DataFrame) -> dict[str, float]:
    """The noise floor of each environment that measured an A/A pair: its largest absolute spread."""
    return {fp: float(group.spread.abs().max()) for fp, group in pairs.groupby("fingerprint", sort=True)}


def floor_between(known: dict[str, float], *fingerprints: str) -> float | None:
    """The floor for a difference between rows of these environments: the largest of their floors, None
    when none of them measured one."""
    found = [known[fp] for fp in fingerprints if fp in known]
    return max(found) if found else None
