"""Rotary position embedding (rotate-half layout, HF convention), with the rope scalings
checkpoints use: linear interpolation, Llama 3's, YaRN and Phi-3's long/short factors
(``longrope``, within the original context); others are refused by ``check_scaling``.

cos/sin tables are built once for the whole context window in fp32 and indexed by
each token's absolute position, so chunked prefill and decode need no state here.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers.modeling_rope_utils computes it: low
    frequencies interpolated by ``factor``, high ones kept, a linear ramp between the
    dimensions that turn beta_fast and beta_slow times over the original context; cos/sin
    scaled by ``attention_factor`` (default 0.1 ln(factor) + 1, or the mscale ratio)."""
    factor = float(_field(scaling, "factor"))
    old_len = float(_field(scaling, "original_max_position_embeddings"))

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(m) / mscale(m_all) if m and m_all else mscale()

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    # in fp32 and in this order, as transformers builds it: the tables match bit for bit
    pos = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp
    return 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep, float(attn)


def _longrope(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int
              ) -> tuple[torch.Tensor, float]:
    """Phi-3's long/short factors (``longrope``): per-dimension divisors of the
    frequencies, cos/sin scaled by sqrt(1 + ln(factor) / ln(original length)). transformers
    switches a whole sequence from the short to the long factors once it grows past the
    original context, recomputing every earlier position; a paged cache keeps the keys it
    wrote, so only a context window within the original length (short factors throughout)
    is served exactly, and a longer one is refused."""
    old_len = int(_field(scaling, "original_max_position_embeddings"))
    if max_positions > old_len:
        raise ValueError(
            f"rope_scaling longrope: a context window of {max_positions} is past "
            f"original_max_position_embeddings ({old_len}), where transformers switches a "
            f"sequence to long_factor mid-way, which a KV cache cannot follow exactly; "
            f"pass --max-model-len {old_len} or less")
    short = torch.tensor(_field(scaling, "short_factor"), dtype=torch.float32)
    if short.numel() != head_dim // 2:
        raise ValueError(f"rope_scaling short_factor has {short.numel()} values, the rotary "
                         f"needs head_dim / 2 = {head_dim // 2}")
    factor = float(_field(scaling, "factor"))
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (short * theta ** shape), float(attn)


def _field(scaling: dict[str, Any], key: str) -> Any:
    if scaling.get(key) is None:
        kind = scaling.get("rope_type") or scaling.get("type")
        raise ValueError(f"rope_scaling {kind}: the field {key!r} is missing")
    return scaling[key]


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                    max_positions: int = 0) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] fp32, the factor cos and sin are multiplied by)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float(), 1.0
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = float(scaling.get("factor") or 1.0)
    if kind == "linear":
        return (inv / factor).float(), 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(mid, blended, scaled).float(), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_positions)
    if kind in (None, "default"):
        return inv.float(), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported ({', '.join(ROPE_SCALINGS)})")


ROPE_SCALINGS = ("default", "linear", "llama3", "yarn", "longrope")
"""The rope_scaling types (config.json's ``rope_type``, or older ``type``) computed here."""


def check_scaling(scaling: dict[str, Any] | None, source: str) -> None:
    """ValueError naming the file for a rope_scaling type we would compute wrongly
    (dynamic NTK, ...) or a partial rotary (``partial_rotary_factor`` below 1), before
    anything loads."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_SCALINGS)})")
    partial = float((scaling or {}).get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor {partial} is not supported "
                         f"(a rotary over the whole head only)")


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
        inv, attn = inv_frequencies(head_dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device),
                            inv.to(device))  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos() * attn, emb.sin() * attn

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._build(self.cos.device)
        return self

    def shift(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys rotated at position p -> the same keys rotated at p + delta (x [..., D]),
        in fp32: rotations compose, and this one has no attention factor (the keys carry
        theirs from their first rotation)."""
        head_dim, max_positions, theta, scaling = self._spec
        inv, _ = inv_frequencies(head_dim, theta, scaling, max_positions)
        angle = torch.cat([inv, inv]).to(x.device) * delta  # [D]
        return apply_rotary(x.float(), angle.cos(), angle.sin())

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, shaped [T, 1, D] to broadcast over heads."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
