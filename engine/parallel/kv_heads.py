"""Moving whole blocks of KV between rank 0 of a tensor-parallel group and the ranks
that hold their heads: what a KV transfer needs, since each rank's pool holds only its
own KV heads (engine/parallel/shard.py) while a block on the wire carries every head.

Both run on every rank at once, over the control group (gloo, on the CPU), rank 0
after it sent the op (engine/parallel/plan.py Op.GATHER_KV / SCATTER_KV): a gather
brings each rank's heads of the blocks to rank 0, a scatter gives each rank its heads.
Blocks travel as raw bytes (uint8), so every KV dtype (int8 rows with their scales
included) moves as stored; only whole heads are cut out of a block, never parts of rows.

h2o's attention scores move the same way (``gather_scores``): rank 0 keeps every head's,
and after a step each rank sends it its heads' share of the step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _bytes(kv: torch.Tensor) -> torch.Tensor:
    """The pool's bytes as [blocks, L, 2, B, heads, row bytes] (shares memory)."""
    return kv.view(torch.uint8)


def gather_heads(kv: torch.Tensor, ids: list[int], head_map: list[list[int]] | None,
                 control) -> torch.Tensor | None:
    """Every rank: send rank 0 this rank's heads of blocks ``ids``. Rank 0 (head_map
    given: each rank's heads) returns the blocks with every head, ``[n, block bytes]``
    uint8 on the CPU; the other ranks return None."""
    local = _bytes(kv)[ids].cpu().contiguous()
    if head_map is None:
        dist.gather(local, None, dst=0, group=control)
        return None
    parts = [torch.empty_like(local) for _ in head_map]
    dist.gather(local, parts, dst=0, group=control)
    n, layers, two, block, _, row = local.shape
    heads = 1 + max(h for rank in head_map for h in rank)
    full = torch.empty(n, layers, two, block, heads, row, dtype=torch.uint8)
    for part, rank_heads in zip(parts, head_map):
        full[..., rank_heads, :] = part
    return full.view(n, -1)


def scatter_heads(kv: torch.Tensor, ids: list[int], head_map: list[list[int]] | None,
                  control, blocks: torch.Tensor | None = None) -> None:
    """Every rank: write this rank's heads of blocks ``ids``. Rank 0 gives ``blocks``
    (``[n, block bytes]`` uint8, every head) and head_map; the others give neither."""
    pool = _bytes(kv)
    mine = torch.empty((len(ids), *pool.shape[1:]), dtype=torch.uint8)
    pieces = None
    if head_map is not None:
        n, layers, two, block, _, row = mine.shape
        full = blocks.view(n, layers, two, block, -1, row)
        pieces = [full[..., rank_heads, :].contiguous() for rank_heads in head_map]
    dist.scatter(mine, pieces, src=0, group=control)
    pool[ids] = mine.to(pool.device)


def gather_scores(local: list[torch.Tensor], head_map: list[list[int]] | None, control,
                  into: list[torch.Tensor] | None = None) -> None:
    """Every rank: send rank 0 this step's scores of its heads, one [L, its heads, slots]
    tensor per scored sequence (``local``, in the step's order). Rank 0 (head_map given,
    ``into`` the sequences' [L, every head, slots] accumulators) adds each rank's into its
    heads: a head replicated on several ranks gets the sum of their query heads' shares,
    as one rank holding all of its query heads would compute."""
    flat = torch.cat([t.float().cpu().flatten() for t in local])
    if head_map is None:
        dist.gather(flat, None, dst=0, group=control)
        return
    parts = [torch.empty_like(flat) for _ in head_map]
    dist.gather(flat, parts, dst=0, group=control)
    for part, heads in zip(parts, head_map):
        at = 0
        for acc, mine in zip(into, local):
            n = mine.numel()
            acc[:, heads] += part[at:at + n].view(mine.shape).to(acc.device)
            at += n
