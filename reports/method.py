"""The method key: what makes a measured figure and a published one the same measurement.

A measured row (a cell's evidence) and a published figure (``evidence/published/*.yaml``, its ``method``)
each carry one value per field of ``FIELDS``. The report sets a measured figure beside a published one only
when their keys are equal (``differences`` is empty); a measured row with no such figure says so, never the
nearest one.

Fields and where a measured row's value comes from:

* ``engine``: ``config.engine.name``.
* ``mode``: ``eager``, ``fuse`` or ``compiled``: ``compiled`` for ``static`` with ``engine.compile=true``;
  the engine's ``mode`` setting where it has one (``static``, ``rust``); a compiling engine (one with a
  ``backend`` setting) is ``compiled`` unless ``backend=none``; otherwise the engine's own (``ENGINE_MODES``).
* ``kept_4bit``: ``none``, ``per-layer table``, ``all tables`` or ``all linears``, from the evidence's
  ``engine.kept_4bit`` (the tables kept packed, and ``linears`` when every linear is); evidence without it
  (a cell that did not run, older evidence, engines that keep nothing) from the config: ``engine.weights=int4``
  keeps every linear, ``table4`` and ``engine.per_layer_table=int4`` the per-layer table.
* ``read_every``: 0 (tokens read back at the end) or k (streamed every k tokens); a served cell's is the
  server's (at least 1).
* ``served``: ``served`` (experiment ``serve``, or an engine measured through an endpoint: ``openai``,
  ``vllm``, ``llamacpp``)
  or ``bare``.
* ``experiment``: what made the figure: ``decode`` (warm calls on the run's prompt; a ``default`` cell's
  decode part), ``recall`` (one of the recall prompts) or ``serve``.
* ``context``, ``dtype``, ``max_new_tokens``: the config's.
* ``twin``: ``ct-text`` or ``emb4``, the checkpoint twin the engine read.
* ``prompt``: ``{"text": <the run's prompt>, "tokens": <its token count>}``.
* ``loader``: ``decodebench``, ``transformers`` (packed at load, unpacked at the first forward) or
  ``transformers_dense`` (unpacked at load) (``engine.loader`` in the evidence or the config).
* ``way``: ``config.way``, the article's row the cell names (``conf/way/``), or None.
* ``batch``: sequences decoded together (``experiment.batch``; 1 in evidence without it). A published figure
  without it is 1: both articles measured one request at a time (the Rust article: "concurrent requests were
  not run on this rig").

Equality, field by field (``differences``):

* a published value ``any`` equals every measured value (the article says the figure does not depend on it);
* a published value that is unknown (absent or null) equals none: the article does not say, so no measured
  row can be shown as the same measurement;
* a measured value that is unknown (the evidence does not record it) equals no published value;
* ``prompt``: every part the article gives (text, token count) must equal the run's;
* ``way``: compared only when the cell names a way; it must be one of the published figure's ways (a figure
  in more than one way's row, such as a range over two notebooks, lists them);
* every other field: equal values (integers compared as integers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from decodebench.evidence import Record

FIELDS = ("engine", "mode", "kept_4bit", "read_every", "served", "experiment", "context", "twin", "dtype",
          "max_new_tokens", "prompt", "loader", "way", "batch")  # fmt: skip
ONE_AT_A_TIME = {"batch": 1}  # a key field's value where a key does not give it (published or older evidence)
ANY = "any"
MODES = ("eager", "fuse", "compiled")
KEPT_4BIT = ("none", "per-layer table", "all tables", "all linears")
SERVED = ("bare", "served")
EXPERIMENTS = ("decode", "recall", "serve")
TWINS = ("ct-text", "emb4")
LOADERS = ("decodebench", "transformers", "transformers_dense")
INTEGERS = ("read_every", "context", "max_new_tokens", "batch")
# Each engine's mode where its config does not say (evidence written before the setting existed, or an engine
# with one mode only): Transformers' generate runs eager, fuse under defer-and-fuse, the stepping engines and
# JAX compile their step.
ENGINE_MODES = {"generate": "eager", "static": "eager", "rust": "eager", "fuse": "fuse", "compiled": "compiled",
                "table4": "compiled", "ring": "compiled", "jax": "compiled", "vllm": "eager",
                "llamacpp": "eager"}  # fmt: skip
ENDPOINT_ENGINES = ("openai", "vllm", "llamacpp")  # engines measured through an OpenAI endpoint: every figure is served
PER_LAYER, EMBED = "embed_tokens_per_layer", "embed_tokens"  # the two vocabulary tables an engine may keep packed
SERVE = "serve"  # the experiment whose figures are served
DECODE, DEFAULT, RECALL = "decode", "default", "recall"  # ``default`` runs decode, then recall
# How an article computed a figure when not as its metric's default (a published figure's ``definition``).
DEFINITIONS = {
    "engine timer": "decode from the first token to the Nth by the engine's own timer (N-1)/decode_s, the prompt "
    "read outside it",
    "after first call": "read right after the first call",
}


def kept_4bit(packed: Iterable[str] | None, engine: dict[str, Any]) -> str:
    """What an engine keeps 4-bit: from the evidence's list of packed weights when it has one, else from its
    config (``engine.weights``, ``table4``, ``engine.per_layer_table``)."""
    if packed is None:
        if engine.get("weights") == "int4":
            return "all linears"
        keeps_table = engine["name"] == "table4" or engine.get("per_layer_table") == "int4"
        return "per-layer table" if keeps_table else "none"
    held = set(packed)
    if "linears" in held:
        return "all linears"
    if {PER_LAYER, EMBED} <= held:
        return "all tables"
    return "per-layer table" if PER_LAYER in held else ("none" if not held else f"tables {', '.join(sorted(held))}")


def mode(engine: dict[str, Any]) -> str | None:
    """``eager``, ``fuse`` or ``compiled`` from an engine's config; None for an engine this module does not know."""
    if engine.get("compile") is True:  # generate compiling its own forward (``static``, ``engine.compile``)
        return "eager" if engine.get("backend") == "none" else "compiled"
    if engine.get("mode"):
        return str(engine["mode"])
    if "backend" in engine:
        return "eager" if engine["backend"] == "none" else "compiled"
    return ENGINE_MODES.get(engine["name"])


def twin(tables_description: Any) -> str | None:
    """Which twin a checkpoint is, from the evidence's ``model.tables_description`` (or a published checkpoint
    name): ``emb4`` (int4 vocabulary tables) or ``ct-text``; None when unstated."""
    if not isinstance(tables_description, str) or not tables_description:
        return None
    return "emb4" if tables_description.endswith("-emb4") or "(-emb4)" in tables_description else "ct-text"


def loader(engine: dict[str, Any], described: dict[str, Any]) -> str:
    """Who built the model: Transformers' own compressed-tensors path or decodebench's loader (every engine
    but those told otherwise: ``engine.loader``, ``compiled`` with ``remove_wrappers=false``)."""
    named = str(described.get("loader") or engine.get("loader") or "")
    if named in LOADERS:
        return named
    if named.startswith("transformers") or engine.get("remove_wrappers") is False:
        return "transformers"
    return "decodebench"


def of_record(record: Record) -> dict[str, Any]:
    """A cell's method key from its evidence (config, engine block, model provenance, prompt tokens)."""
    cfg, engine = record.config, record.config["engine"]
    kept = kept_4bit(record.engine.get("kept_4bit"), engine)
    experiment = cfg["experiment"]["name"]
    served = experiment == SERVE or engine["name"] in ENDPOINT_ENGINES
    read_every = int(cfg.get("read_every", 0))
    read = twin(record.model.get("tables_description"))
    if read is None:  # the cell did not open its checkpoint: the twin its engine would have read
        read = "emb4" if kept != "none" or cfg["model"].get("tables") == "int4" else "ct-text"
    return {
        "engine": engine["name"],
        "mode": mode(engine),
        "kept_4bit": kept,
        "read_every": max(read_every, 1) if served else read_every,
        "served": "served" if served else "bare",
        "experiment": DECODE if experiment == DEFAULT else experiment,
        "context": cfg["context"],
        "twin": read,
        "dtype": cfg["dtype"],
        "max_new_tokens": cfg["max_new_tokens"],
        "prompt": {"text": cfg.get("prompt"), "tokens": record.value("prompt_tokens")},
        "loader": loader(engine, record.engine),
        "way": cfg.get("way"),
        "batch": int(cfg["experiment"].get("batch", 1)),
    }


def _number(value: Any) -> Any:
    """An integer field as an integer (pandas reads counts back as floats)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _prompt_differences(measured: Any, published: Any) -> list[str]:
    measured = measured if isinstance(measured, dict) else {}
    found = []
    for part in ("text", "tokens"):
        if published.get(part) is None:
            continue
        have = _number(measured.get(part))
        if have is None:
            found.append(f"prompt {part}: not recorded in the evidence")
        elif have != published[part]:
            found.append(f"prompt {part}: measured {have!r}, published {published[part]!r}")
    return found


def differences(measured: dict[str, Any], published: dict[str, Any] | None, ignore: Iterable[str] = ()) -> list[str]:
    """Every field on which a measured key and a published one are not the same measurement, each as
    ``field: why``; empty when they are (the rule is in the module's docstring). ``ignore``: fields left
    out (those a cell that did not run cannot record)."""
    if not published:
        return ["the figure has no method key"]
    found = []
    for field in FIELDS:
        if field in ignore:
            continue
        have, want = measured.get(field, ONE_AT_A_TIME.get(field)), published.get(field, ONE_AT_A_TIME.get(field))
        if field == "way":
            ways = want if isinstance(want, list) else [want] if want else []
            if have is not None and have not in ways:
                found.append(f"way: measured {have}, published {' or '.join(ways) or 'run by no way'}")
        elif want == ANY:
            continue
        elif want is None:
            found.append(f"{field}: the article does not say")
        elif field == "prompt":
            found += _prompt_differences(have, want)
        elif have is None:
            found.append(f"{field}: not recorded in the evidence")
        elif _number(have) != want:
            found.append(f"{field}: measured {_number(have)}, published {want}")
    return found


VALUES = {"mode": MODES, "kept_4bit": KEPT_4BIT, "served": SERVED, "experiment": EXPERIMENTS, "twin": TWINS,
          "loader": LOADERS}  # fmt: skip


def check_published(method: dict[str, Any], inferred: dict[str, Any], unknown: dict[str, Any]) -> list[str]:
    """What is wrong with a published figure's key as written in the data: unknown fields, values outside a
    field's set, an inferred or unknown sentence for a field that is not so, an empty sentence."""
    problems = [f"unknown key field {f!r}" for f in method if f not in FIELDS]
    for field, allowed in VALUES.items():
        value = method.get(field)
        if value not in (None, ANY, *allowed):
            problems.append(f"{field}={value!r} is none of {', '.join(allowed)}, any")
    for field in INTEGERS:
        value = method.get(field)
        if value not in (None, ANY) and (not isinstance(value, int) or value < 0):
            problems.append(f"{field}={value!r} must be a whole number, any or null")
    prompt = method.get("prompt")
    if prompt not in (None, ANY) and (not isinstance(prompt, dict) or not set(prompt) <= {"text", "tokens"}):
        problems.append(f"prompt={prompt!r} must be any, null or a mapping of text and/or tokens")
    for name, sentences, wanted in (("inferred", inferred, True), ("unknown", unknown, False)):
        for field, sentence in sentences.items():
            if (method.get(field) is not None) != wanted:
                problems.append(f"{name} names {field}, which is {'unknown' if wanted else 'given'}")
            if not isinstance(sentence, str) or not sentence.strip():
                problems.append(f"{name}.{field} must be the sentence it comes from")
    return problems
