"""Every derived figure as one entry: what it is, its formula, each input with value, unit and source
file, and the result with units.  Measured entries read the aggregated evidence; published entries
recompute the articles' own derived figures from ``evidence/published/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

HEADER = """\
# ARITHMETIC, not measurement: every derived figure decodebench reports, with its formula and inputs.
# Inputs are cited by file: measured evidence (evidence/runs/...) or published data (evidence/published/...).
# Rates are medians of raw samples pooled over the files named; a ratio of two engines divides two such medians.
"""


@dataclass
class Input:
    name: str
    value: float
    unit: str
    source: str
    note: str = ""


@dataclass
class Entry:
    """One derived figure."""

    key: str
    what: str
    formula: str
    inputs: list[Input]
    result: float | None
    unit: str
    notes: list[str] = field(default_factory=list)
    stated: str | None = None  # a published figure's printed value, as printed
    agrees: bool | None = None  # the result rounds to ``stated`` at its printed precision
    row: tuple[str, str] | None = None  # the measured decode row it belongs to: (engine, key)

    def text(self) -> str:
        lines = [f"[{self.key}]", f"what:    {self.what}", f"formula: {self.formula}"]
        for i, item in enumerate(self.inputs):
            label = "inputs:  " if i == 0 else "         "
            extra = f" ({item.note})" if item.note else ""
            lines.append(f"{label}{item.name} = {fmt(item.value, item.unit)}{extra} <- {item.source}")
        lines.append(f"result:  {fmt(self.result, self.unit)}")
        lines += [f"note:    {n}" for n in self.notes]
        return "\n".join(lines)


def fmt(value: float | None, unit: str) -> str:
    """Sensible rounding by unit: 4 significant figures, ratios to 2 decimals, money to cents."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"n/a {unit}".strip()
    if unit == "x":
        return f"{value:.2f}x"
    if unit.startswith("USD"):
        return f"{value:.2f} {unit}"
    if unit == "%":
        return f"{value:.1f} %"
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,} {unit}".replace(",", "_")
    return f"{value:.4g} {unit}"


NOTHING_MEASURED = "nothing measured yet: no ok decode cell in the evidence (run `make demo` or `python run.py`)"


def render(measured: list[Entry], recomputed: list[Entry]) -> str:
    """Measured entries first (or a line saying there are none), then the articles' recomputed ones."""
    sections = [
        "# ---- measured: derived from evidence/runs/ ----",
        "\n\n".join(e.text() for e in measured) if measured else NOTHING_MEASURED,
        "# ---- published: the articles' own derived figures, recomputed from evidence/published/ ----",
        "\n\n".join(e.text() for e in recomputed),
    ]
    return HEADER + "\n" + "\n\n".join(sections) + "\n"


# ---------------------------------------------------------------- measured ----------------------------------------


def _rate_input(name: str, row: pd.Series) -> Input:
    return Input(name, row.decode_median, "tok/s", ", ".join(row.files), note=f"median of {row.n}")


def _sweep_rate_input(name: str, run: dict[str, Any], sweep: str) -> Input:
    return Input(name, run["median"], "tok/s", ", ".join(run["files"]), note=f"median of {run['n']}, sweep {sweep}")


def decode_ratios(decode: pd.DataFrame) -> list[Entry]:
    """Each engine's decode rate as a multiple of ``generate`` on the same device, checkpoint, context, dtype."""
    entries = []
    same = ["model", "checkpoint", "device", "device_name", "context", "dtype", "max_new_tokens"]
    for _, group in decode.groupby(same, sort=True):
        base = group[(group.engine == "generate") & (group.read_every == 0)]
        if base.empty:
            continue
        base_row = base.iloc[0]
        for _, row in group.sort_values(["engine", "read_every"]).iterrows():
            if row.engine == "generate":
                continue
            entries.append(
                Entry(
                    key=f"decode-ratio/{row.engine}-vs-generate/{row.key}",
                    what=f"decode rate of {row.engine} as a multiple of generate, same device and checkpoint",
                    formula=f"{row.engine}_tok_s / generate_tok_s",
                    inputs=[_rate_input(f"{row.engine}_tok_s", row), _rate_input("generate_tok_s", base_row)],
                    result=row.decode_median / base_row.decode_median,
                    unit="x",
                    row=(row.engine, row.key),
                )
            )
    return entries


JAX_GAP_GROUP = ["model", "checkpoint", "device", "context", "dtype", "max_new_tokens"]
JAX_GAP_PUBLISHED = ("jax_vs_best_torch_nb03", "jax_w4a16_vs_best_torch_nb03", "jax_vs_table4_nb04")


def jax_gap(decode: pd.DataFrame) -> list[Entry]:
    """Each JAX row against the fastest PyTorch way on the same device, checkpoint, context, dtype and N,
    measured in a sweep the JAX row was measured in (a ratio from one run: machines of one kind
    differ); the Rust engine is neither. The articles' 14.8x / 11.7x / 2.6x are ``JAX_GAP_PUBLISHED``."""
    entries: list[Entry] = []
    if decode.empty:
        return entries
    for _, group in decode[decode.read_every == 0].groupby(JAX_GAP_GROUP, sort=True):
        torch_ways = group[~group.engine.isin(["jax", "rust"])]
        for _, peer in group[group.engine == "jax"].iterrows():
            shared = [s for s in peer.by_sweep if any(s in w for w in torch_ways.by_sweep)]
            if not shared:
                continue
            sweep = shared[-1]  # the newest shared run, by name: both medians from its files only
            candidates = [w for _, w in torch_ways.iterrows() if sweep in w.by_sweep]
            fastest = max(candidates, key=lambda w: w.by_sweep[sweep]["median"])
            jax_run, torch_run = peer.by_sweep[sweep], fastest.by_sweep[sweep]
            entries.append(
                Entry(
                    key=f"jax-vs-fastest-pytorch/{peer.key}",
                    what=f"JAX engine ({peer.weights} weights) decode rate as a multiple of the fastest "
                    f"PyTorch way ({fastest.engine}), same device, checkpoint, context and N, both from sweep {sweep}",
                    formula="jax_tok_s / fastest_pytorch_tok_s",
                    inputs=[
                        _sweep_rate_input("jax_tok_s", jax_run, sweep),
                        _sweep_rate_input(f"fastest_pytorch_tok_s ({fastest.engine})", torch_run, sweep),
                    ],
                    result=jax_run["median"] / torch_run["median"],
                    unit="x",
                    row=("jax", peer.key),
                )
            )
    return entries


def costs(decode: pd.DataFrame) -> list[Entry]:
    """USD per million output tokens at one request at a time, from the hardware's price per hour."""
    entries = []
    for _, row in decode.iterrows():
        price = row.price_usd_per_hour
        key, cell = f"usd-per-mtok/{row.engine}/{row.key}", (row.engine, row.key)
        rate = _rate_input("rate", row)
        if price is None or (isinstance(price, float) and math.isnan(price)):
            no_price = f"hardware {row.hardware} has no price per hour: set hardware.price_usd_per_hour="
            what = f"USD per million output tokens, {row.engine}"
            entries.append(
                Entry(key, what, "price / (rate * 3600) * 1e6", [rate], None, "USD/Mtok", [no_price], row=cell)
            )
            continue
        entries.append(
            Entry(
                key,
                f"USD per million output tokens, {row.engine}, one request at a time",
                "price / (rate * 3600) * 1e6",
                [Input("price", price, "USD/h", f"conf/hardware/{row.hardware}.yaml (recorded in the evidence)"), rate],
                price / (row.decode_median * 3600) * 1e6,
                "USD/Mtok",
                ["excludes disks, network and idle time; assumes the chip is busy decoding"],
                row=cell,
            )
        )
    return entries


def bytes_per_token(
    shape: dict[str, Any], layers: list[dict[str, Any]], dtype_bytes: int, position: int, int4_linears: bool = False
) -> tuple[float, float, dict[str, float]]:
    """Weights read per decoded token (at the engine's resident precision) and KV read at ``position``.

    ``layers`` is the per-layer layout the evidence records (type, K/V source, head size, K/V heads,
    MLP width). Linears and lm_head are read whole each step; the two embedding tables are gathered
    (one row each); each layer reads its source cache over min(position, window) sliding or
    position full slots. With ``int4_linears`` (``engine.weights=int4``) every linear, ``lm_head``
    included, reads half a byte per weight plus a scale and a zero per 32 weights in the run's
    dtype, as the kernels hold them.
    """
    h, heads, ple = shape["hidden_size"], shape["num_attention_heads"], shape["hidden_size_per_layer_input"]
    vocab, window = shape["vocab_size"], shape["sliding_window"]
    linear = ple_proj = kv = 0.0
    for i, layer in enumerate(layers):
        d, kv_heads, owns_kv = layer["head_dim"], layer["kv_heads"], layer["kv_source"] == i
        linear += h * heads * d * 2 + (2 * h * kv_heads * d if owns_kv else 0)  # q, o (+ k, v)
        linear += 3 * h * layer["intermediate_size"]
        ple_proj += 2 * h * ple
        slots = position if layer["type"] == "full_attention" else min(position, window)
        kv += 2 * kv_heads * d * dtype_bytes * slots
    linear += h * len(layers) * ple  # per_layer_model_projection

    def held(params: float) -> float:  # bytes a weight matrix is read at
        return params / 2 + params / 32 * 2 * dtype_bytes if int4_linears else params * dtype_bytes

    parts = {
        "linears": held(linear + ple_proj),
        "lm_head": held(vocab * h),
        "embedding rows": (h + len(layers) * ple) * dtype_bytes,
    }
    return sum(parts.values()), kv, parts


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def roofline(decode: pd.DataFrame, models: dict[str, dict[str, Any]]) -> list[Entry]:
    """Bytes read per decoded token and the fraction of the memory-bandwidth roofline achieved."""
    entries = []
    for _, row in decode.iterrows():
        model = models.get(row.files[-1], {})
        if not model.get("layers") or row.bandwidth_gb_s is None:
            continue
        position = int(row.prompt_tokens + row.max_new_tokens // 2)
        int4 = row.weights == "int4"
        weights, kv, parts = bytes_per_token(model["shape"], model["layers"], DTYPE_BYTES[row["dtype"]], position, int4)
        per_token = weights + kv
        label = row.key
        entries.append(
            Entry(
                f"bytes-per-token/{row.engine}/{label}",
                f"bytes read per decoded token by {row.engine} (linears {'int4 + scales' if int4 else row['dtype']}, "
                f"the rest at the engine's resident {row['dtype']} precision, KV at position {position})",
                "linears + lm_head + embedding rows + KV(position)",
                [Input(name, value, "B", f"model shape and layers in {row.files[-1]}") for name, value in parts.items()]
                + [
                    Input(
                        "KV(position)",
                        kv,
                        "B",
                        "sum over layers of 2 * kv_heads * head_dim * bytes * "
                        "(position if full else min(position, window))",
                    )
                ],
                per_token,
                "B",
                ["norms (under 1 MB) are left out; engines that attend over every slot read more KV than this"],
            )
        )
        achieved = per_token * row.decode_median / 1e9
        entries.append(
            Entry(
                f"roofline/{row.engine}/{label}",
                f"fraction of the memory-bandwidth roofline {row.engine} achieves",
                "bytes_per_token * rate / bandwidth",
                [
                    Input("bytes_per_token", per_token, "B", f"[bytes-per-token/{row.engine}/{label}]"),
                    _rate_input("rate", row),
                    Input(
                        "bandwidth",
                        row.bandwidth_gb_s,
                        "GB/s",
                        f"{row.bandwidth_source} for {row.hardware}, recorded in {row.files[-1]}",
                    ),
                ],
                100 * achieved / row.bandwidth_gb_s,
                "%",
                [f"achieved {achieved:.4g} GB/s"],
                row=(row.engine, row.key),
            )
        )
    return entries


def measured(decode: pd.DataFrame, models: dict[str, dict[str, Any]]) -> list[Entry]:
    """Every measured entry: ratios, the JAX gap, costs, roofline; none when no decode cell is ok.

    ``models``: each evidence file's model block (shape and per-layer layout)."""
    if decode.empty:
        return []
    return [*decode_ratios(decode), *jax_gap(decode), *costs(decode), *roofline(decode, models)]


DERIVED_COLUMNS = {
    "decode-ratio/": "x_generate",
    "roofline/": "roofline_pct",
    "usd-per-mtok/": "usd_per_mtok",
    "jax-vs-fastest-pytorch/": "x_fastest_pytorch",
}


def with_derived_columns(decode: pd.DataFrame, entries: list[Entry]) -> pd.DataFrame:
    """The decode table with each row's derived figures as columns (``generate`` is 1.0 x itself)."""
    table = decode.copy()
    for prefix, column in DERIVED_COLUMNS.items():
        values = {e.row: e.result for e in entries if e.key.startswith(prefix) and e.row is not None}
        table[column] = [values.get((r.engine, r.key)) for _, r in table.iterrows()]
    if not table.empty:
        table.loc[table.engine == "generate", "x_generate"] = 1.0
    return table


# ---------------------------------------------------------------- published ---------------------------------------


def agrees_as_printed(result: float, printed: str) -> bool:
    """True when ``result``, rounded to the precision ``printed`` shows, reads exactly ``printed``.

    The precision is the printed string's own, trailing zeros included: "25.0" has one decimal, so
    25.08 reads "25.1" and does not agree; "130.8" needs 130.75 <= result < 130.85; "6601" needs
    the integer; "0.0e+00" compares in the same exponent form with one mantissa decimal.
    """
    text = printed.strip().replace("_", "")
    if "e" in text.lower():
        mantissa = text.lower().split("e")[0]
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return _unsigned_zero(f"{result:.{decimals}e}") == _unsigned_zero(f"{float(text):.{decimals}e}")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return _unsigned_zero(f"{result:.{decimals}f}") == text


def _unsigned_zero(text: str) -> str:
    """ "-0.0" reads as "0.0": a negative result that rounds to zero agrees with a printed zero."""
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def published(figures: dict[str, pd.DataFrame], derived: dict[str, list[dict[str, Any]]]) -> list[Entry]:
    """The articles' own derived figures, recomputed from their published inputs with pandas.eval."""
    entries = []
    for name in sorted(derived):
        table = figures[name].set_index("id")
        for item in derived[name]:
            source = f"evidence/published/{name}.yaml"
            key, stated = f"published/{name}/{item['id']}", str(item["stated"])
            if not item.get("formula"):
                notes = [item.get("note", "the article does not print the inputs"), f"stated: {stated} {item['unit']}"]
                entries.append(Entry(key, item["statement"], "not recomputable", [], None, item["unit"], notes, stated))
                continue
            inputs, env = [], {}
            for var, ref in sorted(item["inputs"].items()):
                fig_id, _, end = ref.partition(".")
                fig = table.loc[fig_id]
                value = fig[end] if end else fig["value"]
                env[var] = float(value)
                inputs.append(Input(var, float(value), fig["unit"], f"{source}#{ref}"))
            result = float(pd.eval(item["formula"], local_dict=env, engine="python"))
            agrees = agrees_as_printed(result, stated)
            verdict = "agrees at the printed precision" if agrees else "differs at the printed precision"
            notes = [f"stated: {stated} {item['unit']} ({verdict}); {item['source']}"]
            if item.get("note"):
                notes.append(item["note"])
            entries.append(
                Entry(key, item["statement"], item["formula"], inputs, result, item["unit"], notes, stated, agrees)
            )
    return entries
