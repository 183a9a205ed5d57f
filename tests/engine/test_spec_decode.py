"""Speculative decoding (engine/spec/): outputs token-identical to plain decoding
(greedy, and seeded sampling), distribution kept (chi-square over many seeds, and the
test fails when acceptance is made wrong), stops inside an accepted run, preemption,
opt-out, the prefix cache never holding a rejected token, a leak check after each."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, SpecConfig
from core.kv.block_hash import hash_token_blocks
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from core.sampling import SamplingParams
from engine.spec import ngram as ngram_mod
from engine.spec import speculator as sp_mod
from engine.spec import verify as verify_mod
from engine.spec.base import Proposer
from tests.utils import make_tiny_llama

METHODS = ["ngram", "suffix", "draft:self:1", "draft:tiny"]


_DRAFT_DIR: list = []


def _engine(model_dir, method: str = "none", **kw) -> LLMEngine:
    if method == "draft:tiny":  # a separate one-layer model with the same tokenizer
        method = f"draft:{_DRAFT_DIR[0]}"
    if method.startswith("draft:"):
        kw["speculative_model"] = method.removeprefix("draft:")
        method = "draft"
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("speculative_max_batch", 0)
    return LLMEngine(EngineConfig.from_flat(model=str(model_dir), dtype="float32", max_model_len=256,
                                            speculative_method=method, **kw))


def _prompts(n: int = 50) -> list[list[int]]:
    """Half repeat a phrase (the proposers find matches), half do not."""
    out = []
    for i in range(n):
        phrase = [(i * 13 + j * 7) % 300 + 3 for j in range(6 + i % 5)]
        out.append(phrase * 3 if i % 2 == 0 else [(i * 31 + j * 17) % 311 + 3 for j in range(20)])
    return out


def _run(eng: LLMEngine, prompts, params) -> list[tuple[list[int], list]]:
    """(tokens, logprobs) per prompt, from the step outputs."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, plist)]
    got = {i: ([], []) for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(o.logprobs)
    return [got[i] for i in ids]


def _cache_holds_only_committed(eng: LLMEngine, sequences: list[list[int]]) -> None:
    """Every block in the prefix cache is a block of some committed sequence."""
    bs = eng.config.cache.block_size
    good = {h for s in sequences for h in hash_token_blocks(s, bs, eng.config.cache.hash_seed)}
    cached = set(eng.kv.pool.cached)
    assert cached and cached <= good, f"{len(cached - good)} cached blocks hold other tokens"


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory) -> LLMEngine:
    _DRAFT_DIR[:] = [make_tiny_llama(tmp_path_factory.mktemp("draft"), layers=1, seed=1)]
    return _engine(tiny_model_dir)


GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_plain(plain) -> list[list[int]]:
    want = [t for t, _ in _run(plain, _prompts(), GREEDY)]
    plain.leak_check()
    return want


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_for_50_prompts(tiny_model_dir, greedy_plain, method: str) -> None:
    prompts, params, want = _prompts(), GREEDY, greedy_plain
    eng = _engine(tiny_model_dir, method)
    got = [t for t, _ in _run(eng, prompts, params)]
    assert got == want
    st = eng.speculator.counters.get(eng.speculator.proposer.name)
    assert st.accepted > 0 and st.verifications > 0
    _cache_holds_only_committed(eng, [p + t for p, t in zip(prompts, got)])
    eng.leak_check()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_seeded_sampling_identical_with_logprobs_and_penalties(tiny_model_dir, plain,
                                                                method: str) -> None:
    prompts = _prompts(12)
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True,
                             logprobs=3, repetition_penalty=1.2 if i % 3 == 0 else 1.0)
              for i in range(len(prompts))]
    want = _run(plain, prompts, params)
    eng = _engine(tiny_model_dir, method)
    got = _run(eng, prompts, params)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert [x.token_id for x in a] == [x.token_id for x in b]
        # the same raw-model logprobs; the verify pass scores through the prefill path,
        # whose fp32 rounding differs from the decode kernel's by ~1e-6
        assert torch.allclose(torch.tensor([x.logprob for x in a]),
                              torch.tensor([x.logprob for x in b]), atol=1e-4)
        assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in x.top] for x in b]
    assert eng.speculator.counters.get(method).accepted > 0
    eng.leak_check()
    plain.leak_check()


def test_stops_inside_an_accepted_run(tiny_model_dir, plain) -> None:
    """A stop token id, max_tokens and a stop string end the request at the same token
    as plain decoding, although the verify pass had accepted tokens beyond it."""
    prompts = _prompts(8)[::2]
    free = [t for t, _ in _run(plain, prompts, SamplingParams(max_tokens=30, temperature=0,
                                                              ignore_eos=True))]
    eng = _engine(tiny_model_dir, "ngram")
    for prompt, toks in zip(prompts, free):
        stop_id = toks[9]
        cut = toks.index(stop_id) + 1
        text = plain.tokenizer.decode(toks[4:7])
        for params in (SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                      stop_token_ids=(stop_id,)),
                       SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
                       SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                      stop=(text,))):
            a = plain.generate([prompt], params)[0]
            b = eng.generate([prompt], params)[0]
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text,
                                                              a.finish_reason)
        assert eng.generate([prompt], SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True,
            stop_token_ids=(stop_id,)))[0].token_ids == toks[:cut]
    eng.leak_check()
    plain.leak_check()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_mid_way_keeps_outputs(tiny_model_dir, plain, mode: str) -> None:
    prompts = _prompts(12)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             seed=i) for i in range(len(prompts))]
    want = [t for t, _ in _run(plain, prompts, params)]
    eng = _engine(tiny_model_dir, "ngram", num_kv_blocks=24, preemption_mode=mode)
    got = [t for t, _ in _run(eng, prompts, params)]
    assert sum(eng.stats.preemptions.values()) > 0
    assert got == want
    assert eng.speculator.counters.get("ngram").accepted > 0
    eng.leak_check()


def test_opt_out_and_large_batches_do_not_speculate(tiny_model_dir) -> None:
    prompts = _prompts(4)[::2]
    eng = _engine(tiny_model_dir, "ngram")
    eng.generate(prompts, SamplingParams(max_tokens=16, temperature=0, speculate=False))
    assert eng.speculator.counters.get("ngram").verifications == 0
    small = _engine(tiny_model_dir, "ngram", speculative_max_batch=1)
    small.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert small.speculator.counters.get("ngram").verifications == 0
    small.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert small.speculator.counters.get("ngram").verifications > 0
    eng.leak_check()
    small.leak_check()


# -- the distribution -------------------------------------------------------------------

CONTEXTS = [[40, 41, 40, 41, 40, 41, 40], [100, 200, 100, 200, 100],
            [3, 4, 5, 3, 4, 5, 3, 4], [250, 17, 250, 17, 250]]
SEEDS = 300


def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of a two-sample chi-square test of homogeneity (categories with fewer than
    10 draws in both samples are pooled)."""
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    big = (ca + cb) >= 10
    ca = torch.cat([ca[big], ca[~big].sum().view(1)])
    cb = torch.cat([cb[big], cb[~big].sum().view(1)])
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    if len(ca) < 2:
        return 1.0
    tot = ca + cb
    ea, eb = tot * ca.sum() / tot.sum(), tot * cb.sum() / tot.sum()
    stat = (((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum()
    df = torch.tensor((len(ca) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def _outputs(eng: LLMEngine, ctx: list[int], seeds: range) -> list[list[int]]:
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=8, seed=s, ignore_eos=True)
              for s in seeds]
    return [c.token_ids for c in eng.generate([ctx] * len(seeds), params)]


@pytest.fixture(scope="module")
def flat_model_dir(tmp_path_factory):
    """A tiny model whose next-token distributions are spread (several likely tokens)."""
    return make_tiny_llama(tmp_path_factory.mktemp("flat"), embed_scale=0.25)


def _speculative_draws(model_dir, monkeypatch):
    """(plain draws, speculative draws) of the 2nd and 3rd output tokens (the first
    ones that can be guessed), from disjoint seeds. Single-token matches are allowed, so
    nearly every row gets guesses, and most are rejected (this model tends to repeat)."""
    monkeypatch.setattr(ngram_mod, "MIN_NGRAM", 1)
    plain = _engine(model_dir)
    eng = _engine(model_dir, "ngram", num_speculative_tokens=3)
    out = []
    for ctx in CONTEXTS:
        a, b = _outputs(plain, ctx, range(SEEDS)), _outputs(eng, ctx, range(SEEDS, 2 * SEEDS))
        for pos in (1, 2):
            out.append(([t[pos] for t in a], [t[pos] for t in b]))
    eng.leak_check()
    plain.leak_check()
    return out, eng.speculator.counters.get("ngram")


def test_sampled_distribution_is_kept(flat_model_dir, monkeypatch) -> None:
    draws, st = _speculative_draws(flat_model_dir, monkeypatch)
    assert st.proposed > SEEDS and 0 < st.accepted < st.proposed  # guesses were rejected
    for a, b in draws:
        assert chi_square_p(a, b) > 0.01


def test_distribution_test_fails_when_acceptance_is_wrong(flat_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(verify_mod, "ACCEPT_ALL", True)
    ps = [chi_square_p(a, b) for a, b in _speculative_draws(flat_model_dir, monkeypatch)[0]]
    assert min(ps) < 0.01, ps


# -- bad input: a start-up error naming the flag ------------------------------------------

@pytest.mark.parametrize("kw, flag", [
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "--num-speculative-tokens"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 256, "max_model_len": 256},
     "--num-speculative-tokens"),
    ({"speculative_method": "medusa"}, "--speculative-method"),
    ({"speculative_method": "draft"}, "--speculative-model"),
    ({"speculative_method": "ngram", "speculative_model": "self:1"}, "--speculative-model"),
])
def test_bad_config_names_the_flag(kw, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        EngineConfig.from_flat(model="x", **kw)


def test_k_beyond_the_models_context_names_the_flag(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                         speculative_method="ngram", num_speculative_tokens=600))


@pytest.mark.parametrize("spec", ["self:0", "self:2", "self:x"])
def test_self_draft_layers_outside_range(tiny_model_dir, spec: str) -> None:
    with pytest.raises(ValueError, match=r"--speculative-model self:N needs N in \[1, 2\)"):
        _engine(tiny_model_dir, f"draft:{spec}")


def test_draft_with_another_vocabulary_or_tokenizer(tiny_model_dir, tmp_path) -> None:
    import json

    other = make_tiny_llama(tmp_path / "vocab", layers=1, vocab=352)
    with pytest.raises(ValueError, match="--speculative-model .*vocabulary of 352"):
        _engine(tiny_model_dir, f"draft:{other}")
    same = make_tiny_llama(tmp_path / "tok", layers=1)
    tok = json.loads((same / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["<renamed>"] = vocab.pop("<extra_300>")
    (same / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="--speculative-model .*tokenizer differs"):
        _engine(tiny_model_dir, f"draft:{same}")


@pytest.mark.slow
def test_real_model_greedy_identical_for_50_prompts_fp32(model_path) -> None:
    """The embedded SmolLM2 in fp32: 50 chat prompts (half ask to repeat their input),
    greedy, with and without n-gram speculation."""
    def engine(method: str) -> LLMEngine:
        return LLMEngine(EngineConfig.from_flat(model=str(model_path), dtype="float32", max_model_len=512,
                                                num_kv_blocks=1024, speculative_method=method,
                                                speculative_max_batch=0))
    plain_eng = engine("none")
    tok = plain_eng.tokenizer
    topics = ["rivers", "bread", "chess", "rain", "trains", "owls", "glass", "maps", "tea",
              "bees"]
    texts = [f"Repeat this sentence twice: the {t} of the north are old and quiet."
             if i % 2 == 0 else f"Write one sentence about {t}." for i, t in
             enumerate(topics * 5)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{t} ({i})"}],
                                       tokenize=True) for i, t in enumerate(texts)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [c.token_ids for c in plain_eng.generate(prompts, params)]
    plain_eng.leak_check()
    del plain_eng
    eng = engine("ngram")
    got = [c.token_ids for c in eng.generate(prompts, params)]
    assert got == want
    assert eng.speculator.counters.get("ngram").accepted > 0
    eng.leak_check()


def test_adaptive_length_grows_shrinks_and_switches_off() -> None:
    from engine.spec.state import SpecState

    st = SpecState(k=2, max_k=4)
    st.update(2, 2)
    assert st.want() == 3  # all accepted: one more
    st.update(3, 1)
    assert st.want() == 2  # one accepted: propose what was accepted plus one
    for _ in range(3):  # the moving acceptance rate falls below 25%
        st.update(1, 0)
    assert [st.want() for _ in range(5)] == [0, 0, 0, 0, 1]  # off for 4 steps, a probe
    st.update(1, 0)
    st.update(1, 0)
    assert [st.want() for _ in range(9)] == [0] * 8 + [1]  # rejected again: the pause doubles


class _Guesser(Proposer):
    """Guesses k ones, whatever the context (free: a lookup's cost)."""
    name = "free"

    def propose(self, reqs, ks):
        return [[1] * k for k in ks]


def _decoding(i: int) -> Request:
    r = Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=100))
    r.status, r.token_ids, r.num_computed_tokens = RequestStatus.RUNNING, [5, 6, 7], 2
    return r


def test_a_costly_proposer_needs_more_acceptance_and_new_requests_start_paused() -> None:
    """A draft pass must be paid back: with a guess costing 0.4 of a step, a request
    whose guesses are about half accepted pauses (a free proposer's would not), requests
    start at one guess, and once the proposer's recent guesses over all requests fall
    below break-even a new request waits START_PAUSED steps before its first guess."""
    class Costly(_Guesser):
        name, cost = "costly", 0.4

    spec = sp_mod.Speculator(SpecConfig(num_speculative_tokens=4), Costly(), 256)
    free = sp_mod.Speculator(SpecConfig(num_speculative_tokens=4), _Guesser(), 256)
    assert (spec.low, spec.start_k, free.low, free.start_k) == (pytest.approx(0.65), 1, 0.25, 4)

    def guesses(s, r: Request) -> int:
        s.prepare([r])
        return len(r.draft)

    for s, paused in ((spec, True), (free, False)):
        r, counts = _decoding(0), []
        for i in range(5):  # every other run of guesses accepted (moving rate 60%, 46%)
            counts.append(guesses(s, r))
            if counts[-1]:
                s.record(r, emitted=1 + counts[-1] * (i % 2 == 0), kept=1)
        assert counts == ([1, 2, 0, 0, 0] if paused else [4, 4, 1, 2, 1])  # 0: paused
    assert guesses(spec, _decoding(1)) == 1  # fresh state, proposer still above break-even
    late = _decoding(2)
    spec.rate = 0.1  # recent guesses, over all requests, mostly rejected
    assert [guesses(spec, late) for _ in range(sp_mod.START_PAUSED + 1)] == \
        [0] * sp_mod.START_PAUSED + [1]


def test_guesses_shrink_as_the_batch_grows() -> None:
    """A step's rows, guesses included, stay within VERIFY_ROWS: 1 request may guess 7
    (--num-speculative-tokens), 4 requests 7 each (32 rows), 8 requests 3 each."""
    spec = sp_mod.Speculator(SpecConfig(num_speculative_tokens=7, speculative_max_batch=0),
                             _Guesser(), 256)
    for n, k in ((1, 7), (4, 7), (8, 3), (16, 1)):
        reqs = [_decoding(i) for i in range(n)]
        spec.prepare(reqs)
        assert [len(r.draft) for r in reqs] == [k] * n


@pytest.mark.parametrize("method", ["draft:self:1", "draft:tiny"])
def test_draft_models_read_an_int8_cache(tiny_model_dir, plain, method: str) -> None:
    """With --kv-cache-dtype int8 a draft reads (self:N) or keeps (its own cache) int8
    rows too: greedy output equals plain int8 decoding's, and guesses are accepted."""
    prompts = _prompts(12)
    want = [t for t, _ in _run(_engine(tiny_model_dir, kv_cache_dtype="int8"), prompts, GREEDY)]
    eng = _engine(tiny_model_dir, method, kv_cache_dtype="int8")
    assert [t for t, _ in _run(eng, prompts, GREEDY)] == want
    assert eng.speculator.counters.get(eng.speculator.proposer.name).accepted > 0
    eng.leak_check()


def test_a_verify_row_attends_as_decode_queries(tiny_model_dir, monkeypatch) -> None:
    """A speculating row's 1 + k positions reach attention as 1 + k one-token decode
    queries over its block table (query j sees start + j + 1 tokens), after any real
    prefill, and its logits are the causal ones: each equals the logits a prompt of
    that length gives at its last position."""
    eng = _engine(tiny_model_dir, "ngram")
    run = eng.runner
    prompt = [(j * 7) % 300 + 3 for j in range(21)]
    other = [(j * 11) % 300 + 3 for j in range(9)]
    a = eng.make_request(prompt[:-1], GREEDY)
    b = eng.make_request(other, GREEDY)
    ta = eng.kv.pool.allocate(eng.kv.blocks_needed(len(prompt) + 4))
    tb = eng.kv.pool.allocate(eng.kv.blocks_needed(len(other)))
    run.execute([(a, len(prompt) - 1)], [ta])
    a.num_computed_tokens = len(prompt) - 1
    a.token_ids.append(prompt[-1])
    guesses = [5, 9, 14]
    a.draft = list(guesses)
    seen = []
    forward = run.backend.forward
    monkeypatch.setattr(run.backend, "forward", lambda layer, q, k, v, kv, meta, params:
                        seen.append(meta) or forward(layer, q, k, v, kv, meta, params))
    captured = {}
    monkeypatch.setattr(run, "_sample", lambda sampled, rows, logits, plain, banned:
                        captured.update(rows=rows, logits=logits.clone()))
    run.execute([(b, len(other)), (a, 1 + len(guesses))], [tb, ta])
    meta = seen[0]
    n = len(prompt)
    assert (meta.num_prefills, meta.query_lens) == (1, [len(other)] + [1] * 4)
    assert meta.seq_lens == [len(other), n, n + 1, n + 2, n + 3]
    verify_logits = captured["logits"][1:]
    monkeypatch.undo()
    full = prompt + guesses
    for j in range(4):
        t = eng.kv.pool.allocate(eng.kv.blocks_needed(n + j))
        want = run.prompt_logits(full[:n + j], t)[-1]
        torch.testing.assert_close(verify_logits[j], want, rtol=1e-4, atol=1e-4)
        eng.kv.pool.free(t)
    a.draft = []
    for t in (ta, tb):
        eng.kv.pool.free(t)


def test_verification_in_a_one_graph_step_equals_plain_decoding(plain, tiny_model_dir) -> None:
    """ngram guesses verified by a compiled step (one sequence's 1 + 3 rows: bucket 4, run
    as one graph, every row's K/V written before any attends): the plain engine's
    greedy tokens, with guesses accepted."""
    eng = _engine(tiny_model_dir, "ngram", num_speculative_tokens=3, compile=True,
                  compile_max_batch=4, compile_graph_max_batch=4, max_num_seqs=1)
    c = eng.runner.compiled
    assert c.layer_groups(4) is not None
    c.slower.clear()
    rows = []
    inner = c.step
    c.step = lambda model, ids, *rest: rows.append(ids.shape[0]) or inner(model, ids, *rest)
    prompts = _prompts(6)[::2]  # the repeating ones
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert [eng.generate([p], GREEDY)[0].token_ids for p in prompts] == want
    assert 4 in rows and eng.speculator.counters.get("ngram").accepted > 0
    assert c.graph_failed is None
    eng.leak_check()
