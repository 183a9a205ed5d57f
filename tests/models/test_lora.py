"""Multi-LoRA on small random checkpoints (tests/models/families.py), fp32, against PEFT's
own model: three seeded random adapters (nonzero B) and the base, greedy tokens equal to
PEFT's; a batch mixing all four equals each request alone; a prefix cached under one
adapter is never a hit under another; adapters the model cannot take are refused naming
the field or flag. Phi-3 stores q/k/v and gate/up fused in its checkpoint, so its
adapters target qkv_proj and gate_up_proj; Llama's target the separate projections that
our fused linears take as slices."""
from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
import torch

from core.guided.spec import GuidedSpec

from core.errors import FieldError
from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.adapter import AdapterError
from tests.models.adapters import ALL_LINEARS, make_adapter
from tests.guided_cases import MAX_TOKENS, SCHEMAS
from tests.models.families import build_checkpoint, hf_greedy, load_reference, prompts

pytest.importorskip("peft", reason="PEFT makes the adapters and is the reference")

NEW_TOKENS = 32
TARGETS = {"llama": ALL_LINEARS, "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
ADAPTERS = {  # name -> (seed, keyword arguments): ranks, rsLoRA and target sets differ
    "a": (1, {}),
    "b": (2, {"r": 4, "alpha": 32, "rslora": True}),
    "c": (3, {"r": 16, "attention_only": True}),
}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _targets(family: str, attention_only: bool = False) -> tuple[str, ...]:
    names = TARGETS[family]
    return tuple(n for n in names if "proj" in n and ("q" in n or "o_proj" in n)) \
        if attention_only else names


@pytest.fixture(scope="module", params=sorted(TARGETS))
def setup(request, checkpoint, tmp_path_factory):
    """(family, engine serving adapters a, b, c, {name: PEFT model or the base})."""
    family = request.param
    path = checkpoint(family)
    base = load_reference(path)
    refs, modules = {"": base}, []
    for name, (seed, kw) in ADAPTERS.items():
        kw = dict(kw)
        targets = _targets(family, kw.pop("attention_only", False))
        root, refs[name] = make_adapter(base, tmp_path_factory.mktemp(f"{family}-{name}"),
                                        seed, targets, **kw)
        modules.append(f"{name}={root}")
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(path), dtype="float32", quantization="none", max_model_len=256,
        num_kv_blocks=512, block_size=8, lora_modules=tuple(modules), max_loras=3))
    return family, eng, refs


def test_greedy_matches_peft(setup) -> None:
    """8 prompts x 32 tokens under each adapter and the base, one batch per adapter:
    every token equals PEFT's; every adapter changes the output."""
    family, eng, refs = setup
    batch = prompts(8, seed=1)
    outputs = {}
    for name, ref in refs.items():
        outputs[name] = [c.token_ids for c in eng.generate(batch, GREEDY, [name] * len(batch))]
        theirs = [hf_greedy(ref, ids, NEW_TOKENS) for ids in batch]
        assert outputs[name] == theirs, f"{family} adapter {name!r}"
    for name in ADAPTERS:
        assert outputs[name] != outputs[""], f"{family}: adapter {name} changes nothing"
    eng.leak_check()


def test_mixed_batch_equals_alone(setup) -> None:
    """16 requests, four each of the base and the three adapters, interleaved in one
    batch (mixed prefill and decode steps): each gets the tokens it gets alone."""
    family, eng, _ = setup
    batch = prompts(16, seed=3)
    names = ["", "a", "b", "c"] * 4
    together = [c.token_ids for c in eng.generate(batch, GREEDY, names)]
    alone = [eng.generate([p], GREEDY, [n])[0].token_ids for p, n in zip(batch, names)]
    assert together == alone, family
    assert len({tuple(t) for t in together[:4]}) == 4, "the four models answer alike"
    eng.leak_check()


def test_prefix_cache_is_per_adapter(setup) -> None:
    """A prompt of 5 full blocks cached under adapter a: 0 cached tokens under b and under
    the base, a hit under a again."""
    _, eng, _ = setup
    prompt = prompts(1, seed=5, low=41, high=41)[0]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    cached = {}
    for name in ("a", "b", "", "a"):
        cached.setdefault(name, []).append(eng.generate([prompt], one, [name])[0].num_cached_tokens)
    assert cached == {"a": [0, 40], "b": [0], "": [0]}, cached
    eng.leak_check()


def test_more_adapters_than_slots_queue(checkpoint, tmp_path) -> None:
    """--max-loras 1 and requests for two adapters: the second adapter's requests wait for
    the slot (Scheduler.lora_blocked counts them) and all get their own tokens."""
    path = checkpoint("llama")
    base = load_reference(path)
    mods = [f"{n}={make_adapter(base, tmp_path / n, seed)[0]}" for n, seed in (("x", 7), ("y", 8))]
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(path), dtype="float32", quantization="none", max_model_len=256,
        num_kv_blocks=512, block_size=8, lora_modules=tuple(mods), max_loras=1))
    batch, names = prompts(4, seed=9), ["x", "y", "x", "y"]
    ids = [eng.add_request(p, GREEDY, lora=n) for p, n in zip(batch, names)]
    blocked, outs = 0, {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
        blocked = max(blocked, eng.scheduler.lora_blocked)
    assert blocked > 0
    alone = [eng.generate([p], GREEDY, [n])[0].token_ids for p, n in zip(batch, names)]
    assert [outs[i] for i in ids] == alone
    eng.leak_check()


def test_bad_adapters_are_refused(setup, checkpoint, tmp_path) -> None:
    family, eng, refs = setup
    if family != "llama":
        pytest.skip("one family suffices")
    base = load_reference(checkpoint("llama"))
    root, _ = make_adapter(base, tmp_path / "big", 4, r=32)
    with pytest.raises(AdapterError, match="--max-lora-rank 16"):
        eng.loras.add("big", str(root))
    root, _ = make_adapter(base, tmp_path / "t", 4)
    cfg = json.loads((root / "adapter_config.json").read_text())
    cfg["target_modules"] = ["c_attn", "q_proj"]
    (root / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"target_modules \['c_attn'\]"):
        eng.loras.add("t", str(root))
    other = load_reference(build_checkpoint(tmp_path / "ck", "llama", intermediate_size=96))
    root, _ = make_adapter(other, tmp_path / "other", 4)
    with pytest.raises(AdapterError, match="made for another base model"):
        eng.loras.add("other", str(root))
    with pytest.raises(FieldError, match="'nope'") as e:
        eng.add_request([5, 6, 7], GREEDY, lora="nope")
    assert e.value.field == "model"
    assert eng.loras.names() == ["a", "b", "c"]
    eng.leak_check()


def test_compiled_decode_step_runs_adapters(setup) -> None:
    """The compiled decode step (its LoRA path traced once per bucket, the base rows'
    slots zeroed) gives the eager engine's tokens for a batch mixing all four."""
    family, eng, _ = setup
    if family != "llama":
        pytest.skip("one family suffices")
    compiled = LLMEngine(EngineConfig.from_flat(
        model=eng.config.load.model, dtype="float32", quantization="none", max_model_len=256,
        num_kv_blocks=512, block_size=8, lora_modules=eng.config.lora.lora_modules,
        max_loras=3, compile=True, compile_max_batch=4, max_num_seqs=4))
    assert compiled.runner.compiled.disabled is None
    compiled.runner.compiled.slower.clear()  # every bucket compiled, even if eager timed faster
    batch, names = prompts(4, seed=11), ["", "a", "b", "c"]
    assert ([c.token_ids for c in compiled.generate(batch, GREEDY, names)]
            == [c.token_ids for c in eng.generate(batch, GREEDY, names)])
    compiled.leak_check()


def _with(eng: LLMEngine, **flags) -> LLMEngine:
    """Another engine serving the same adapters as eng, with flags changed."""
    return LLMEngine(EngineConfig.from_flat(**{
        "model": eng.config.load.model, "dtype": "float32", "quantization": "none",
        "max_model_len": 256, "num_kv_blocks": 512, "block_size": 8,
        "lora_modules": eng.config.lora.lora_modules, "max_loras": 3, **flags}))


def test_speculation_constraints_and_swap_work_per_adapter(setup) -> None:
    """Under adapters (issue 30, item 4): n-gram speculation equals plain greedy with
    guesses accepted; a JSON-schema output under an adapter validates; in a pool too small
    for the batch, preempted and swapped adapter requests (low priority, pushed out by
    urgent ones) get their alone-tokens."""
    family, eng, _ = setup
    if family != "llama":
        pytest.skip("one family suffices")
    names = ["a", "b", "c", ""] * 2
    batch = [p * 3 if i % 2 == 0 else p for i, p in enumerate(prompts(8, seed=7, low=4, high=12))]
    want = [c.token_ids for c in eng.generate(batch, GREEDY, names)]
    spec = _with(eng, speculative_method="ngram", speculative_max_batch=0)
    assert [c.token_ids for c in spec.generate(batch, GREEDY, names)] == want
    counters = spec.speculator.counters.get(spec.speculator.proposer.name)
    assert counters.accepted > 0
    spec.leak_check()

    schema = SCHEMAS["flat_object"]
    out = eng.generate(prompts(1, seed=8, low=3, high=30), SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, guided=GuidedSpec.json_schema(schema)), ["b"])[0]
    jsonschema.validate(json.loads(out.text), schema)

    small = _with(eng, num_kv_blocks=16, max_model_len=64, preemption_mode="swap",
                  swap_space=0.01)
    batch = prompts(8, seed=13, low=20, high=30)
    alone = [eng.generate([p], GREEDY, [n])[0].token_ids for p, n in zip(batch, names)]
    ids = [small.add_request(p, GREEDY, lora=n, priority=5 if i < 4 else 0)
           for i, (p, n) in enumerate(zip(batch, names))]
    outs = {i: [] for i in ids}
    while small.has_unfinished():
        for o in small.step():
            outs[o.request_id].extend(o.new_token_ids)
    assert small.stats.swap_out_bytes > 0 and small.stats.swap_in_bytes > 0
    assert [outs[i] for i in ids] == alone
    small.leak_check()
