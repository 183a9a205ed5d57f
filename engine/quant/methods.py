"""The quantization methods behind ``--quantization`` (contract in base.py)."""
from __future__ import annotations

from typing import Sequence

import torch

from engine.quant.base import QuantMethod, Source
from engine.quant.packed import (PackedWeight, UnpackableWeight, check_shape, pack_int4,
                                 pack_int8)
from engine.quant.quantize import GGUF_BLOCK, gguf_int4_codes, int4_codes, int8_codes

FOUR_BIT = ("Q4_0", "Q4_1")
EIGHT_BIT = ("Q8_0",)


def _int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[PackedWeight, torch.Tensor]:
    q, scales = int8_codes(weight)
    scales = scales.to(dtype).float()  # the kernel's scales are in the activation dtype
    return pack_int8(q, scales, dtype), q.float() * scales[:, None]


def _int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
          dtype: torch.dtype) -> tuple[PackedWeight, torch.Tensor]:
    n, k = q.shape
    scales, zeros = scales.to(dtype).float(), zeros.to(dtype).float()  # as the kernel sees them
    values = ((q.float().view(n, -1, group) - 8) * scales[..., None] + zeros[..., None])
    return pack_int4(q, scales, zeros, group, dtype), values.view(n, k)


class Int8Method(QuantMethod):
    name = "int8"

    def __init__(self, group_size: int = 32) -> None:
        pass

    def pack(self, name, weight, dtype, sources=None) -> tuple[PackedWeight, torch.Tensor]:
        check_shape(name, "int8", *weight.shape)
        return _int8(weight, dtype)


class Int4Method(QuantMethod):
    name = "int4"

    def __init__(self, group_size: int = 32) -> None:
        self.group_size = group_size

    def pack(self, name, weight, dtype, sources=None) -> tuple[PackedWeight, torch.Tensor]:
        check_shape(name, "int4", *weight.shape, group_size=self.group_size)
        return _int4(*int4_codes(weight, self.group_size), self.group_size, dtype)


class GGUFMethod(QuantMethod):
    """Keep the file's blocks: 4-bit shards exactly as int4/g32; a fused weight with a
    Q8_0 shard as per-channel int8 of its dequantized values; anything else unpackable."""

    name = "gguf"

    def __init__(self, group_size: int = 32) -> None:
        pass

    def pack(self, name, weight, dtype, sources: Sequence[Source] | None = None
             ) -> tuple[PackedWeight, torch.Tensor]:
        types = [t for t, _ in sources or ()]
        if not types or any(t not in FOUR_BIT + EIGHT_BIT for t in types):
            other = next((t for t in types if t not in FOUR_BIT + EIGHT_BIT), "none")
            raise UnpackableWeight(f"{name}: GGUF type {other} cannot be kept packed "
                                   f"(packable: {', '.join(FOUR_BIT + EIGHT_BIT)})")
        n, k = weight.shape
        if all(t in FOUR_BIT for t in types):
            check_shape(name, "int4", n, k, GGUF_BLOCK)
            parts = [gguf_int4_codes(raw, t) for t, raw in sources]
            q, s, z = (torch.cat([p[i] for p in parts]) for i in range(3))
            return _int4(q, s, z, GGUF_BLOCK, dtype)
        check_shape(name, "int8", n, k)
        return _int8(weight, dtype)  # Q8_0: requantized per channel

    def describe(self, packed: PackedWeight) -> str:
        return "Q4 as int4/g32" if packed.kind == "int4" else "Q8_0 requantized to int8"
