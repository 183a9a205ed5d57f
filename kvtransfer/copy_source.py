"""What the sources whose own CPU copies the bytes (tcp, local) hold: the KV tensor as a block
view (or, for a tensor-parallel group, rank 0's GroupKV), its compat record and the lease
check they run before and after every read.

nixl's source differs: its reads are one-sided, so it registers memory with UCX instead and
never sees a read.
"""
from __future__ import annotations

import threading
from typing import Iterator, Sequence

import torch

from kvtransfer.base import CompatRecord, KVSource, LeaseCheck, contiguous_runs
from kvtransfer.group_kv import GroupKV, registered


class CopySource(KVSource):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Guards the source's state (implementations add theirs under it)."""
        self._blocks: torch.Tensor | None = None
        """``[num_blocks, block_bytes]`` uint8 view of the registered KV tensor."""
        self._group: GroupKV | None = None
        """Registered instead of a tensor by rank 0 of a tensor-parallel group."""
        self._shape: tuple[int, int] = (0, 0)
        """(num_blocks, block_bytes) as readers see them (every head of a group's blocks)."""
        self._compat: CompatRecord | None = None
        self._lease_check: LeaseCheck | None = None

    def register(self, kv: torch.Tensor | GroupKV, compat: CompatRecord,
                 lease_check: LeaseCheck) -> None:
        blocks, group, shape = registered(kv, compat)
        with self._lock:
            if self._compat is not None:
                raise RuntimeError(f"{type(self).__name__}.register called twice")
            self._blocks, self._group, self._shape = blocks, group, shape
            self._compat, self._lease_check = compat, lease_check

    def _require_registered(self, call: str) -> None:
        """RuntimeError naming ``call`` when ``register`` has not run."""
        if self._compat is None:
            raise RuntimeError(f"{type(self).__name__}.{call} before register")

    def _pieces(self, ids: Sequence[int]) -> Iterator[torch.Tensor]:
        """The bytes of blocks ``ids``, in order, as CPU ``[n, block_bytes]`` pieces: one
        per run of consecutive ids of the tensor (no copy on CPU), or the group's gather
        of them all."""
        if self._group is not None:
            yield self._group.read(ids)
            return
        for _, first, n in contiguous_runs(list(ids)):
            run = self._blocks[first:first + n]
            yield run if run.device.type == "cpu" else run.cpu()
