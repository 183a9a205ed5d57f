"""The names behind --attention-backend (torch-free; EngineConfig validates against it,
so `tandem --help` and start-up errors do not wait for torch)."""
from __future__ import annotations

from core.registry import Registry

ATTENTION_BACKENDS: Registry[type] = Registry(  # entries: engine.attention.base.AttentionBackend subclasses
    "attention backend", "--attention-backend", {
        "sdpa": "engine.attention.sdpa:SDPABackend",
        "flash_attn": "engine.attention.flash_attn:FlashAttnBackend",
        "naive": "engine.attention.naive:NaiveBackend",
    })
