"""The decode worker: pulls a prompt's missing KV blocks, joins the request to its
continuous batch, and streams tokens.

Request life here (Generate): validate; queue the request as a remote admission
through the service's KV connector (kvtransfer/decode_connector.py: the engine's
scheduler gives it blocks in priority order with everything else,
its own prefix-cache hit adopted, preempting less important requests when the
router allows); pull only the blocks it lacks from the prefill worker named in the
KVHandle, then release the lease (KVLinkClient.pull does both); join the batch.
If the pull fails (lease expired, peer gone, timeout) the prompt is recomputed
here and the trace says why. Without a handle the prompt is prefilled locally
(conditional disaggregation).

Blocks are freed once, by the engine, when the request finishes or is aborted. The
pull's owner is this handler: an Abort that arrives mid-pull is held by the engine
until the pull ends (no byte lands in a block someone else owns), and a cancelled
handler waits for its pull to stop before it gives the blocks back.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from decode_svc.peers import KVPeerList, Peer, PeerCache
from decode_svc.kv_policy import adopt_scores, entries_mismatch, policy_mismatch
from engine.engine_thread import EngineWorker
from core.kv import blocks_for
from core.states import FallbackReason
from engine.request import FinishReason, Request
from kvtransfer.decode_connector import DecodeConnector, RemoteReservation
from kvtransfer.base import (KVAuthError, KVCompatError, ReadPlan, SourceBlocks, TransferState,
                             get_backend)
from kvtransfer.link import blocks_from_proto, ends_lease
from proto import common_pb2 as common
from proto import decode_pb2 as pb
from proto import decode_pb2_grpc as pb_grpc
from proto.convert import FALLBACK, prompt_logprobs_to_proto, top_to_proto
from worker.base import WorkerBase
from worker.config import WorkerConfig
from worker import spans as worker_spans

log = logging.getLogger(__name__)
_ENDS_ALL = (FinishReason.ERROR, FinishReason.ABORT)
"""A choice ending so ends the whole request (n > 1: it may come before the fork)."""
_FALLBACK = {TransferState.EXPIRED: FallbackReason.LEASE_EXPIRED,
             TransferState.FAILED: FallbackReason.TRANSFER_FAILED}


class DecodeService(WorkerBase, pb_grpc.DecodeServicer):
    role = "decode"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.kv_peers = KVPeerList(config.kv_peers)

    def make_connector(self, engine: EngineWorker) -> DecodeConnector:
        return DecodeConnector(engine)

    async def start(self) -> None:
        await self.start_engine()
        backend = get_backend(self.config.kv.backend)
        self.reader = backend.reader()
        self.reader.register(self.transfer_kv(), self.compat())
        self.peers = PeerCache(self.reader, self.compat, self.worker_id, backend.name,
                               self.secret, lambda: self.kv_peers.current())
        self.backend_name = backend.name
        pb_grpc.add_DecodeServicer_to_server(self, self.server)
        await self.start_server([pb.DESCRIPTOR.services_by_name["Decode"].full_name])

    async def stop(self, grace_s: float = 1.0) -> None:
        await super().stop(grace_s)
        await self.peers.close()
        self.reader.close()

    # -- RPCs -----------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context) -> None:
        """Streams GenerateChunks with context.write, so a cancelled call (the router
        went away) raises here and the cleanup below always runs."""
        rid = request.request_id
        await self.refuse_if_draining(context)
        req = await self.request_from(context, request, request.prompt_token_ids)
        info = self.engine.info
        need = blocks_for(len(req.token_ids) + 1, info.block_size)
        if req.kv_policy is not None:  # it never holds more than its budget
            need = min(need, req.kv_policy.budget_blocks(info.block_size))
        if need > info.num_blocks:
            return await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request {rid} needs {need} KV blocks; this decode worker has "
                f"{info.num_blocks} in all (--kv-blocks)")
        trace = pb.KVTrace()
        local = not request.HasField("kv_handle")
        worker_spans.generate_start(req, "local" if local else request.kv_handle.worker_id)
        try:
            q = await (self.engine.add(req) if local
                       else self._admit_remote(req, request, trace, context))
        except (ValueError, RuntimeError) as e:
            return await self.admission_error(context, e)
        try:
            await self._stream(q, trace, context, local, req.params.n)
        finally:
            self.engine.close_stream(rid)
            self.engine.abort_soon(rid)  # a no-op once it finished

    async def _admit_remote(self, req: Request, request: pb.GenerateRequest,
                            trace: pb.KVTrace, context) -> asyncio.Queue:
        """Reserve blocks, pull what is missing, join the batch; the output queue. The
        link's compatibility is checked before anything else, as the handle's block
        count only means something between compatible caches."""
        handle = blocks_from_proto(request.kv_handle)
        await _refuse_other_weights(req, request, context)
        mc = self.engine.info.model_config
        unfit = policy_mismatch(req, request.kv_handle)
        if unfit is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, unfit)
        async with contextlib.AsyncExitStack() as stack:
            peer: Peer | None = None
            if not self.kv_peers.allows(handle.endpoint):
                log.warning("kv handle of %s names %s, which no router's discovery lists (nor "
                            "--kv-peer); not dialing it, recomputing", req.request_id,
                            handle.endpoint)
                self._fallback(trace, FallbackReason.UNKNOWN_PEER)
            else:
                peer = await self._connect(stack, handle, req, trace, context)
            bad = (entries_mismatch(handle, self.engine.info.block_size)
                   or adopt_scores(req, request.kv_handle, mc.num_layers, mc.num_kv_heads))
            if not 0 < handle.num_tokens < len(req.token_ids):
                bad = (f"kv_handle: num_tokens {handle.num_tokens} must be below the "
                       f"request's {len(req.token_ids)} tokens")
            if bad is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad)
            return await self._reserve_and_pull(req, request, handle, peer, trace, context)

    async def _connect(self, stack: contextlib.AsyncExitStack, handle: SourceBlocks,
                       req: Request, trace: pb.KVTrace, context) -> Peer | None:
        """The link to the handle's source; None (fallback recorded) when it cannot be
        used; FAILED_PRECONDITION naming the field when the caches are incompatible."""
        try:
            return await stack.enter_async_context(self.peers.use(handle.endpoint))
        except KVCompatError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KVAuthError as e:
            log.warning("%s; recomputing %s", e, req.request_id)
            self._fallback(trace, FallbackReason.UNAUTHENTICATED_PEER)
        except Exception as e:  # noqa: BLE001 - unreachable peer: recompute here
            log.warning("prefill worker %s unreachable (%s); recomputing %s",
                        handle.endpoint, e, req.request_id)
            self._fallback(trace, FallbackReason.PEER_UNREACHABLE)
        return None

    async def _reserve_and_pull(self, req: Request, request: pb.GenerateRequest,
                                handle: SourceBlocks, peer: Peer | None, trace: pb.KVTrace,
                                context) -> asyncio.Queue:
        remaining = context.time_remaining()
        try:
            with worker_spans.reserving(req, handle.num_tokens):
                res, q = await asyncio.wait_for(
                    self.connector.reserve(req, handle.num_tokens, request.preempt_lower_priority),
                    timeout=remaining)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {req.request_id}: no KV room before its deadline")
        trace.local_cached_tokens = res.local_cached_tokens
        trace.local_host_cached_tokens = res.local_host_cached_tokens
        trace.local_disk_cached_tokens = res.local_disk_cached_tokens
        joined = False
        try:
            ok = False
            if peer is not None:
                async with self.peers.turn(peer, req.priority):  # per source, by priority
                    ok = await self._pull(handle, peer, res, trace)
            await self.connector.end_pull(req.request_id, ok)
            joined = True
        finally:
            if not joined:  # cancelled or failed: the pull has ended, the blocks go back
                self.engine.close_stream(req.request_id)
                self.engine.abort_soon(req.request_id)
        self.metrics.count_prompt(req.num_prompt_tokens, handle.num_tokens,
                                  res.local_cached_tokens)
        return q

    @worker_spans.pull_span
    async def _pull(self, handle: SourceBlocks, peer: Peer, res: RemoteReservation,
                    trace: pb.KVTrace) -> bool:
        """Pull the missing blocks and release the lease. True when the KV arrived.
        Cancelled: waits for the read to stop before re-raising."""
        source = handle.entries()  # a bounded policy's handle lists only kept blocks
        if not res.fill or any(i not in source for i, _ in res.fill):
            trace.lease_ended = await _quiet_release(peer, handle)
            if not res.fill:  # everything was cached here: only the lease to drop
                return True
            log.warning("kv handle of %s lacks blocks this worker keeps; recomputing",
                        handle.request_id)
            return self._fallback(trace, FallbackReason.TRANSFER_FAILED)
        plan = ReadPlan(handle.request_id, handle.epoch, [source[i] for i, _ in res.fill],
                        [b for _, b in res.fill], handle.lease_token)
        task = asyncio.ensure_future(peer.client.pull(self.reader, peer.peer_id, plan,
                                                      self.config.kv.transfer_timeout_s))
        try:
            done = await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.gather(task, return_exceptions=True)
            raise
        except Exception as e:  # noqa: BLE001 - peer died mid-pull, malformed reply, ...
            log.warning("pull of %s failed (%s); recomputing", handle.request_id, e)
            self.peers.invalidate(peer)
            return self._fallback(trace, FallbackReason.TRANSFER_FAILED)
        trace.lease_ended = done.lease_ended
        if done.state is not TransferState.DONE:
            log.warning("pull of %s ended %s (%s); recomputing", handle.request_id,
                        done.state.name, done.error)
            if done.state is TransferState.FAILED:  # the source may have restarted
                self.peers.invalidate(peer)
            return self._fallback(trace, _FALLBACK.get(done.state,
                                                       FallbackReason.TRANSFER_FAILED))
        trace.blocks_pulled, trace.bytes_pulled = plan.num_blocks, done.nbytes
        trace.transfer_seconds, trace.backend = done.seconds or 0.0, self.backend_name
        m = self.metrics
        m.labelled(m.kv_bytes).inc(done.nbytes)
        m.labelled(m.kv_blocks).inc(plan.num_blocks)
        m.labelled(m.kv_seconds).observe(done.seconds or 0.0)
        return True

    def _fallback(self, trace: pb.KVTrace, reason: FallbackReason) -> bool:
        trace.fallback = FALLBACK.to_proto(reason)
        worker_spans.fallback(reason)
        self.metrics.labelled(self.metrics.kv_fallbacks, reason=reason.value).inc()
        return False

    async def _stream(self, q: asyncio.Queue, trace: pb.KVTrace, context, local: bool,
                      n: int = 1) -> None:
        """Write one request's chunks, each choice's under its index, until all n choices
        have finished; the first carries the trace. local: this worker prefilled the
        prompt itself, so its prefix-cache hit is known only now."""
        first, left = True, n
        while True:
            out = await q.get()
            await self.abort_if_engine_died(context, out)
            chunk = pb.GenerateChunk(token_ids=out.new_token_ids, finished=out.finished,
                                     num_prompt_tokens=out.num_prompt_tokens,
                                     num_output_tokens=out.num_output_tokens,
                                     logprobs=[lp.logprob for lp in out.logprobs],
                                     index=out.index)
            if any(lp.top for lp in out.logprobs):
                chunk.top_logprobs.extend(top_to_proto(lp.top) for lp in out.logprobs)
            if out.prompt_logprobs is not None:
                chunk.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
            if out.finished:
                chunk.finish_reason = out.finish_reason.value if out.finish_reason else "error"
                if chunk.finish_reason == "error":
                    chunk.error = out.error or "the request failed on this worker"
                self.count_finish(out)
                worker_spans.generate_done(out)
                if out.spec is not None:
                    chunk.spec.CopyFrom(pb.SpecTrace(proposed_tokens=out.spec.proposed,
                                                     accepted_tokens=out.spec.accepted,
                                                     verifications=out.spec.verifications))
            if first:
                if local:
                    trace.local_cached_tokens = out.num_cached_tokens
                    trace.local_host_cached_tokens = out.num_host_cached_tokens
                    trace.local_disk_cached_tokens = out.num_disk_cached_tokens
                    self.metrics.count_prompt(out.num_prompt_tokens, out.num_prompt_tokens,
                                              out.num_cached_tokens)
                chunk.trace.CopyFrom(trace)
                first = False
            self.metrics.labelled(self.metrics.generation_tokens).inc(len(out.new_token_ids))
            await context.write(chunk)
            left -= out.finished
            if left == 0 or out.finish_reason in _ENDS_ALL:
                return  # Generate's cleanup aborts the choices still running

    async def SetKVPeers(self, request: pb.KVPeers, context) -> pb.KVPeersReply:
        num_peers = self.kv_peers.update(request.router_id, list(request.prefill_endpoints))
        # links to sources no list names any more; shielded: a caller that goes away
        # must not leave a link half closed
        await asyncio.shield(self.peers.prune())
        return pb.KVPeersReply(num_peers=num_peers)

    async def Abort(self, request: common.AbortRequest, context) -> common.AbortReply:
        """Cancel a request; its Generate stream ends with finish_reason "abort" (at once,
        or when its pull ends)."""
        return common.AbortReply(aborted=await self.engine.abort(request.request_id))


async def _refuse_other_weights(req: Request, request: pb.GenerateRequest, context) -> None:
    """FAILED_PRECONDITION when the handle's KV was computed under another LoRA adapter
    (or the base model) than this request runs under: such KV is never adopted. Nothing
    is held here yet; the caller (the router) ends the prefill side's lease."""
    mine = req.lora.identity if req.lora is not None else b""
    theirs = request.kv_handle.lora_identity
    if theirs != mine:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"kv_handle.lora_identity: the KV was computed under {_weights(theirs)}, and "
            f"request {req.request_id} runs under {_weights(mine)} (lora_name "
            f"{request.lora_name!r}); KV of other weights is never adopted")


def _weights(identity: bytes) -> str:
    return f"LoRA adapter {identity.hex()[:16]}" if identity else "the base model"


async def _quiet_release(peer: Peer, handle: SourceBlocks) -> bool:
    """Release the handle's lease; True when the source answered (the lease is over)."""
    try:
        _, reason = await peer.client.release(handle.request_id, handle.epoch,
                                              handle.lease_token)
        return ends_lease(reason)
    except Exception as e:  # noqa: BLE001 - the router ends the lease (trace.lease_ended)
        log.warning("release of %s failed: %s", handle.request_id, e)
        return False
