"""Rotary position embedding (rotate-half layout, HF convention), with the rope scalings
of Llama 3 and linear interpolation (others are refused by ``check_scaling``).

cos/sin tables are built once for the whole context window in fp32 and indexed by
each token's absolute position, so chunked prefill and decode need no state here.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float()
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(mid, blended, scaled).float()
    if kind in (None, "default"):
        return inv.float()
    raise ValueError(f"rope_scaling type {kind!r} is not supported ({', '.join(ROPE_SCALINGS)})")


ROPE_SCALINGS = ("default", "linear", "llama3")
"""The rope_scaling types (config.json's ``rope_type``, or older ``type``) computed here."""


def check_scaling(scaling: dict[str, Any] | None, source: str) -> None:
    """ValueError naming the file for a rope_scaling type we would compute wrongly
    (YaRN, Phi-3's long/short factors, dynamic NTK, ...), before anything loads."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_SCALINGS)})")


class RotaryEmbedding(nn.Module):
    """The tables are a pure function of the config, so they are recomputed, in fp32,
    wherever the module goes (``_apply``): casting the model to bf16, or materialising
    it from the meta device, never degrades or empties them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self._spec = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self._build(self.cos.device)

    def _build(self, device: torch.device) -> None:
        if device.type == "meta":
            return
        head_dim, max_positions, theta, scaling = self._spec
        inv = inv_frequencies(head_dim, theta, scaling).to(device)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device),
                            inv)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._build(self.cos.device)
        return self

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, shaped [T, 1, D] to broadcast over heads."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
