"""Weights that stay 4-bit while they compute: the repack keeps the checkpoint's numbers (its scales as
stored, its group size), the kernel the evidence names is the one that runs, the bytes held are four
bits a weight plus scales, parity holds."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from safetensors.torch import load_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

from decodebench.checkpoint import PackedTable, open_checkpoint, text_state_dict
from engines import int4, int4_cpu
from engines.base import EngineLimit
from runner import run_cell
from tests.conftest import opened
from tests.test_engines import parity


def packed_weight(rows: int, cols: int, group: int = 32) -> tuple[PackedTable, torch.Tensor]:
    """Random levels and bf16 scales, one per ``group`` inputs, packed as the checkpoint stores them;
    the dense weight."""
    torch.manual_seed(0)
    levels = torch.randint(-8, 8, (rows, cols), dtype=torch.int8)
    scale = (torch.rand(rows, cols // group) * 0.02 + 0.001).to(torch.bfloat16)
    dense = (levels.float().view(rows, -1, group) * scale.float()[..., None]).view(rows, cols)
    return PackedTable(pack_to_int32(levels, 4), scale, (rows, cols), group), dense


ATEN, ROWS = int4.KERNELS["cpu"], int4_cpu.OP


def runs_here(kernel: str | None, dtype: torch.dtype = torch.bfloat16, group: int = 32) -> None:
    """Skips a test of ``int4_rows`` where this CPU or dtype cannot run it, saying why."""
    reason = int4_cpu.unsupported(dtype, group) if kernel == ROWS else None
    if reason:
        pytest.skip(f"{ROWS}: {reason}")


@pytest.mark.parametrize(("kind", "kernel", "group"), [("cpu", ATEN, 32), ("cpu", ATEN, 64), ("cpu", ATEN, 256),
                                                       ("cpu", ROWS, 32), ("cpu", ROWS, 48), ("cpu", ROWS, 256),
                                                       ("tpu", None, 32), ("tpu", None, 48)])  # fmt: skip
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int4_linear_equals_the_dense_matmul_on_the_dequantized_weight(kind, kernel, group, dtype, tolerance):
    weight, dense = packed_weight(96, 768, group)
    if kernel == ROWS and dtype != torch.bfloat16:  # asked for by name where it cannot compute: refused, not run
        with pytest.raises(EngineLimit, match=f"{ROWS} cannot compute this weight here: it computes bf16 activations"):
            int4.Int4Linear(weight, dtype, torch.device("cpu"), kind=kind, kernel=kernel)
        return
    runs_here(kernel, dtype, group)
    x = torch.randn(3, 5, 768)
    layer = int4.Int4Linear(weight, dtype, torch.device("cpu"), kind=kind, kernel=kernel)
    got = layer(x.to(dtype)).float()
    expected = x.to(dtype).float() @ dense.t()
    assert got.shape == (3, 5, 96)
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def test_a_group_size_no_cpu_kernel_takes_is_refused_by_name():
    weight, _ = packed_weight(96, 768, 12)  # not a multiple of 8 (int4_rows), nor 32, 64, 128 or 256 (aten)
    with pytest.raises(EngineLimit, match=r"group_size=12.*32, 64, 128 or 256"):
        int4.Int4Linear(weight, torch.bfloat16, torch.device("cpu"), kind="cpu")
    weight, _ = packed_weight(96, 768, 48)
    with pytest.raises(EngineLimit, match=r"group_size=48.*32, 64, 128 or 256"):
        int4.Int4Linear(weight, torch.bfloat16, torch.device("cpu"), kind="cpu", kernel=ATEN)


def test_scales_the_run_dtype_cannot_hold_as_a_sum_are_refused_by_name():
    weight, _ = packed_weight(96, 768)
    weight.scale[0, 0] = 2.0**-40  # below float16's smallest subnormal (2**-24): no sum of float16 values
    with pytest.raises(EngineLimit, match=r"torch.bfloat16 scales.*torch.float16"):
        int4.Int4Linear(weight, torch.float16, torch.device("cpu"), kind="cpu", kernel=ATEN)


def level_one_probe(levels: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with a level-1 weight in each of their first two groups (columns a and b), and per such row an
    input that is +1 at a and -1 at b: its output at that row is scale[row, 0] - scale[row, 1]."""
    first, second = (levels[:, g * group : (g + 1) * group] == 1 for g in (0, 1))
    rows = torch.nonzero(first.any(1) & second.any(1)).view(-1)
    x = torch.zeros(len(rows), levels.shape[1])
    x[torch.arange(len(rows)), first[rows].float().argmax(1)] = 1.0
    x[torch.arange(len(rows)), group + second[rows].float().argmax(1)] = -1.0
    return rows, x


@pytest.mark.parametrize("kernel", [ATEN, ROWS])
def test_float16_scales_round_trip_through_the_loader_and_the_int4_modules(tiny, kernel):
    """lm_head and the tables of the -emb4 twin store float16 scales none of which is a bf16 value; the
    loader hands them on as stored, the lookups hold them as stored, and in a bf16 run the CPU kernel
    computes with them exactly (either CPU kernel): a difference of two scales that bf16 holds comes out exact, where
    scales rounded to bf16 first give another number."""
    stored = load_file(tiny.emb4 / "model.safetensors")
    _, packed = text_state_dict(
        open_checkpoint(tiny.emb4), torch.bfloat16, keep_packed=int4.LOOKUPS + ("lm_head",), keep_linears=True
    )
    for path in ("lm_head", "model.embed_tokens", "model.embed_tokens_per_layer"):
        scale = stored[path.replace("model.", "model.language_model.") + ".weight_scale"]
        assert scale.dtype == torch.float16
        assert not torch.equal(scale.to(torch.bfloat16).to(torch.float16), scale), f"{path}: bf16 holds its scales"
        assert packed[path].scale.dtype == torch.float16 and torch.equal(packed[path].scale, scale), path
        assert packed[path].group_size == 32, path
    lookup = int4.Int4Embedding(packed["model.embed_tokens"], 1.0, torch.bfloat16, torch.device("cpu"))
    assert torch.equal(lookup.scale, packed["model.embed_tokens"].scale) and lookup.scale.dtype == torch.float16

    head, scale = packed["lm_head"], stored["lm_head.weight_scale"].double()
    levels = unpack_from_int32(head.packed, 4, torch.Size(head.shape))
    rows, x = level_one_probe(levels, head.group_size)
    exact = scale[rows, 0] - scale[rows, 1]
    assert len(rows) > 100 and torch.equal(exact.to(torch.bfloat16).double(), exact), "bf16 holds the differences"
    rounded = scale.to(torch.bfloat16).double()
    assert not torch.equal(rounded[rows, 0] - rounded[rows, 1], exact), "the probe must tell rounded scales apart"
    runs_here(kernel)
    layer = int4.Int4Linear(head, torch.bfloat16, torch.device("cpu"), kind="cpu", kernel=kernel)
    got = layer(x.to(torch.bfloat16))[torch.arange(len(rows)), rows]
    assert torch.equal(got.double(), exact)


class OpCalls(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active, by name (``aten.<op>``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_int4_linear_runs_the_kernel_the_evidence_names(cache_dir, tiny, dtype):
    engine = opened(f"cache_dir={cache_dir}", "engine=compiled", "engine.weights=int4", f"dtype={dtype}").load()
    described = engine.describe()
    linears = {name: m for name, m in engine.model.named_modules() if isinstance(m, int4.Int4Linear)}
    with torch.device("meta"):
        skeleton = Gemma4ForCausalLM(engine.checkpoint.config)
    assert described["int4_linears"] == len(linears) == sum(isinstance(m, nn.Linear) for m in skeleton.modules())
    assert not any(isinstance(m, nn.Linear) for m in engine.model.modules())
    forwards: Counter[str] = Counter()
    for name, module in linears.items():
        module.register_forward_hook(lambda m, args, out, name=name: forwards.update([name]))
    with torch.inference_mode(), OpCalls() as ops:
        engine.model(torch.tensor([[2, 40, 41, 42, 43]]))
    # each linear's forward calls the kernel once, aten's once per scale part: lm_head's float16 scales take two
    # bf16 parts; int4_rows reads them as stored
    split = described["int4_kernel"] == ATEN and dtype == "bfloat16"
    assert described["int4_kernel"] == (ROWS if dtype == "bfloat16" and int4_cpu.unsupported(torch.bfloat16, 32) is None
                                        else ATEN)  # fmt: skip
    parts = {name: 2 if name == "lm_head" and split else 1 for name in linears}
    assert forwards["lm_head"] == 1 and ops.calls[described["int4_kernel"]] == sum(
        parts[name] * n for name, n in forwards.items()
    )
    assert not {"aten.mm", "aten.addmm", "aten.linear"} & set(ops.calls), "a weight multiplied dense"
    engine.close()


@pytest.mark.parametrize("engine", ["compiled", "ring"])
def test_int4_engines_write_the_reference_tokens(cell_cfg, tiny, engine):
    record = parity(cell_cfg, engine, "engine.weights=int4")
    out = record["outputs"]["prompt"]
    assert out["first_difference"] is None and out["kl_max"] < 1e-6
    assert record["outputs"]["verdict"] == "pass"


def int4_bytes_from_shapes(config, dtype: torch.dtype, stored: dict[str, torch.Tensor]) -> int:
    """What ``engine.weights=int4`` holds, in bytes, from the text config's shapes alone (the state dict of
    a skeleton on the meta device) and the dtype of the checkpoint's stored scales: 4 bits a weight for every
    linear and vocabulary table; per group of 32 weights a table keeps its float16 scale (2 bytes); a linear
    computed by ``int4_rows`` (bf16 on a CPU that runs it) keeps its stored scales, its outputs padded to whole
    tiles of 16; one computed by aten's kernel a scale and a zero in the run's dtype, lm_head's float16 scales
    as two such parts in bf16; every other value in the run's dtype."""
    with torch.device("meta"):
        skeleton = Gemma4ForCausalLM(config)
    size = torch.tensor([], dtype=dtype).element_size()
    rows_kernel = int4.chosen("cpu", dtype, 32) == ROWS
    total = 0
    for name, value in skeleton.state_dict().items():
        module, n = skeleton.get_submodule(name.rpartition(".")[0]), value.numel()
        if isinstance(module, nn.Linear) and rows_kernel:
            out, inputs = value.shape
            scale = stored[name.replace("model.", "model.language_model.", 1) + "_scale"]
            total += -(-out // 16) * 16 * inputs * (1 / 2 + scale.element_size() / 32)
        elif isinstance(module, nn.Linear):
            parts = 2 if name == "lm_head.weight" and dtype == torch.bfloat16 else 1
            total += n // 2 + n // 32 * 2 * size * parts
        elif isinstance(module, nn.Embedding):
            total += n // 2 + n // 32 * 2
        else:
            total += n * size
    return int(total)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_holds_four_bits_a_weight_plus_scales(cell_cfg, tiny, dtype):
    cfg = cell_cfg("engine=compiled", "engine.backend=eager", "engine.weights=int4", "experiment=decode",
                   f"dtype={dtype}", "max_new_tokens=4", "repeats=1")  # fmt: skip
    record = run_cell(cfg)
    assert record["status"] == "ok", record["reason"]
    held = record["measurements"]["weight_bytes_from_shape"]["value"]
    stored = load_file(tiny.emb4 / "model.safetensors")
    expected = int4_bytes_from_shapes(open_checkpoint(tiny.emb4).config, getattr(torch, dtype), stored)
    # beyond the weights the model holds small buffers: rotary tables, the lookups' nibble shifts
    assert expected <= held <= 1.001 * expected


def test_a_device_without_an_int4_kernel_is_skipped(cell_cfg, tiny, monkeypatch):
    monkeypatch.setattr(int4, "KERNELS", {k: v for k, v in int4.KERNELS.items() if k != "cpu"})
    record = run_cell(cell_cfg("engine=ring", "engine.weights=int4"))
    assert record["status"] == "skipped" and "no int4 kernel for device cpu" in record["reason"]


@pytest.mark.parametrize(
    ("overrides", "status", "message"),
    [
        (("engine=ring", "engine.int4_limbs=2"), "failed", "int4_limbs=2 has no effect with engine.weights=dense"),
        (("engine=rust", "engine.int4_limbs=2"), "failed", "int4_limbs=2 has no effect with engine.weights=dense"),
        (("engine=ring", "engine.weights=int4", "engine.int4_limbs=4"), "failed", "holds each input in 3 or 2"),
        (("engine=compiled", "engine.weights=int4", "engine.int4_limbs=2", "dtype=float32"), "skipped",
         f"engine.int4_limbs=2 sets how {ROWS} holds x; int4 linears on cpu compute with {ATEN}"),
    ],
)  # fmt: skip
def test_limbs_where_they_would_take_no_effect_are_refused_by_name(cell_cfg, tiny, overrides, status, message):
    record = run_cell(cell_cfg(*overrides))
    assert record["status"] == status and message in record["reason"]


def test_limbs_on_a_weight_another_kernel_computes_are_refused():
    """A checkpoint's group ``int4_rows`` does not take (12 inputs) goes to aten's kernel, which has no limbs."""
    weight, _ = packed_weight(16, 48, group=12)
    with pytest.raises(EngineLimit, match="group_size=12"):
        int4.Int4Linear(weight, torch.bfloat16, torch.device("cpu"), kind="cpu", limbs=2)


def test_two_limbs_take_effect_and_keep_the_reference_tokens(cache_dir, cell_cfg, tiny):
    """``engine.int4_limbs=2``: every ``Int4Linear`` of the ring holds x in two limbs, its logits differ from three
    limbs' (each the kernel's own rounding) and its tokens are Transformers' at bf16."""
    runs_here(ROWS)
    logits = {}
    for limbs in (3, 2):
        handle = opened(f"cache_dir={cache_dir}", "engine=ring", "engine.weights=int4", f"engine.int4_limbs={limbs}",
                        "dtype=bfloat16", "context=1024", "engine.backend=eager")  # fmt: skip
        try:
            engine = handle.load()
            assert {m.limbs for m in engine.model.modules() if isinstance(m, int4.Int4Linear)} == {limbs}
            assert engine.describe()["int4_exactness"] == f"{limbs} limbs: {int4_cpu.LIMBS[limbs]}"
            assert engine.describe()["settings_without_effect"] == ["one_row"]  # no linear is dense
            logits[limbs] = engine.generate([2, 40, 41, 42, 43, 44, 45, 46], 4, return_logits=True).logits
        finally:
            handle.close()
    assert not torch.equal(logits[2], logits[3])
    record = run_cell(cell_cfg("engine=ring", "engine.weights=int4", "engine.int4_limbs=2", "engine.backend=eager",
                               "experiment=parity-bf16", "max_new_tokens=16"))  # fmt: skip
    assert record["status"] == "ok", record["reason"]
    assert record["config"]["engine"]["int4_limbs"] == 2 and record["outputs"]["verdict"] == "pass"
