"""Model definitions, one family per file, found by architecture name."""
from __future__ import annotations

from core.registry import Registry

MODELS: Registry = Registry("model architecture", "--model", {
    "llama": "engine.models.llama:LlamaForCausalLM",
    "mistral": "engine.models.mistral:MistralForCausalLM",
    "qwen2": "engine.models.qwen:Qwen2ForCausalLM",
    "qwen3": "engine.models.qwen:Qwen3ForCausalLM",
    "gemma2": "engine.models.gemma:Gemma2ForCausalLM",
    "gemma3": "engine.models.gemma:Gemma3ForCausalLM",
    "phi3": "engine.models.phi3:Phi3ForCausalLM",
    "mixtral": "engine.models.moe:MixtralForCausalLM",
    "qwen3_moe": "engine.models.moe:Qwen3MoeForCausalLM",
})
"""ModelConfig.architecture -> the class that runs it."""

HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""config.json ``architectures[0]`` -> the MODELS entry that runs it."""

HF_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
}
"""config.json ``model_type`` -> MODELS entry, for configs without ``architectures``."""


def resolve_architecture(architectures: list[str] | None, model_type: str | None,
                         source: str) -> str:
    """The MODELS entry for a config.json; ValueError naming the file, the architecture
    and what is supported when none runs it (a model is served exactly or refused)."""
    if architectures:
        arch = architectures[0]
        if arch in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[arch]
    elif model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    raise ValueError(f"{source}: architecture {architectures[0] if architectures else None!r} "
                     f"(model_type {model_type!r}) is not supported; supported: "
                     f"{', '.join(HF_ARCHITECTURES)}")
