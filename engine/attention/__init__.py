"""Attention backends behind a small registry (see base.py)."""
from __future__ import annotations

from engine.attention.base import AttentionBackend, get_backend
from engine.attention.metadata import AttentionMetadata, build_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "build_metadata", "get_backend"]
