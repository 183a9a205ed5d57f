"""vLLM's run-time LoRA endpoints, behind the admin key (router/http/middleware.py):
``POST /v1/load_lora_adapter`` {lora_name, lora_path} and ``POST
/v1/unload_lora_adapter`` {lora_name}. The router forwards each to every healthy
worker (gRPC LoadLoRAAdapter / UnloadLoRAAdapter, worker/lora.py).

Load: every worker reads and checks the adapter (the path must be readable on each);
if any refuses, those that loaded it unload it again and the answer is the refusal
(400 naming lora_path or lora_name). On success every worker serves it, and the
router knows so before it answers: the next request naming it is placed at once.

Unload waits: the name is refused to new requests at once (404 naming model), then
the router waits until its own requests under the adapter have finished, then each
worker removes it and answers once no request there uses it. So no request that was
admitted under the adapter fails because of the unload.

Both fan-outs are shielded: an admin client that goes away does not leave the cluster
half changed (the change completes; the client just does not hear of it).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

import grpc
from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import Field, ValidationError

from proto import common_pb2 as common
from proto.convert import field_of
from router.http.errors import APIError
from router.openai_api import _Strict
from router.state import RouterState
from router.workers import Worker

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 60.0
_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.ALREADY_EXISTS: 400,
           grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.NOT_FOUND: 404}


class LoadLoRARequest(_Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(_Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
    """vLLM's; no effect (adapters are known by name)."""


async def _body(request: Request, model):
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise APIError.from_errors(e.errors()) from None


async def load(state: RouterState, request: Request) -> PlainTextResponse:
    body = await _body(request, LoadLoRARequest)
    workers = _workers(state)
    if body.lora_name == state.model_name or body.lora_name in state.loras.served():
        raise APIError(400, f"lora_name: {body.lora_name!r} is already served; unload it first",
                       param="lora_name")
    msg = common.LoadLoRARequest(lora_name=body.lora_name, lora_path=body.lora_path)
    await _to_the_end(_load_everywhere(workers, msg), f"loading LoRA {body.lora_name!r}")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def _load_everywhere(workers: list[Worker], msg: common.LoadLoRARequest) -> None:
    replies = await asyncio.gather(*(w.stub.LoadLoRAAdapter(msg, timeout=RPC_TIMEOUT_S)
                                     for w in workers), return_exceptions=True)
    failed = [r for r in replies if isinstance(r, BaseException)]
    if not failed:
        for w, reply in zip(workers, replies):
            w.take_loras(reply)
        return
    undo = common.UnloadLoRARequest(lora_name=msg.lora_name)
    await asyncio.gather(*(w.stub.UnloadLoRAAdapter(undo, timeout=RPC_TIMEOUT_S)
                           for w, r in zip(workers, replies) if not isinstance(r, BaseException)),
                         return_exceptions=True)
    raise _refusal(failed[0], "lora_path")


async def unload(state: RouterState, request: Request) -> PlainTextResponse:
    body = await _body(request, UnloadLoRARequest)
    name, loras = body.lora_name, state.loras
    if name not in loras.served():
        raise APIError(404, f"lora_name: no LoRA adapter named {name!r} is loaded (loaded: "
                            f"{sorted(loras.served()) or 'none'})", param="lora_name")
    loras.unloading.add(name)
    await _to_the_end(_unload_everywhere(state, name), f"unloading LoRA {name!r}")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _unload_everywhere(state: RouterState, name: str) -> None:
    try:
        await state.loras.drained(name)
        workers = [w for w in _workers(state) if name in w.loras]
        msg = common.UnloadLoRARequest(lora_name=name)
        replies = await asyncio.gather(*(w.stub.UnloadLoRAAdapter(msg, timeout=RPC_TIMEOUT_S)
                                         for w in workers), return_exceptions=True)
        for w, reply in zip(workers, replies):
            if isinstance(reply, BaseException):  # gone there already, or the worker is down
                w.loras.pop(name, None)
            else:
                w.take_loras(reply)
    finally:
        state.loras.unloading.discard(name)


async def _to_the_end(change: Coroutine[Any, Any, None], what: str) -> None:
    """Run a cluster change to its end even if the admin client goes away (shielded); a
    failure that no client awaits any more is logged, not dropped."""
    task = asyncio.ensure_future(change)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: _log_orphan(t, what))
        raise


def _log_orphan(task: asyncio.Future, what: str) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s failed after its admin client went away: %s", what, task.exception())


def _workers(state: RouterState) -> list[Worker]:
    workers = state.loras.workers()
    if not workers:
        raise APIError(503, "no healthy worker to change adapters on", "service_unavailable")
    return workers


def _refusal(e: BaseException, default_field: str) -> APIError:
    if not isinstance(e, grpc.aio.AioRpcError):
        return APIError(500, f"internal error: {type(e).__name__}", "server_error")
    status = _STATUS.get(e.code(), 503)
    field = field_of(e.trailing_metadata()) or (
        "lora_name" if e.code() == grpc.StatusCode.ALREADY_EXISTS else default_field)
    return APIError(status, e.details() or e.code().name,
                    "invalid_request_error" if status < 500 else "service_unavailable",
                    param=field if status < 500 else None)
