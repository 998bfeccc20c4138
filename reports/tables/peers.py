"""The peers tables, rendered by ``peers.md.j2`` beside this file: each peer's decode rate (``engines.peer``: vLLM's
or llama.cpp's server, started, measured and stopped by its cell) beside the fastest VALID in-process way of each
precision class, with a generated verdict per table.

Every figure is a row of the decode table (``reports.tables.decode``), never recomputed: a row whose last file's
``engine`` block names a ``peer`` is a peer's (every one is shown, VALID or not; each llama.cpp quantization is a row
of its own); an in-process way is a VALID, bare (not served) row without one, and of those only the fastest of each
precision class: ``int4`` when every linear is held 4-bit (the row's method key says ``kept_4bit`` "all linears":
``engine.weights=int4``, or the evidence's ``kept_4bit``, as llama.cpp's q4_* files record), ``dense`` otherwise.

One table per model, device, hardware, environment (fingerprint), context, N and prompt tokens (``PEER_GROUP``) and
per sweep with a peer row in it: a row's decode samples, interval and files there are its cells of that sweep alone
(``by_sweep``), so each way stands beside the peers measured in the same run (a machine's read moves between runs),
and rows measured otherwise are never divided by each other; its load seconds and peak memory stay the decode
table's (over all its files). Units: decode rates in tok/s (the median of the sweep's samples with its 95% interval
and n); ``x_fastest_peer`` the row's median over the fastest peer's
(the fastest VALID peer, else the fastest), with the 95% interval from both rows' samples
(``reports.uncertainty.ratio``, the environment's A/A noise floor beside it); ``startup_s`` seconds (a peer's own
start to readiness, the median over its files; an in-process way's ``load_s``); ``memory_peak_bytes`` bytes (a peer's
peak resident set summed over its processes, from its last file; an in-process way's peak counter).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any

import pandas as pd

from reports import uncertainty
from reports.verdicts import VALID

PEER_GROUP = ["model", "synthetic", "device", "device_name", "hardware", "fingerprint", "context", "max_new_tokens",
              "batch", "prompt_tokens"]  # fmt: skip
PEER_COLUMNS = ["decode_row", "way", "peer", "engine", "engine_config", "dtype", "precision", "decode",
                "decode_values", "x_fastest_peer", "x_shown", "x_same_precision", "same_precision_peer",
                "x_same_shown", "startup_s", "memory_peak_bytes", "verdict", "weights", "files"]  # fmt: skip
DENSE, INT4, INT8 = "dense", "int4", "int8"
ALL_LINEARS = "all linears"  # ``reports.method.kept_4bit``: every linear held 4-bit
NOT_A_PEER = "–"  # the fastest peer's own ratio cell


@dataclass(frozen=True)
class PeerTable:
    """One model and device's peers table: ``title`` (what its rows share), its ``model`` and ``device``, ``rows``
    (``PEER_COLUMNS``, fastest first), the fastest peer's ``way`` and the generated one-sentence ``verdict``."""

    title: str
    model: str
    device: str
    rows: pd.DataFrame
    fastest_peer: str | None  # None when no peer row has a decode sample
    verdict: str


def precision(method: dict[str, Any]) -> str:
    """``int4`` when the row's method key holds every linear 4-bit, else ``dense``."""
    return INT4 if method.get("kept_4bit") == ALL_LINEARS else DENSE


def peer_tables(
    decode: pd.DataFrame, records: dict[str, dict[str, Any]], floors: dict[str, float] | None = None
) -> list[PeerTable]:
    """The peers tables of ``decode`` (every row of ``decode_table``, VALID or not); ``records``: the evidence by
    file (for each row's ``engine`` block); ``floors``: each environment's A/A noise floor (``reports.noise``)."""
    tables = []
    for key, group in decode.groupby(PEER_GROUP, sort=True, dropna=False):
        where = dict(zip(PEER_GROUP, key, strict=True))
        for sweep in sorted({s for by_sweep in group.by_sweep for s in by_sweep}):
            in_sweep = [part for _, row in group.iterrows() if (part := _in_sweep(row, sweep)) is not None]
            if table := _table(where, sweep, in_sweep, records, (floors or {}).get(where["fingerprint"])):
                tables.append(table)
    return tables


def _in_sweep(row: pd.Series, sweep: str) -> pd.Series | None:
    """The decode row as its cells of ``sweep`` alone measured it (its samples, interval and files there), or None
    where none of its pooled cells is of that sweep."""
    part = row.by_sweep.get(sweep)
    if part is None:
        return None
    interval, values = part["interval"], part["values"]
    measured = {"decode": interval, "decode_values": values, "n": len(values), "files": part["files"],
                "decode_median": None if interval is None else interval.value}  # fmt: skip
    return pd.Series({**row.to_dict(), **measured}, name=row.name)


def _table(where: dict[str, Any], sweep: str, in_sweep: list[pd.Series], records: dict[str, dict[str, Any]],
           floor: float | None) -> PeerTable | None:  # fmt: skip
    """The peers table of one sweep's rows (``_in_sweep``; None when none is a peer's)."""
    blocks = {row.name: _engine_block(row, records) for row in in_sweep}
    peers = [row for row in in_sweep if blocks[row.name].get("peer")]
    if not peers:
        return None
    ways = [row for row in in_sweep if _in_process(row, blocks[row.name])]
    by_class = [_fastest([w for w in ways if precision(w.method) == c]) for c in (DENSE, INT4)]
    fastest_ways = [w for w in by_class if w is not None]
    valid_peer = _fastest([p for p in peers if p.verdict == VALID])
    fastest_peer = valid_peer if valid_peer is not None else _fastest(peers)
    shown = [*peers, *fastest_ways]
    rows = pd.DataFrame([_row(r, blocks[r.name], fastest_peer, floor, records) for r in shown], columns=PEER_COLUMNS)
    rows["way"] = _unique_ways(list(rows.way), shown)
    _same_precision(rows, shown, peers, floor)
    rate = [-(r.decode_median if r.n > 0 else float("-inf")) for r in shown]  # fastest first, unmeasured last
    rows = rows.assign(_rate=rate).sort_values(["_rate", "way"]).drop(columns="_rate").reset_index(drop=True)
    peer_way = None if fastest_peer is None else rows.way[rows.decode_row == fastest_peer.name].iloc[0]
    verdict = _verdict(rows, fastest_peer, peer_way, _fastest(fastest_ways)) + _at_own_precision(rows)
    return PeerTable(_title(where, sweep), where["model"], where["device"], rows, peer_way, verdict)


def _same_precision(rows: pd.DataFrame, shown: list[pd.Series], peers: list[pd.Series], floor: float | None) -> None:
    """Each row's median over the fastest peer of its own precision (``x_same_precision``; the fastest VALID one,
    else the fastest), named in ``same_precision_peer`` (marked where it is not VALID) and shown in ``x_same_shown``:
    the int4 ring over llama.cpp q4_0, the dense ways over llama.cpp bf16, not over another precision's peer."""
    at = {row.name: i for i, row in enumerate(shown)}  # a decode row's position among the table's rows
    for i, row in enumerate(shown):
        same = [p for p in peers if p.name != row.name and rows.precision[at[p.name]] == rows.precision[i]]
        valid = _fastest([p for p in same if p.verdict == VALID])
        peer = valid if valid is not None else _fastest(same)
        if peer is None or row.n == 0:
            continue
        ratio = uncertainty.ratio(row.decode_values, peer.decode_values, floor)
        name = rows.way[at[peer.name]] + ("" if peer.verdict == VALID else f" ({peer.verdict})")
        rows.at[i, "x_same_precision"], rows.at[i, "same_precision_peer"] = ratio, name
        rows.at[i, "x_same_shown"] = f"{ratio.text()} over {name}"


def _precision(row: pd.Series, block: dict[str, Any]) -> str:
    """The row's precision class: a llama.cpp file's by its quantization (``q4_*`` int4, ``q8_*`` int8, else dense),
    any other row's by its method key (``precision``)."""
    quant = str((block.get("weights") or {}).get("quant") or "") if block.get("peer") else ""
    if quant.startswith("q4"):
        return INT4
    if quant.startswith("q8"):
        return INT8
    return DENSE if quant else precision(row.method)


def _engine_block(row: pd.Series, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``engine`` block (the engine's describe()) of the row's last file, the one ``decode_table`` reads its
    memory from."""
    return records.get(row.files[-1], {}).get("engine") or {}


def _in_process(row: pd.Series, block: dict[str, Any]) -> bool:
    """A VALID bare row of an engine in the cell's own process (no peer, no endpoint)."""
    return not block.get("peer") and row.verdict == VALID and row.method.get("served") == "bare" and row.n > 0


def _fastest(rows: list[pd.Series]) -> pd.Series | None:
    """The row with the highest median rate (None when none has a sample)."""
    measured = [r for r in rows if r.n > 0]
    return max(measured, key=lambda r: r.decode_median, default=None)


def _way(row: pd.Series, block: dict[str, Any]) -> str:
    """A row's short name: the peer with its GGUF quantization (``llama.cpp q4_0``, ``vLLM``), or the engine and
    its precision class (``ring·int4``)."""
    if block.get("peer"):
        quant = (block.get("weights") or {}).get("quant")
        return f"{block['peer']} {quant}" if quant else str(block["peer"])
    return f"{row.engine}·{precision(row.method)}"


def _unique_ways(ways: list[str], shown: list[pd.Series]) -> list[str]:
    """The rows' short names, those shared by several rows (one peer's settings, commits or A/A copies) told apart
    by what differs among them."""
    out = list(ways)
    for way in set(ways):
        same = [shown[i] for i, w in enumerate(ways) if w == way]
        if len(same) < 2:
            continue
        differ = [c for c in ("engine_config", "code", "replica") if len({s[c] for s in same}) > 1]
        for i in (i for i, w in enumerate(ways) if w == way):
            parts = {"engine_config": shown[i].engine_config or "defaults", "code": f"@ {shown[i].code}",
                     "replica": f"replica {shown[i].replica}"}  # fmt: skip
            out[i] = f"{way} ({', '.join(parts[c] for c in differ)})"
    return out


def _row(
    row: pd.Series,
    block: dict[str, Any],
    fastest_peer: pd.Series | None,
    floor: float | None,
    records: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    peer = block.get("peer")
    ratio = None
    if fastest_peer is not None and row.name != fastest_peer.name and row.n > 0:
        ratio = uncertainty.ratio(row.decode_values, fastest_peer.decode_values, floor)
    return {
        "decode_row": row.name,
        "way": _way(row, block),
        "peer": peer,
        "engine": row.engine,
        "engine_config": row.engine_config,
        "dtype": row["dtype"],
        "precision": _precision(row, block),
        "decode": row.decode,
        "decode_values": row.decode_values,
        "x_fastest_peer": ratio,
        "x_shown": NOT_A_PEER if ratio is None else ratio.text(),
        "x_same_precision": None,
        "same_precision_peer": None,
        "x_same_shown": NOT_A_PEER,
        "startup_s": _startup(row, records) if peer else row.load_s,
        "memory_peak_bytes": row.memory_peak,
        "verdict": _short_verdict(row),
        "weights": _weights(row, block),
        "files": row.files,
    }


def _startup(row: pd.Series, records: dict[str, dict[str, Any]]) -> float | None:
    """A peer's seconds from start to readiness: the median over the row's files (None where none recorded it)."""
    seconds = [s for f in row.files if (s := (records[f].get("engine") or {}).get("startup_s")) is not None]
    return statistics.median(seconds) if seconds else None


def _short_verdict(row: pd.Series) -> str:
    """``VALID``, or ``INVALID:`` and each rule its files break, cut at its figure (``contended``, ``its parity
    check failed``; in full under *Verdict per cell*)."""
    if row.verdict == VALID:
        return VALID
    rules = dict.fromkeys(re.split(r":| \(|, ", rule, maxsplit=1)[0] for v in row.left_out for rule in v.broken)
    return f"{row.verdict}: {'; '.join(rules)}" if rules else str(row.verdict)


def _weights(row: pd.Series, block: dict[str, Any]) -> str:
    """What the row's engine read: a peer's GGUF quantization and its size in GB, or the checkpoint twin (with
    what it kept 4-bit)."""
    held = block.get("weights") if block.get("peer") else None
    if isinstance(held, dict) and held.get("quant"):
        size = f", {held['gguf_bytes'] / 1e9:.2f} GB" if held.get("gguf_bytes") else ""
        return f"GGUF {held['quant']}{size}"
    twin = held.get("twin") if isinstance(held, dict) and held.get("twin") else row.method.get("twin")
    kept = row.method.get("kept_4bit")
    return f"{twin} twin" + ("" if block.get("peer") or kept in (None, "none") else f", 4-bit: {kept}")


def _title(where: dict[str, Any], sweep: str) -> str:
    """What a table's rows share, for its heading: the device and its name as the decode table's heading gives them,
    then the hardware profile."""
    name = f" ({where['device_name']})" if isinstance(where["device_name"], str) else ""
    hardware = f", hardware {where['hardware']}" if isinstance(where["hardware"], str) else ""
    synthetic = ", synthetic weights" if where["synthetic"] else ""
    prompt = "" if pd.isna(where["prompt_tokens"]) else f", P={int(where['prompt_tokens'])}"
    n = "" if pd.isna(where["max_new_tokens"]) else f", N={int(where['max_new_tokens'])}"
    batch = int(where.get("batch", 1) or 1)
    sequences = f", B={batch} sequences a step" if batch > 1 else ""
    return (
        f"{where['model']} on {where['device']}{name}{hardware}{synthetic}: context {where['context']}{n}{prompt}"
        f"{sequences}, env {where['fingerprint']}, sweep {sweep}"
    )


def _at_own_precision(rows: pd.DataFrame) -> str:
    """A sentence setting each in-process way beside the fastest peer of its own precision, where there is one."""
    ways = [r for r in rows.itertuples() if pd.isna(r.peer) and isinstance(r.x_same_precision, uncertainty.Ratio)]
    parts = [f"{r.way} decodes {r.x_same_precision.text()} the rate of {r.same_precision_peer}" for r in ways]
    return f" At its own precision: {'; '.join(parts)}." if parts else ""


def _verdict(rows: pd.DataFrame, fastest_peer: pd.Series | None, peer: str | None, best: pd.Series | None) -> str:
    """One sentence from the table's own figures: the fastest VALID in-process way (``best``) against the fastest
    peer (``peer``: its way), as its ``x_fastest_peer`` ratio says."""
    if fastest_peer is None:
        return "No peer row here has a decode sample: there is no rate to set an in-process way against."
    invalid = "" if fastest_peer.verdict == VALID else " (no peer row here is VALID: the fastest is shown as measured)"
    if best is None:
        rate = uncertainty.figure(fastest_peer.decode, uncertainty.decimals(2), "tok/s")
        return f"No in-process way is VALID here; the fastest peer ({peer}{invalid}) decodes {rate}."
    (way,) = rows[rows.decode_row == best.name].itertuples()
    ratio: uncertainty.Ratio = way.x_fastest_peer
    head = f"The fastest VALID in-process way ({way.way})"
    if ratio.measurable:
        side = "ahead of" if ratio.value > 1 else "behind"
        return f"{head} decodes {ratio.text()} the rate of the fastest peer ({peer}{invalid}): {side} it."
    return f"{head} against the fastest peer ({peer}{invalid}): {ratio.text()}, neither ahead nor behind."
