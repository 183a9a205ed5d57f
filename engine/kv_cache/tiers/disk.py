"""The disk tier: KV blocks as files (block_file.py), an LRU bounded in bytes, written by
a thread so that the step loop never waits for a disk.

Files are named ``<format key>-<block hash>.kvb``: a restart of the same model (same
fingerprint and KV format) finds its blocks by listing the directory, without reading
them; another model's files have another key and are never opened. Every read checks
the file's digest and header; a corrupt or foreign file is counted, deleted and treated
as a miss, never read as KV. Writes go to a temporary file renamed into place, so a
crash leaves a whole file or none.

The write queue holds at most ``queue_blocks`` blocks. When it is full (the disk is
slower than evictions), a block to be written is dropped and counted (``dropped``): it
was a cache copy, so the cost is a later recompute, and the engine never blocks on it.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from core.kv.block_hash import BlockHash
from engine.kv_cache.block_pool import KVEventKind
from engine.kv_cache.tiers.block_file import CorruptBlock, ForeignBlock, KVFormat, decode, encode
from engine.kv_cache.tiers.events import MEDIUM_DISK, TierEvent

log = logging.getLogger(__name__)
SUFFIX = ".kvb"


@dataclass
class DiskStats:
    written: int = 0
    dropped: int = 0
    """Blocks not written because the write queue was full."""
    write_errors: int = 0
    """Writes that failed (directory gone, disk full): the block is dropped."""
    evicted: int = 0
    corrupt: int = 0
    """Files whose digest, magic or length was wrong when read: deleted, recomputed."""
    foreign: int = 0
    """Intact files of another model, format or block under this engine's name: deleted."""


class DiskTier:
    def __init__(self, directory: str | os.PathLike, budget_bytes: int, fmt: KVFormat,
                 queue_blocks: int = 64) -> None:
        """ValueError naming --kv-offload-dir when the directory cannot be written."""
        self.dir = Path(directory)
        self.budget = budget_bytes
        self.fmt = fmt
        self.stats = DiskStats()
        _check_writable(self.dir)
        self._lock = threading.Lock()
        self.index: OrderedDict[BlockHash, int] = self._scan()
        """Blocks on disk, least recently used first, with their file sizes."""
        self._pending: dict[BlockHash, tuple[tuple[int, ...], bytes]] = {}
        self._events: list[TierEvent] = []  # since drain_events
        self._queue: queue.Queue = queue.Queue(maxsize=queue_blocks)
        self._writer = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{self.fmt.key}-{block_hash.hex()}{SUFFIX}"

    def __contains__(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self.index or block_hash in self._pending

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self.index.values())

    def put(self, block_hash: BlockHash, tokens: tuple[int, ...], payload: bytes) -> bool:
        """Queue a block for writing without waiting; False when it was dropped."""
        with self._lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
                return True
            if block_hash in self._pending:
                return True
            try:
                self._queue.put_nowait((block_hash, tokens, payload))
            except queue.Full:
                self.stats.dropped += 1
                return False
            self._pending[block_hash] = (tokens, payload)
            return True

    def read(self, block_hash: BlockHash, tokens: tuple[int, ...]) -> bytes | None:
        """The block's bytes, or None (not here, or the file failed its checks)."""
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is not None:
                return pending[1] if pending[0] == tokens else None
            if block_hash not in self.index:
                return None
            self.index.move_to_end(block_hash)
        try:
            return decode(self.fmt, block_hash, tokens, self.path(block_hash).read_bytes())
        except (CorruptBlock, ForeignBlock) as e:
            kind = "corrupt" if isinstance(e, CorruptBlock) else "foreign"
            log.warning("KV disk tier: %s file %s skipped (%s)", kind,
                        self.path(block_hash).name, e)
            with self._lock:
                setattr(self.stats, kind, getattr(self.stats, kind) + 1)
            self._forget(block_hash)
        except OSError:  # evicted by the writer meanwhile
            self._forget(block_hash)
        return None

    def stored(self) -> list[TierEvent]:
        """The blocks on disk now (those found at start-up included), as stores without
        tokens (the files are not read for them)."""
        with self._lock:
            return [TierEvent(KVEventKind.STORED, h, MEDIUM_DISK) for h in self.index]

    def drain_events(self) -> list[TierEvent]:
        """Blocks written and files removed since the last call (any thread)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _event(self, kind: KVEventKind, block_hash: BlockHash, tokens: tuple[int, ...] = ()) -> None:
        """Record one (the lock held)."""
        self._events.append(TierEvent(kind, block_hash, MEDIUM_DISK, tokens))

    def drain(self) -> None:
        """Wait until every queued block is written (tests; shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._writer.join()

    # -- the writer thread -------------------------------------------------------------
    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            block_hash, tokens, payload = item
            try:
                self._write(block_hash, tokens, payload)
            except OSError as e:
                with self._lock:
                    self.stats.write_errors += 1
                log.warning("KV disk tier: cannot write to %s (%s); the block is dropped",
                            self.dir, e)
            finally:
                with self._lock:
                    self._pending.pop(block_hash, None)
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, block_hash: BlockHash, tokens: tuple[int, ...], payload: bytes) -> None:
        data = encode(self.fmt, block_hash, tokens, payload)
        if len(data) > self.budget:
            return
        self._make_room(len(data))
        final = self.path(block_hash)
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError:  # a full disk: no partial file left to fill it further
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self.index[block_hash] = len(data)
            self.stats.written += 1
            self._event(KVEventKind.STORED, block_hash, tokens)

    def _make_room(self, size: int) -> None:
        with self._lock:
            used = sum(self.index.values())
            doomed = []
            while self.index and used + size > self.budget:
                block_hash, n = self.index.popitem(last=False)
                doomed.append(block_hash)
                used -= n
                self._event(KVEventKind.REMOVED, block_hash)
            self.stats.evicted += len(doomed)
        for block_hash in doomed:
            self.path(block_hash).unlink(missing_ok=True)

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            if self.index.pop(block_hash, None) is not None:
                self._event(KVEventKind.REMOVED, block_hash)
        self.path(block_hash).unlink(missing_ok=True)

    def _scan(self) -> OrderedDict[BlockHash, int]:
        """This format's files, oldest first; leftovers of interrupted writes removed;
        the oldest dropped beyond the budget."""
        found = []
        for p in self.dir.glob(f"{self.fmt.key}-*"):
            if p.suffix != SUFFIX:
                p.unlink(missing_ok=True)  # a temporary file of a write that never ended
                continue
            try:
                block_hash = BlockHash(bytes.fromhex(p.stem.split("-", 1)[1]))
                st = p.stat()
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime_ns, block_hash, st.st_size))
        index = OrderedDict((h, n) for _, h, n in sorted(found))
        while index and sum(index.values()) > self.budget:
            self.path(index.popitem(last=False)[0]).unlink(missing_ok=True)
        return index


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--kv-offload-dir {str(directory)!r} is not a writable directory: "
                         f"{e.strerror or e}") from e
