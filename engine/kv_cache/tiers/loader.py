"""Disk reads for promotions, off the step loop: a reader thread reads and checks a
block's file (block_file.py) while the engine thread goes on stepping; the engine
thread collects the read (``landed``) and writes it into the host slot reserved for it
(a copy of one block; at --tensor-parallel-size > 1 a scatter to the ranks, a group
operation only the engine thread may run), and only then can a request be promoted
from it.

The engine thread owns the host tier and the host slots; the reader thread touches only
the disk tier (thread-safe) and the bytes it read.
"""
from __future__ import annotations

import concurrent.futures as cf

import torch

from core.kv.block_hash import BlockHash
from engine.kv_cache.tiers.disk import DiskTier


class DiskLoader:
    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        self.pending: dict[BlockHash, cf.Future] = {}

    def start(self, block_hash: BlockHash, tokens: tuple[int, ...]) -> None:
        """Read the block in the background."""
        self.pending[block_hash] = self._pool.submit(self._read, block_hash, tokens)

    def _read(self, block_hash: BlockHash, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """Reader thread: the block's bytes (uint8), None when the file is gone, another
        block's, or fails its checks (the disk tier counted and deleted it)."""
        payload = self.disk.read(block_hash, tokens)
        return None if payload is None else torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def landed(self) -> list[tuple[BlockHash, torch.Tensor | None]]:
        """The reads that ended since the last call: (block, its bytes or None)."""
        done = [(h, f.result() if f.exception() is None else None)
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
