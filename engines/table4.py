"""``table4``: the compiled step with the per-layer embedding table kept 4-bit (article 003, Step 9).

The ``-emb4`` twin stores ``embed_tokens_per_layer`` as compressed-tensors int4 (group 32 along the
row); ``engines.int4.Int4Embedding`` looks up the packed rows of the ids it is given and unpacks
only those (the stepping engines swap it in for every table they keep packed).
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.compiled import CompiledEngine, CompiledEngineConfig


@dataclass
class Table4EngineConfig(CompiledEngineConfig):
    """``compiled`` with the per-layer embedding table kept 4-bit (read from the -emb4 twin)."""

    keeps_table_4bit = True


class Table4Engine(CompiledEngine):
    name = "table4"
    config = Table4EngineConfig
    keep_packed = ("embed_tokens_per_layer",)
