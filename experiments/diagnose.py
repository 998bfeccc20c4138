"""Experiment ``diagnose``: the Colab article's claims about loading the repack through Transformers,
checked on this device and checkpoint (article 003, Steps 3, 6, 7 and 12). No engine runs; nothing
is timed.

The ``-ct-text`` twin goes through Transformers' own compressed-tensors loading, the way the article's
notebooks load it (``decodebench.checkpoint.load_transformers``), twice, one model at a time:

1. With the key mapping and ``device_map=<device>``: names matched (the stored names Transformers'
   loading info does not call unexpected) and tensors on the device; memory (``device.memory_now``,
   naming its counter) and packed weights after load, after a forward pass of the prompt and after a
   second one; the dtype of the formerly packed weights afterwards; modules whose forward
   compressed-tensors' dispatch wrapped; the decode step over a StaticCache (``engines.compiled``,
   prompt read eagerly first) compiled with ``fullgraph=True``, which raises at the first graph break:
   TorchDynamo's reason and the innermost frame's file:line; then ``remove_dispatch``, the wrapped
   modules after it, and the step's first graph break after it.
2. Without the key mapping, on the host: names matched as stored; then ``model.to(device)`` and the
   tensors on the device.

Step 12 needs no weights: Transformers' StaticCache asked for ``cache_slots`` positions, the slots it
gives each layer type (layers that reuse another layer's K/V hold none).

Each claim is recorded as the article states it, with what it predicts for this checkpoint's shape
(``expected``), what was measured and whether it ``holds``.
"""

from __future__ import annotations

import gc
import re
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
from compressed_tensors.offload.dispatch import remove_dispatch
from transformers import StaticCache

from decodebench.checkpoint import load_tokenizer, load_transformers, resolve, stored_names
from decodebench.config import ConfigError, ExperimentConfig, at_least
from decodebench.device import Device
from decodebench.evidence import MemoryReading, Record, scalar
from decodebench.prompts import prompt_ids
from engines.compiled import dispatch_wrapped, forward_logits, forward_replaced, static_cache
from engines.stepping import compile_backend
from experiments.cell import Cell
from experiments.common import Result, quiet


@dataclass
class DiagnoseExperimentConfig(ExperimentConfig):
    """The article's claims about loading the repack through Transformers (article 003, Steps 3, 6, 7, 12).

    ``backend``: what compiles the step whose first graph break is reported; TorchDynamo finds graph
    breaks while it traces, before any backend runs, so ``eager`` finds the same break at a fraction
    of the cost (``auto``: the device's own backend). ``cache_slots``: the StaticCache length asked
    for in the Step 12 check (the article's 4,352).
    """

    backend: str = "eager"
    cache_slots: int = 4352

    def __post_init__(self) -> None:
        at_least("experiment.", self, 1, "cache_slots")


def headline(record: Record) -> str:
    """The cell's one line: how many of the article's claims hold."""
    held = sum(c["holds"] for c in record.outputs["claims"])
    synthetic = " (synthetic weights)" if record.model.get("synthetic") else ""
    return f"diagnose: {held} of {len(record.outputs['claims'])} claims hold{synthetic}"

ARTICLE_BREAK = ("Data pointer comparison", "compressed_tensors/offload/utils.py")  # Step 7's break and its file
NO_BREAK = "no graph break"


@dataclass(frozen=True)
class Claim:
    """One line of the article's claims table: what it says, expected for this checkpoint, measured."""

    key: str
    step: str
    claim: str
    expected: Any
    measured: Any
    holds: bool


def claim(key: str, step: str, text: str, expected: Any, measured: Any, holds: bool | None = None) -> Claim:
    """A claim that holds when ``measured == expected``, unless ``holds`` says otherwise."""
    return Claim(key, step, text, expected, measured, measured == expected if holds is None else holds)


def tensors_on(model: torch.nn.Module, device: Device) -> tuple[int, int]:
    """(tensors on ``device``, all tensors): parameters and buffers, each tensor once."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(t.device.type == device.torch_device.type for t in tensors), len(tensors)


def packed(model: torch.nn.Module) -> int:
    """Weights still held 4-bit packed (compressed-tensors' ``weight_packed``)."""
    named = (*model.named_parameters(), *model.named_buffers())
    return sum(1 for name, _ in named if name.endswith("weight_packed"))


def matched(stored: list[str], info: dict[str, Any]) -> int:
    """Stored tensors the load matched to the model: those Transformers did not report unexpected."""
    return len(stored) - len(info["unexpected_keys"])


def first_break(model: Any, ids: torch.Tensor, slots: int, backend: str) -> dict[str, Any]:
    """The decode step after the prompt (read eagerly into a StaticCache) compiled with ``fullgraph=True``
    and called once: TorchDynamo raises at the first graph break. Its reason and innermost frame, or
    ``NO_BREAK`` when the step traced as one graph."""
    cache = static_cache(model.config, slots)
    n = ids.shape[1]
    forward_logits(model, cache, ids, torch.arange(n, device=ids.device)[None])
    torch._dynamo.reset()
    step = torch.compile(partial(forward_logits, model, cache), backend=backend, fullgraph=True, dynamic=False)
    try:
        step(ids[:, -1:], torch.tensor([[n]], device=ids.device))
    except torch._dynamo.exc.Unsupported as exc:
        frame = exc.real_stack[-1] if exc.real_stack else None
        return {
            "reason": getattr(exc, "gb_type", None) or str(exc).splitlines()[0],
            "file": frame.filename if frame else None,
            "line": frame.lineno if frame else None,
            "function": frame.name if frame else None,
            "code": frame.line if frame else None,
        }
    finally:
        torch._dynamo.reset()
    return {"reason": NO_BREAK}


def where(brk: dict[str, Any]) -> str:
    """A break as the compiler names it: reason, then file:line (from the package folder on)."""
    if brk["reason"] == NO_BREAK:
        return NO_BREAK
    file = re.split(r"[/\\](?:site|dist)-packages[/\\]", str(brk["file"]))[-1]
    return f"{brk['reason']} at {file}:{brk['line']}"


def is_article_break(brk: dict[str, Any]) -> bool:
    return brk["reason"] == ARTICLE_BREAK[0] and ARTICLE_BREAK[1] in str(brk.get("file", "")).replace("\\", "/")


def cache_slots(config: Any, asked: int) -> dict[str, dict[str, Any]]:
    """Slots Transformers' StaticCache gives each layer type when asked for ``asked`` (lazy: nothing allocated)."""
    cache = StaticCache(config=config, max_cache_len=asked)
    out: dict[str, dict[str, Any]] = {}
    for kind, layer in zip(config.layer_types, cache.layers, strict=False):
        slots = getattr(layer, "max_cache_len", None)
        if slots is None:
            continue  # reuses an earlier layer's K/V
        entry = out.setdefault(kind, {"layers": 0, "slots": [], "class": type(layer).__name__})
        entry["layers"] += 1
        entry["slots"] = sorted({*entry["slots"], int(slots)})
    return out


def only(values: list[Any]) -> Any:
    """One value when all are the same, else the list."""
    return values[0] if len(values) == 1 else values


@dataclass
class Findings:
    """What the two loads found (counts, memory readings, breaks), before they become claims."""

    stored: list[str]
    loads: int = 0
    total: int = 0
    matched_mapped: int = 0
    matched_as_stored: int = 0
    on_device_map: int = 0
    on_device_after_to: int = 0
    dtypes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    memory: dict[str, MemoryReading] = field(default_factory=dict)
    breaks: dict[str, dict[str, Any]] = field(default_factory=dict)


def mapped_on_device(cell: Cell, ckpt: Any, ids: torch.Tensor, slots: int, backend: str, found: Findings) -> None:
    """Load 1: key mapping, ``device_map=<device>``; Steps 3, 6 and 7 (the model is freed after)."""
    device = cell.device
    gc.collect()
    found.memory["memory_before_load"] = device.memory_now()
    with quiet():
        model, info = load_transformers(ckpt, cell.cfg.dtype.torch, str(device.torch_device), mapped=True)
    found.memory["memory_after_load"] = device.memory_now()
    found.matched_mapped = matched(found.stored, info)
    found.loads = len(set(model.state_dict()) - set(getattr(model, "all_tied_weights_keys", None) or {}))
    found.on_device_map, found.total = tensors_on(model, device)
    packed_modules = [name for name, m in model.named_modules() if hasattr(m, "weight_packed")]
    counts = found.counts
    counts.update(packed_weights_after_load=packed(model), wrapped_modules_at_load=dispatch_wrapped(model))
    with torch.inference_mode():
        for k in (1, 2):
            with quiet():
                model(input_ids=ids, use_cache=False)
            found.memory[f"memory_after_forward_{k}"] = device.memory_now()
            counts[f"packed_weights_after_forward_{k}"] = packed(model)
        found.dtypes = sorted({str(model.get_submodule(name).weight.dtype) for name in packed_modules})
        counts.update(wrapped_modules=dispatch_wrapped(model), forward_replaced_modules=forward_replaced(model))
        with quiet():
            found.breaks["wrappers_on"] = first_break(model, ids, slots, backend)
        remove_dispatch(model)
        counts["wrapped_modules_after_remove_dispatch"] = dispatch_wrapped(model)
        counts["forward_replaced_modules_after_remove_dispatch"] = forward_replaced(model)
        with quiet():
            found.breaks["wrappers_off"] = first_break(model, ids, slots, backend)
    del model
    gc.collect()


def as_stored_then_to(cell: Cell, ckpt: Any, found: Findings) -> None:
    """Load 2: no key mapping, on the host, then ``model.to(device)``; Step 3 (the model is freed after)."""
    with quiet():
        model, info = load_transformers(ckpt, cell.cfg.dtype.torch, None, mapped=False)
    found.matched_as_stored = matched(found.stored, info)
    model.to(cell.device.torch_device)
    found.on_device_after_to, _ = tensors_on(model, cell.device)
    del model
    gc.collect()


def claims(
    found: Findings, dev: str, dtype: torch.dtype, layers: dict[str, Any], asked: int, window: int
) -> list[Claim]:
    """The article's claims, in its order, each with what it predicts for this checkpoint."""
    counts, on, off = found.counts, found.breaks["wrappers_on"], found.breaks["wrappers_off"]
    cache = f"StaticCache(max_cache_len={asked}):"
    return [
        claim(
            "names",
            "Step 3",
            "tensor names matched as stored / with the key mapping",
            [0, found.loads],
            [found.matched_as_stored, found.matched_mapped],
        ),
        claim(
            "to_device", "Step 3", f"tensors on {dev} after model.to('{dev}')", found.total, found.on_device_after_to
        ),
        claim("device_map", "Step 3", f"tensors on {dev} with device_map='{dev}'", found.total, found.on_device_map),
        claim(
            "packed_after_load",
            "Step 6",
            "packed weights present after load",
            True,
            counts["packed_weights_after_load"] > 0,
        ),
        claim(
            "packed_after_forward_1",
            "Step 6",
            "packed weights present after forward pass 1 (unpacked at the first forward)",
            False,
            counts["packed_weights_after_forward_1"] > 0,
        ),
        claim(
            "packed_after_forward_2",
            "Step 6",
            "packed weights present after forward pass 2",
            False,
            counts["packed_weights_after_forward_2"] > 0,
        ),
        claim("weight_dtype", "Step 6", "weight dtype afterwards", str(dtype), only(found.dtypes)),
        claim(
            "wrapped",
            "Step 7",
            "modules with a wrapped forward (compressed-tensors' dispatch)",
            "more than 0",
            counts["wrapped_modules"],
            counts["wrapped_modules"] > 0,
        ),
        claim(
            "first_break",
            "Step 7",
            "fullgraph=True raises at the first graph break",
            f"{ARTICLE_BREAK[0]} in {ARTICLE_BREAK[1]}",
            where(on),
            is_article_break(on),
        ),
        claim(
            "wrapped_after_remove_dispatch",
            "Step 7",
            "modules with a wrapped forward after remove_dispatch",
            0,
            counts["wrapped_modules_after_remove_dispatch"],
        ),
        claim(
            "break_after_remove_dispatch",
            "Step 8",
            "with the wrappers removed the step traces as one graph (fullgraph=True)",
            NO_BREAK,
            where(off),
        ),
        claim(
            "full_slots",
            "Step 12",
            f"{cache} full-attention layers hold the slots asked",
            asked,
            only(layers.get("full_attention", {}).get("slots", [None])),
        ),
        claim(
            "sliding_slots",
            "Step 12",
            f"{cache} sliding layers hold min(sliding_window, slots asked)",
            min(window, asked),
            only(layers.get("sliding_attention", {}).get("slots", [None])),
        ),
    ]


def run(cell: Cell) -> Result:
    cfg, device = cell.cfg, cell.device
    backend = compile_backend(cfg.experiment.backend, device)
    if backend is None:
        raise ConfigError("experiment.backend=none: diagnose compiles the step to find its graph breaks")
    ckpt = resolve(cfg.model, "bf16", cfg.cache_dir)
    ids = prompt_ids(load_tokenizer(ckpt), cfg.prompt, cfg.chat_template)
    window = ckpt.config.sliding_window
    slots = min(cfg.context, window)
    if len(ids) + 1 > slots:
        raise ConfigError(
            f"the prompt is {len(ids)} tokens; diagnose's compiled step needs one more slot within both "
            f"context={cfg.context} and sliding_window={window} (the StaticCache fix's range)"
        )
    found = Findings(stored=stored_names(ckpt.path))
    mapped_on_device(cell, ckpt, torch.tensor([ids], device=device.torch_device), slots, backend, found)
    as_stored_then_to(cell, ckpt, found)
    asked = cfg.experiment.cache_slots
    layers = cache_slots(ckpt.config, asked)
    result = Result(model=ckpt.provenance, timers={"diagnose": "not timed"})
    result.outputs.update(
        claims=[asdict(c) for c in claims(found, device.kind, cfg.dtype.torch, layers, asked, window)],
        breaks=found.breaks,
        cache_slots={"asked": asked, "layers": layers},
        weight_dtypes=found.dtypes,
        prompt_tokens=len(ids),
        backend=backend,
    )
    stored_less_unexpected = "stored names less Transformers' unexpected keys"
    result.measurements.update(found.memory)
    result.measurements.update(
        tensors_stored=scalar(len(found.stored), "count", method="safetensors headers"),
        tensors_model_loads=scalar(found.loads, "count", method="model.state_dict() keys less tied ones"),
        tensors_matched_as_stored=scalar(found.matched_as_stored, "count", method=stored_less_unexpected),
        tensors_matched_mapped=scalar(found.matched_mapped, "count", method=stored_less_unexpected),
        tensors_total=scalar(found.total, "count", method="parameters and buffers, each tensor once"),
        tensors_on_device_after_to=scalar(found.on_device_after_to, "count", device=device.kind),
        tensors_on_device_device_map=scalar(found.on_device_map, "count", device=device.kind),
        **{name: scalar(value, "count") for name, value in found.counts.items()},
    )
    return result
