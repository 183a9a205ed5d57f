"""HF-style directories: config.json + *.safetensors, for every family engine.models
runs; any other architecture is refused here, naming it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from engine.config import ModelConfig, config_number
from engine.layers.rotary import check_scaling
from engine.loader.base import LoadedCheckpoint
from engine.loader.fingerprint import weights_fingerprint
from engine.models import resolve_architecture

_PARSED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
           "rope_theta", "rope_scaling", "max_position_embeddings",
           "tie_word_embeddings", "bos_token_id", "eos_token_id", "architectures", "model_type",
           "hidden_act", "hidden_activation", "attention_bias", "sliding_window", "layer_types"}
_NOISE = {"transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range",
          "attention_dropout", "_name_or_path", "output_router_logits", "router_aux_loss_coef"}


def _rope(d: dict, source: str) -> tuple[float, dict | None]:
    """(theta, scaling) from top-level rope_theta / rope_scaling or transformers >= 5's
    rope_parameters {rope_theta, rope_type, ...} (per layer type where it nests them)."""
    rope = d.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3: one set per layer type; the family reads both
        rope = rope["full_attention"]
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling is not None and (scaling.get("rope_type") or scaling.get("type")) == "longrope":
        # Phi-3 keeps the original length at the top level, and leaves the factor implied
        old_len = scaling.get("original_max_position_embeddings",
                              d.get("original_max_position_embeddings"))
        if old_len is None:
            raise ValueError(f"{source}: rope_scaling longrope needs the field "
                             f"'original_max_position_embeddings', which is missing")
        factor = scaling.get("factor") or d.get("max_position_embeddings", 2048) / old_len
        scaling = {**scaling, "original_max_position_embeddings": old_len, "factor": factor}
    check_scaling(scaling, source)
    return float(theta), scaling


def _required(d: dict, key: str, source: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"{source}: the field {key!r} is missing")
    return d[key]


def _int(d: dict, key: str, source: str, default: int | None = None,
         required: bool = False) -> int | None:
    """An integer field; ValueError naming the file and the field when it is missing
    (required) or holds anything but a whole number ("four", 2.5, true, a list)."""
    value = _required(d, key, source) if required else d.get(key)
    if value is None:
        return default
    return config_number(value, key, source)


def _eos(d: dict, source: str) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    items = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(config_number(e, "eos_token_id", source) for e in items)


def hf_config(d: dict, path: Path) -> ModelConfig:
    source = str(path / "config.json")
    # neither field: a bare Llama config, as this loader always read one
    arch = resolve_architecture(d.get("architectures"), d.get("model_type", "llama"), source)
    heads = _int(d, "num_attention_heads", source, required=True)
    hidden = _int(d, "hidden_size", source, required=True)
    theta, scaling = _rope(d, source)
    window = _int(d, "sliding_window", source)
    if d.get("use_sliding_window") is False:  # Qwen2 keeps a window it does not use
        window = None
    types = d.get("layer_types")
    return ModelConfig(
        vocab_size=_int(d, "vocab_size", source, required=True), hidden_size=hidden,
        intermediate_size=_int(d, "intermediate_size", source, required=True),
        num_layers=_int(d, "num_hidden_layers", source, required=True), num_heads=heads,
        num_kv_heads=_int(d, "num_key_value_heads", source) or heads,
        head_dim=_int(d, "head_dim", source) or hidden // max(heads, 1),
        rms_norm_eps=config_number(d.get("rms_norm_eps", 1e-5), "rms_norm_eps", source, float),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=_int(d, "max_position_embeddings", source, 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=_int(d, "bos_token_id", source), eos_token_ids=_eos(d, source),
        name=path.name, architecture=arch,
        hidden_act=str(d.get("hidden_act") or d.get("hidden_activation") or "silu"),
        attention_bias=bool(d.get("attention_bias", False)),
        sliding_window=window,
        layer_types=None if types is None else tuple(types),
        extra={k: v for k, v in d.items() if k not in _PARSED and k not in _NOISE},
        source=source,
    )


def load_hf_dir(path: Path) -> LoadedCheckpoint:
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}/config.json: cannot read model config ({e})") from e
    config = hf_config(raw, path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files next to config.json")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)

    fingerprint = weights_fingerprint(config.fingerprint(), [path / "config.json", *files])
    return LoadedCheckpoint(config, tensors(), fingerprint, path)
