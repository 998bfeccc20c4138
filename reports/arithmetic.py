"""Every derived figure as one entry: what it is, its formula, each input with value, unit and source
file, and the result with units.  Measured entries read the aggregated evidence; published entries
recompute the articles' own derived figures from ``evidence/published/``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from decodebench.stats import Interval
from reports import uncertainty
from reports.uncertainty import Ratio

HEADER = """\
# ARITHMETIC, not measurement: every derived figure decodebench reports, with its formula and inputs.
# Inputs are cited by file: measured evidence (evidence/runs/...) or published data (evidence/published/...).
# Rates are medians of raw samples pooled over the files named, each with its 95% bootstrap interval and n
# ("45.2 tok/s [44.8, 45.9] n=6"); a ratio of two engines divides two such medians, its interval from the
# samples of both sides ("6.50x [6.00, 7.00] n=6/4"), and is "no measurable difference" when that interval
# contains 1. Only rows whose cells are VALID are here (verdicts: REPORT.md, "Verdict per cell").
"""


@dataclass
class Input:
    """One input of a derived figure; ``interval`` when it is the median of samples."""

    name: str
    value: float
    unit: str
    source: str
    note: str = ""
    interval: Interval | None = None

    def shown(self) -> str:
        return fmt(self.value, self.unit) if self.interval is None else fmt_interval(self.interval, self.unit)


@dataclass
class Entry:
    """One derived figure; ``interval`` when it is made from samples, ``ratio`` when it divides two."""

    key: str
    what: str
    formula: str
    inputs: list[Input]
    result: float | None
    unit: str
    notes: list[str] = field(default_factory=list)
    stated: str | None = None  # a published figure's printed value, as printed
    agrees: bool | None = None  # the result rounds to ``stated`` at its printed precision (None: not a number)
    row: tuple[str, str] | None = None  # the measured decode row it belongs to: (engine, key)
    interval: Interval | None = None
    ratio: Ratio | None = None

    def shown(self) -> str:
        """The result as the report prints it: a ratio's text, a figure with its interval, or the value."""
        if self.ratio is not None:
            return self.ratio.text()
        if self.interval is not None and self.result is not None:
            return fmt_interval(self.interval, self.unit)
        return fmt(self.result, self.unit)

    def text(self) -> str:
        lines = [f"[{self.key}]", f"what:    {self.what}", f"formula: {self.formula}"]
        for i, item in enumerate(self.inputs):
            label = "inputs:  " if i == 0 else "         "
            extra = f" ({item.note})" if item.note else ""
            lines.append(f"{label}{item.name} = {item.shown()}{extra} <- {item.source}")
        lines.append(f"result:  {self.shown()}")
        if self.ratio is not None and not self.ratio.measurable:
            lines.append(f"note:    median ratio {fmt(self.result, self.unit)}: {self.ratio.verdict()}")
        lines += [f"note:    {n}" for n in self.notes]
        return "\n".join(lines)


def _number(value: float, unit: str) -> str:
    """``value`` rounded by unit: 4 significant figures, ratios to 2 decimals, money to cents, % to 0.1."""
    if unit == "x" or unit.startswith("USD"):
        return f"{value:.2f}"
    if unit == "%":
        return f"{value:.1f}"
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}".replace(",", "_")
    return f"{value:.4g}"


def fmt(value: float | None, unit: str) -> str:
    """A value with its unit, rounded by ``_number``: ``6.50x``, ``5.13 USD/Mtok``, ``12.3 %``, ``45.2 tok/s``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"n/a {unit}".strip()
    text = _number(value, unit)
    return f"{text}x" if unit == "x" else f"{text} {unit}".strip()


def fmt_interval(interval: Interval, unit: str) -> str:
    """A sampled figure with its unit, 95% interval and n: ``45.2 tok/s [44.8, 45.9] n=6``."""
    return f"{fmt(interval.value, unit)} {uncertainty.bounds(interval, lambda v: _number(v, unit))} n={interval.n}"


NOTHING_MEASURED = (
    "nothing measured yet: no VALID decode cell in the evidence (REPORT.md names each cell's verdict; "
    "run `make demo` or `python run.py`)"
)


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
    return Input(name, row.decode_median, "tok/s", ", ".join(row.files), "pooled median", row.decode)


def _sweep_rate_input(name: str, run: dict[str, Any], sweep: str) -> Input:
    return Input(name, run["interval"].value, "tok/s", ", ".join(run["files"]), f"sweep {sweep}", run["interval"])


# Rows compared by a ratio share these (and so their environment, code, A/A copy and prompt) besides the engine.
RATIO_SAME = ["model", "checkpoint", "device", "device_name", "context", "dtype", "max_new_tokens", "batch",
              "prompt_tokens", "fingerprint", "code", "replica"]  # fmt: skip


def decode_ratios(decode: pd.DataFrame, floors: dict[str, float] | None = None) -> list[Entry]:
    """Each engine's decode rate as a multiple of ``generate`` on the same device, checkpoint, context, dtype,
    prompt and environment, with the interval from both rows' samples; ``floors``: the A/A noise floor of
    each environment (``reports.noise.floors``)."""
    entries = []
    for _, group in decode.groupby(RATIO_SAME, sort=True, dropna=False):
        base = group[(group.engine == "generate") & (group.read_every == 0)]
        if base.empty:
            continue
        base_row = base.iloc[0]
        for _, row in group.sort_values(["engine", "read_every"]).iterrows():
            if row.engine == "generate":
                continue
            ratio = uncertainty.ratio(row.decode_values, base_row.decode_values, (floors or {}).get(row.fingerprint))
            entries.append(
                Entry(
                    key=f"decode-ratio/{row.engine}-vs-generate/{row.key}",
                    what=f"decode rate of {row.engine} as a multiple of generate, same device and checkpoint",
                    formula=f"{row.engine}_tok_s / generate_tok_s",
                    inputs=[_rate_input(f"{row.engine}_tok_s", row), _rate_input("generate_tok_s", base_row)],
                    result=ratio.value,
                    unit="x",
                    row=(row.engine, row.key),
                    ratio=ratio,
                )
            )
    return entries


JAX_GAP_GROUP = ["model", "checkpoint", "device", "context", "dtype", "max_new_tokens", "batch", "prompt_tokens",
                 "fingerprint", "code", "replica"]  # fmt: skip
JAX_GAP_PUBLISHED = ("jax_vs_best_torch_nb03", "jax_w4a16_vs_best_torch_nb03", "jax_vs_table4_nb04")


def jax_gap(decode: pd.DataFrame, floors: dict[str, float] | None = None) -> list[Entry]:
    """Each JAX row against the fastest PyTorch way with the same weights (``engine.weights``: dense against
    dense, int4 against int4, as the articles compare JAX bf16 with bf16 PyTorch ways and JAX w4a16 apart) on
    the same device, checkpoint, context, dtype, N and environment, measured in a sweep the JAX row was
    measured in (a ratio from one run: machines of one kind differ), with the interval from both sides'
    samples in that sweep; the Rust engine is neither. The articles' 14.8x / 11.7x / 2.6x are
    ``JAX_GAP_PUBLISHED``."""
    entries: list[Entry] = []
    if decode.empty:
        return entries
    for _, group in decode[decode.read_every == 0].groupby(JAX_GAP_GROUP, sort=True, dropna=False):
        for _, peer in group[group.engine == "jax"].iterrows():
            torch_ways = group[~group.engine.isin(["jax", "rust"]) & (group.weights == peer.weights)]
            shared = [s for s in peer.by_sweep if any(s in w for w in torch_ways.by_sweep)]
            if not shared:
                continue
            sweep = shared[-1]  # the newest shared run, by name: both medians from its files only
            candidates = [w for _, w in torch_ways.iterrows() if sweep in w.by_sweep]
            fastest = max(candidates, key=lambda w: w.by_sweep[sweep]["interval"].value)
            jax_run, torch_run = peer.by_sweep[sweep], fastest.by_sweep[sweep]
            ratio = uncertainty.ratio(jax_run["values"], torch_run["values"], (floors or {}).get(peer.fingerprint))
            entries.append(
                Entry(
                    key=f"jax-vs-fastest-pytorch/{peer.key}",
                    what=f"JAX engine ({peer.weights} weights) decode rate as a multiple of the fastest PyTorch way "
                    f"with {peer.weights} weights ({fastest.engine}), same device, checkpoint, context and N, both "
                    f"from sweep {sweep}",
                    formula="jax_tok_s / fastest_pytorch_tok_s",
                    inputs=[
                        _sweep_rate_input("jax_tok_s", jax_run, sweep),
                        _sweep_rate_input(f"fastest_pytorch_tok_s ({fastest.engine})", torch_run, sweep),
                    ],
                    result=ratio.value,
                    unit="x",
                    row=("jax", peer.key),
                    ratio=ratio,
                )
            )
    return entries


def _at_batch(row: pd.Series) -> str:
    batch = int(row.get("batch", 1) or 1)
    return "one request at a time" if batch == 1 else f"{batch} sequences a step (aggregate rate)"


def costs(decode: pd.DataFrame) -> list[Entry]:
    """USD per million output tokens at the row's batch, from the row's own price per hour (every
    file of the row must record the same price); the interval is the price over the rate's bounds."""
    entries = []
    for _, row in decode.iterrows():
        price = row.price_usd_per_hour
        key, cell = f"usd-per-mtok/{row.engine}/{row.key}", (row.engine, row.key)
        rate = _rate_input("rate", row)
        if _missing(price):
            why = row.price_note or f"hardware {row.hardware} has no price per hour: set hardware.price_usd_per_hour="
            what = f"USD per million output tokens, {row.engine}"
            entries.append(Entry(key, what, "price / (rate * 3600) * 1e6", [rate], None, "USD/Mtok", [why], row=cell))
            continue
        interval = uncertainty.scaled(row.decode, lambda r, price=price: price / (r * 3600) * 1e6)
        entries.append(
            Entry(
                key,
                f"USD per million output tokens, {row.engine}, {_at_batch(row)}",
                "price / (rate * 3600) * 1e6",
                [Input("price", price, "USD/h", f"conf/hardware/{row.hardware}.yaml (recorded in the evidence)"), rate],
                interval.value,
                "USD/Mtok",
                [
                    "excludes disks, network and idle time; assumes the chip is busy decoding",
                    "interval: the price over the rate's interval bounds (a higher rate costs less)",
                ],  # fmt: skip
                row=cell,
                interval=interval,
            )
        )
    return entries


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


# Bytes a linear weight is read at, by how the engine holds its linears (the cells' ``weights``), given the run
# dtype's bytes, where the evidence has no count of the engine's own (``engine.product_bytes``, which takes
# precedence): ``dense`` at that dtype; ``int4`` (``engine.weights=int4``) half a byte plus a scale and a zero per 32
# weights in the run's dtype, as aten's int4 kernels hold them with one scale part (``int4_rows`` holds the stored
# scale alone, 0.5 + 2/32 with float16 scales: 10 % fewer bytes, so evidence without the count overstates its share of
# the roofline by 11 %); a peer's own formats as its evidence names them
# (``engine.linears``): vLLM's W4A16 half a byte plus a bf16 scale per 32 (symmetric), llama.cpp's GGUF types by their
# block sizes (q8_0: 32 int8 and an fp16 scale in 34 bytes; q4_0: 18 bytes per 32; q4_K: 144 bytes per 256, its
# lm_head q6_K counted at that rate too), bf16 and f32 whole.
HELD_BYTES: dict[str, Callable[[int], float]] = {
    "dense": lambda dtype_bytes: dtype_bytes,
    "int4": lambda dtype_bytes: 0.5 + 2 * dtype_bytes / 32,
    "w4a16": lambda _: 0.5 + 2 / 32,
    "q8_0": lambda _: 34 / 32,
    "q4_0": lambda _: 18 / 32,
    "q4_k_m": lambda _: 144 / 256,
    "bf16": lambda _: 2,
    "f32": lambda _: 4,
}


def weights_per_step(shape: dict[str, Any], layers: list[dict[str, Any]]) -> dict[str, float]:
    """The weights a decode step multiplies every row by, by part: ``linears`` (attention q, o and, on a layer that
    owns its cache, k, v; the MLP's three; the per-layer gate and projection; the per-layer model projection) and
    ``lm_head``, as counts of weights (not bytes)."""
    h, heads, ple = shape["hidden_size"], shape["num_attention_heads"], shape["hidden_size_per_layer_input"]
    linear = 0.0
    for i, layer in enumerate(layers):
        d, kv_heads, owns_kv = layer["head_dim"], layer["kv_heads"], layer["kv_source"] == i
        linear += h * heads * d * 2 + (2 * h * kv_heads * d if owns_kv else 0)  # q, o (+ k, v)
        linear += 3 * h * layer["intermediate_size"]
        linear += 2 * h * ple  # per-layer input gate and projection
    linear += h * len(layers) * ple  # per_layer_model_projection
    return {"linears": linear, "lm_head": shape["vocab_size"] * h}


def bytes_per_token(
    shape: dict[str, Any],
    layers: list[dict[str, Any]],
    dtype_bytes: int,
    position: int,
    weights: str = "dense",
    batch: int = 1,
    product_bytes: dict[str, int] | None = None,
) -> tuple[float, float, dict[str, float]]:
    """Weights read per decoded token (at the engine's resident precision) and KV read at ``position``, in bytes.

    ``layers`` is the per-layer layout the evidence records (type, K/V source, head size, K/V heads,
    MLP width). Linears and lm_head are read whole each step, once for the ``batch`` sequences of the step (so
    a token's share is 1/batch of them); the two embedding tables are gathered (one row each, a token); each
    layer reads its source cache over min(position, window) sliding or position full slots, a sequence its own.
    The linears' and ``lm_head``'s bytes are ``product_bytes`` where the engine counted them from its own tensors
    (``engines.product_bytes``: ``linears`` and ``lm_head``, B), else every weight of the shape at
    ``HELD_BYTES[weights]`` bytes. Returns the weights' bytes a token, the KV bytes a token, and ``parts``: what one
    step reads of each (linears and lm_head whole).
    """
    h, ple, window = shape["hidden_size"], shape["hidden_size_per_layer_input"], shape["sliding_window"]
    kv = 0.0
    for layer in layers:
        slots = position if layer["type"] == "full_attention" else min(position, window)
        kv += 2 * layer["kv_heads"] * layer["head_dim"] * dtype_bytes * slots
    if product_bytes is None:
        width = HELD_BYTES[weights](dtype_bytes)  # bytes a weight is read at
        step = weights_per_step(shape, layers)
        product_bytes = {"linears": step["linears"] * width, "lm_head": step["lm_head"] * width}
    parts = {
        "linears": float(product_bytes["linears"]),
        "lm_head": float(product_bytes["lm_head"]),
        "embedding rows": (h + len(layers) * ple) * dtype_bytes,
    }
    return (parts["linears"] + parts["lm_head"]) / batch + parts["embedding rows"], kv, parts


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class TokenBytes:
    """Bytes read per decoded token at ``position`` (the middle of the decode: prompt + N // 2)."""

    total: float
    kv: float
    parts: dict[str, float]
    position: int
    counted: bool = False  # linears and lm_head as the engine counted them from its tensors, not from the shape


def token_bytes(
    model: dict[str, Any],
    dtype: str,
    prompt_tokens: Any,
    max_new_tokens: Any,
    weights: str,
    batch: int = 1,
    product_bytes: dict[str, int] | None = None,
) -> TokenBytes | None:
    """``bytes_per_token`` of a cell from its evidence (the model block's shape and layers, its dtype, prompt
    and N, the bytes its products read as the engine counted them, ``product_bytes``, else how the linears are held:
    ``HELD_BYTES``); None when the evidence lacks the layout or the prompt's length, or names a holding this module
    cannot count and no count of the engine's."""
    if not model.get("layers") or _missing(prompt_tokens) or _missing(max_new_tokens) or dtype not in DTYPE_BYTES:
        return None
    position = int(prompt_tokens + max_new_tokens // 2)
    product_bytes = product_bytes if isinstance(product_bytes, dict) else None  # NaN where a cell has none
    if product_bytes is None and weights not in HELD_BYTES:
        return None
    weight, kv, parts = bytes_per_token(model["shape"], model["layers"], DTYPE_BYTES[dtype], position, weights, batch,
                                        product_bytes)  # fmt: skip
    return TokenBytes(weight + kv, kv, parts, position, counted=product_bytes is not None)


def roofline(decode: pd.DataFrame, models: dict[str, dict[str, Any]]) -> list[Entry]:
    """Bytes read per decoded token and the fraction of the memory-bandwidth roofline achieved, from the
    row's own prompt and bandwidth (``row.bandwidth_note`` says when its files measured different ones); no fraction
    where the median rate reads more than that bandwidth (only the one at the reads after its pairs, which moved with
    the machine), so none above 100 % is printed."""
    entries = []
    for _, row in decode.iterrows():
        batch = int(row.get("batch", 1) or 1)
        read = token_bytes(models.get(row.files[0], {}), row["dtype"], row.prompt_tokens, row.max_new_tokens,
                           row.weights, batch, row.get("product_bytes"))  # fmt: skip
        if read is None or _missing(row.bandwidth_gb_s):
            continue
        held = row["dtype"] if row.weights == "dense" else f"{row.weights} + scales"
        if read.counted:
            held += ", the bytes of the tensors the engine's products read"
        label = row.key
        entries.append(
            Entry(
                f"bytes-per-token/{row.engine}/{label}",
                f"bytes read per decoded token by {row.engine} (linears {held}, "
                f"the rest at the engine's resident {row['dtype']} precision, KV at position {read.position}"
                + (f"; linears and lm_head read once a step for {batch} sequences" if batch > 1 else "") + ")",
                "linears + lm_head + embedding rows + KV(position)" if batch == 1
                else f"(linears + lm_head) / {batch} + embedding rows + KV(position)",
                [
                    Input(name, value, "B", f"engine.product_bytes (counted from its tensors) in {row.files[-1]}"
                          if read.counted and name in ("linears", "lm_head")
                          else f"model shape and layers in {row.files[0]}")  # fmt: skip
                    for name, value in read.parts.items()
                ]
                + [
                    Input(
                        "KV(position)",
                        read.kv,
                        "B",
                        "sum over layers of 2 * kv_heads * head_dim * bytes * "
                        "(position if full else min(position, window))",
                    )
                ],
                read.total,
                "B",
                ["norms (under 1 MB) are left out; engines that attend over every slot read more KV than this"],
            )
        )
        entries += _roofline_at_pairs(row, read.total, label)
        if read.total * row.decode_median / 1e9 > row.bandwidth_gb_s:
            continue  # above the sweep's read: VALID only within its cells' own reads (reports.verdicts); no share
        interval = uncertainty.scaled(row.decode, lambda r, b=read.total, bw=row.bandwidth_gb_s: 100 * b * r / 1e9 / bw)
        notes = [f"achieved {read.total * row.decode_median / 1e9:.4g} GB/s"]
        entries.append(
            Entry(
                f"roofline/{row.engine}/{label}",
                f"fraction of the memory-bandwidth roofline {row.engine} achieves",
                "bytes_per_token * rate / bandwidth",
                [
                    Input("bytes_per_token", read.total, "B", f"[bytes-per-token/{row.engine}/{label}]"),
                    _rate_input("rate", row),
                    Input(
                        "bandwidth",
                        row.bandwidth_gb_s,
                        "GB/s",
                        f"{row.bandwidth_source} for {row.hardware}, recorded in {', '.join(row.files)}",
                    ),
                ],
                interval.value,
                "%",
                notes + ([] if _missing(row.bandwidth_note) else [row.bandwidth_note]),
                row=(row.engine, row.key),
                interval=interval,
            )
        )
    return entries


def _roofline_at_pairs(row: pd.Series, total: int, label: str) -> list[Entry]:
    """The roofline against the machine's streaming read after each pair (``decode``'s ``bandwidth_at_pairs_gb_s``,
    one for each rate): each pair's rate over the read of its own moment, the median of those with its interval, where
    the row's files recorded them (a shared host's read moves 2x within minutes: a rate of one moment over a read of
    another is a share of neither)."""
    reads = row.get("bandwidth_at_pairs_values")  # one for each rate, or none (``decode_table``)
    if not isinstance(reads, list) or not reads:
        return []
    per_read = uncertainty.sampled([rate / read for rate, read in zip(row.decode_values, reads, strict=True)])
    interval = uncertainty.scaled(per_read, lambda x: 100 * total * x / 1e9)
    return [
        Entry(
            f"roofline-at-pairs/{row.engine}/{label}",
            f"fraction of the memory-bandwidth roofline {row.engine} achieves, each pair against the read after it",
            "bytes_per_token * median over pairs of (rate / bandwidth)",
            [
                Input("bytes_per_token", total, "B", f"[bytes-per-token/{row.engine}/{label}]"),
                Input("rate / bandwidth", per_read.value, "tok/GB", ", ".join(row.files),
                      "pooled median, each pair's rate over the read after it", per_read),  # fmt: skip
            ],
            interval.value,
            "%",
            [f"the reads after the pairs {min(reads):.4g}-{max(reads):.4g} GB/s, the sweep's {row.bandwidth_gb_s:.4g}"],
            row=(row.engine, row.key),
            interval=interval,
        )
    ]


def matmul_ceiling(decode: pd.DataFrame, models: dict[str, dict[str, Any]]) -> list[Entry]:
    """The fraction of the device's bf16 matrix-product rate a way's weight products reach: the multiply-adds a
    token takes through every linear and lm_head (2 FLOP each) times the decode rate, over ``peak_tflops`` (the
    facts file's peak, or the GEMM rate measured in the sweep: ``decodebench.device.measure_matmul``). One row
    reads its weights for one token, so this stays small; B rows share a read, so it grows with B, and where it
    nears 100% the products, not the memory, set the step."""
    entries = []
    for _, row in decode.iterrows():
        model = models.get(row.files[0], {})
        if not model.get("layers") or _missing(row.get("peak_tflops")):
            continue
        step = weights_per_step(model["shape"], model["layers"])
        flop = 2 * (step["linears"] + step["lm_head"])
        interval = uncertainty.scaled(row.decode, lambda r, f=flop, peak=row.peak_tflops: 100 * f * r / 1e12 / peak)
        entries.append(
            Entry(
                f"matmul-ceiling/{row.engine}/{row.key}",
                f"fraction of the bf16 matrix-product rate {row.engine}'s weight products reach",
                "2 * (linear weights + lm_head weights) * rate / peak",
                [
                    Input("linear weights", step["linears"], "weights", f"model shape and layers in {row.files[0]}"),
                    Input("lm_head weights", step["lm_head"], "weights", f"model shape in {row.files[0]}"),
                    _rate_input("rate", row),
                    Input("peak", row.peak_tflops, "TFLOP/s",
                          f"{row.peak_source} for {row.hardware}, recorded in {', '.join(row.files)}"),  # fmt: skip
                ],
                interval.value,
                "%",
                [f"achieved {flop * row.decode_median / 1e12:.4g} TFLOP/s in the weight products; attention and "
                 "elementwise work left out"],  # fmt: skip
                row=(row.engine, row.key),
                interval=interval,
            )
        )
    return entries


def measured(
    decode: pd.DataFrame, models: dict[str, dict[str, Any]], floors: dict[str, float] | None = None
) -> list[Entry]:
    """Every measured entry: ratios, the JAX gap, costs, roofline, matmul ceiling; none when no decode row is VALID.

    ``models``: each evidence file's model block (shape and per-layer layout); ``floors``: the A/A noise
    floor per environment fingerprint."""
    if decode.empty:
        return []
    return [*decode_ratios(decode, floors), *jax_gap(decode, floors), *costs(decode), *roofline(decode, models),
            *matmul_ceiling(decode, models)]


DERIVED_COLUMNS = {
    "decode-ratio/": "x_generate",
    "roofline/": "roofline_pct",
    "roofline-at-pairs/": "roofline_at_pairs_pct",
    "matmul-ceiling/": "matmul_pct",
    "usd-per-mtok/": "usd_per_mtok",
    "jax-vs-fastest-pytorch/": "x_fastest_pytorch",
}


def with_derived_columns(decode: pd.DataFrame, entries: list[Entry]) -> pd.DataFrame:
    """The decode table with each row's derived figures as columns, the value in ``<column>`` and the text
    the report prints (with its interval) in ``<column>_shown`` (``generate`` is 1.00x itself)."""
    table = decode.copy()
    for prefix, column in DERIVED_COLUMNS.items():
        found = {e.row: e for e in entries if e.key.startswith(prefix) and e.row is not None}
        table[column] = [found[(r.engine, r.key)].result if (r.engine, r.key) in found else None
                         for _, r in table.iterrows()]  # fmt: skip
        table[f"{column}_shown"] = [found[(r.engine, r.key)].shown() if (r.engine, r.key) in found else "–"
                                    for _, r in table.iterrows()]  # fmt: skip
    if not table.empty:
        table.loc[table.engine == "generate", "x_generate"] = 1.0
        table.loc[table.engine == "generate", "x_generate_shown"] = "1.00x"
    return table


# ---------------------------------------------------------------- published ---------------------------------------


# A number as the articles print it: digits grouped by thousands ("6,601") or not, decimals, an exponent.
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
# One number, or a range of two ("91-95", "9.1 to 9.4"); a trailing "%", "x" or "×" is the unit, not the number.
_PRINTED = re.compile(rf"^(?P<low>{_NUMBER})(?:\s*(?:-|–|to)\s*(?P<high>{_NUMBER}))?\s*[%x×]?$")


def agrees_as_printed(result: float, printed: str) -> bool | None:
    """Whether ``result``, rounded to the precision ``printed`` shows, reads as ``printed``; None when
    ``printed`` is not a number or a range of two as the articles print them ("about twice").

    The precision is the printed string's own, trailing zeros included: "25.0" has one decimal, so
    25.08 reads "25.1" and does not agree; "130.8" needs 130.75 <= result < 130.85; "6601" and "6,601"
    need the integer; "0.0e+00" compares in the same exponent form with one mantissa decimal; "95%" and
    "14.8x" compare their number. A range "91-95" agrees when the result, rounded at each end's precision,
    lies between the ends (94.6 rounds to 95: agrees; 95.6 rounds to 96: differs).
    """
    match = _PRINTED.match(printed.strip().replace("_", ""))
    if match is None:
        return None
    low, high = match["low"], match["high"] or match["low"]
    at_low, low_value = _at_precision(result, low)
    at_high, high_value = _at_precision(result, high)
    return low_value <= at_low and at_high <= high_value


def _at_precision(result: float, printed: str) -> tuple[float, float]:
    """``result`` rounded to the precision of the printed number ``printed``, and that number; a negative
    result that rounds to zero equals a printed zero (-0.0 == 0.0)."""
    text = printed.replace(",", "")
    mantissa, exponent, _ = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    form = "e" if exponent else "f"
    return float(f"{result:.{decimals}{form}}"), float(f"{float(text):.{decimals}{form}}")


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
            verdict = {True: "agrees at the printed precision", False: "differs at the printed precision",
                       None: "not a number as printed: not compared"}[agrees]  # fmt: skip
            notes = [f"stated: {stated} {item['unit']} ({verdict}); {item['source']}"]
            if item.get("note"):
                notes.append(item["note"])
            entries.append(
                Entry(key, item["statement"], item["formula"], inputs, result, item["unit"], notes, stated, agrees)
            )
    return entries
