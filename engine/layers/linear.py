"""A linear layer that knows which checkpoint tensors fill it and how a tensor-parallel
rank would split it.

It stays an ``nn.Linear`` (engine/quant/apply.py swaps every nn.Linear for a packed
one), with two facts on top: ``shards``, the checkpoint tensors stacked along its output
rows in order (q, k and v projections run as one matmul, so do gate and up; a checkpoint
that stores them fused, as Phi-3 does, is one shard), and ``parallel``, the dimension a
rank takes: "column" (output rows: q/k/v, gate/up, each shard split on its own) or "row"
(input columns: o_proj, down_proj, whose partial sums a rank all-reduces).
"""
from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import nn

from engine.layers import dense

Parallel = Literal["column", "row", "replicated"]


class Linear(nn.Linear):
    def __init__(self, in_features: int, shards: Sequence[tuple[str, int]], *,
                 bias: bool = False, parallel: Parallel = "column") -> None:
        """shards: (checkpoint module name beside this one, output rows it fills), in
        the order they are stacked: ``[("q_proj", 512), ("k_proj", 128), ("v_proj", 128)]``
        is filled from ``<parent>.q_proj.weight`` etc. (and ``.bias`` with bias)."""
        super().__init__(in_features, sum(n for _, n in shards), bias=bias)
        self.shards = tuple(shards)
        self.parallel: Parallel = parallel
        self.register_buffer("onednn_weight", None, persistent=False)
        """The weight prepacked for oneDNN (engine/layers/dense.py), set once the model is
        in its final dtype; None: F.linear on the plain weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.forward(x, self.weight, self.onednn_weight, self.bias)

    def tp_dim(self) -> int | None:
        """The weight dimension a tensor-parallel rank takes a slice of (None: all)."""
        return {"column": 0, "row": 1}.get(self.parallel)

    def shard_rows(self) -> list[tuple[str, slice]]:
        """(checkpoint module name, the output rows it fills)."""
        out, start = [], 0
        for name, rows in self.shards:
            out.append((name, slice(start, start + rows)))
            start += rows
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shards={[n for n, _ in self.shards]}, {self.parallel}"


def single(in_features: int, out_features: int, name: str, *, bias: bool = False,
           parallel: Parallel = "column") -> Linear:
    """A linear filled by one checkpoint tensor of its own name."""
    return Linear(in_features, [(name, out_features)], bias=bias, parallel=parallel)


def move_forward_hooks(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst``, which takes ``src``'s place (a packed linear, a LoRA wrapper around
    it), the forward hooks ``src`` had: a tensor-parallel split's collective belongs to
    whatever module sits at that path, and must run once."""
    for hook in list(src._forward_hooks.values()):
        dst.register_forward_hook(hook)
    src._forward_hooks.clear()
