"""The sweeps table, rendered by ``sweeps.md.j2`` beside this file (included under *Environment and
provenance*)."""

from __future__ import annotations

import pandas as pd


def sweeps_table(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per sweep: the hosts its cells ran on (as their files say) and its cells by status."""
    rows = []
    for sweep, group in cells.groupby("sweep", sort=True):
        hosts = sorted({h for h in group.host if h})
        rows.append(
            {
                "sweep": sweep,
                "hosts": len(hosts),
                "host_names": ", ".join(hosts),
                "unrecorded": int((group.host == "").sum()),
                "cells": len(group),
                "ok": int((group.status == "ok").sum()),
                "skipped": int((group.status == "skipped").sum()),
                "failed": int((group.status == "failed").sum()),
            }
        )
    return pd.DataFrame(
        rows, columns=["sweep", "hosts", "host_names", "unrecorded", "cells", "ok", "skipped", "failed"]
    )
