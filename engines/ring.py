"""``ring``: a ring KV cache for the full context (article 003, Step 10; shared/notes section 2.2).

* The geometry is ``decodebench.layout``'s (full slots, the sliding ring, KV-shared sources); the
  ring keeps one record of the position each slot holds (-1: empty or padding).
* Prompts are read in fixed ``piece``-token pieces (the last one padded), so the model compiles to
  exactly two programs, one piece and one decode step, whatever the prompt length.
* ``engine.attend=filled``: full-attention layers read only slots ``[0, bucket)``, the filled ones
  rounded up to ``piece * 2**j`` (``bucket_for``), so a short prompt in a large cache does not attend
  over empty slots; each bucket is one more compiled piece or step program, counted in ``buckets``.
  ``engine.attend=exact``: the filled ones rounded up to whole pieces, one program dynamic in the slot
  count (TorchDynamo makes it so at the second count; not on a TPU): a long prompt's pieces read half the
  slots the cache holds on average, against two thirds with power-of-two buckets.
* ``engine.last_piece=bucketed``: the prompt's last piece is padded only to a power of two of at least
  ``MIN_PIECE`` tokens (``decodebench.layout``), so a 20-token prompt is read as 32 tokens, not 256 (a program per
  length); ``exact`` reads it at its own length (a program per distinct length).
* Every piece's last row is a prompt token: a padded piece holds its padding rows first (at the positions just
  past its prompt tokens, recorded as empty, so no query sees them and a later token overwrites their slots), except
  in the article's layout (``attend=cache last_piece=padded``), which pads at the end. Transformers is asked for
  that last row alone (``logits_to_keep=1``) and then runs only that row through the KV-shared layers, which write
  no keys or values (on E2B the last 20 of 35, with double-wide MLPs): a 65-token prompt read as 128 rows runs
  128 rows through 15 layers and one row through 20. The article's layout keeps its two programs and runs every
  row through every layer.
* A decode step folds the query heads that share a K/V head into the query length
  (``grouped_attention``): the same products as ``enable_gqa``, as one matrix product per K/V head.
  A prompt piece keeps ``enable_gqa``: folding 256 queries would repeat its mask G times.

Only attention is replaced (``Gemma4TextAttention.forward`` on each layer, as the article does); the
projections, norms, RoPE, MLP and per-layer embeddings are Transformers' own modules.
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

from decodebench.config import Tables, at_least
from decodebench.device import Device
from decodebench.layout import LastPiece, bucket_for, cache_layout, full_slots, kv_sources, piece_length, sliding_slots
from engines import attention_cpu
from engines.base import Generation
from engines.joined import join_layers
from engines.stepping import SteppingEngine, SteppingEngineConfig
from engines.steps import batch_call

MAX_PROGRAMS = 64  # compiled programs a bucketed ring keeps per function (more than 2 * log2(131328 / 16))
NO_MASKS = {"full_attention": None, "sliding_attention": None}  # attention builds its own from the record


class Attend(StrEnum):
    """Which slots the ring's full-attention layers read: every slot of the cache (the article's two
    programs), the filled ones rounded up to a bucket (a program per bucket), or the filled ones rounded
    up to whole pieces (one program whose slot count changes: dynamic shapes, not on a TPU)."""

    cache = "cache"
    filled = "filled"
    exact = "exact"


@dataclass
class RingEngineConfig(SteppingEngineConfig):
    """Ring KV cache (article 003, Step 10): prompts read in ``piece``-token pieces, two programs.

    ``per_layer_table=int4``: the per-layer embedding table stays 4-bit (read from the ``-emb4`` twin and
    looked up packed, as ``table4`` does): the article's notebook 05 ring; ``bf16`` dequantizes it at load.

    ``attend=filled``: full-attention layers read only the slots up to the current position, rounded
    up to ``piece`` times a power of two (one compiled program per bucket used); ``attend=exact``: rounded
    up to whole pieces, in one program made dynamic in the slot count (TorchDynamo's automatic dynamic
    shapes: a second program the first time the count changes, then no more; refused on a TPU, whose
    programs have fixed shapes). ``last_piece=bucketed``:
    a short prompt costs about its length, not a whole piece. The defaults are the article's ring, but for
    ``decode_attention`` (``SteppingEngineConfig``).
    """

    piece: int = 256
    attend: Attend = Attend.cache
    last_piece: LastPiece = LastPiece.padded
    per_layer_table: Tables = Tables.int4

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("engine.", self, 1, "piece", why=" (prompt tokens read per piece)")


class RingCache:
    """K/V buffers for the cache-owning layers and the position records that mask them, for ``batch`` sequences
    (a row each: buffers [batch, heads, slots, dim], records [batch, slots])."""

    def __init__(
        self, config: Any, context: int, piece: int, dtype: torch.dtype, device: torch.device, batch: int = 1
    ) -> None:
        self.config = config
        self.batch = batch
        self.window = config.sliding_window
        self.piece = piece
        self.ring_slots = sliding_slots(self.window, piece, context)
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
            self.k[i] = torch.zeros(batch, heads, slots, head_dim, dtype=dtype, device=device)
            self.v[i] = torch.zeros(batch, heads, slots, head_dim, dtype=dtype, device=device)
        self.ring_pos = torch.full((batch, self.ring_slots), -1, dtype=torch.long, device=device)
        self.full_pos = torch.full((batch, self.full_slots), -1, dtype=torch.long, device=device)
        self.query_pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.ring_slot = torch.zeros(batch, 1, dtype=torch.long, device=device)
        # Each row's index [B, 1] beside its slots [B, S]: one indexed write (index_put_) puts every row's K/V in its
        # own slots in place. Per-row index_copy_ into a row's view made TorchInductor copy the row's whole buffer and
        # then the whole cache (a view's mutation functionalized): 0.65 ms a layer at B=8 on the 2-core EPYC.
        self.rows = torch.arange(batch, device=device)[:, None]
        self.masks: dict[bool, torch.Tensor] = {}  # keyed by "sliding", rebuilt by begin(): [batch, S, slots]
        self.folded: dict[tuple[bool, int, int], torch.Tensor] = {}  # (sliding, groups, rows) -> [B, G*rows, slots]
        self.bucket = self.full_slots  # full-layer slots the next forward reads (a host int: one program each)

    def nbytes(self) -> int:
        """Bytes held by K/V buffers, from their shapes."""
        return sum(t.nbytes for t in (*self.k.values(), *self.v.values()))

    def layout(self) -> dict[str, Any]:
        return cache_layout(self.config, self.full_slots, self.piece)

    def reset(self) -> None:
        self.ring_pos.fill_(-1)
        self.full_pos.fill_(-1)

    def first(self, rows: int) -> RingCache:
        """The first ``rows`` sequences of this cache, on its own buffers (views of them): a step of these rows
        reads and writes theirs alone."""
        if rows == self.batch:
            return self
        part = copy.copy(self)
        part.batch, part.rows, part.masks, part.folded = rows, self.rows[:rows], {}, {}
        part.k = {i: t[:rows] for i, t in self.k.items()}
        part.v = {i: t[:rows] for i, t in self.v.items()}
        part.ring_pos, part.full_pos = self.ring_pos[:rows], self.full_pos[:rows]
        return part

    def take_row(self, row: int, single: RingCache) -> None:
        """Copies a one-sequence cache (its prompt read) into sequence ``row`` of this one (the same geometry)."""
        for i in self.k:
            self.k[i][row].copy_(single.k[i][0])
            self.v[i][row].copy_(single.v[i][0])
        self.ring_pos[row].copy_(single.ring_pos[0])
        self.full_pos[row].copy_(single.full_pos[0])

    def begin(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Marks the slots this forward writes and builds the two masks every layer of it reads.

        ``positions`` [B, S] absolute, ``valid`` [B, S] (False: padding), a row per sequence. A key slot is
        visible to a query when it holds a position at or before the query's (and, sliding, within the window).
        """
        self.query_pos = positions
        self.ring_slot = positions % self.ring_slots
        recorded = torch.where(valid, positions, torch.full_like(positions, -1))
        self.ring_pos[self.rows, self.ring_slot] = recorded
        self.full_pos[self.rows, positions] = recorded
        qpos = positions[:, :, None]
        ring, full = self.ring_pos[:, None, :], self.full_pos[:, None, : self.bucket]
        self.masks = {
            True: (ring >= 0) & (ring <= qpos) & (qpos - ring < self.window),
            False: (full >= 0) & (full <= qpos),
        }
        self.folded = {}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V [B, heads, S, dim] into each sequence's slots of this forward, every row in one indexed write."""
        slots = self.ring_slot if self.sliding[layer] else self.query_pos
        self.k[layer][self.rows, :, slots] = k.transpose(1, 2)  # indexed by [B, S]: the values [B, S, heads, dim]
        self.v[layer][self.rows, :, slots] = v.transpose(1, 2)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the layer's source: every ring slot (sliding), or the first ``bucket`` slots (full)."""
        src = self.source[layer]
        if self.sliding[layer]:
            return self.k[src], self.v[src]
        return self.k[src][:, :, : self.bucket], self.v[src][:, :, : self.bucket]

    def mask(self, layer: int, groups: int, rows: int) -> torch.Tensor:
        """The [B, groups * rows, slots] mask of the keys the forward's last ``rows`` queries may see (a KV-shared
        layer may see only the last one: Transformers drops the rest before those layers), folded ``groups``
        to a K/V head; built once per forward and shared by the layers of the same type."""
        sliding = self.sliding[layer]
        full = self.masks[sliding]
        if groups == 1 and rows == full.shape[1]:
            return full
        if (sliding, groups, rows) not in self.folded:
            self.folded[sliding, groups, rows] = full[:, -rows:].repeat(1, groups, 1)
        return self.folded[sliding, groups, rows]


def ring_attention(
    self: Any,
    ring: RingCache,
    hidden_states: torch.Tensor,
    position_embeddings: Any,
    attention_mask: Any = None,
    shared_kv_states: Any = None,
    one_query: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``Gemma4TextAttention.forward`` over the ring: the module's own projections (q, k and v joined where the engine
    joined them), norms and RoPE; a decode step's attention by ``attention_cpu.one_query`` when ``one_query``."""
    batch, seq = hidden_states.shape[:2]
    shape = (batch, seq, -1, self.head_dim)
    cos, sin = position_embeddings
    if self.is_kv_shared_layer:
        q = self.q_proj(hidden_states)
    elif hasattr(self, "qkv_proj"):  # joined (engines.joined)
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj_sizes, dim=-1)
    else:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    q = apply_rotary_pos_emb(self.q_norm(q.view(shape)), cos, sin, unsqueeze_dim=2)
    if not self.is_kv_shared_layer:
        k = apply_rotary_pos_emb(self.k_norm(k.view(shape)), cos, sin, unsqueeze_dim=2)
        v = self.v_norm(v.view(shape))
        ring.write(self.layer_idx, k.transpose(1, 2), v.transpose(1, 2))
    keys, values = ring.read(self.layer_idx)
    if seq == 1:  # a decode step: fold the query heads (for a piece the G-times larger mask costs more)
        keep = ring.mask(self.layer_idx, q.shape[2] // keys.shape[1], seq)
        out = attention_cpu.grouped_attention(q.transpose(1, 2), keys, values, keep, self.scaling, one_query)
    else:
        keep = ring.mask(self.layer_idx, 1, seq)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=keep[:, None], scale=self.scaling, enable_gqa=True
        )
    return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)), None


class RingEngine(SteppingEngine):
    name = "ring"
    config = RingEngineConfig
    batches = True
    joins = True  # the server's continuous batching (serving.worker.BatchWorker)

    @classmethod
    def kept_4bit(cls, engine_cfg: Any) -> tuple[str, ...]:
        return ("embed_tokens_per_layer",) if engine_cfg.per_layer_table == Tables.int4 else ()

    @classmethod
    def dynamo_settings(cls, engine_cfg: Any, device: Device) -> dict[str, Any]:
        """A program per bucket and length: keep them all, never evict (one program per function otherwise)."""
        settings = super().dynamo_settings(engine_cfg, device)
        if engine_cfg.attend != Attend.cache or engine_cfg.last_piece != LastPiece.padded:
            return {**settings, "recompile_limit": MAX_PROGRAMS}
        return settings

    @classmethod
    def unsupported_reason(cls, device: Device, run_cfg: Any) -> str | None:
        if run_cfg.engine.attend == Attend.exact and device.kind == "tpu":
            return ("engine.attend=exact needs a program whose slot count changes from call to call (dynamic "
                    "shapes); a TPU compiles fixed shapes: engine.attend=filled has a program per bucket")  # fmt: skip
        return super().unsupported_reason(device, run_cfg)

    def dynamic_shapes(self) -> bool:
        return self.ctx.engine_cfg.attend == Attend.exact

    def join_linears(self) -> int:
        """q, k and v of each layer that writes its own K/V (its attention is ``ring_attention``), gate and up of
        every MLP (``joined_mlp``)."""
        return join_layers(self.model)

    def build(self) -> None:
        piece = self.ctx.engine_cfg.piece
        self.ring = RingCache(self.model.config, self.ctx.context, piece, self.ctx.dtype, self.ctx.device.torch_device)
        self.batch_ring: RingCache | None = None  # generate_batch's ring, a row per sequence (built at first use)
        self.row_rings: dict[int, RingCache] = {}  # n -> the batch ring's first n rows (open_rows)
        self.attend = self.ctx.engine_cfg.attend
        # the article's two programs (every piece padded, every slot read) keep one piece program: every row
        # of a piece goes through every layer there, as the article's ring does
        self.article_layout = self.attend == Attend.cache and self.ctx.engine_cfg.last_piece == LastPiece.padded
        self.buckets: dict[int, dict[str, int]] = {}  # bucket -> forwards run with it (pieces, steps)
        self.piece_lengths: dict[int, int] = {}  # padded piece length -> pieces read at it
        one_query = self.decode_attention == attention_cpu.OP
        for layer in self.model.model.layers:
            attn = layer.self_attn
            attn.forward = types.MethodType(
                lambda s, *a, **k: ring_attention(s, self.ring, *a, one_query=one_query, **k), attn
            )
        device = self.ctx.device.torch_device
        self.piece_offsets = torch.arange(piece, device=device)
        self.compiled_piece = self.compile(self.read_piece)

    def reset(self) -> None:
        self.ring.reset()

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, row: torch.Tensor | int
    ) -> torch.Tensor:
        """Logits [B, V] at row ``row`` (a [1] device tensor) of ids [B, S] at ``positions`` [B, S] (``valid``
        [B, S]) after writing this forward into the ring;
        ``row=1`` (the int): the last row, and Transformers runs only that row through the KV-shared layers
        (they write no keys or values, so the other rows' outputs there are never read). Transformers is asked
        for no cache of its own (``use_cache=False``): the ring is the cache, and building Transformers' cache on
        every forward only lengthened what TorchDynamo traces."""
        self.ring.begin(positions, valid)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=NO_MASKS, use_cache=False,
                         logits_to_keep=row)
        return out.logits[:, -1]

    def read_piece(
        self, ids: torch.Tensor, start: torch.Tensor, count: torch.Tensor, ends_full: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One piece: ids [1, length] holding ``count`` prompt tokens from position ``start`` (device scalars).
        ``ends_full`` (a host bool, one program each way): the padding rows come first and the last row is the
        prompt's, so only that row goes through the KV-shared layers; else (the article's layout) the padding
        rows come last and every row goes through every layer. A padding row sits at a position past the
        prompt tokens (``start + count`` on), recorded as empty."""
        length = ids.shape[1]
        offsets = self.piece_offsets[:length]
        order = (offsets - (length - count)) % length if ends_full else offsets  # each row's place in the piece
        logits = self.forward(ids, (start + order)[None], (order < count)[None],
                              1 if ends_full else (count - 1).view(1))  # fmt: skip
        return self.greedy(logits), logits

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = self.pieces_of(prompt_ids)
        for k in tqdm(range(pieces), desc="reading prompt", unit="piece", disable=pieces < 16, leave=False):
            token, logits = self.read_one(prompt_ids, k)
        return token, logits

    def pieces_of(self, prompt_ids: list[int]) -> int:
        """How many pieces the prompt is read in; a prompt the cache cannot hold is refused."""
        pieces = math.ceil(len(prompt_ids) / self.ring.piece)
        if pieces * self.ring.piece > self.ring.full_slots:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit {self.ring.full_slots} slots")
        return pieces

    def read_one(self, prompt_ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's piece ``k`` into the one-sequence ring (after pieces 0 to k-1): the greedy next token [1, 1]
        and logits [1, V] at its last prompt token."""
        piece, device = self.ring.piece, self.ctx.device.torch_device
        ends_full = not self.article_layout
        self.fill_to((k + 1) * piece, "pieces")
        tokens = prompt_ids[k * piece : (k + 1) * piece]
        length = self.piece_length(len(tokens))
        self.piece_lengths[length] = self.piece_lengths.get(length, 0) + 1
        padding = [0] * (length - len(tokens))
        ids = torch.tensor([padding + tokens if ends_full else tokens + padding], device=device)
        start, count = torch.tensor(k * piece, device=device), torch.tensor(len(tokens), device=device)
        return self.compiled_piece(ids, start, count, ends_full)

    def piece_length(self, count: int) -> int:
        """Tokens a piece holding ``count`` prompt tokens is padded to."""
        return piece_length(self.ctx.engine_cfg.last_piece, count, self.ring.piece)

    def before_step(self, position: int) -> None:
        self.fill_to(position + 1, "steps")

    def fill_to(self, needed: int, kind: str) -> None:
        """Sets the slots the next forward reads (``attend=filled`` or ``exact``) and counts the forward."""
        ring = self.ring
        if self.attend == Attend.filled:
            ring.bucket = bucket_for(needed, ring.piece, ring.full_slots)
        elif self.attend == Attend.exact:
            ring.bucket = min(ring.full_slots, full_slots(needed, ring.piece))
        else:
            ring.bucket = ring.full_slots
        counts = self.buckets.setdefault(ring.bucket, {"pieces": 0, "steps": 0})
        counts[kind] += 1

    def step(self, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token a sequence: ``token`` [B, 1] at ``position`` [B] -> the next [B, 1] and logits [B, V]."""
        positions = position[:, None]
        logits = self.forward(token, positions, torch.ones_like(positions, dtype=torch.bool),
                              torch.zeros_like(position[:1]))  # fmt: skip
        return self.greedy(logits), logits

    def open_rows(self, rows: int, warm: bool = False) -> None:
        """A ring of ``rows`` sequences (kept while its size is asked again), every row free: ``admit`` reads a
        prompt into a row, ``step_rows`` steps the busy rows at once, ``release`` frees one (the server's continuous
        batching, and ``generate_batch``). A step runs the first ``n`` rows, the fewest of ``row_rings`` (a power of
        two, or ``rows``: a program each) that hold every busy row; ``warm``: each of those programs compiled now,
        every row free (the server's, so that no request's step waits for a compile)."""
        device = self.ctx.device.torch_device
        if self.batch_ring is None or self.batch_ring.batch != rows:
            self.batch_ring = RingCache(self.model.config, self.ctx.context, self.ring.piece, self.ctx.dtype, device,
                                        rows)  # fmt: skip
            sizes = sorted({*(2**j for j in range(rows.bit_length()) if 2**j < rows), rows})
            self.row_rings = {n: self.batch_ring.first(n) for n in sizes}
        with self.running():  # made as the steps make them (inference tensors), so a step never sees another kind
            self.row_token = torch.zeros(rows, 1, dtype=torch.long, device=device)
            self.row_position = torch.zeros(rows, dtype=torch.long, device=device)
            self.row_busy = torch.zeros(rows, dtype=torch.long, device=device)  # 1 where a row advances each step
        self.row_at: list[int | None] = [None] * rows  # each busy row's next position on the host; None: free
        for n in self.row_rings if warm else ():
            self.step_first(n)

    def admit(self, row: int, prompt_ids: list[int]) -> torch.Tensor:
        """Reads ``prompt_ids`` alone (the one-sequence programs, into the one-sequence ring), copies its cache into
        ``row``, and returns its first token [1, 1] on the device; the row then steps with the others."""
        *_, token = self.admitting(row, prompt_ids)
        return token

    def admitting(self, row: int, prompt_ids: list[int]) -> Iterator[torch.Tensor | None]:
        """``admit`` a piece at a time: None after each piece but the last, then the first token. Between two
        pieces the other rows may step (``step_rows`` runs on the batch ring, the prompt is read into the
        one-sequence ring); one prompt is read at a time, and nothing else reads one until it is done."""
        with self.running():
            self.reset()
        pieces = self.pieces_of(prompt_ids)
        for k in range(pieces):
            with self.running():
                token, _ = self.read_one(prompt_ids, k)
            if k < pieces - 1:
                yield None
        with self.running():
            self.batch_ring.take_row(row, self.ring)
            self.row_token[row] = token[0]
            self.row_position[row] = len(prompt_ids)
            self.row_busy[row] = 1
        self.row_at[row] = len(prompt_ids)
        yield token

    def release(self, row: int) -> None:
        """Frees ``row``: it keeps stepping in place (its own slots only, its position held) until admitted again."""
        self.row_at[row] = None
        with self.running():
            self.row_busy[row] = 0

    def step_rows(self) -> torch.Tensor:
        """One step of the busy rows, each at its own position: each row's next token [rows, 1] on the device (a
        free row's is not one to read). The first ``n`` rows step (``open_rows``): busy rows advance, free ones
        among them hold."""
        last = max((row for row, at in enumerate(self.row_at) if at is not None), default=0)
        return self.step_first(min(n for n in self.row_rings if n > last))

    def step_first(self, n: int) -> torch.Tensor:
        """One step of the first ``n`` rows (``row_rings[n]``'s program); the rows past them keep their tokens."""
        busy = [at for at in self.row_at if at is not None]
        single, self.ring = self.ring, self.row_rings[n]
        try:
            with self.running():
                self.before_step(max(busy, default=0))
                tokens, _ = self.compiled_step(self.row_token[:n], self.row_position[:n])
                self.row_token = torch.cat([tokens, self.row_token[n:]]) if n < len(self.row_at) else tokens
                self.row_position = self.row_position + self.row_busy
        finally:
            self.ring = single
        self.row_at = [None if at is None else at + 1 for at in self.row_at]
        return self.row_token

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        """A row each (``open_rows``, ``admit``), then one step program for every row at once, each at its own
        position (``step_rows``); tokens and phase timers as ``steps.batch_call`` keeps them."""
        self.open_rows(len(prompts))
        read = lambda: torch.cat([self.admit(row, ids) for row, ids in enumerate(prompts)])  # noqa: E731
        return batch_call(self.ctx.device.sync, read, lambda _: self.step_rows(), max_new_tokens)

    def cache_bytes(self) -> int | None:
        return self.ring.nbytes()

    def close(self) -> None:
        super().close()
        self.ring = self.batch_ring = self.compiled_piece = None
        self.row_rings = {}

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "layout": self.ring.layout(),
            "cache_bytes": self.ring.nbytes(),
            "attend": str(self.ctx.engine_cfg.attend),
            "per_layer_table": str(self.ctx.engine_cfg.per_layer_table),
            "buckets": {str(b): n for b, n in sorted(self.buckets.items())},
            "last_piece": str(self.ctx.engine_cfg.last_piece),
            "piece_lengths": {str(n): k for n, k in sorted(self.piece_lengths.items())},
        }
