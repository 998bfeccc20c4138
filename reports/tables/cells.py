"""Evidence files into the cells table (one row per cell file) and the boot table (one row per boot
stage), each file validated against its schema and read once; ``cells.md.j2`` renders the cells that
did not run and ``parity.md.j2`` the parity columns of those that did.

A file that cannot be read or does not follow the schema is named in ``warnings`` and skipped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pandas as pd

from decodebench import evidence
from reports import method

# The settings that make two cells the same measurement; cells sharing them pool their raw samples. Cells of
# different environments (``fingerprint``), code (``code``: the commit and any uncommitted change), A/A copies
# (``replica``), prompts and ways (``config.way``, the article row a cell names) are never pooled.
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
    "max_new_tokens",
    "batch",
    "prompt_tokens",
    "prompt",
    "way",
    "fingerprint",
    "code",
    "replica",
]

PEER_PEAK = "VmHWM summed over the peer server's processes"  # a peer's memory: its server's, not the cell's

BOOT_COLUMNS = ["file", "sweep", "host", "index", "stage", "status", "reason", "seconds", "since_boot_s",
                "started_utc", "versions", "dry_run", "detail", "measurements"]  # fmt: skip


@dataclass
class Evidence:
    """Every readable evidence record, flattened: one row per cell file, one per boot stage, plus what
    was skipped and why."""

    cells: pd.DataFrame
    records: dict[str, dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    boot: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=BOOT_COLUMNS))


def load(folder: Path, root: Path) -> Evidence:
    """Reads ``folder/**/*.json`` in name order (not the tools' files a cell keeps beside its evidence,
    ``evidence.KEPT_BESIDE``); paths in the result are relative to ``root``. A file with
    the same bytes as one read before is the same evidence (a copy, e.g. collected twice) and is read once;
    different files for the same cell of a sweep (two hosts ran it) are all kept and named in ``warnings``."""
    schemas = {kind: evidence.load_schema(kind) for kind in (None, evidence.BOOT)}
    rows, boot, records, warnings, seen = [], [], {}, [], set()
    for path in evidence.evidence_files(Path(folder)):
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


def _same_cell_twice(cells: pd.DataFrame) -> list[str]:
    """A warning for every cell of a sweep that has more than one (different) evidence file."""
    out = []
    for (sweep, cell), group in cells.groupby(["sweep", "cell"], sort=True):
        if len(group) > 1:
            hosts = ", ".join(sorted({h or "unrecorded" for h in group.host}))
            files = ", ".join(f"`{f}`" for f in group.file)
            out.append(f"sweep {sweep}: cell {cell} has {len(group)} different evidence files (hosts {hosts}): {files}")
    return out


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
    "decode_values",
    "bandwidth_at_pairs_values",
    "phase_values",
    "streamed_values",
    "warm_1_values",
    "warm_n_values",
    "method",
    "generated_ids",
    "first_call_s",
    "load_s",
    "weight_bytes",
    "cache_bytes",
    "memory_after_load",
    "memory_with_cache",
    "memory_peak",
    "memory_counter",
    "graphs",
    "graph_breaks",
    "parity_tokens_equal",
    "parity_first_difference",
    "parity_kl_mean",
    "parity_kl_max",
    "parity_kl_over",
    "parity_top5_same",
    "parity_verdict",
    "parity_bounds",
    "cpu_kernel_source",
    "settings_without_effect",
    "checks",
    "contention",
    "tables",
    "weights",
    "product_bytes",
    "utc_time",
    "cpu_model",
    "cpu_flags",
    "torch",
    "transformers",
    "packages",
    "git_sha",
    "git_dirty",
    "price_usd_per_hour",
    "bandwidth_gb_s",
    "bandwidth_source",
    "bandwidth_at_cell",
    "bandwidth_contention",
    "peak_tflops",
    "peak_source",
    "hardware",
]


def engine_settings(engine: dict[str, Any]) -> str:
    """An engine's settings as one line, ``key=value`` sorted by key; its name and empty option sets
    (``inductor={}``: none given, as in evidence written before the setting existed) left out."""
    return " ".join(f"{k}={v}" for k, v in sorted(engine.items()) if k != "name" and v != {})


def fingerprint(env: dict[str, Any]) -> str:
    """The environment class of a cell: ``environment.fingerprint`` as recorded, or, for evidence written
    before it was, ``~`` and 11 hex digits of a SHA-256 over the CPU model, device name, torch and
    transformers versions (the ``~`` marks a derived fingerprint; it never equals a recorded one)."""
    if env.get("fingerprint"):
        return str(env["fingerprint"])
    packages = env.get("packages") or {}
    key = [env.get("cpu_model"), env.get("device_name"), packages.get("torch"), packages.get("transformers")]
    return "~" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:11]


def code(env: dict[str, Any]) -> str:
    """The code a cell ran: its commit's first 12 hex digits, with ``+`` and the hash of the uncommitted
    change where the tree differed from it (``+dirty`` where that hash was not recorded); empty where the
    evidence names no commit (written outside a git checkout, or before it was recorded)."""
    sha = (env.get("git_sha") or "")[:12]
    if not sha or not env.get("git_dirty"):
        return sha
    return f"{sha}+{env.get('git_diff_sha256_16') or 'dirty'}"


def parity_bounds(cfg: dict[str, Any]) -> str | None:
    """What a parity cell's verdict held, from its config: ``parity`` (float32, every token equal) and
    ``parity-bf16`` (bfloat16, the KL up to the first differing token) share the experiment name."""
    if cfg["experiment"]["name"] != "parity":
        return None
    exp = cfg["experiment"]
    tokens = "every token equal, " if exp.get("all_tokens", True) else ""
    mean, most = ("not recorded" if exp.get(k) is None else f"{exp[k]:g}" for k in ("kl_mean", "kl_max"))
    return f"{cfg['dtype']}: {tokens}KL mean <= {mean} nats, max <= {most}"


def _values(r: evidence.Record, name: str) -> list[float]:
    """A measurement's raw samples; none when it was not measured."""
    m = r.measurements.get(name)
    return list(m.values) if isinstance(m, evidence.Samples) else []


def _row(rel: str, data: dict[str, Any]) -> dict[str, Any]:
    """One cell file as a row. ``weights``: how the engine holds its linears (``engine.weights``, dense or
    int4; a peer's own format, its evidence's ``engine.linears``, else ``engine.quant``); ``product_bytes``: the
    bytes its products read each step as the engine counted them from its tensors (``engines.product_bytes``; None
    where it did not, a peer or evidence written before it did); ``tables``: the
    checkpoint's own account of its weights (``model.tables_description``, or
    ``model.weights`` in evidence written before that name); ``max_new_tokens`` falls back to the
    measurement's earlier name ``new_tokens`` the same way; ``device_name``: on a CPU the CPU's model (torch and
    JAX label the same CPU device each its own way); ``memory_peak``: a peer's is its server's processes'
    (``PEER_PEAK``), the cell's own process holds none of its weights; ``method``: the cell's method key
    (``reports.method.of_record``). ``replica`` (the A/A copy) is 0 where the
    config has none; ``checks`` (``outputs.checks``) and ``contention`` (``environment.contention``) are
    None in evidence written before the experiments recorded them."""
    r = evidence.Record.from_json(data)
    cfg, env, hw = r.config, r.environment, r.hardware or {}
    device = env.get("device_kind") or cfg["device"]["kind"]
    peak = r.memory_peak()
    peer_peak = (r.engine.get("memory") or {}).get("peak_rss_bytes_sum") if r.engine.get("peer") else None
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
        "engine_config": engine_settings(cfg["engine"]),
        "cpu_kernel_source": r.engine.get("cpu_kernel_source"),
        "settings_without_effect": " ".join(r.engine.get("settings_without_effect") or ()),
        "model": cfg["model"]["name"] if r.model.get("kind") != "none" else "none",
        "checkpoint": r.model.get("key") or r.model.get("hub_id") or r.model.get("config_sha256_16") or "",
        "synthetic": bool(r.model.get("synthetic")),
        "device": device,
        "device_name": (env.get("cpu_model") if device == "cpu" else env.get("device_name")) or "",
        "context": cfg["context"],
        "dtype": cfg["dtype"],
        "read_every": cfg.get("read_every", 0),
        "fingerprint": fingerprint(env),
        "code": code(env),
        "replica": int(cfg.get("replica", 0)),
        "prompt_tokens": r.value("prompt_tokens"),
        "prompt": cfg.get("prompt"),
        "way": cfg.get("way"),
        "max_new_tokens": r.value("max_new_tokens" if "max_new_tokens" in r.measurements else "new_tokens"),
        "batch": int(cfg["experiment"].get("batch", 1)),
        "decode_values": _values(r, "decode_tok_s"),
        "bandwidth_at_pairs_values": _values(r, "bandwidth_at_pairs_gb_s"),
        "phase_values": _values(r, "decode_phase_tok_s"),
        "streamed_values": _values(r, "decode_streamed_tok_s"),
        "warm_1_values": _values(r, "warm_1_s"),
        "warm_n_values": _values(r, "warm_n_s"),
        "method": method.of_record(r),
        "generated_ids": r.outputs.get("generated_ids"),
        "first_call_s": r.value("first_call_s"),
        "load_s": r.value("load_s"),
        "weight_bytes": r.value("weight_bytes_from_shape"),
        "cache_bytes": r.value("cache_bytes_from_shape"),
        "memory_after_load": r.value("memory_after_load"),
        "memory_with_cache": r.value("memory_with_cache"),
        "memory_peak": peer_peak if peer_peak is not None else None if peak is None else peak.bytes,
        "memory_counter": PEER_PEAK if peer_peak is not None else None if peak is None else peak.counter,
        "graphs": r.engine.get("graphs"),
        "graph_breaks": r.engine.get("graph_breaks"),
        "parity_tokens_equal": None if parity is None else parity["tokens_equal"],
        "parity_first_difference": None if parity is None else parity["first_difference"],
        "parity_kl_mean": None if parity is None else parity.get("kl_mean", parity.get("topk_kl_mean")),
        "parity_kl_max": None if parity is None else parity.get("kl_max", parity.get("topk_kl_max")),
        "parity_kl_over": None if parity is None or "kl_mean" in parity else f"top-{parity['topk']} ids",
        "parity_top5_same": None
        if parity is None or "top5_engine" not in parity
        else parity["top5_engine"] == parity["top5_reference"],
        "parity_verdict": r.outputs.get("verdict"),
        "parity_bounds": parity_bounds(cfg),
        "checks": r.outputs.get("checks"),
        "contention": env.get("contention"),
        "tables": r.model.get("tables_description", r.model.get("weights")),
        "weights": cfg["engine"].get("weights") or r.engine.get("linears") or cfg["engine"].get("quant") or "dense",
        "product_bytes": r.engine.get("product_bytes"),
        "utc_time": env.get("utc_time"),
        "cpu_model": env.get("cpu_model"),
        "cpu_flags": " ".join(env.get("cpu_flags") or []),
        "torch": env.get("packages", {}).get("torch"),
        "transformers": env.get("packages", {}).get("transformers"),
        "packages": dict(env.get("packages") or {}),
        "git_sha": (env.get("git_sha") or "")[:12],
        "git_dirty": env.get("git_dirty"),
        "price_usd_per_hour": hw.get("price_usd_per_hour"),
        "bandwidth_gb_s": hw.get("memory_bandwidth_gb_s"),
        "bandwidth_source": hw.get("bandwidth_source"),
        "bandwidth_at_cell": hw.get("bandwidth_at_cell"),
        "bandwidth_contention": (hw.get("bandwidth_measurement") or {}).get("contention"),
        "peak_tflops": hw.get("peak_bf16_tflops"),
        "peak_source": hw.get("peak_source") or ("facts file" if hw.get("peak_bf16_tflops") else None),
        "hardware": hw.get("name"),
    }
