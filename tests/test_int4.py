"""Weights that stay 4-bit while they compute: the repack is exact, the kernel is named, parity holds."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from decodebench.checkpoint import PackedTable
from engines import int4
from runner import run_cell
from tests.test_engines import parity


def packed_weight(rows: int, cols: int) -> tuple[PackedTable, torch.Tensor]:
    """Random levels and bf16 group-32 scales packed as the checkpoint stores them; the dense weight."""
    torch.manual_seed(0)
    levels = torch.randint(-8, 8, (rows, cols), dtype=torch.int8)
    scale = (torch.rand(rows, cols // 32) * 0.02 + 0.001).to(torch.bfloat16)
    dense = (levels.float().view(rows, -1, 32) * scale.float()[..., None]).view(rows, cols)
    return PackedTable(pack_to_int32(levels, 4), scale, (rows, cols)), dense


@pytest.mark.parametrize("kind", ["cpu", "tpu"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int4_linear_equals_the_dense_matmul_on_the_dequantized_weight(kind, dtype, tolerance):
    weight, dense = packed_weight(96, 256)
    x = torch.randn(3, 5, 256)
    layer = int4.Int4Linear(weight, dtype, torch.device("cpu"), kind=kind)
    got = layer(x.to(dtype)).float()
    expected = x.to(dtype).float() @ dense.t()
    assert got.shape == (3, 5, 96)
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("engine", ["compiled", "ring"])
def test_int4_engines_write_the_reference_tokens_and_name_their_kernel(cell_cfg, tiny, engine):
    record = parity(cell_cfg, engine, "engine.weights=int4")
    out = record["outputs"]["prompt"]
    assert out["first_difference"] is None and out["kl_max"] < 1e-6
    assert record["engine"]["int4_kernel"] == int4.KERNELS["cpu"] and record["engine"]["int4_linears"] > 0


def test_int4_holds_fewer_weight_bytes(cell_cfg, tiny):
    held = {}
    for weights in ("dense", "int4"):
        cfg = cell_cfg("engine=compiled", "engine.backend=eager", f"engine.weights={weights}", "experiment=decode",
                       "max_new_tokens=4", "repeats=1")  # fmt: skip
        record = run_cell(cfg)
        assert record["status"] == "ok", record["reason"]
        held[weights] = record["measurements"]["weight_bytes_from_shape"]["value"]
    assert held["int4"] < held["dense"]


def test_a_device_without_an_int4_kernel_is_skipped(cell_cfg, tiny, monkeypatch):
    monkeypatch.setattr(int4, "KERNELS", {k: v for k, v in int4.KERNELS.items() if k != "cpu"})
    record = run_cell(cell_cfg("engine=ring", "engine.weights=int4"))
    assert record["status"] == "skipped" and "no int4 kernel for device cpu" in record["reason"]
