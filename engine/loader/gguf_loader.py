"""GGUF checkpoints (llama.cpp's format) through the `gguf` package.

Q/K projections in llama.cpp files are stored with their rows permuted (the
converter interleaves the two RoPE halves per head); we undo that so the weights
match HF's rotate-half RoPE and an HF checkpoint of the same model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.config import ModelConfig
from core.gguf_file import open_gguf
from engine.loader.base import LoadedCheckpoint
from engine.loader.fingerprint import weights_fingerprint

SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1)

# GGUF tensor name -> HF Llama name ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}; only 'llama' is supported")
    p = f"{arch}."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = int(_field(reader, p + "attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if _field(reader, p + "rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(_field(reader, p + "rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")), num_heads=heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=str(_field(reader, "general.name", path.stem)),
    )


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head row interleave of Q/K weights ([out, in])."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor, path: Path) -> np.ndarray:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"{path}: tensor {tensor.name} has GGUF type {tensor.tensor_type.name}, "
                         f"which Tandem does not load (supported: {names})")
    if tensor.tensor_type == QT.F32:
        arr = np.asarray(tensor.data)
    else:
        arr = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml stores dims fastest-first
    return arr.reshape(shape)


def raw_rows(reader: GGUFReader, config: ModelConfig, path: Path):
    """A lookup HF tensor name -> (GGUF type name, raw block rows [N, row bytes]) with
    Q/K rows unpermuted like the dequantized tensors, or None when absent."""
    by_name = {hf_name(t.name): t for t in reader.tensors if hf_name(t.name)}

    def lookup(name: str) -> tuple[str, np.ndarray] | None:
        t = by_name.get(name)
        if t is None:
            return None
        rows = np.asarray(t.data)
        if rows.ndim == 1:  # an unquantized 1-D tensor: nothing to keep packed
            return t.tensor_type.name, rows
        rows = rows.reshape(int(t.shape[-1]), -1)  # [N, row bytes]
        if name.endswith("q_proj.weight"):
            rows = unpermute_qk(rows, config.num_heads)
        elif name.endswith("k_proj.weight"):
            rows = unpermute_qk(rows, config.num_kv_heads)
        return t.tensor_type.name, rows

    return lookup


def _weight_digest(path: Path, config: ModelConfig) -> str:
    """The architecture plus a digest of every byte of the file (fingerprint.py)."""
    return weights_fingerprint(config.fingerprint(), [path])


def load_gguf(path: Path) -> LoadedCheckpoint:
    try:
        reader = open_gguf(path)
    except Exception as e:  # the gguf package raises bare ValueErrors on bad magic
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    config = gguf_config(reader, path)
    for t in reader.tensors:  # fail before any work on an unsupported type
        if hf_name(t.name) is not None and t.tensor_type not in SUPPORTED_TYPES:
            _dequantize(t, path)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            arr = _dequantize(t, path)
            if name.endswith("q_proj.weight"):
                arr = unpermute_qk(arr, config.num_heads)
            elif name.endswith("k_proj.weight"):
                arr = unpermute_qk(arr, config.num_kv_heads)
            yield name, torch.from_numpy(np.array(arr, dtype=np.float32))  # writable copy

    return LoadedCheckpoint(config, tensors(), _weight_digest(path, config), path, reader)
