"""What a user can get wrong about a checkpoint is refused at start-up, naming the file
and the architecture, field, tensor or flag; nothing is served wrong."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def _engine(path: Path, **flags) -> LLMEngine:
    flags = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64, **flags}
    return LLMEngine(EngineConfig.from_flat(model=str(path), **flags))


def _copy(checkpoint, family: str, tmp_path: Path, **config_changes) -> Path:
    """A copy of the family's test checkpoint with config.json fields changed (None:
    removed)."""
    path = Path(shutil.copytree(checkpoint(family), tmp_path / family))
    cfg = json.loads((path / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_an_unknown_architecture_is_refused_naming_it(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint, "llama", tmp_path, architectures=["GPTNeoXForCausalLM"],
                 model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"config\.json: architecture 'GPTNeoXForCausalLM' "
                                         r"\(model_type 'gpt_neox'\) is not supported; "
                                         r"supported: LlamaForCausalLM, MistralForCausalLM"):
        _engine(path)


@pytest.mark.parametrize("family, field", [("llama", "intermediate_size"),
                                           ("gemma2", "query_pre_attn_scalar"),
                                           ("mixtral", "num_local_experts"),
                                           ("qwen3_moe", "moe_intermediate_size")])
def test_a_missing_config_field_is_named(checkpoint, tmp_path, family: str, field: str) -> None:
    """A field every family reads, and ones only Gemma or a MoE family reads."""
    path = _copy(checkpoint, family, tmp_path, **{field: None})
    with pytest.raises(ValueError, match=rf"{path}/config\.json: .*'{field}'.* missing"):
        _engine(path, attention_backend="naive")


@pytest.mark.parametrize("family, field, value, says", [
    ("llama", "num_attention_heads", "four", "the field 'num_attention_heads' is 'four'; "
                                             "expected a whole number"),
    ("llama", "eos_token_id", [2, "x"], "the field 'eos_token_id' is 'x'; expected a whole number"),
    ("gemma2", "query_pre_attn_scalar", True, "the field 'query_pre_attn_scalar' is True; "
                                              "expected a number"),
    ("mixtral", "num_experts_per_tok", 1.5, "the field 'num_experts_per_tok' is 1.5; "
                                            "expected a whole number"),
    ("mistral", "sliding_window", 0, "sliding_window must be >= 1 or null, got 0"),
    ("llama", "num_key_value_heads", 3, r"num_attention_heads \(4\) must be a multiple of "
                                        r"num_key_value_heads \(3\)")])
def test_a_config_field_of_the_wrong_kind_is_named(checkpoint, tmp_path, family: str, field: str,
                                                   value, says: str) -> None:
    """A value no family can run names the file and the field as config.json spells it,
    never a bare conversion error."""
    path = _copy(checkpoint, family, tmp_path, **{field: value})
    with pytest.raises(ValueError, match=rf"^{path}/config\.json: {says}"):
        _engine(path, attention_backend="naive")


def test_a_rope_scaling_we_do_not_compute_is_refused(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint, "llama", tmp_path, rope_parameters={
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"config\.json: rope_scaling type 'dynamic' is not supported"):
        _engine(path)


def test_a_tensor_of_the_wrong_shape_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint, "qwen2", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.bias"
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{path}: checkpoint tensor {name} has shape \[33\]; "
                                         r"the qwen2 model config\.json describes needs \[32\]"):
        _engine(path)


@pytest.mark.parametrize("layers, name", [(2, "model.layers.0.mlp.extra.weight"),
                                          (1, "model.layers.1.input_layernorm.weight")])
def test_a_tensor_with_no_place_is_named(checkpoint, tmp_path, layers: int, name: str) -> None:
    """A tensor the model has no parameter for (a stray one; a layer config.json does
    not count) is refused naming it, never dropped."""
    path = _copy(checkpoint, "llama", tmp_path, num_hidden_layers=layers)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.setdefault(name, torch.zeros(3))
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"^{path}: checkpoint tensor {re.escape(name)} has no "
                                         r"place in the llama model"):
        _engine(path)


@pytest.mark.parametrize("family, name", [
    ("qwen3", "model.layers.0.self_attn.q_norm.weight"),
    # Mixtral's experts load into our stacked mlp weights; the error still names the
    # checkpoint's own tensor
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight")])
def test_a_missing_tensor_is_named(checkpoint, tmp_path, family: str, name: str) -> None:
    path = _copy(checkpoint, family, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"checkpoint is missing 1 tensors, e\.g\. "
                                         rf"{re.escape(name)}"):
        _engine(path)


def test_a_sliding_window_on_a_backend_without_one_is_refused(checkpoint, monkeypatch) -> None:
    """The runner asks the backend about every layer before loading: a backend that does
    not compute windows (sdpa until it does; flash_attn's window is another helper's) is
    refused naming the flag, never run with the window ignored."""
    from engine.attention.sdpa import SDPABackend

    monkeypatch.setattr(SDPABackend, "supports", frozenset())
    with pytest.raises(ValueError, match=r"--attention-backend sdpa does not compute window"):
        _engine(checkpoint("mistral"), attention_backend="sdpa")



