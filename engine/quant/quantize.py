"""From float weights or GGUF blocks to the codes and scales the kernels take.

* ``int8_codes``: per-output-channel symmetric, scale = max|w| / 127.
* ``int4_codes``: per group of K, asymmetric min/max over 16 levels, in the
  kernel's form w = (q - 8) * scale + zero.
* ``gguf_int4_codes``: Q4_0 and Q4_1 blocks (32 weights along K, fp16 scale
  and, for Q4_1, fp16 min) map exactly onto the int4 kernel's group of 32:
  Q4_0 is (q - 8) * d, so zero = 0; Q4_1 is q * d + m = (q - 8) * d + (m + 8d).
  Only the scales' rounding to the activation dtype differs (bf16 keeps 8
  mantissa bits of the fp16 d and m).
* Q8_0 (int8 in blocks of 32 with an fp16 scale each), and every GGUF block type
  where our block kernel runs, keep the file's blocks as they are (blocks.py).
"""
from __future__ import annotations

import numpy as np
import torch

GGUF_BLOCK = 32


def int8_codes(w: torch.Tensor, absmax: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scales [N] fp32). absmax [N]: each row's max |w|
    where w is part of a longer row (a tensor-parallel rank's input columns)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if absmax is None else absmax.float()
    scales = (amax / 127.0).clamp(min=1e-12)  # [N]
    q = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def int4_codes(w: torch.Tensor, group_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] 0..15, scales [N, K/g], zeros [N, K/g]) fp32."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)  # [N, G, g]
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [N, G]
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15)  # w ~ q * s + lo
    zeros = lo + 8.0 * scales  # so that w ~ (q - 8) * s + zero
    return q.reshape(n, k).to(torch.int32), scales, zeros


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """[N, row bytes] uint8 -> [N, K/32, block_bytes]."""
    n = raw.shape[0]
    return np.ascontiguousarray(raw).reshape(n, -1, block_bytes)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte offset ``at`` of every block, as fp32 [N, G]."""
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[N, G, 16] packed bytes -> [N, G, 32] codes: low nibbles are elements 0..15."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_int4_codes(raw: np.ndarray, type_name: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks [N, row bytes] -> (q [N, K] 0..15, scales, zeros [N, K/32]) fp32."""
    if type_name == "Q4_0":
        b = _blocks(raw, 18)
        d, qs, m = _f16(b, 0), b[..., 2:], None
    elif type_name == "Q4_1":
        b = _blocks(raw, 20)
        d, m, qs = _f16(b, 0), _f16(b, 2), b[..., 4:]
    else:
        raise ValueError(f"GGUF type {type_name} is not a 4-bit block type")
    q = _nibbles(qs).reshape(raw.shape[0], -1)  # [N, K]
    zeros = np.zeros_like(d) if m is None else m + 8.0 * d
    return (torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d),
            torch.from_numpy(zeros))

