"""The part of a worker service that does not depend on its role: the engine on
its thread (through the typed EngineWorker), KV event and load streaming, metrics,
the gRPC server, draining, and what happens when the engine dies."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

import grpc
import torch

from auth.grpc_auth import ServerAuth
from auth.secret import load_cluster_secret
from auth.targets import join, server_names
from core.errors import FieldError
from core.kv.layout import scale_layout
from engine.engine_thread import (AbortedBeforeArrival, DuplicateRequestError, EngineDead,
                                  EngineLoad, EngineWorker)
from engine.kv_cache.tiers.events import TierEvent
from engine.kv_connector import KVConnector
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request, RequestOutput
from engine.parallel.shard import kv_head_map
from kvtransfer.base import CompatRecord
from kvtransfer.group_kv import GroupKV
from proto import common_pb2 as common
from worker.config import WorkerConfig
from proto.convert import field_error_trailer, sampling_from_proto
from worker.events import KVEventHub, events_to_proto
from worker.kv_events_zmq import EngineEventBridge, ZmqKVEventPublisher
from worker.metrics import WorkerMetrics
from worker import lora as worker_lora
from worker import server as grpc_server
from tracing import provider as tracing

log = logging.getLogger(__name__)

ENGINE_CALL_S = 60.0
"""Most a KV transfer's I/O thread waits for the engine thread to gather or scatter a
group's heads (it runs them between steps; a dead engine never answers)."""
SNAPSHOT_CHUNK = 32768
"""Block hashes per snapshot batch (about 1.3 MB, under gRPC's 4 MB default)."""


class WorkerBase:
    role = "worker"

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"{self.role}@{config.host}:{config.port}"
        self.metrics = WorkerMetrics(self.role, self.worker_id)
        self.server: grpc.aio.Server | None = None  # made in start(): it binds to the running loop
        self.port = 0
        self.metrics_port: int | None = None
        self.engine: EngineWorker | None = None
        self.connector: KVConnector | None = None
        self.hub: KVEventHub | None = None
        self.kv_events: ZmqKVEventPublisher | None = None
        self._zmq_bridge: EngineEventBridge | None = None
        self.health = None
        self.draining = False
        self.died = asyncio.Event()
        """Set when the engine thread died (the process should exit non-zero)."""
        self.secret = load_cluster_secret(config.cluster_secret_file)
        self.auth = ServerAuth(self.secret)

    def active_leases(self) -> int:
        return 0

    def make_connector(self, engine: EngineWorker) -> KVConnector | None:
        """This role's KV connector (engine/kv_connector.py), its worker side driving
        ``engine``; None: the engine runs colocated."""
        return None

    async def start_engine(self) -> None:
        tracing.configure(f"tandem-{self.role}", self.config.otlp_traces_endpoint)
        self.server = grpc_server.new_server(self.auth)
        self.hub = KVEventHub(asyncio.get_running_loop())
        self._zmq_bridge = self._zmq_events()
        self.engine = EngineWorker(
            lambda: LLMEngine(self.config.engine, connector=self.connector),
            on_events=self._on_kv_events, on_step=self._on_step,
            on_load=lambda _: self.hub.load_changed(), on_death=self._engine_died)
        self.connector = self.make_connector(self.engine)  # built before the engine is
        await self.engine.start()
        info = self.engine.info
        self.metrics.set_kv_cache(info.kv_cache_dtype, scale_layout(info.kv_cache_dtype),
                                  info.block_size, info.block_bytes)

    def _on_kv_events(self, events: list[TierEvent]) -> None:
        """Engine thread: every tier's changes, to the routers' streams (and ZMQ)."""
        self.hub.publish(events)
        if self._zmq_bridge is not None:
            self._zmq_bridge.on_events(events)

    def _on_step(self, engine: LLMEngine) -> None:
        self.metrics.observe_engine(engine, self.active_leases(), self.kv_events)
        if self._zmq_bridge is not None:
            self._zmq_bridge.on_step(engine)

    def _zmq_events(self) -> EngineEventBridge | None:
        """The vLLM-format KV event publisher (--kv-events-endpoint), bound now."""
        if not self.config.kv_events_endpoint:
            return None
        self.kv_events = ZmqKVEventPublisher(
            self.config.kv_events_endpoint, self.config.kv_events_replay_endpoint or None,
            self.config.engine.cache.block_size)
        return EngineEventBridge(self.kv_events)

    def compat(self) -> CompatRecord:
        """This worker's KV layout record: at TP > 1, every head of the model, and which
        rank holds which (kvtransfer/group_kv.py)."""
        info = self.engine.info
        heads = kv_head_map(info.model_config.num_kv_heads,
                            self.config.engine.parallel.tensor_parallel_size)
        return CompatRecord.from_kv(self.engine.kv_tensor, info.fingerprint, info.kv_cache_dtype,
                                    info.dtype, heads)

    def transfer_kv(self) -> torch.Tensor | GroupKV:
        """What the KV transfer backend registers: the engine's KV tensor, or, at TP > 1,
        the group's KV, whose reads gather every rank's heads and whose writes scatter
        them, on the engine thread (a backend's I/O threads call them; never the loop)."""
        compat = self.compat()
        if compat.tensor_parallel_size == 1:
            return self.engine.kv_tensor
        loop = asyncio.get_running_loop()

        def on_engine(fn: Callable[[LLMEngine], Any]) -> Any:
            call = asyncio.run_coroutine_threadsafe(self.engine.run(fn), loop)
            return call.result(timeout=ENGINE_CALL_S)

        def export(engine: LLMEngine, ids: list[int], then) -> torch.Tensor:
            blocks = engine.runner.export_kv(ids)
            if then is not None:
                then(blocks)
            return blocks

        return GroupKV(self.engine.kv_tensor, compat,
                       gather=lambda ids, then: on_engine(lambda e: export(e, ids, then)),
                       scatter=lambda ids, blocks: on_engine(
                           lambda e: e.runner.import_kv(ids, blocks)))

    async def start_server(self, service_names: list[str]) -> None:
        self.health = grpc_server.add_health_and_reflection(self.server, service_names)
        self.port = grpc_server.bind(self.server, self.config.host, self.config.port)
        if not self.config.worker_id:
            self.worker_id = f"{self.role}@{self.endpoint}"
        self.auth.worker_id = self.worker_id
        names = server_names(self.config.host, self.port, self.config.public_host)
        self.auth.answer_to(names)
        await self.server.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        log.info("%s serving gRPC on %s:%d; clients may dial it as %s", self.worker_id,
                 self.config.host, self.port, ", ".join(sorted(names)))

    @property
    def endpoint(self) -> str:
        """host:port where peers reach this worker (an IPv6 host bracketed), once bound."""
        return join(self.config.public_host, self.port)

    def _engine_died(self, error: BaseException) -> None:
        log.critical("%s: the engine thread died (%s); health is NOT_SERVING and the "
                     "process exits", self.worker_id, error)
        if self.health is not None:
            self.health.enter_graceful_shutdown()
        self.died.set()

    def busy(self) -> bool:
        """Requests (or leases) still in flight on this worker."""
        return self.engine.load.busy or self.active_leases() > 0

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work (UNAVAILABLE; health NOT_SERVING so probes and routers move
        away) and wait up to timeout_s for what runs to finish."""
        self.draining = True
        if self.health is not None:
            self.health.enter_graceful_shutdown()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.busy() and not self.died.is_set() \
                and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        if self.busy():
            log.warning("%s: drain ended with work left: %s, %d leases", self.worker_id,
                        self.engine.load, self.active_leases())

    async def request_from(self, context, message, prompt_ids: Sequence[int]) -> Request:
        """The engine request a Prefill or Generate message asks for (its sampling, priority,
        outputs so far, cache salt, adapter and KV policy over prompt_ids); a client's error aborts the call
        with INVALID_ARGUMENT naming the field. Nothing is held yet either way."""
        try:
            params = sampling_from_proto(message.sampling)
            return await self.engine.make_request(prompt_ids, params, message.request_id,
                                                  message.priority, message.output_token_ids,
                                                  message.cache_salt, message.lora_name,
                                                  message.kv_policy or None)
        except ValueError as e:
            await invalid_argument(context, e)
            raise  # abort raised already; for a context that does not

    async def refuse_if_draining(self, context) -> None:
        if self.draining or not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{self.worker_id} is draining; send the request elsewhere"
                                if self.draining else f"{self.worker_id}: engine is down")

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.hub is not None:
            self.hub.close()
            await asyncio.sleep(0.05)  # let the event streams end cleanly
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.engine is not None:
            self.engine.stop()
        if self.kv_events is not None:
            self.kv_events.close()

    def load_proto(self) -> common.WorkerLoad:
        load = load_to_proto(self.engine.load, self.worker_id, self.engine.info.block_size,
                             self.active_leases())
        worker_lora.describe(self.engine.loras, load)
        return load

    # -- RPCs both roles serve ----------------------------------------------------
    async def GetLoad(self, request, context) -> common.WorkerLoad:
        return self.load_proto()

    async def LoadLoRAAdapter(self, request: common.LoadLoRARequest, context) -> common.LoRAReply:
        reply = await worker_lora.load_adapter(self.engine, request, context, invalid_argument)
        self.hub.load_changed()  # routers learn the new adapter with the next batch
        return reply

    async def UnloadLoRAAdapter(self, request: common.UnloadLoRARequest,
                                context) -> common.LoRAReply:
        reply = await worker_lora.unload_adapter(self.engine, request, context)
        self.hub.load_changed()
        return reply

    async def StreamKVEvents(self, request, context) -> None:
        """A snapshot of every block held, in every tier (chunked, the first batch reset=true), then
        each change and each load change, until the worker stops or cuts us off.
        Written with context.write, so a subscriber that goes away always unsubscribes."""
        sub = self.hub.subscribe()  # before the snapshot, so no change falls between
        self.subscriber_opened(request.subscriber)
        try:
            snapshot = events_to_proto(await self.engine.stored_blocks())
            for i in range(0, max(len(snapshot), 1), SNAPSHOT_CHUNK):
                await context.write(common.KVEventBatch(
                    worker_id=self.worker_id, load=self.load_proto(), reset=i == 0,
                    events=snapshot[i:i + SNAPSHOT_CHUNK]))
            while True:
                item = await sub.queue.get()
                if item is None:  # the worker is stopping, or we fell too far behind
                    return
                await context.write(common.KVEventBatch(
                    worker_id=self.worker_id, load=self.load_proto(),
                    events=events_to_proto(item.events or [])))
        except EngineDead:
            return
        finally:
            self.hub.unsubscribe(sub)
            self.subscriber_closed(request.subscriber)

    def subscriber_opened(self, subscriber: str) -> None:
        """A KV event stream opened for ``subscriber`` (a router's instance id); the
        prefill service counts a router's streams to tell when it is gone."""

    def subscriber_closed(self, subscriber: str) -> None:
        """That stream ended, however it ended (the subscriber went away included)."""

    # -- helpers --------------------------------------------------------------------
    def count_finish(self, out: RequestOutput) -> None:
        reason = out.finish_reason.value if out.finish_reason else "handoff"
        self.metrics.labelled(self.metrics.requests, finish_reason=reason).inc()

    async def abort_if_engine_died(self, context: grpc.aio.ServicerContext,
                                   out: RequestOutput) -> None:
        """An output the engine's death ended (a tensor-parallel rank lost, the engine
        thread crashed) ends the call UNAVAILABLE, as if this worker had died with it
        (it exits next): the router resumes the request on another worker instead of
        ending it with an error that is this worker's, not the request's."""
        if out.finish_reason is FinishReason.ERROR and not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id}: {out.error}")

    async def admission_error(self, context: grpc.aio.ServicerContext, error: Exception) -> None:
        """Answer a request the engine refused: ALREADY_EXISTS for a live id, CANCELLED
        when an Abort for its id came first, UNAVAILABLE when the engine is down,
        INVALID_ARGUMENT otherwise."""
        if isinstance(error, DuplicateRequestError):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(error))
        if isinstance(error, AbortedBeforeArrival):
            await context.abort(grpc.StatusCode.CANCELLED, str(error))
        if isinstance(error, EngineDead):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id}: {error}")
        await invalid_argument(context, error)


def load_to_proto(load: EngineLoad, worker_id: str, block_size: int,
                  active_leases: int = 0) -> common.WorkerLoad:
    """The engine thread's latest load snapshot as the wire message."""
    return common.WorkerLoad(
        worker_id=worker_id, num_waiting=load.num_waiting,
        num_running=load.num_running + load.num_loading, kv_usage=load.kv_usage,
        free_blocks=load.free_blocks, total_blocks=load.total_blocks,
        queued_prompt_tokens=load.queued_prompt_tokens, active_leases=active_leases,
        block_size=block_size, swap_used_blocks=load.swap_used_blocks)



async def invalid_argument(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """INVALID_ARGUMENT with the error's message; a FieldError's field travels in the
    status details (proto/convert.py field_error_trailer)."""
    trailer = field_error_trailer(error) if isinstance(error, FieldError) else ()
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error), trailer)
