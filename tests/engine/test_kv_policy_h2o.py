"""Bounded KV under ``h2o:heavy=H,recent=R`` (H2O's heavy hitters, engine/kv_cache/h2o.py):
the tokens equal a plain reference written here (token by token, per layer and KV head:
the R newest tokens and the H with the most accumulated attention, keys rotated at
their index among the kept ones), for a prompt longer than the budget, through the
prefill path, the decode kernel and the naive backend; the request holds exactly the
budget's blocks; a swap resumes exactly; bad budgets and a backend without scores are
refused naming their field or flag."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.errors import FieldError
from core.kv.policy import parse_kv_policy
from core.sampling import SamplingParams
from tests.engine.test_kv_policy import (GREEDY, PlainStreaming, _engine, _held, _run,
                                         run_together)
from tests.utils import make_tiny_llama


class PlainH2O(PlainStreaming):
    """The tiny Llama token by token in fp32, each layer's KV head keeping its own tokens:
    the new one joins, the query attends, each kept token's score grows by its attention
    probability summed over the head's group of query heads (under a halflife, after the
    scores so far faded by one token's factor); a full cache (S + H + R tokens) then
    drops, per head, the least-scored of its H oldest after its S first (the sinks). Under
    ``mean`` a token's score is divided by the queries it has seen, each counted here as
    it comes (and faded as its attention is)."""

    def __init__(self, model_dir: Path, heavy: int, recent: int, halflife: int = 0,
                 sinks: int = 0, mean: bool = False) -> None:
        budget = sinks + heavy + recent
        super().__init__(model_dir, 0, budget, block=budget)
        self.sinks, self.heavy, self.budget, self.mean = sinks, heavy, budget, mean
        self.fade = 0.5 ** (1 / halflife) if halflife else 1.0  # per token, before it adds

    def new_state(self) -> dict:
        """Besides every token's K and V: per KV head, its kept tokens, their scores and the
        queries each has seen."""
        return {"keys": [], "vals": [], "kept": [[] for _ in range(self.nkv)],
                "score": [[] for _ in range(self.nkv)], "seen": [[] for _ in range(self.nkv)]}

    def attend(self, q: torch.Tensor, p: int, st: dict) -> torch.Tensor:
        rep = self.nh // self.nkv
        o = torch.empty(self.nh, self.d)
        for g in range(self.nkv):
            kept, score, seen = st["kept"][g], st["score"][g], st["seen"][g]
            score[:] = [x * self.fade for x in score]
            seen[:] = [x * self.fade for x in seen]
            kept.append(p)
            score.append(0.0)
            seen.append(0.0)
            s = len(kept)
            k = self.rope(torch.stack([st["keys"][t][g] for t in kept]).unsqueeze(1),
                          torch.arange(s))[:, 0]  # [S, D]
            v = torch.stack([st["vals"][t][g] for t in kept])
            qg = self.rope(q[:, g * rep:(g + 1) * rep], torch.tensor([s - 1]))[0]  # [rep, D]
            att = (qg @ k.T / self.d ** 0.5).softmax(-1)  # [rep, S]
            o[g * rep:(g + 1) * rep] = att @ v
            score[:] = [a + b for a, b in zip(score, att.sum(0).tolist())]
            seen[:] = [x + 1 for x in seen]
            if s == self.budget:
                rank = [x / n for x, n in zip(score, seen)] if self.mean else score
                victim = min(range(self.sinks, self.sinks + self.heavy), key=lambda j: rank[j])
                del kept[victim], score[victim], seen[victim]
        return o.reshape(1, -1)


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("sharp-llama"), scale=0.5, embed_scale=1.0)


@pytest.mark.parametrize("backend,halflife,chunk,sinks,score", [
    ("sdpa", 0, 512, 0, "sum"), ("naive", 0, 512, 0, "sum"), ("sdpa", 5, 512, 0, "sum"),
    ("sdpa", 5, 6, 0, "sum"), ("naive", 5, 6, 0, "sum"), ("sdpa", 0, 512, 2, "sum"),
    ("sdpa", 5, 6, 2, "sum"), ("sdpa", 0, 512, 0, "mean"), ("naive", 0, 6, 2, "mean"),
    ("sdpa", 5, 6, 0, "mean")])
def test_h2o_equals_the_plain_reference(sharp_model, backend, halflife, chunk, sinks,
                                        score) -> None:
    """Blocks of 4, heavy 6 + recent 10: a prompt of 37 (a first 16 tokens through the prefill
    path, in one chunk or in chunks of 6, then one token a step, each evicting), 80 tokens
    generated, with plain sums and with scores that fade by half every 5 tokens, with 2
    of the heavy part's slots kept as sinks, and ranked by mean attention per query seen.
    Tokens equal, logprobs within fp32 rounding; the request holds 4 blocks (the budget's)
    from its first step on."""
    ref = PlainH2O(sharp_model, heavy=6 - sinks, recent=10, halflife=halflife, sinks=sinks,
                   mean=score == "mean")
    prompt = [(7 * j + 3) % 300 + 1 for j in range(37)]
    want, want_lp = ref.generate(prompt, 80)
    extra = ((f",halflife={halflife}" if halflife else "") + (f",sinks={sinks}" if sinks else "")
             + (f",score={score}" if score != "sum" else ""))
    eng = _engine(sharp_model, block_size=4, attention_backend=backend,
                  kv_policy=f"h2o:heavy={6 - sinks},recent=10{extra}",
                  max_num_batched_tokens=chunk)
    eng.add_request(prompt, SamplingParams(max_tokens=80, logprobs=0, **GREEDY))
    got, got_lp, held = [], [], []
    while eng.has_unfinished():
        for out in eng.step():
            got += out.new_token_ids
            got_lp += [lp.logprob for lp in out.logprobs]
            held.append(_held(eng))
    assert got == want
    assert got_lp == pytest.approx(want_lp, abs=1e-4)
    assert set(held[:-1]) == {4}
    eng.leak_check()


def test_batching_and_swapping_equal_alone(sharp_model) -> None:
    """h2o, streaming and full requests in one batch (the decode kernel gives scores for
    the h2o rows only), in a pool that seats two so they are swapped out and in (the
    scores, and under score=mean the arrivals, follow the request's slots): each one's
    tokens equal its run alone."""
    jobs = [([(i * 11 + j) % 300 + 1 for j in range(10 + 9 * i)], policy) for i, policy in
            enumerate(["h2o:heavy=6,recent=10", "full", "h2o:heavy=9,recent=7,score=mean",
                       "streaming:sinks=4,window=12", "h2o:heavy=6,recent=10"])]
    alone_eng = _engine(sharp_model, block_size=4, allow_request_kv_policy=True, max_model_len=96)
    alone = [_run(alone_eng, p, 50, policy)[0] for p, policy in jobs]
    eng = _engine(sharp_model, block_size=4, allow_request_kv_policy=True, num_kv_blocks=24,
                  preemption_mode="swap", max_model_len=96)
    got = run_together(eng, jobs, 50)
    assert sum(eng.stats.preemptions.values()) > 0
    assert got == alone
    eng.leak_check()


def test_a_backend_without_scores_is_refused(tiny_model_dir, monkeypatch) -> None:
    """h2o evicts by attention scores: a backend that gives none is refused at start-up
    naming --kv-policy, and a request asking for h2o there naming kv_policy."""
    from engine.attention.sdpa import SDPABackend

    monkeypatch.setattr(SDPABackend, "gives_scores", False)
    with pytest.raises(ValueError, match="--kv-policy: h2o needs attention scores") as e:
        _engine(tiny_model_dir, kv_policy="h2o:heavy=32,recent=32")
    assert "--attention-backend sdpa" in str(e.value)
    eng = _engine(tiny_model_dir, allow_request_kv_policy=True)
    with pytest.raises(FieldError, match="kv_policy: h2o needs attention scores") as e:
        eng.make_request([1, 2, 3], SamplingParams(max_tokens=4), kv_policy="h2o:heavy=8,recent=8")
    assert e.value.field == "kv_policy"


def test_sinks_a_halflife_and_the_score_are_part_of_the_policy() -> None:
    """``sinks``, ``halflife`` and ``score`` are h2o's optional arguments: they parse, count
    in the budget (sinks), and the spec a log or a P/D handoff carries gives them back
    (without them, or with their defaults, the spec is the two-number form)."""
    policy = parse_kv_policy("h2o:recent=480, halflife=256,heavy=28,score=mean,sinks=4")
    assert (policy.sinks, policy.heavy, policy.recent, policy.halflife, policy.score) == (
        4, 28, 480, 256, "mean")
    assert policy.budget == 512
    assert policy.spec() == "h2o:heavy=28,recent=480,sinks=4,halflife=256,score=mean"
    assert parse_kv_policy(policy.spec()) == policy
    assert parse_kv_policy("h2o:heavy=32,recent=480").spec() == "h2o:heavy=32,recent=480"
    assert parse_kv_policy("h2o:heavy=32,recent=480,score=sum") == parse_kv_policy(
        "h2o:heavy=32,recent=480")
