"""Seeded random PEFT LoRA adapters for the test checkpoints, and PEFT's own model as the
reference: ``init_lora_weights=False`` draws B at random too (PEFT's default makes B zero,
an adapter that changes nothing and so tests nothing)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base, root: Path, seed: int, targets: Sequence[str] = ALL_LINEARS,
                 r: int = 8, alpha: int = 16, rslora: bool = False, scale: float = 1.0):
    """Save a random adapter on ``base`` (a transformers model, left unchanged) under root
    and return (root, PEFT's model of base + adapter, fp32, eval). ``scale`` multiplies
    the random weights (the real model needs small ones to stay coherent)."""
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                          use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.mul_(scale)
    model.save_pretrained(root)
    return root, model.eval()


def tiny_adapters(model_dir: Path, root: Path, ranks: dict[str, int]) -> dict[str, Path]:
    """Seeded random adapters of the given ranks on the tiny Llama (tests/utils.py), one
    directory each under root, for the serving tests: name -> path (seeds 1, 2, ...)."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: make_adapter(base, root / name, seed, r=r, alpha=2 * r)[0]
            for seed, (name, r) in enumerate(sorted(ranks.items()), start=1)}
