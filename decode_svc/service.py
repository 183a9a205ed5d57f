"""The decode worker: pulls a prompt's missing KV blocks, joins the request to its
continuous batch, and streams tokens.

Request life here (Generate): validate; reserve blocks on the engine thread (its
own prefix-cache hit adopted, the rest allocated; waits while the pool is
full); pull only the blocks it lacks from the prefill worker named in the
KVHandle, then release the lease (KVLinkClient.pull does both); join the batch.
If the pull fails (lease expired, peer gone, timeout) the prompt is recomputed
here and the trace says why. Without a handle the prompt is prefilled locally
(conditional disaggregation). Blocks are freed once, by the engine, when the
request finishes or is aborted; an abort that arrives mid-pull waits for the
pull to end so no byte lands in a block someone else owns.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from engine.remote import RemoteReservation
from kvtransfer.base import KVCompatError, ReadPlan, TransferState, get_backend
from kvtransfer.link import KVLinkClient, blocks_from_proto
from proto import common_pb2 as common
from proto import decode_pb2 as pb
from proto import decode_pb2_grpc as pb_grpc
from decode_svc.priority_gate import PriorityGate
from worker.base import WorkerBase, invalid_argument
from worker.config import WorkerConfig
from worker.convert import sampling_from_proto, top_to_proto

log = logging.getLogger(__name__)
_FALLBACK = {TransferState.EXPIRED: "lease_expired", TransferState.FAILED: "transfer_failed"}


class DecodeService(WorkerBase, pb_grpc.DecodeServicer):
    role = "decode"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self._peers: dict[str, tuple[KVLinkClient, object]] = {}
        self._peer_lock = asyncio.Lock()
        self._reserve_gate = PriorityGate(1)  # freed blocks go to the most important first
        self._pull_gate = PriorityGate(2)     # transfers served in priority order
        self._pulling: set[str] = set()
        self._abort_after_pull: set[str] = set()

    async def start(self) -> None:
        await self.start_engine()
        backend = get_backend(self.config.kv.backend)
        self.backend_name = backend.name
        self.reader = backend.reader()
        self.reader.register(self.llm.runner.kv, self.compat())
        pb_grpc.add_DecodeServicer_to_server(self, self.server)
        await self.start_server([pb.DESCRIPTOR.services_by_name["Decode"].full_name])

    async def stop(self, grace_s: float = 1.0) -> None:
        await super().stop(grace_s)
        for client, _ in self._peers.values():
            await client.close()
        self.reader.close()

    async def _peer(self, endpoint: str):
        """(client, reader peer) for a prefill worker; handshake once per endpoint.
        KVCompatError when the two workers' KV records differ."""
        async with self._peer_lock:
            if endpoint not in self._peers:
                client = KVLinkClient(endpoint, self.worker_id)
                try:
                    info = await client.handshake(self.compat(), self.backend_name)
                    self.compat().check(info.compat)
                    peer = self.reader.connect(info)
                except BaseException:
                    await client.close()
                    raise
                self._peers[endpoint] = (client, peer)
            return self._peers[endpoint]

    # -- RPCs -----------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context):
        rid = request.request_id
        await self.refuse_if_draining(context)
        try:
            params = sampling_from_proto(request.sampling)
            # Validation only reads the engine: done here, not after the running step.
            req = self.llm.make_request(list(request.prompt_token_ids), params, rid,
                                        request.priority, list(request.output_token_ids))
        except ValueError as e:
            await invalid_argument(context, e)
            return
        need = self.llm.kv.blocks_needed(len(req.token_ids) + 1)
        if need > self.llm.kv.pool.num_blocks:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request {rid} needs {need} KV blocks; this decode worker has "
                                f"{self.llm.kv.pool.num_blocks} in all (--kv-blocks)")
            return
        q = self.engine.open_stream(rid)
        try:
            trace = await self._admit(req, request, context)
            if trace is None:  # aborted while its KV was being pulled
                yield pb.GenerateChunk(finished=True, finish_reason="abort",
                                       num_prompt_tokens=req.num_prompt_tokens,
                                       num_output_tokens=req.num_output_tokens)
                return
            async for chunk in self._stream(q, trace, local=not request.HasField("kv_handle")):
                yield chunk
        except asyncio.CancelledError:
            await self.engine.call(lambda e: e.abort(rid))
            raise
        finally:
            self.engine.close_stream(rid)

    async def _admit(self, req, request: pb.GenerateRequest, context) -> pb.KVTrace | None:
        """Get the request into the running batch; None when it was aborted meanwhile."""
        trace = pb.KVTrace()
        if not request.HasField("kv_handle"):
            await self.engine.call(lambda e: e.admit(req), urgent=req.priority)
            return trace
        handle = blocks_from_proto(request.kv_handle)
        peer = await self._connect(handle, trace, context)  # compat is checked first
        want = self.llm.kv.blocks_needed(handle.num_tokens)
        if not 0 < handle.num_tokens < len(req.token_ids) or len(handle.block_ids) != want:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kv_handle: {len(handle.block_ids)} block_ids for num_tokens "
                                f"{handle.num_tokens} (expected {want}, and num_tokens below the "
                                f"request's {len(req.token_ids)} tokens)")
        num_kv = handle.num_tokens
        async with self._reserve_gate.hold(req.priority):
            res = await self._reserve(req, num_kv, request.preempt_lower_priority)
        trace.local_cached_tokens = res.local_cached_tokens
        self._pulling.add(req.request_id)
        try:
            async with self._pull_gate.hold(req.priority):
                ok = peer is not None and await self._pull(handle, peer, res, trace)
        finally:
            self._pulling.discard(req.request_id)
        if req.request_id in self._abort_after_pull:
            self._abort_after_pull.discard(req.request_id)
            await self.engine.call(lambda e: e.abort(req.request_id))
            return None
        await self.engine.call(lambda e: e.activate_remote(req.request_id, ok),
                               urgent=req.priority)
        m = self.metrics
        m.l(m.prompt_tokens).inc(req.num_prompt_tokens)
        m.l(m.prefix_queries).inc(num_kv)
        m.l(m.prefix_hits).inc(res.local_cached_tokens)
        return trace

    async def _reserve(self, req, num_kv: int, preempt_lower: bool) -> RemoteReservation:
        """Blocks for the request; waits while the pool is full (what can never fit was
        refused before)."""
        delay = 0.002
        urgent: int | None = req.priority
        while True:
            res = await self.engine.call(lambda e: e.reserve_remote(req, num_kv, preempt_lower),
                                         urgent=urgent)
            if res is not None:
                return res
            # Retries wait for steps to end: interrupting each one would stop the very
            # requests whose completion frees the blocks.
            urgent = None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _connect(self, handle, trace: pb.KVTrace, context):
        """(client, peer) for the handle's source; None (fallback recorded) when it is
        unreachable; FAILED_PRECONDITION naming the field when it is incompatible."""
        try:
            return await self._peer(handle.endpoint)
        except KVCompatError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Exception as e:  # noqa: BLE001 - unreachable peer: recompute here
            log.warning("prefill worker %s unreachable (%s); recomputing %s", handle.endpoint,
                        e, handle.request_id)
            self._fallback(trace, "peer_unreachable")
            return None

    async def _pull(self, handle, peer, res: RemoteReservation, trace: pb.KVTrace) -> bool:
        """Pull the missing blocks and release the lease. True when the KV arrived."""
        client, peer = peer
        if not res.fill:  # everything was cached here: only the lease to drop
            await _quiet_release(client, handle)
            return True
        plan = ReadPlan(handle.request_id, handle.epoch,
                        [handle.block_ids[i] for i, _ in res.fill], [b for _, b in res.fill])
        task = asyncio.ensure_future(client.pull(self.reader, peer, plan,
                                                 self.config.kv.transfer_timeout_s))
        try:
            done = await asyncio.shield(task)
        except asyncio.CancelledError:
            # the caller went away mid-pull: let the pull end before blocks are freed
            await asyncio.gather(task, return_exceptions=True)
            raise
        except Exception as e:  # noqa: BLE001 - peer died mid-pull, malformed reply, ...
            log.warning("pull of %s failed (%s); recomputing", handle.request_id, e)
            await self._forget_peer(handle.endpoint)
            return self._fallback(trace, "transfer_failed")
        if done.state is not TransferState.DONE:
            log.warning("pull of %s ended %s (%s); recomputing", handle.request_id,
                        done.state.name, done.error)
            if done.state is TransferState.FAILED:  # the source may have restarted
                await self._forget_peer(handle.endpoint)
            return self._fallback(trace, _FALLBACK.get(done.state, "transfer_failed"))
        trace.blocks_pulled, trace.bytes_pulled = plan.num_blocks, done.nbytes
        trace.transfer_seconds, trace.backend = done.seconds or 0.0, self.backend_name
        m = self.metrics
        m.l(m.kv_bytes).inc(done.nbytes)
        m.l(m.kv_blocks).inc(plan.num_blocks)
        m.l(m.kv_seconds).observe(done.seconds or 0.0)
        return True

    async def _forget_peer(self, endpoint: str) -> None:
        """Drop a peer so the next request to it handshakes afresh."""
        async with self._peer_lock:
            entry = self._peers.pop(endpoint, None)
        if entry is not None:
            await entry[0].close()

    def _fallback(self, trace: pb.KVTrace, reason: str) -> bool:
        trace.fallback = reason
        self.metrics.l(self.metrics.kv_fallbacks, reason=reason).inc()
        return False

    async def _stream(self, q: asyncio.Queue, trace: pb.KVTrace, local: bool = False):
        """Chunks of one request; the first carries the trace. local: this worker
        prefilled the prompt itself, so its prefix-cache hit is known only now."""
        first = True
        while True:
            out = await q.get()
            chunk = pb.GenerateChunk(token_ids=out.new_token_ids, finished=out.finished,
                                     num_prompt_tokens=out.num_prompt_tokens,
                                     num_output_tokens=out.num_output_tokens,
                                     logprobs=[lp.logprob for lp in out.logprobs])
            if any(lp.top for lp in out.logprobs):
                chunk.top_logprobs.extend(top_to_proto(lp.top) for lp in out.logprobs)
            if out.finished:
                chunk.finish_reason = out.finish_reason.value if out.finish_reason else "error"
                self.count_finish(out)
            if first:
                if local:
                    trace.local_cached_tokens = out.num_cached_tokens
                    m = self.metrics
                    m.l(m.prompt_tokens).inc(out.num_prompt_tokens)
                    m.l(m.prefix_queries).inc(out.num_prompt_tokens)
                    m.l(m.prefix_hits).inc(out.num_cached_tokens)
                chunk.trace.CopyFrom(trace)
                first = False
            self.metrics.l(self.metrics.generation_tokens).inc(len(out.new_token_ids))
            yield chunk
            if out.finished:
                return

    async def Abort(self, request: common.AbortRequest, context) -> common.AbortReply:
        if request.request_id in self._pulling:  # its blocks are being written: defer
            self._abort_after_pull.add(request.request_id)
            return common.AbortReply(aborted=True)
        out = await self.engine.call(lambda e: e.abort(request.request_id))
        return common.AbortReply(aborted=out is not None)


async def _quiet_release(client: KVLinkClient, handle) -> None:
    try:
        await client.release(handle.request_id, handle.epoch)
    except Exception as e:  # noqa: BLE001 - the lease will expire on its own
        log.warning("release of %s failed: %s", handle.request_id, e)
