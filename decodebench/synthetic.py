"""Synthetic Gemma 4 checkpoints in exactly the real repack's format, built deterministically.

Two twins share one set of values:

* ``w4a16/``: like ``xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text``: every Linear but ``lm_head`` is
  compressed-tensors W4A16 ``pack-quantized`` (int4 symmetric, group 32, bf16 scales), the vocabulary
  tables are dense and ``lm_head`` is tied to ``embed_tokens``.
* ``emb4/``: like its ``-text-emb4`` twin: ``embed_tokens_per_layer``, ``embed_tokens`` and ``lm_head``
  are int4 too (group 32 along the row, float16 scales), ``tie_word_embeddings`` false.

``config.json`` is the text config (``Gemma4ForCausalLM``, ``model_type gemma4_text``) with its
``quantization_config``, while tensors keep the multimodal ``model.language_model.*`` names, as the
real repack does.  ``build(..., group_size=)`` quantizes in groups of another size (the real repack's
is 32).  Every weight is level * scale on a grid (``_grid``) whose float16 scales bf16 cannot hold, so
the dense tables of ``w4a16/`` are float16 where the real repack's are bf16: that way they equal the
dequantized int4 tables of ``emb4/`` bit for bit, and Transformers' reference on ``w4a16/`` (it
cannot load int4 tables) is the exact model the ``emb4/`` engines run.

Build one alone: ``python -m scripts.make_checkpoint model=e2b-synthetic``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from safetensors.torch import save_file
from torch import nn
from transformers import Gemma4TextConfig, GenerationConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

from decodebench.config import SHAPE_FIELDS
from decodebench.synthetic_tokenizer import TURN_END, build_tokenizer

FORMAT_VERSION = 4  # bump whenever the bytes a shape builds change (weights, tokenizer, config)
GROUP = 32  # inputs per scale, as in the real repack
CHECKPOINT_PREFIX = "model.language_model."
# The scales each stored scale dtype gets: m * 2**e for m in the range, e the exponent (see _grid)
SCALES = {torch.bfloat16: (range(8, 16), -11), torch.float16: (range(257, 292, 2), -16)}


@dataclass(frozen=True)
class SyntheticCheckpoint:
    """Where a built synthetic model lives, and the key that names it."""

    root: Path
    key: str

    @property
    def w4a16(self) -> Path:
        return self.root / "w4a16"

    @property
    def emb4(self) -> Path:
        return self.root / "emb4"


def shape_of(model_cfg: Any, group_size: int = GROUP) -> dict[str, Any]:
    """The fields that decide a synthetic checkpoint's bytes (with its seed, group size in weights and
    format version)."""
    shape = {f: getattr(model_cfg, f) for f in SHAPE_FIELDS}
    shape["seed"] = model_cfg.seed
    shape["group_size"] = group_size
    shape["format_version"] = FORMAT_VERSION
    return shape


def checkpoint_key(model_cfg: Any, group_size: int = GROUP) -> str:
    """The cache folder's name: the model's name and a digest of everything that decides its bytes."""
    digest = hashlib.sha256(json.dumps(shape_of(model_cfg, group_size), sort_keys=True).encode()).hexdigest()[:12]
    return f"{model_cfg.name}-{digest}"


def text_config(shape: dict[str, Any], special: dict[str, int]) -> Gemma4TextConfig:
    """The Gemma 4 text config for a synthetic shape (same fields as E2B's ``text_config``)."""
    k = shape["full_attention_every"]
    n = shape["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % k == 0 else "sliding_attention" for i in range(n)]
    return Gemma4TextConfig(
        vocab_size=shape["vocab_size"],
        vocab_size_per_layer_input=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        global_head_dim=shape["global_head_dim"],
        layer_types=layer_types,
        sliding_window=shape["sliding_window"],
        num_kv_shared_layers=shape["num_kv_shared_layers"],
        use_double_wide_mlp=shape["use_double_wide_mlp"],
        hidden_size_per_layer_input=shape["hidden_size_per_layer_input"],
        max_position_embeddings=shape["max_position_embeddings"],
        final_logit_softcapping=shape["final_logit_softcapping"],
        rms_norm_eps=shape["rms_norm_eps"],
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        attention_k_eq_v=False,
        attention_bias=False,
        enable_moe_block=False,
        pad_token_id=special["<pad>"],
        bos_token_id=special["<bos>"],
        eos_token_id=[special["<eos>"], special[TURN_END]],
    )


def _generator(seed: int, name: str) -> torch.Generator:
    """One generator per tensor, so a tensor's values do not depend on the order of building."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _grid(
    rows: int, cols: int, group_size: int, scale_dtype: torch.dtype, gen: torch.Generator, chunk_rows: int = 8192
) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4 levels in [-8, 7] (int8, [rows, cols]) and one scale per ``group_size`` columns (float32,
    [rows, cols / group_size]), each scale exactly a ``scale_dtype`` value.

    compressed-tensors dequantizes in the scale's dtype, so every level * scale is exact in it too:

    * bfloat16 (the linears'): m * 2**-11 with m in 8..15, a 4-bit mantissa (0.0039 to 0.0073);
    * float16 (the tables' and ``lm_head``'s): m * 2**-16 with m odd in 257..291, a 9-bit mantissa
      that bfloat16 cannot hold (0.0039 to 0.0044), so a scale rounded to bf16 anywhere changes it;
      times a level (|level| <= 8, at most 3 significant bits) it keeps within float16's 11 bits.

    Weights have a standard deviation near 0.02 like Gemma's init.
    """
    if group_size < 1 or cols % group_size:
        raise ValueError(f"group_size={group_size} must divide a quantized weight's {cols} columns")
    levels = torch.empty(rows, cols, dtype=torch.int8)
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        levels[start:stop] = torch.randint(-8, 8, (stop - start, cols), generator=gen, dtype=torch.int8)
    mantissas, exponent = SCALES[scale_dtype]
    pick = torch.randint(len(mantissas), (rows, cols // group_size), generator=gen)
    scales = torch.tensor(mantissas, dtype=torch.float32)[pick] * 2.0**exponent
    return levels, scales


def _dense(levels: torch.Tensor, scales: torch.Tensor, chunk_rows: int = 8192) -> torch.Tensor:
    """levels * scale per group, in float16 (exact for float16 scales by construction, see ``_grid``)."""
    rows, cols = levels.shape
    out = torch.empty(rows, cols, dtype=torch.float16)
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        block = levels[start:stop].to(torch.float32).view(stop - start, scales.shape[1], -1)
        out[start:stop] = (block * scales[start:stop, :, None]).view(stop - start, cols).to(torch.float16)
    return out


def _uniform_range(name: str) -> tuple[float, float]:
    """Ranges for the small tensors of a synthetic model, chosen so outputs depend on the input.

    RMSNorm weights are used as is (not 1 + w).  Post-norms are small so that each layer adds a
    little to a residual stream that still carries the token; layer scalars stay near one so the
    stream does not vanish over 35 layers; the final norm is large (and of mixed sign) so greedy
    picks are decisive and vary from step to step instead of repeating one token.
    """
    if name.endswith("layer_scalar"):
        return 0.9, 1.0
    if name == "model.norm.weight":
        return 4.0, 6.0
    if ".post_" in name:
        return 0.4, 1.0
    return 0.8, 1.2


def _packed(name: str, levels: torch.Tensor, scales: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors for one weight."""
    rows, cols = levels.shape
    packed = torch.cat([pack_to_int32(levels[s : s + 16384], 4) for s in range(0, rows, 16384)])
    return {
        f"{name}.weight_packed": packed,
        f"{name}.weight_scale": scales.to(scale_dtype),
        f"{name}.weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }


def _quantization_config(emb4: bool, group_size: int) -> dict[str, Any]:
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights, format="pack-quantized")}
    ignore = ["lm_head"]
    if emb4:
        for group, target in (
            ("group_embed_tokens_per_layer", r"re:.*\.embed_tokens_per_layer$"),
            ("group_embed_tokens", r"re:.*\.embed_tokens$"),
            ("group_lm_head", r"re:^lm_head$"),
        ):
            groups[group] = QuantizationScheme(targets=[target], weights=weights, format="pack-quantized")
        ignore = []
    qc = QuantizationConfig(
        config_groups=groups, ignore=ignore, format="pack-quantized", quantization_status="compressed"
    )
    return qc.model_dump(mode="json")


def _write_twin(
    out: Path, config: Gemma4TextConfig, tensors: dict[str, torch.Tensor], emb4: bool, group_size: int
) -> None:
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict.update(
        architectures=["Gemma4ForCausalLM"],
        dtype="bfloat16",
        tie_word_embeddings=not emb4,
        quantization_config=_quantization_config(emb4, group_size),
    )
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)


def build(model_cfg: Any, out_root: Path, group_size: int = GROUP) -> None:
    """Writes tokenizer, ``w4a16/`` and ``emb4/`` under ``out_root`` (which must not exist), every int4
    weight quantized in groups of ``group_size`` inputs."""
    shape = shape_of(model_cfg, group_size)
    seed = model_cfg.seed
    tok_dir = out_root / "tokenizer"
    special = build_tokenizer(tok_dir, vocab_size=shape["vocab_size"], bpe_vocab=shape["tokenizer_vocab"], seed=seed)
    config = text_config(shape, special)
    with torch.device("meta"):
        skeleton = Gemma4ForCausalLM(config)
    linear_names = {n for n, m in skeleton.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    common: dict[str, torch.Tensor] = {}
    tables_dense: dict[str, torch.Tensor] = {}
    tables_int4: dict[str, torch.Tensor] = {}
    for name, meta in skeleton.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied in w4a16; written from embed_tokens' levels in emb4
        stored = CHECKPOINT_PREFIX + name.removeprefix("model.")
        gen = _generator(seed, name)
        module = name.rsplit(".", 1)[0]
        if module in linear_names:
            levels, scales = _grid(*meta.shape, group_size, torch.bfloat16, gen)
            common.update(_packed(stored.rsplit(".", 1)[0], levels, scales, torch.bfloat16))
        elif name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight")):
            levels, scales = _grid(*meta.shape, group_size, torch.float16, gen)
            tables_dense[stored] = _dense(levels, scales)
            tables_int4.update(_packed(stored.rsplit(".", 1)[0], levels, scales, torch.float16))
            if name.endswith("embed_tokens.weight"):
                tables_int4.update(_packed("lm_head", levels, scales, torch.float16))
            del levels
        else:
            low, high = _uniform_range(name)
            values = low + (high - low) * torch.rand(meta.shape, generator=gen)
            if name == "model.norm.weight":  # mixed signs: no token direction wins every step
                values *= torch.randint(0, 2, meta.shape, generator=gen) * 2 - 1
            common[stored] = values.to(torch.bfloat16)
    _write_twin(out_root / "w4a16", config, {**common, **tables_dense}, emb4=False, group_size=group_size)
    del tables_dense
    _write_twin(out_root / "emb4", config, {**common, **tables_int4}, emb4=True, group_size=group_size)
    for twin in ("w4a16", "emb4"):
        for f in tok_dir.iterdir():
            shutil.copy2(f, out_root / twin / f.name)
    provenance = {
        "synthetic": True,
        "key": out_root.name,
        "shape": shape,
        "note": "weights are random, on an int4 grid",
    }
    for twin in ("w4a16", "emb4"):
        (out_root / twin / "decodebench_synthetic.json").write_text(json.dumps(provenance, indent=2) + "\n")


def ensure_synthetic(model_cfg: Any, cache_dir: str | Path, group_size: int = GROUP) -> SyntheticCheckpoint:
    """Builds the synthetic checkpoint (int4 groups of ``group_size`` inputs) on first use; later calls
    find it by its key.

    The build goes to a temporary folder that is renamed into place only when complete, under a
    lock file, so an interrupted build never leaves a half checkpoint behind.
    """
    import fcntl

    root = Path(cache_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    key = checkpoint_key(model_cfg, group_size)
    final = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "emb4" / "decodebench_synthetic.json").exists():
            tmp = root / f"{key}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            print(
                f"[decodebench] building synthetic checkpoint {key} (first use) ...",
                file=sys.stderr,
                flush=True,
            )
            build(model_cfg, tmp, group_size)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    return SyntheticCheckpoint(root=final, key=key)
