"""Small seeded random checkpoints of each model family, built with transformers' own
classes and saved as HF safetensors directories, and the reference runs against them.

Each checkpoint has 2 layers and widths of 64 (fp32), so building one takes well under
a second; ``initializer_range`` is raised from HF's 0.02 to 0.1 so the logits are not
flat: greedy picks then have margins far above fp32 summation noise, and an exact
comparison with transformers is meaningful rather than a coin flip at near-ties.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.utils import _byte_level_tokenizer_json

VOCAB = 320
WINDOW = 16
"""The sliding window of the families that slide: shorter than most test prompts."""


@dataclass(frozen=True)
class Family:
    """How to build one family's test checkpoint with transformers."""

    model_class: str
    config_class: str
    config: dict[str, Any] = field(default_factory=dict)
    backend: str = "sdpa"
    """The attention backend its tests run on: sdpa, the default, which computes sliding
    windows and soft-caps (engine/attention/sdpa.py) as the paged decode kernel does."""


BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "initializer_range": 0.1, "max_position_embeddings": 512,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "LlamaConfig"),
    "mistral": Family("MistralForCausalLM", "MistralConfig",
                      {"sliding_window": WINDOW}),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}),
    "gemma2": Family("Gemma2ForCausalLM", "Gemma2Config",
                     {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                      "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0}),
    "gemma3": Family("Gemma3ForCausalLM", "Gemma3TextConfig",
                     {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                      "num_hidden_layers": 3, "layer_types": ["sliding_attention",
                                                              "full_attention",
                                                              "sliding_attention"],
                      "rope_parameters": {
                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 100000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
    "phi3": Family("Phi3ForCausalLM", "Phi3Config"),
    "mixtral": Family("MixtralForCausalLM", "MixtralConfig",
                      {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "num_hidden_layers": 3,
                         "mlp_only_layers": [1]}),
}


def build_checkpoint(root: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Write ``family``'s random checkpoint (config.json, model.safetensors, a byte-level
    tokenizer.json) under root and return its path."""
    import transformers

    spec = FAMILIES[family]
    cfg = getattr(transformers, spec.config_class)(**{**BASE, **spec.config, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(cfg).eval()
    model.save_pretrained(root)
    (root / "tokenizer.json").write_text(json.dumps(_byte_level_tokenizer_json(VOCAB)))
    return root


def load_reference(path: Path):
    """transformers' model for a checkpoint directory, fp32, eval."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def prompts(count: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    """Seeded random token-id prompts of lengths in [low, high] (special ids 0-2 left out)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ids (EOS ignored: always new_tokens tokens)."""
    gen = copy.deepcopy(model.generation_config)
    gen.update(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    gen.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             generation_config=gen)
    return out[0, len(ids):].tolist()


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def engine_logits(eng, ids: list[int]) -> torch.Tensor:
    """The engine's logits at every position of ids (prefilled alone into blocks it frees)."""
    table = eng.kv.pool.allocate(eng.kv.blocks_needed(len(ids)))
    try:
        return eng.runner.prompt_logits(ids, table)
    finally:
        eng.kv.pool.free(table)


def engine_last_logits(eng, ids: list[int]) -> torch.Tensor:
    """The engine's logits at the last position of ids."""
    return engine_logits(eng, ids)[-1]


def greedy_margin(eng, prompt: list[int], tokens: list[int]) -> float:
    """The smallest top-2 logit gap along a greedy continuation: how far every pick was
    from a near-tie that another summation order (TP, another batch) could flip."""
    logits = engine_logits(eng, prompt + tokens[:-1])[len(prompt) - 1:]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).min().item()


def worst_last_logit_gap(eng, model, batch: list[list[int]]) -> float:
    """The largest difference between the engine's and transformers' logits at the
    last position of each prompt (each prefilled alone into blocks it frees)."""
    return max((engine_last_logits(eng, ids) - hf_last_logits(model, ids)).abs().max().item()
               for ids in batch)
