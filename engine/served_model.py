"""The model an engine serves, loaded: its checkpoint, the fingerprint of its weights as
they run, its context window and its tokenizer (LLMEngine's first steps; a draft model
picks its tokenizer the same way)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from engine.config import LoadConfig, ModelConfig, QuantConfig
from engine.loader import LoadedCheckpoint, load_checkpoint
from engine.quant.base import resolve_method
from core.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 8192


def open_checkpoint(load: LoadConfig) -> LoadedCheckpoint:
    """Raises ValueError when no model is named, and as load_checkpoint does."""
    if not load.model:
        raise ValueError("EngineConfig.model is empty: pass --model PATH "
                         "(tandem fetch-model puts the default model in the cache)")
    return load_checkpoint(load.model)


def served_fingerprint(ckpt: LoadedCheckpoint, quant: QuantConfig) -> str:
    """``architecture/digest``: the checkpoint's fingerprint and how it is quantized (the
    same checkpoint quantized another way gives other KV, so workers running it so must
    not exchange blocks). The readable architecture makes a refused handoff between two
    families say which ones (``model_fingerprint: local 'llama/..' != remote 'qwen2/..'``)."""
    method = resolve_method(quant.quantization, ckpt.reader is not None)
    suffix = "" if method == "none" else f":{method}:{quant.quant_group_size}"
    digest = hashlib.sha256(f"{ckpt.fingerprint}{suffix}".encode()).hexdigest()[:32]
    return f"{ckpt.config.architecture}/{digest}"


def context_window(load: LoadConfig, model: ModelConfig) -> int:
    """--max-model-len, or the model's own capped at DEFAULT_MAX_MODEL_LEN."""
    return load.max_model_len or min(model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def checkpoint_tokenizer(ckpt: LoadedCheckpoint) -> Tokenizer:
    """A GGUF's embedded tokenizer, else the one in the HF directory."""
    if ckpt.reader is not None:
        return Tokenizer.from_gguf(ckpt.reader)
    return Tokenizer.load(Path(ckpt.path))
