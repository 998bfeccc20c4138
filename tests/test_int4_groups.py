"""The checkpoint's quantization args decide how int4 weights are read: a checkpoint quantized in groups
of 64 runs every int4 engine at parity (and the dense ones), a group size a kernel does not take is
refused with the size named, and arguments no engine reads (8 bits, asymmetric) are refused at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from decodebench.checkpoint import CheckpointError, load_model, open_checkpoint
from decodebench.synthetic import SyntheticCheckpoint, ensure_synthetic
from engines import int4_cpu
from runner import run_cell
from tests.conftest import make_cfg
from tests.test_engines import parity

PLE_64 = "model.hidden_size_per_layer_input=64"  # tiny's per-layer inputs are 32 wide: too narrow for groups of 64


def synthetic_in_groups(cache_dir, group_size: int) -> SyntheticCheckpoint:
    return ensure_synthetic(make_cfg(PLE_64).model, cache_dir, group_size=group_size)


def as_paths(ckpt: SyntheticCheckpoint) -> tuple[str, ...]:
    """Overrides that run a cell on both twins of ``ckpt`` (a checkpoint read from its folders)."""
    return ("model.source=hub", f"model.path={ckpt.w4a16}", f"model.emb4_path={ckpt.emb4}")


@pytest.fixture(scope="module")
def groups_of_64(cache_dir) -> SyntheticCheckpoint:
    return synthetic_in_groups(cache_dir, 64)


def test_the_builder_quantizes_in_the_group_size_asked(groups_of_64):
    for twin in (groups_of_64.w4a16, groups_of_64.emb4):
        config = json.loads((twin / "config.json").read_text())
        assert {g["weights"]["group_size"] for g in config["quantization_config"]["config_groups"].values()} == {64}
    _, packed = load_model(open_checkpoint(groups_of_64.emb4), torch.float32, torch.device("cpu"), ("lm_head",))
    head = packed["lm_head"]
    assert head.group_size == 64 and head.scale.shape == (head.shape[0], head.shape[1] // 64)


@pytest.mark.parametrize(
    "engine",
    [("compiled", "int4"), ("table4", "int4"), ("ring", "int4"), ("jax", "int4"), ("generate", None)],
    ids=lambda e: f"{e[0]}-{e[1] or 'dense'}",
)
def test_a_checkpoint_in_groups_of_64_runs_at_parity(cell_cfg, groups_of_64, engine):
    name, weights = engine
    if name == "jax":
        pytest.importorskip("jax", reason="the jax extra is not installed (make setup installs it)")
    record = parity(cell_cfg, name, *as_paths(groups_of_64), *([f"engine.weights={weights}"] if weights else []))
    out = record["outputs"]["prompt"]
    assert record["outputs"]["verdict"] == "pass" and out["first_difference"] is None and out["kl_max"] < 1e-6
    assert Path(record["model"]["path"]).parent == groups_of_64.root  # the cell read this checkpoint


def test_a_group_size_the_cpu_kernel_does_not_take_is_skipped_with_the_size_named(cell_cfg, cache_dir):
    """Groups of 16: ``int4_rows`` takes them (bf16 on a CPU that runs it), aten's kernel does not (float32)."""
    paths = as_paths(synthetic_in_groups(cache_dir, 16))
    record = run_cell(cell_cfg("engine=ring", "engine.weights=int4", "dtype=float32", *paths))
    assert record["status"] == "skipped"
    assert "group_size=16" in record["reason"] and "32, 64, 128 or 256" in record["reason"]
    record = run_cell(cell_cfg("engine=ring", "engine.weights=int4", "dtype=bfloat16", "max_new_tokens=4", *paths))
    reason = int4_cpu.unsupported(torch.bfloat16, 16)
    assert record["status"] == ("skipped" if reason else "ok"), record["reason"]
    assert record["engine"]["int4_kernel"] == int4_cpu.OP if not reason else "group_size=16" in record["reason"]


@pytest.mark.parametrize(
    ("change", "named"), [({"symmetric": False}, "symmetric=False"), ({"num_bits": 8}, "num_bits=8")]
)
@pytest.mark.parametrize("keep_linears", [False, True], ids=["dense", "kept-4-bit"])
def test_quantization_no_engine_reads_is_refused_at_load(tiny, tmp_path, change, named, keep_linears):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny.emb4, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"layers\.0\..*{named}.*num_bits=4"):
        load_model(open_checkpoint(path), torch.float32, torch.device("cpu"), keep_linears=keep_linears)
