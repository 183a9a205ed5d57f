"""The two KV connectors the services plug into their engines, driven through the engine
thread as the services drive them: the prefill side leases a finished prefill's blocks
in the moment it keeps them and ends the lease in the moment they are freed; the decode
side hands each reservation to the one caller waiting for it."""
from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.engine_thread import EngineWorker
from engine.llm_engine import LLMEngine
from engine.request import DuplicateRequestError
from core.sampling import SamplingParams
from kvtransfer.decode_connector import DecodeConnector
from kvtransfer.lease import LeaseTable
from kvtransfer.prefill_connector import PREFILL_ONLY, PrefillConnector

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7 + j * 3) % 300 + 3 for j in range(n)]


async def _worker(model_dir, make_connector) -> tuple[EngineWorker, object]:
    holder: dict = {}
    worker = EngineWorker(lambda: LLMEngine(
        EngineConfig.from_flat(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=128),
        connector=holder["connector"]))
    holder["connector"] = make_connector(worker)
    await worker.start()
    return worker, holder["connector"]


def test_a_lease_lives_exactly_as_long_as_its_held_blocks(tiny_model_dir) -> None:
    leases = LeaseTable()

    async def body():
        worker, conn = await _worker(tiny_model_dir,
                                     lambda w: PrefillConnector(leases, 30.0, w))
        try:
            req = await worker.make_request(_prompt(40), GREEDY, "p")
            req.kv_transfer = PREFILL_ONLY
            out = await asyncio.wait_for((await worker.add(req)).get(), 30)
            assert out.finished and out.finish_reason is None and len(out.new_token_ids) == 1
            assert list(leases.get("p").block_ids) == out.kept_blocks == conn.held["p"]
            assert (await worker.run(lambda e: e.load())).num_kept == 1
            assert await conn.release("p") and leases.get("p") is None
            assert not await conn.release("p")  # once
            req = await worker.make_request(_prompt(40, 1), GREEDY, "q")
            req.kv_transfer = PREFILL_ONLY
            await asyncio.wait_for((await worker.add(req)).get(), 30)
            assert leases.get("q") is not None
            assert await worker.abort("q")  # an abort frees the held blocks and ends the lease
            assert leases.get("q") is None and leases.active() == 0
            await worker.leak_check()
        finally:
            worker.stop()
    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_reservation_goes_to_its_one_caller(tiny_model_dir) -> None:
    async def body():
        worker, conn = await _worker(tiny_model_dir, DecodeConnector)
        try:
            prompt = _prompt(40, 2) + [7]
            first = await worker.make_request(prompt, GREEDY, "d")
            second = await worker.make_request(prompt, GREEDY, "d")
            waiting = asyncio.ensure_future(conn.reserve(first, 40, False))
            await asyncio.sleep(0)  # it waits for its blocks: a second caller is refused
            with pytest.raises(DuplicateRequestError, match="'d'"):
                await conn.reserve(second, 40, False)
            res, q = await asyncio.wait_for(waiting, 30)
            with pytest.raises(DuplicateRequestError, match="'d'"):
                await conn.reserve(second, 40, False)  # and once it has them
            assert res.request_id == "d" and res.local_cached_tokens == 0
            assert [i for i, _ in res.fill] == [0, 1, 2]  # 40 tokens: blocks 0-2 pulled
            await conn.end_pull("d", kv_arrived=False)  # recomputed here
            outs = [await asyncio.wait_for(q.get(), 30)]
            while not outs[-1].finished:
                outs.append(await asyncio.wait_for(q.get(), 30))
            assert sum(len(o.new_token_ids) for o in outs) == 4
            worker.close_stream("d")
            # a caller that goes away before its blocks come leaves nothing behind
            gone = asyncio.ensure_future(conn.reserve(
                await worker.make_request(prompt, GREEDY, "g"), 40, False))
            await asyncio.sleep(0)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            for _ in range(100):
                if not (await worker.run(lambda e: e.has_request("g"))):
                    break
                await asyncio.sleep(0.05)
            await worker.leak_check()
        finally:
            worker.stop()
    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_pulled_request_preempted_by_recompute_is_recomputed_here(tiny_model_dir) -> None:
    """Once its pull ended, a decode-side request is this engine's: preempted by recompute
    (its KV dropped), it is recomputed here and runs to its end. It was admitted as a
    remote load a second time: a reservation nobody waits for, and a worker would abort
    the request mid-stream."""
    conn = DecodeConnector()
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(tiny_model_dir), dtype="float32", num_kv_blocks=5, max_model_len=64,
        preemption_mode="recompute", swap_space=0.0), connector=conn)
    req = eng.make_request(_prompt(40, 1), SamplingParams(max_tokens=20, ignore_eos=True),
                           "remote", priority=5)
    conn.add_remote(eng, req, 39)
    eng.step()
    assert [g.request_id for g in conn.take_grants()] == ["remote"]
    eng.finish_loading("remote", loaded=True)
    outs = [o for _ in range(3) for o in eng.step()]
    eng.add_request(_prompt(50, 2), GREEDY, request_id="urgent", priority=0)
    while eng.has_unfinished():
        outs += eng.step()
        assert conn.take_grants() == []
    mine = [o for o in outs if o.request_id == "remote"]
    assert eng.stats.preemptions and mine[-1].finished
    assert (mine[-1].finish_reason.value, sum(len(o.new_token_ids) for o in mine)) == ("length", 20)
    eng.leak_check()
    conn.leak_check()


def test_a_reservation_failed_by_the_engine_s_death_is_not_left_unread() -> None:
    """The engine dies while a reservation is admitted: engine_stopped fails its future and
    the admission raises the same error to the caller. The future is then read, so asyncio
    logs no 'Future exception was never retrieved' (it did when a TP group lost a rank)."""
    import gc
    from types import SimpleNamespace

    from engine.engine_thread import EngineDead

    unread: list[dict] = []

    async def body():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unread.append(ctx))

        async def add(req):  # the engine thread dies during the admission
            connector.engine_stopped(EngineDead("the engine thread died"))
            raise EngineDead("the engine thread died")
        connector = DecodeConnector(SimpleNamespace(add=add))
        req = SimpleNamespace(request_id="r", token_ids=_prompt(20), kv_transfer=None)
        with pytest.raises(EngineDead):
            await connector.reserve(req, 16, False)
        gc.collect()
    asyncio.run(body())
    assert not unread, unread
