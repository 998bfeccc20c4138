"""The project's own int4 product for a CPU with AVX-512 BF16 and VNNI: ``decodebench_int4::int4_rows``
(``csrc/int4_rows.cpp``, built with ``engines.cpu_kernels``).

A decode step multiplies one row (or a batch's few) by every weight, so its speed is the rate at which the
weights are read. This operator reads each packed byte once, front to back, the scales as stored, and multiplies in
integers: each row of x is written once a call in fixed point, block by block, as ``limbs`` 7-bit limbs (``LIMBS``:
what each keeps of an input), the 4-bit levels multiply its bytes by ``vpdpbusd``, and the sums are scaled in float32
and rounded to bf16 once. Three limbs are the default; two do two thirds of the products, which is what bounds the
kernel where ``vpdpbusd`` issues once a cycle (AMD's Zen 4), for inputs far below their block's largest rounded
coarser. Its first form (levels to bf16 by a table
lookup, ``vdpbf16ps``) was bound by that arithmetic on both CPUs it was timed on: on a 2-core AMD EPYC (Zen 5) one
row read 14-53 GB/s of the held weight shape by shape (``make bench-int4``, cold copies), below the 67-73 the bf16
kernel reads there; on the 2-core Xeon with AMX 31-32 GB/s from the cores' L2, below a 35-37 GB/s streaming read
(``csrc/int4_rows.cpp`` has the cycles and this form's figures). aten's ``_weight_int4pack_mm_for_cpu`` read
17.9 GB/s on that Xeon's ``lm_head`` against 26.6 for ``torch.mv`` on the bf16 weight, and needs float16 scales split
into two bf16 parts (two calls).

``pack`` lays a W4A16 weight out for it once, at load: tiles of 16 outputs, each 8 inputs of a tile in 64 bytes
(the layout is described in the C++ file), the checkpoint's scales kept in their own dtype, tile by tile. ``rows``
computes ``x @ w.T`` for bf16 rows; the output is rounded to bf16 once from float32 sums.
"""

from __future__ import annotations

import torch

from engines.cpu_kernels import missing

OP = "decodebench_int4.int4_rows"  # the operator's name as it is dispatched (and as the evidence names it)
TILE, CHUNK = 16, 8  # outputs per tile, inputs per 64-byte chunk (csrc/int4_rows.cpp)
LIMB_BITS = 7  # bits of each limb of an input's fixed point (the top limb's eighth is its sign)
LIMBS = {3: "inputs within 2^13 of their block's largest exact, the rest rounded at 2^-21 of it",
         2: "inputs within 2^6 of their block's largest exact, the rest rounded at 2^-14 of it"}  # fmt: skip
DEFAULT_LIMBS = 3


def fraction_bits(limbs: int) -> int:
    """Bits of an input's fixed point below the exponent of its block's largest input, for ``limbs`` limbs: an input
    within 2^(F - 7) of that largest keeps its 8 significant bits; a smaller one is rounded at 2^-(F + 1) of it."""
    return LIMB_BITS * limbs - 1


def unsupported(dtype: torch.dtype, group: int | None) -> str | None:
    """Why ``int4_rows`` cannot compute this weight here (another kernel does), or None; ``group`` None: any
    weight, before the checkpoint's group size is read."""
    if dtype != torch.bfloat16:
        return f"it computes bf16 activations, this run's are {dtype}"
    if group is not None and group % CHUNK:
        return f"it takes groups of a multiple of {CHUNK} inputs, this checkpoint's are {group}"
    return missing()


PACK_ROWS = 4096  # outputs packed at a time: what packing holds beside the result stays about 60 MB on E2B's shapes


def pack(levels: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``levels`` [out, in] (integers -8..7, any integer dtype, or a function of a row range giving them: the
    checkpoint's words unpacked a part at a time) and ``scale`` [out, in / group] as the operator reads them: words
    [tiles, in / 8, 32] int16 and scales [tiles, in / group, 16] in ``scale``'s dtype, the last tile padded with
    zero scales."""
    out, groups = scale.shape
    rows_of = (lambda a, b: levels[a:b]) if isinstance(levels, torch.Tensor) else levels
    tiles = -(-out // TILE)
    words = None
    for first in range(0, out, PACK_ROWS):
        part = rows_of(first, min(out, first + PACK_ROWS))
        if words is None:
            inputs = part.shape[1]
            words = torch.empty(tiles, inputs // CHUNK, 2 * TILE, dtype=torch.int16)
        part_tiles = -(-len(part) // TILE)
        padded = torch.full((part_tiles * TILE, inputs), 8, dtype=torch.int32)
        padded[: len(part)] = part.to(torch.int32) + 8
        # [tile, o, chunk, j, p] -> [tile, chunk, o, p, j]: word 2*o+p of a chunk holds input 2*j+p in nibble j
        nibbles = padded.view(part_tiles, TILE, inputs // CHUNK, 4, 2).permute(0, 2, 1, 4, 3)
        word = nibbles[..., 0] | nibbles[..., 1] << 4 | nibbles[..., 2] << 8 | nibbles[..., 3] << 12
        word = torch.where(word >= 1 << 15, word - (1 << 16), word)  # the 16 bits as an int16 holds them
        t = first // TILE
        words[t : t + part_tiles] = word.reshape(part_tiles, -1, 2 * TILE)
    padded_scales = torch.zeros(tiles * TILE, groups, dtype=scale.dtype)
    padded_scales[:out] = scale
    return words, padded_scales.view(tiles, TILE, groups).transpose(1, 2).contiguous()


def rows(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, group: int, out_features: int,
         limbs: int = DEFAULT_LIMBS) -> torch.Tensor:  # fmt: skip
    """``x`` [rows, in] bf16 times the packed weight: [rows, out_features] bf16, x held in ``limbs`` limbs."""
    return torch.ops.decodebench_int4.int4_rows(x, words, scales, group, out_features, limbs)
