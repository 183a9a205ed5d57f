"""Packed weights and the fused weight-only kernels that multiply by them.

A ``PackedWeight`` is one linear weight [N, K] kept quantized in the layout a
PyTorch kernel reads directly, with the kernel call next to it:

* ``blocks`` (CPU with AVX2, FMA and F16C; blocks.py): codes and fp16 (d, m) per group,
  as GGUF stores them, multiplied by our ``torch.ops.tandem.block_mm`` in fp32. The
  layout of every GGUF Q8_0 tensor (kept with its per-32 scales) and, wherever it is
  the vectorised path (fp32 activations, or no AVX-512 for aten's bf16 kernels), of
  every other packed weight: GGUF Q4 blocks, ``--quantization int8`` (one group per
  row) and ``int4``.
  With ``--activation-quant int8`` the same layout multiplies activations quantized to
  int8 per 32 with integer dot products (``tandem::block_mm_i8``, as llama.cpp does).
* ``int8``: per-output-channel symmetric int8 [N, K] plus scales [N];
  ``aten._weight_int8pack_mm`` (CPU and CUDA).
* ``int4``: 4-bit codes in groups of ``group_size`` along K, asymmetric:
  w = (q - 8) * scale + zero. Three layouts, by where the weight lives:
  - ``tiles`` (CPU, bf16, a CPU with AVX-512 BF16): our ``torch.ops.tandem.int4_mm``
    (csrc/int4_mm.cpp; codes [N/16, K/2, 16], scales and zeros [N/16, K/g, 2, 16]),
    whose cost grows little with the rows: it unpacks each block of codes once for
    all of them (AMX tiles from INT4_AMX_MIN_ROWS rows; the source's header has the
    timings against aten's);
  - ``aten`` on CPU otherwise: ``aten._weight_int4pack_mm_for_cpu`` over
    ``_convert_weight_to_int4pack_for_cpu``, scales and zeros [K / group, N, 2];
  - on CUDA ``aten._weight_int4pack_mm`` over ``_convert_weight_to_int4pack`` (needs
    bf16 activations).

The kernels' own shape limits are checked here, before any packing, so a bad
shape is an error naming the tensor rather than a crash inside the kernel (the
CPU int8 kernel segfaults when K is not a multiple of 16).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engine.native import NativeKernel, cpu_flags
from engine.quant.blocks import BLOCK, BLOCK_KERNEL, pack_blocks

PackedKind = Literal["int8", "int4"]
Layout = Literal["aten", "tiles", "blocks"]
ActivationQuant = Literal["none", "int8"]
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_AMX_MIN_ROWS = 3
"""From this many rows tandem::int4_mm multiplies on AMX tiles (where the CPU has them);
below, with AVX-512 FMAs (at 1-2 rows they win: no tile set-up per group)."""
INT4_DOT_MIN_ROWS = 7
"""Without AMX, from this many rows tandem::int4_mm multiplies with vdpbf16ps after
unpacking each tile once; below, with AVX-512 FMAs (`bench/dense_gemm.py --int4` times
both: on an AMD EPYC they cross at 7 rows)."""


def _register_int4_fakes() -> None:
    torch.library.register_fake("tandem::int4_mm")(
        lambda x, codes, sz, group_size, amx_min_rows, dot_min_rows=2**30:
        x.new_empty((x.shape[0], codes.shape[0] * 16)))


INT4_KERNEL = NativeKernel("int4_mm", Path(__file__).parent / "csrc" / "int4_mm.cpp",
                           _register_int4_fakes,
                           without="int4 weights multiply with aten's kernel",
                           needs_cpu_flags=("avx512f", "avx512bw", "avx512_bf16"))


@functools.cache
def amx_min_rows() -> int:
    """INT4_AMX_MIN_ROWS where the CPU, as the capability ceiling shows it, has AMX
    (engine/native.py); else no call reaches the tiles."""
    return INT4_AMX_MIN_ROWS if "amx_bf16" in cpu_flags() else 2**62


class UnpackableWeight(ValueError):
    """The kernel cannot take this tensor's shape (the message names the tensor)."""


def check_shape(name: str, kind: PackedKind, n: int, k: int, group_size: int = 32) -> None:
    if kind == "int8" and k % 16:
        raise UnpackableWeight(f"{name} [{n}, {k}]: the int8 weight-only kernel needs "
                               "in_features divisible by 16")
    if kind == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise UnpackableWeight(f"{name}: int4 group size must be one of {INT4_GROUP_SIZES}, "
                                   f"got {group_size}")
        if n % 16 or k % group_size:
            raise UnpackableWeight(
                f"{name} [{n}, {k}]: the int4 weight-only kernel needs out_features divisible "
                f"by 16 and in_features divisible by the group size {group_size}")


@dataclass
class PackedWeight:
    kind: PackedKind
    data: torch.Tensor
    """int8: [N, K] int8; int4: the kernel's packed uint8 (CPU) / int32 (CUDA) layout."""
    scales: torch.Tensor
    """int8: [N]; int4: [K / group, N, 2] (scale, zero), activation dtype; blocks:
    [N, K / group, 2] (d, m) fp16 bits as int16."""
    out_features: int
    in_features: int
    group_size: int = 0
    layout: Layout = "aten"
    """Whose kernel reads ``data`` (above)."""
    activations: ActivationQuant = "none"
    """blocks only: ``int8`` multiplies activations quantized per 32 (tandem::block_mm_i8,
    --activation-quant int8); ``none`` the activations as they are (exact)."""
    amx_min_rows: int = 2**62
    """tiles only: calls with this many rows or more use AMX (``amx_min_rows()`` when
    packed: a plain number here, so a traced matmul never reads /proc/cpuinfo)."""
    dot_min_rows: int = 2**30
    """tiles only: calls with this many rows or more, not on AMX, use vdpbf16ps
    (INT4_DOT_MIN_ROWS when packed)."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W^T [M, N], in x's dtype."""
        if self.layout == "blocks":
            mm = torch.ops.tandem.block_mm_i8 if self.activations == "int8" else \
                torch.ops.tandem.block_mm
            return mm(x, self.data, self.scales, self.group_size)
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales)
        if self.layout == "tiles":
            return torch.ops.tandem.int4_mm(x, self.data, self.scales, self.group_size,
                                            self.amx_min_rows, self.dot_min_rows)
        if x.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x, self.data, self.group_size, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, self.group_size,
                                                          self.scales)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + \
            self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> torch.Tensor:
        """[N, K] in the scales' dtype (blocks: fp32): the weights this kernel multiplies by
        (with int8 activations too: they quantize x, not W)."""
        dtype = torch.float32 if self.layout == "blocks" else self.scales.dtype
        eye = torch.eye(self.in_features, dtype=dtype, device=self.scales.device)
        return dataclasses.replace(self, activations="none").matmul(eye).t().contiguous()


def blocks_layout(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the blocks kernel is this weight's vectorised path: on a CPU where it runs,
    for fp32 activations (aten's int kernels have no vectorised fp32 path) or where no
    AVX-512 runs aten's bf16 ones."""
    return (device.type == "cpu" and (dtype == torch.float32 or "avx512f" not in cpu_flags())
            and BLOCK_KERNEL.unavailable() is None)


def pack_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> PackedWeight:
    """q [N, K] int8, scales [N] -> PackedWeight: blocks (one group per row, the scales in
    fp16) where that layout is the fast one, else aten's (scales in the activation dtype)."""
    n, k = q.shape
    if k % BLOCK == 0 and blocks_layout(dtype, q.device):
        codes, sm = pack_blocks(q, scales[:, None], torch.zeros_like(scales[:, None]), k)
        return PackedWeight("int8", codes, sm, n, k, k, "blocks")
    return PackedWeight("int8", q.contiguous(), scales.to(dtype).contiguous(), n, k)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              dtype: torch.dtype, layout: Layout | None = None) -> PackedWeight:
    """q [N, K] integer codes 0..15; scales, zeros [N, K / group] with w = (q - 8) * s + z.
    layout None: ``tiles`` where tandem::int4_mm can run (CPU, bf16, the kernel built),
    else ``blocks`` where that is the fast layout (blocks_layout), else ``aten``."""
    n, k = q.shape
    if layout is None:
        layout = ("tiles" if q.device.type == "cpu" and dtype == torch.bfloat16
                  and INT4_KERNEL.unavailable() is None
                  else "blocks" if blocks_layout(dtype, q.device) else "aten")
    elif layout == "tiles" and INT4_KERNEL.unavailable() is not None:
        raise RuntimeError(f"int4 tiles layout: {INT4_KERNEL.unavailable()}")
    elif layout == "blocks" and BLOCK_KERNEL.unavailable() is not None:
        raise RuntimeError(f"int4 blocks layout: {BLOCK_KERNEL.unavailable()}")
    if layout == "blocks":
        codes, sm = pack_blocks(q.to(torch.uint8), scales, zeros - 8 * scales, group_size)
        return PackedWeight("int4", codes, sm, n, k, group_size, "blocks")
    if layout == "tiles":
        c = q.to(torch.uint8).view(n // 16, 16, k // 2, 2)
        codes = (c[..., 0] | (c[..., 1] << 4)).permute(0, 2, 1).contiguous()  # [N/16, K/2, 16]
        sz = (torch.stack([scales, zeros]).view(2, n // 16, 16, k // group_size)
              .permute(1, 3, 0, 2).to(dtype).contiguous())  # [N/16, K/g, 2, 16]
        return PackedWeight("int4", codes, sz, n, k, group_size, "tiles",
                            amx_min_rows=amx_min_rows(), dot_min_rows=INT4_DOT_MIN_ROWS)
    sz = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()  # [K/g, N, 2]
    codes = q.to(torch.int32).contiguous()
    if codes.device.type == "cuda":
        packed = torch.ops.aten._convert_weight_to_int4pack(
            (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    return PackedWeight("int4", packed, sz, n, k, group_size)
