"""Bad input found by trying decodebench as a new user would: each is a clear error naming the value
and the rule, and nothing is written where it should not be."""

from __future__ import annotations

import huggingface_hub
import pytest

from runner import run_cell, typed_config
from tests.conftest import REPO, make_cfg

EMB4_HUB_ID = "xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text-emb4"  # model=e2b-w4a16's -emb4 twin


def test_a_sweep_name_that_is_a_path_is_refused_and_writes_nothing(cell_cfg, tmp_path, capsys):
    for sweep in ("../../somewhere", "a/b", "..", ".hidden"):
        record = run_cell(cell_cfg(f"sweep={sweep}"))
        assert record["status"] == "failed"
        assert f"sweep={sweep!r} is not a folder name" in record["reason"] and "no '/', no '..'" in record["reason"]
    assert "[failed] nothing written" in capsys.readouterr().err
    assert not (tmp_path.parent / "somewhere").exists(), "nothing outside evidence_dir"
    assert not list(tmp_path.rglob("*.json")), "and nothing inside it"


def test_a_negative_price_is_refused(cell_cfg):
    record = run_cell(cell_cfg("hardware=cpu", "hardware.price_usd_per_hour=-1"))
    assert record["status"] == "failed"
    assert "hardware.price_usd_per_hour=-1.0 must be positive" in record["reason"]


@pytest.mark.parametrize("facts", sorted(p.stem for p in (REPO / "conf" / "hardware").glob("*.yaml")))
def test_every_hardware_facts_file_composes_and_a_price_names_its_source(facts):
    hardware = typed_config(make_cfg(f"hardware={facts}")).hardware
    assert hardware.name == facts
    if hardware.price_usd_per_hour is not None:
        assert len(hardware.price_source) > 40, f"hardware={facts}: a price with no source ({hardware.price_source!r})"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.num_hidden_layers=0", "model.num_hidden_layers=0 must be at least 1"),
        ("model.sliding_window=0", "model.sliding_window=0 must be at least 1"),
        ("model.num_key_value_heads=3", "must be a multiple of model.num_key_value_heads=3"),
        ("model.head_dim=31", "model.head_dim=31 must be even"),
        ("model.num_kv_shared_layers=5", "model.num_kv_shared_layers=5 must leave"),
    ],
)
def test_synthetic_shape_fields_are_checked_before_building(cell_cfg, override, message):
    record = run_cell(cell_cfg(override, "model.name=bad-shape"))
    assert record["status"] == "failed" and message in record["reason"]
    assert "Traceback" not in record["reason"]


def test_inductor_options_with_another_backend_are_refused_by_name(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=ring", "engine.backend=eager", "+engine.inductor.cpp_wrapper=true"))
    assert record["status"] == "failed"
    assert "engine.inductor={'cpp_wrapper': True} has no effect with backend eager" in record["reason"]


@pytest.mark.parametrize("engine", ["generate", "static"])
def test_read_every_is_refused_by_name_where_the_engine_does_not_read_back_itself(cell_cfg, tiny, engine):
    record = run_cell(cell_cfg(f"engine={engine}", "read_every=3", "max_new_tokens=4"))
    assert record["status"] == "failed"
    assert f"read_every=3 has no effect on engine {engine}" in record["reason"]
    assert "compiled, jax, ring, rust, table4" in record["reason"]
    assert "Traceback" not in record["reason"]
    streamed = run_cell(cell_cfg(f"engine={engine}", "read_every=1", "max_new_tokens=4", "repeats=1"))
    assert streamed["status"] == "ok", streamed["reason"]


@pytest.mark.parametrize("folder", ["ct-text twin", "empty folder"])
def test_an_emb4_path_that_is_no_emb4_twin_says_what_it_lacks(cell_cfg, tiny, tmp_path, folder):
    """engine.weights=int4 looks every vocabulary table up packed: a model.emb4_path without them is named as no
    -emb4 twin, with the tensors it lacks and what a twin stores (not a KeyError, nor 'not a checkpoint folder')."""
    empty = tmp_path / "empty"
    empty.mkdir()
    path = tiny.w4a16 if folder == "ct-text twin" else empty
    record = run_cell(cell_cfg("engine=ring", "engine.weights=int4", "model=e2b-w4a16", f"model.path={tiny.w4a16}",
                               f"model.emb4_path={path}"))  # fmt: skip
    reason = record["reason"]
    assert record["status"] == "failed" and f"model.emb4_path={path} is not an -emb4 twin" in reason
    assert "no int4-packed vocabulary table (embed_tokens.weight_packed, embed_tokens_per_layer.weight_packed" in reason
    assert "an -emb4 twin (the -ct-text-emb4 repack) stores embed_tokens, embed_tokens_per_layer and lm_head" in reason


def test_an_emb4_twin_out_of_reach_names_model_emb4_path_not_model_path(cell_cfg, tiny, tmp_path, monkeypatch):
    """The ring keeps its per-layer table 4-bit, read from the -emb4 twin: given only model.path, with the hub out of
    reach (offline, an empty hub cache: it fails at once), the error says how to pass the twin and how to run
    without it."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    record = run_cell(cell_cfg("engine=ring", "model=e2b-w4a16", f"model.path={tiny.w4a16}"))
    reason = record["reason"]
    assert record["status"] == "failed" and f"could not fetch {EMB4_HUB_ID} from the hub" in reason
    assert "read from the -emb4 twin (model.path is the -ct-text one)" in reason
    assert "pass model.emb4_path=<folder>, or run without the twin: engine.per_layer_table=bf16" in reason
    assert "model.path=<folder>" not in reason
