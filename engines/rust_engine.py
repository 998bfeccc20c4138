"""``rust``: Gemma 4 in Rust over ATen (``engines/rust/``), driven through its PyO3 bindings.

Weights come from the one loader (``decodebench.checkpoint.load_model``) and cross to Rust once;
the layers, the ring cache (the same design as ``ring``), the prompt read in pieces and the decode
loop run in Rust, every tensor operation through the C++ shim's ATen calls.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from decodebench.checkpoint import load_model
from decodebench.config import ConfigError, EngineConfig, Tables, at_least
from decodebench.device import Device, EagerMode, fuse_unsupported, tpu_eager_mode
from decodebench.layout import LastPiece, full_slots, kv_sources, piece_length, sliding_slots
from engines import attention_cpu, cpu_kernels, greedy_cpu, held, int4, int4_cpu, norm_cpu, one_row
from engines.attention_cpu import DecodeAttention
from engines.base import Engine, Generation, OnTokens
from engines.int4 import Int4Embedding, Int4Linear, Weights
from engines.joined import join_layers
from engines.one_row import OneRow, PackedEmbedding, PackedLinear
from engines.product_bytes import product_bytes


@dataclass
class RustEngineConfig(EngineConfig):
    """Gemma 4 in Rust over ATen (engines/rust/), with the ring cache's layout and pieces. ``mode=fuse``
    runs every call under TorchTPU's defer-and-fuse (the Rust article's ``SERVE_DEFER_AND_FUSE=1``: a
    compiler cannot trace a Rust model, so fusion below ATen is how it is compiled; TPU only). ``last_piece``:
    the rows a prompt's last piece is read as (``decodebench.layout``: ``padded``, a whole piece, the article's fixed
    shapes; ``bucketed``, a power of two of at least 16; ``exact``, its own tokens: a short prompt costs its length,
    not a piece; on a TPU each length is a program of its own). ``one_row``:
    which kernel a dense linear calls on one row (``engines/one_row.py``: ``auto`` is the fastest on this CPU,
    measured on the model's shapes; ``mv`` is ``at::mv``, ``linear`` ``at::linear``, ``rows`` the project's
    ``decodebench_bf16::bf16_rows`` for every row count, its weight packed at load by the Python side). ``weights``:
    ``dense``, or ``int4``: the ``-emb4`` twin's linears kept 4-bit and multiplied by the project's
    ``decodebench_int4::int4_rows``, its vocabulary tables read row by row from their packed words (a CPU with
    AVX-512 BF16, bf16; skipped, named, elsewhere), each input held in ``int4_limbs`` 7-bit limbs (3, or 2:
    ``engines.int4_cpu.LIMBS``; refused other than 3 with dense weights). ``decode_attention``: a decode step's
    attention (``engines.attention_cpu``: ``auto`` the project's ``one_query`` where it runs, aten's elsewhere).
    Every such kernel is the operator the PyTorch engines call, found by name in ATen's dispatcher. q, k and v, and
    gate and up, are one product each where ``engines.joined`` joins them, as the ring's are."""

    piece: int = 256
    mode: EagerMode = EagerMode.eager
    last_piece: LastPiece = LastPiece.padded
    one_row: OneRow = OneRow.auto
    weights: Weights = Weights.dense
    decode_attention: DecodeAttention = DecodeAttention.auto
    int4_limbs: int = int4_cpu.DEFAULT_LIMBS

    def __post_init__(self) -> None:
        at_least("engine.", self, 1, "piece", why=" (prompt tokens read per piece)")
        if reason := int4.one_row_refused(self.one_row, self.weights) or int4.limbs_refused(self.int4_limbs,
                                                                                             self.weights):
            raise ConfigError(reason)

    def settings_without_effect(self) -> tuple[str, ...]:
        """The settings that take no effect with the others, for the evidence (each refused there other than at its
        default, so its value says nothing of the way)."""
        return int4.settings_without_effect(self.weights)


def built() -> str | None:
    """Why the Rust module cannot be used here, or None when it imports."""
    if importlib.util.find_spec("decodebench_rs") is None:
        return "the rust engine is not built: `make setup` builds it (cargo, maturin, Debian's librust-pyo3-dev)"
    try:
        import decodebench_rs  # noqa: F401
    except ImportError as exc:
        return f"the rust engine does not load: {exc}"
    return None


def model_config(model: Any, context: int, piece: int, dtype: torch.dtype) -> dict[str, Any]:
    """The shape and constants the Rust model needs, read from the loaded Transformers model."""
    cfg = model.config
    text = model.model
    rotary = text.rotary_emb

    def as_dtype(value: float) -> float:  # Transformers multiplies by these scales held in the run's dtype
        return float(torch.tensor(value, dtype=dtype))

    def embed_scale(table: Any) -> float:  # Transformers' scaled embedding, or the Int4Embedding that replaced it
        return table.embed_scale if isinstance(table, Int4Embedding) else table.scalar_embed_scale

    return {
        "sliding": [t == "sliding_attention" for t in cfg.layer_types],
        "head_dims": [cfg.per_layer_config[i].head_dim for i in range(cfg.num_hidden_layers)],
        "kv_heads": [cfg.per_layer_config[i].num_key_value_heads for i in range(cfg.num_hidden_layers)],
        "sources": kv_sources(cfg),
        "hidden": cfg.hidden_size,
        "ple_dim": cfg.hidden_size_per_layer_input,
        "window": cfg.sliding_window,
        "piece": piece,
        "context": context,
        "ring_slots": sliding_slots(cfg.sliding_window, piece, context),
        "full_slots": full_slots(context, piece),
        "eps": cfg.rms_norm_eps,
        "softcap": cfg.final_logit_softcapping,
        "embed_scale": as_dtype(embed_scale(text.embed_tokens)),
        "ple_embed_scale": as_dtype(embed_scale(text.embed_tokens_per_layer)),
        "ple_projection_scale": text.per_layer_model_projection_scale,
        "ple_input_scale": text.per_layer_input_scale,
        "rope_scaling_sliding": float(rotary.sliding_attention_attention_scaling),
        "rope_scaling_full": float(rotary.full_attention_attention_scaling),
    }


class RustEngine(Engine):
    name = "rust"
    config = RustEngineConfig
    streams = True
    splits_phases = True  # the Rust loop times its own phases (Engine.timers)

    @classmethod
    def unsupported_reason(cls, device: Device, run_cfg: Any) -> str | None:
        return (
            built()
            or fuse_unsupported(run_cfg.engine.mode, "rust", device.kind)
            or int4_unsupported(device, run_cfg)
            or one_row.rows_refused(run_cfg.engine.one_row, device.kind, run_cfg.dtype.torch)
            or attention_cpu.refused(run_cfg.engine.decode_attention, device.kind, run_cfg.dtype.torch)
            or super().unsupported_reason(device, run_cfg)
        )

    @classmethod
    def twin(cls, engine_cfg: Any, model_cfg: Any) -> str:
        """``engine.weights=int4`` reads the ``-emb4`` twin, whose tables and ``lm_head`` are int4."""
        return Tables.int4 if engine_cfg.weights == Weights.int4 else super().twin(engine_cfg, model_cfg)

    def load(self) -> None:
        import decodebench_rs

        device, dtype = self.ctx.device.torch_device, self.ctx.dtype
        self.int4 = self.ctx.engine_cfg.weights == Weights.int4
        model = self.load_int4() if self.int4 else load_model(self.checkpoint, dtype, device)[0]
        config = model_config(model, self.ctx.context, self.ctx.engine_cfg.piece, dtype)
        self.int4_linears = sum(isinstance(m, Int4Linear) for m in model.modules())  # as the checkpoint has them
        self.joined_linears = join_layers(model)  # the Rust layer splits a joined product's outputs (model.rs: Qkv)
        self.held_together_bytes = held.hold_together(model)
        self.one_row_choice = one_row.choose_for(model, self.ctx.engine_cfg.one_row, self.ctx.device.kind,
                                                 self.ctx.cache_dir)  # fmt: skip
        self.one_row = self.one_row_choice.one_row
        self.row_linears = one_row.pack_dense_linears(model) if self.one_row == OneRow.rows else 0
        config["one_row_mv"] = self.one_row == OneRow.mv
        self.decode_attention = attention_cpu.choose(self.ctx.engine_cfg.decode_attention, self.ctx.device.kind,
                                                     dtype, model.config)  # fmt: skip
        config["one_query"] = self.decode_attention == attention_cpu.OP
        self.norm = norm_cpu.EAGER if norm_cpu.unsupported(self.ctx.device.kind, dtype) else norm_cpu.OP
        config["rms_norm"] = config["add_rms"] = config["gelu_mul"] = self.norm == norm_cpu.OP
        self.greedy_kernel = greedy_cpu.choose(self.ctx.device.kind, dtype)
        config["first_max"] = self.greedy_kernel == greedy_cpu.OP
        modules = dict(model.named_modules(remove_duplicate=False))
        tables = {path: packed_table(m) for path, m in modules.items() if isinstance(m, PACKED_TABLES)}
        linears = {path: packed_linear(m) for path, m in modules.items()
                   if isinstance(m, PACKED_LINEARS) and path.rpartition(".")[0] not in tables}  # fmt: skip
        packed = (*tables, *linears)  # what Rust reads packed: none of their tensors crosses as a dense weight
        weights = {n: t for n, t in model.state_dict().items() if not n.startswith(tuple(f"{p}." for p in packed))}
        if "lm_head" not in linears:
            weights["lm_head.weight"] = model.lm_head.weight
        for layer_type in ("sliding_attention", "full_attention"):
            weights[f"rope.{layer_type}.inv_freq"] = getattr(model.model.rotary_emb, f"{layer_type}_inv_freq")
        like = torch.zeros(1, dtype=dtype, device=device)
        self.native = decodebench_rs.Engine(config, weights, like,
                                            linears={f"{p}.weight": w for p, w in linears.items()},
                                            tables={f"{p}.weight": w for p, w in tables.items()})  # fmt: skip
        self.model = model  # the weights Rust reads share its storage: what the engine holds, and its shapes
        self.build = dict(decodebench_rs.BUILD)
        self.piece_lengths: Counter[int] = Counter()  # rows a prompt piece was read as -> pieces read so far

    def load_int4(self) -> Any:
        """The ``-emb4`` twin with its tables and linears swapped for the int4 modules the PyTorch engines hold
        (``engines.int4``), every linear packed for ``int4_rows``; the Rust model reads their packed tensors."""
        device, dtype = self.ctx.device.torch_device, self.ctx.dtype
        keep = int4.LOOKUPS + ("lm_head",)
        model, packed = load_model(self.checkpoint, dtype, device, keep, keep_linears=True)
        tables, linears = int4.split_packed(packed, int4.LOOKUPS, model.config.tie_word_embeddings)
        int4.swap_lookups(model, tables, dtype, device)
        limbs = self.ctx.engine_cfg.int4_limbs
        int4.swap_linears(model, linears, dtype, device, kernel=int4_cpu.OP, limbs=limbs)  # Rust calls no other kernel
        return model

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        return_logits: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> Generation:
        """The Rust loop (under defer-and-fuse with ``mode=fuse``); ``on_tokens`` is its own per-batch
        callback (called with the GIL taken back)."""
        fused = self.ctx.engine_cfg.mode == EagerMode.fuse
        with tpu_eager_mode("fuse") if fused else contextlib.nullcontext():
            piece = self.ctx.engine_cfg.piece
            last_rows = piece_length(self.ctx.engine_cfg.last_piece, (len(prompt_ids) - 1) % piece + 1, piece)
            tokens, _, logits = self.native.decode(
                prompt_ids,
                max_new_tokens,
                last_rows=last_rows,
                read_every=self.ctx.read_every,
                on_tokens=on_tokens,
                return_logits=return_logits,
            )
        timers = self.native.timers
        self.piece_lengths.update(self.native.read_rows)
        return Generation(
            tokens,
            None if logits is None else logits.float().cpu(),
            read_s=timers["read_s"],
            decode_s=timers["decode_s"],
        )

    def cache_bytes(self) -> int | None:
        return self.native.cache_bytes

    def close(self) -> None:
        super().close()
        self.native = None

    def describe(self) -> dict[str, Any]:
        fused = self.ctx.engine_cfg.mode == EagerMode.fuse
        described = {"build": self.build, "layout": self.native.layout, "read_every": self.ctx.read_every,
                     "mode": str(self.ctx.engine_cfg.mode), "torch_tpu_defer_and_fuse": "1" if fused else "0",
                     "last_piece": str(self.ctx.engine_cfg.last_piece), "decode_attention": self.decode_attention,
                     "norm": self.norm, "rope": norm_cpu.ROPE if self.norm == norm_cpu.OP else norm_cpu.EAGER,
                     "residual": norm_cpu.ADD_RMS if self.norm == norm_cpu.OP else norm_cpu.EAGER,
                     "gelu": norm_cpu.GELU_MUL if self.norm == norm_cpu.OP else norm_cpu.EAGER,
                     "greedy": self.greedy_kernel,
                     "piece_lengths": {str(n): k for n, k in sorted(self.piece_lengths.items())},
                     "one_row": str(self.one_row), "one_row_choice": self.one_row_choice.record(),
                     "joined_linears": self.joined_linears,
                     "held_together_bytes": self.held_together_bytes, "product_bytes": product_bytes(self.model),
                     "weights": str(self.ctx.engine_cfg.weights), "row_linears": self.row_linears,
                     "settings_without_effect": list(self.ctx.engine_cfg.settings_without_effect()),
                     **cpu_kernels.facts(self.model)}  # fmt: skip
        if self.int4:
            described.update(int4.described(self.model, self.int4_linears))
        return described


PACKED_LINEARS = (Int4Linear, PackedLinear)
PACKED_TABLES = (Int4Embedding, PackedEmbedding)


def packed_linear(module: Any) -> tuple[Any, ...]:
    """A linear held packed, as the Rust engine's constructor takes it (``engines/rust/src/lib.rs``)."""
    if isinstance(module, Int4Linear):
        return ("int4", module.words, module.scales, module.group, module.out_features, module.limbs)
    return ("rows", module.packed, module.out_features)


def packed_table(module: Any) -> tuple[Any, ...]:
    """A table held packed: 4-bit as stored, or tied to a ``rows`` linear (its packed weight)."""
    if isinstance(module, Int4Embedding):
        return ("int4", module.packed, module.scale, module.group, module.cols)
    return ("rows", module.linear.packed)


def int4_unsupported(device: Device, run_cfg: Any) -> str | None:
    """Why ``engine=rust engine.weights=int4`` cannot run here (its products are ``int4_rows``, a CPU kernel), or
    None."""
    if run_cfg.engine.weights != Weights.int4:
        return None
    way = f"engine=rust engine.weights=int4 multiplies with {int4_cpu.OP}"
    if device.kind != "cpu":
        return f"{way}, a CPU kernel; this device is {device.kind}"
    if reason := int4_cpu.unsupported(run_cfg.dtype.torch, None):
        return f"{way}, which cannot run here: {reason}"
    return None
