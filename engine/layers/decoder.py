"""Decoder layers: the residual wiring around one attention and one feed-forward block.

Each splits at its attention call: ``attn_in`` (residual -> q, k, v) and ``attn_out``
(residual and attention output -> the layer's output), the pieces the compiled step
fuses with the neighbouring layer's (engine/models/base.py, Segments)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.layers.attention import Attention, RopeTables


class DecoderLayer(nn.Module):
    """Pre-norm (Llama, Mistral, Qwen, Phi-3): x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.mlp = mlp

    def attn_in(self, x: torch.Tensor, rope: RopeTables):
        """Residual stream [T, H] -> q, k, v of this layer's attention."""
        return self.self_attn.project(self.input_layernorm(x), rope)

    def attn_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual [T, H] and attention output [T, Hq * D] -> the layer's output [T, H]."""
        x = x + self.self_attn.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: each block's output is normed again before it joins the residual
    (post_attention_layernorm is that norm here; pre_feedforward_layernorm is the MLP's
    input norm)."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, norm: Callable[[], nn.Module]) -> None:
        super().__init__(self_attn, mlp, norm)
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def attn_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(o))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
