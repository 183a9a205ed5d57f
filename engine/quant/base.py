"""The quantization contract and its registry.

A ``QuantMethod`` turns one linear weight into a ``PackedWeight`` the fused
weight-only kernels read. It is called once per linear at load time, on the
fp32 weight (q/k/v and gate/up already fused, so one call per kernel call),
and may also read the checkpoint's own packed blocks (``sources``: the GGUF
type and raw rows of each fused shard, in shard order).

``pack`` returns the packed weight, or raises ``UnpackableWeight`` naming the
tensor when the kernel cannot take it. The caller decides whether that is an
error (an explicit ``--quantization int8|int4``) or a logged fallback to the
dense weights (a GGUF tensor stored in a type we cannot keep packed).

Methods (``--quantization``): ``gguf`` (the default for a GGUF) keeps the file's
Q8_0/Q4_0/Q4_1 blocks with their own scales and leaves the dense copy the file's
exact dequantization; ``int8`` and ``int4`` quantize any checkpoint at load (lossy:
only when asked). ``none`` (no method) dequantizes at load.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from engine.quant.blocks import BLOCK, BLOCK_BYTES
from engine.quant.packed import PackedWeight, UnpackableWeight  # noqa: F401 (re-export)

Source = tuple[str, np.ndarray]
"""(GGUF type name, raw block rows [N_shard, row bytes]) of one fused shard."""



@dataclass(frozen=True)
class Shard:
    """The part of an unsplit linear weight one tensor-parallel rank holds (set as
    ``linear.shard`` by engine/parallel/shard.py), so that its shard is packed exactly as
    that part of the unsplit weight would be: the same codes and scales as at TP 1.

    rows: the output-row pieces (start, length) a column split keeps, in order; cols:
    the input columns (start, length) a row split keeps, with ``row_absmax``, each
    unsplit row's max |w| (a per-channel scale is the whole row's, not the shard's)."""

    rows: tuple[tuple[int, int], ...] = ()
    cols: tuple[int, int] | None = None
    row_absmax: torch.Tensor | None = None

    def sources(self, name: str, found: Sequence[Source]) -> list[Source]:
        """The checkpoint's blocks of this shard: ``found`` (the unsplit fused shards'
        block rows, in order) cut as the weight was. UnpackableWeight naming ``name``
        when a row split does not fall on a block boundary."""
        if self.rows:
            return [_rows_of(name, found, start, n) for start, n in self.rows]
        start, n = self.cols
        return [_cols_of(name, t, raw, start, n) for t, raw in found]


def _rows_of(name: str, found: Sequence[Source], start: int, n: int) -> Source:
    offset = 0
    for t, raw in found:
        if offset <= start and start + n <= offset + raw.shape[0]:
            return t, raw[start - offset:start - offset + n]
        offset += raw.shape[0]
    raise UnpackableWeight(f"{name}: rows [{start}, {start + n}) of this rank's shard "
                           "straddle two checkpoint tensors")


def _cols_of(name: str, type_name: str, raw: np.ndarray, start: int, n: int) -> Source:
    per_block = BLOCK_BYTES.get(type_name)
    if per_block is None:  # not a block type: the method refuses it by its type
        return type_name, raw
    if start % BLOCK or n % BLOCK:
        raise UnpackableWeight(f"{name}: this rank's input columns [{start}, {start + n}) "
                               f"do not fall on {type_name}'s {BLOCK}-weight blocks")
    return type_name, raw[:, start // BLOCK * per_block:(start + n) // BLOCK * per_block]


_REGISTRY: dict[str, str] = {
    "int8": "engine.quant.methods:Int8Method",
    "int4": "engine.quant.methods:Int4Method",
    "gguf": "engine.quant.methods:GGUFMethod",
}
METHODS = ("auto", "none", *_REGISTRY)


class QuantMethod(ABC):
    name: str

    @abstractmethod
    def pack(self, name: str, weight: torch.Tensor, dtype: torch.dtype,
             sources: Sequence[Source] | None = None, shard: Shard | None = None
             ) -> tuple[PackedWeight, torch.Tensor]:
        """weight [N, K] fp32 -> (packed weight for activations in ``dtype``, the fp32 values
        the dense copy holds [N, K]). shard: where weight is a tensor-parallel rank's part
        of the unsplit weight (``sources`` are then already cut to it), what part.

        The caller puts those values in the dense copy. A lossy method returns what its
        kernel multiplies by, so both paths multiply by the same weights; ``gguf`` returns
        the file's exact dequantization, which its blocks kernel multiplies by to fp32
        rounding (aten's and the AVX-512 int4 kernel: to the rounding of their scales).
        Pure: reads its inputs only. Raises UnpackableWeight naming ``name``."""

    def describe(self, packed: PackedWeight) -> str:
        """Short label of what a packed weight is, for the start-up log."""
        g = f"/g{packed.group_size}" if packed.kind == "int4" else ""
        return f"{packed.kind}{g}"


def resolve_method(name: str, is_gguf: bool) -> str:
    """``auto`` keeps a GGUF's own quantization packed and leaves other checkpoints dense."""
    if name not in METHODS:
        raise ValueError(f"--quantization must be one of {', '.join(METHODS)}; got {name!r}")
    if name == "auto":
        return "gguf" if is_gguf else "none"
    if name == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf checkpoint; use int8 or int4 "
                         "to quantize an HF checkpoint at load")
    return name


def get_method(name: str, group_size: int = 32) -> QuantMethod:
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(group_size)
