"""The articles' own definitions, each computed as the article printed it and set beside its figure, with what
was compared; the project's stricter checks stay beside them.

* **First-token KL** (the Rust article: ``KL hf||rs 1.078e-05``): ``parity_first_token_kl`` of each parity cell,
  beside its verdict (every token, KL mean and max within bounds).
* **KL over prompt + generated positions** (the Colab article, notebook 03: 0.001073 over 83 positions, the same
  top token at each, JAX bf16 against PyTorch eager): ``parity_sequence_kl_mean`` over its ``positions`` and
  ``parity_sequence_top1_same`` of a parity cell (the engine against Transformers, in that cell's dtype).
* **Token identity** (notebook 05: ring "first 64 of 64 tokens identical to notebook 04's step"): the generated
  ids of a ``ring`` and a ``table4`` decode cell of the same sweep, model, prompt, N and dtype, as the length of
  their common prefix, "first k of N identical".
* **N / warm N-token call** (notebook 02's rate): ``reports.like_for_like`` pairs it (``n_over_warm_n``); here
  beside the same rows' (N-1)/(T_N-T_1).

And two of the articles' derived figures from measurements:

* **The 4-bit per-layer table** (Step 9: frees 3.4 GB, 1.51x to 1.60x faster): ``table4`` against ``compiled``,
  and ``ring`` with ``engine.per_layer_table=int4`` against ``bf16``, rows of the same settings otherwise,
  measured in the same sweep: memory after load (bf16 minus int4) and weights from their shapes, and the rate
  ratio with its interval from both sides' samples in that sweep (``decodebench.stats.ratio_interval``).
* **The read-speed ratio** (the Tip after Step 11: the same 32,761-token prompt reads at 50% to 56% of the speed
  with the larger context): the same recall prompt (by its SHA-256) read by the same engine in the same sweep at
  two contexts, the larger's prompt tok/s over the smaller's, with its interval.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from decodebench.evidence import Record
from reports import uncertainty
from reports.like_for_like import View, matching, measured, ratio, shown
from reports.published import span
from reports.verdicts import VALID

FIRST_TOKEN = ("parity_kl_hf_rs", "parity_same_tokens", "parity_compared_tokens")  # the Rust article's CPU check
SEQUENCE = ("nb03_kl_jax_bf16_vs_torch_eager", "nb03_kl_positions", "nb03_same_top_token_positions")
IDENTITY = {33024: ("nb05_ring_33024_identical_tokens", "nb05_ring_33024_compared_tokens"),
            131328: ("nb05_ring_131328_identical_tokens", "nb05_ring_131328_compared_tokens")}  # fmt: skip
TABLE4_EFFECT = ("nb04_table4_frees_gb", "nb04_table4_vs_compiled_min", "nb04_table4_vs_compiled_max")
READ_SPEED = ("nb05_read_speed_ratio_min", "nb05_read_speed_ratio_max")
# A table kept 4-bit and the same way with it in bf16: (engine kept, engine not), the setting that differs.
TABLE_PAIRS = {("table4", "compiled"), ("ring", "ring")}
TABLE_SETTING = "per_layer_table="
SAME_ROW = ["model", "device", "device_name", "context", "dtype", "max_new_tokens", "prompt_tokens", "prompt",
            "read_every", "weights", "fingerprint", "replica"]  # fmt: skip


def printed(figures: pd.DataFrame, *ids: str) -> dict[str, str]:
    """The published figures by id, each as printed."""
    by_id = figures.set_index("id")
    return {i: span(by_id.loc[i]) for i in ids}


def stated(derived: list[Any], *ids: str) -> dict[str, str]:
    """The articles' derived figures by id (recomputed entries' keys end with the id), as printed."""
    return {e.key.rsplit("/", 1)[-1]: e.stated for e in derived if e.key.rsplit("/", 1)[-1] in ids}


def _parity_records(records: dict[str, dict[str, Any]]) -> list[tuple[str, Record]]:
    out = []
    for file, data in sorted(records.items()):
        if data["status"] == "ok" and data["config"]["experiment"]["name"] == "parity":
            out.append((file, Record.from_json(data)))
    return out


def _compared(r: Record) -> str:
    engine = r.config["engine"]
    settings = " ".join(f"{k}={v}" for k, v in sorted(engine.items()) if k != "name")
    return f"{engine['name']}{f' ({settings})' if settings else ''} against Transformers, {r.config['dtype']}"


def first_token_kl(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """Each parity cell's first-token KL and, beside it, the project's verdict over every token."""
    rows = []
    for file, r in _parity_records(records):
        if "parity_first_token_kl" not in r.measurements:
            continue
        prompt = r.outputs.get("prompt") or {}
        kl = " / ".join(f"{prompt[k]:.3g}" if prompt.get(k) is not None else "–" for k in ("kl_mean", "kl_max"))
        rows.append({"compared": _compared(r), "model": r.config["model"]["name"],
                     "first-token KL": f"{r.value('parity_first_token_kl'):.3e}",
                     "tokens equal": f"{prompt.get('tokens_equal', '–')} of {r.config['max_new_tokens']}",
                     "KL mean / max": kl, "verdict": r.outputs.get("verdict", "–"), "file": f"`{file}`"})  # fmt: skip
    return pd.DataFrame(rows, columns=["compared", "model", "first-token KL", "tokens equal", "KL mean / max",
                                       "verdict", "file"])  # fmt: skip


def sequence_kl(records: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """Each parity cell's mean KL over prompt + generated positions and the positions with the same top token."""
    rows = []
    for file, r in _parity_records(records):
        kl = r.measurements.get("parity_sequence_kl_mean")
        if kl is None:
            continue
        positions = kl.extra.get("positions")
        top1 = r.measurements.get("parity_sequence_top1_same")
        rows.append({"compared": _compared(r), "model": r.config["model"]["name"],
                     "mean KL": f"{kl.central:.4g}", "positions": positions,
                     "same top token": "–" if top1 is None else f"{top1.central} of {top1.extra.get('of', positions)}",
                     "verdict": r.outputs.get("verdict", "–"), "file": f"`{file}`"})  # fmt: skip
    return pd.DataFrame(rows, columns=["compared", "model", "mean KL", "positions", "same top token", "verdict",
                                       "file"])  # fmt: skip


def n_over_warm_n(views: list[View], figures: pd.DataFrame) -> pd.DataFrame:
    """Notebook 02's rate, N over the warm N-token call, for each VALID row of an nb02 way's method, beside
    the same row's (N-1)/(T_N-T_1)."""
    rows = []
    for view in (v for v in views if v.valid):
        for _, fig in matching(view, figures).iterrows():
            if fig.metric != "warm_tok_s":
                continue
            value = measured(view, fig)
            rows.append({"row": fig.way, "measured": view.label, "N / warm N-token call s": shown(value),
                         "published": span(fig), "measured / published": ratio(value, fig),
                         "(N-1)/(T_N-T_1)": shown(view.quantities.get("decode_tok_s"))})  # fmt: skip
    return pd.DataFrame(rows, columns=["row", "measured", "N / warm N-token call s", "published",
                                       "measured / published", "(N-1)/(T_N-T_1)"])  # fmt: skip


def _prefix(a: list[int], b: list[int]) -> int:
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same


def token_identity(cells: pd.DataFrame) -> pd.DataFrame:
    """Each ring decode cell against each table4 decode cell of the same sweep, model, prompt, N and dtype:
    how many of the first generated ids are identical."""
    ok = cells[(cells.status == "ok") & (cells.experiment == "decode") & cells.generated_ids.notna()]
    same = ["sweep", "model", "prompt", "prompt_tokens", "max_new_tokens", "dtype"]
    rows = []
    for _, group in ok.groupby(same, sort=True, dropna=False):
        for _, ring in group[group.engine == "ring"].sort_values("file").iterrows():
            for _, step in group[group.engine == "table4"].sort_values("file").iterrows():
                same_ids = _prefix(ring.generated_ids, step.generated_ids)
                rows.append({"ring": f"ring, {ring.context} ({ring.engine_config})",
                             "table4": f"table4, {step.context}", "model": ring.model, "sweep": ring.sweep,
                             "identical": f"first {same_ids} of {len(ring.generated_ids)} identical",
                             "files": f"`{ring.file}`, `{step.file}`"})  # fmt: skip
    return pd.DataFrame(rows, columns=["ring", "table4", "model", "sweep", "identical", "files"])


def _without_table(config: str) -> str:
    return " ".join(p for p in config.split() if not p.startswith(TABLE_SETTING))


def table4_effect(decode: pd.DataFrame) -> pd.DataFrame:
    """Each VALID row that keeps the per-layer table 4-bit against the same way with it in bf16 (same settings
    otherwise, a sweep both were measured in): memory freed after load and by the weights' shapes, and the
    speed-up with its interval from both sides' samples in that sweep."""
    valid = decode[decode.verdict == VALID] if not decode.empty else decode
    rows = []
    for _, packed in valid.loc[[m.get("kept_4bit") == "per-layer table" for m in valid.method]].iterrows():
        for _, dense in valid.loc[[m.get("kept_4bit") == "none" for m in valid.method]].iterrows():
            if (packed.engine, dense.engine) not in TABLE_PAIRS or any(packed[c] != dense[c] for c in SAME_ROW):
                continue
            if _without_table(packed.engine_config) != _without_table(dense.engine_config):
                continue
            shared = sorted(set(packed.by_sweep) & set(dense.by_sweep))
            if not shared:
                continue
            sweep = shared[-1]
            speed = uncertainty.ratio(packed.by_sweep[sweep]["values"], dense.by_sweep[sweep]["values"])
            rows.append({"kept 4-bit": f"{packed.engine} ({packed.engine_config or 'defaults'})",
                         "bf16 table": f"{dense.engine} ({dense.engine_config or 'defaults'})",
                         "model": packed.model, "device": packed.device, "context": packed.context, "sweep": sweep,
                         "freed after load GB": _freed(dense.memory_after_load, packed.memory_after_load),
                         "freed by shapes GB": _freed(dense.weight_bytes, packed.weight_bytes),
                         "speed-up": speed.text()})  # fmt: skip
    return pd.DataFrame(rows, columns=["kept 4-bit", "bf16 table", "model", "device", "context", "sweep",
                                       "freed after load GB", "freed by shapes GB", "speed-up"])  # fmt: skip


def _freed(before: Any, after: Any) -> str:
    if before is None or after is None or pd.isna(before) or pd.isna(after):
        return "–"
    return f"{(before - after) / 1e9:.4g}"


def read_speed(recall: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """The same recall prompt (SHA-256) read by the same engine and settings in the same sweep at two contexts:
    the larger context's prompt tok/s over the smaller's, with the interval from both sides' repeats."""
    if recall.empty:
        return pd.DataFrame(columns=["engine", "model", "prompt tokens", "contexts", "sweep", "read speed", "files"])
    settings = cells.set_index("file")[["sweep", "engine_config", "dtype", "fingerprint"]]
    ok = recall[(recall.status == "ok") & recall.read_values.notna()].join(settings, on="file")
    rows = []
    for (engine, model, _, sweep), group in ok.groupby(["engine", "model", "prompt_sha256", "sweep"], sort=True):
        group = group.sort_values("context")
        for _, small in group.iterrows():
            for _, large in group[group.context > small.context].iterrows():
                if (small.engine_config, small["dtype"], small.fingerprint) != (
                    large.engine_config,
                    large["dtype"],
                    large.fingerprint,
                ):
                    continue
                ratio = uncertainty.ratio(large.read_values, small.read_values)
                rows.append({"engine": engine, "model": model, "prompt tokens": int(small.prompt_tokens),
                             "contexts": f"{large.context} over {small.context}", "sweep": sweep,
                             "read speed": _percent(ratio), "files": f"`{large.file}`, `{small.file}`"})  # fmt: skip
    return pd.DataFrame(rows, columns=["engine", "model", "prompt tokens", "contexts", "sweep", "read speed", "files"])


def _percent(ratio: uncertainty.Ratio) -> str:
    """A ratio as the Tip prints it, in percent, with its interval and n of each side."""
    interval = ratio.interval
    bounds = f"[{100 * interval.low:.0f}%, {100 * interval.high:.0f}%]" if interval.known else uncertainty.NO_INTERVAL
    return f"{100 * ratio.value:.0f}% {bounds} n={ratio.n_top}/{ratio.n_bottom}"
