"""RMS norms, computed in fp32 whatever the activation dtype, in the two forms
checkpoints use. Both normalise over the last dimension, so applied to [T, H, D] they
are the per-head q/k norms of Qwen3 and Gemma 3."""
from __future__ import annotations

import torch
from torch import nn


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """weight * normed (Llama, Qwen, Mistral): the normed value is cast back to the
    activation dtype before the weight multiplies it, as HF Llama does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return self.weight * _rms(x, self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """normed * (1 + weight), all in fp32, then cast (Gemma stores weights around 0)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return (_rms(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
