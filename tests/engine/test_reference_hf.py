"""Our engine against Hugging Face transformers on the real model, fp32 on both sides.

transformers de-quantizes the same GGUF, so both sides run the same fp32
weights (on our side the default path too, which keeps the file's blocks packed):
prompt logits must agree to 1e-2 and greedy continuations token for token. A greedy divergence is tolerated only at a step where HF's own top two
logits are within 1e-3 (a near-tie that summation order can flip); anything
else is a bug. Both sides get the same token ids (tokenizer parity is
tests/engine/test_tokenizer.py's job), so this isolates the model, the paged
KV cache, the scheduler's batching and chunked prefill.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from core.sampling import SamplingParams

pytestmark = pytest.mark.slow

LOGIT_ATOL = 1e-2
NEAR_TIE = 1e-3
NEW_TOKENS = 32
PACKED_TOKENS = 16

LONG_TEXT = " ".join(
    f"Section {i}: the paged KV cache stores keys and values in fixed-size blocks, "
    f"so request {i} can grow without copying and share its prefix with others."
    for i in range(1, 10))


def _prompts(eng: LLMEngine) -> dict[str, list[int]]:
    tok = eng.tokenizer
    chat = [{"role": "user", "content": "Give me three tips for writing clear Python code."}]
    prompts = {
        "plain": tok.encode("The capital of France is Paris. The capital of Germany is"),
        "chat": tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True),
        "code": tok.encode("def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci "
                           "number.\"\"\"\n    if n < 2:\n"),
        "long": tok.encode(LONG_TEXT),
        "unicode": tok.encode("Café, naïve, Straße — 日本語のテキスト, Привет мир 🙂. Translate: "),
    }
    assert 250 <= len(prompts["long"]) <= 350, len(prompts["long"])
    return prompts


@pytest.fixture(scope="module")
def hf_model(model_path: Path):
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    if model_path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", params=["auto", "none"], ids=["default", "dense"])
def eng(model_path: Path, request) -> LLMEngine:
    """The default path (a GGUF kept packed, its blocks multiplied as stored) and the
    dequantized one: both compute the file's weights, as HF does."""
    return LLMEngine(EngineConfig.from_flat(model=str(model_path), dtype="float32", max_model_len=1024,
                                            num_kv_blocks=256, quantization=request.param))


@pytest.fixture(scope="module")
def prompts(eng: LLMEngine) -> dict[str, list[int]]:
    return _prompts(eng)


def test_prompt_logits_match_hf(eng: LLMEngine, hf_model, prompts: dict[str, list[int]]) -> None:
    diffs: dict[str, tuple[float, float]] = {}
    for name, ids in prompts.items():
        table = eng.kv.pool.allocate(eng.kv.blocks_needed(len(ids)))
        assert table is not None
        try:
            ours = eng.runner.prompt_logits(ids, table)  # [T, V] fp32
        finally:
            eng.kv.pool.free(table)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0].float()  # [T, V]
        assert ours.shape == ref.shape
        diffs[name] = ((ours[-1] - ref[-1]).abs().max().item(), (ours - ref).abs().max().item())
    print("\nmax |ours - hf| logits (last position / all positions):")
    for name, (last, every) in diffs.items():
        print(f"  {name:8s} T={len(prompts[name]):3d}  last={last:.3e}  all={every:.3e}")
    bad = {n: d[0] for n, d in diffs.items() if d[0] > LOGIT_ATOL}
    assert not bad, f"last-position logits differ from HF by more than {LOGIT_ATOL}: {bad}"
    eng.leak_check()


def _hf_greedy(hf_model, ids: list[int], new_tokens: int = NEW_TOKENS
               ) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy continuation (EOS ignored) and its per-step scores ([V] each)."""
    gen_cfg = copy.deepcopy(hf_model.generation_config)
    gen_cfg.update(do_sample=False, max_new_tokens=new_tokens, output_scores=True,
                   return_dict_in_generate=True)
    gen_cfg.eos_token_id = None  # match ignore_eos=True: always new_tokens tokens
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                generation_config=gen_cfg)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [s[0].float() for s in out.scores]


def test_greedy_batched_matches_hf(eng: LLMEngine, hf_model, prompts: dict[str, list[int]]) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    names = list(prompts)
    done = eng.generate([prompts[n] for n in names], params)  # one batch: all 5 at once
    failures, report = [], []
    for name, comp in zip(names, done):
        ref, scores = _hf_greedy(hf_model, prompts[name])
        assert len(ref) == NEW_TOKENS and len(comp.token_ids) == NEW_TOKENS, (name, len(ref), len(comp.token_ids))
        step = next((i for i, (a, b) in enumerate(zip(comp.token_ids, ref)) if a != b), None)
        if step is None:
            report.append(f"  {name:8s} identical ({NEW_TOKENS} tokens)")
            continue
        top2 = scores[step].topk(2)
        gap = (top2.values[0] - top2.values[1]).item()
        line = (f"  {name:8s} diverges at step {step}: ours={comp.token_ids[step]} hf={ref[step]} "
                f"hf top-2 gap={gap:.3e}")
        report.append(line)
        # a tolerated flip picks HF's runner-up; any other token is a bug whatever the gap
        if gap >= NEAR_TIE or comp.token_ids[step] not in top2.indices.tolist():
            failures.append(line + f"\n    ours={comp.token_ids}\n    hf  ={ref}")
    print("\ngreedy continuations vs HF:\n" + "\n".join(report))
    assert not failures, "greedy divergence without a near-tie:\n" + "\n".join(failures)
    eng.leak_check()


def hf_with_weights_of(hf_model, runner):
    """A copy of the HF model holding our engine's (quantized) weights: each packed
    linear's dense copy holds exactly the values its kernel multiplies by."""
    from engine.models.llama import checkpoint_names
    from engine.quant.linear import QuantLinear

    model = copy.deepcopy(hf_model)
    params = dict(model.named_parameters(remove_duplicate=False))
    tie = runner.model_config.tie_word_embeddings
    with torch.no_grad():
        for path, mod in runner.model.named_modules():
            if not isinstance(mod, QuantLinear):
                continue
            names = checkpoint_names(path, tie)
            sizes = [params[n].shape[0] for n in names]
            for name, part in zip(names, mod.weight.float().split(sizes)):
                params[name].copy_(part)
    return model


@pytest.mark.parametrize("method", ["gguf"])
def test_greedy_quantized_matches_hf_with_the_same_weights(model_path: Path, hf_model,
                                                           prompts, method: str) -> None:
    """The GGUF kept packed (its Q4_1 and Q8_0 blocks as stored where the block kernel
    runs, else Q4_1 as int4 and Q8_0 dense): decode steps of 5 rows and the logits of
    sampled rows run on the packed kernels. 16 tokens each: without the block kernel the
    CPU int kernels have no vectorised fp32 path (10x the dense GEMM's time)."""
    if model_path.is_dir():
        pytest.skip("needs the GGUF")
    eng = LLMEngine(EngineConfig.from_flat(model=str(model_path), dtype="float32", max_model_len=1024,
                                           num_kv_blocks=256, quantization=method, quant_packed_max_rows=8))
    assert eng.runner.quant.fallbacks == []
    ref_model = hf_with_weights_of(hf_model, eng.runner)
    params = SamplingParams(max_tokens=PACKED_TOKENS, temperature=0.0, ignore_eos=True)
    names = list(prompts)
    done = eng.generate([prompts[n] for n in names], params)
    failures = []
    for name, comp in zip(names, done):
        ref, scores = _hf_greedy(ref_model, prompts[name], PACKED_TOKENS)
        step = next((i for i, (a, b) in enumerate(zip(comp.token_ids, ref)) if a != b), None)
        if step is None:
            continue
        top2 = scores[step].topk(2)
        gap = (top2.values[0] - top2.values[1]).item()
        if gap >= NEAR_TIE or comp.token_ids[step] not in top2.indices.tolist():
            failures.append(f"{name} diverges at step {step} (hf top-2 gap {gap:.3e})")
    assert not failures, failures
    eng.leak_check()
