"""Disk reads for promotions, off the step loop: a reader thread reads and checks a
block's file (block_file.py) and copies it into the host slot reserved for it, while
the engine thread goes on stepping; the block joins the host tier when the engine
thread collects the read (``landed``), and only then can a request be promoted from it.

The engine thread owns the host tier; the reader thread touches only the slot it was
given (pinned by the tier, so neither reused nor reclaimed meanwhile) and the disk tier
(thread-safe).
"""
from __future__ import annotations

import concurrent.futures as cf

import torch

from core.kv.block_hash import BlockHash
from engine.kv_cache.tiers.disk import DiskTier


class DiskLoader:
    def __init__(self, disk: DiskTier, host_kv: torch.Tensor) -> None:
        self.disk = disk
        self.host_kv = host_kv  # [host slots, L, 2, B, Hkv, row]
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        self.pending: dict[BlockHash, cf.Future] = {}

    def start(self, block_hash: BlockHash, tokens: tuple[int, ...], slot: int) -> None:
        """Read the block into host slot ``slot`` in the background."""
        self.pending[block_hash] = self._pool.submit(self._read, block_hash, tokens, slot)

    def _read(self, block_hash: BlockHash, tokens: tuple[int, ...], slot: int) -> bool:
        """Reader thread: False when the file is gone, another block's, or fails its
        checks (the disk tier counted and deleted it)."""
        payload = self.disk.read(block_hash, tokens)
        if payload is None:
            return False
        dst = self.host_kv[slot].view(-1).view(torch.uint8)
        dst.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return True

    def landed(self) -> list[tuple[BlockHash, bool]]:
        """The reads that ended since the last call: (block, whether it is in its slot)."""
        done = [(h, f.exception() is None and f.result())
                for h, f in self.pending.items() if f.done()]
        for h, _ in done:
            del self.pending[h]
        return done

    def wait(self, timeout: float) -> None:
        """Until some read ends, at most ``timeout`` seconds (an engine with nothing
        else to run)."""
        if self.pending:
            cf.wait(list(self.pending.values()), timeout, return_when=cf.FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
