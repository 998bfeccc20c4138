"""Evidence files into pandas tables: validated, repeats pooled (median of raw samples, min, max, n).

A file that cannot be read or does not follow the schema is named in ``warnings`` and skipped.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pandas as pd

from decodebench import evidence

# The settings that make two cells the same measurement; cells sharing them pool their raw samples.
GROUP = [
    "experiment",
    "engine",
    "engine_config",
    "model",
    "checkpoint",
    "synthetic",
    "device",
    "device_name",
    "context",
    "dtype",
    "read_every",
    "new_tokens",
]


DECODE_EXPERIMENTS = ("decode", "default")  # experiments whose files carry decode_tok_s samples
DECODE_COLUMNS = ["decode_median", "decode_min", "decode_max", "n", "phase_median", "files", "sweeps", "first_call_s",
                  "load_s", "weight_bytes", "cache_bytes", "memory_after_load", "memory_peak", "memory_counter",
                  "graphs", "graph_breaks", "prompt_tokens", "price_usd_per_hour", "bandwidth_gb_s",
                  "bandwidth_source", "hardware", "weights", "linear_weights"]  # fmt: skip


@dataclass
class Evidence:
    """Every readable evidence record, flattened: one row per cell file, one per boot stage, plus what
    was skipped and why."""

    cells: pd.DataFrame
    records: dict[str, dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    boot: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=BOOT_COLUMNS))


BOOT_COLUMNS = ["file", "sweep", "host", "index", "stage", "status", "reason", "seconds", "since_boot_s",
                "started_utc", "versions", "dry_run", "detail"]  # fmt: skip


def load(folder: Path, root: Path) -> Evidence:
    """Reads ``folder/**/*.json`` in name order; paths in the result are relative to ``root``. A file with
    the same bytes as one read before is the same evidence (a copy, e.g. collected twice) and is read once;
    different files for the same cell of a sweep (two hosts ran it) are all kept and named in ``warnings``."""
    schemas = {kind: evidence.load_schema(kind) for kind in (None, evidence.BOOT)}
    rows, boot, records, warnings, seen = [], [], {}, [], set()
    for path in sorted(Path(folder).rglob("*.json")):
        rel = _display(path, root, Path(folder))
        try:
            data = path.read_bytes()
            record = json.loads(data)
            kind = record.get("kind") if isinstance(record, dict) else None
            evidence.validate(record, schemas.get(kind, schemas[None]))
        except (OSError, ValueError) as exc:
            warnings.append(f"{rel}: unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            continue
        except jsonschema.ValidationError as exc:
            where = "/".join(map(str, exc.absolute_path)) or "top level"
            schema = evidence.BOOT_SCHEMA_PATH if kind == evidence.BOOT else evidence.SCHEMA_PATH
            warnings.append(f"{rel}: does not follow evidence/{schema.name} at {where} ({exc.message[:160]})")
            continue
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            continue
        seen.add(digest)
        if kind == evidence.BOOT:
            boot.append({"file": rel, **{c: record.get(c) for c in BOOT_COLUMNS if c != "file"}})
            continue
        records[rel] = record
        rows.append(_row(rel, record))
    cells = pd.DataFrame(rows, columns=_COLUMNS)
    warnings += _same_cell_twice(cells)
    boot_table = pd.DataFrame(boot, columns=BOOT_COLUMNS).sort_values(["sweep", "host", "index", "file"])
    return Evidence(cells=cells, records=records, warnings=warnings, boot=boot_table)


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


def _same_cell_twice(cells: pd.DataFrame) -> list[str]:
    """A warning for every cell of a sweep that has more than one (different) evidence file."""
    out = []
    for (sweep, cell), group in cells.groupby(["sweep", "cell"], sort=True):
        if len(group) > 1:
            hosts = ", ".join(sorted({h or "unrecorded" for h in group.host}))
            files = ", ".join(f"`{f}`" for f in group.file)
            out.append(f"sweep {sweep}: cell {cell} has {len(group)} different evidence files (hosts {hosts}): {files}")
    return out


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


def _display(path: Path, root: Path, folder: Path) -> str:
    """A path as the report cites it: relative to the repository, or to the evidence folder's parent."""
    path = path.resolve()
    base = root.resolve() if path.is_relative_to(root.resolve()) else folder.resolve().parent
    return path.relative_to(base).as_posix()


_COLUMNS = [
    "file",
    "sweep",
    "cell",
    "host",
    "status",
    "reason",
    *GROUP,
    "prompt_tokens",
    "decode_values",
    "phase_values",
    "first_call_s",
    "load_s",
    "weight_bytes",
    "cache_bytes",
    "memory_after_load",
    "memory_peak",
    "memory_counter",
    "graphs",
    "graph_breaks",
    "parity_tokens_equal",
    "parity_first_difference",
    "parity_kl_mean",
    "parity_kl_max",
    "parity_top5_same",
    "parity_verdict",
    "weights",
    "linear_weights",
    "utc_time",
    "cpu_model",
    "torch",
    "transformers",
    "git_sha",
    "git_dirty",
    "price_usd_per_hour",
    "bandwidth_gb_s",
    "bandwidth_source",
    "hardware",
]


def _row(rel: str, data: dict[str, Any]) -> dict[str, Any]:
    r = evidence.Record.from_json(data)
    cfg, env, hw = r.config, r.environment, r.hardware or {}
    peak = r.memory_peak()
    parity = r.outputs.get("prompt") if cfg["experiment"]["name"] == "parity" else None
    parity = parity if isinstance(parity, dict) and parity.get("status") == "ok" else None
    return {
        "file": rel,
        "sweep": r.sweep,
        "cell": r.cell,
        "host": env.get("host") or "",
        "status": r.status,
        "reason": r.reason,
        "experiment": cfg["experiment"]["name"],
        "engine": cfg["engine"]["name"],
        "engine_config": " ".join(f"{k}={v}" for k, v in sorted(cfg["engine"].items()) if k != "name"),
        "model": cfg["model"]["name"] if r.model.get("kind") != "none" else "none",
        "checkpoint": r.model.get("key") or r.model.get("hub_id") or r.model.get("config_sha256_16") or "",
        "synthetic": bool(r.model.get("synthetic")),
        "device": env.get("device_kind") or cfg["device"]["kind"],
        "device_name": env.get("device_name") or "",
        "context": cfg["context"],
        "dtype": cfg["dtype"],
        "read_every": cfg.get("read_every", 0),
        "prompt_tokens": r.value("prompt_tokens"),
        "new_tokens": r.value("new_tokens"),
        "decode_values": list(r.measurements["decode_tok_s"].values) if "decode_tok_s" in r.measurements else [],
        "phase_values": list(r.measurements["decode_phase_tok_s"].values)
        if "decode_phase_tok_s" in r.measurements
        else [],
        "first_call_s": r.value("first_call_s"),
        "load_s": r.value("load_s"),
        "weight_bytes": r.value("weight_bytes_from_shape"),
        "cache_bytes": r.value("cache_bytes_from_shape"),
        "memory_after_load": r.value("memory_after_load"),
        "memory_peak": None if peak is None else peak.bytes,
        "memory_counter": None if peak is None else peak.counter,
        "graphs": r.engine.get("graphs"),
        "graph_breaks": r.engine.get("graph_breaks"),
        "parity_tokens_equal": None if parity is None else parity["tokens_equal"],
        "parity_first_difference": None if parity is None else parity["first_difference"],
        "parity_kl_mean": None if parity is None else parity["kl_mean"],
        "parity_kl_max": None if parity is None else parity["kl_max"],
        "parity_top5_same": None if parity is None else parity["top5_engine"] == parity["top5_reference"],
        "parity_verdict": r.outputs.get("verdict"),
        "weights": r.model.get("weights"),
        "linear_weights": cfg["engine"].get("weights", "dense"),
        "utc_time": env.get("utc_time"),
        "cpu_model": env.get("cpu_model"),
        "torch": env.get("packages", {}).get("torch"),
        "transformers": env.get("packages", {}).get("transformers"),
        "git_sha": (env.get("git_sha") or "")[:12],
        "git_dirty": env.get("git_dirty"),
        "price_usd_per_hour": hw.get("price_usd_per_hour"),
        "bandwidth_gb_s": hw.get("memory_bandwidth_gb_s"),
        "bandwidth_source": hw.get("bandwidth_source"),
        "hardware": hw.get("name"),
    }


RECALL_FIELDS = ["target_tokens", "status", "reason", "prompt_tokens", "read_s", "read_tok_s", "decode_tok_s",
                 "answer_code", "found", "asked_record", "records", "true_code", "prompt_sha256"]  # fmt: skip


def recall_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per recall prompt of every ok cell (article 003, Step 11 shape)."""
    rows = []
    for file, r in sorted(records.items()):
        for item in r["outputs"].get("recall", []) if r["status"] == "ok" else []:
            cell = {
                "file": file,
                "engine": r["config"]["engine"]["name"],
                "model": r["config"]["model"]["name"],
                "device": r["environment"].get("device_kind"),
                "context": r["config"]["context"],
            }
            rows.append({**cell, **{k: item.get(k) for k in RECALL_FIELDS}})
    return pd.DataFrame(rows, columns=["file", "engine", "model", "device", "context", *RECALL_FIELDS])


SERVE_COLUMNS = ["file", "engine", "model", "synthetic", "device", "context", "read_every", "requests", "tokens",
                 "finish", "read_s", "decode_s", "engine_tok_s", "engine_tok_s_min", "engine_tok_s_max", "client_s",
                 "request_rate", "streams", "ttft_min", "ttft_median", "ttft_max", "client_tok_s_min",
                 "client_tok_s_max", "itl_p50", "itl_p90", "itl_p99", "tpot", "e2el", "bare_tok_s",
                 "served_over_bare", "client_over_bare", "cancel_before", "cancel_after", "cancel_idle_s",
                 "screenshot"]  # fmt: skip


def serve_table(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per ok ``serve`` cell: the three parts' figures as the experiment wrote them (medians of
    its samples, min and max), the bare engine beside them, and the chat page's screenshot if taken."""
    rows = []
    for file, data in sorted(records.items()):
        if data["status"] != "ok" or data["config"]["experiment"]["name"] != "serve":
            continue
        r = evidence.Record.from_json(data)
        m = r.measurements
        spread = {name: (m[name].to_json()["min"], m[name].to_json()["max"]) if name in m else (None, None)
                  for name in ("served_engine_tok_s", "ttft_s", "client_tok_s")}  # fmt: skip
        itl = m["itl_s"].to_json() if "itl_s" in m else {}
        shot = r.outputs.get("screenshot") or {}
        finishes = sorted({row["finish"] for row in r.outputs.get("requests", [])})
        rows.append(
            {
                "file": file,
                "engine": r.config["engine"]["name"],
                "model": r.config["model"]["name"],
                "synthetic": bool(r.model.get("synthetic")),
                "device": r.environment.get("device_kind"),
                "context": r.config["context"],
                "read_every": r.outputs.get("read_every"),
                "requests": len(r.outputs.get("requests", [])),
                "tokens": r.value("served_tokens"),
                "finish": "/".join(finishes),
                "read_s": r.value("served_read_s"),
                "decode_s": r.value("served_decode_s"),
                "engine_tok_s": r.value("served_engine_tok_s"),
                "engine_tok_s_min": spread["served_engine_tok_s"][0],
                "engine_tok_s_max": spread["served_engine_tok_s"][1],
                "client_s": r.value("served_client_s"),
                "request_rate": r.value("request_rate_req_s"),
                "streams": len(r.outputs.get("streams", [])),
                "ttft_min": spread["ttft_s"][0],
                "ttft_median": r.value("ttft_s"),
                "ttft_max": spread["ttft_s"][1],
                "client_tok_s_min": spread["client_tok_s"][0],
                "client_tok_s_max": spread["client_tok_s"][1],
                "itl_p50": itl.get("p50"),
                "itl_p90": itl.get("p90"),
                "itl_p99": itl.get("p99"),
                "tpot": r.value("tpot_s"),
                "e2el": r.value("e2el_s"),
                "bare_tok_s": r.value("bare_decode_tok_s"),
                "served_over_bare": r.value("served_over_bare"),
                "client_over_bare": r.value("client_over_bare"),
                "cancel_before": r.value("cancel_counter_before"),
                "cancel_after": r.value("cancel_counter_after"),
                "cancel_idle_s": r.value("cancel_idle_s"),
                "screenshot": shot.get("file") if shot.get("status") == "ok" else None,
            }
        )
    return pd.DataFrame(rows, columns=SERVE_COLUMNS)


def decode_table(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per measurement group: raw decode samples pooled over its ok files (never averaged)."""
    ok = cells[(cells.status == "ok") & cells.experiment.isin(DECODE_EXPERIMENTS)]
    rows = []
    for key, group in ok.groupby(GROUP, sort=True, dropna=False):
        values = [v for vs in group.decode_values for v in vs]
        phase = [v for vs in group.phase_values for v in vs]
        last = group.sort_values("file").iloc[-1]
        rows.append(
            {
                **dict(zip(GROUP, key, strict=True)),
                "decode_median": statistics.median(values),
                "decode_min": min(values),
                "decode_max": max(values),
                "n": len(values),
                "phase_median": statistics.median(phase) if phase else None,
                "files": list(group.file),
                "sweeps": sorted(set(group.sweep)),
                "by_sweep": {
                    sweep: {
                        "median": statistics.median([v for vs in cells.decode_values for v in vs]),
                        "n": sum(len(vs) for vs in cells.decode_values),
                        "files": list(cells.file),
                    }
                    for sweep, cells in group.groupby("sweep", sort=True)
                },
                "first_call_s": statistics.median(group.first_call_s),
                "load_s": statistics.median(group.load_s),
                "weight_bytes": last.weight_bytes,
                "cache_bytes": last.cache_bytes,
                "memory_after_load": last.memory_after_load,
                "memory_peak": last.memory_peak,
                "memory_counter": last.memory_counter,
                "graphs": last.graphs,
                "graph_breaks": last.graph_breaks,
                "prompt_tokens": last.prompt_tokens,
                "price_usd_per_hour": last.price_usd_per_hour,
                "bandwidth_gb_s": last.bandwidth_gb_s,
                "bandwidth_source": last.bandwidth_source,
                "hardware": last.hardware,
                "weights": last.weights,
                "linear_weights": last.linear_weights,
            }
        )
    if not rows:  # no decode cell: the columns still exist, so templates can filter the empty table
        return pd.DataFrame(columns=[*GROUP, *DECODE_COLUMNS, "key", "label"])
    table = pd.DataFrame(rows)
    table["key"] = table.apply(_key, axis=1)
    table["label"] = table.apply(_label, axis=1)
    return table


def _key(row: pd.Series) -> str:
    """The row's name in arithmetic.txt keys (with the engine before it)."""
    engine = f"/{row.engine_config.replace(' ', ',')}" if row.engine_config else ""
    return (
        f"{row.model}/{row.checkpoint}/{row.device}/ctx{row.context}/{row['dtype']}/N={row.new_tokens}"
        f"/read_every={row.read_every}{engine}"
    )


def _label(row: pd.Series) -> str:
    """The row's name for a reader (plots)."""
    stream = f", read_every={row.read_every}" if row.read_every else ""
    backend = next((p for p in row.engine_config.split() if p.startswith("backend=")), "")
    backend = f", {backend}" if backend else ""
    return f"{row.engine} ({row.model}, {row.device}, ctx {row.context}, N={row.new_tokens}{stream}{backend})"


def bench_table(folder: Path) -> pd.DataFrame:
    """pytest-benchmark's JSON files (``make bench-int4``): one row per benchmark, median seconds and
    the dense/int4 ratio per shape on the same machine."""
    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        cpu = data.get("machine_info", {}).get("cpu", {}).get("brand_raw", "")
        for bench in data.get("benchmarks", []):
            params = bench.get("params") or {}
            shape = "x".join(map(str, params.get("shape", ())))
            rows.append(
                {
                    "file": path.name,
                    "cpu": cpu,
                    "device": bench.get("extra_info", {}).get("device", ""),
                    "linear": shape,
                    "weights": params.get("weights", ""),
                    "kernel": bench.get("extra_info", {}).get("kernel", ""),
                    "median_s": bench["stats"]["median"],
                    "rounds": bench["stats"]["rounds"],
                }
            )
    table = pd.DataFrame(rows, columns=["file", "cpu", "device", "linear", "weights", "kernel", "median_s", "rounds"])
    dense = table[table.weights == "dense"].set_index(["file", "linear"]).median_s
    table["x_dense"] = [
        dense.get((r.file, r.linear), float("nan")) / r.median_s if r.weights == "int4" else None
        for _, r in table.iterrows()
    ]
    return table
