"""Shared test factories: the real model's path, and a tiny random Llama on disk.

The tiny model is an HF-style directory (config.json + model.safetensors +
tokenizer.json) built in-process, so scheduler and service tests run in
seconds without real weights and exercise the HF loader too.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

DEFAULT_MODEL = Path.home() / ".cache" / "tandem" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_model_path() -> Path:
    """The embedded SmolLM2 GGUF (TANDEM_MODEL overrides); skips when absent."""
    path = Path(os.environ.get("TANDEM_MODEL") or DEFAULT_MODEL)
    if not path.exists():
        pytest.skip(f"model file {path} is absent (run `tandem fetch-model`)")
    return path


def _byte_level_tokenizer_json(vocab_size: int) -> dict:
    """A byte-level BPE tokenizer with 256 byte tokens, no merges, and specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    return json.loads(tok.to_str())


def train_sentencepiece(texts: list[str], vocab_size: int, *, add_dummy_prefix: bool = True,
                        user_defined: tuple[str, ...] = ()) -> bytes:
    """A SentencePiece BPE model (tokenizer.model bytes) trained in memory on texts, set
    up as Llama 2's and Gemma's are: byte fallback, identity normalization, spaces kept
    as they are, digits split, whitespace-only pieces allowed. Well under a second."""
    import io

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=out, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=list(user_defined),
        num_threads=1, minloglevel=2)
    return out.getvalue()


def make_tiny_llama(root: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, vocab: int = 320, seed: int = 0,
                    tie: bool = True, max_pos: int = 512, embed_scale: float = 0.5,
                    scale: float = 0.08) -> Path:
    """Write a random tiny Llama as an HF directory and return its path. A small
    embed_scale (tied embeddings) flattens its logits, so sampling wanders over every
    token a constraint allows; a larger ``scale`` (the linears' weights) makes attention,
    and so positions, weigh more in its outputs."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    inter = hidden * 2
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": max_pos,
           "tie_word_embeddings": tie, "bos_token_id": 0, "eos_token_id": 0}
    (root / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = scale) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    t = {"model.embed_tokens.weight": rnd(vocab, hidden, scale=embed_scale),
         "model.norm.weight": 1 + rnd(hidden, scale=0.1)}
    if not tie:
        t["lm_head.weight"] = rnd(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + rnd(hidden, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(hidden, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        t[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        t[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
    save_file({k: v.contiguous() for k, v in t.items()}, str(root / "model.safetensors"))
    (root / "tokenizer.json").write_text(json.dumps(_byte_level_tokenizer_json(vocab)))
    write_chat_template(root)
    return root


def write_chat_template(root: Path) -> None:
    """A ChatML-style tokenizer_config.json beside a byte-level tokenizer.json."""
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
         "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                          "assistant\n{% endif %}"}))
