"""The method's contract: a timed call writes exactly N tokens, even when the greedy text reaches EOS.

The early-EOS checkpoint is the tiny one in the real ``-ct-text`` layout with one change: the first
token the model writes at step 3 or later that it has not written before is added to its EOS ids,
in config.json and generation_config.json, as a real checkpoint names its stop set.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from decodebench.checkpoint import load_model, load_tokenizer, open_checkpoint
from decodebench.prompts import prompt_ids
from engines.base import Generation
from engines.generate import GenerateEngine, greedy_generate
from runner import run_cell
from tests.conftest import make_cfg

N = 8
FIRST_STOP = 2  # the EOS token is the third one written, or a later one
ENGINES = ("generate", "static", "compiled", "table4", "ring", "rust")


def add_eos(folder: Path, token: int) -> None:
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        data = json.loads(path.read_text())
        node = data.get("text_config", data) if name == "config.json" else data
        eos = node["eos_token_id"]
        node["eos_token_id"] = [*(eos if isinstance(eos, list) else [eos]), token]
        path.write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="module")
def early_eos(tiny, tmp_path_factory) -> tuple[Path, Path, list[int], int]:
    """Both twins with an EOS id the greedy output reaches early; the greedy tokens; the EOS index."""
    root = tmp_path_factory.mktemp("early-eos")
    w4a16, emb4 = root / "ct-text", root / "ct-text-emb4"
    shutil.copytree(tiny.w4a16, w4a16)
    shutil.copytree(tiny.emb4, emb4)
    ckpt = open_checkpoint(w4a16)
    model, _ = load_model(ckpt, torch.float32, torch.device("cpu"))
    ids = prompt_ids(load_tokenizer(ckpt), make_cfg().prompt, chat_template=True)
    tokens = greedy_generate(model, ids, N).tokens
    stop = next(i for i in range(FIRST_STOP, N - 1) if tokens[i] not in tokens[:i] + ckpt.eos_ids)
    for folder in (w4a16, emb4):
        add_eos(folder, tokens[stop])
    assert tokens[stop] in open_checkpoint(w4a16).eos_ids
    return w4a16, emb4, tokens, stop


def early_eos_cell(cell_cfg, early_eos, engine: str, *extra: str) -> list[str]:
    w4a16, emb4, _, _ = early_eos
    overrides = [
        f"engine={engine}",
        "experiment=decode",
        "model.source=hub",
        f"model.path={w4a16}",
        f"model.emb4_path={emb4}",
        "dtype=float32",
        f"max_new_tokens={N}",
        "repeats=1",
        *extra,
    ]
    if engine in ("compiled", "table4", "ring"):
        overrides.append("engine.backend=eager")
    return cell_cfg(*overrides)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_writes_exactly_n_tokens_past_an_early_eos(cell_cfg, early_eos, engine):
    if engine == "rust":
        pytest.importorskip("decodebench_rs", reason="the rust engine is not built (make setup)")
    record = run_cell(early_eos_cell(cell_cfg, early_eos, engine))
    assert record["status"] == "ok", record["reason"]
    out, (_, _, expected, stop) = record["outputs"], early_eos
    assert out["generated_ids"] == expected and len(expected) == N  # Transformers' own greedy tokens
    assert out["answer_ids"] == expected[:stop] and out["finish_reason"] == "stop"
    assert record["measurements"]["max_new_tokens"]["value"] == N


def test_greedy_generate_ignores_the_models_own_eos(early_eos):
    w4a16, _, expected, _ = early_eos
    ckpt = open_checkpoint(w4a16)
    model, _ = load_model(ckpt, torch.float32, torch.device("cpu"))
    assert model.generation_config.eos_token_id == ckpt.eos_ids  # the stop set is there, and not applied
    ids = prompt_ids(load_tokenizer(ckpt), make_cfg().prompt, chat_template=True)
    assert greedy_generate(model, ids, N).tokens == expected


def test_a_call_with_another_count_fails_the_cell(cell_cfg, early_eos, monkeypatch):
    original = GenerateEngine.generate

    def stops_at_eos(self, prompt_ids, max_new_tokens, *, return_logits=False) -> Generation:
        gen = original(self, prompt_ids, max_new_tokens, return_logits=return_logits)
        return Generation(gen.tokens[: stop + 1])

    stop = early_eos[3]
    monkeypatch.setattr(GenerateEngine, "generate", stops_at_eos)
    record = run_cell(early_eos_cell(cell_cfg, early_eos, "generate"))
    assert record["status"] == "failed"
    assert f"engine generate wrote {stop + 1} tokens where the method asks for exactly {N}" in record["reason"]
    assert "decode_tok_s" not in record["measurements"]
