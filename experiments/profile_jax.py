"""JAX's side of ``experiment=profile``: XLA's operations as ``jax.profiler`` traces them, named by the model.

XLA:CPU runs a compiled program as a list of operations (thunks: fusions, dots, copies); the profiler's trace
records each one by its HLO instruction name, and the compiled program's text (``as_text``) says which of the
model's named scopes each instruction came from (``engines/jax_model.py``: every linear under its own name,
``attention``, ``embed``, ``logits``). A fusion without metadata of its own takes its fused computation's
root's, else the first scope inside it.

XLA runs independent operations at once on its thread pool, so operation times are not added up: the call's
wall time is cut at every operation's start and end, and each slice goes evenly to the operations running
in it; a slice with none running but inside a dispatch on the calling thread (``PjitFunction``) is
``host: dispatch and wrappers``. What no slice covers is left to ``host: between operators`` (the module
docstring of ``experiments/profile.py``).
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from experiments.profile_classes import DISPATCH, WEIGHT_KINDS

SCOPES = {"attention": "attention", "embed": "table lookups", "logits": "logits and argmax"} | {
    end: kind for kind, ends in WEIGHT_KINDS.items() for end in ends
}
OTHER = "norms and elementwise"
COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
INSTRUCTION = re.compile(r"^\s+(ROOT )?%(\S+) = ")
CALLS = re.compile(r"calls=%([^\s,}]+)")
OP_NAME = re.compile(r'op_name="([^"]*)"')


def scope_class(op_name: str | None) -> str:
    """The class of an operation from its scope path (``jit(decode_step)/up_proj/reduce_sum``): the
    innermost scope the model names, else norms and elementwise."""
    for part in reversed((op_name or "").split("/")):
        if part in SCOPES:
            return SCOPES[part]
    return OTHER


def instruction_classes(text: str) -> dict[str, str]:
    """Every instruction of a compiled HLO module's text -> its class (module docstring: fusions)."""
    own: dict[str, str | None] = {}
    calls: dict[str, str] = {}
    bodies: dict[str, list[str]] = defaultdict(list)
    roots: dict[str, str] = {}
    computation = ""
    for line in text.splitlines():
        if header := COMPUTATION.match(line):
            computation = header.group(1)
        elif instruction := INSTRUCTION.match(line):
            name = instruction.group(2)
            bodies[computation].append(name)
            if instruction.group(1):
                roots[computation] = name
            own[name] = (m.group(1) if (m := OP_NAME.search(line)) else None)
            if m := CALLS.search(line):
                calls[name] = m.group(1)

    def scope(name: str, depth: int = 0) -> str | None:
        if own.get(name) or name not in calls or depth > 8:
            return own.get(name)
        body = bodies[calls[name]]
        ordered = [roots.get(calls[name]), *body]
        return next((s for s in (scope(n, depth + 1) for n in ordered if n) if s), None)

    return {name: scope_class(scope(name)) for name in own}


def wall_split(events: list[dict[str, Any]], classes: dict[str, str]) -> dict[str, float]:
    """Seconds of the traced wall time by class (module docstring): ``events`` are a Chrome trace's complete
    events (``ts``, ``dur`` in microseconds); operations are the ones ``classes`` names."""
    marks: list[tuple[float, int, str]] = []  # (time, +1 start / -1 end, label)
    for event in events:
        name = event.get("name", "")
        label = classes.get(name) or (DISPATCH if name.startswith("PjitFunction") else None)
        if event.get("ph") == "X" and label:
            marks += [(event["ts"], 1, label), (event["ts"] + event.get("dur", 0), -1, label)]
    marks.sort()
    running: Counter[str] = Counter()
    out: dict[str, float] = defaultdict(float)
    for i, (at, step, label) in enumerate(marks):
        running[label] += step
        if i + 1 == len(marks) or (span := marks[i + 1][0] - at) <= 0:
            continue
        ops = {k: n for k, n in running.items() if n > 0 and k != DISPATCH}
        if ops:
            share = span / sum(ops.values())
            for k, n in ops.items():
                out[k] += share * n / 1e6
        elif running[DISPATCH] > 0:
            out[DISPATCH] += span / 1e6
    return out


class JaxProfile:
    """One JAX engine's calls under ``jax.profiler.trace``, attributed by class."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.classes: dict[str, str] = {}
        for text in engine.program_texts().values():  # the step's names win where two programs share one
            self.classes.update(instruction_classes(text))

    @staticmethod
    def compiling() -> AbstractContextManager[Any]:
        """Where the cell compiles and runs: as it is (XLA's operations are the trace's events already)."""
        return nullcontext()

    def prepare(self, one: Callable[[], Any], many: Callable[[], Any], trace: Path | None) -> None:
        """The raw trace (gzip) of the N-token call ``many`` once under the profiler to ``trace``; no call without
        one, and none of the 1-token ``one`` (the classes come from the programs' text, read when this was made)."""
        if trace is not None:
            self.run(many, trace)

    def run(self, call: Callable[[], Any], trace: Path | None = None) -> dict[str, float]:
        """``call`` once under the profiler: wall seconds by class; the raw trace (gzip) to ``trace``."""
        import jax.profiler

        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # Python frames would nest every event in the caller's thread
        log = logging.getLogger("jax._src.profiler")  # its INFO lines about writing the trace, per call
        level = log.level
        log.setLevel(logging.WARNING)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                with jax.profiler.trace(tmp, create_perfetto_trace=True, profiler_options=options):
                    call()
                raw = next(Path(tmp).rglob("perfetto_trace.json.gz"))
                if trace is not None:
                    shutil.copyfile(raw, trace)
                events = json.loads(gzip.decompress(raw.read_bytes()))["traceEvents"]
        finally:
            log.setLevel(level)
        return wall_split(events, self.classes)

    def read_bytes(self) -> dict[str, int]:
        """Bytes the model's own arrays make each class read per token (the KV cache is the engine's: ``run``
        adds it): every linear's arrays as held (4-bit words and scales where kept so), one row of each
        vocabulary table."""
        import jax

        reads: dict[str, int] = defaultdict(int)
        for name, value in self.engine.params.items():
            module = name.removesuffix(".weight").rpartition(".")[2]
            kind = next((k for k, ends in WEIGHT_KINDS.items() if module in ends), None)
            if kind:
                reads[kind] += sum(a.nbytes for a in jax.tree_util.tree_leaves(value))
            elif module in ("embed_tokens", "embed_tokens_per_layer"):
                reads["table lookups"] += value.nbytes // value.shape[0]
        return dict(reads)
