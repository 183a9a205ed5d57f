"""The prefill worker: chunked, batched prefill; first token; KV under a lease.

Request life here: Prefill() queues the prompt as a prefill_only engine request
(the engine's scheduler chunks it under the token budget, batched with other
prompts); when its first token is sampled the engine hands its blocks to the
service's KV connector, which keeps them (held) and, in the same moment on the
engine thread, grants the lease over them (kvtransfer/prefill_connector.py); the
reply carries it as a KVHandle. The held blocks are freed exactly once, keyed by
request id: when the decode worker's Release arrives, when the lease expires (a reaper
runs every 250 ms), on Abort, when the Prefill call is cancelled or fails before its
reply (while it prefills, or after the lease was granted), or when the router that
asked is gone (prefill_svc/router_leases.py: its KV event stream closed for 5 s); and
freeing them ends the lease, whichever path freed them (an Abort that overtakes the
output: the reply says abort, no handle). A reply lost after the handler returned it is
the lease's TTL's, or its router's.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from engine.kv_cache.manager import NULL_BLOCK
from engine.request import FinishReason, Request
from proto.convert import prompt_logprobs_to_proto, top_to_proto
from engine.engine_thread import EngineWorker
from kvtransfer.base import SourceBlocks, get_backend
from kvtransfer.lease import Lease, LeaseTable
from kvtransfer.link import KVLinkServicer, add_kv_link, blocks_to_proto
from kvtransfer.prefill_connector import PREFILL_ONLY, PrefillConnector
from prefill_svc.router_leases import RouterLeases
from proto import common_pb2 as common
from proto import kv_link_pb2
from proto import prefill_pb2 as pb
from proto import prefill_pb2_grpc as pb_grpc
from worker.base import WorkerBase
from worker.config import WorkerConfig
from worker import spans as worker_spans

log = logging.getLogger(__name__)


class PrefillService(WorkerBase, pb_grpc.PrefillServicer):
    role = "prefill"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.leases = LeaseTable()
        self.routers = RouterLeases(self._drop_lease)
        """The leases each router was granted, ended when that router is gone."""
        self._reaper: asyncio.Task | None = None

    def active_leases(self) -> int:
        return self.leases.active()

    def make_connector(self, engine: EngineWorker) -> PrefillConnector:
        return PrefillConnector(self.leases, self.config.kv.lease_ttl_s, engine)

    async def start(self) -> None:
        await self.start_engine()
        backend = get_backend(self.config.kv.backend)
        self.source = backend.source(advertise_host=self.config.public_host)
        self.source.register(self.transfer_kv(), self.compat(), self.leases.check_readable)
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
        asyncio.ensure_future(self.connector.release(lease.request_id))

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.link.reap_expired()
            self.routers.prune(self._lease_live)

    def subscriber_opened(self, subscriber: str) -> None:
        self.routers.opened(subscriber)

    def subscriber_closed(self, subscriber: str) -> None:
        self.routers.closed(subscriber)

    # -- RPCs -------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        rid = request.request_id
        t0 = time.monotonic()
        await self.refuse_if_draining(context)
        req = await self.request_from(context, request, request.token_ids)
        if request.deadline_unix_ms and request.deadline_unix_ms < time.time() * 1000:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {rid}: deadline passed before prefill started")
        req.kv_transfer = PREFILL_ONLY
        try:
            q = await self.engine.add(req)
        except (ValueError, RuntimeError) as e:
            return await self.admission_error(context, e)
        out = None
        try:
            out = await q.get()
        finally:
            self.engine.close_stream(rid)
            if out is None:  # cancelled (the router went away): its lease and blocks go
                self._drop(rid)
        handle = None
        if out.kept_blocks is not None:
            handle = self._handle(rid, out.kept_blocks,
                                  len(request.token_ids) + len(request.output_token_ids),
                                  req.kv_policy is not None)
            if handle is None:  # an Abort freed the blocks before this handler woke
                out.finish_reason, out.kept_blocks = FinishReason.ABORT, None
        try:
            if handle is not None:
                _bind(handle, req)
                await self._stage(context, rid, handle)
                self.routers.granted(request.router_id, rid, handle.lease_epoch)
            await self.abort_if_engine_died(context, out)
            if out.error:
                await context.abort(grpc.StatusCode.INTERNAL, out.error)
            return self._reply(request, out, handle, time.monotonic() - t0)
        except BaseException:  # cancelled or failed: the handle never reaches the caller
            if handle is not None:
                self._drop_lease(rid, handle.lease_epoch,
                                 "its Prefill call ended before the reply")
            raise

    def _reply(self, request: pb.PrefillRequest, out, handle, seconds: float
               ) -> pb.PrefillResponse:
        self.count_finish(out)
        self.metrics.count_prompt(out.num_prompt_tokens, out.num_prompt_tokens,
                                  out.num_cached_tokens)
        self.metrics.labelled(self.metrics.generation_tokens).inc(len(out.new_token_ids))
        reply = pb.PrefillResponse(
            request_id=request.request_id,
            first_token=out.new_token_ids[0] if out.new_token_ids else 0,  # none: max_tokens 0
            finished=out.finish_reason is not None,
            finish_reason=out.finish_reason.value if out.finish_reason else "",
            num_cached_tokens=out.num_cached_tokens, prefill_seconds=seconds,
            num_host_cached_tokens=out.num_host_cached_tokens,
            num_disk_cached_tokens=out.num_disk_cached_tokens)
        if out.logprobs:
            reply.first_logprob = out.logprobs[0].logprob
            if out.logprobs[0].top:
                reply.first_top_logprobs.CopyFrom(top_to_proto(out.logprobs[0].top))
        if out.prompt_logprobs is not None:
            reply.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
        if handle is not None:
            reply.kv_handle.CopyFrom(handle)
        worker_spans.prefill_done(out, seconds, handle, request.lora_name)
        return reply

    def _handle(self, rid: str, table: list[int], num_tokens: int, bounded: bool):
        """The KVHandle of the lease the engine granted with the hold of this table (its
        kept blocks: a bounded policy dropped the NULL_BLOCK entries, and its handle
        says which entries the kept ones are); None when that hold has ended already."""
        index = [i for i, b in enumerate(table) if b != NULL_BLOCK]
        kept = [table[i] for i in index]
        lease = self.leases.get(rid)
        if lease is None or list(lease.block_ids) != kept:
            return None
        return blocks_to_proto(SourceBlocks(
            self.worker_id, self.endpoint, rid, lease.epoch, tuple(kept),
            lease.deadline_unix_ms, num_tokens, lease.token,
            tuple(index) if bounded else ()))

    async def _stage(self, context, rid: str, handle: kv_link_pb2.KVHandle) -> None:
        """Make the leased blocks readable before the handle leaves (a tensor-parallel
        group's NIXL source gathers them into its mirror: kvtransfer/nixl.py). Cancelled,
        or failed (the engine is gone): Prefill frees the lease and the blocks as it
        unwinds (its ``except BaseException``), nothing is held."""
        if not self.source.stages:
            return
        try:
            await asyncio.to_thread(self.source.stage, list(handle.block_ids))
        except Exception as e:  # noqa: BLE001 - reported to the caller, nothing kept
            log.error("request %s: staging %d KV blocks failed: %r", rid,
                      len(handle.block_ids), e)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"request {rid}: the prefill group could not stage its KV "
                                f"for the decode worker: {e}")

    def _lease_live(self, rid: str, epoch: int) -> bool:
        lease = self.leases.get(rid)
        return lease is not None and lease.epoch == epoch

    def _drop_lease(self, rid: str, epoch: int, why: str) -> bool:
        """_drop, when rid's lease is still this epoch's (a handle that will never reach
        its caller, or be used; a retry under the same id holds a lease of its own).
        True when it was."""
        lease = self.leases.get(rid)
        if lease is None or lease.epoch != epoch:
            return False
        log.info("request %s: %s; its lease and %d KV blocks are freed", rid, why,
                 len(lease.block_ids))
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        """End rid's lease (if any) and free its held blocks (or abort it running)."""
        self.leases.drop(rid)
        self.engine.abort_soon(rid)

    async def Abort(self, request: common.AbortRequest, context) -> common.AbortReply:
        rid = request.request_id
        self.leases.drop(rid)  # unreadable at once; the engine then frees the blocks
        return common.AbortReply(aborted=await self.engine.abort(rid, owner=True))


def _bind(handle: kv_link_pb2.KVHandle, req: Request) -> None:
    """What the decode side must run the KV under: the adapter (it adopts KV of these
    weights only), the KV policy (kept blocks sit at positions within the cache) and,
    under h2o, the scores its next evictions follow (and under score=mean the arrivals).
    The request finished on the engine thread before its output came here, so its scores
    no longer change."""
    if req.lora is not None:
        handle.lora_identity = req.lora.identity
    if req.kv_policy is not None:
        handle.kv_policy = req.kv_policy.spec()
    if req.kv_scores is not None:
        handle.kv_scores = req.kv_scores.to("cpu", torch.float32).numpy().tobytes()
    if req.kv_arrivals is not None:
        handle.kv_arrivals = req.kv_arrivals.to("cpu", torch.int32).numpy().tobytes()
