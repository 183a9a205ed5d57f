"""The router knows each worker's KV tiers (docs/kv-offload.md): the index keeps the
tier per worker and block from the workers' events, placement scores a device hit
above a host hit above a disk hit above a miss against load, and the trace and usage
say which tier served a hit. Unit level on the index and placer, the flow with fake
decode workers, and real worker and router processes on the tiny model."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from core.kv import hash_token_blocks
from core.sampling import SamplingParams
from proto import decode_pb2, decode_pb2_grpc
from router.config import RouterConfig
from router.flow import RequestFlow
from router.http.render import usage
from router.placement import Placer
from router.prefix_index import PrefixIndex, Tier
from router.trace import Trace
from router.workers import Worker
from tests.cluster.launch import cluster
from tests.router.test_flow import FakeDecode, FakePool, Tok

H = [bytes([i]) * 32 for i in range(1, 6)]  # a prompt's 5 leading block hashes


def _workers(n: int) -> list[Worker]:
    return [Worker(f"127.0.0.1:{7000 + i}", "decode", None, None) for i in range(n)]


def _holding(index: PrefixIndex, w: Worker, tier: Tier, n: int = 4) -> None:
    for h in H[:n]:
        index.stored(w.address, h, tier)


def test_a_host_hit_wins_over_a_miss_and_a_device_hit_over_a_host_hit() -> None:
    for a_tier, b_tier, winner in [(Tier.HOST, None, 0), (None, Tier.HOST, 1),
                                   (Tier.DEVICE, Tier.HOST, 0), (Tier.HOST, Tier.DEVICE, 1),
                                   (Tier.HOST, Tier.DISK, 0), (Tier.DISK, None, 0)]:
        index, ws = PrefixIndex(), _workers(2)
        for w, tier in zip(ws, (a_tier, b_tier)):
            if tier is not None:
                _holding(index, w, tier)
        w, reported = Placer("prefix", index).choose(ws, H)
        assert w is ws[winner], (a_tier, b_tier)
        assert reported == 4


def test_a_block_moved_down_is_a_host_hit_and_gone_from_every_tier_is_a_miss() -> None:
    """A block in two tiers of one worker counts at its best; REMOVED from one tier
    leaves the others."""
    index, (w,) = PrefixIndex(), _workers(1)
    _holding(index, w, Tier.DEVICE)
    _holding(index, w, Tier.HOST)
    assert index.overlap(w.address, H).by_tier == (4, 0, 0)
    for h in H[:4]:
        index.removed(w.address, h, Tier.DEVICE)  # evicted from the device, kept on host
    assert index.overlap(w.address, H).by_tier == (0, 4, 0)
    index.stored(w.address, H[2], Tier.DISK)
    index.removed(w.address, H[2], Tier.HOST)  # spilled to disk
    assert index.overlap(w.address, H).by_tier == (0, 3, 1)
    index.removed(w.address, H[2], Tier.DISK)  # the chain breaks at block 2
    o = index.overlap(w.address, H)
    assert (o.by_tier, o.reported) == ((0, 2, 0), 2)
    index.drop_worker(w.address)
    assert index.overlap(w.address, H).blocks == 0


def test_load_weighs_against_a_lower_tier_hit() -> None:
    """A host hit of 4 blocks (3.2) outweighs a queue 6 requests longer (3.0), not 7."""
    for inflight, winner in [(6, 0), (7, 1)]:
        index, ws = PrefixIndex(), _workers(2)
        _holding(index, ws[0], Tier.HOST)
        ws[0].inflight = inflight
        assert Placer("prefix", index).choose(ws, H)[0] is ws[winner], inflight


class TieredDecode(FakeDecode):
    """Reports that it served 32 cached prompt tokens, 16 of them from its host tier."""

    async def _stream(self, req):
        yield decode_pb2.GenerateChunk(
            token_ids=[5], finished=True, finish_reason="length",
            trace=decode_pb2.KVTrace(local_cached_tokens=48, local_host_cached_tokens=16,
                                     local_disk_cached_tokens=16))


def test_the_flow_places_on_the_host_tier_and_the_trace_and_usage_say_so() -> None:
    async def body():
        prompt = list(range(70))  # 4 full blocks of 16
        miss, holder = FakeDecode(None), TieredDecode(None)
        workers = [Worker("127.0.0.1:9301", "decode", None, miss, healthy=True),
                   Worker("127.0.0.1:9302", "decode", None, holder, healthy=True)]
        cfg = RouterConfig(local_prefill_threshold=None)
        flow = RequestFlow(cfg, Tok(), FakePool(workers))
        for h in hash_token_blocks(prompt, cfg.block_size, cfg.hash_seed):
            flow.pool.index.stored(workers[1].address, h, Tier.HOST)
        trace = Trace("rid")
        out = [d async for d in flow.run(prompt, SamplingParams(max_tokens=1), 0, "rid",
                                         trace=trace, deadline=time.monotonic() + 10)]
        assert out[-1].finished and (holder.ids, miss.ids) == (["rid-0"], [])
        got = json.loads(trace.json())
        assert (got["predicted_cached_tokens"], got["realized_cached_tokens"],
                got["realized_host_cached_tokens"], got["realized_disk_cached_tokens"]) == \
            (64, 48, 16, 16)
        trace.prompt_tokens = len(prompt)
        assert usage(trace)["prompt_tokens_details"] == {
            "cached_tokens": 48, "cached_tokens_by_tier": {"device": 16, "host": 16, "disk": 16}}
    asyncio.run(body())


BS = 16
PROMPT = [(i * 7) % 300 + 3 for i in range(4 * BS + 5)]  # 4 full blocks + 5 tokens
FILLERS = [[(i * 11 + k * 37) % 300 + 3 for i in range(4 * BS + 5)] for k in range(3)]
TIERED = ["--dtype", "float32", "--kv-blocks", "8", "--max-model-len", "128",
          "--swap-space", "0", "--preemption-mode", "recompute", "--kv-offload-cpu-gib", "0.01"]


def _complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _generate_on(c, proc, rid: str, prompt: list[int]) -> None:
    """Straight to one worker, past the router's placement."""
    with c.channel(proc) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        sp = decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt)
        sp.sampling.max_tokens, sp.sampling.ignore_eos = 2, True
        chunks = list(stub.Generate(sp, timeout=60))
    assert chunks[-1].finished


def _router_sees_idle(url: str, proc, total: int) -> None:
    """Wait until the router's last load report from proc says every block is free (a
    report is pushed at most every 50 ms, after the events of the same step: placing
    before it arrives would weigh a stale mid-run load against the host hit)."""
    want = f'tandem:router_worker_kv_blocks{{state="free",worker="{proc.addr}"}} {float(total)}'
    deadline = time.monotonic() + 30
    while want not in (text := httpx.get(url + "/metrics", timeout=10).text):
        assert time.monotonic() < deadline, [ln for ln in text.splitlines() if "worker_kv" in ln]
        time.sleep(0.05)


def test_two_workers_the_prompt_goes_where_its_host_tier_holds_it(tiny_model_dir, tmp_path) -> None:
    """The prompt ran on one worker, which then ran other prompts (sent to it directly)
    until the prompt's blocks left its device for its host tier. The router sends the
    prompt back there, not to the other (a miss), and usage says the host served it;
    the tokens equal the first run's."""
    log = tmp_path / "requests.jsonl"
    with cluster(tiny_model_dir, "tcp", n_prefill=0, n_decode=2, worker_args=TIERED,
                 router_args=["--log-requests", str(log)]) as c:
        first = _complete(c.url, PROMPT)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        where = json.loads(log.read_text().splitlines()[-1])["decode_worker"]
        holder = next(p for p in c.decode if p.addr in where)
        for k, filler in enumerate(FILLERS):
            _generate_on(c, holder, f"filler-{k}", filler)
        _router_sees_idle(c.url, holder, total=8)
        again = _complete(c.url, PROMPT)
        assert holder.addr in json.loads(log.read_text().splitlines()[-1])["decode_worker"]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 4 * BS, "cached_tokens_by_tier": {"device": 0, "host": 4 * BS,
                                                               "disk": 0}}
        c.leak_check()


async def _walk_becomes(pool, address: str, hashes, want: tuple[int, int, int]) -> tuple:
    """The router's view of the worker's tiers for hashes, once it is ``want`` (bounded)."""
    got = None
    for _ in range(300):
        got = pool.index.overlap(address, hashes).by_tier
        if got == want:
            break
        await asyncio.sleep(0.05)
    return got


def test_a_workers_stream_tells_the_routers_index_each_tier(tiny_model_dir) -> None:
    """A real decode worker with a host tier: its StreamKVEvents reports the prompt's
    blocks on the device, then (evicted by other prompts) on the host, and the router's
    index follows; a reconnecting router's snapshot says host too."""
    from decode_svc.service import DecodeService
    from router.discovery.base import WorkerEndpoint
    from router.workers import WorkerPool
    from tests.services.conftest import generate, leak_check, sampling, worker_config

    async def body():
        engine = dict(max_model_len=128, swap_space=0, preemption_mode="recompute",
                      kv_offload_cpu_gib=0.01)
        d = DecodeService(worker_config(tiny_model_dir, engine=engine, kv_blocks=8))
        await d.start()
        address = f"127.0.0.1:{d.port}"
        hashes = hash_token_blocks(PROMPT, BS, 0)[:4]
        pools = []
        try:
            pool = WorkerPool(d.secret)
            pools.append(pool)
            await pool.apply(frozenset({WorkerEndpoint("decode", address)}))
            stub = pool.workers[0].stub
            await generate(stub, "p", PROMPT, [], sampling(2))
            assert await _walk_becomes(pool, address, hashes, (4, 0, 0)) == (4, 0, 0)
            for k, filler in enumerate(FILLERS):
                await generate(stub, f"f{k}", filler, [], sampling(2))
            assert await _walk_becomes(pool, address, hashes, (0, 4, 0)) == (0, 4, 0)
            late = WorkerPool(d.secret)
            pools.append(late)
            await late.apply(frozenset({WorkerEndpoint("decode", address)}))
            assert await _walk_becomes(late, address, hashes, (0, 4, 0)) == (0, 4, 0)
            await leak_check(d)
        finally:
            for p in pools:
                await p.stop()
            await d.stop(0)
    asyncio.run(body())
