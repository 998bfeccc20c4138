"""The layers point one way, engines come from one factory, and a run is typed objects.

Layers, bottom to top: the core (``decodebench``), ``engines``, ``serving``, ``experiments``, then the
application (``runner``, ``run``, ``serve``, ``scripts``, ``hydra_plugins``). A module imports only its
own layer and those below; ``reports`` reads evidence and imports only the core. Imports inside
functions count too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engines.base import Engine
from engines.open import OpenEngine
from runner import run_cell
from tests.conftest import REPO

LAYERS = {"decodebench": 0, "engines": 1, "serving": 2, "experiments": 3, "runner": 4, "run": 4, "serve": 4,
          "scripts": 4, "hydra_plugins": 4}  # fmt: skip
READERS = {"reports": {"decodebench", "reports"}}  # a package that may import only these
ROOTS = (*LAYERS, *READERS)


def project_modules() -> dict[str, Path]:
    """Every project module by dotted name (packages by their ``__init__``)."""
    found = {}
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] not in ROOTS and rel.with_suffix("").as_posix() not in ROOTS:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (``from a import b`` names ``a.b`` when
    ``b`` is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for name, targets in graph().items():
        root = name.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if root in READERS:
                allowed = other in READERS[root]
            else:
                allowed = other not in READERS and LAYERS[other] <= LAYERS[root]
            if not allowed:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_module_graph_has_no_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                return [*path, node, target]
            if target not in state and (cycle := visit(target, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start, [])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_core_names_no_engine():
    """No engine's name next to the word engine in the core, and no central probing of a group's fields
    (``jax`` the framework and ``fuse`` TorchTPU's mode are not engine names there)."""
    from engines import ENGINES

    text = "\n".join(p.read_text() for p in (REPO / "decodebench").glob("*.py"))
    names = "|".join(ENGINES)
    named = re.findall(rf"engine[ ._=a-z]*[=\"' ]({names})\b", text)
    assert not named, f"decodebench/ names engines {named}: engine knowledge belongs in engines/"
    assert not re.search(r"getattr\(cfg\.(engine|experiment)", text)


def constructions() -> dict[str, int]:
    """Where the project (not its tests) calls ``open_engine`` or builds an engine from its class."""
    found: dict[str, int] = {}
    for name, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if called in ("open_engine", "engine_cls") or (name == "engines.open" and called == "cls") or (
                    isinstance(func, ast.Subscript) and getattr(func.value, "id", "") == "ENGINES"
                ):
                    key = f"{name}:{called or 'ENGINES[...]'}"
                    found[key] = found.get(key, 0) + 1
    return found


def test_engines_are_built_in_one_place_and_opened_by_the_runner_and_the_server():
    sites = constructions()
    assert sites.pop("engines.open:cls") == 1, "the factory's OpenEngine.load builds the engine"
    assert sites == {"runner:open_engine": 1, "serve:open_engine": 1}, sites


def test_a_cell_builds_its_engine_through_the_factory_as_typed_objects(cell_cfg, tiny, monkeypatch):
    built = []
    original = Engine.__init__

    def spy(self, ctx, checkpoint, tokenizer):
        caller = sys._getframe(1)
        built.append((type(self).__name__, caller.f_code.co_name, type(caller.f_locals.get("self")).__name__,
                      type(ctx.engine_cfg).__name__, type(ctx.model_cfg).__name__))  # fmt: skip
        original(self, ctx, checkpoint, tokenizer)

    monkeypatch.setattr(Engine, "__init__", spy)
    record = run_cell(cell_cfg("engine=static", "experiment=decode", "max_new_tokens=2", "repeats=1"))
    assert record["status"] == "ok", record["reason"]
    assert built == [("StaticEngine", "load", OpenEngine.__name__, "StaticEngineConfig", "ModelConfig")]


def test_a_setting_given_once_beside_a_sweep_applies_where_taken_and_is_refused_elsewhere(tmp_path, tiny, cache_dir):
    command = [sys.executable, "run.py", "-m", "engine=static,generate", "engine.mode=eager", "experiment=decode",
               "max_new_tokens=2", "repeats=1", "device=cpu", f"cache_dir={cache_dir}", "sweep=once",
               f"evidence_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Could not override" not in proc.stderr
    records = {p.stem.split("-")[0]: p.read_text() for p in (tmp_path / "once").glob("*.json")}
    assert '"status": "ok"' in records["static"]
    assert '"status": "failed"' in records["generate"]
    assert "engine generate has no setting engine.mode" in records["generate"]
    assert "engine.mode is a setting of rust, static" in records["generate"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine.peice=64", "engine generate has no setting engine.peice"),
        ("experiment.reps=3", "experiment default has no setting experiment.reps"),
    ],
)
def test_a_mistyped_setting_is_refused_by_name(cell_cfg, override, message):
    record = run_cell(cell_cfg(override))
    assert record["status"] == "failed" and message in record["reason"]
