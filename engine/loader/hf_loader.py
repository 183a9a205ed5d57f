"""HF-style directories: config.json + *.safetensors (Llama family)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.loader.base import LoadedCheckpoint


def hf_config(d: dict, path: Path) -> ModelConfig:
    arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
    if d.get("model_type", "llama") not in ("llama", "mistral") and "Llama" not in arch:
        raise ValueError(f"{path}/config.json: model_type {d.get('model_type')!r} is not "
                         "supported (Llama family only)")
    heads = int(d["num_attention_heads"])
    # transformers >= 5 writes rope_parameters {rope_theta, rope_type, ...} instead of
    # top-level rope_theta / rope_scaling
    rope = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
        name=path.name,
    )


def load_hf_dir(path: Path) -> LoadedCheckpoint:
    try:
        raw = json.loads((path / "config.json").read_text())
        config = hf_config(raw, path)
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}/config.json: cannot read model config ({e!r})") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files next to config.json")
    h = hashlib.sha256(config.fingerprint().encode())
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}".encode())

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)

    return LoadedCheckpoint(config, tensors(), h.hexdigest()[:16], path)
