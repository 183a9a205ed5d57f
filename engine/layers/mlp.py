"""The gated feed-forward block: down(act(gate(x)) * up(x)), gate and up as one matmul."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from engine.layers.activation import gated
from engine.layers.linear import Linear, single


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: Callable[[torch.Tensor], torch.Tensor],
                 gate_up: Sequence[str] = ("gate_proj", "up_proj"), bias: bool = False) -> None:
        """gate_up: the checkpoint's names for the gate and up projections, or one name
        where the checkpoint stores them fused (gate rows first)."""
        super().__init__()
        shards = ([(gate_up[0], 2 * inter)] if len(gate_up) == 1
                  else [(name, inter) for name in gate_up])
        self.gate_up_proj = Linear(hidden, shards, bias=bias)
        self.down_proj = single(inter, hidden, "down_proj", bias=bias, parallel="row")
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(gated(self.gate_up_proj(x), self.act))  # via [T, I]
