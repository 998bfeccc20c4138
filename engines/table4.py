"""``table4``: the compiled step with the per-layer embedding table kept 4-bit (article 003, Step 9).

The ``-emb4`` twin stores ``embed_tokens_per_layer`` as compressed-tensors int4 (group 32 along the
row); this module looks up the packed rows of the ids it is given and unpacks only those.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from decodebench.checkpoint import PackedTable
from decodebench.config import Table4EngineConfig
from engines.compiled import CompiledEngine

TABLE = "model.embed_tokens_per_layer"
# The checkpoint stores the table's scales in float16 and a bf16 run writes bf16 rows, so inductor's
# CPU code generator sees both in one fused lookup and says so. The lookup unpacks in float32, so
# nothing is lost; converting the scales instead would either round the checkpoint's own numbers
# (bf16) or double their bytes (float32), against the point of keeping the table 4-bit.
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node", category=UserWarning)


class Int4Embedding(nn.Module):
    """An embedding whose table stays packed: int32 words [rows, cols/8], scales [rows, cols/32].

    ``forward(ids)`` gives the same values as the dequantized table times ``embed_scale``, in ``dtype``.
    """

    def __init__(self, table: PackedTable, embed_scale: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("packed", table.packed.to(device))
        self.register_buffer("scale", table.scale.to(device))
        self.register_buffer("shifts", torch.arange(0, 32, 4, dtype=torch.int32, device=device))
        self.cols = table.shape[1]
        self.dtype = dtype
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        words, scale = self.packed[ids], self.scale[ids]
        levels = ((words.unsqueeze(-1) >> self.shifts) & 15).to(torch.float32) - 8
        groups = levels.view(*ids.shape, scale.shape[-1], -1) * scale.unsqueeze(-1).to(torch.float32)
        weights = groups.view(*ids.shape, self.cols).to(self.dtype)
        return weights * torch.tensor(self.embed_scale, dtype=self.dtype, device=ids.device)


class Table4Engine(CompiledEngine):
    name = "table4"
    config = Table4EngineConfig
    tables = "int4"
    keep_packed = ("embed_tokens_per_layer",)

    def build(self) -> None:
        old = self.model.model.embed_tokens_per_layer
        self.model.model.embed_tokens_per_layer = Int4Embedding(
            self.packed_tables[TABLE], old.scalar_embed_scale, self.ctx.dtype, self.ctx.device.torch_device
        )
        super().build()

    def describe(self) -> dict[str, Any]:
        table = self.packed_tables.get(TABLE) if hasattr(self, "packed_tables") else None
        if table is None:
            return super().describe()
        rows, cols = table.shape
        return {
            **super().describe(),
            "per_layer_table": "int4 packed rows",
            "per_layer_table_bytes": table.packed.nbytes + table.scale.nbytes,
            "per_layer_table_dense_bytes": rows * cols * self.ctx.dtype.itemsize,
        }
