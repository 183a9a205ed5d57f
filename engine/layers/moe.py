"""Mixture-of-experts feed-forward: a router picks each token's top-k experts, and the
experts run as grouped matmuls over the rows routed to them.

The tokens' (token, expert) pairs are sorted by expert, so each active expert's rows are
one contiguous slice: an expert costs one gate/up and one down matmul per forward over
all its tokens, and an expert no token chose costs nothing. There is never a loop over
tokens, nor over experts that got none. The weights are stacked ([E, 2I, H] and
[E, H, I]) and filled from the checkpoint's per-expert tensors.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.activation import gated
from engine.layers.linear import single


class FusedExperts(nn.Module):
    not_compilable = ("the experts' token split is data-dependent (how many tokens each "
                      "expert gets is known only at run time), which a full-graph compile "
                      "cannot trace")
    """Why a model holding this layer cannot have its decode step compiled
    (engine/models/base.py compile_blocker reads it)."""
    not_quantizable = ("the experts' stacked weights have no int8/int4 kernel, and packing "
                       "only the attention and router linears would serve a model that is "
                       "mostly dense as quantized")
    """Why --quantization int8/int4 refuses a model holding this layer (quantize_model)."""

    def __init__(self, num_experts: int, hidden: int, inter: int,
                 act: Callable[[torch.Tensor], torch.Tensor],
                 names: Sequence[str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        """names: the checkpoint's per-expert gate, up and down tensors
        (``experts.{e}.<name>.weight``)."""
        super().__init__()
        self.num_experts, self.inter, self.act, self.names = num_experts, inter, act, tuple(names)
        self.checkpoint_inter = inter
        """Each checkpoint expert's width, which a tensor-parallel split of ``inter`` keeps."""
        self.first, self.owned = 0, num_experts
        """The experts held here: [first, first + owned) (a tensor-parallel rank under
        expert parallelism holds a share, engine/parallel/shard.py); all by default."""
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)

    def checkpoint_places(self, path: str) -> dict[str, tuple[str, object]]:
        """Checkpoint tensor -> (our parameter, the index it fills): engine/models/weights.py."""
        gate, up, down = self.names
        inter, out = self.checkpoint_inter, {}
        for e in range(self.num_experts):
            pre = f"{path}.{e}."
            out[pre + gate + ".weight"] = (f"{path}.gate_up", (e, slice(0, inter)))
            out[pre + up + ".weight"] = (f"{path}.gate_up", (e, slice(inter, 2 * inter)))
            out[pre + down + ".weight"] = (f"{path}.down", e)
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; ids, weights [T, k] (each token's experts and their fp32 weights)
        -> sum over k of weight * expert(x) [T, H], over the experts held here."""
        k = ids.shape[1]
        ids, weights = ids.flatten(), weights.flatten()
        token = torch.arange(ids.shape[0], device=ids.device) // k  # of each (token, slot)
        if self.owned != self.num_experts:  # a share of the experts: only their pairs
            mine = (ids >= self.first) & (ids < self.first + self.owned)
            ids, weights, token = ids[mine] - self.first, weights[mine], token[mine]
        order = ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(ids, minlength=self.owned).tolist()
        token = token[order]
        rows = x[token]  # [pairs, H]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = gated(F.linear(rows[start:start + n], self.gate_up[e]), self.act)  # [n, I]
                out[start:start + n] = F.linear(h, self.down[e])  # [n, H]
                start += n
        scaled = (out * weights[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, scaled)


class SparseMoE(nn.Module):
    """The router (``gate``: softmax over experts, top-k, optionally renormalised to sum
    to 1) and the experts."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool,
                 act: Callable[[torch.Tensor], torch.Tensor],
                 names: Sequence[str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = single(hidden, num_experts, "gate", parallel="replicated")
        self.experts = FusedExperts(num_experts, hidden, inter, act, names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        probs = self.gate(x).float().softmax(-1)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(x, ids, weights)
