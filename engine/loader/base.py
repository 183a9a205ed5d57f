"""Pick a loader by what the path is: a .gguf file or an HF directory."""
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


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Raises FileNotFoundError / ValueError naming the path when it is not a model."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"unknown model format: {p} (expected a .gguf file or an HF "
                             "directory with config.json and *.safetensors)")
        from engine.loader.gguf_loader import load_gguf
        return load_gguf(p)
    if (p / "config.json").is_file():
        from engine.loader.hf_loader import load_hf_dir
        return load_hf_dir(p)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        from engine.loader.gguf_loader import load_gguf
        return load_gguf(ggufs[0])
    raise ValueError(f"unknown model format: {p} has no config.json and "
                     f"{'several' if ggufs else 'no'} .gguf files")
