"""Synthetic checkpoints are in the real repack's format, and the one loader reads them exactly."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from decodebench import checkpoint
from decodebench.checkpoint import CheckpointError, StoredTensors, load_model, open_checkpoint, text_state_dict
from decodebench.synthetic import build, checkpoint_key
from tests.conftest import make_cfg


def numpy_dequant(packed: np.ndarray, scale: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """An independent reading of pack-quantized: nibble i of word j is level+8 of column 8j+i."""
    rows, cols = (int(v) for v in shape)
    words = packed.view(np.uint32)
    nibbles = np.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(rows, -1)[:, :cols]
    levels = nibbles.astype(np.float32) - 8.0
    return levels * np.repeat(scale.astype(np.float32), 32, axis=1)


def test_format_matches_the_real_repack(tiny):
    config = json.loads((tiny.w4a16 / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForCausalLM"] and config["model_type"] == "gemma4_text"
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    weights = q["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["strategy"]) == (
        4,
        32,
        True,
        "group",
    )
    assert q["ignore"] == ["lm_head"]
    tensors = load_file(tiny.w4a16 / "model.safetensors")
    assert all(name.startswith("model.language_model.") for name in tensors)
    q_proj = "model.language_model.layers.0.self_attn.q_proj"
    assert tensors[f"{q_proj}.weight_packed"].dtype == torch.int32
    assert tensors[f"{q_proj}.weight_scale"].dtype == torch.bfloat16
    assert "lm_head.weight" not in tensors and config["tie_word_embeddings"] is True
    twin = json.loads((tiny.emb4 / "config.json").read_text())
    assert twin["tie_word_embeddings"] is False
    assert {"group_embed_tokens_per_layer", "group_embed_tokens", "group_lm_head"} <= set(
        twin["quantization_config"]["config_groups"]
    )
    twin_tensors = load_file(tiny.emb4 / "model.safetensors")
    assert twin_tensors["model.language_model.embed_tokens_per_layer.weight_scale"].dtype == torch.float16
    assert "lm_head.weight_packed" in twin_tensors


def test_loaded_weights_equal_the_dequantized_saved_ones(tiny):
    saved = load_file(tiny.w4a16 / "model.safetensors")
    model, _ = load_model(open_checkpoint(tiny.w4a16), torch.float32, torch.device("cpu"))
    state = model.state_dict()
    checked = 0
    for name in saved:
        if not name.endswith(".weight_packed"):
            continue
        module = name.removesuffix(".weight_packed")
        expected = numpy_dequant(
            saved[name].numpy(),
            saved[f"{module}.weight_scale"].float().numpy(),
            saved[f"{module}.weight_shape"].numpy(),
        )
        loaded = state["model." + module.removeprefix("model.language_model.") + ".weight"]
        np.testing.assert_array_equal(loaded.numpy(), expected)
        checked += 1
    assert checked > 20
    for name, tensor in saved.items():
        if tensor.is_floating_point() and ".weight_" not in name:
            assert torch.equal(state["model." + name.removeprefix("model.language_model.")], tensor.float())
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


def mapped_ranges(file: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps ``file`` (``/proc/self/maps``)."""
    ranges, path = [], file.resolve()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]) == path:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux) to see the mappings")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loaded_model_holds_no_view_of_the_checkpoint_file(tiny, dtype):
    """Every weight is copied out of the mapped file, a norm already in the run's dtype too: a view of it would
    keep the whole file mapped and every page the load read of it resident."""
    ckpt = open_checkpoint(tiny.w4a16)
    model, _ = load_model(ckpt, dtype, torch.device("cpu"))
    ranges = mapped_ranges(ckpt.path / "model.safetensors")
    views = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
             if any(start <= t.data_ptr() < end for start, end in ranges)]  # fmt: skip
    assert views == []


def test_the_loader_holds_one_modules_stored_tensors_at_a_time(tiny, monkeypatch):
    """Each packed weight's words and scales are read when its module is and dropped once dequantized: whenever a
    weight is dequantized, the words and scales read from the file and still alive are one module's at most (read all
    at once, every module's were alive beside the state dict until the load's end)."""
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    most = 0
    read, dequantize = StoredTensors.__getitem__, checkpoint.dequantize

    def reading(self: StoredTensors, name: str) -> torch.Tensor:
        tensor = read(self, name)
        if name.endswith(("weight_packed", "weight_scale")):
            alive.add(tensor)
        return tensor

    def dequantizing(*args, **kwargs) -> torch.Tensor:
        nonlocal most
        gc.collect()
        most = max(most, sum(t.nbytes for t in alive))
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(StoredTensors, "__getitem__", reading)
    monkeypatch.setattr(checkpoint, "dequantize", dequantizing)
    stored = load_file(tiny.w4a16 / "model.safetensors")
    modules = {name.rpartition(".")[0] for name in stored if name.endswith("weight_packed")}
    one_module = max(stored[f"{m}.weight_packed"].nbytes + stored[f"{m}.weight_scale"].nbytes for m in modules)
    all_modules = sum(stored[f"{m}.weight_packed"].nbytes + stored[f"{m}.weight_scale"].nbytes for m in modules)
    text_state_dict(open_checkpoint(tiny.w4a16), torch.bfloat16)
    largest_scales = max(stored[f"{m}.weight_scale"].nbytes for m in modules)  # alive while its module dequantizes
    assert len(modules) > 1 and one_module < all_modules / 2  # a load that held them all would be caught
    assert largest_scales <= most <= one_module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twins_dequantize_to_the_same_model(tiny, dtype):
    """The dense float16 tables of w4a16 are emb4's int4 ones dequantized (so Transformers' reference on
    w4a16 is the model the emb4 engines run), in a float32 run and rounded once in a bf16 one."""
    a, _ = load_model(open_checkpoint(tiny.w4a16), dtype, torch.device("cpu"))
    b, _ = load_model(open_checkpoint(tiny.emb4), dtype, torch.device("cpu"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_build_is_deterministic(tmp_path):
    cfg = make_cfg("model.vocab_size=1024", "model.tokenizer_vocab=600").model
    build(cfg, tmp_path / "a")
    build(cfg, tmp_path / "b")
    for twin in ("w4a16", "emb4"):
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            digest = [hashlib.sha256((tmp_path / r / twin / name).read_bytes()).hexdigest() for r in "ab"]
            assert digest[0] == digest[1], f"{twin}/{name} differs between two builds"


def test_shape_overrides_name_another_checkpoint():
    base = make_cfg().model
    other = make_cfg("model.num_hidden_layers=7", "model.sliding_window=8").model
    assert checkpoint_key(base) != checkpoint_key(other)
    assert checkpoint_key(base) != checkpoint_key(base, group_size=64)
    assert checkpoint_key(base) == checkpoint_key(make_cfg().model) == checkpoint_key(base, group_size=32)


def _copy(tiny, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny.w4a16, dst)
    return dst


def test_missing_weight_is_an_error_not_a_random_init(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.language_model.layers.1.mlp.up_proj.weight_packed"]
    del tensors["model.language_model.layers.1.mlp.up_proj.weight_scale"]
    del tensors["model.language_model.layers.1.mlp.up_proj.weight_shape"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="uninitialised.*layers.1.mlp.up_proj.weight"):
        load_model(open_checkpoint(path), torch.float32, torch.device("cpu"))


def test_scales_that_do_not_fit_the_group_size_are_an_error(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64  # tensors: groups of 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"down_proj: \(128, 8\) scales do not fit a \(128, 256\) weight.*group_size=64"
    ):
        load_model(open_checkpoint(path), torch.float32, torch.device("cpu"))


def test_corrupt_and_missing_checkpoints_say_what_and_why(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(open_checkpoint(path), torch.float32, torch.device("cpu"))
    with pytest.raises(CheckpointError, match="no config.json"):
        open_checkpoint(tmp_path / "nowhere")
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(path)


def test_multimodal_config_loads_the_same_model(tiny, tmp_path):
    """A repack whose config.json is the multimodal one (text_config nested) loads identically."""
    path = _copy(tiny, tmp_path)
    text = json.loads((path / "config.json").read_text())
    quantization = text.pop("quantization_config")
    multimodal = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "quantization_config": quantization,
        "vision_config": None,
    }
    (path / "config.json").write_text(json.dumps(multimodal))
    a, _ = load_model(open_checkpoint(tiny.w4a16), torch.float32, torch.device("cpu"))
    b, _ = load_model(open_checkpoint(path), torch.float32, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
