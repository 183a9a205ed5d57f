"""Prefill and decode workers at --tensor-parallel-size 2 (each a worker process and one
gloo rank process beside it) hand KV to workers at 1 and at 2, over TCP and over NIXL
(whose one-sided READs go through rank 0's mirror of the pool): a prompt
prefilled on one side and decoded on the other gets exactly the greedy tokens of a
colocated engine at TP 1, for P 2 -> D 1, P 1 -> D 2 and P 2 -> D 2; the decode side's
`tandem:kv_transfer_bytes_total` grows by exactly the bytes of every KV head of the
blocks moved; both sides end idle with no block, request or lease held. A decode worker
whose model has other head numbers refuses the KV at connect time, naming both layouts.

One set of workers serves the module per backend: the two TP-2 workers are processes
started once (this process can be rank 0 of one group only, and stays out of any); the
TP-1 workers run in this process, started by the test that needs them."""
from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from auth.grpc_auth import channel as auth_channel
from auth.secret import load_cluster_secret
from core.sampling import SamplingParams
from decode_svc.peers import KVPeerList
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from proto import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.cluster.launch import Cluster, Proc, _spawn
from tests.services.conftest import (generate_after, leak_check, prefill_worker,
                                     refused_handoff, sampling, worker_config)
from tests.models.conftest import checkpoint  # noqa: F401 - the shared checkpoint fixture
from tests.models.families import build_checkpoint

BLOCK = 8
NEW_TOKENS = 10
SHAPES = [[5 + i % 50 for i in range(19)], [7 + 3 * i % 90 for i in range(33)]]
"""Prompts of 3 and 5 blocks, the last partial."""
DIRECTIONS = ("p2d1", "p1d2", "p2d2")
"""Each hands off its own prompts (SHAPES shifted), so none finds another's in a cache."""


def prompts(tag: str) -> list[list[int]]:
    return [[t + DIRECTIONS.index(tag) for t in p] for p in SHAPES]
ENGINE = {"dtype": "float32", "quantization": "none", "block_size": BLOCK, "max_model_len": 256,
          "attention_backend": "sdpa", "compile": False}
FLAGS = ["--dtype", "float32", "--quantization", "none", "--block-size", str(BLOCK),
         "--max-model-len", "256", "--attention-backend", "sdpa", "--no-compile",
         "--kv-blocks", "64", "--tensor-parallel-size", "2"]
LAYERS, KV_HEADS, HEAD_DIM, FP32 = 2, 2, 16, 4
"""The small random Llama's (tests/models/families.py: 4 query heads of 16, 2 KV heads)."""


def head_bytes(blocks: int) -> int:
    """Bytes of every KV head of ``blocks`` blocks, K and V, every layer, fp32."""
    return blocks * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * FP32


@pytest.fixture(scope="module")
def model(checkpoint):  # noqa: F811
    return checkpoint("llama")


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def backend(request) -> str:
    """--kv-transfer of every worker of the module."""
    return request.param


@pytest.fixture(scope="module")
def tp2(model, backend):
    """A prefill and a decode worker at TP 2 (processes): role -> Proc."""
    c = Cluster()
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for role in ("prefill", "decode"):
            ready = Path(tmp) / role
            procs[role] = Proc(role, _spawn([
                role, "--model", str(model), "--port", "0", "--metrics-port", "0",
                "--ready-file", str(ready), "--kv-transfer", backend, "--num-threads", "1",
                *FLAGS]))
            procs[role].ready = ready
        c.prefill, c.decode = [procs["prefill"]], [procs["decode"]]
        try:
            deadline = time.monotonic() + 240
            for proc in procs.values():
                while not proc.ready.exists():
                    assert proc.popen.poll() is None, f"the TP-2 {proc.role} worker died"
                    assert time.monotonic() < deadline, f"the TP-2 {proc.role} worker not ready"
                    time.sleep(0.1)
                proc.addr, port = proc.ready.read_text().split()
                proc.metrics_port = int(port)
            yield c
        finally:
            for proc in procs.values():
                proc.kill()


@pytest.fixture(scope="module")
def colocated(model):
    eng = LLMEngine(EngineConfig.from_flat(model=str(model), num_kv_blocks=64, **ENGINE))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    want = {tag: [o.token_ids for o in eng.generate(prompts(tag), params)] for tag in DIRECTIONS}
    assert all(len(set(t)) > 3 for ts in want.values() for t in ts), want  # tokens that tell
    return want


def bytes_moved(metrics_text: str) -> float:
    """tandem:kv_transfer_bytes_total in a /metrics page."""
    return sum(s.value for f in text_string_to_metric_families(metrics_text)
               for s in f.samples if s.name == "tandem:kv_transfer_bytes_total")


@contextlib.asynccontextmanager
async def tp1_worker(role: str, model_dir, backend: str):
    """A prefill or decode worker at TP 1 in this process, with the module's flags."""
    from decode_svc.service import DecodeService
    from prefill_svc.service import PrefillService

    svc = (PrefillService if role == "prefill" else DecodeService)(
        worker_config(model_dir, backend, ENGINE))
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop(0)


async def handoffs(pstub, dstub, tag: str) -> list[tuple[list[int], object]]:
    """Each prompt prefilled on pstub's worker and decoded on dstub's: (tokens, trace)."""
    out = []
    for i, prompt in enumerate(prompts(tag)):
        rid = f"{tag}-{i}"
        first = await pstub.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, token_ids=prompt, sampling=sampling(NEW_TOKENS)))
        out.append(await generate_after(dstub, rid, prompt, NEW_TOKENS, first))
    return out


def check(results, want: list[list[int]], moved: float) -> None:
    """Tokens equal the colocated run's; every prompt block came over (none cached on
    the decode side), and the bytes counted are exactly their heads' bytes."""
    assert [toks for toks, _ in results] == want
    blocks = [-(-len(p) // BLOCK) for p in SHAPES]
    assert [t.blocks_pulled for _, t in results] == blocks
    assert [t.bytes_pulled for _, t in results] == [head_bytes(b) for b in blocks]
    assert moved == head_bytes(sum(blocks))


def stubs(c: Cluster, proc: Proc):
    ch = auth_channel(proc.addr, load_cluster_secret(None))
    return ch, (prefill_pb2_grpc.PrefillStub if proc.role == "prefill"
                else decode_pb2_grpc.DecodeStub)(ch)


def test_p2_to_d1(tp2, colocated, model, backend) -> None:
    async def body():
        ch, pstub = stubs(tp2, tp2.prefill[0])
        async with tp1_worker("decode", model, backend) as d:
            d.kv_peers = KVPeerList((tp2.prefill[0].addr,))
            dch = auth_channel(f"127.0.0.1:{d.port}", d.secret)
            results = await handoffs(pstub, decode_pb2_grpc.DecodeStub(dch), "p2d1")
            check(results, colocated["p2d1"],
                  bytes_moved(generate_latest(d.metrics.registry).decode()))
            await leak_check(d)
            await dch.close()
        await ch.close()
    asyncio.run(body())
    tp2.leak_check()


def test_p1_to_d2_and_p2_to_d2(tp2, colocated, model, backend) -> None:
    async def body():
        ch, dstub = stubs(tp2, tp2.decode[0])
        pch, p2stub = stubs(tp2, tp2.prefill[0])
        async with tp1_worker("prefill", model, backend) as p:
            await dstub.SetKVPeers(decode_pb2.KVPeers(
                router_id="test", prefill_endpoints=[f"127.0.0.1:{p.port}",
                                                     tp2.prefill[0].addr]))
            before = bytes_moved(tp2.metrics(tp2.decode[0]))
            pc = auth_channel(f"127.0.0.1:{p.port}", p.secret)
            results = await handoffs(prefill_pb2_grpc.PrefillStub(pc), dstub, "p1d2")
            check(results, colocated["p1d2"], bytes_moved(tp2.metrics(tp2.decode[0])) - before)
            await leak_check(p)
            await pc.close()
        before = bytes_moved(tp2.metrics(tp2.decode[0]))
        check(await handoffs(p2stub, dstub, "p2d2"), colocated["p2d2"],
              bytes_moved(tp2.metrics(tp2.decode[0])) - before)
        await ch.close()
        await pch.close()
    asyncio.run(body())
    tp2.leak_check()


def test_other_head_numbers_are_refused_naming_both_layouts(tp2, tmp_path, backend) -> None:
    """A decode worker whose model has 4 KV heads (of 16) against the TP-2 prefill
    group's 2: refused at connect time; the reason gives both sides' numbers."""
    other = build_checkpoint(tmp_path, "llama", num_key_value_heads=4)

    async def body():
        ch, pstub = stubs(tp2, tp2.prefill[0])
        async with tp1_worker("decode", other, backend) as d:
            d.kv_peers = KVPeerList((tp2.prefill[0].addr,))
            dch = auth_channel(f"127.0.0.1:{d.port}", d.secret)
            why = await refused_handoff(pstub, decode_pb2_grpc.DecodeStub(dch), "heads",
                                        SHAPES[0])
            await leak_check(d)
            await dch.close()
        await ch.close()
        return why
    why = asyncio.run(body())
    assert "num_kv_heads: local 4 != remote 2" in why, why
    assert ("head layouts cannot be mapped: local 4 KV heads x head_dim 16 on one rank, "
            "remote 2 KV heads x head_dim 16 over TP 2 (ranks hold [0] [1])") in why, why
    tp2.leak_check()



@pytest.mark.parametrize("how", ["fails", "cancelled"])
def test_a_prefill_whose_staging_fails_or_is_cancelled_keeps_nothing(model, how: str) -> None:
    """A NIXL source serving a group stages a request's blocks before its handle leaves
    (kvtransfer/nixl.py). Staging that fails answers UNAVAILABLE naming it; a caller that
    goes away while it runs: either way the lease and the blocks go (played on a TP-1
    worker whose source is told it stages)."""
    async def body():
        async with prefill_worker(model) as (p, stub):
            started, gate = threading.Event(), threading.Event()

            def stage(ids):
                started.set()
                gate.wait(10)
                if how == "fails":
                    raise RuntimeError("the engine has stopped")

            p.source.stages, p.source.stage = True, stage
            call = stub.Prefill(prefill_pb2.PrefillRequest(
                request_id="staged", token_ids=SHAPES[0], sampling=sampling(NEW_TOKENS)))
            if how == "fails":
                gate.set()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert e.value.details() == (
                    "request staged: the prefill group could not stage its KV for the decode "
                    "worker: the engine has stopped")
            else:
                while not started.is_set():
                    await asyncio.sleep(0.01)
                assert p.leases.active() == 1
                call.cancel()
                deadline = time.monotonic() + 10
                while p.leases.active():  # dropped while the staging still blocks
                    assert time.monotonic() < deadline, "the lease outlived its caller"
                    await asyncio.sleep(0.01)
                gate.set()
            await leak_check(p)
    asyncio.run(body())
