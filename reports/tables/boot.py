"""The boot timeline, rendered by ``boot.md.j2`` beside this file."""

from __future__ import annotations

from typing import Any

import pandas as pd

# The published boot's span, installing Python to starting the service: (first stage, last stage, which edge
# of the last). A boot from before the serving stage ends its span at the end of smoke.
READY_SPANS = (("python", "serving", "start"), ("python", "smoke", "end"))


def boot_runs(boot: pd.DataFrame) -> list[dict[str, Any]]:
    """One entry per machine boot (sweep, host): its stages with the versions each one added or changed,
    the whole boot's seconds, and the seconds from the start of ``python`` to the start of ``serving`` (the
    span the Rust article times: installing Python to starting the service; the end of ``smoke`` for a boot
    without a serving stage), when both ran ok, with the service's own load and warm-up seconds."""
    runs = []
    for (sweep, host), stages in boot.groupby(["sweep", "host"], sort=True):
        stages = stages.sort_values("index").fillna({"reason": "", "detail": ""})
        shown, before = [], {}
        for versions in stages.versions:
            changed = {k: v for k, v in versions.items() if v and before.get(k) != v}
            shown.append(", ".join(v if v.startswith(k) else f"{k} {v}" for k, v in sorted(changed.items())))
            before = versions
        ok = stages[stages.status == "ok"].set_index("stage")
        ready, span, service = None, None, {}
        for start, stop, edge in READY_SPANS:
            if {start, stop} <= set(ok.index):
                first, last = ok.loc[start], ok.loc[stop]
                end = last.since_boot_s - (last.seconds if edge == "start" else 0)
                ready, span = end - (first.since_boot_s - first.seconds), f"the {edge} of *{stop}*"
                break
        if "serving" in ok.index and isinstance(ok.loc["serving"].measurements, dict):
            service = ok.loc["serving"].measurements
        runs.append(
            {
                "sweep": sweep,
                "host": host,
                "dry_run": bool(stages.dry_run.any()),
                "stages": stages.assign(shown_versions=shown),
                "total_s": stages.since_boot_s.max(),
                "ready_s": ready,
                "ready_span": span,
                "load_s": service.get("load_s"),
                "warmup_s": service.get("warmup_s"),
                "failed": bool((stages.status != "ok").any()),
            }
        )
    return runs
