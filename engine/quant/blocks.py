"""The ``blocks`` layout: weights as GGUF stores them, multiplied by tandem::block_mm.

W[n, k] = d[n, g] * q[n, k] + m[n, g] per group g of ``group_size`` along K, with
(d, m) in float16 (GGUF's own fields, so a file's blocks are kept bit for bit; held as
their int16 bits):

* Q8_0: int8 codes, m = 0; Q4_0: 4-bit codes, m = -8d; Q4_1: 4-bit codes, m as stored.
  A fused weight whose shards mix 4- and 8-bit blocks holds every shard as int8 codes
  (a Q4 block is exactly (d, m) times codes 0..15).
* ``--quantization int8`` (per channel, the group is the whole row) and ``int4``
  (asymmetric groups) store their codes the same way, their scales rounded to fp16.

``--activation-quant int8`` multiplies the same blocks by activations quantized to int8
per 32 (``tandem::block_mm_i8``, same source), as llama.cpp does: lossy, on request only.
The kernels (csrc/block_mm.cpp) need AVX2, FMA and F16C; ``BLOCK_KERNEL.unavailable()``
says why not where it cannot run (a CPU without them, no compiler).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from engine.native import NativeKernel, cpu_flags, simd_flags

log = logging.getLogger(__name__)

BLOCK = 32
Q4_BYTES = {"Q4_0": 18, "Q4_1": 20}
Q8_BYTES = 34
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
BLOCK_BYTES = {**Q4_BYTES, "Q8_0": Q8_BYTES}
"""Bytes of one block of BLOCK weights, by GGUF type."""


def _register_fakes() -> None:
    for op in ("tandem::block_mm", "tandem::block_mm_i8"):
        torch.library.register_fake(op)(
            lambda x, codes, sm, group_size: x.new_empty((x.shape[0], codes.shape[0])))


BLOCK_KERNEL = NativeKernel("block_mm", Path(__file__).parent / "csrc" / "block_mm.cpp",
                            _register_fakes,
                            without="GGUF Q8_0 tensors and fp32 models run on their exact "
                                    "dense weights",
                            needs_cpu_flags=("avx2", "fma", "f16c"))


def kernel_path() -> tuple[str, str | None]:
    """(the start-up line naming the weight kernels' path and the CPU flags it rests on,
    the fallback reason or None), building the kernel on the first call."""
    flags = " ".join(simd_flags()) or "none"
    reason = BLOCK_KERNEL.unavailable()
    if reason is None:
        wide = "; AVX-512 BF16 int4 kernel for bf16" if "avx512_bf16" in cpu_flags() else ""
        return f"weight kernels: AVX2+FMA block kernel{wide} (CPU SIMD flags: {flags})", None
    if not {"avx2", "avx512f"} & cpu_flags():
        reason = (f"this CPU has neither AVX2 nor AVX-512 (SIMD flags found: {flags}): "
                  "packed weights cannot be multiplied fast; linears run on their dense "
                  "copies (slower path)")
    return f"weight kernels unavailable: {reason}", reason


def pack_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] integer (int8 range, or 0..15 to pack as nibbles when ``codes`` is
    uint8), d and m [N, K/group] -> (kernel codes, sm [N, K/group, 2] fp16)."""
    n, k = codes.shape
    if codes.dtype == torch.uint8:  # 4-bit: GGUF's nibble order per block of 32
        c = codes.view(n, k // BLOCK, 2, BLOCK // 2)
        codes = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)
    sm = torch.stack([d, m], dim=-1).to(torch.float16)
    return codes.contiguous(), as_bits(sm)


def as_bits(sm: torch.Tensor) -> torch.Tensor:
    """fp16 (d, m) -> their bits as int16: a model's ``.to(dtype)`` casts every floating
    buffer, and must leave the file's scales alone."""
    return sm.contiguous().view(torch.int16)


def block_values(codes: torch.Tensor, sm: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weights [N, K] that a blocks-layout weight multiplies by: d * q + m."""
    n = codes.shape[0]
    if codes.dtype == torch.uint8:
        c = codes.view(n, -1, BLOCK // 2)
        q = torch.cat([c & 0x0F, c >> 4], dim=-1).reshape(n, -1)
    else:
        q = codes
    g = q.float().view(n, sm.shape[1], group_size)
    s = sm.view(torch.float16).float()
    return (s[..., 0:1] * g + s[..., 1:2]).view(n, -1)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0]


def _shard(type_name: str, raw: np.ndarray, as_int8: bool
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One shard's raw block rows -> (codes [N, K] or packed nibbles [N, K/2], d, m)."""
    n = raw.shape[0]
    if type_name == "Q8_0":
        b = np.ascontiguousarray(raw).reshape(n, -1, Q8_BYTES)
        d = _f16(b, 0)
        return b[..., 2:].view(np.int8).reshape(n, -1), d, np.zeros_like(d)
    b = np.ascontiguousarray(raw).reshape(n, -1, Q4_BYTES[type_name])
    d = _f16(b, 0)
    m = (_f16(b, 2) if type_name == "Q4_1"
         else (d.astype(np.float32) * -8.0).astype(np.float16))  # exact: a power of two
    qs = b[..., Q4_BYTES[type_name] - 16:]  # [N, K/32, 16]
    if as_int8:
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8).reshape(n, -1), d, m
    return qs.reshape(n, -1), d, m


def gguf_blocks(sources: Sequence[tuple[str, np.ndarray]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused weight's shards (GGUF type, raw rows) -> (codes, sm) of the blocks layout,
    the file's blocks unchanged: nibbles where every shard is 4-bit, else int8 codes."""
    as_int8 = any(t == "Q8_0" for t, _ in sources)
    parts = [_shard(t, raw, as_int8) for t, raw in sources]
    codes, d, m = (np.concatenate([p[i] for p in parts]) for i in range(3))
    sm = np.stack([d, m], axis=-1)
    return torch.from_numpy(codes.copy()), as_bits(torch.from_numpy(sm.copy()))
