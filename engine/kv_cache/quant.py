"""Quantized KV rows: encode on write, decode on read (torch; layout in layout.py).

A quantized row is ``head_dim`` one-byte codes then the row's bfloat16 scale, stored in
an int8 tensor whose last dimension is ``head_dim + 2``. Codes are int8 (scale =
absmax / 127, round to nearest) or float8_e4m3fn (scale = absmax / 448). The scale is
rounded to bfloat16 (fp32's range: no row is too large or too small for it) before the
codes are computed, so every code is within half a step of its value and
``code * scale`` (in fp32) is what every backend reads back, on every machine.

Rows are rotated before they are quantized: encode stores ``x @ R`` and decode returns
``(code * scale) @ R``, where R (``rotation``) is a block-diagonal Walsh-Hadamard matrix
(blocks of the largest power of two dividing head_dim, scaled to be orthonormal and
symmetric, so R @ R = I). A rotation spreads a row's few large channels (RoPE'd keys
have them) over all of them, so the per-row absmax scale fits the row better: on the
embedded model it cuts the keys' quantization error 3.8x and the values' 1.3x. Backends
that read rows in place (the CPU paged decode kernel) rotate the query instead, which
leaves q . k unchanged, and rotate their output back (``rotation`` again).
"""
from __future__ import annotations

import torch

from core.kv.layout import SCALE_BYTES, is_quantized

_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_SCALE_MIN = 1e-30  # an all-zero row: codes 0, never 0 / 0


_ROTATIONS: dict[tuple[int, str], torch.Tensor] = {}


def rotation(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 [D, D] rotation quantized rows are stored in (orthonormal, R @ R = I)."""
    key = (head_dim, str(device))
    r = _ROTATIONS.get(key)
    if r is None:
        b = head_dim & -head_dim  # the largest power of two dividing head_dim
        h = torch.ones(1, 1)
        while h.shape[0] < b:  # Sylvester's construction
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = torch.block_diag(*[h / b ** 0.5] * (head_dim // b)).to(device)
        _ROTATIONS[key] = r
    return r


def storage_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The KV tensor's element type: int8 bytes when quantized, else the compute dtype."""
    return torch.int8 if is_quantized(kv_cache_dtype) else compute_dtype


def row_width(kv_cache_dtype: str, head_dim: int) -> int:
    """Elements per (token, KV head) row of the KV tensor's last dimension."""
    return head_dim + SCALE_BYTES if is_quantized(kv_cache_dtype) else head_dim


def encode(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """[..., D] float -> [..., D + 2] int8: per-row codes of the rotated row, then its
    bfloat16 scale."""
    xf = x.float() @ rotation(x.shape[-1], x.device)
    qmax = _QMAX[kv_cache_dtype]
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=_SCALE_MIN).bfloat16()
    y = xf / scale.float()  # [..., D]
    if kv_cache_dtype == "int8":
        codes = y.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        codes = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def decode(rows: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 2] int8 rows -> [..., D] in ``dtype``: (code * scale) @ R in fp32."""
    d = rows.shape[-1] - SCALE_BYTES
    rows = rows.contiguous()
    codes = rows[..., :d]
    if kv_cache_dtype == "fp8_e4m3":
        codes = codes.view(torch.float8_e4m3fn)
    scale = rows[..., d:].view(torch.bfloat16)  # [..., 1]
    return ((codes.float() * scale.float()) @ rotation(d, rows.device)).to(dtype)
