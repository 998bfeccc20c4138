"""The boot timeline, rendered by ``boot.md.j2`` beside this file."""

from __future__ import annotations

from typing import Any

import pandas as pd

READY_SPAN = ("python", "smoke")  # the published boot's span: installing Python to a working engine


def boot_runs(boot: pd.DataFrame) -> list[dict[str, Any]]:
    """One entry per machine boot (sweep, host): its stages with the versions each one added or changed,
    the whole boot's seconds, and the seconds from the start of ``python`` to the end of ``smoke`` (the
    span the Rust article times: installing Python to serving), when both ran ok."""
    runs = []
    for (sweep, host), stages in boot.groupby(["sweep", "host"], sort=True):
        stages = stages.sort_values("index").fillna({"reason": "", "detail": ""})
        shown, before = [], {}
        for versions in stages.versions:
            changed = {k: v for k, v in versions.items() if v and before.get(k) != v}
            shown.append(", ".join(v if v.startswith(k) else f"{k} {v}" for k, v in sorted(changed.items())))
            before = versions
        ok = stages[stages.status == "ok"].set_index("stage")
        ready = None
        if set(READY_SPAN) <= set(ok.index):
            first, last = ok.loc[READY_SPAN[0]], ok.loc[READY_SPAN[1]]
            ready = last.since_boot_s - (first.since_boot_s - first.seconds)
        runs.append(
            {
                "sweep": sweep,
                "host": host,
                "dry_run": bool(stages.dry_run.any()),
                "stages": stages.assign(shown_versions=shown),
                "total_s": stages.since_boot_s.max(),
                "ready_s": ready,
                "failed": bool((stages.status != "ok").any()),
            }
        )
    return runs
