"""The one loader: synthetic, hub id or local path, W4A16 `-ct-text` or its `-emb4` twin.

A checkpoint's tensors are read with safetensors, the text prefix is detected
(``model.language_model.``, ``language_model.``, ``model.``), compressed-tensors ``pack-quantized``
weights are unpacked with compressed-tensors' own helpers and dequantized to the run's dtype, and
Transformers' ``Gemma4ForCausalLM`` is built from the state dict.  Any weight the model expects but
the checkpoint lacks is an error, never a silent random init (the trap in shared/notes section 4).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from safetensors import safe_open
from transformers import AutoTokenizer, Gemma4TextConfig, PreTrainedTokenizerBase
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

from decodebench.config import ModelSource
from decodebench.layout import layers_of_config
from decodebench.synthetic import ensure_synthetic

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
INT4_TABLES = ("embed_tokens_per_layer",)  # tables a 4-bit-table engine keeps packed
EMB4_TABLES = ("embed_tokens", "embed_tokens_per_layer")  # what an -emb4 twin stores pack-quantized int4
KEY_MAPPING = {r"^model\.language_model\.": "model."}  # the repack's multimodal names -> the text model's
INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}  # the one weight quantization read


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not fit the model it claims to be."""


@dataclass
class Checkpoint:
    """A checkpoint folder on disk and what it says about itself."""

    path: Path
    config: Gemma4TextConfig
    quantization: dict[str, Any] | None
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_ids(self) -> list[int]:
        eos = self.config.eos_token_id
        return list(eos) if isinstance(eos, list | tuple) else [eos]


@dataclass
class PackedTable:
    """An int4 weight kept packed as the checkpoint stores it (a table, or a linear [out, in]): int32
    words [rows, cols/8] of level + 8, low nibble first, and one scale per ``group_size`` columns
    ([rows, cols/group_size], in the dtype the checkpoint stores them in)."""

    packed: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]
    group_size: int


def resolve(model_cfg: Any, tables: str, cache_dir: str | Path) -> Checkpoint:
    """Finds (building or downloading if needed) the checkpoint a model config names.

    ``tables='int4'`` picks the ``-emb4`` twin, ``'bf16'`` the ``-ct-text`` one.
    """
    if model_cfg.source == ModelSource.synthetic:
        built = ensure_synthetic(model_cfg, cache_dir)
        path = built.emb4 if tables == "int4" else built.w4a16
        provenance = {"kind": "synthetic", "synthetic": True, "key": built.key, "path": str(path)}
    else:
        setting = "model.emb4_path" if tables == "int4" else "model.path"
        local = model_cfg.emb4_path if tables == "int4" else model_cfg.path
        hub_id = model_cfg.emb4_hub_id if tables == "int4" else model_cfg.hub_id
        if local:
            path = Path(local)
            provenance = {"kind": "path", "synthetic": False, "path": str(path), "hub_id": hub_id}
        else:
            path = _download(hub_id, setting)
            provenance = {"kind": "hub", "synthetic": False, "hub_id": hub_id, "path": str(path)}
        if tables == "int4":
            check_emb4_twin(path, f"{setting}={path}" if local else f"model.emb4_hub_id={hub_id} ({path})")
    ckpt = open_checkpoint(path)
    ckpt.provenance.update(provenance)
    ckpt.provenance["tables_description"] = "int4 tables (-emb4)" if tables == "int4" else "W4A16 linears, bf16 tables"
    return ckpt


def check_emb4_twin(path: Path, named: str) -> None:
    """An error unless the folder ``named`` (``model.emb4_path=...``) stores the vocabulary tables int4-packed, as
    an ``-emb4`` twin does (an engine that keeps them 4-bit looks them up packed); reads the safetensors headers."""
    packed = {n.removesuffix(".weight_packed").rpartition(".")[2] for n in stored_names(path) if n.endswith("_packed")}
    missing = [table for table in EMB4_TABLES if table not in packed]
    if missing:
        raise CheckpointError(
            f"{named} is not an -emb4 twin: its safetensors hold no int4-packed vocabulary table "
            f"({', '.join(f'{table}.weight_packed' for table in missing)} missing); an -emb4 twin (the -ct-text-emb4 "
            f"repack) stores {', '.join(EMB4_TABLES)} and lm_head pack-quantized int4 (weight_packed, weight_scale, "
            "weight_shape), where the -ct-text twin (model.path) stores the tables dense"
        )


FETCH_HINTS = {  # how to run when a twin cannot be fetched, by the setting that names a local copy of it
    "model.path": "download it elsewhere and pass model.path=<folder>",
    "model.emb4_path": "this run keeps vocabulary tables 4-bit, read from the -emb4 twin (model.path is the -ct-text "
    "one): download it elsewhere and pass model.emb4_path=<folder>, or run without the twin: "
    "engine.per_layer_table=bf16, with engine.weights=dense and model.tables=bf16",
}


def _download(hub_id: str | None, setting: str) -> Path:
    """The hub checkpoint ``hub_id`` in the local hub cache; ``setting``: what names a local copy instead."""
    if not hub_id:
        raise CheckpointError(f"this model names no hub id; set {setting}= to a local copy")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model"]))
    except Exception as exc:  # offline, private, or missing: say which checkpoint and how to work around
        raise CheckpointError(
            f"could not fetch {hub_id} from the hub ({type(exc).__name__}: {exc}); {FETCH_HINTS[setting]}"
        ) from exc


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Reads config.json (text or multimodal) and checks the folder holds safetensors."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} holds no config.json: not a checkpoint folder")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from exc
    if not _weight_files(path):
        raise CheckpointError(f"{path} holds no .safetensors weights")
    text = dict(raw.get("text_config") or raw)  # a multimodal config nests the text one
    text.pop("quantization_config", None)
    text["model_type"] = "gemma4_text"
    if "eos_token_id" not in text and "eos_token_id" in raw:
        text["eos_token_id"] = raw["eos_token_id"]
    generation = path / "generation_config.json"
    if generation.is_file():  # the stop set is the generation config's (Gemma: [1, 106, 50])
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            text["eos_token_id"] = eos
    config = Gemma4TextConfig.from_dict(text)
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]
    provenance = {"config_sha256_16": digest}
    marker = path / "decodebench_synthetic.json"
    if marker.is_file():
        provenance.update(json.loads(marker.read_text()))
    provenance.setdefault("shape", shape_of_config(config))
    provenance["layers"] = layers_of_config(config)
    return Checkpoint(path=path, config=config, quantization=raw.get("quantization_config"), provenance=provenance)


def shape_of_config(config: Gemma4TextConfig) -> dict[str, Any]:
    """The shape fields decodebench's derived figures use, read from a checkpoint's text config."""
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    sliding = next((i for i, t in enumerate(config.layer_types) if t != "full_attention"), 0)
    local = config.per_layer_config[sliding]  # head_dim and KV heads are per-layer attributes in Gemma 4
    full_head = config.per_layer_config[full[0]].head_dim if full else local.head_dim
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": local.num_key_value_heads,
        "head_dim": local.head_dim,
        "global_head_dim": full_head,
        "full_attention_every": full[1] - full[0] if len(full) > 1 else config.num_hidden_layers,
        "sliding_window": config.sliding_window,
        "num_kv_shared_layers": config.num_kv_shared_layers,
        "use_double_wide_mlp": config.use_double_wide_mlp,
        "hidden_size_per_layer_input": config.hidden_size_per_layer_input,
        "max_position_embeddings": config.max_position_embeddings,
    }


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def stored_names(path: Path) -> list[str]:
    """Every tensor name of every shard, as stored (read from the headers, no tensor is loaded)."""
    names: list[str] = []
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                names += list(f.keys())
        except Exception as exc:
            raise CheckpointError(f"{file} is unreadable or corrupt: {exc}") from exc
    return names


class StoredTensors(Mapping[str, torch.Tensor]):
    """Every tensor of every shard by its name as stored, read from the file each time it is asked for: with
    ``pread`` (a tensor of its own, no view of a mapped file), so a caller that drops each tensor once used holds the
    file's tensors one at a time, not all of them (``stored_tensors`` opens and closes the shards)."""

    def __init__(self, shards: dict[str, Any]) -> None:
        self.shards = shards  # stored name -> the open shard holding it

    def __getitem__(self, name: str) -> torch.Tensor:
        shard = self.shards[name]
        try:
            return shard.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{name} is unreadable or corrupt in its shard: {exc}") from exc

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)


@contextmanager
def stored_tensors(path: Path) -> Iterator[StoredTensors]:
    """The checkpoint's shards opened for reading tensor by tensor (``StoredTensors``), closed on leaving."""
    with ExitStack() as stack:
        shards: dict[str, Any] = {}
        for file in _weight_files(path):
            if not file.is_file():
                raise CheckpointError(f"shard {file} named by the index is missing")
            try:
                shard = stack.enter_context(safe_open(str(file), framework="pt", backend="pread"))
                shards.update(dict.fromkeys(shard.keys(), shard))
            except Exception as exc:
                raise CheckpointError(f"{file} is unreadable or corrupt: {exc}") from exc
        yield StoredTensors(shards)


def _text_prefix(names: list[str]) -> str:
    for prefix in TEXT_PREFIXES:
        if any(n.startswith(prefix + "layers.") for n in names):
            return prefix
    raise CheckpointError("no Gemma 4 decoder layers found under " + ", ".join(TEXT_PREFIXES))


def _quant_args(quantization: dict[str, Any] | None, stored_name: str, is_table: bool) -> QuantizationArgs:
    """The weight args of the config group whose targets match a packed module; an error unless they
    are ``INT4``'s (4-bit symmetric integers in groups), the one quantization decodebench reads."""
    if not quantization:
        raise CheckpointError(f"{stored_name} is packed but config.json has no quantization_config")
    for group in quantization.get("config_groups", {}).values():
        for target in group.get("targets", []):
            regex = target[3:] if target.startswith("re:") else None
            if (regex and re.match(regex, stored_name)) or (target == "Linear" and not is_table):
                args = QuantizationArgs(**group["weights"])
                wrong = [f"{key}={getattr(args, key)}" for key, value in INT4.items() if getattr(args, key) != value]
                if wrong:
                    rule = ", ".join(f"{key}={value}" for key, value in INT4.items())
                    raise CheckpointError(
                        f"checkpoint quantizes {stored_name} with {', '.join(wrong)}; decodebench reads {rule}"
                    )
                return args
    raise CheckpointError(f"no quantization group targets {stored_name}")


def stored_shape(tensors: Mapping[str, torch.Tensor], stored: str) -> tuple[int, ...]:
    """[out, in] of a pack-quantized weight, as its ``weight_shape`` tensor states it."""
    return tuple(tensors[f"{stored}.weight_shape"].tolist())


def unpack_weight(tensors: Mapping[str, torch.Tensor], stored: str) -> torch.Tensor:
    """Int4 levels (int8, -8..7) of a pack-quantized weight, shape [out, in]."""
    return unpack_from_int32(tensors[f"{stored}.weight_packed"], 4, torch.Size(stored_shape(tensors, stored)))


def dequantize(levels: torch.Tensor, scale: torch.Tensor, args: QuantizationArgs, dtype: torch.dtype) -> torch.Tensor:
    """w = level * scale[group], computed in float32 and cast once to ``dtype`` (``args`` as ``_quant_args``
    gives them: groups of ``args.group_size`` columns)."""
    rows, cols = levels.shape
    grouped = levels.to(torch.float32).view(rows, cols // args.group_size, args.group_size)
    return (grouped * scale.to(torch.float32)[:, :, None]).view(rows, cols).to(dtype)


def text_state_dict(
    ckpt: Checkpoint, dtype: torch.dtype, keep_packed: tuple[str, ...] = (), keep_linears: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, PackedTable]]:
    """The model's state dict (names as ``Gemma4ForCausalLM`` wants them), dequantized to ``dtype``.

    Tables named in ``keep_packed`` (and with ``keep_linears`` every packed linear) stay int4 and are
    returned separately, keyed by module path. Each stored tensor is read when its module is (``StoredTensors``: no
    view of a mapped file) and dropped once dequantized, so the load holds the dequantized state dict and one
    module's stored tensors at most: read all at once, or as views of the mapped file, the file's tensors were held
    beside the state dict until the end (6.5 GB of e2b-synthetic's W4A16 twin in the peak of the dense Rust engine's
    load, 16.5 GB where its state dict was 10.2), and a view left in the state dict (a norm already in ``dtype``) kept
    every page the load had read resident after it.
    """
    with stored_tensors(ckpt.path) as tensors:
        return _text_state_dict(ckpt, tensors, dtype, keep_packed, keep_linears)


def _text_state_dict(ckpt: Checkpoint, tensors: StoredTensors, dtype: torch.dtype, keep_packed: tuple[str, ...],
                     keep_linears: bool) -> tuple[dict[str, torch.Tensor], dict[str, PackedTable]]:  # fmt: skip
    """``text_state_dict`` over the open shards."""
    prefix = _text_prefix(list(tensors))
    out: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedTable] = {}
    for stored in sorted(tensors):
        if stored.startswith(prefix):
            name = "model." + stored.removeprefix(prefix)
        elif stored.startswith("lm_head."):
            name = stored
        else:
            continue  # vision / audio towers of a multimodal repack
        module, _, leaf = name.rpartition(".")
        if leaf in PACKED_SUFFIXES:
            if leaf != "weight_packed":
                continue
            stored_module = stored.rpartition(".")[0]
            is_table = module.endswith(("embed_tokens", "embed_tokens_per_layer")) or module == "lm_head"
            args = _quant_args(ckpt.quantization, stored_module, is_table)
            scale = tensors[f"{stored_module}.weight_scale"]
            rows, cols = shape = stored_shape(tensors, stored_module)
            if cols % args.group_size or tuple(scale.shape) != (rows, cols // args.group_size):
                raise CheckpointError(
                    f"{stored_module}: {tuple(scale.shape)} scales do not fit a {shape} weight quantized with "
                    f"group_size={args.group_size} (one scale per group_size columns)"
                )
            if module.rpartition(".")[2] in keep_packed or (keep_linears and not is_table):
                packed[module] = PackedTable(tensors[stored], scale, shape, args.group_size)
                continue
            out[f"{module}.weight"] = dequantize(unpack_weight(tensors, stored_module), scale, args, dtype)
        else:
            value = tensors[stored]
            out[name] = value.to(dtype) if value.is_floating_point() else value
    return out, packed


def load_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    keep_packed: tuple[str, ...] = (),
    keep_linears: bool = False,
) -> tuple[Gemma4ForCausalLM, dict[str, PackedTable]]:
    """Builds ``Gemma4ForCausalLM`` on ``device`` from the checkpoint; errors on any missing weight.

    Weights kept packed (``keep_packed`` tables, ``keep_linears``) get a zero-stride placeholder that
    holds no memory; the caller replaces those modules with its own int4 ones (engines/table4.py,
    engines/int4.py).
    """
    state, packed = text_state_dict(ckpt, dtype, keep_packed, keep_linears)
    config = Gemma4TextConfig.from_dict(ckpt.config.to_dict())
    if "lm_head.weight" in state:
        config.tie_word_embeddings = False
    for module, table in packed.items():  # zero-stride placeholder (no memory); the engine swaps the module
        state[f"{module}.weight"] = torch.zeros((), dtype=dtype).expand(*table.shape)
    model, info = Gemma4ForCausalLM.from_pretrained(
        None, config=config, state_dict=state, dtype=dtype, device_map=str(device), output_loading_info=True
    )
    missing = sorted(info["missing_keys"])
    mismatched = [k for k, *_ in info["mismatched_keys"]]
    if missing or mismatched:
        raise CheckpointError(
            f"{ckpt.path}: the model would be left with uninitialised weights: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, wrong shape {mismatched[:8]}"
        )
    model.eval()
    model.generation_config.eos_token_id = ckpt.eos_ids
    model.generation_config.pad_token_id = ckpt.config.pad_token_id
    return model, packed


def load_tokenizer(ckpt: Checkpoint) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(ckpt.path))
    except Exception as exc:
        raise CheckpointError(f"{ckpt.path}: tokenizer could not be loaded: {exc}") from exc


def load_transformers(
    ckpt: Checkpoint, dtype: torch.dtype, device_map: str | None, *, mapped: bool = True, dequantize: bool = False
) -> tuple[Gemma4ForCausalLM, dict[str, Any]]:
    """Transformers' own loading path (its compressed-tensors integration), the way the Colab article
    loads the repack; returns the model and Transformers' loading info (missing and unexpected keys).

    The text config gets the checkpoint's ``quantization_config`` with its ``ignore`` list in the text
    model's names (shared/notes section 4). ``mapped``: the stored multimodal names are renamed with
    ``KEY_MAPPING``; without it none of them match. ``device_map=None`` leaves the model on the host.
    Weights are dequantized by Transformers and compressed-tensors, not by us: by default the linears stay
    packed at load and are unpacked at the first forward (and kept so); ``dequantize``: unpacked at load
    (compressed-tensors' ``dequantize=True``).
    """
    config = Gemma4TextConfig.from_dict(ckpt.config.to_dict())
    if ckpt.quantization:
        quantization = json.loads(json.dumps(ckpt.quantization))
        quantization["ignore"] = [re.sub(r"^model\.language_model\.", "model.", i) for i in quantization["ignore"]]
        quantization["dequantize"] = dequantize
        config.quantization_config = quantization
    return Gemma4ForCausalLM.from_pretrained(
        str(ckpt.path),
        config=config,
        key_mapping=KEY_MAPPING if mapped else None,
        dtype=dtype,
        device_map=device_map,
        output_loading_info=True,
    )


def load_reference(
    ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, *, dequantize: bool = False
) -> Gemma4ForCausalLM:
    """``load_transformers`` onto ``device`` with the key mapping; any weight left uninitialised is an error."""
    model, info = load_transformers(ckpt, dtype, str(device), dequantize=dequantize)
    if info["missing_keys"]:
        raise CheckpointError(
            f"reference load of {ckpt.path} left weights uninitialised: {sorted(info['missing_keys'])[:8]}"
        )
    model.eval()
    model.generation_config.eos_token_id = ckpt.eos_ids
    model.generation_config.pad_token_id = ckpt.config.pad_token_id
    return model
