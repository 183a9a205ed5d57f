"""Model definitions, one family per file, found by architecture name."""
from __future__ import annotations

from core.registry import Registry

MODELS: Registry = Registry("model architecture", "--model", {
    "llama": "engine.models.llama:LlamaForCausalLM",
})
"""ModelConfig.architecture -> the class that runs it."""
