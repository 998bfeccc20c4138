"""Bad input found by trying decodebench as a new user would: each is a clear error naming the value
and the rule, and nothing is written where it should not be."""

from __future__ import annotations

import pytest

from runner import run_cell


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
