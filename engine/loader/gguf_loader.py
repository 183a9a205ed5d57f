"""GGUF checkpoints (llama.cpp's format) through the `gguf` package, for the
architectures engine/loader/gguf_arch.py maps onto a family (llama, with Mistral's and
Mixtral's files; qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3).

Tensors come out under their HF checkpoint names and as the HF checkpoint holds them:
llama's Q/K rows, which llama.cpp's converter permutes per head (it interleaves the two
RoPE halves), are unpermuted to HF's rotate-half layout; Gemma's norms lose the 1 the
converter added; stacked experts are split per expert.
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
from engine.loader.gguf_arch import ROPE_FACTOR_NAMES, Meta, gguf_arch, tensor_names

SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1)


def _rope_scaling(m: Meta, arch: str, context: int) -> dict | None:
    """The HF rope_scaling the file's metadata (and Phi-3's factor tensors) describe;
    ValueError naming the key for a scaling Tandem would compute wrongly."""
    kind = m.get("rope.scaling.type")
    factors = {t.name: t for t in m.reader.tensors if t.name in ROPE_FACTOR_NAMES}
    if factors:
        if arch != "phi3" or len(factors) != 2:
            raise ValueError(f"{m.path}: tensors {', '.join(sorted(factors))} (per-dimension "
                             f"rotary factors) are not supported for architecture {arch!r}")
        old_len = int(m.need("rope.scaling.original_context_length"))
        short, long = (np.asarray(factors[n].data, dtype=np.float64).tolist()
                       for n in ROPE_FACTOR_NAMES[::-1])
        scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                   "original_max_position_embeddings": old_len, "factor": context / old_len}
        if m.get("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(m.get("rope.scaling.attn_factor"))
        return scaling
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(m.need("rope.scaling.factor"))}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": float(m.need("rope.scaling.factor")),
                "original_max_position_embeddings":
                    int(m.need("rope.scaling.original_context_length"))}
    raise ValueError(f"{m.path}: {m.prefix}rope.scaling.type is {kind!r}; supported: "
                     f"none, linear, yarn")


def gguf_config(reader: GGUFReader, path: Path) -> ModelConfig:
    """The model config from the file's metadata; ValueError naming the file and the
    architecture or key it cannot take."""
    arch, spec = gguf_arch(reader, path)
    m = Meta(reader, path, arch)
    hidden, heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    m.head_dim = int(m.get("attention.key_length") or m.get("rope.dimension_count")
                     or hidden // heads)
    rot = m.get("rope.dimension_count")
    if rot is not None and int(rot) != m.head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count is {rot}, the heads are "
                         f"{m.head_dim} wide: a partial rotary is not supported")
    num_layers = int(m.need("block_count"))
    family, extra, overrides = spec.config(m, num_layers)
    vocab = m.get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    context = int(m.get("context_length", 2048))
    window = m.get("attention.sliding_window")
    eos = m.raw("tokenizer.ggml.eos_token_id")
    fields = dict(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(m.need("feed_forward_length")),
        num_layers=num_layers, num_heads=heads,
        num_kv_heads=int(m.get("attention.head_count_kv", heads)), head_dim=m.head_dim,
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m.get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(m, arch, context),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in m.tensor_names,
        attention_bias=arch == "llama" and "blk.0.attn_output.bias" in m.tensor_names,
        sliding_window=int(window) if window else None,
        bos_token_id=m.raw("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=str(m.raw("general.name", path.stem)), architecture=family,
        extra={k: v for k, v in extra.items() if v is not None}, source=str(path))
    fields.update(overrides)
    return ModelConfig(**fields)


class _Names:
    """GGUF tensor name -> HF name for one file; ValueError naming the file, the tensor and
    the architecture for a tensor no family layer takes."""

    def __init__(self, reader: GGUFReader, config: ModelConfig, path: Path) -> None:
        self.arch, self.spec = gguf_arch(reader, path)
        self.path = path
        self.names = tensor_names(self.spec, config.num_layers)

    def __call__(self, gguf_name: str) -> str | None:
        """The HF name, or None for a tensor read into the config (rope factors)."""
        if gguf_name in ROPE_FACTOR_NAMES:
            return None
        base, _, suffix = gguf_name.rpartition(".")
        if base not in self.names or suffix not in ("weight", "bias"):
            raise ValueError(f"{self.path}: tensor {gguf_name} has no place in Tandem's "
                             f"{self.arch} architecture")
        return f"{self.names[base]}.{suffix}"

    def shift(self, hf: str) -> float:
        """What the file added to this tensor (Gemma's norms)."""
        return self.spec.norm_shift if hf.endswith("norm.weight") else 0.0

    def unpermute(self, hf: str, arr: np.ndarray, config: ModelConfig) -> np.ndarray:
        if self.spec.permute_qk and hf.endswith("q_proj.weight"):
            return unpermute_qk(arr, config.num_heads)
        if self.spec.permute_qk and hf.endswith("k_proj.weight"):
            return unpermute_qk(arr, config.num_kv_heads)
        return arr


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
    Q/K rows unpermuted like the dequantized tensors, or None when absent (stacked
    experts are never looked up: they stay dense)."""
    names = _Names(reader, config, path)
    by_name = {}
    for t in reader.tensors:
        hf = names(t.name)
        if hf is not None and "{e}" not in hf:
            by_name[hf] = t

    def lookup(name: str) -> tuple[str, np.ndarray] | None:
        t = by_name.get(name)
        if t is None:
            return None
        rows = np.asarray(t.data)
        if rows.ndim == 1:  # an unquantized 1-D tensor: nothing to keep packed
            return t.tensor_type.name, rows
        rows = rows.reshape(int(t.shape[-1]), -1)  # [N, row bytes]
        return t.tensor_type.name, names.unpermute(name, rows, config)

    return lookup


def _weight_digest(path: Path, config: ModelConfig) -> str:
    """The architecture plus a digest of every byte of the file (fingerprint.py)."""
    return weights_fingerprint(config.fingerprint(), [path])


def _checkpoint_tensors(reader: GGUFReader, config: ModelConfig, path: Path
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every tensor of the file, as the HF checkpoint holds it:
    q/k unpermuted, Gemma's norms less the 1 the converter added, stacked experts split."""
    names = _Names(reader, config, path)
    for t in reader.tensors:
        name = names(t.name)
        if name is None:
            continue
        arr = names.unpermute(name, _dequantize(t, path), config)
        arr = np.array(arr, dtype=np.float32)  # a writable copy
        if names.shift(name):
            arr -= names.shift(name)
        if "{e}" in name:  # [E, out, in]: one tensor per expert
            for e in range(arr.shape[0]):
                yield name.replace("{e}", str(e)), torch.from_numpy(arr[e])
        else:
            yield name, torch.from_numpy(arr)


def load_gguf(path: Path) -> LoadedCheckpoint:
    try:
        reader = open_gguf(path)
    except Exception as e:  # the gguf package raises bare ValueErrors on bad magic
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    config = gguf_config(reader, path)
    names = _Names(reader, config, path)
    for t in reader.tensors:  # fail before any work on an unknown tensor or type
        if names(t.name) is not None and t.tensor_type not in SUPPORTED_TYPES:
            _dequantize(t, path)
    return LoadedCheckpoint(config, _checkpoint_tensors(reader, config, path),
                            _weight_digest(path, config), path, reader)
