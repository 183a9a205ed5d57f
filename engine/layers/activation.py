"""Gated activations: act(gate) * up over a fused [T, 2I] gate/up projection."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU
    "gelu_pytorch_tanh": _gelu_tanh,  # GeGLU (Gemma)
    "gelu_tanh": _gelu_tanh,
}
"""config.json's hidden_act / hidden_activation -> the gate's nonlinearity."""


def gate_fn(name: str, source: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The nonlinearity a checkpoint names; ValueError naming the file for another."""
    if name not in GATES:
        raise ValueError(f"{source}: hidden_act {name!r} is not supported "
                         f"(supported: {', '.join(GATES)})")
    return GATES[name]


def gated(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """[T, 2I] (gate rows first, then up) -> act(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
