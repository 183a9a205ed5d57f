"""The prefill side's KV connector (engine/kv_connector.py): a finished prefill's blocks,
kept for a decode worker to read under a lease.

Scheduler side (engine thread): a request marked ``PrefillOnly`` (Request.kv_transfer)
ends once its prompt is computed and its first token sampled, unless that token
finished it anyway (EOS, a stop, max_tokens); its block table is then kept here
(``held``) and, in the same moment, the lease over it is granted. Freeing the table,
whatever freed it (the reader's Release, the lease's expiry, an Abort), ends the lease
in the same moment. Both happen on the engine thread, so a lease never outlives its
blocks nor starts after they went (LeaseTable is thread-safe: the KVLink service
reads it on the event loop).

Worker side (event loop): the bytes are read by the KV source (kvtransfer/base.py)
under the lease; ``release`` frees a table on the engine thread once its lease ended
(kvtransfer/link.py's Release, the reaper's expiry).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.engine_thread import EngineWorker
from engine.kv_cache.manager import NULL_BLOCK
from engine.kv_connector import KVConnector
from engine.request import Request
from kvtransfer.lease import LeaseTable


@dataclass(frozen=True)
class PrefillOnly:
    """Request.kv_transfer of a prefill worker's request: compute the prompt and sample
    the first token, then keep the blocks for a lease (finish_reason None)."""


PREFILL_ONLY = PrefillOnly()


class PrefillConnector(KVConnector):
    def __init__(self, leases: LeaseTable, ttl_s: float, engine: EngineWorker | None = None
                 ) -> None:
        """``engine``: the driver ``release`` runs through (None: the caller already runs
        on the engine thread and calls ``free``, as engine tests do)."""
        self.leases, self.ttl_s, self.engine = leases, ttl_s, engine
        self.held: dict[str, list[int]] = {}
        """Block tables of finished prefills, each under a lease of the same id."""

    # -- scheduler side (engine thread) ----------------------------------------------------
    def ends_after_prompt(self, req: Request) -> bool:
        return isinstance(req.kv_transfer, PrefillOnly)

    def request_finished(self, req: Request, table: list[int]) -> bool:
        """Keep the table of a prefill that ended after its prompt, and lease it."""
        if not isinstance(req.kv_transfer, PrefillOnly) or req.finish_reason is not None:
            return False
        self.held[req.request_id] = table
        # a bounded policy dropped some entries (NULL_BLOCK): only the kept blocks move
        self.leases.grant(req.request_id, [b for b in table if b != NULL_BLOCK], self.ttl_s)
        return True

    def owns(self, request_id: str) -> bool:
        return request_id in self.held

    def free(self, request_id: str) -> bool:
        """End the lease and free the held table, once; False for unknown or already
        freed ids."""
        table = self.held.pop(request_id, None)
        if table is None:
            return False
        self.leases.drop(request_id)
        self.kv.release(table)
        return True

    @property
    def num_kept(self) -> int:
        return len(self.held)

    def leak_check(self) -> None:
        if self.held:
            raise AssertionError(f"prefill blocks still held for: {sorted(self.held)[:8]}")

    # -- worker side (event loop) ------------------------------------------------------------
    async def release(self, request_id: str) -> bool:
        """Free a held table on the engine thread (its lease ended); False when it was
        unknown or freed already."""
        return await self.engine.run(lambda _: self.free(request_id))
