"""The engine without a KV connector (engine/kv_connector.py) is the colocated engine:
every request is computed here from its first token and every finished request's
blocks are freed; a request's connector parameters mean nothing to it."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.kv_connector import ExternalKV
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, RequestStatus
from core.sampling import SamplingParams
from kvtransfer.prefill_connector import PREFILL_ONLY

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 11 + j * 5) % 300 + 3 for j in range(n)]


def test_the_colocated_engine_runs_with_no_connector(tiny_model_dir) -> None:
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                 max_model_len=128))
    assert eng.connector is None and eng.scheduler.connector is None
    prompts = [_prompt(20 + i, i) for i in range(3)]
    alone = [c.token_ids for c in eng.generate(prompts, GREEDY)]
    eng.add_request(prompts[0], GREEDY, request_id="plain")
    eng.add_request(prompts[1], GREEDY, request_id="marked", kv_transfer=PREFILL_ONLY)
    eng.add_request(prompts[2], GREEDY, request_id="ext", kv_transfer=ExternalKV(16))
    reqs = dict(eng.requests)
    tokens, last, statuses = {}, {}, set()
    while eng.has_unfinished():
        statuses |= {r.status for r in reqs.values()}
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            last[out.request_id] = out
    assert RequestStatus.WAITING_FOR_KV not in statuses  # nothing was loaded from elsewhere
    assert [tokens[rid] for rid in ("plain", "marked", "ext")] == alone
    assert {rid: (o.finish_reason, o.kept_blocks) for rid, o in last.items()} == {
        rid: (FinishReason.LENGTH, None) for rid in ("plain", "marked", "ext")}
    load = eng.load()
    assert (load.num_loading, load.num_kept, load.free_blocks) == (0, 0, load.total_blocks)
    assert not load.busy
    eng.leak_check()
