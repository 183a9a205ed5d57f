"""Tiers under prefill/decode disaggregation, every service its own process (issue 29
item 5): a prefill worker's host tier serves the next prefill of a prefix it demoted; a
decode worker that receives a handoff promotes its own demoted copy and says which tier
it came from; a decode worker's demoted blocks of a finished conversation serve its
next turn when the router prefills that turn there (conditional disaggregation). Tokens
equal a cold run's (the same prompt under another cache salt: no hit anywhere)."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.cluster.launch import another_router, cluster

BS = 16
PROMPT = [(i * 7) % 300 + 3 for i in range(4 * BS + 5)]  # 4 full blocks + 5 tokens
CONV = [(i * 13) % 300 + 5 for i in range(4 * BS + 5)]
FILLERS = [[(i * 11 + k * 37) % 300 + 3 for i in range(4 * BS + 5)] for k in range(3)]
# 8 device blocks on each worker: three fillers push a prompt's blocks to its host tier
TIERED = ["--dtype", "float32", "--kv-blocks", "8", "--max-model-len", "128",
          "--swap-space", "0", "--preemption-mode", "recompute", "--kv-offload-cpu-gib", "0.01"]


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    """One prefill and one decode worker with host tiers; the router always
    disaggregates (threshold 0), so each request runs on both."""
    log = tmp_path_factory.mktemp("pd-tiers") / "requests.jsonl"
    with cluster(tiny_model_dir, "tcp", n_prefill=1, n_decode=1, worker_args=TIERED,
                 router_args=["--local-prefill-threshold", "0", "--log-requests", str(log)]) as c:
        c.log = log
        yield c


def _complete(url: str, prompt: list[int], max_tokens: int = 2, salt: str | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


def _last_trace(log) -> dict:
    return json.loads(log.read_text().splitlines()[-1])


def _push_to_host(url: str) -> None:
    """Other prompts through both workers until the earlier ones left their devices."""
    for filler in FILLERS:
        _complete(url, filler)


def _usage(cached: int, device: int = 0, host: int = 0, disk: int = 0) -> dict:
    return {"cached_tokens": cached,
            "cached_tokens_by_tier": {"device": device, "host": host, "disk": disk}}


def test_prefill_host_tier_serves_the_prefill_and_the_decode_reports_its_own(pd) -> None:
    """The prompt ran once (disaggregated), then left both devices for their host tiers.
    Again: the prefill worker promotes it from its host tier (usage says host), and the
    decode worker receiving the handoff promotes its own copy, pulling only the tail,
    and its trace says host too."""
    cold = _complete(pd.url, PROMPT, salt="cold")
    first = _complete(pd.url, PROMPT)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _push_to_host(pd.url)
    again = _complete(pd.url, PROMPT)
    assert _tokens(again) == _tokens(first) == _tokens(cold)
    assert again["usage"]["prompt_tokens_details"] == _usage(4 * BS, host=4 * BS)
    t = _last_trace(pd.log)
    assert (t["path"], t["realized_host_cached_tokens"]) == ("disaggregated", 4 * BS)
    assert (t["decode_cached_tokens"], t["decode_host_cached_tokens"],
            t["decode_disk_cached_tokens"], t["blocks_pulled"]) == (4 * BS, 4 * BS, 0, 1)
    pd.leak_check()


def test_decode_host_tier_serves_the_next_turn_prefilled_locally(pd, tiny_model_dir) -> None:
    """Turn 1 is disaggregated; its blocks (prompt and answer) stay on the decode worker
    and are demoted to its host tier by other traffic. Turn 2 (turn 1, its answer and a
    short new message) through a router that prefills short tails locally: it goes to
    the decode worker, whose host tier serves the history; tokens equal a cold run's."""
    turn1 = _complete(pd.url, CONV, max_tokens=12)
    assert _last_trace(pd.log)["path"] == "disaggregated"
    turn2 = CONV + _tokens(turn1) + [7, 8, 9, 10, 11, 12]
    cold = _complete(pd.url, turn2, max_tokens=4, salt="cold")
    _push_to_host(pd.url)
    log = pd.log.with_name("local.jsonl")
    with another_router(pd, tiny_model_dir, ["--local-prefill-threshold", "32",
                                             "--log-requests", str(log)]) as url:
        hit = _complete(url, turn2, max_tokens=4)
    t = _last_trace(log)
    assert (t["path"], t["blocks_pulled"]) == ("local_prefill", 0)
    assert pd.decode[0].addr in t["decode_worker"]
    # the decode worker computed 5 full blocks of turn 1 (69 prompt + 11 of its answer)
    assert hit["usage"]["prompt_tokens_details"] == _usage(5 * BS, host=5 * BS)
    assert _tokens(hit) == _tokens(cold)
    pd.leak_check()
