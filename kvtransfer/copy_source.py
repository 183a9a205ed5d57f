"""What the sources whose own CPU copies the bytes (tcp, local) hold: the KV tensor as a block
view, its compat record and the lease check they run before and after every read.

nixl's source differs: its reads are one-sided, so it registers memory with UCX instead and
never sees a read.
"""
from __future__ import annotations

import threading

import torch

from kvtransfer.base import CompatRecord, KVSource, LeaseCheck, block_view


class CopySource(KVSource):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Guards the source's state (implementations add theirs under it)."""
        self._blocks: torch.Tensor | None = None
        """``[num_blocks, block_bytes]`` uint8 view of the registered KV tensor."""
        self._compat: CompatRecord | None = None
        self._lease_check: LeaseCheck | None = None

    def register(self, kv: torch.Tensor, compat: CompatRecord, lease_check: LeaseCheck) -> None:
        compat.check_tensor(kv)
        with self._lock:
            if self._blocks is not None:
                raise RuntimeError(f"{type(self).__name__}.register called twice")
            self._blocks, self._compat, self._lease_check = block_view(kv), compat, lease_check

    def _require_registered(self, call: str) -> None:
        """RuntimeError naming ``call`` when ``register`` has not run."""
        if self._blocks is None:
            raise RuntimeError(f"{type(self).__name__}.{call} before register")
