"""Preemption under a small KV pool: swap-to-host and recompute give exactly the
unconstrained outputs; priorities are respected; both pools end empty."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from core.sampling import SamplingParams
from core.states import PreemptionMode

PROMPT_LEN, OUT = 20, 40  # 60 tokens = 4 blocks of 16 each: 16 blocks hold 4 requests


def _requests():
    reqs = []
    for i in range(12):
        prompt = [(i * 13 + j * 7) % 300 + 3 for j in range(PROMPT_LEN)]
        seeded = i % 2 == 1
        params = SamplingParams(max_tokens=OUT, ignore_eos=True,
                                temperature=0.9 if seeded else 0.0,
                                seed=100 + i if seeded else None)
        reqs.append((f"r{i}", prompt, params, i % 3))  # priorities 0, 1, 2 mixed
    return reqs


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(model_dir), dtype="float32",
                                            **{"max_model_len": 64, **kw}))


@pytest.fixture(scope="module")
def unconstrained(tiny_model_dir) -> dict[str, list[int]]:
    eng = _engine(tiny_model_dir, num_kv_blocks=256)
    out = {}
    for rid, prompt, params, _ in _requests():  # each alone
        out[rid] = eng.generate([prompt], params)[0].token_ids
    eng.leak_check()
    return out


def _run_tracking_priorities(eng: LLMEngine) -> dict[str, list[int]]:
    """Run all 12 at once; after every step check no request was preempted while a
    less important one kept running."""
    for rid, prompt, params, prio in _requests():
        eng.add_request(prompt, params, request_id=rid, priority=prio)
    reqs = dict(eng.requests)
    while eng.has_unfinished():
        batch_before = {r.request_id for r in eng.scheduler.running}
        eng.step()
        running = eng.scheduler.running
        for r in reqs.values():
            if r.request_id in batch_before and r.status in (RequestStatus.SWAPPED,
                                                            RequestStatus.WAITING):
                worse = [o for o in running if o.sort_key() > r.sort_key()]
                assert not worse, f"{r.request_id} (prio {r.priority}) preempted while " \
                                  f"{[o.request_id for o in worse]} run"
    return {rid: r.output_token_ids for rid, r in reqs.items()}


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_twelve_requests_in_a_four_request_pool(tiny_model_dir, unconstrained, mode) -> None:
    eng = _engine(tiny_model_dir, num_kv_blocks=16, preemption_mode=mode,
                  swap_space=0.01 if mode != "recompute" else 0.0)
    out = _run_tracking_priorities(eng)
    assert out == unconstrained
    total = sum(eng.stats.preemptions.values())
    assert total > 0
    if mode == "swap":
        assert eng.stats.preemptions.get(PreemptionMode.SWAP, 0) > 0
        assert eng.stats.swap_out_bytes > 0 and eng.stats.swap_in_bytes == eng.stats.swap_out_bytes
    if mode == "recompute":
        assert set(eng.stats.preemptions) == {PreemptionMode.RECOMPUTE}
    eng.leak_check()  # device pool, swap pool, tables


def test_full_swap_pool_falls_back_to_recompute(tiny_model_dir, unconstrained) -> None:
    # room for one swapped request's blocks only
    eng = _engine(tiny_model_dir, num_kv_blocks=16, preemption_mode="swap")
    eng.swap.__init__(4)
    out = _run_tracking_priorities(eng)
    assert out == unconstrained
    assert eng.stats.preemptions.get(PreemptionMode.RECOMPUTE, 0) > 0
    eng.leak_check()


def test_high_priority_prompt_runs_between_chunks(tiny_model_dir) -> None:
    eng = _engine(tiny_model_dir, num_kv_blocks=64, max_num_batched_tokens=8)
    long = [5] * 50
    eng.add_request(long, SamplingParams(max_tokens=2), request_id="low", priority=5)
    eng.step()  # first chunk of the long prompt
    eng.add_request([7] * 6, SamplingParams(max_tokens=2), request_id="high", priority=0)
    eng.step()
    low, high = eng.requests["low"], eng.requests["high"]
    assert high.num_computed_tokens == 6  # ran whole, ahead of the next low chunk
    assert low.num_computed_tokens < 16
    while eng.has_unfinished():
        eng.step()
    eng.leak_check()


def test_abort_of_a_swapped_request_frees_its_host_blocks(tiny_model_dir) -> None:
    eng = _engine(tiny_model_dir, num_kv_blocks=16, preemption_mode="swap",
                  swap_space=0.01)
    for rid, prompt, params, prio in _requests():
        eng.add_request(prompt, params, request_id=rid, priority=prio)
    while not eng.scheduler.swapped and eng.has_unfinished():
        eng.step()
    victim = eng.scheduler.swapped[0].request_id
    assert eng.swap.tables.get(victim)
    eng.abort(victim)
    assert victim not in eng.swap.tables
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.leak_check()


def test_bad_preemption_config_names_the_flag(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="--swap-space"):
        EngineConfig.from_flat(swap_space=0, preemption_mode="swap")
    with pytest.raises(ValueError, match="--preemption-mode"):
        EngineConfig.from_flat(preemption_mode="sometimes")
    with pytest.raises(ValueError, match="--kv-blocks"):
        _engine(tiny_model_dir, num_kv_blocks=3)


def test_priority_batch_cap_limits_lower_rows(tiny_model_dir) -> None:
    eng = _engine(tiny_model_dir, num_kv_blocks=64, priority_batch_cap=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(4):
        eng.add_request([5 + i] * 8, params, request_id=f"low{i}", priority=5)
    eng.add_request([9] * 8, params, request_id="high", priority=0)
    eng.step()  # all five prefill
    batch = eng.scheduler.schedule()
    rows = sorted(r.request_id for r, _ in batch.entries)
    assert rows == ["high", "low0"]  # the best class, plus one lower row
    eng.scheduler.running.sort(key=lambda r: r.sort_key())
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.leak_check()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_full_batch_gives_its_seat_to_a_more_important_request(tiny_model_dir, mode) -> None:
    """max_num_seqs running low-priority requests: a high-priority arrival is admitted
    at the next step (the least important one is preempted), and outputs are unchanged."""
    ref = _engine(tiny_model_dir, num_kv_blocks=256)
    reqs = _requests()[:3]
    alone = {rid: ref.generate([prompt], params)[0].token_ids for rid, prompt, params, _ in reqs}
    eng = _engine(tiny_model_dir, num_kv_blocks=256, max_num_seqs=2, preemption_mode=mode,
                  swap_space=0.01)
    for rid, prompt, params, _ in reqs[:2]:
        eng.add_request(prompt, params, request_id=rid, priority=5)
    eng.step()
    eng.step()
    rid, prompt, params, _ = reqs[2]
    eng.add_request(prompt, params, request_id=rid, priority=0)
    tracked = dict(eng.requests)
    eng.step()
    assert tracked[rid].status is RequestStatus.RUNNING and tracked[rid].num_output_tokens == 1
    assert sum(r.num_preemptions for r in tracked.values()) == 1
    assert tracked["r1"].num_preemptions == 1  # the latest of the two less important ones
    last = {}
    while eng.has_unfinished():
        last.update((o.request_id, o) for o in eng.step() if o.finished)
    assert {k: r.output_token_ids for k, r in tracked.items()} == alone
    # each request's last output says how often it was preempted (the decode worker's
    # span event, docs/observability.md), and for how long
    assert {k: o.num_preemptions for k, o in last.items()} == {"r0": 0, "r1": 1, "r2": 0}
    assert last["r1"].preempted_seconds > 0 and last["r0"].preempted_seconds == 0
    eng.leak_check()


def test_two_prefills_that_overflow_the_pool_finish(tiny_model_dir) -> None:
    """A long prompt is mid-prefill when a more important long prompt arrives; together
    their KV overflows the pool before either prompt is done. The prefill that cannot
    get blocks preempts the less important one (it used to skip its chunk, and so did
    the other: no step ran, forever); both finish with the tokens each gets alone."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 7 + j * 5) % 300 + 3 for j in range(300)] for i in range(2)]
    alone = _engine(tiny_model_dir, max_model_len=320, num_kv_blocks=64)
    want = [alone.generate([p], params)[0].token_ids for p in prompts]
    eng = _engine(tiny_model_dir, max_model_len=320, num_kv_blocks=20,
                  max_num_batched_tokens=64, preemption_mode="recompute")
    low = eng.add_request(prompts[0], params, priority=1)
    for _ in range(3):  # 192 of its 300 tokens: 12 of the 20 blocks
        eng.step()
    high = eng.add_request(prompts[1], params, priority=0)
    reqs = {rid: eng.requests[rid] for rid in (low, high)}
    for _ in range(200):  # bounded: a deadlock fails here instead of hanging
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished(), [r.num_computed_tokens for r in reqs.values()]
    assert [reqs[low].output_token_ids, reqs[high].output_token_ids] == want
    assert eng.stats.preemptions == {PreemptionMode.RECOMPUTE: 1}
    eng.leak_check()
