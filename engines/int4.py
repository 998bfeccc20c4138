"""Weights that stay 4-bit while they compute (``engine.weights=int4``), one existing kernel per device.

With ``engine.weights=int4`` an engine reads the ``-emb4`` twin, where every large tensor is int4, and
keeps them so: the vocabulary tables as ``Int4Embedding`` (packed rows looked up, only those
unpacked) and every linear, ``lm_head`` included, as ``Int4Linear``.

The checkpoint's W4A16 levels and scales (one per ``group_size`` inputs, as its ``quantization_config``
says) are used as stored (no re-quantization, no rounding), repacked once at load into the layout the
device's kernel wants:

* ``cpu``: the project's own ``decodebench_int4.int4_rows`` (``engines.int4_cpu``: bf16 activations on a CPU with
  AVX-512 BF16, any group of a multiple of 8 inputs, the stored scales as they are; ``engine.int4_limbs``: how many
  7-bit limbs it holds each input in, ``int4_cpu.LIMBS``), else
  ``aten._weight_int4pack_mm_for_cpu`` over ``aten._convert_weight_to_int4pack_for_cpu``;
* ``cuda``: tinygemm's ``aten._weight_int4pack_mm`` over ``aten._convert_weight_to_int4pack`` (bf16);
* ``tpu``: the checkpoint's packed words, unpacked inside the compiled step (whether XLA fuses the
  unpack into the matmul is what a TPU run measures).

The asymmetric kernels compute w = (q - 8) * scale + zero with q = level + 8 and zero = 0, which is
the checkpoint's w = level * scale exactly. They take group sizes 32, 64, 128 and 256 only (another is
``skipped``, named), and scales in the activations' dtype only: scales that dtype cannot hold (the
``-emb4`` twin's float16 ones in a bf16 run) are split into parts it holds, summing to them exactly
(``scale_parts``), and the kernel runs once per part.
"""

from __future__ import annotations

import warnings
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from torch import nn

from decodebench.checkpoint import PackedTable
from engines import int4_cpu
from engines.base import EngineLimit
from engines.one_row import OneRow


class Weights(StrEnum):
    """How the W4A16 linears are held while they compute: dequantized at load, or 4-bit (this module)."""

    dense = "dense"
    int4 = "int4"


LOOKUPS = ("embed_tokens_per_layer", "embed_tokens")  # tables read by row: kept packed as Int4Embedding
# The checkpoint stores the table's scales in float16 and a bf16 run writes bf16 rows, so inductor's
# CPU code generator sees both in one fused lookup and says so. The lookup unpacks in float32, so
# nothing is lost; converting the scales instead would either round the checkpoint's own numbers
# (bf16) or double their bytes (float32), against the point of keeping the table 4-bit.
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node", category=UserWarning)


class Int4Embedding(nn.Module):
    """An embedding whose table stays packed: int32 words [rows, cols/8], scales [rows, cols/group_size]
    as stored.

    ``forward(ids)`` gives the same values as the dequantized table times ``embed_scale``, in ``dtype``.
    """

    def __init__(self, table: PackedTable, embed_scale: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("packed", table.packed.to(device))
        self.register_buffer("scale", table.scale.to(device))
        self.register_buffer("shifts", torch.arange(0, 32, 4, dtype=torch.int32, device=device))
        self.cols, self.group = table.shape[1], table.group_size
        self.dtype = dtype
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        words, scale = self.packed[ids], self.scale[ids]
        levels = ((words.unsqueeze(-1) >> self.shifts) & 15).to(torch.float32) - 8
        groups = levels.view(*ids.shape, -1, self.group) * scale.unsqueeze(-1).to(torch.float32)
        weights = groups.view(*ids.shape, self.cols).to(self.dtype)
        return weights * torch.tensor(self.embed_scale, dtype=self.dtype, device=ids.device)


KERNELS = {  # each device's kernel by the operator's name as it is dispatched (the cpu's where int4_rows cannot run)
    "cpu": "aten._weight_int4pack_mm_for_cpu",
    "cuda": "aten._weight_int4pack_mm (tinygemm)",
    "tpu": "packed words unpacked in the compiled step",
}


def unsupported(device_kind: str, dtype: torch.dtype) -> str | None:
    """Why int4 linears cannot run here (the cell is skipped, never run dense instead), or None."""
    if device_kind not in KERNELS:
        return f"engine.weights=int4 has no int4 kernel for device {device_kind} (kernels: {', '.join(KERNELS)})"
    if device_kind == "cuda" and dtype != torch.bfloat16:
        return f"engine.weights=int4 on cuda uses tinygemm, which computes in bfloat16; this run's dtype is {dtype}"
    return None


def one_row_refused(choice: OneRow, weights: Weights) -> str | None:
    """Why ``engine.one_row`` cannot be set so (a ``ConfigError``), or None: it picks the kernel of a dense linear on
    one row, so with int4 weights, where none is dense, only its default (``auto``) is taken."""
    if choice != OneRow.auto and weights == Weights.int4:
        return f"engine.one_row={choice} has no effect with engine.weights=int4: every linear is held 4-bit, none dense"
    return None


def limbs_refused(limbs: int, weights: Weights) -> str | None:
    """Why ``engine.int4_limbs`` cannot be set so (a ``ConfigError``), or None: a count ``int4_rows`` takes, and other
    than the default only where linears are held 4-bit (it sets how that kernel holds x; dense linears have none)."""
    if limbs not in int4_cpu.LIMBS:
        return f"engine.int4_limbs={limbs}: {int4_cpu.OP} holds each input in {' or '.join(map(str, int4_cpu.LIMBS))}"
    if limbs != int4_cpu.DEFAULT_LIMBS and weights != Weights.int4:
        return (f"engine.int4_limbs={limbs} has no effect with engine.weights={weights}: it sets how {int4_cpu.OP} "
                "holds x, and no linear is held 4-bit")  # fmt: skip
    return None


def settings_without_effect(weights: Weights) -> tuple[str, ...]:
    """The engine settings that take no effect with these weights, for the evidence (``describe``): each is refused
    there other than at its default (``limbs_refused``, ``one_row_refused``), so its value says nothing of the way.
    ``int4_limbs`` sets how ``int4_rows`` holds x (no linear is 4-bit with dense weights); ``one_row`` picks the
    kernel of a dense linear (none is dense with int4 ones)."""
    return ("one_row",) if weights == Weights.int4 else ("int4_limbs",)


def limbs_unsupported(limbs: int, device_kind: str, dtype: torch.dtype) -> str | None:
    """Why ``engine.int4_limbs`` other than the default would take no effect on this device (the cell is skipped),
    or None: only ``int4_rows`` holds x in limbs."""
    if limbs == int4_cpu.DEFAULT_LIMBS or (device_kind == "cpu" and int4_cpu.unsupported(dtype, None) is None):
        return None
    return (f"engine.int4_limbs={limbs} sets how {int4_cpu.OP} holds x; int4 linears on {device_kind} compute with "
            f"{KERNELS.get(device_kind, 'no int4 kernel')} here")  # fmt: skip


def chosen(device_kind: str, dtype: torch.dtype, group: int) -> str:
    """The kernel an ``Int4Linear`` computes with: ``int4_rows`` on a CPU that runs it for this dtype and group,
    else the device's ``KERNELS`` entry."""
    if device_kind == "cpu" and int4_cpu.unsupported(dtype, group) is None:
        return int4_cpu.OP
    return KERNELS[device_kind]


def kernels_of(model: nn.Module) -> str:
    """The kernels ``model``'s ``Int4Linear`` modules compute with, by name, comma-separated."""
    return ", ".join(sorted({m.kernel for m in model.modules() if isinstance(m, Int4Linear)}))


def described(model: nn.Module, linears: int) -> dict[str, Any]:
    """What the evidence says of ``model``'s int4 linears (``linears`` of them, as the checkpoint has them): their
    kernels by name and, where ``int4_rows`` computes them, what its limbs keep of x (``int4_cpu.LIMBS``)."""
    limbs = sorted({m.limbs for m in model.modules() if isinstance(m, Int4Linear) and m.kernel == int4_cpu.OP})
    facts: dict[str, Any] = {"int4_kernel": kernels_of(model), "int4_linears": linears}
    if limbs:
        facts["int4_exactness"] = "; ".join(f"{n} limbs: {int4_cpu.LIMBS[n]}" for n in limbs)
    return facts


KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes (inputs per scale) the cpu and cuda kernels take


def scale_parts(scale: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The checkpoint's scales as ``dtype`` tensors whose sum is exactly them: one when ``dtype`` holds
    them (bf16 scales in a bf16 run, any in float32), two for float16 scales in a bf16 run (bf16 keeps 8
    of their 11 significant bits; what is left has at most 3), three at most (float32 scales in bf16)."""
    parts, rest = [], scale.to(torch.float64)
    for _ in range(3):
        parts.append(rest.to(dtype))
        rest = rest - parts[-1].to(torch.float64)  # exact: the rounding error of a float32 value
        if not rest.any():
            return parts
    raise EngineLimit(
        f"the checkpoint's {scale.dtype} scales are no sum of three {dtype} values (one lies outside {dtype}'s "
        f"range); engine.weights=int4 computes with the stored scales exactly, in the run's dtype"
    )


class Int4Linear(nn.Module):
    """``y = x @ w.T`` with ``w`` held 4-bit: [out, in] levels and one scale per ``group_size`` inputs.

    ``tpu`` keeps the scales as stored and unpacks in float32; ``int4_rows`` (a ``cpu`` that runs it) reads them
    as stored; the aten kernels (another ``cpu``, ``cuda``) hold them as ``scale_parts`` in the run's dtype
    ([parts, in/group_size, out, 2] scales and zeros), are called once per part and the parts' outputs summed in
    float32. ``kernel``: the operator that computes it, by its dispatched name (``KERNELS`` or ``int4_cpu.OP``);
    ``limbs``: how many limbs ``int4_rows`` holds x in (``int4_cpu.LIMBS``; another kernel takes only the default).
    """

    def __init__(self, weight: PackedTable, dtype: torch.dtype, device: torch.device, kind: str | None = None,
                 kernel: str | None = None, limbs: int = int4_cpu.DEFAULT_LIMBS) -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group = weight.group_size
        self.kind = kind or device.type  # which device's kernel (a KERNELS key); tests run the tpu one on a CPU
        self.kernel = kernel or chosen(self.kind, dtype, self.group)
        self.limbs = limbs
        if limbs != int4_cpu.DEFAULT_LIMBS and self.kernel != int4_cpu.OP:
            raise EngineLimit(f"engine.int4_limbs={limbs} sets how {int4_cpu.OP} holds x; this weight (group_size="
                              f"{self.group}) computes with {self.kernel}")  # fmt: skip
        if self.kind == "tpu":
            self.register_buffer("words", weight.packed.to(device))
            self.register_buffer("scale", weight.scale.to(device))
            self.register_buffer("shifts", torch.arange(0, 32, 4, dtype=torch.int32, device=device))
            self.dtype = dtype
            return
        if self.kernel == int4_cpu.OP:
            if reason := int4_cpu.unsupported(dtype, self.group):
                raise EngineLimit(f"{int4_cpu.OP} cannot compute this weight here: {reason}")
            inputs = weight.shape[1]
            words, scales = int4_cpu.pack(
                lambda a, b: unpack_from_int32(weight.packed[a:b], 4, torch.Size([b - a, inputs])), weight.scale
            )
            self.register_buffer("words", words.to(device))
            self.register_buffer("scales", scales.to(device))
            return
        if self.group not in KERNEL_GROUPS:
            *most, last = KERNEL_GROUPS
            raise EngineLimit(
                f"checkpoint quantizes linears with group_size={self.group}; engine.weights=int4 on {self.kind} "
                f"runs {KERNELS[self.kind]}, which takes group_size {', '.join(map(str, most))} or {last}"
            )
        levels = unpack_from_int32(weight.packed, 4, torch.Size(weight.shape)).to(torch.int32) + 8  # 0..15
        parts = [
            torch.stack([part.t(), torch.zeros_like(part.t())], dim=-1) for part in scale_parts(weight.scale, dtype)
        ]
        if self.kind == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
            self.mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        else:
            nibbles = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), 8)
            self.mm = torch.ops.aten._weight_int4pack_mm
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("scales_and_zeros", torch.stack(parts).contiguous().to(device))

    @classmethod
    def stacked(cls, parts: list[Int4Linear]) -> Int4Linear:
        """One ``int4_rows`` linear whose outputs are ``parts``' side by side (``engines.joined``): their tiles and
        tile scales in order. Every part computes with ``int4_rows``, of one input size and group size, and holds
        whole tiles (``int4_cpu.TILE`` outputs each), so no padding lies between them."""
        joined = cls.__new__(cls)
        nn.Module.__init__(joined)
        first = parts[0]
        joined.out_features, joined.in_features = sum(p.out_features for p in parts), first.in_features
        joined.group, joined.kind, joined.kernel, joined.limbs = first.group, first.kind, first.kernel, first.limbs
        joined.register_buffer("words", torch.cat([p.words for p in parts]))
        joined.register_buffer("scales", torch.cat([p.scales for p in parts]))
        return joined

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kind == "tpu":
            levels = ((self.words.unsqueeze(-1) >> self.shifts) & 15).to(torch.float32) - 8
            grouped = levels.view(self.out_features, -1, self.group) * self.scale.to(torch.float32).unsqueeze(-1)
            y = F.linear(rows, grouped.view(self.out_features, self.in_features).to(self.dtype))
        elif self.kernel == int4_cpu.OP:
            y = int4_cpu.rows(rows, self.words, self.scales, self.group, self.out_features, self.limbs)
        else:
            parts = [self.mm(rows, self.packed, self.group, part) for part in self.scales_and_zeros]
            y = parts[0] if len(parts) == 1 else torch.stack(parts).float().sum(0).to(rows.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def split_packed(packed: dict[str, PackedTable], lookups: tuple[str, ...], tied: bool
                 ) -> tuple[dict[str, PackedTable], dict[str, PackedTable]]:  # fmt: skip
    """The loader's packed weights (module path -> weight) as (tables read by row, named by ``lookups``' leaf
    names; linears). With ``engine.weights=int4`` and a tied checkpoint that stores no ``lm_head``, the linears
    include ``lm_head`` over the token table (``tied``: the caller's config says the two are one)."""
    tables = {p: w for p, w in packed.items() if p.rpartition(".")[2] in lookups}
    linears = {p: w for p, w in packed.items() if p not in tables}
    if "lm_head" not in linears and tied and "model.embed_tokens" in tables:
        linears["lm_head"] = tables["model.embed_tokens"]  # tied: lm_head reads the same table
    return tables, linears


def swap_linears(model: nn.Module, packed: dict[str, PackedTable], dtype: torch.dtype, device: torch.device,
                 kernel: str | None = None, limbs: int = int4_cpu.DEFAULT_LIMBS) -> int:  # fmt: skip
    """Replaces each packed linear (module path -> its weight) with an ``Int4Linear`` computing with ``kernel``
    (None: the device's choice, ``chosen``), x in ``limbs`` limbs; returns how many."""
    for path, weight in packed.items():
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Int4Linear(weight, dtype, device, kernel=kernel, limbs=limbs))
    return len(packed)


def swap_lookups(model: nn.Module, packed: dict[str, PackedTable], dtype: torch.dtype, device: torch.device) -> None:
    """Replaces each packed table (module path -> its weight) with an ``Int4Embedding`` of the same scale."""
    for path, table in packed.items():
        parent, _, leaf = path.rpartition(".")
        old = model.get_submodule(path)
        setattr(model.get_submodule(parent), leaf, Int4Embedding(table, old.scalar_embed_scale, dtype, device))
