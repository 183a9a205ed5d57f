"""The quantization methods behind ``--quantization`` (contract in base.py)."""
from __future__ import annotations

from typing import Sequence

import torch

from engine.quant.base import QuantMethod, Shard, Source
from engine.quant.blocks import BLOCK_KERNEL, block_values, gguf_blocks
from engine.quant.packed import (PackedWeight, UnpackableWeight, blocks_layout, check_shape,
                                 pack_int4, pack_int8)
from engine.quant.quantize import GGUF_BLOCK, gguf_int4_codes, int4_codes, int8_codes

FOUR_BIT = ("Q4_0", "Q4_1")
EIGHT_BIT = ("Q8_0",)


def _int8(weight: torch.Tensor, dtype: torch.dtype, absmax: torch.Tensor | None = None
          ) -> tuple[PackedWeight, torch.Tensor]:
    q, scales = int8_codes(weight, absmax)
    packed = pack_int8(q, scales, dtype)
    if packed.layout == "blocks":
        return packed, block_values(packed.data, packed.scales, packed.group_size)
    scales = scales.to(dtype).float()  # aten's scales are in the activation dtype
    return pack_int8(q, scales, dtype), q.float() * scales[:, None]


def _int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
          dtype: torch.dtype) -> tuple[PackedWeight, torch.Tensor]:
    n, k = q.shape
    packed = pack_int4(q, scales, zeros, group, dtype)
    if packed.layout == "blocks":
        return packed, block_values(packed.data, packed.scales, group)
    scales, zeros = scales.to(dtype).float(), zeros.to(dtype).float()  # as the kernel sees them
    values = ((q.float().view(n, -1, group) - 8) * scales[..., None] + zeros[..., None])
    return packed, values.view(n, k)


class Int8Method(QuantMethod):
    name = "int8"

    def __init__(self, group_size: int = 32) -> None:
        pass

    def pack(self, name, weight, dtype, sources=None, shard: Shard | None = None
             ) -> tuple[PackedWeight, torch.Tensor]:
        check_shape(name, "int8", *weight.shape)
        absmax = shard.row_absmax if shard is not None else None  # filled on the CPU
        return _int8(weight, dtype, None if absmax is None else absmax.to(weight.device))


class Int4Method(QuantMethod):
    name = "int4"

    def __init__(self, group_size: int = 32) -> None:
        self.group_size = group_size

    def pack(self, name, weight, dtype, sources=None, shard: Shard | None = None
             ) -> tuple[PackedWeight, torch.Tensor]:
        # a row split's columns start on a group boundary (its width is a whole number of
        # groups, checked here), so its groups are the unsplit weight's
        check_shape(name, "int4", *weight.shape, group_size=self.group_size)
        return _int4(*int4_codes(weight, self.group_size), self.group_size, dtype)


class GGUFMethod(QuantMethod):
    """Keep the file's blocks as stored (the blocks layout: Q8_0 with its per-32 scales,
    Q4_0/Q4_1 with theirs); where that kernel is not the fast path, 4-bit shards as int4/g32
    for aten's or our AVX-512 kernel. The dense copy stays the file's exact dequantization
    (the loader's); anything else, or Q8_0 without the blocks kernel, is unpackable."""

    name = "gguf"

    def __init__(self, group_size: int = 32) -> None:
        pass

    def pack(self, name, weight, dtype, sources: Sequence[Source] | None = None,
             shard: Shard | None = None) -> tuple[PackedWeight, torch.Tensor]:
        types = [t for t, _ in sources or ()]
        if not types or any(t not in FOUR_BIT + EIGHT_BIT for t in types):
            other = next((t for t in types if t not in FOUR_BIT + EIGHT_BIT), "none")
            raise UnpackableWeight(f"{name}: GGUF type {other} cannot be kept packed "
                                   f"(packable: {', '.join(FOUR_BIT + EIGHT_BIT)})")
        n, k = weight.shape
        four_bit = all(t in FOUR_BIT for t in types)
        if blocks_layout(dtype, weight.device) or (not four_bit and weight.device.type == "cpu"
                                                   and BLOCK_KERNEL.unavailable() is None):
            codes, sm = gguf_blocks(sources)
            kind = "int4" if codes.dtype == torch.uint8 else "int8"
            return PackedWeight(kind, codes, sm, n, k, GGUF_BLOCK, "blocks"), weight
        if not four_bit:
            why = BLOCK_KERNEL.unavailable() or f"no block kernel on {weight.device.type}"
            raise UnpackableWeight(f"{name}: GGUF Q8_0 blocks need the block kernel ({why})")
        check_shape(name, "int4", n, k, GGUF_BLOCK)
        parts = [gguf_int4_codes(raw, t) for t, raw in sources]
        q, s, z = (torch.cat([p[i] for p in parts]) for i in range(3))
        return _int4(q, s, z, GGUF_BLOCK, dtype)[0], weight

    def describe(self, packed: PackedWeight) -> str:
        if packed.layout == "blocks":
            return f"GGUF {'Q4' if packed.kind == 'int4' else 'Q8_0/mixed'} blocks as stored"
        return "Q4 as int4/g32"
