"""Cache geometry in plain Python: which layer reads whose keys and values, and how many slots each holds.

Every framework's engine reads the same numbers from here (the torch ring, the JAX engine, the Rust
engine through the config the Python side hands it), so the layout is written once and the evidence
of each names the same geometry. ``config`` is a Gemma 4 text config (any object with its fields).

* Full-attention layers keep one slot per position up to the context, rounded up to whole pieces
  (``full_slots``), so a padded last piece fits.
* Sliding layers keep a ring of ``window + piece`` slots, the window rounded up to whole pieces
  (``ring_slots``): a piece of the prompt lands in contiguous slots and never overwrites a key the same
  piece still needs; or the full layers' slots where those are fewer (``sliding_slots``): a context that
  short never wraps, and a step reads no slot it can never fill.
* KV-shared layers read the buffers of the last cache-owning layer of their own attention type
  (``kv_sources``).
* ``attend=filled`` reads the first ``bucket_for`` full slots: the filled ones rounded up to
  ``piece * 2**j``.
* ``last_piece`` (``LastPiece``, ``piece_length``): the rows a prompt's last piece is read as.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

MIN_PIECE = 16  # shortest padded last piece with last_piece=bucketed


class LastPiece(StrEnum):
    """How a prompt's last, partly filled piece is read: padded to a whole piece (the Rust article's and notebook
    05's fixed shapes: two programs), padded only to a power of two of at least ``MIN_PIECE`` tokens (a program per
    length), or read at its exact length (a program per distinct length: what a short prompt costs exactly)."""

    padded = "padded"
    bucketed = "bucketed"
    exact = "exact"


def piece_length(mode: LastPiece, count: int, piece: int) -> int:
    """Tokens a piece holding ``count`` prompt tokens (at most ``piece``) is read as."""
    if mode == LastPiece.padded or count == piece:
        return piece
    if mode == LastPiece.exact:
        return count
    return min(piece, max(MIN_PIECE, 2 ** math.ceil(math.log2(count))))


def layers_of_config(config: Any) -> list[dict[str, Any]]:
    """Each decoder layer as the model builds it: attention type, the layer whose K/V it reads, head
    size, K/V heads and MLP width (KV-shared layers are double-wide where the config says so)."""
    modes = config.kv_sharing_modes
    layers = []
    for i, kind in enumerate(config.layer_types):
        source = i
        if modes[i] == "reuse":
            source = max(j for j in range(i) if modes[j] != "reuse" and config.layer_types[j] == kind)
        wide = 2 if config.use_double_wide_mlp and source != i else 1
        layers.append(
            {
                "type": kind,
                "kv_source": source,
                "head_dim": config.per_layer_config[i].head_dim,
                "kv_heads": config.per_layer_config[i].num_key_value_heads,
                "intermediate_size": config.per_layer_config[i].intermediate_size * wide,
            }
        )
    return layers


def kv_sources(config: Any) -> list[int]:
    """For each layer, the layer whose K/V it reads: itself, or (KV-shared) the last cache-owning
    layer of the same type."""
    return [layer["kv_source"] for layer in layers_of_config(config)]


def ring_slots(window: int, piece: int) -> int:
    """Sliding-layer ring size in slots: the window rounded up to whole pieces, plus one piece."""
    return math.ceil(window / piece) * piece + piece


def full_slots(context: int, piece: int) -> int:
    """Full-layer slots: the context rounded up to whole pieces (a padded last piece fits)."""
    return math.ceil(context / piece) * piece


def sliding_slots(window: int, piece: int, context: int) -> int:
    """Slots a sliding layer holds: its ring, or the full layers' slots where fewer (a context no longer than the
    ring never wraps it; at E2B's window 512, piece 256 and context 256: 256 slots a step reads, not 768)."""
    return min(ring_slots(window, piece), full_slots(context, piece))


def bucket_for(needed: int, piece: int, full: int) -> int:
    """Full-layer slots read when ``needed`` positions are filled: ``piece * 2**j``, at most ``full``."""
    pieces = math.ceil(needed / piece)
    return min(full, piece * 2 ** math.ceil(math.log2(pieces)) if pieces > 1 else piece)


def cache_layout(config: Any, context: int, piece: int) -> dict[str, Any]:
    """The ring cache's geometry for evidence: cache-owning layers of each type and their slots."""
    owners = [i for i, src in enumerate(kv_sources(config)) if src == i]
    full = [i for i in owners if config.layer_types[i] == "full_attention"]
    return {
        "full_layers": len(full),
        "full_slots": full_slots(context, piece),
        "sliding_layers": len(owners) - len(full),
        "ring_slots": sliding_slots(config.sliding_window, piece, context),
        "shared_layers": config.num_hidden_layers - len(owners),
        "sliding_window": config.sliding_window,
        "piece": piece,
    }
