"""LoRA adapters on a worker: what it tells routers it serves (WorkerLoad.loras), the
admin RPCs that load and unload adapters at run time (the router's
/v1/load_lora_adapter and /v1/unload_lora_adapter fan out to them), and the
``tandem:lora_requests_info`` gauge (vLLM's).

Load reads and checks the adapter on the request-build pool (a disk read and a check
against the model), never on the event loop nor the engine thread: the batch goes on
streaming meanwhile, and the adapter serves the next request that names it. An adapter
the model cannot take is refused naming lora_path (the message names the config field
or the flag, e.g. --max-lora-rank); nothing is registered then.

Unload removes the name at once (new requests naming it are refused) and answers once
no request on this worker still runs under it: requests already admitted finish on the
weights they started with (engine/lora/registry.py). A caller that goes away does not
undo the removal.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Gauge

from core.errors import FieldError
from engine.lora.registry import LoRARegistry
from proto import common_pb2 as common

if TYPE_CHECKING:
    from engine.engine_thread import EngineWorker
    from engine.llm_engine import LLMEngine

UNLOAD_POLL_S = 0.05
"""How often an unload looks whether the adapter's last request has finished."""


def describe(registry: LoRARegistry | None, message) -> None:
    """Fill a WorkerLoad's or LoRAReply's loras and lora_generation."""
    if registry is None:
        return
    served, message.lora_generation = registry.served()
    message.loras.extend(common.LoRAAdapter(name=n, path=p, identity=i) for n, p, i in served)


async def _registry(engine: EngineWorker, context) -> LoRARegistry:
    registry = engine.loras
    if registry is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "this worker serves no LoRA adapters: start it with --enable-lora "
                            "(or --lora-modules) to load adapters at run time")
    return registry


async def load_adapter(engine: EngineWorker, request: common.LoadLoRARequest, context,
                       refuse) -> common.LoRAReply:
    """refuse(context, FieldError): the worker's INVALID_ARGUMENT answer naming the field."""
    registry = await _registry(engine, context)
    name, path = request.lora_name, request.lora_path
    if not name or not path:
        return await refuse(context, FieldError(
            "lora_name" if not name else "lora_path",
            "lora_name and lora_path are both required (a name and a PEFT adapter directory)"))
    with_name = {n for n, _, _ in registry.served()[0]}
    if name in with_name:
        await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                            f"lora_name: an adapter named {name!r} is already loaded; unload "
                            f"it first")
    try:
        adapter = await engine.off_loop(registry.add, name, path)
    except Exception as e:  # noqa: BLE001 - any unreadable or unfit adapter: the client's
        if isinstance(e, ValueError) and str(e).startswith("lora_name"):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))  # a racing load
        return await refuse(context, FieldError("lora_path", f"lora_path {path!r}: {e}"))
    reply = common.LoRAReply(adapter=common.LoRAAdapter(name=name, path=path,
                                                        identity=adapter.identity))
    describe(registry, reply)
    return reply


async def unload_adapter(engine: EngineWorker, request: common.UnloadLoRARequest,
                         context) -> common.LoRAReply:
    registry = await _registry(engine, context)
    name = request.lora_name
    served = {n: (p, i) for n, p, i in registry.served()[0]}
    try:
        registry.remove(name)
    except KeyError:
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"lora_name: no adapter named {name!r} is loaded "
                            f"(loaded: {sorted(served) or 'none'})")
    path, identity = served[name]
    reply = common.LoRAReply(adapter=common.LoRAAdapter(name=name, path=path, identity=identity))
    describe(registry, reply)
    while await engine.run(lambda e: _uses(e, identity)):
        await asyncio.sleep(UNLOAD_POLL_S)
    return reply


def _uses(engine: LLMEngine, identity: bytes) -> bool:
    """Engine thread: some live request runs under this adapter."""
    return any(r.lora is not None and r.lora.identity == identity
               for r in engine.requests.values())


class LoRAMetrics:
    """vLLM's ``lora_requests_info`` gauge: one series whose labels name the adapters
    of the running and of the waiting requests (comma-separated) and --max-loras; its
    value is when that changed (unix seconds). Only on a worker that serves LoRA."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.labels = labels
        self.gauge = Gauge("tandem:lora_requests_info", "Running and waiting LoRA adapters "
                           "(labels); the value is when they last changed",
                           [*labels, "running_lora_adapters", "waiting_lora_adapters",
                            "max_lora"], registry=registry)
        self._last: tuple[str, str] | None = None

    def observe(self, engine: LLMEngine) -> None:
        """Engine thread, after a step: a new series when the sets changed."""
        if engine.loras is None:
            return
        sched = engine.scheduler
        running = _names((*sched.running, *sched.loading.values()))
        waiting = _names((*sched.waiting, *sched.swapped))
        if (running, waiting) == self._last:
            return
        self._last = (running, waiting)
        self.gauge.clear()
        self.gauge.labels(**self.labels, running_lora_adapters=running,
                          waiting_lora_adapters=waiting,
                          max_lora=str(sched.max_loras)).set(time.time())


def _names(requests) -> str:
    return ",".join(sorted({r.lora.name for r in requests if r.lora is not None}))
