"""A step of only less important requests is abandoned between layers when a more
important request arrives; nothing of the abandoned step counts."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from core.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7)


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(model_dir), dtype="float32", max_model_len=64,
                                            num_kv_blocks=64, **kw))


def _prompt(i: int) -> list[int]:
    return [(i * 17 + j * 5) % 300 + 3 for j in range(20)]


def _announce_during_next_forward(eng: LLMEngine, priority: int) -> None:
    """Make the next forward pass see interrupt_for(priority) before its second layer, as
    if another thread had called it while the step ran."""
    attn = eng.runner.model.model.layers[0].self_attn
    inner = attn.attend  # layer 0's attention runs eagerly in compiled steps too

    def attend(*a, **kw):
        attn.attend = inner  # once
        eng.interrupt_for(priority)
        return inner(*a, **kw)

    attn.attend = attend


def test_interrupted_step_commits_nothing_and_outputs_are_unchanged(tiny_model_dir) -> None:
    ref = _engine(tiny_model_dir)
    alone = {i: ref.generate([_prompt(i)], GREEDY if i % 2 else SEEDED)[0].token_ids
             for i in range(3)}

    eng = _engine(tiny_model_dir)
    for i in (0, 1):  # low priority, decoding
        eng.add_request(_prompt(i), GREEDY if i % 2 else SEEDED, request_id=f"r{i}",
                        priority=5)
    eng.step()
    eng.step()
    computed = {rid: r.num_computed_tokens for rid, r in eng.requests.items()}
    outputs = {rid: list(r.output_token_ids) for rid, r in eng.requests.items()}
    _announce_during_next_forward(eng, priority=0)
    assert eng.step() == []
    assert eng.stats.interrupted_steps == 1
    assert {rid: r.num_computed_tokens for rid, r in eng.requests.items()} == computed
    assert {rid: list(r.output_token_ids) for rid, r in eng.requests.items()} == outputs

    eng.add_request(_prompt(2), SEEDED, request_id="r2", priority=0)
    reqs = dict(eng.requests)
    _drain(eng)
    assert {rid: r.output_token_ids for rid, r in reqs.items()} == \
        {f"r{i}": alone[i] for i in range(3)}
    eng.leak_check()


def test_a_step_holding_an_equally_important_request_runs_on(tiny_model_dir) -> None:
    eng = _engine(tiny_model_dir)
    eng.add_request(_prompt(0), GREEDY, request_id="a", priority=0)
    eng.add_request(_prompt(1), GREEDY, request_id="b", priority=5)
    eng.step()
    _announce_during_next_forward(eng, priority=0)
    assert eng.step()  # a (priority 0) is in the step: not interrupted
    assert eng.stats.interrupted_steps == 0
    _drain(eng)
    eng.leak_check()


def test_interrupts_can_be_switched_off(tiny_model_dir) -> None:
    eng = _engine(tiny_model_dir, interrupt_steps=False)
    eng.add_request(_prompt(0), GREEDY, request_id="a", priority=5)
    eng.step()
    _announce_during_next_forward(eng, priority=0)
    assert eng.step()
    assert eng.stats.interrupted_steps == 0
    _drain(eng)
    eng.leak_check()


def _drain(eng: LLMEngine) -> None:
    while eng.has_unfinished():
        eng.step()
