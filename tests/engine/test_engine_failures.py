"""What the engine does when something goes wrong: a step that raises fails its
requests and the engine serves on; a duplicate id is refused where requests are
admitted; an engine thread that dies fails everything waiting on it; the remote
admission path yields to priorities, holds an abort until the pull ends, and counts
evictable prefix hits when it preempts."""
from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.aborts import AbortMemory
from engine.request import (AbortedBeforeArrival, DuplicateRequestError, FinishReason,
                            RequestStatus)
from engine.engine_thread import EngineDead, EngineWorker
from core.sampling import SamplingParams
from kvtransfer.decode_connector import DecodeConnector
from kvtransfer.lease import LeaseTable
from kvtransfer.prefill_connector import PREFILL_ONLY, PrefillConnector

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _engine(model_dir, connector=None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 128)
    return LLMEngine(EngineConfig.from_flat(model=str(model_dir), dtype="float32", **kw),
                     connector=connector)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 13 + j * 7) % 300 + 3 for j in range(n)]


def _drain(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def test_a_scheduling_failure_fails_requests_not_the_engine(tiny_model_dir, monkeypatch) -> None:
    eng = _engine(tiny_model_dir)
    want = eng.generate([_prompt(20)], GREEDY)[0].token_ids
    eng.add_request(_prompt(20, 1), GREEDY, request_id="victim")
    real = eng.scheduler.schedule
    calls = iter([RuntimeError("injected")])

    def schedule():
        err = next(calls, None)
        if err is not None:
            raise err
        return real()
    monkeypatch.setattr(eng.scheduler, "schedule", schedule)
    outs = eng.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [
        ("victim", FinishReason.ERROR, True)]
    assert "injected" in outs[0].error
    eng.leak_check()
    assert eng.generate([_prompt(20)], GREEDY)[0].token_ids == want  # serves on
    eng.leak_check()


def test_a_forward_failure_fails_only_that_batch(tiny_model_dir, monkeypatch) -> None:
    eng = _engine(tiny_model_dir)
    eng.add_request(_prompt(20, 2), GREEDY, request_id="a")
    monkeypatch.setattr(eng.runner, "execute", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("boom")))
    outs = eng.step()
    assert outs[0].finish_reason is FinishReason.ERROR and "boom" in outs[0].error
    monkeypatch.undo()
    assert eng.generate([_prompt(20, 2)], GREEDY)[0].finish_reason is FinishReason.LENGTH
    eng.leak_check()


def test_duplicate_ids_are_refused_at_admission(tiny_model_dir) -> None:
    conn = PrefillConnector(LeaseTable(), 30.0)
    eng = _engine(tiny_model_dir, conn)
    eng.add_request(_prompt(20), GREEDY, request_id="same")
    with pytest.raises(DuplicateRequestError, match="same"):
        eng.add_request(_prompt(24), GREEDY, request_id="same")
    _drain(eng)
    # a finished prefill holding its blocks for a handoff still owns the id
    eng.add_request(_prompt(20), GREEDY, request_id="held", kv_transfer=PREFILL_ONLY)
    _drain(eng)
    assert "held" in conn.held
    with pytest.raises(DuplicateRequestError):
        eng.add_request(_prompt(20), GREEDY, request_id="held")
    assert eng.abort("held", owner=True) is None and not conn.held
    eng.leak_check()


def test_an_abort_that_overtakes_its_request_refuses_it(tiny_model_dir) -> None:
    """Chaos run 22: the router's Abort reached the prefill worker before the Prefill
    it had cancelled, which then ran and leased its blocks to nobody for the lease's
    30 s. An Abort of an unknown id is remembered; the request arriving under it is
    refused, once; an Abort just after a request ended is not remembered."""
    conn = PrefillConnector(LeaseTable(), 30.0)
    eng = _engine(tiny_model_dir, conn)
    assert eng.abort("early", owner=True) is None
    with pytest.raises(AbortedBeforeArrival, match="'early' was aborted before it arrived"):
        eng.add_request(_prompt(20), GREEDY, request_id="early", kv_transfer=PREFILL_ONLY)
    assert not eng.requests and not conn.held and not eng.has_unfinished()
    eng.add_request(_prompt(20), GREEDY, request_id="early")  # the memory is used up
    eng.add_request(_prompt(20), GREEDY, request_id="done")
    _drain(eng)
    assert eng.abort("done") is None  # a late Abort of a finished request
    eng.add_request(_prompt(20), GREEDY, request_id="done")  # the id may be reused
    _drain(eng)
    eng.add_request(_prompt(20), GREEDY, request_id="held", kv_transfer=PREFILL_ONLY)
    _drain(eng)
    conn.free("held")
    eng.abort("held")  # late, after the handoff ended
    eng.add_request(_prompt(20), GREEDY, request_id="held", kv_transfer=PREFILL_ONLY)
    _drain(eng)
    conn.free("held")
    assert len(eng.aborts) == 0
    eng.leak_check()


def test_the_memory_of_early_aborts_is_bounded_in_time_and_size() -> None:
    now = [0.0]
    mem = AbortMemory(remember_s=60.0, capacity=3, clock=lambda: now[0])
    mem.aborted_unknown("old")
    now[0] = 61.0
    mem.check_admission("old")  # too late to be the same request: served
    for rid in ("a", "b", "c", "d"):
        mem.aborted_unknown(rid)
    assert len(mem) == 3
    mem.check_admission("a")  # the oldest went first
    with pytest.raises(AbortedBeforeArrival):
        mem.check_admission("d")
    for i in range(5):
        mem.ended(f"e{i}")
    mem.aborted_unknown("e0")  # forgotten as ended (capacity 3): remembered as early
    mem.aborted_unknown("e4")  # just ended: not remembered
    with pytest.raises(AbortedBeforeArrival):
        mem.check_admission("e0")
    mem.check_admission("e4")


def test_bad_resumed_output_ids_are_refused(tiny_model_dir) -> None:
    eng = _engine(tiny_model_dir)
    with pytest.raises(ValueError, match="output_token_ids"):
        eng.make_request(_prompt(20), GREEDY, "r", output_token_ids=[10**9])
    with pytest.raises(ValueError, match="priority"):
        eng.make_request(_prompt(20), GREEDY, "r", priority=2**40)


def test_an_abort_mid_pull_waits_for_the_pull(tiny_model_dir) -> None:
    """Finding 11: an Abort that arrives while bytes are being pulled into a request's
    blocks must not free them; the request finishes when the pull ends."""
    conn = DecodeConnector()
    eng = _engine(tiny_model_dir, conn)
    prompt = _prompt(40, 3)
    req = eng.make_request(prompt + [7], GREEDY, "remote")
    conn.add_remote(eng, req, len(prompt))
    eng.step()
    (grant,) = conn.take_grants()
    free_before = eng.kv.pool.num_free
    assert eng.abort("remote") is None  # deferred: a pull may be writing
    assert req.status is RequestStatus.WAITING_FOR_KV
    assert eng.kv.pool.num_free == free_before  # nothing freed under the pull
    out = eng.finish_loading("remote", loaded=True)
    assert out.finish_reason is FinishReason.ABORT
    eng.leak_check()


def test_remote_admission_preempts_past_evictable_prefix_hits(tiny_model_dir) -> None:
    """Finding 11: the reservation used to stop preempting as soon as num_free reached
    the blocks it needed, counting free-but-cached prefix blocks it then adopted; the
    allocation failed and the reservation never happened."""
    conn = DecodeConnector()
    eng = _engine(tiny_model_dir, conn, num_kv_blocks=12, max_model_len=64,
                  preemption_mode="recompute", swap_space=0.0)
    shared = _prompt(32, 4)  # 2 full blocks, cached once this runs
    eng.generate([shared + [9]], SamplingParams(max_tokens=1))
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(3):
        eng.add_request(_prompt(16, 10 + i), long, request_id=f"low{i}", priority=5)
    for _ in range(20):  # the three low ones now hold all the non-cached blocks
        eng.step()
    # free: 2 cached (evictable) prefix blocks + 1; urgent adopts the 2 and needs 2 more
    assert eng.kv.pool.num_free == 3
    req = eng.make_request(shared + _prompt(30, 5), GREEDY, "urgent", priority=0)
    conn.add_remote(eng, req, len(shared) + 29, preempt_lower=True)
    eng.step()
    grants = conn.take_grants()
    assert [g.request_id for g in grants] == ["urgent"]
    assert grants[0].local_cached_tokens == 32
    assert sum(eng.stats.preemptions.values()) >= 1
    eng.finish_loading("urgent", loaded=False)  # recompute the rest here
    _drain(eng)
    eng.leak_check()


def test_priority_cap_advances_every_lower_row_in_turn(tiny_model_dir) -> None:
    """Finding 11: with --priority-batch-cap, the same two oldest lower rows advanced
    while the others froze until the best class finished."""
    eng = _engine(tiny_model_dir, priority_batch_cap=1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    eng.add_request(_prompt(8, 20), params, request_id="high", priority=0)
    for i in range(3):
        eng.add_request(_prompt(8, 21 + i), params, request_id=f"low{i}", priority=5)
    eng.step()  # all prefill
    reqs = dict(eng.requests)
    for _ in range(9):
        eng.step()
    advanced = {rid: reqs[rid].num_output_tokens for rid in ("low0", "low1", "low2")}
    assert min(advanced.values()) >= 3, advanced  # each lower row got its turns
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.leak_check()


def test_a_dead_engine_thread_fails_every_waiter(tiny_model_dir, monkeypatch) -> None:
    deaths = []

    async def body():
        worker = EngineWorker(lambda: _engine(tiny_model_dir), on_death=deaths.append)
        await worker.start()
        req = await worker.make_request(_prompt(20), GREEDY, "r")

        def die(self):
            raise SystemError("injected: the step loop itself broke")
        monkeypatch.setattr(LLMEngine, "step", die)
        q = await worker.add(req)
        out = await asyncio.wait_for(q.get(), 10)
        assert out.finished and out.finish_reason is FinishReason.ERROR
        assert "engine thread died" in out.error
        assert not worker.alive
        with pytest.raises(EngineDead):
            await worker.add(await worker.make_request(_prompt(20), GREEDY, "late"))
        with pytest.raises(EngineDead):
            await worker.cached_hashes()
        worker.stop()
    asyncio.run(asyncio.wait_for(body(), 60))
    assert len(deaths) == 1 and isinstance(deaths[0], SystemError)


def test_a_command_that_kills_the_thread_fails_its_own_caller(tiny_model_dir) -> None:
    """A command that raises a BaseException (a tensor-parallel group's GroupFailed in a KV
    export) ends the engine thread; its caller, already off the command queue, gets
    EngineDead at once instead of waiting forever."""
    from engine.parallel.group import GroupFailed

    async def body():
        worker = EngineWorker(lambda: _engine(tiny_model_dir))
        await worker.start()

        def fail(engine):
            raise GroupFailed("injected: rank 1 is gone")
        with pytest.raises(EngineDead, match="GroupFailed: injected"):
            await asyncio.wait_for(worker.run(fail), 10)
        assert not worker.alive
        worker.stop()
    asyncio.run(asyncio.wait_for(body(), 60))
