"""Rank 0's handle on a tensor-parallel group's KV pool, for a KV transfer backend.

Each rank of a group holds only its KV heads of every block (docs/tensor-parallel.md),
while a block on the wire always carries every KV head of the model, in the layout a
group of one stores (``[L, 2, B, Hkv, row]``): that is what makes a prefill group at TP
p and a decode group at TP d interchangeable for any p and d, as long as the model's
head layout (total KV heads, head_dim) is the same, which the compat record checks at
connect time. So a source reads a block by gathering its heads from every rank, and a
reader writes one by scattering them, each rank its own. Both are collectives of the
group, which only the engine thread may run (they go in the same order on every rank
as the steps): ``gather`` and ``scatter`` are the worker's calls onto that thread,
made from the backend's I/O threads, never from the event loop.

Only backends whose own CPU moves the bytes can serve a group (tcp): a one-sided NIXL
READ reads registered memory without the source knowing, so it cannot gather.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvtransfer.base import CompatRecord, KVTransferError, block_view

Gather = Callable[[list[int]], torch.Tensor]
"""Block ids -> those blocks with every head, ``[n, block_bytes]`` uint8 on the CPU."""
Scatter = Callable[[list[int], torch.Tensor], None]
"""(block ids, their blocks with every head) -> each rank holds its heads of them."""


class GroupKV:
    def __init__(self, local: torch.Tensor, compat: CompatRecord, gather: Gather,
                 scatter: Scatter) -> None:
        """``local``: rank 0's own pool (its heads); ``compat``: the group's record (every
        head, and which rank holds which)."""
        compat.check_tensor(local)
        self.compat = compat
        self.num_blocks = local.shape[0]
        self.block_bytes = compat.block_bytes
        """Bytes of one block with every head: what the wire carries per block."""
        self._gather, self._scatter = gather, scatter

    def read(self, ids: Sequence[int]) -> torch.Tensor:
        """Blocks ``ids`` with every head, ``[n, block_bytes]`` uint8 on the CPU."""
        blocks = self._gather(list(ids))
        if tuple(blocks.shape) != (len(ids), self.block_bytes):
            raise KVTransferError(f"the group gave {tuple(blocks.shape)} for {len(ids)} blocks "
                                  f"of {self.block_bytes} B")
        return blocks

    def write(self, ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Blocks ``ids`` := ``blocks`` (``[n, block_bytes]`` uint8, every head)."""
        self._scatter(list(ids), blocks)


def registered(kv: torch.Tensor | GroupKV, compat: CompatRecord
               ) -> tuple[torch.Tensor | None, GroupKV | None, tuple[int, int]]:
    """What a copying backend (tcp) keeps of what it registers: the tensor's
    ``[num_blocks, block_bytes]`` block view, or the group; and (num_blocks, block_bytes)
    as the wire sees them. ValueError unless ``kv`` matches ``compat``."""
    if isinstance(kv, GroupKV):
        if kv.compat != compat:
            raise ValueError(f"group KV does not match its compat record: {kv.compat} vs {compat}")
        return None, kv, (kv.num_blocks, kv.block_bytes)
    compat.check_tensor(kv)
    view = block_view(kv)
    return view, None, (view.shape[0], view.shape[1])
