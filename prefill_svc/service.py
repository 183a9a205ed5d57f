"""The prefill worker: chunked, batched prefill; first token; KV under a lease.

Request life here: Prefill() queues the prompt as a prefill_only engine request
(the engine's scheduler chunks it under the token budget, batched with other
prompts); when its first token is sampled the engine keeps the blocks (held),
this service grants a lease over them and returns a KVHandle. The blocks are
freed exactly once: when the decode worker's Release arrives, when the lease
expires (a reaper runs every 250 ms), or on Abort.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.llm_engine import LLMEngine
from kvtransfer.base import SourceBlocks, get_backend
from kvtransfer.lease import LeaseTable
from kvtransfer.link import KVLinkServicer, add_kv_link, blocks_to_proto
from proto import common_pb2 as common
from proto import kv_link_pb2
from proto import prefill_pb2 as pb
from proto import prefill_pb2_grpc as pb_grpc
from worker.base import WorkerBase, invalid_argument
from worker.config import WorkerConfig
from worker.convert import sampling_from_proto, top_to_proto

log = logging.getLogger(__name__)


def _release_blocks(engine: LLMEngine, block_ids: list[int]) -> bool:
    """Engine thread: free the held table made of exactly these blocks."""
    for rid, table in engine.held.items():
        if table == block_ids:
            return engine.release_held(rid)
    return False


class PrefillService(WorkerBase, pb_grpc.PrefillServicer):
    role = "prefill"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.leases = LeaseTable()
        self._reaper: asyncio.Task | None = None

    def active_leases(self) -> int:
        return self.leases.active()

    async def start(self) -> None:
        await self.start_engine()
        backend = get_backend(self.config.kv.backend)
        self.source = (backend.source(advertise_host=self.config.public_host)
                       if backend.name == "tcp" else backend.source())
        self.source.register(self.llm.runner.kv, self.compat(), self.leases.check_readable)
        self.source.serve(self.config.host)
        self.link = KVLinkServicer(self.source, self.leases, self._free_blocks, self.worker_id)
        pb_grpc.add_PrefillServicer_to_server(self, self.server)
        add_kv_link(self.server, self.link)
        await self.start_server([pb.DESCRIPTOR.services_by_name["Prefill"].full_name,
                                 kv_link_pb2.DESCRIPTOR.services_by_name["KVLink"].full_name])
        self.link.worker_id = self.worker_id
        self._reaper = asyncio.create_task(self._reap_loop())

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await super().stop(grace_s)
        self.source.close()

    def _free_blocks(self, block_ids: list[int]) -> None:
        """KVLinkServicer callback (event loop thread): free on the engine thread."""
        asyncio.ensure_future(self.engine.call(_release_blocks, list(block_ids)))

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.link.reap_expired()

    # -- RPCs -------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        rid = request.request_id
        t0 = time.monotonic()
        await self.refuse_if_draining(context)
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            return await invalid_argument(context, e)
        if request.deadline_unix_ms and request.deadline_unix_ms < time.time() * 1000:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {rid}: deadline passed before prefill started")
        await self._drop_lease(rid)  # a retry of a request whose decode side died
        q = self.engine.open_stream(rid)
        try:
            await self.engine.call(lambda e: e.add_request(
                list(request.token_ids), params, rid, request.priority,
                output_token_ids=list(request.output_token_ids), prefill_only=True),
                urgent=request.priority)
        except ValueError as e:
            self.engine.close_stream(rid)
            return await invalid_argument(context, e)
        try:
            out = await q.get()
        except asyncio.CancelledError:  # the router went away: free everything
            await self.engine.call(lambda e: (e.abort(rid), e.release_held(rid)))
            raise
        finally:
            self.engine.close_stream(rid)
        if out.error:
            await context.abort(grpc.StatusCode.INTERNAL, out.error)
        self.count_finish(out)
        m = self.metrics
        m.l(m.prompt_tokens).inc(out.num_prompt_tokens)
        m.l(m.generation_tokens).inc(1)
        m.l(m.prefix_queries).inc(out.num_prompt_tokens)
        m.l(m.prefix_hits).inc(out.num_cached_tokens)
        reply = pb.PrefillResponse(
            request_id=rid, first_token=out.new_token_ids[0], finished=out.finish_reason is not None,
            finish_reason=out.finish_reason.value if out.finish_reason else "",
            num_cached_tokens=out.num_cached_tokens, prefill_seconds=time.monotonic() - t0)
        if out.logprobs:
            reply.first_logprob = out.logprobs[0].logprob
            if out.logprobs[0].top:
                reply.first_top_logprobs.CopyFrom(top_to_proto(out.logprobs[0].top))
        if out.finish_reason is None:
            num_tokens = len(request.token_ids) + len(request.output_token_ids)
            reply.kv_handle.CopyFrom(await self._lease(rid, num_tokens))
        return reply

    async def _lease(self, rid: str, num_tokens: int):
        table = await self.engine.call(lambda e: list(e.held[rid]))
        lease = self.leases.grant(rid, table, self.config.kv.lease_ttl_s)
        return blocks_to_proto(SourceBlocks(
            self.worker_id, f"{self.config.public_host}:{self.port}", rid, lease.epoch,
            tuple(table), lease.deadline_unix_ms, num_tokens))

    async def _drop_lease(self, rid: str) -> bool:
        """Release rid's lease (if any) and free its blocks now."""
        lease = self.leases.get(rid)
        blocks = None if lease is None else self.leases.release(rid, lease.epoch)
        if blocks is None:
            return False
        await self.engine.call(_release_blocks, list(blocks))
        return True

    async def Abort(self, request: common.AbortRequest, context) -> common.AbortReply:
        rid = request.request_id
        out = await self.engine.call(lambda e: e.abort(rid))
        dropped = await self._drop_lease(rid)
        return common.AbortReply(aborted=out is not None or dropped)
