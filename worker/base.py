"""The part of a worker service that does not depend on its role: the engine on
its thread, KV event streaming, load reports, metrics, the gRPC server."""
from __future__ import annotations

import asyncio
import logging

import grpc

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput
from kvtransfer.base import CompatRecord
from proto import common_pb2 as common
from worker.config import WorkerConfig
from worker.convert import engine_load, events_to_proto
from worker.events import KVEventHub
from worker.metrics import WorkerMetrics
from worker import server as grpc_server

log = logging.getLogger(__name__)


class WorkerBase:
    role = "worker"

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"{self.role}@{config.host}:{config.port}"
        self.metrics = WorkerMetrics(self.role, self.worker_id)
        self.server: grpc.aio.Server | None = None  # made in start(): it binds to the running loop
        self.port = 0
        self.metrics_port: int | None = None
        self.engine: AsyncEngine | None = None
        self.hub: KVEventHub | None = None
        self.draining = False

    @property
    def llm(self) -> LLMEngine:
        """The engine, for read-only access off its thread (config, tokenizer, sizes)."""
        return self.engine.engine

    def active_leases(self) -> int:
        return 0

    async def start_engine(self) -> None:
        self.server = grpc_server.new_server()
        self.hub = KVEventHub(asyncio.get_running_loop())
        self.engine = AsyncEngine(lambda: LLMEngine(self.config.engine),
                                  on_events=self.hub.publish,
                                  on_step=lambda e: self.metrics.observe_engine(e, self.active_leases()))
        await self.engine.start()

    def compat(self) -> CompatRecord:
        return CompatRecord.from_kv(self.llm.runner.kv, self.llm.fingerprint)

    async def start_server(self, service_names: list[str]) -> None:
        self.health = grpc_server.add_health_and_reflection(self.server, service_names)
        self.port = grpc_server.bind(self.server, self.config.host, self.config.port)
        if not self.config.worker_id:
            self.worker_id = f"{self.role}@{self.config.public_host}:{self.port}"
        await self.server.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        log.info("%s serving gRPC on %s:%d", self.worker_id, self.config.host, self.port)

    def busy(self) -> bool:
        """Requests (or leases) still in flight on this worker."""
        return bool(self.llm.requests) or self.active_leases() > 0

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work (UNAVAILABLE; health NOT_SERVING so probes and routers move
        away) and wait up to timeout_s for what runs to finish."""
        self.draining = True
        if getattr(self, "health", None) is not None:
            self.health.enter_graceful_shutdown()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.busy() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        if self.busy():
            log.warning("%s: drain timed out with %d requests and %d leases left",
                        self.worker_id, len(self.llm.requests), self.active_leases())

    async def refuse_if_draining(self, context) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{self.worker_id} is draining; send the request elsewhere")

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.hub is not None:
            self.hub.close()
            await asyncio.sleep(0.05)  # let the event streams end cleanly
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.engine is not None:
            self.engine.stop()

    # -- RPCs both roles serve ----------------------------------------------------
    async def GetLoad(self, request, context) -> common.WorkerLoad:
        return engine_load(self.llm, self.worker_id, self.active_leases())

    async def StreamKVEvents(self, request, context):
        """First batch: a snapshot of every cached block; then each change."""
        q = self.hub.subscribe()
        try:
            snapshot = await self.engine.call(lambda e: list(e.kv.pool.cached))
            yield common.KVEventBatch(
                worker_id=self.worker_id, load=engine_load(self.llm, self.worker_id),
                events=[common.KVEvent(kind=common.KVEvent.STORED, block_hash=h) for h in snapshot])
            while True:
                events = await q.get()
                if events is None:  # the worker is stopping
                    return
                yield common.KVEventBatch(worker_id=self.worker_id, events=events_to_proto(events),
                                          load=engine_load(self.llm, self.worker_id,
                                                           self.active_leases()))
        except asyncio.CancelledError:  # subscriber gone or server stopping: a normal end
            return
        finally:
            self.hub.unsubscribe(q)

    # -- helpers --------------------------------------------------------------------
    def count_finish(self, out: RequestOutput) -> None:
        reason = out.finish_reason.value if out.finish_reason else "handoff"
        self.metrics.l(self.metrics.requests, finish_reason=reason).inc()


async def invalid_argument(context: grpc.aio.ServicerContext, error: Exception) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
