"""The prefill worker: chunked, batched prefill; first token; KV under a lease.

Request life here: Prefill() queues the prompt as a prefill_only engine request
(the engine's scheduler chunks it under the token budget, batched with other
prompts); when its first token is sampled the engine keeps the blocks (held) and
hands their ids back with that output, and this service grants a lease over them
at once (no await between the two, so no cancellation can fall in the gap) and
returns a KVHandle. The held blocks are freed exactly once, keyed by request id:
when the decode worker's Release arrives, when the lease expires (a reaper runs
every 250 ms), on Abort, or when the Prefill call is cancelled before its reply.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvtransfer.base import SourceBlocks, get_backend
from kvtransfer.lease import Lease, LeaseTable
from kvtransfer.link import KVLinkServicer, add_kv_link, blocks_to_proto
from proto import common_pb2 as common
from proto import kv_link_pb2
from proto import prefill_pb2 as pb
from proto import prefill_pb2_grpc as pb_grpc
from worker.base import WorkerBase, invalid_argument
from worker.config import WorkerConfig
from engine.wire import sampling_from_proto, top_to_proto

log = logging.getLogger(__name__)


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
        self.source = backend.source(advertise_host=self.config.public_host)
        self.source.register(self.engine.kv_tensor, self.compat(), self.leases.check_readable)
        self.source.serve(self.config.host)
        self.link = KVLinkServicer(self.source, self.leases, self._lease_ended, self.worker_id,
                                   self.secret)
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

    def _lease_ended(self, lease: Lease) -> None:
        """KVLinkServicer callback (event loop thread): free on the engine thread."""
        asyncio.ensure_future(self.engine.release_held(lease.request_id))

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
            req = self.engine.make_request(request.token_ids, params, rid, request.priority,
                                           request.output_token_ids)
        except ValueError as e:
            return await invalid_argument(context, e)
        if request.deadline_unix_ms and request.deadline_unix_ms < time.time() * 1000:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {rid}: deadline passed before prefill started")
        try:
            q = await self.engine.add(req, prefill_only=True)
        except (ValueError, RuntimeError) as e:
            return await self.admission_error(context, e)
        granted = False
        try:
            out = await q.get()
            if out.held_blocks is not None:  # no await from the hold to the grant
                handle = self._grant(rid, out.held_blocks,
                                     len(request.token_ids) + len(request.output_token_ids))
                granted = True
        finally:
            self.engine.close_stream(rid)
            if not granted:  # cancelled (router gone), or finished without a handoff
                self.engine.abort_soon(rid)
        if out.error:
            if granted:
                self._drop(rid)
            await context.abort(grpc.StatusCode.INTERNAL, out.error)
        return self._reply(request, out, handle if granted else None, time.monotonic() - t0)

    def _reply(self, request: pb.PrefillRequest, out, handle, seconds: float
               ) -> pb.PrefillResponse:
        self.count_finish(out)
        self.metrics.count_prompt(out.num_prompt_tokens, out.num_prompt_tokens,
                                  out.num_cached_tokens)
        self.metrics.labelled(self.metrics.generation_tokens).inc(1)
        reply = pb.PrefillResponse(
            request_id=request.request_id, first_token=out.new_token_ids[0],
            finished=out.finish_reason is not None,
            finish_reason=out.finish_reason.value if out.finish_reason else "",
            num_cached_tokens=out.num_cached_tokens, prefill_seconds=seconds)
        if out.logprobs:
            reply.first_logprob = out.logprobs[0].logprob
            if out.logprobs[0].top:
                reply.first_top_logprobs.CopyFrom(top_to_proto(out.logprobs[0].top))
        if handle is not None:
            reply.kv_handle.CopyFrom(handle)
        return reply

    def _grant(self, rid: str, blocks: list[int], num_tokens: int):
        lease = self.leases.grant(rid, blocks, self.config.kv.lease_ttl_s)
        return blocks_to_proto(SourceBlocks(
            self.worker_id, f"{self.config.public_host}:{self.port}", rid, lease.epoch,
            tuple(blocks), lease.deadline_unix_ms, num_tokens, lease.token))

    def _drop(self, rid: str) -> bool:
        """End rid's lease (if any) and free its held blocks."""
        lease = self.leases.drop(rid)
        self.engine.abort_soon(rid)
        return lease is not None

    async def Abort(self, request: common.AbortRequest, context) -> common.AbortReply:
        rid = request.request_id
        dropped = self.leases.drop(rid) is not None
        aborted = await self.engine.abort(rid, owner=True)  # held blocks go too
        return common.AbortReply(aborted=aborted or dropped)
