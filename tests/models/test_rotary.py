"""Rotary scalings checkpoints use, against transformers' own (modeling_rope_utils): the
cos/sin tables of YaRN and Phi-3's long/short factors (``longrope``) equal theirs, and a
family served with such a config continues prompts greedily as transformers does. What
is not computed exactly is refused at start-up, naming config.json's field."""
from __future__ import annotations

import json

import pytest
import torch

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.layers.rotary import RotaryEmbedding
from engine.llm_engine import LLMEngine
from engine.loader.hf_loader import hf_config
from tests.models.families import build_checkpoint, hf_greedy, load_reference, prompts

WINDOW = 256
SCALINGS = {
    "yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 128}}),
    "yarn_mscale": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.9,
                                               "mscale_all_dim": 0.7, "beta_fast": 16,
                                               "original_max_position_embeddings": 64}}),
    "longrope": ("phi3", {"original_max_position_embeddings": WINDOW, "rope_scaling": {
        "type": "longrope", "long_factor": [1.0 + i for i in range(8)],
        "short_factor": [1.0 + 0.3 * i for i in range(8)]}}),
}


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled(request, tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers is the reference")
    family, overrides = SCALINGS[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param), family, **overrides)


def test_tables_equal_transformers(scaled) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs_cfg = AutoConfig.from_pretrained(scaled)
    kind = theirs_cfg.rope_parameters["rope_type"]
    inv, attn = ROPE_INIT_FUNCTIONS[kind](theirs_cfg, torch.device("cpu"))
    freqs = torch.outer(torch.arange(WINDOW, dtype=torch.float32), inv.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    ours_cfg = hf_config(json.loads((scaled / "config.json").read_text()), scaled)
    ours = RotaryEmbedding(ours_cfg.head_dim, WINDOW, ours_cfg.rope_theta, ours_cfg.rope_scaling)
    assert attn != 1.0  # the attention factor is exercised
    torch.testing.assert_close(ours.cos, emb.cos() * attn, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin, emb.sin() * attn, rtol=0, atol=1e-6)


def test_greedy_matches_transformers(scaled) -> None:
    eng = LLMEngine(EngineConfig.from_flat(model=str(scaled), dtype="float32",
                                           quantization="none", max_model_len=WINDOW,
                                           num_kv_blocks=128, block_size=8))
    ref = load_reference(scaled)
    batch = prompts(4, seed=7, low=20, high=60)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ours = [c.token_ids for c in eng.generate(batch, params)]
    assert ours == [hf_greedy(ref, ids, 24) for ids in batch]
    eng.leak_check()


def _refusal(tmp_path, family: str, max_model_len: int, **overrides) -> str:
    path = build_checkpoint(tmp_path / family, family, **overrides)
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineConfig.from_flat(model=str(path), dtype="float32", quantization="none",
                                         max_model_len=max_model_len, num_kv_blocks=64))
    return str(e.value)


def test_longrope_past_the_original_context_is_refused(tmp_path) -> None:
    """transformers moves a sequence to long_factor once it outgrows the original
    context, recomputing every earlier position; a KV cache cannot, so it is refused."""
    pytest.importorskip("transformers")
    why = _refusal(tmp_path, "phi3", 512, **SCALINGS["longrope"][1])
    assert "original_max_position_embeddings" in why and "--max-model-len 256" in why, why


def test_unsupported_scaling_and_partial_rotary_are_refused(tmp_path) -> None:
    pytest.importorskip("transformers")
    why = _refusal(tmp_path, "llama", 256, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "config.json" in why and "'dynamic'" in why, why
    why = _refusal(tmp_path, "qwen2", 256, rope_scaling={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.5})
    assert "config.json" in why and "partial_rotary_factor" in why, why
