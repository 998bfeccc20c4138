"""``ring``: a ring KV cache for the full context (article 003, Step 10; shared/notes section 2.2).

* Full-attention layers keep one slot per position up to ``context`` (rounded up to a piece).
* Sliding layers keep a ring of ``window + piece`` slots (the window rounded up to a whole number of
  pieces) and one record of the position each slot holds (-1: empty or padding); a piece of the
  prompt always lands in contiguous slots and never overwrites a key the same piece still needs.
* KV-shared layers read their source layer's buffers (the last cache-owning layer of their type).
* Prompts are read in fixed ``piece``-token pieces (the last one padded), so the model compiles to
  exactly two programs, one piece and one decode step, whatever the prompt length.
* ``engine.attend=filled``: full-attention layers read only slots ``[0, bucket)``, the filled ones
  rounded up to ``piece * 2**j`` (``bucket_for``), so a short prompt in a large cache does not attend
  over empty slots; each bucket is one more compiled piece or step program, counted in ``buckets``.
* ``engine.last_piece=bucketed``: the prompt's last piece is padded only to a power of two of at
  least ``MIN_PIECE`` tokens, so a 20-token prompt is read as 32 tokens, not 256 (a program per length);
  ``exact`` reads it at its own length (a program per distinct length).
* A decode step folds the query heads that share a K/V head into the query length
  (``grouped_attention``): the same products as ``enable_gqa``, as one matrix product per K/V head.
  A prompt piece keeps ``enable_gqa``: folding 256 queries would repeat its mask G times.

Only attention is replaced (``Gemma4TextAttention.forward`` on each layer, as the article does); the
projections, norms, RoPE, MLP and per-layer embeddings are Transformers' own modules.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

from decodebench.checkpoint import layers_of_config
from decodebench.config import Attend, LastPiece, RingEngineConfig
from engines.stepping import SteppingEngine, greedy

MIN_PIECE = 16  # shortest padded last piece with last_piece=bucketed
MAX_PROGRAMS = 64  # compiled programs a bucketed ring keeps per function (more than 2 * log2(131328 / 16))
NO_MASKS = {"full_attention": None, "sliding_attention": None}  # attention builds its own from the record


def ring_slots(window: int, piece: int) -> int:
    """Sliding-layer ring size: the window rounded up to whole pieces, plus one piece."""
    return math.ceil(window / piece) * piece + piece


def bucket_for(needed: int, piece: int, full: int) -> int:
    """Full-layer slots read when ``needed`` positions are filled: ``piece * 2**j``, at most ``full``."""
    pieces = math.ceil(needed / piece)
    return min(full, piece * 2 ** math.ceil(math.log2(pieces)) if pieces > 1 else piece)


def full_slots(context: int, piece: int) -> int:
    """Full-layer slots: the context rounded up to whole pieces (a padded last piece fits)."""
    return math.ceil(context / piece) * piece


def kv_sources(config: Any) -> list[int]:
    """For each layer, the layer whose K/V it reads: itself, or (KV-shared) the last cache-owning
    layer of the same type (``decodebench.checkpoint.layers_of_config``)."""
    return [layer["kv_source"] for layer in layers_of_config(config)]


def cache_layout(config: Any, context: int, piece: int) -> dict[str, Any]:
    """The ring cache's geometry for evidence: cache-owning layers of each type and their slots."""
    owners = [i for i, src in enumerate(kv_sources(config)) if src == i]
    full = [i for i in owners if config.layer_types[i] == "full_attention"]
    return {
        "full_layers": len(full),
        "full_slots": full_slots(context, piece),
        "sliding_layers": len(owners) - len(full),
        "ring_slots": ring_slots(config.sliding_window, piece),
        "shared_layers": config.num_hidden_layers - len(owners),
        "sliding_window": config.sliding_window,
        "piece": piece,
    }


class RingCache:
    """K/V buffers for the cache-owning layers and the position records that mask them."""

    def __init__(self, config: Any, context: int, piece: int, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.window = config.sliding_window
        self.piece = piece
        self.ring_slots = ring_slots(self.window, piece)
        self.full_slots = full_slots(context, piece)
        self.source = dict(enumerate(kv_sources(config)))
        self.sliding = {i: t == "sliding_attention" for i, t in enumerate(config.layer_types)}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i, src in self.source.items():
            if src != i:
                continue
            head_dim = config.per_layer_config[i].head_dim
            heads = config.per_layer_config[i].num_key_value_heads
            slots = self.ring_slots if self.sliding[i] else self.full_slots
            self.k[i] = torch.zeros(1, heads, slots, head_dim, dtype=dtype, device=device)
            self.v[i] = torch.zeros(1, heads, slots, head_dim, dtype=dtype, device=device)
        self.ring_pos = torch.full((self.ring_slots,), -1, dtype=torch.long, device=device)
        self.full_pos = torch.full((self.full_slots,), -1, dtype=torch.long, device=device)
        self.query_pos = torch.zeros(1, dtype=torch.long, device=device)
        self.ring_slot = torch.zeros(1, dtype=torch.long, device=device)
        self.masks: dict[bool, torch.Tensor] = {}  # keyed by "sliding", rebuilt by begin()
        self.folded: dict[tuple[bool, int], torch.Tensor] = {}  # (sliding, query groups) -> [G*S, slots]
        self.bucket = self.full_slots  # full-layer slots the next forward reads (a host int: one program each)

    def nbytes(self) -> int:
        """Bytes held by K/V buffers, from their shapes."""
        return sum(t.nbytes for t in (*self.k.values(), *self.v.values()))

    def layout(self) -> dict[str, Any]:
        return cache_layout(self.config, self.full_slots, self.piece)

    def reset(self) -> None:
        self.ring_pos.fill_(-1)
        self.full_pos.fill_(-1)

    def begin(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Marks the slots this forward writes and builds the two masks every layer of it reads.

        ``positions`` [S] absolute, ``valid`` [S] (False: padding). A key slot is visible to a query
        when it holds a position at or before the query's (and, sliding, within the window).
        """
        self.query_pos = positions
        self.ring_slot = positions % self.ring_slots
        recorded = torch.where(valid, positions, torch.full_like(positions, -1))
        self.ring_pos.index_copy_(0, self.ring_slot, recorded)
        self.full_pos.index_copy_(0, positions, recorded)
        qpos = positions[:, None]
        ring, full = self.ring_pos[None, :], self.full_pos[None, : self.bucket]
        self.masks = {
            True: (ring >= 0) & (ring <= qpos) & (qpos - ring < self.window),
            False: (full >= 0) & (full <= qpos),
        }
        self.folded = {}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self.ring_slot if self.sliding[layer] else self.query_pos
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the layer's source: every ring slot (sliding), or the first ``bucket`` slots (full)."""
        src = self.source[layer]
        if self.sliding[layer]:
            return self.k[src], self.v[src]
        return self.k[src][:, :, : self.bucket], self.v[src][:, :, : self.bucket]

    def mask(self, layer: int, groups: int) -> torch.Tensor:
        """The [groups * S, slots] mask of the keys each query may see, for queries folded ``groups``
        to a K/V head (built once per forward and shared by the layers of the same type)."""
        sliding = self.sliding[layer]
        if groups == 1:
            return self.masks[sliding]
        if (sliding, groups) not in self.folded:
            self.folded[sliding, groups] = self.masks[sliding].repeat(groups, 1)
        return self.folded[sliding, groups]


def ring_attention(
    self: Any,
    ring: RingCache,
    hidden_states: torch.Tensor,
    position_embeddings: Any,
    attention_mask: Any = None,
    shared_kv_states: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``Gemma4TextAttention.forward`` over the ring: the module's own projections, norms and RoPE."""
    batch, seq = hidden_states.shape[:2]
    shape = (batch, seq, -1, self.head_dim)
    cos, sin = position_embeddings
    q = apply_rotary_pos_emb(self.q_norm(self.q_proj(hidden_states).view(shape)), cos, sin, unsqueeze_dim=2)
    if not self.is_kv_shared_layer:
        k = apply_rotary_pos_emb(self.k_norm(self.k_proj(hidden_states).view(shape)), cos, sin, unsqueeze_dim=2)
        v = self.v_norm(self.v_proj(hidden_states).view(shape))
        ring.write(self.layer_idx, k.transpose(1, 2), v.transpose(1, 2))
    keys, values = ring.read(self.layer_idx)
    if seq == 1:  # a decode step: fold the query heads (for a piece the G-times larger mask costs more)
        keep = ring.mask(self.layer_idx, q.shape[2] // keys.shape[1])
        out = grouped_attention(q.transpose(1, 2), keys, values, keep, self.scaling)
    else:
        keep = ring.mask(self.layer_idx, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=keep[None, None], scale=self.scaling, enable_gqa=True
        )
    return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)), None


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with each K/V head's G = H/KV query heads folded into the query length: q [B, H, S, D],
    keys and values [B, KV, slots, D], keep [G*S, slots] (the [S, slots] mask repeated G times) ->
    [B, H, S, D]. The products are the same as with ``enable_gqa`` (head h reads K/V head h // G);
    on a CPU one [G*S, slots] product per K/V head is far cheaper than G broadcast ones."""
    batch, heads, seq, dim = q.shape
    folded = q.reshape(batch, keys.shape[1], heads // keys.shape[1] * seq, dim)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=keep[None, None], scale=scale)
    return out.view(batch, heads, seq, values.shape[-1])


class RingEngine(SteppingEngine):
    name = "ring"
    config = RingEngineConfig

    def build(self) -> None:
        piece = self.ctx.engine_cfg.piece
        self.ring = RingCache(self.model.config, self.ctx.context, piece, self.ctx.dtype, self.ctx.device.torch_device)
        self.filled = self.ctx.engine_cfg.attend == Attend.filled
        self.short_last_piece = self.ctx.engine_cfg.last_piece != LastPiece.padded
        self.buckets: dict[int, dict[str, int]] = {}  # bucket -> forwards run with it (pieces, steps)
        self.piece_lengths: dict[int, int] = {}  # padded piece length -> pieces read at it
        if self.filled or self.short_last_piece:  # a program per bucket and length: keep them, never evict
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_PROGRAMS)
        for layer in self.model.model.layers:
            attn = layer.self_attn
            attn.forward = types.MethodType(lambda s, *a, **k: ring_attention(s, self.ring, *a, **k), attn)
        device = self.ctx.device.torch_device
        self.piece_offsets = torch.arange(piece, device=device)
        self.compiled_piece = self.compile(self.read_piece)

    def reset(self) -> None:
        self.ring.reset()

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, row: torch.Tensor
    ) -> torch.Tensor:
        """Logits [1, V] at row ``row`` (a [1] device tensor) after writing this forward into the ring."""
        self.ring.begin(positions, valid)
        out = self.model(input_ids=ids, position_ids=positions[None], attention_mask=NO_MASKS, logits_to_keep=row)
        return out.logits[:, -1]

    def read_piece(
        self, ids: torch.Tensor, start: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One piece: ids [1, length] from position ``start`` with ``count`` real tokens (device scalars)."""
        offsets = self.piece_offsets[: ids.shape[1]]
        logits = self.forward(ids, start + offsets, offsets < count, (count - 1).view(1))
        return greedy(logits), logits

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        piece, device = self.ring.piece, self.ctx.device.torch_device
        pieces = math.ceil(len(prompt_ids) / piece)
        if pieces * piece > self.ring.full_slots:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit {self.ring.full_slots} slots")
        padded = torch.tensor(prompt_ids + [0] * (pieces * piece - len(prompt_ids)), device=device).view(pieces, piece)
        for k in tqdm(range(pieces), desc="reading prompt", unit="piece", disable=pieces < 16, leave=False):
            self.fill_to((k + 1) * piece, "pieces")
            count = min(piece, len(prompt_ids) - k * piece)
            length = self.piece_length(count)
            self.piece_lengths[length] = self.piece_lengths.get(length, 0) + 1
            start = torch.tensor(k * piece, device=device)
            ids = padded[k : k + 1, :length]
            token, logits = self.compiled_piece(ids, start, torch.tensor(count, device=device))
        return token, logits

    def piece_length(self, count: int) -> int:
        """Tokens a piece holding ``count`` prompt tokens is padded to."""
        mode = self.ctx.engine_cfg.last_piece
        if mode == LastPiece.padded or count == self.ring.piece:
            return self.ring.piece
        if mode == LastPiece.exact:
            return count
        return min(self.ring.piece, max(MIN_PIECE, 2 ** math.ceil(math.log2(count))))

    def before_step(self, position: int) -> None:
        self.fill_to(position + 1, "steps")

    def fill_to(self, needed: int, kind: str) -> None:
        """Sets the slots the next forward reads (``attend=filled``) and counts the forward."""
        ring = self.ring
        ring.bucket = bucket_for(needed, ring.piece, ring.full_slots) if self.filled else ring.full_slots
        counts = self.buckets.setdefault(ring.bucket, {"pieces": 0, "steps": 0})
        counts[kind] += 1

    def step(self, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.forward(token, position, torch.ones_like(position, dtype=torch.bool), torch.zeros_like(position))
        return greedy(logits), logits

    def cache_bytes(self) -> int | None:
        return self.ring.nbytes()

    def describe(self) -> dict[str, Any]:
        if not hasattr(self, "ring"):
            return {}
        return {
            **super().describe(),
            "layout": self.ring.layout(),
            "cache_bytes": self.ring.nbytes(),
            "attend": str(self.ctx.engine_cfg.attend),
            "buckets": {str(b): n for b, n in sorted(self.buckets.items())},
            "last_piece": str(self.ctx.engine_cfg.last_piece),
            "piece_lengths": {str(n): k for n, k in sorted(self.piece_lengths.items())},
        }
