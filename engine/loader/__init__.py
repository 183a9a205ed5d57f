"""Weight loaders: a checkpoint on disk -> (ModelConfig, named fp32/bf16 tensors)."""
from __future__ import annotations

from engine.loader.base import LoadedCheckpoint, load_checkpoint

__all__ = ["LoadedCheckpoint", "load_checkpoint"]
