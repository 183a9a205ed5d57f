"""What every weight loader returns (the loaders' contract)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from engine.config import ModelConfig


@dataclass
class LoadedCheckpoint:
    """A checkpoint's config and a lazy stream of (HF-style name, tensor) pairs.

    Names follow the HF Llama layout (``model.layers.3.self_attn.q_proj.weight``);
    every loader maps its own names onto these, so the model declares one mapping.
    """

    config: ModelConfig
    tensors: Iterator[tuple[str, torch.Tensor]]
    fingerprint: str
    """Digest of the architecture plus a sample of the weight bytes (for the KV compat record)."""
    path: Path
    reader: Any = None
    """The parsed GGUF file when there is one (its metadata also holds the tokenizer)."""
