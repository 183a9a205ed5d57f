"""Careless and hostile callers of the worker services, and faults between them:
duplicate and empty ids, cancelled calls at every moment, aborts mid-pull, a
failing pull next to a good one, reservations that must yield, and a router that
must hear about frees. Each test ends with the leak check."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from auth.grpc_auth import channel as auth_channel
from engine.llm_engine import LLMEngine
from kvtransfer.link import KVLinkClient
from proto import common_pb2, decode_pb2, prefill_pb2
from tests.services.conftest import generate, leak_check, prompt_ids, sampling, services

BOUND_S = 30.0  # no call here may take longer: a hang is a failure, not a wait


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture
def slow_steps(monkeypatch):
    """Every engine step takes at least this long: commands queue behind steps, so
    cancellations land while a call waits on the engine thread."""
    def install(seconds: float) -> None:
        orig = LLMEngine.step

        def step(self):
            t0 = time.monotonic()
            out = orig(self)
            time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
            return out
        monkeypatch.setattr(LLMEngine, "step", step)
    return install


async def _prefill(ps, rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0):
    return await ps.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, token_ids=prompt, sampling=sampling(max_tokens), priority=priority),
        timeout=BOUND_S)


async def _handoff(ps, ds, rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0,
                   preempt: bool = False):
    r = await _prefill(ps, rid, prompt, max_tokens, priority)
    req = decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                     output_token_ids=[r.first_token], sampling=sampling(max_tokens),
                                     priority=priority, preempt_lower_priority=preempt)
    req.kv_handle.CopyFrom(r.kv_handle)
    toks, chunks = [r.first_token], []
    async for ch in ds.Generate(req, timeout=BOUND_S):
        toks += list(ch.token_ids)
        chunks.append(ch)
    return toks, chunks


def test_same_id_twice_at_once_is_refused_and_the_engine_lives(tiny_model_dir, reference) -> None:
    """Finding 1: two requests under one id, with the prompt's prefix cached: one is
    refused (ALREADY_EXISTS), the other runs, and the engine keeps serving (before, both
    reached the block allocator and the engine thread died on an assertion)."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            prompt = prompt_ids(40, 1)
            await generate(ds, "warm", prompt, [], sampling(4))  # caches 2 blocks
            results = await asyncio.gather(
                *(asyncio.wait_for(generate(ds, "dup", prompt, [], sampling(8)), BOUND_S)
                  for _ in range(2)), return_exceptions=True)
            ok = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert len(ok) == 1 and len(refused) == 1, results
            assert refused[0].code() == grpc.StatusCode.ALREADY_EXISTS
            assert "dup" in refused[0].details()
            assert ok[0][0] == reference(prompt, 8)
            toks, _ = await asyncio.wait_for(generate(ds, "after", prompt, [], sampling(4)),
                                             BOUND_S)
            assert toks == reference(prompt, 4)
            await leak_check(p, d)
    _run(body())


def test_prefill_refuses_an_id_whose_blocks_are_leased(tiny_model_dir, reference) -> None:
    """Finding 1 (prefill side): a second Prefill under a leased id is refused; it must
    not drop the first request's lease (the first handoff still pulls its KV)."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            prompt = prompt_ids(40, 2)
            first = await _prefill(ps, "x", prompt)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _prefill(ps, "x", prompt)
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
            req = decode_pb2.GenerateRequest(request_id="x", prompt_token_ids=prompt,
                                             output_token_ids=[first.first_token],
                                             sampling=sampling(8))
            req.kv_handle.CopyFrom(first.kv_handle)
            toks, chunks = [first.first_token], []
            async for ch in ds.Generate(req, timeout=BOUND_S):
                toks += list(ch.token_ids)
                chunks.append(ch)
            assert toks == reference(prompt, 8)
            assert chunks[0].trace.fallback == decode_pb2.FALLBACK_REASON_UNSPECIFIED
            assert chunks[0].trace.blocks_pulled > 0
            await leak_check(p, d)
    _run(body())


def test_empty_request_id_is_refused_not_hung(tiny_model_dir) -> None:
    """Finding 11: an empty request id over gRPC is INVALID_ARGUMENT (it hung)."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(_prefill(ps, "", prompt_ids(20, 3)), 10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(generate(ds, "", prompt_ids(20, 3), [], sampling(4)), 10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await leak_check(p, d)
    _run(body())


def test_cancelled_prefills_leave_nothing_held(tiny_model_dir, slow_steps) -> None:
    """Finding 6: Prefill calls cancelled at spread moments (queued behind a step, mid-
    prefill, between the hold and the lease) leave no held block and no lease."""
    slow_steps(0.03)

    async def body():
        async with services(tiny_model_dir, lease_ttl_s=1.0,
                            prefill_engine={"max_num_batched_tokens": 16}) as (p, d, ps, ds):
            busy = asyncio.ensure_future(_prefill(ps, "busy", prompt_ids(150, 4)))
            await asyncio.sleep(0.05)
            for i in range(24):
                call = ps.Prefill(prefill_pb2.PrefillRequest(
                    request_id=f"c{i}", token_ids=prompt_ids(20 + i, 10 + i), sampling=sampling()))
                await asyncio.sleep(0.004 * i)
                call.cancel()
            first = await busy
            await ps.Abort(common_pb2.AbortRequest(request_id="busy"))
            assert first.HasField("kv_handle")
            await asyncio.sleep(1.6)  # any lease of a call cancelled after its grant expires
            await leak_check(p, d)
    _run(body())


def test_a_prefill_cancelled_after_its_lease_frees_it_at_once(tiny_model_dir) -> None:
    """A Prefill call cancelled after the engine granted its lease, before the reply
    reached the caller: nobody will ever Release that handle, so the lease and its blocks
    go when the call ends, not at the lease's expiry (30 s by default: they were held
    that long)."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            at_reply = asyncio.Event()
            checked = p.abort_if_engine_died

            async def hold_the_reply(context, out):  # the last await before the reply
                at_reply.set()
                await asyncio.sleep(5)
                return await checked(context, out)
            p.abort_if_engine_died = hold_the_reply
            call = ps.Prefill(prefill_pb2.PrefillRequest(
                request_id="gone", token_ids=prompt_ids(40, 5), sampling=sampling()))
            await asyncio.wait_for(at_reply.wait(), BOUND_S)
            assert p.leases.active() == 1
            call.cancel()
            t0 = time.monotonic()
            await leak_check(p, d)  # gives a release 2 s
            assert time.monotonic() - t0 < 5
    _run(body())


def test_an_abort_between_the_hold_and_the_reply_leases_nothing(tiny_model_dir) -> None:
    """Chaos run 21: the engine held a finished prefill's blocks and queued its output;
    the router's Abort ran before the Prefill handler woke and freed the blocks; the
    handler then leased the freed blocks (a live lease over blocks others may reuse, and
    the leak audit saw active_leases 1 with every block free). Now the lease is taken
    with the hold on the engine thread and ends with it: the late reply says abort and
    carries no handle."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            deliver, aborts = p.engine._deliver, []

            def abort_first(outs) -> None:  # the Abort overtakes the output on the loop
                if any(o.request_id == "r" and o.kept_blocks for o in outs):
                    async def then():
                        aborts.append(await ps.Abort(common_pb2.AbortRequest(request_id="r")))
                        deliver(outs)
                    asyncio.ensure_future(then())
                else:
                    deliver(outs)
            p.engine._deliver = abort_first
            reply = await _prefill(ps, "r", prompt_ids(40, 9))
            assert [a.aborted for a in aborts] == [True]
            assert reply.finished and reply.finish_reason == "abort"
            assert not reply.HasField("kv_handle")
            assert p.leases.active() == 0
            await leak_check(p, d)
    _run(body())


def test_an_abort_that_overtakes_its_call_leaves_nothing_behind(tiny_model_dir) -> None:
    """Chaos run 22: a client hung up during its Prefill; the router cancelled the call
    and sent Abort, and the worker ran the Abort first (an unknown id: nothing done),
    then the Prefill, whose cancellation had not reached the handler: it leased its
    blocks to nobody until the lease expired 30 s later. Now the late call is refused
    (CANCELLED, naming the id) on either pool, and nothing is held."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            assert not (await ps.Abort(common_pb2.AbortRequest(request_id="gone"))).aborted
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _prefill(ps, "gone", prompt_ids(40, 11))
            assert e.value.code() == grpc.StatusCode.CANCELLED
            assert "'gone' was aborted before it arrived" in e.value.details()
            assert p.leases.active() == 0
            assert not (await ds.Abort(common_pb2.AbortRequest(request_id="gone-d"))).aborted
            req = decode_pb2.GenerateRequest(request_id="gone-d",
                                             prompt_token_ids=prompt_ids(20, 4),
                                             sampling=sampling(8))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in ds.Generate(req, timeout=BOUND_S):
                    pass
            assert e.value.code() == grpc.StatusCode.CANCELLED
            # the next request under the id is served (the memory is used up)
            assert (await _prefill(ps, "gone", prompt_ids(40, 11))).HasField("kv_handle")
            await p.connector.release("gone")
            await leak_check(p, d)
    _run(body())


def test_abort_ends_the_callers_stream(tiny_model_dir, slow_steps) -> None:
    """Finding 11: Abort of a running request ends its Generate stream with
    finish_reason "abort" (the stream used to wait forever)."""
    slow_steps(0.02)

    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            req = decode_pb2.GenerateRequest(request_id="long", prompt_token_ids=prompt_ids(20, 5),
                                             sampling=sampling(200))
            call = ds.Generate(req)
            first = await asyncio.wait_for(call.read(), BOUND_S)
            assert not first.finished
            reply = await ds.Abort(common_pb2.AbortRequest(request_id="long"))
            assert reply.aborted

            async def rest():
                last = first
                while not last.finished:
                    last = await call.read()
                return last
            last = await asyncio.wait_for(rest(), 10)
            assert last.finish_reason == "abort"
            await leak_check(p, d)
    _run(body())


def test_abort_and_cancel_mid_pull_leave_no_stale_state(tiny_model_dir, reference,
                                                        monkeypatch) -> None:
    """Finding 11: an Abort that lands mid-pull, then the caller going away, must not
    leave the id marked (a later request under it was aborted after its pull) nor
    free blocks the pull writes into."""
    gate = asyncio.Event()
    orig = KVLinkClient.pull

    async def gated_pull(self, *args, **kw):
        await gate.wait()
        return await orig(self, *args, **kw)
    monkeypatch.setattr(KVLinkClient, "pull", gated_pull)

    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            prompt = prompt_ids(40, 6)
            task = asyncio.ensure_future(_handoff(ps, ds, "s", prompt))
            await asyncio.sleep(0.3)  # the Generate is now waiting inside its pull
            await ds.Abort(common_pb2.AbortRequest(request_id="s"))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            gate.set()
            await asyncio.sleep(0.3)
            toks, chunks = await _handoff(ps, ds, "s", prompt)
            assert chunks[-1].finish_reason == "length"
            assert toks == reference(prompt, 8)
            await leak_check(p, d)
    _run(body())


def test_a_failed_pull_does_not_break_a_concurrent_one(tiny_model_dir, reference,
                                                       monkeypatch) -> None:
    """Finding 11: one failed pull used to close the KV link that a concurrent pull from
    the same prefill worker was using; over NIXL that pull's Release then failed and its
    prompt was recomputed."""
    release_gate = asyncio.Event()
    orig_pull, orig_release = KVLinkClient.pull, KVLinkClient.release

    async def pull(self, reader, peer, plan, timeout_s=30.0):
        if plan.request_id == "bad":
            await asyncio.sleep(0.2)
            raise RuntimeError("malformed reply (injected)")
        return await orig_pull(self, reader, peer, plan, timeout_s)

    async def release(self, request_id, epoch, token):
        if request_id.startswith("good"):
            await release_gate.wait()
        return await orig_release(self, request_id, epoch, token)
    monkeypatch.setattr(KVLinkClient, "pull", pull)
    monkeypatch.setattr(KVLinkClient, "release", release)

    async def body():
        async with services(tiny_model_dir, backend="nixl") as (p, d, ps, ds):
            good_prompt, bad_prompt = prompt_ids(40, 7), prompt_ids(40, 8)
            good = asyncio.ensure_future(_handoff(ps, ds, "good", good_prompt))
            await asyncio.sleep(0.3)  # "good" has read its blocks and waits to release
            bad_toks, bad_chunks = await _handoff(ps, ds, "bad", bad_prompt)
            assert bad_chunks[0].trace.fallback == decode_pb2.FALLBACK_TRANSFER_FAILED
            release_gate.set()
            toks, chunks = await good
            assert chunks[0].trace.fallback == decode_pb2.FALLBACK_REASON_UNSPECIFIED
            assert chunks[0].trace.blocks_pulled > 0
            assert toks == reference(good_prompt, 8)
            assert bad_toks == reference(bad_prompt, 8)
            await ps.Abort(common_pb2.AbortRequest(request_id="bad"))  # its lease
            await leak_check(p, d)
    _run(body())


def test_a_waiting_reservation_yields_to_a_more_important_request(tiny_model_dir,
                                                                  slow_steps) -> None:
    """Finding 8: a large low-priority handoff that cannot get its blocks must not hold
    up a priority-0 one that fits now (it used to hold a one-at-a-time reservation gate
    across its retries)."""
    slow_steps(0.05)

    async def body():
        async with services(tiny_model_dir, decode_engine={"num_kv_blocks": 12,
                                                           "max_model_len": 128}) as (p, d, ps, ds):
            ends: dict[str, float] = {}

            async def timed(name, coro):
                out = await coro
                ends[name] = time.monotonic()
                return out

            # low holds 7-8 of the 12 blocks for ~27 steps; big (7 blocks) cannot fit
            # until low ends; urgent (2 blocks) fits at once
            low = [asyncio.ensure_future(timed("low", _handoff(
                ps, ds, "low", prompt_ids(100, 20), max_tokens=27, priority=5)))]
            await asyncio.sleep(0.3)
            big = asyncio.ensure_future(timed("big", _handoff(
                ps, ds, "big", prompt_ids(100, 30), max_tokens=8, priority=5)))
            await asyncio.sleep(0.3)
            urgent = await timed("urgent", _handoff(ps, ds, "urgent", prompt_ids(20, 31),
                                                    max_tokens=4, priority=0, preempt=True))
            await asyncio.gather(*low, big)
            assert urgent[1][-1].finish_reason == "length"
            assert ends["urgent"] < min(ends["low"], ends["big"]), ends
            await leak_check(p, d)
    _run(body())


def test_load_is_pushed_when_blocks_are_freed(tiny_model_dir) -> None:
    """Finding 9: with no cache events (prefix caching off), the router still hears that
    a finished request freed its blocks (load only came with store/evict events)."""
    async def body():
        async with services(tiny_model_dir,
                            decode_engine={"enable_prefix_caching": False}) as (p, d, ps, ds):
            stream = ds.StreamKVEvents(common_pb2.KVEventsRequest(subscriber="test"))
            first = await asyncio.wait_for(stream.read(), BOUND_S)
            total = first.load.total_blocks
            await generate(ds, "r", prompt_ids(40, 9), [], sampling(20))
            deadline = time.monotonic() + 5
            seen_busy = False
            while True:
                batch = await asyncio.wait_for(stream.read(), max(0.1, deadline - time.monotonic()))
                seen_busy |= batch.load.free_blocks < total
                if seen_busy and batch.load.free_blocks == total and not batch.load.num_running:
                    break
            stream.cancel()
            await leak_check(p, d)
    _run(body())


def test_snapshot_of_a_large_cache_fits_the_default_message_limit(tiny_model_dir) -> None:
    """Finding 9: the first batch of StreamKVEvents listed every cached block in one
    message; beyond ~110k blocks it exceeded gRPC's 4 MB default and the router could
    never subscribe. It is chunked now, the first chunk marked reset."""
    fakes = [bytes([i % 256, (i >> 8) % 256, (i >> 16) % 256]) * 10 + b"xx"
             for i in range(150_000)]

    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            run = getattr(d.engine, "run", None) or getattr(d.engine, "call")
            await run(lambda e: e.kv.pool.cached.update((h, 0) for h in fakes))
            try:
                async with auth_channel(f"127.0.0.1:{d.port}", d.secret) as ch:
                    from proto import decode_pb2_grpc
                    stream = decode_pb2_grpc.DecodeStub(ch).StreamKVEvents(
                        common_pb2.KVEventsRequest(subscriber="test"))
                    got, batches = 0, []
                    while got < len(fakes):
                        b = await asyncio.wait_for(stream.read(), BOUND_S)
                        batches.append(b)
                        got += len(b.events)
                    stream.cancel()
                assert batches[0].reset and not any(b.reset for b in batches[1:])
                assert max(b.ByteSize() for b in batches) < 4 * 1024 * 1024
            finally:
                await run(lambda e: [e.kv.pool.cached.pop(h, None) for h in fakes])
            await leak_check(p, d)
    _run(body())
