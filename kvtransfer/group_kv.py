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

A backend whose own CPU moves the bytes (tcp) gathers a block when a reader asks for
it. A one-sided NIXL READ reads registered memory without the source knowing, so
nixl keeps a mirror of the pool with every head (``mirror``): the source fills a
request's rows of it (``read(ids, into=mirror)``) before the request's handle leaves
the worker, and the reader lands a read there and scatters it. Row b of a mirror
stands for block b of the pool, so the block's owner (a lease, a pull) owns the row
too: it needs no accounting of its own.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvtransfer.base import CompatRecord, KVTransferError, block_view

Gather = Callable[[list[int], Callable[[torch.Tensor], None] | None], torch.Tensor]
"""(block ids, then) -> those blocks with every head, ``[n, block_bytes]`` uint8 on the
CPU; ``then`` (if any) is called with them on the engine thread, before the next step."""
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

    def read(self, ids: Sequence[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks ``ids`` with every head, ``[n, block_bytes]`` uint8 on the CPU. With
        ``into`` (a ``mirror()``), they are also copied into its rows ``ids`` on the
        engine thread, so a later read of the same blocks (the pool reused them) can
        never be overtaken by this one's copy."""
        ids = list(ids)
        then = None
        if into is not None:
            rows = torch.tensor(ids, dtype=torch.int64)
            then = lambda blocks: into.index_copy_(0, rows, self._checked(blocks, ids))  # noqa: E731
        return self._checked(self._gather(ids, then), ids)

    def write(self, ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Blocks ``ids`` := ``blocks`` (``[n, block_bytes]`` uint8, every head)."""
        self._scatter(list(ids), blocks)

    def mirror(self) -> torch.Tensor:
        """A new ``[num_blocks, block_bytes]`` uint8 CPU tensor: row b holds block b with
        every head, for a one-sided backend to register (module docstring). Its pages
        are committed as rows are first written."""
        return torch.empty(self.num_blocks, self.block_bytes, dtype=torch.uint8)

    def _checked(self, blocks: torch.Tensor, ids: list[int]) -> torch.Tensor:
        if tuple(blocks.shape) != (len(ids), self.block_bytes):
            raise KVTransferError(f"the group gave {tuple(blocks.shape)} for {len(ids)} blocks "
                                  f"of {self.block_bytes} B")
        return blocks


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
