"""A test family checkpoint (tests/models/families.py) written as a GGUF file the way
llama.cpp's converter (convert_hf_to_gguf.py) writes one: its tensor names (the `gguf`
package's TensorNameMap), its metadata keys, llama's q/k row permutation, Gemma's
norms stored as w + 1, stacked experts; F32, F16 or Q8_0 matrices (norms, biases and
other 1-D tensors stay F32, as the converter keeps them). A minimal stand-in for the
converter, which is not on PyPI, covering what these tiny checkpoints hold.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
             "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
             "qwen3_moe": "qwen3moe"}
"""Our family -> the general.architecture llama.cpp's converter gives its checkpoints."""

_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: interleave each head's two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(cfg: dict, layer_type: str = "full_attention") -> dict:
    params = cfg.get("rope_parameters") or {}
    params = params.get(layer_type, params)
    return {"rope_theta": cfg.get("rope_theta", params.get("rope_theta", 10000.0)), **params}


def _metadata(w, family: str, cfg: dict) -> None:
    import gguf

    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_name(f"tandem-test-{family}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(_rope(cfg)["rope_theta"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.get("sliding_window") and family in ("mistral", "gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family == "gemma3":
        glob = _rope(cfg)
        if glob.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(glob["factor"])
        w.add_rope_freq_base_swa(float(_rope(cfg, "sliding_attention")["rope_theta"]))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if family == "phi3":  # the converter writes 0 for "no window" (and so Phi-4 apart)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    if family in ("mixtral", "qwen3_moe"):
        w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if family == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _sentencepiece(w, model: Path, vocab_size: int | None, control: Collection[str]) -> None:
    """A SentencePiece tokenizer.model as llama.cpp "llama" metadata, the way the converter
    writes it (_create_vocab_sentencepiece): pieces, scores, token types; user-defined
    pieces in ``control`` become control tokens with score -1000, the others user-defined
    (as a tokenizer_config.json listing them special or not makes them); padded with
    unused [PAD{i}] tokens up to the model's vocabulary."""
    import gguf
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString(model.read_bytes())
    kinds = gguf.TokenType  # numbered as SentencePiece numbers its piece types
    tokens, scores, types = [], [], []
    for p in proto.pieces:
        kind, score = kinds(p.type), p.score
        if kind == kinds.USER_DEFINED:
            kind, score = (kinds.CONTROL if p.piece in control else kinds.USER_DEFINED), -1000.0
        tokens.append(p.piece)
        scores.append(score)
        types.append(kind)
    for i in range(len(tokens), vocab_size or 0):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(kinds.UNUSED)
    spec = proto.trainer_spec
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(spec.bos_id)
    w.add_eos_token_id(spec.eos_id)
    w.add_unk_token_id(spec.unk_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)


def write_tokenizer_gguf(model: Path, out: Path, control: Collection[str] = ()) -> Path:
    """A GGUF holding only a SentencePiece model's vocabulary (no tensors)."""
    import gguf

    w = gguf.GGUFWriter(str(out), "llama")
    _sentencepiece(w, model, None, control)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _tokenizer(w, root: Path, vocab_size: int) -> None:
    """The checkpoint's tokenizer as llama.cpp metadata: a SentencePiece tokenizer.model
    (where the directory has one, as Llama 2's and Mistral's do) as "llama", else
    tokenizer.json's byte-level BPE as "gpt2"."""
    if (root / "tokenizer.model").is_file():
        _sentencepiece(w, root / "tokenizer.model", vocab_size, control=())
        return
    tok = json.loads((root / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tok.get("added_tokens", [])}
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_pad_token_id(0)  # as the converter writes a padding id (transformers' Phi-3 needs one)


def _add(w, name: str, arr: np.ndarray, qtype: str) -> None:
    import gguf
    from gguf.quants import quantize

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.ndim == 1 or qtype == "F32":
        w.add_tensor(name, arr)
    elif qtype == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    else:
        kind = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, quantize(arr, kind), raw_dtype=kind)


def _longrope(w, cfg: dict) -> None:
    """Phi-3's longrope as the converter writes it: the factors as F32 tensors, the
    original context and the cos/sin factor in the metadata."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "longrope":
        return
    old_len = scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / old_len
    w.add_rope_scaling_orig_ctx_len(old_len)
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(old_len)) if scale > 1 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.asarray(scaling["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(scaling["short_factor"], dtype=np.float32))


def write_gguf(root: Path, family: str, out: Path, qtype: str = "F32") -> Path:
    """Convert the HF checkpoint at root (config.json, model.safetensors, tokenizer.json)
    to a GGUF file at out; qtype: F32, F16 or Q8_0 for the 2-D tensors."""
    import gguf

    cfg = json.loads((root / "config.json").read_text())
    arch = GGUF_ARCH[family]
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg["num_hidden_layers"])
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, family, cfg)
    _tokenizer(w, root, cfg["vocab_size"])
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf, arr in sorted(load_file(str(root / "model.safetensors")).items()):
        if (m := _EXPERT.fullmatch(hf)) is not None:
            experts.setdefault((int(m[1]), _EXPERT_KIND[m[3]]), {})[int(m[2])] = arr
            continue
        base, _, suffix = hf.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"no GGUF name for {hf}")
        if arch == "llama" and base.endswith("q_proj"):
            arr = _permute(arr, heads)
        elif arch == "llama" and base.endswith("k_proj"):
            arr = _permute(arr, kv_heads)
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            arr = arr + 1
        _add(w, f"{name}.{suffix}", arr, qtype)
    _longrope(w, cfg)
    for (layer, kind), per_expert in sorted(experts.items()):
        stacked = np.stack([per_expert[e] for e in sorted(per_expert)])  # [E, out, in]
        _add(w, f"blk.{layer}.ffn_{kind}_exps.weight", stacked, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
