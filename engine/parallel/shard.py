"""Splitting a loaded model over the ranks of a tensor-parallel group (Megatron-style).

Each rank keeps, of every layer:
- attention: its share of the query heads and of the KV heads (the KV heads a rank's
  query heads read; where there are fewer KV heads than ranks, each is replicated on the
  ranks whose query heads read it); q/k/v are split by output rows (columns of the
  computation), o_proj by its input columns, whose partial sums are all-reduced;
- the gated MLP, and each expert of a mixture: its share of the intermediate width
  (gate/up by rows, down by columns), all-reduced after the block. Every rank runs the
  (replicated) router, so every rank picks the same experts for every token. Under
  --enable-expert-parallel a mixture is split by experts instead: a rank keeps E / N
  whole experts and runs only the (token, expert) pairs routed to them (every rank
  holds every token's hidden state, so no token moves); the same all-reduce sums them;
- the embedding and the LM head: its share of the vocabulary. An embedding row outside
  the share contributes zeros and the rows are all-reduced; the logits are gathered.

So a layer costs two all-reduces of [T, H]. Biases after a row split stay on rank 0
only (every rank adding one would add it world-size times).

The split is made on the meta skeleton, before any weight is allocated: each split
parameter gets its share's shape and a ``Cut`` (engine/models/weights.py) that cuts
each checkpoint tensor as it loads, so a rank allocates its share and never the whole
model (a model larger than one device loads on a group). Each split linear records
its part of the unsplit weight (``linear.shard``), so --quantization packs a shard with
the codes and scales TP 1 gives that part: a GGUF's own blocks cut at block boundaries,
int4's groups, int8's per-row scales taken over the whole row. The collectives are
forward hooks on the split modules, so a group of one never runs any of this: that
path is the unsharded model, unchanged. They go through engine/parallel/collectives.py,
where a benchmark can time them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import Attention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoE
from engine.models.base import CausalLM
from engine.models.weights import Cut
from engine.parallel.collectives import all_gather, all_reduce
from engine.quant.base import Shard

FLAG = "--tensor-parallel-size"
EP_FLAG = "--enable-expert-parallel"


def check_shardable(model: CausalLM, world: int, expert_parallel: bool = False) -> None:
    """ValueError naming the flag and the numbers when ``world`` ranks cannot split this
    model evenly (works on a model still on the meta device: nothing is loaded yet)."""
    cfg = model.cfg
    counts = [("attention heads", cfg.num_heads), ("vocabulary entries", cfg.vocab_size)]
    for layer in model.model.layers:
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            counts.append(("MLP intermediate width", mlp.down_proj.in_features))
        elif isinstance(mlp, SparseMoE) and expert_parallel:
            counts.append((f"experts ({EP_FLAG})", mlp.experts.num_experts))
        elif isinstance(mlp, SparseMoE):
            counts.append(("expert intermediate width", mlp.experts.inter))
        else:
            raise ValueError(f"{FLAG} {world}: {type(mlp).__name__} layers cannot be split")
    for what, n in counts:
        if n % world:
            raise ValueError(f"{FLAG} {world} does not divide the model's {n} {what}")
    kv = cfg.num_kv_heads
    if kv % world and world % kv:
        raise ValueError(f"{FLAG} {world} neither divides the model's {kv} KV heads nor is "
                         f"a multiple of them")


def local_kv_heads(num_kv_heads: int, world: int) -> int:
    """KV heads one rank holds: its share, or one replicated head."""
    return max(1, num_kv_heads // world)


def kv_head_map(num_kv_heads: int, world: int) -> list[list[int]]:
    """Each rank's KV heads, in rank order: a share each, or, where there are fewer KV
    heads than ranks, the one head its query heads read."""
    n = local_kv_heads(num_kv_heads, world)
    firsts = [r * n if num_kv_heads >= world else r * num_kv_heads // world for r in range(world)]
    return [list(range(first, first + n)) for first in firsts]


def shard_model(model: CausalLM, rank: int, world: int, expert_parallel: bool = False,
                row_scales: bool = False) -> None:
    """Give every split parameter of the meta skeleton ``model`` its share's shape and Cut
    (in place, before loading) and hook the collectives in. row_scales: a row split's
    Cut also takes each whole row's max |w| as it loads (int8 packing's scales), which
    reads the whole tensor; otherwise a rank reads only its columns."""
    check_shardable(model, world, expert_parallel)
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, rank, world, row_scales)
        if isinstance(layer.mlp, GatedMLP):
            _shard_mlp(layer.mlp, rank, world, row_scales)
        elif expert_parallel:
            _split_experts(layer.mlp, rank, world)
        else:
            _shard_experts(layer.mlp, rank, world)
        layer.self_attn.o_proj.register_forward_hook(_all_reduce)
        layer.mlp.register_forward_hook(_all_reduce)
    _shard_vocab(model, rank, world)


def _keep(module: nn.Module, name: str, dim: int, pieces: list[tuple[int, int]],
          zero: bool = False, absmax: torch.Tensor | None = None) -> None:
    """module.name (on meta) becomes its (start, length) pieces along dim, concatenated,
    with the Cut that fills it at load time in the module's ``cuts``."""
    w = getattr(module, name)
    value = torch.cat([w.narrow(dim, s, n) for s, n in pieces], dim)
    setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=False))
    module.cuts = {**getattr(module, "cuts", {}),
                   name: Cut(tuple(w.shape), dim, tuple(pieces), zero, absmax)}


def _column_split(linear: nn.Linear, pieces: list[tuple[int, int]]) -> None:
    _keep(linear, "weight", 0, pieces)
    if linear.bias is not None:
        _keep(linear, "bias", 0, pieces)
    linear.out_features = linear.weight.shape[0]
    linear.shard = Shard(rows=tuple(pieces))  # --quantization packs it as TP 1 would


def _row_split(linear: nn.Linear, start: int, n: int, rank: int, row_scales: bool) -> None:
    # the whole rows' max |w|, filled as the weight loads
    absmax = torch.zeros(linear.out_features) if row_scales else None
    _keep(linear, "weight", 1, [(start, n)], absmax=absmax)
    if linear.bias is not None and rank:
        _keep(linear, "bias", 0, [(0, linear.out_features)], zero=True)
    linear.in_features = n
    linear.shard = Shard(cols=(start, n), row_absmax=absmax)


def _shard_attention(attn: Attention, rank: int, world: int, row_scales: bool) -> None:
    d, hq, hkv = attn.d, attn.hq // world, local_kv_heads(attn.hkv, world)
    first_kv = kv_head_map(attn.hkv, world)[rank][0]
    k0, v0 = attn.hq * d, (attn.hq + attn.hkv) * d
    _column_split(attn.qkv_proj, [(rank * hq * d, hq * d), (k0 + first_kv * d, hkv * d),
                                  (v0 + first_kv * d, hkv * d)])
    _row_split(attn.o_proj, rank * hq * d, hq * d, rank, row_scales)
    attn.hq, attn.hkv = hq, hkv


def _shard_mlp(mlp: GatedMLP, rank: int, world: int, row_scales: bool) -> None:
    inter = mlp.down_proj.in_features
    n = inter // world
    _column_split(mlp.gate_up_proj, [(rank * n, n), (inter + rank * n, n)])  # gate, up
    _row_split(mlp.down_proj, rank * n, n, rank, row_scales)


def _shard_experts(moe: SparseMoE, rank: int, world: int) -> None:
    ex = moe.experts
    n = ex.inter // world
    _keep(ex, "gate_up", 1, [(rank * n, n), (ex.inter + rank * n, n)])
    _keep(ex, "down", 2, [(rank * n, n)])
    ex.inter = n


def _split_experts(moe: SparseMoE, rank: int, world: int) -> None:
    ex = moe.experts
    n = ex.num_experts // world
    _keep(ex, "gate_up", 0, [(rank * n, n)])
    _keep(ex, "down", 0, [(rank * n, n)])
    ex.first, ex.owned = rank * n, n


class VocabShardEmbedding(nn.Module):
    """Rank's rows [start, start + n) of the embedding; the full rows come from an
    all-reduce (each token's row is nonzero on exactly one rank)."""

    def __init__(self, embed: nn.Embedding, start: int, n: int) -> None:
        super().__init__()
        self.weight = embed.weight
        _keep(self, "weight", 0, [(start, n)])
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        all_reduce(x)
        return x


def _shard_vocab(model: CausalLM, rank: int, world: int) -> None:
    n = model.cfg.vocab_size // world
    model.model.embed_tokens = VocabShardEmbedding(model.model.embed_tokens, rank * n, n)
    head = model.lm_head
    if model.cfg.tie_word_embeddings:
        head.weight = model.model.embed_tokens.weight  # tied again after loading (tie_weights)
    else:
        _keep(head, "weight", 0, [(rank * n, n)])
    head.out_features = n
    head.shard = Shard(rows=((rank * n, n),))
    head.register_forward_hook(_gather_vocab)


def _all_reduce(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook: the ranks' partial sums -> the full output, on every rank."""
    all_reduce(out)
    return out


def _gather_vocab(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook: each rank's logits [N, V / world] -> all of them [N, V]."""
    return torch.cat(all_gather(out.contiguous()), dim=-1)
