"""Bounded KV under ``streaming:sinks=S,window=W`` (StreamingLLM): the blocks held stay
constant however long a request runs, the tokens equal a plain reference written here
(token by token, keys rotated at their positions within the kept cache), batching with
full requests changes nothing, preemption (swap and recompute) resumes exactly, bounded
requests stay out of the prefix cache, and every bad policy is refused naming its field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.errors import FieldError
from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.utils import make_tiny_llama

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(model_dir: Path, **kw) -> LLMEngine:
    flat = dict(model=str(model_dir), dtype="float32", max_model_len=512, num_kv_blocks=64)
    flat.update(kw)
    return LLMEngine(EngineConfig.from_flat(**flat))


def _held(eng: LLMEngine) -> int:
    return eng.kv.pool.num_blocks - eng.kv.pool.num_free


# -- the plain reference -------------------------------------------------------------------
class PlainStreaming:
    """The tiny Llama token by token in fp32: each token's un-rotated K and its V are kept
    per layer; a query sees the sink blocks and the newest ``recent`` blocks (the block
    granularity of engine/kv_cache/policy.py), every key rotated at its index among them."""

    def __init__(self, model_dir: Path, sinks: int, window: int, block: int) -> None:
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = load_file(str(model_dir / "model.safetensors"))
        self.head = -(-sinks // block)
        self.recent = -(-(sinks + window) // block) - self.head
        self.block = block
        c = self.cfg
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.d = c["hidden_size"] // self.nh
        self.inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, self.d, 2).double() / self.d))

    def kept(self, p: int) -> list[int]:
        first = max(self.head, p // self.block - self.recent + 1) * self.block
        return [t for t in range(p + 1) if t < self.head * self.block or t >= first]

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [T, H, D]
        ang = (pos.double().unsqueeze(1) * self.inv).float()  # [T, D/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(1)
        sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(1)
        half = self.d // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) \
            * self.w[name]

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and each one's logprob."""
        layers = self.cfg["num_hidden_layers"]
        state = [self.new_state() for _ in range(layers)]
        toks, out, lps = list(prompt), [], []
        for p in range(len(prompt) + n - 1):
            x = self.w["model.embed_tokens.weight"][toks[p]].unsqueeze(0)  # [1, H]
            for i in range(layers):
                x = self.layer(i, x, p, state[i])
            if p >= len(prompt) - 1:
                logits = self.norm(x, "model.norm.weight") @ self.w["model.embed_tokens.weight"].T
                toks.append(int(logits.argmax()))
                out.append(toks[-1])
                lps.append(float(logits.log_softmax(-1)[0, toks[-1]]))
        return out, lps

    def new_state(self) -> dict:
        """One layer's cache: every token's un-rotated K and its V."""
        return {"keys": [], "vals": []}

    def attend(self, q: torch.Tensor, p: int, st: dict) -> torch.Tensor:
        """q [1, Hq, D] of the token at p -> its attention output [1, Hq * D]."""
        kept = self.kept(p)
        k = self.rope(torch.stack([st["keys"][t] for t in kept]), torch.arange(len(kept)))
        v = torch.stack([st["vals"][t] for t in kept])  # [S, Hkv, D]
        q = self.rope(q, torch.tensor([len(kept) - 1]))
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / self.d ** 0.5
        return torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(1, -1)

    def layer(self, i: int, x: torch.Tensor, p: int, st: dict) -> torch.Tensor:
        pre = f"model.layers.{i}."
        h = self.norm(x, pre + "input_layernorm.weight")
        q = (h @ self.w[pre + "self_attn.q_proj.weight"].T).view(1, self.nh, self.d)
        st["keys"].append((h @ self.w[pre + "self_attn.k_proj.weight"].T).view(self.nkv, self.d))
        st["vals"].append((h @ self.w[pre + "self_attn.v_proj.weight"].T).view(self.nkv, self.d))
        x = x + self.attend(q, p, st) @ self.w[pre + "self_attn.o_proj.weight"].T
        h = self.norm(x, pre + "post_attention_layernorm.weight")
        g = torch.nn.functional.silu(h @ self.w[pre + "mlp.gate_proj.weight"].T)
        return x + (g * (h @ self.w[pre + "mlp.up_proj.weight"].T)) \
            @ self.w[pre + "mlp.down_proj.weight"].T


def _run(eng: LLMEngine, prompt: list[int], n: int, policy: str | None = None
         ) -> tuple[list[int], list[float]]:
    """One request alone: its greedy tokens and their logprobs."""
    eng.add_request(prompt, SamplingParams(max_tokens=n, logprobs=0, **GREEDY), kv_policy=policy)
    toks, lps = [], []
    while eng.has_unfinished():
        for out in eng.step():
            toks += out.new_token_ids
            lps += [lp.logprob for lp in out.logprobs]
    return toks, lps


def run_together(eng: LLMEngine, jobs: list[tuple[list[int], str | None]], n: int
                 ) -> list[list[int]]:
    """(prompt, kv_policy) requests added at once (priority i % 3), run to the end: each
    one's greedy tokens."""
    reqs = []
    for i, (prompt, policy) in enumerate(jobs):
        rid = eng.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY), priority=i % 3,
                              kv_policy=policy)
        reqs.append(eng.requests[rid])
    while eng.has_unfinished():
        eng.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> Path:
    """A tiny Llama whose outputs depend on attention (and so on positions) strongly
    enough that a key at a wrong position changes its greedy tokens."""
    return make_tiny_llama(tmp_path_factory.mktemp("sharp-llama"), scale=0.5, embed_scale=1.0)


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
@pytest.mark.parametrize("sinks,window,prompt_len", [(4, 12, 10), (4, 12, 45), (0, 16, 30)])
def test_streaming_equals_the_plain_reference(sharp_model, backend, sinks, window,
                                              prompt_len) -> None:
    """Blocks of 4 tokens, a budget of 16: dozens of drops in 120 tokens, a prompt past
    the budget (prefilled in chunks that stop where the kept blocks change), and sinks=0
    (a plain window over cache positions). Tokens equal, logprobs within fp32 rounding."""
    ref = PlainStreaming(sharp_model, sinks, window, block=4)
    prompt = [(7 * j + 3) % 300 + 1 for j in range(prompt_len)]
    want, want_lp = ref.generate(prompt, 120)
    eng = _engine(sharp_model, block_size=4, attention_backend=backend,
                  kv_policy=f"streaming:sinks={sinks},window={window}")
    got, got_lp = _run(eng, prompt, 120)
    assert got == want
    assert got_lp == pytest.approx(want_lp, abs=1e-4)
    eng.leak_check()


def test_20000_tokens_hold_a_constant_number_of_blocks(tmp_path) -> None:
    """streaming:sinks=4,window=508 with blocks of 16: after the first 512 tokens the
    request holds exactly 32 blocks at every step, 20,000 tokens on, past --max-model-len
    512; --max-stream-len is what ends it."""
    model = make_tiny_llama(tmp_path / "one-layer", layers=1, hidden=32, heads=2, kv_heads=1)
    eng = _engine(model, kv_policy="streaming:sinks=4,window=508", max_stream_len=20_000)
    eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=30_000, **GREEDY))
    held = []
    while eng.has_unfinished():
        [out] = eng.step()
        if not out.finished:
            held.append(_held(eng))
    assert out.finish_reason.value == "length" and len(held) == 20_000 - 8 - 1
    assert max(held) == 32 and set(held[512:]) == {32}
    eng.leak_check()


def test_batching_with_full_requests_equals_alone(sharp_model) -> None:
    """Streaming and full requests in one batch: each one's tokens equal its own run alone."""
    eng = _engine(sharp_model, kv_policy="streaming:sinks=4,window=28",
                  allow_request_kv_policy=True)
    jobs = [([(i * 11 + j) % 300 + 1 for j in range(10 + 13 * i)], policy)
            for i, policy in enumerate(["full", None, "streaming:sinks=0,window=32", None, "full"])]
    alone = []
    for prompt, policy in jobs:
        rid = eng.add_request(prompt, SamplingParams(max_tokens=90, **GREEDY), kv_policy=policy)
        req = eng.requests[rid]
        while eng.has_unfinished():
            eng.step()
        alone.append(req.output_token_ids)
    ids = [eng.add_request(p, SamplingParams(max_tokens=90, **GREEDY), kv_policy=policy)
           for p, policy in jobs]
    reqs = [eng.requests[i] for i in ids]
    while eng.has_unfinished():
        eng.step()
    assert [r.output_token_ids for r in reqs] == alone
    eng.leak_check()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("policy", ["streaming:sinks=4,window=20",
                                    "h2o:heavy=6,recent=18,score=mean"])
def test_preemption_resumes_exactly(sharp_model, mode, policy) -> None:
    """Six bounded requests in a pool that seats two: they are preempted (swap moves
    only the held blocks, with their re-rotated keys, and h2o's scores and arrivals stay
    with the request; recompute re-runs the context under the policy, rebuilding them)
    and each one's tokens equal its run alone."""
    alone_eng = _engine(sharp_model, block_size=4, kv_policy=policy)
    prompts = [[(i * 17 + j * 5) % 300 + 1 for j in range(12 + 7 * i)] for i in range(6)]
    alone = [_run(alone_eng, p, 60)[0] for p in prompts]
    eng = _engine(sharp_model, block_size=4, kv_policy=policy, num_kv_blocks=14,
                  preemption_mode=mode, max_model_len=64)
    got = run_together(eng, [(p, None) for p in prompts], 60)
    assert sum(eng.stats.preemptions.values()) > 0
    assert got == alone
    eng.leak_check()


def test_only_full_requests_share_prefix_blocks(sharp_model) -> None:
    """A streaming request neither adopts cached blocks nor publishes its own (its keys
    move to other positions); a full request after it still hits the full one's blocks."""
    eng = _engine(sharp_model, block_size=4, allow_request_kv_policy=True, max_model_len=128)
    prompt = [(3 * j) % 300 + 1 for j in range(40)]
    _run(eng, prompt, 4)
    cached = set(eng.cached_hashes())
    assert cached
    eng.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY),
                    kv_policy="streaming:sinks=4,window=12")
    req = next(iter(eng.requests.values()))
    while eng.has_unfinished():
        eng.step()
    assert req.num_cached_tokens == 0 and set(eng.cached_hashes()) == cached
    eng.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    req = next(iter(eng.requests.values()))
    while eng.has_unfinished():
        eng.step()
    assert req.num_cached_tokens == 36
    with pytest.raises(FieldError, match="n: several choices need kv_policy full"):
        eng.add_request(prompt, SamplingParams(max_tokens=4, n=2, **GREEDY),
                        kv_policy="streaming:sinks=4,window=12")
    assert not eng.has_unfinished()
    eng.leak_check()


def test_a_speculating_engine_runs_bounded_requests_plainly(sharp_model) -> None:
    """Speculation is off for a bounded request (its kept blocks would change inside a
    verified run): under --speculative-method ngram its tokens equal plain decoding's."""
    policy = "streaming:sinks=4,window=12"
    prompt = [1, 2, 3, 4] * 6
    plain = _run(_engine(sharp_model, block_size=4, kv_policy=policy), prompt, 50)[0]
    eng = _engine(sharp_model, block_size=4, kv_policy=policy, speculative_method="ngram")
    assert _run(eng, prompt, 50)[0] == plain
    assert eng.speculator.counters.get("ngram").proposed == 0
    eng.leak_check()


@pytest.mark.parametrize("policy,words", [
    ("streaming:sinks=4,window=8", "smaller than one KV block"),
    ("streaming:sinks=20,window=10", "fill all"),
    ("streaming:sinks=4", "needs sinks and window"),
    ("streaming:sinks=4,window=x", "is not streaming"),
    ("h2o:heavy=4,recent=4", "the budget heavy + recent = 8 tokens is smaller than one KV"),
    ("h2o:heavy=0,recent=64", "heavy >= 1"),
    ("h2o:heavy=8,window=64", "is not h2o:heavy=H,recent=R[,sinks=S][,halflife=T][,score="),
    ("h2o:heavy=8,recent=56,halflife=0", "halflife >= 1"),
    ("h2o:heavy=2,recent=2,sinks=2", "the budget sinks + heavy + recent = 6 tokens"),
    ("h2o:heavy=8,recent=56,halflife=1.5", "is not h2o:heavy=H,recent=R[,sinks=S][,halflife=T]"),
    ("h2o:heavy=8,recent=56,score=max", "score must be sum or mean; got 'max'"),
    ("h2o:heavy=8,recent=56,score=mean,score=sum", "is not h2o:heavy=H,recent=R"),
    ("streaming:sinks=4,window=60,halflife=8", "is not streaming:sinks=S,window=W"),
    ("lru", "must be full, streaming:sinks=S,window=W or "
            "h2o:heavy=H,recent=R[,sinks=S][,halflife=T][,score=mean]"),
    ("streaming:sinks=4,window=1000", "exceeds the context window"),
])
def test_bad_policies_name_the_flag_and_the_field(tiny_model_dir, policy, words) -> None:
    with pytest.raises(ValueError, match="--kv-policy") as e:
        _engine(tiny_model_dir, kv_policy=policy)
    assert words in str(e.value)
    eng = _engine(tiny_model_dir, allow_request_kv_policy=True)
    with pytest.raises(FieldError, match="kv_policy") as e:
        eng.make_request([1, 2, 3], SamplingParams(max_tokens=4), kv_policy=policy)
    assert words in str(e.value) and e.value.field == "kv_policy"


def test_a_request_policy_needs_the_servers_consent(tiny_model_dir) -> None:
    """Without --allow-request-kv-policy a request may only name the server's policy; a
    full request's length is still the context window, a bounded one's --max-stream-len."""
    eng = _engine(tiny_model_dir, kv_policy="streaming:sinks=4,window=60", max_stream_len=2000)
    with pytest.raises(FieldError, match="--allow-request-kv-policy") as e:
        eng.make_request([1, 2, 3], SamplingParams(max_tokens=4), kv_policy="full")
    assert e.value.field == "kv_policy"
    req = eng.make_request([1] * 600, SamplingParams(max_tokens=1000),
                           kv_policy="streaming:sinks=4,window=60")
    assert req.max_total_len == 2000
    with pytest.raises(FieldError, match="--max-stream-len"):
        eng.make_request([1] * 2000, SamplingParams(max_tokens=4))
    full = _engine(tiny_model_dir)
    with pytest.raises(FieldError, match="max_model_len"):
        full.make_request([1] * 600, SamplingParams(max_tokens=4))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_shifted_keys_equal_keys_rotated_there(tiny_model_dir, kv_dtype) -> None:
    """shift_keys by -d turns keys written at positions p into the keys written at p - d
    (fp32: to rounding; int8: within the codes' rounding, dequantized, rotated, quantized
    again); values are untouched."""
    from engine.attention.base import gather_blocks
    from engine.kv_cache.quant import encode

    eng = _engine(tiny_model_dir, block_size=4, kv_cache_dtype=kv_dtype, max_model_len=128)
    runner = eng.runner
    rot = runner.model.model.rotaries[0]
    layers = eng.model_config.num_layers
    hkv, d = eng.model_config.num_kv_heads, eng.model_config.head_dim
    raw = torch.randn(layers, 2, 4, hkv, d)  # un-rotated K, and V, of one block
    pos = torch.arange(40, 44)

    def write(block: int, at: torch.Tensor) -> None:
        cos, sin = rot.tables(at, torch.float32)
        for i in range(layers):
            k = raw[i, 0] * cos + torch.cat([-raw[i, 0, ..., d // 2:], raw[i, 0, ..., :d // 2]],
                                            -1) * sin
            rows = (k, raw[i, 1])
            for j, x in enumerate(rows):
                runner.kv[block, i, j] = encode(x, kv_dtype) if kv_dtype == "int8" else x

    write(3, pos)
    write(5, pos - 12)
    runner.shift_keys([3], -12)
    quant = eng.runner.kv_quant
    for i in range(layers):
        k3, v3 = gather_blocks(i, runner.kv, torch.tensor([3]), quant, torch.float32)
        k5, v5 = gather_blocks(i, runner.kv, torch.tensor([5]), quant, torch.float32)
        tol = 1e-5 if quant is None else 0.05 * float(k5.abs().max())
        assert (k3 - k5).abs().max() < tol
        assert torch.equal(v3, v5)


def test_the_perplexity_bench_skips_to_the_same_tokens_a_longer_read_has(tok) -> None:
    """bench/kv_policy_ppl.py --skip N reads the text's tokens N.. as a run of N + n tokens
    has them (docs/performance.md l compares the two reads token for token)."""
    from bench.kv_policy_ppl import text_ids

    whole = text_ids(tok, 700)
    assert len(whole) == 700
    assert text_ids(tok, 300, skip=400) == whole[400:]
    assert text_ids(tok, 300, skip=0) == whole[:300]
