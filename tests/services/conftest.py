"""In-process prefill and decode services on the tiny model (fast handoff tests)."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from auth.grpc_auth import channel as auth_channel
from decode_svc.peers import KVPeerList

from engine.config import EngineConfig
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from worker.config import KVTransferConfig, WorkerConfig


def worker_config(model_dir, backend: str = "tcp", engine: dict | None = None,
                  lease_ttl_s: float = 30.0, transfer_timeout_s: float = 5.0,
                  kv_blocks: int = 64) -> WorkerConfig:
    kv = KVTransferConfig(backend=backend, lease_ttl_s=lease_ttl_s,
                          transfer_timeout_s=transfer_timeout_s)
    base = dict(model=str(model_dir), dtype="float32", num_kv_blocks=kv_blocks, max_model_len=256)
    return WorkerConfig(engine=EngineConfig.from_flat(**{**base, **(engine or {})}), kv=kv)


def kv_endpoint(prefill) -> str:
    """Where a prefill service's KV handles point (what a router lists to decode workers)."""
    return f"{prefill.config.public_host}:{prefill.port}"


@contextlib.asynccontextmanager
async def services(model_dir, backend: str = "tcp", prefill_engine: dict | None = None,
                   decode_engine: dict | None = None, lease_ttl_s: float = 30.0,
                   transfer_timeout_s: float = 5.0, kv_blocks: int = 64):
    from decode_svc.service import DecodeService
    from prefill_svc.service import PrefillService

    times = {"lease_ttl_s": lease_ttl_s, "transfer_timeout_s": transfer_timeout_s}
    p = PrefillService(worker_config(model_dir, backend, prefill_engine, kv_blocks=kv_blocks,
                                     **times))
    d = DecodeService(worker_config(model_dir, backend, decode_engine, kv_blocks=kv_blocks,
                                    **times))
    await p.start()
    await d.start()
    d.kv_peers = KVPeerList((kv_endpoint(p),))  # as a router would push
    pch = auth_channel(f"127.0.0.1:{p.port}", p.secret)
    dch = auth_channel(f"127.0.0.1:{d.port}", d.secret)
    try:
        yield p, d, prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
    finally:
        await pch.close()
        await dch.close()
        await p.stop(0)
        await d.stop(0)


@contextlib.asynccontextmanager
async def prefill_worker(model_dir, backend: str = "tcp", lease_ttl_s: float = 30.0):
    """One more prefill worker (tests with several sources): the service and its stub."""
    from prefill_svc.service import PrefillService

    p = PrefillService(worker_config(model_dir, backend, lease_ttl_s=lease_ttl_s))
    await p.start()
    ch = auth_channel(f"127.0.0.1:{p.port}", p.secret)
    try:
        yield p, prefill_pb2_grpc.PrefillStub(ch)
    finally:
        await ch.close()
        await p.stop(0)


async def leak_check(*svcs) -> None:
    """No lease held, no request held, every block free or cached."""
    for _ in range(100):  # releases travel asynchronously: give them a moment
        if all(getattr(s, "leases", None) is None or s.leases.active() == 0 for s in svcs):
            break
        await asyncio.sleep(0.02)
    for s in svcs:
        if getattr(s, "leases", None) is not None:
            assert s.leases.active() == 0, f"{s.worker_id} still holds leases"
        await asyncio.sleep(0.05)
        await s.engine.leak_check()


def prompt_ids(n: int, seed: int) -> list[int]:
    """n token ids of the tiny model's vocabulary, a different prompt per seed."""
    return [(seed * 31 + i * 7) % 300 + 3 for i in range(n)]


async def until(check, what: str, bound_s: float = 60.0) -> float:
    """Wait until check() is true, polling every 20 ms; the seconds it took. A failure
    naming ``what`` after bound_s."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 >= bound_s:
            raise AssertionError(f"gave up waiting after {bound_s:.0f} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def sampling(max_tokens: int = 8, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=kw.pop("temperature", 0),
                                     ignore_eos=kw.pop("ignore_eos", True), **kw)


async def generate(dstub, rid: str, prompt: list[int], outputs: list[int], sp,
                   handle=None) -> tuple[list[int], list]:
    req = decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                     output_token_ids=outputs, sampling=sp)
    if handle is not None:
        req.kv_handle.CopyFrom(handle)
    toks, chunks = list(outputs), []
    async for ch in dstub.Generate(req):
        toks += list(ch.token_ids)
        chunks.append(ch)
    return toks, chunks


async def generate_after(dstub, rid: str, prompt: list[int], max_tokens: int, first=None,
                         **fields) -> tuple[list[int], object]:
    """(tokens, the first chunk's trace) of a greedy Generate; first: the Prefill reply
    whose first token and handle it continues from (None: colocated); fields: the
    GenerateRequest's others (lora_name, kv_policy)."""
    req = decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                     sampling=sampling(max_tokens), **fields)
    toks = []
    if first is not None:
        req.output_token_ids.append(first.first_token)
        req.kv_handle.CopyFrom(first.kv_handle)
        toks.append(first.first_token)
    chunks = [c async for c in dstub.Generate(req)]
    return toks + [t for c in chunks for t in c.token_ids], chunks[0].trace


async def disagg(pstub, dstub, rid: str, prompt: list[int], sp) -> tuple[list[int], list]:
    r = await pstub.Prefill(prefill_pb2.PrefillRequest(request_id=rid, token_ids=prompt,
                                                       sampling=sp))
    return await generate(dstub, rid, prompt, [r.first_token], sp, r.kv_handle)


async def refused_handoff(pstub, dstub, rid: str, prompt: list[int]) -> str:
    """Prefill, then a Generate that the decode worker must refuse at connect time
    (FAILED_PRECONDITION); the router's Abort then drops the prefill side's lease.
    Returns the refusal's details."""
    r = await pstub.Prefill(prefill_pb2.PrefillRequest(request_id=rid, token_ids=prompt,
                                                       sampling=sampling()))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(dstub, rid, prompt, [r.first_token], sampling(), r.kv_handle)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await pstub.Abort(common_pb2.AbortRequest(request_id=rid))
    return e.value.details()


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """Colocated greedy reference on the same tiny model."""
    from engine.llm_engine import LLMEngine
    from core.sampling import SamplingParams

    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                           max_model_len=256))

    def run(prompt: list[int], max_tokens: int = 8, **kw) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=kw.pop("temperature", 0),
                                ignore_eos=True, **kw)
        return eng.generate([prompt], params)[0].token_ids

    return run
